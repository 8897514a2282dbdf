"""A short run of the coverage-guided fuzzer (tests/fuzz_codec.py, atheris) from a seed corpus of valid inputs:
no input may end in anything but the parsers' own InputError."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tunegate import codec
from tunegate.capture import CaptureRecord, write_capture_file

ROOT = Path(__file__).resolve().parent.parent
RUNS = 20_000


def seeds(corpus: Path) -> None:
    x = {"x": np.arange(8, dtype=np.float32).reshape(2, 4), "ids": np.array([[1, 2, 3]], dtype=np.int64)}
    json_body, _ = codec.encode_request(x, binary=False)
    bin_body, hl = codec.encode_request(x, binary=True)
    resp, rhl = codec.encode_response({"y": np.ones((2, 4), np.float32)}, binary=True, model_name="m")
    capture_file = corpus.parent / "capture-seed.jsonl"
    write_capture_file(capture_file, [CaptureRecord(1.0, "m", None, bin_body, hl)])
    items = {
        "json": bytes([0, 0]) + json_body,  # target 0, no header length
        "binary": bytes([0, 1, hl or 0]) + bin_body,
        "response": bytes([0, 1, rhl or 0]) + resp,
        "class": bytes([1]) + json_body,
        "pbtxt": bytes([2])
        + b'name: "m"\nmax_batch_size: 8\nversion_policy: { specific { versions: 1 versions: 2 } }\n'
        b'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n',
        "capture": bytes([3]) + capture_file.read_text().splitlines()[0].encode(),
    }
    for name, data in items.items():
        (corpus / name).write_bytes(data)


def test_the_parsers_hold_against_coverage_guided_inputs(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seeds(corpus)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fuzz_codec.py"), f"-atheris_runs={RUNS}", "-max_len=4096",
         str(corpus)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    tail = proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    assert not list(tmp_path.glob("crash-*")), tail
    assert "Done" in proc.stderr or "DONE" in proc.stderr, tail
