"""config.pbtxt read and written through Triton's protobuf, on the configs Triton's model-configuration docs show."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from tunegate import pbtxt
from tunegate.repository import parse_version_policy, set_version_policy

DOCS_CONFIGS = {
    "tensorrt": """
platform: "tensorrt_plan"
max_batch_size: 8
input [
  {
    name: "input0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  },
  {
    name: "input1"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "output0"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
""",
    "onnx-named-first": """
name: "mymodel"   # the model's name
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
""",
    "policy-all": 'name: "m"\nversion_policy: { all { }}\n',
    "policy-latest": 'name: "m"\nversion_policy: { latest: { num_versions: 2 } }\n',
    "policy-specific-repeated": 'name: "m"\nversion_policy: { specific { versions: 1 versions: 2 } }\n',
    "policy-specific-list": 'name: "m"\nversion_policy: { specific: { versions: [1, 3] } }\n',
    "policy-angle": "name: 'm'\nversion_policy < specific < versions: 4 > >\n",
    "dynamic-batching": """
name: "batched"
max_batch_size: 16
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
}
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
""",
    "sequence": """
name: "seq"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] }
  ]
}
""",
    "ensemble": """
name: "ens"
platform: "ensemble"
max_batch_size: 1
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "pre" model_version: -1 input_map { key: "x" value: "IN" } output_map { key: "y" value: "mid" } },
    { model_name: "net" model_version: -1 input_map { key: "x" value: "mid" } output_map { key: "y" value: "OUT" } }
  ]
}
""",
    "python-with-parameters": """
name: "py"
backend: "python"
parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }
model_transaction_policy { decoupled: true }
""",
}
EXPECTED_POLICY = {"policy-specific-repeated": (1, 2), "policy-specific-list": (1, 3), "policy-angle": (4,)}


@pytest.mark.parametrize("key", DOCS_CONFIGS)
def test_every_docs_config_reads_and_edits_to_exactly_the_intended_change(key: str) -> None:
    text = DOCS_CONFIGS[key]
    before = pbtxt.parse(text)
    assert parse_version_policy(text) == EXPECTED_POLICY.get(key)

    edited = set_version_policy(text, [5, 7])
    after = pbtxt.parse(edited)
    assert parse_version_policy(edited) == (5, 7)
    before.version_policy.Clear()
    before.version_policy.specific.versions.extend([5, 7])
    assert after == before  # nothing else changed

    renamed = pbtxt.with_name(edited, "m__canary")
    again = pbtxt.parse(renamed)
    assert again.name == "m__canary"
    again.name = before.name
    assert again == before
    # Round trip through the protobuf's own text form.
    assert pbtxt.parse(text_format.MessageToString(after)) == after


def test_an_edit_keeps_comments_and_layout() -> None:
    text = '# served by the canary\nname: "m"  # keep me\nversion_policy: { specific { versions: 1 versions: 2 } }\nmax_batch_size: 4\n'
    edited = set_version_policy(text, [2])
    assert edited == (
        '# served by the canary\nname: "m"  # keep me\nversion_policy: { specific: { versions: [ 2 ] } }\n'
        "max_batch_size: 4\n"
    )
    assert pbtxt.with_name(edited, "m__canary").startswith(
        '# served by the canary\nname: "m__canary"  # keep me\n'
    )


def test_a_policy_is_added_when_missing_and_a_nested_name_is_not_taken_for_the_models() -> None:
    text = 'input [\n  {\n    name: "x"\n    data_type: TYPE_FP32\n    dims: [ 4 ]\n  }\n]\nname: "m"\n'
    assert parse_version_policy(set_version_policy(text, [3])) == (3,)
    renamed = pbtxt.parse(pbtxt.with_name(text, "other"))
    assert renamed.name == "other" and renamed.input[0].name == "x"


def test_unknown_fields_are_skipped_and_invalid_text_is_a_clear_error() -> None:
    text = 'name: "m"\nsome_future_field: { knob: 3 }\nversion_policy: { specific: { versions: [2] } }\n'
    assert parse_version_policy(text) == (2,)
    assert "some_future_field" in set_version_policy(text, [3])
    with pytest.raises(pbtxt.ConfigTextError, match="not valid protobuf text"):
        parse_version_policy('name: "m"\nversion_policy: { specific: { versions: [1 }\n')
    with pytest.raises(ValueError):  # callers that catch ValueError keep working
        parse_version_policy("max_batch_size: many")
