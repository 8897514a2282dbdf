"""Gate vs canary on MiniLM: over the routes the tuner evaluates, where the gate passes the canary promotes and
where it rejects the canary pins (INCONCLUSIVE counts as disagreement), judged on the same distribution with the
same tolerance, budget and confidence. Real tuning, real Triton, real sidecar, real Locust (slow)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest.runner import LoadOptions
from loadtest.runner import run as run_locust
from loadtest.synth import SynthSpec, write_synthetic
from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tunegate import models
from tunegate.app.demo import STRICT, capture_spec, spec_path
from tunegate.repository import write_version
from tuner.builders import Artifact, get_builder
from tuner.release import gate_record
from tuner.search import tune

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.timeout(1500)]

# The tuner's MiniLM routes far from the budget on either side (specs/minilm.toml's space);
# int8-matmul sits at 1.2x the budget, where neither side can decide quickly (see README, "The demo").
ROUTES = "-opt=all -fusion=bert -quant=[fp32|int8-channel-keepffn|int8-channel] -threads=1"
REPLAY_RATE = (
    12.0  # requests per second: what the mirror keeps up with on two cores (a saturated one is biased)
)


def _canary(admin: AdminClient, url: str, version: int, traffic: Path, params: dict[str, Any],
            csv: Path) -> dict[str, Any]:  # fmt: skip
    admin.start(models.MINILM, version, **params)

    def decided(_elapsed: float) -> bool:
        return admin.status(models.MINILM)["state"] in ("promoted", "pinned")

    run_locust(LoadOptions(capture=traffic, host=url, users=4, spawn_rate=4, duration_s=params["deadline_s"] + 5,
                           rate=REPLAY_RATE, csv_prefix=csv), progress=decided)  # fmt: skip
    admin.wait_decision(models.MINILM, timeout_s=30)
    record = admin.decisions(models.MINILM)[-1]
    assert record["candidate"] == version
    return dict(record)


def test_where_the_gate_passes_the_canary_promotes_and_where_it_rejects_the_canary_pins(
    tmp_path: Path, demo_repository: Path, triton_factory: Any
) -> None:
    capture = tmp_path / "capture"
    write_synthetic(capture / "capture-traffic.jsonl", SynthSpec(model=models.MINILM, requests=600, seed=3))
    spec = capture_spec(spec_path(STRICT), capture, demo_repository, models.minilm_onnx(), tmp_path / "tune")
    spec = spec.with_search(routes=ROUTES)
    # The gate's verdicts are what is compared: no finalists served end to end.
    spec = dataclasses.replace(spec, bench=dataclasses.replace(spec.bench, e2e=False))
    result = tune(spec, progress=False, write=False)
    gated = [r for r in result.routes if r.status in ("passed", "rejected") and r.artifact]
    assert {r.knobs["quant"] for r in gated} == {"fp32", "int8-channel-keepffn", "int8-channel"}
    # Fused fp32 computes what the baseline computes within float rounding: its canary could only agree. The
    # two int8 routes are where gate and canary can disagree, one on each side of the budget.
    judged = [r for r in gated if r.knobs["quant"] != "fp32"]

    builder = get_builder("onnxruntime")
    versions = {}
    for r in judged:
        files = builder.version_files(Artifact.load(Path(r.artifact or "")))
        release = {
            "route": r.route,
            "tolerance": spec.tolerance.to_dict(),
            "gate": gate_record(spec, r.accuracy or {}),
        }
        versions[r.route] = write_version(demo_repository, models.MINILM, files, release=release)

    triton = triton_factory(demo_repository, models=(models.MINILM,))
    token = "agreement-token-" + "x" * 16
    token_file = write_token_file(tmp_path / "admin.token", token)
    g = spec.gate
    # As the demo: every request compared, none dropped. The gate judges outputs only, so the canary's latency
    # bar is lowered out of the way (fused fp32 is within noise of the baseline's speed on two busy cores).
    params = {"oot_budget": g.oot_budget, "confidence": g.confidence, "min_samples": 300, "deadline_s": 150.0,
              "sample_rate": 1.0, "latency_pairing": "primary", "required_speedup": 0.5}  # fmt: skip
    rows = []
    with SidecarProcess(upstream=triton.http_url, state_dir=tmp_path / "sidecar", repository=demo_repository,
                        token_file=token_file, extra_args=("--retain-versions", "0")) as sidecar:  # fmt: skip
        admin = AdminClient(sidecar.url, token)
        for r in judged:
            t0 = time.monotonic()
            rec = _canary(admin, sidecar.url, versions[r.route], capture / "capture-traffic.jsonl", params,
                          tmp_path / "locust" / r.knobs["quant"])  # fmt: skip
            ev = rec.get("evidence", {})
            expected = "promote" if r.status == "passed" else "pin"
            rows.append({"route": r.knobs["quant"], "gate": r.status, "gate_k": (r.accuracy or {})["rate"]["k"],
                         "gate_n": (r.accuracy or {})["rate"]["n"], "canary": rec["outcome"],
                         "canary_oot": ev.get("out_of_tolerance"), "canary_compared": ev.get("compared"),
                         "agree": rec["outcome"] == expected, "seconds": round(time.monotonic() - t0, 1),
                         "reasons": rec.get("reasons", [])})  # fmt: skip
            if rec["outcome"] == "promote":  # back to the baseline for the next route
                admin.rollback(models.MINILM, to=1, reason="next route of the agreement test")
                deadline = time.monotonic() + 60
                while admin.status(models.MINILM)["live"] != 1 and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert admin.status(models.MINILM)["live"] == 1

    agreement = sum(r["agree"] for r in rows) / len(rows)
    report = json.dumps({"agreement": agreement, "routes": rows}, indent=1)
    print(report)
    (tmp_path / "agreement.json").write_text(report)
    assert {r["gate"] for r in rows} == {"passed", "rejected"}, report  # both sides of the gate are exercised
    assert agreement == 1.0, report
