"""Gate vs canary on MiniLM: where the tuner's gate passes a route the canary should promote it, and where the
gate rejects one the canary should pin it, judged on the same distribution with the same tolerance, budget
and confidence. Real tuning, the embedded Triton, a sidecar process and Locust; INCONCLUSIVE counts as a
disagreement.

The two int8 routes of specs/minilm.toml are canaried, one on each side of the budget (fused fp32 computes
what the baseline computes within float rounding: its canary could only agree). The demo's two scenarios
make the same two claims end to end (tests/test_demo.py); this measures them side by side, `--rounds`
times, and prints each route's gate and canary figures.

    .venv/bin/python benchmarks/gate_canary_agreement.py [--rounds 1] [--json out.json]

About 8 minutes a round on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtest.runner import LoadOptions
from loadtest.runner import run as run_locust
from loadtest.synth import SynthSpec, write_synthetic
from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tunegate import models
from tunegate.app.demo import STRICT, capture_spec, spec_path
from tunegate.repository import write_version
from tunegate.triton import EmbeddedTriton, TritonOptions
from tuner.builders import Artifact, get_builder
from tuner.release import gate_record
from tuner.search import tune

ROUTES = "-opt=all -fusion=bert -quant=[fp32|int8-channel-keepffn|int8-channel] -threads=1"
REPLAY_RATE = (
    12.0  # requests per second: what the mirror keeps up with on two cores (a saturated one is biased)
)
TOKEN = "agreement-token-" + "x" * 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def canary(
    admin: AdminClient, url: str, version: int, traffic: Path, params: dict[str, Any], csv: Path
) -> dict[str, Any]:
    admin.start(models.MINILM, version, **params)

    def decided(_elapsed: float) -> bool:
        return admin.status(models.MINILM)["state"] in ("promoted", "pinned")

    run_locust(LoadOptions(capture=traffic, host=url, users=4, spawn_rate=4, duration_s=params["deadline_s"] + 5,
                           rate=REPLAY_RATE, csv_prefix=csv), progress=decided)  # fmt: skip
    admin.wait_decision(models.MINILM, timeout_s=30)
    record = admin.decisions(models.MINILM)[-1]
    assert record["candidate"] == version
    return dict(record)


def one_round(work: Path, seed: int) -> list[dict[str, Any]]:
    repo = models.copy_repository(work / "repo", [models.MINILM], models.minilm_onnx())
    capture = work / "capture"
    write_synthetic(
        capture / "capture-traffic.jsonl", SynthSpec(model=models.MINILM, requests=600, seed=seed)
    )
    spec = capture_spec(spec_path(STRICT), capture, repo, models.minilm_onnx(), work / "tune").with_search(
        routes=ROUTES
    )
    # The gate's verdicts are what is compared: no finalists served end to end.
    spec = dataclasses.replace(spec, bench=dataclasses.replace(spec.bench, e2e=False))
    log(f"tuning {ROUTES}")
    result = tune(spec, progress=False, write=False)
    judged = [
        r
        for r in result.routes
        if r.status in ("passed", "rejected") and r.artifact and r.knobs["quant"] != "fp32"
    ]
    builder = get_builder("onnxruntime")
    versions = {}
    for r in judged:
        files = builder.version_files(Artifact.load(Path(r.artifact or "")))
        release = {
            "route": r.route,
            "tolerance": spec.tolerance.to_dict(),
            "gate": gate_record(spec, r.accuracy or {}),
        }
        versions[r.route] = write_version(repo, models.MINILM, files, release=release)

    triton = EmbeddedTriton(TritonOptions(repository=repo, models=(models.MINILM,)), workdir=work / "triton")
    triton.start()
    g = spec.gate
    # As the demo: every request compared, none dropped. The gate judges outputs only, so the canary's latency
    # bar is lowered out of the way.
    params = {"oot_budget": g.oot_budget, "confidence": g.confidence, "min_samples": 300, "deadline_s": 150.0,
              "sample_rate": 1.0, "latency_pairing": "primary", "required_speedup": 0.5}  # fmt: skip
    rows = []
    try:
        token_file = write_token_file(work / "admin.token", TOKEN)
        with SidecarProcess(upstream=triton.http_url, state_dir=work / "sidecar", repository=repo,
                            token_file=token_file, extra_args=("--retain-versions", "0")) as sidecar:  # fmt: skip
            admin = AdminClient(sidecar.url, TOKEN)
            for r in judged:
                t0 = time.monotonic()
                log(f"canary of {r.knobs['quant']} (gate: {r.status})")
                rec = canary(admin, sidecar.url, versions[r.route], capture / "capture-traffic.jsonl", params,
                             work / "locust" / r.knobs["quant"])  # fmt: skip
                ev = rec.get("evidence", {})
                rate = (r.accuracy or {})["rate"]
                expected = "promote" if r.status == "passed" else "pin"
                rows.append({"route": r.knobs["quant"], "gate": r.status, "gate_k": rate["k"], "gate_n": rate["n"],
                             "gate_upper": rate["upper"], "canary": rec["outcome"],
                             "canary_oot": ev.get("out_of_tolerance"), "canary_compared": ev.get("compared"),
                             "agree": rec["outcome"] == expected, "seconds": round(time.monotonic() - t0, 1),
                             "reasons": rec.get("reasons", [])})  # fmt: skip
                if rec["outcome"] == "promote":  # back to the baseline for the next route
                    admin.rollback(models.MINILM, to=1, reason="next route of the agreement benchmark")
                    deadline = time.monotonic() + 60
                    while admin.status(models.MINILM)["live"] != 1 and time.monotonic() < deadline:
                        time.sleep(0.5)
    finally:
        triton.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="tunegate-agreement-") as tmp:
            rows += [{"round": i, **r} for r in one_round(Path(tmp), seed=3 + i)]
    agreement = sum(r["agree"] for r in rows) / len(rows) if rows else 0.0
    print(
        f"{'round':>5} {'route':<22} {'gate':<9} {'gate k/n':>9} {'upper':>7} {'canary':<8} {'canary k/n':>10} {'s':>6}"
    )
    for r in rows:
        print(f"{r['round']:>5} {r['route']:<22} {r['gate']:<9} {r['gate_k']:>4}/{r['gate_n']:<4} "
              f"{100 * r['gate_upper']:>6.2f}% {r['canary']:<8} {r['canary_oot'] or 0:>5}/{r['canary_compared'] or 0:<4} "
              f"{r['seconds']:>6.0f}")  # fmt: skip
    print(f"agreement {agreement:.2f} over {len(rows)} canaries")
    if args.json:
        args.json.write_text(json.dumps({"agreement": agreement, "rows": rows}, indent=1) + "\n")
    return 0 if agreement == 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
