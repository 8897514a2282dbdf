"""The tuner on the real demo model (slow): fused MiniLM, int8 per-channel rejected by the gate (its share of
requests out of the per-request tolerance is far above the budget), int8 with the FFN down-projections kept fp32
accepted (far below it), written as version 2 and served by the real Triton."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tunegate import models
from tunegate.textdata import Tokenizer
from tuner.builders.ort import ort_runner
from tuner.release import RELEASE_KEYS
from tuner.search import tune
from tuner.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_minilm_int8_is_rejected_keepffn_wins_and_serves_in_triton(
    tmp_path: Path, demo_repository: Path, triton_factory: Any
) -> None:
    raw = tomllib.loads((ROOT / "specs" / "minilm.toml").read_text())
    raw["model"]["repository"] = str(demo_repository)
    raw["output"]["workdir"] = str(tmp_path / "work")
    # Two routes of the shipped spec's space, so the test stays a few minutes on two cores;
    # a modest speed bar, because CI machines are noisy (int8 is well over 1.2x in practice).
    raw["search"]["routes"] = "-opt=all -fusion=bert -quant=[int8-channel-keepffn|int8-channel] -threads=1"
    raw["objective"]["min_speedup"] = 1.0
    raw["bench"].update(repeats=6, e2e_requests=8)
    # 2,000 gate requests: the FFN-kept route misses on 0.5% of the spec's declared requests with AVX512-VNNI
    # but on about 2% on an AVX2 CPU without it, where 500 requests cannot bound that rate under the 4% budget
    # (upper bound 4.7% at 10 of 503); 2,000 bound it near 2.9%.
    raw["gate"]["samples"] = 2000
    spec = parse_spec(raw, ROOT / "specs" / "minilm.toml")

    result = tune(spec, progress=False)

    by_quant = {r.knobs["quant"]: r for r in result.routes}
    rejected, kept = by_quant["int8-channel"], by_quant["int8-channel-keepffn"]
    threshold = spec.tolerance.for_output("embedding").threshold
    budget, n = spec.gate.oot_budget, spec.gate.samples + 3  # the drawn requests and the three edge cases
    assert rejected.status == "rejected", rejected.accuracy
    bad = rejected.accuracy["rate"]
    # rejected by its rate, with margin: even the lower bound is above the budget
    assert bad["n"] == n and bad["lower"] > budget and bad["passed"] is False, bad
    assert (
        rejected.accuracy["outputs"]["embedding"]["value"] < threshold
    )  # its worst request is out of tolerance
    assert kept.status == "passed", kept.accuracy
    good = kept.accuracy["rate"]
    assert good["n"] == n and good["upper"] <= budget and good["rate"] < budget / 1.5, good
    assert kept.accuracy["checks_passed"] is True
    assert (rejected.speedup or 0) > 1.0  # the gate exists for exactly this: faster, and wrong

    assert result.winner is not None and result.winner.knobs["quant"] == "int8-channel-keepffn", result.reason
    assert result.version == 2
    release = json.loads((result.version_path / "release.json").read_text())
    assert set(RELEASE_KEYS) <= set(release)
    assert (release["gate"]["k"], release["gate"]["n"]) == (good["k"], n) and release["gate"][
        "budget"
    ] == budget
    assert release["gate"]["classes"] and sum(release["gate"]["class_counts"].values()) == n
    assert release["builder_notes"]["fused"]["Attention"] == 6
    assert (
        len(release["builder_notes"]["kept_fp32"]) == 12
    )  # layer.0..5: output/dense, attention/output/dense
    assert release["latency"]["triton"]["candidate"]["max_abs_diff_vs_in_process"] == 0.0
    assert (demo_repository / "minilm" / "config.pbtxt").read_text().count("versions: [ 1 ]") == 1

    # The written version, loaded by the real Triton (config override only), serves the in-process outputs.
    server = triton_factory(demo_repository)
    server.load("minilm", config=dataclasses.replace(models.minilm_config(), versions=(2,)).to_json())
    feeds = Tokenizer()(["The gate rejects routes that break the tolerance.", "Short one."])
    runtime = json.loads((result.version_path / "runtime.json").read_text())
    expected = ort_runner(result.version_path / "model.onnx", runtime)(feeds)["embedding"]
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_address)
    try:
        inputs = []
        for name, arr in feeds.items():
            inp = httpclient.InferInput(name, list(arr.shape), "INT64")
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        served = client.infer("minilm", inputs, model_version="2").as_numpy("embedding")
    finally:
        client.close()
    np.testing.assert_array_equal(served, expected)
