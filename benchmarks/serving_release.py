"""A serving configuration released end to end on MiniLM: searched, canaried, promoted, rolled back.

1. `tunegate tune-serving` on the demo's traffic (a synthetic capture of the demo's mix): the model's own
   configuration against specs/minilm.toml's [serving] routes, gated and measured in alternating rounds;
   the winner becomes version 2 (version 1's files, a serving configuration in release.json).
2. The embedded Triton and a sidecar process; Locust replays fresh traffic through the sidecar while the
   canary of version 2 runs to the judge's decision (default judge, latency paired with the client's request).
3. If promoted: Triton's loaded config for `minilm` has the new instance count; then, with Locust still
   replaying, a rollback to version 1, after which the loaded config is version 1's again. Every client
   request of both replays is counted; a failed one is a failure of the release.

    .venv/bin/python benchmarks/serving_release.py [--json out.json]

About 6 minutes on two cores. Exit 0 when a configuration won, was promoted, and was rolled back with no failed
client request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
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
from tunegate.triton import EmbeddedTriton, TritonOptions
from tuner.serving import tune_serving

TOKEN = "serving-release-token-" + "x" * 16
RATE = 10.0  # requests per second through the sidecar: what the mirror compares in full on two cores


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loaded_instances(triton: EmbeddedTriton, model: str) -> int:
    with urllib.request.urlopen(f"{triton.http_url}/v2/models/{model}/config", timeout=10) as r:
        return int(sum(g["count"] for g in json.loads(r.read())["instance_group"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--deadline-s", type=float, default=240.0, help="the canary's deadline")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tunegate-serving-release-") as tmp:
        work = Path(tmp)
        repo = models.copy_repository(work / "repo", [models.MINILM], models.minilm_onnx())
        capture = work / "capture"
        write_synthetic(
            capture / "capture-traffic.jsonl", SynthSpec(model=models.MINILM, requests=600, seed=5)
        )
        traffic = work / "traffic.jsonl"
        write_synthetic(traffic, SynthSpec(model=models.MINILM, requests=3000, seed=6))
        spec = capture_spec(spec_path(STRICT), capture, repo, models.minilm_onnx(), work / "tune")
        log(f"serving search: {spec.serving.routes} at concurrency {list(spec.serving.concurrency)}")
        t0 = time.monotonic()
        result, version, _path = tune_serving(spec, note=log)
        out["search"] = {
            **result.to_dict(),
            "written_version": version,
            "wall_s": round(time.monotonic() - t0, 1),
        }
        for r in result.routes:
            log(f"  {r.route}: {r.status}, throughput {[round(t, 1) for t in r.throughput]}, ratios "
                f"{[round(x, 2) for x in r.ratios]}")  # fmt: skip
        log(result.reason)
        if version is None:
            print(json.dumps(out, indent=1))
            return 1

        triton = EmbeddedTriton(
            TritonOptions(repository=repo, models=(models.MINILM,)), workdir=work / "triton"
        )
        triton.start()
        try:
            token_file = write_token_file(work / "admin.token", TOKEN)
            with SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address, state_dir=work / "sidecar",
                                repository=repo, token_file=token_file) as sidecar:  # fmt: skip
                admin = AdminClient(sidecar.url, TOKEN)
                before = loaded_instances(triton, models.MINILM)
                admin.start(
                    models.MINILM, version, min_samples=300, deadline_s=args.deadline_s, sample_rate=1.0
                )

                def decided(_elapsed: float) -> bool:
                    return admin.status(models.MINILM)["state"] in ("promoted", "pinned")

                t1 = time.monotonic()
                canary_load = run_locust(LoadOptions(capture=traffic, host=sidecar.url, users=4, spawn_rate=4,
                                                     duration_s=args.deadline_s + 10, rate=RATE,
                                                     csv_prefix=work / "locust" / "canary"), progress=decided)  # fmt: skip
                rec = admin.wait_decision(models.MINILM, timeout_s=30)
                record = admin.decisions(models.MINILM)[-1]
                out["canary"] = {"outcome": record["outcome"], "reasons": record["reasons"],
                                 "seconds": round(time.monotonic() - t1, 1),
                                 "compared": record.get("evidence", {}).get("compared"),
                                 "throughput": record.get("evidence", {}).get("throughput"),
                                 "load": canary_load.to_dict()}  # fmt: skip
                log(f"canary: {record['outcome']} ({'; '.join(record['reasons'])})")
                out["instances"] = {
                    "before": before,
                    "after_promotion": loaded_instances(triton, models.MINILM),
                }
                if rec.get("state") != "promoted":
                    print(json.dumps(out, indent=1, default=str))
                    return 1
                rolled: dict[str, Any] = {}

                def roll_back_midway(elapsed: float) -> bool:
                    if elapsed >= 8 and not rolled:
                        rolled["status"] = admin.rollback(models.MINILM, reason="serving release benchmark")
                        rolled["at"] = round(elapsed, 1)
                    return elapsed >= 25

                rb_load = run_locust(LoadOptions(capture=traffic, host=sidecar.url, users=4, spawn_rate=4,
                                                 duration_s=40, rate=RATE, csv_prefix=work / "locust" / "rollback"),
                                     progress=roll_back_midway)  # fmt: skip
                out["rollback"] = {"live": admin.status(models.MINILM)["live"], "load": rb_load.to_dict(),
                                   "at_s": rolled.get("at")}  # fmt: skip
                out["instances"]["after_rollback"] = loaded_instances(triton, models.MINILM)
        finally:
            triton.stop()
    failures = out["canary"]["load"]["failures"] + out["rollback"]["load"]["failures"]
    ok = (
        failures == 0
        and out["rollback"]["live"] == 1
        and out["instances"]["after_promotion"] != out["instances"]["before"]
        and out["instances"]["after_rollback"] == out["instances"]["before"]
    )
    out["ok"] = ok
    s = out["search"]
    print(f"search: {s['reason']} ({s['wall_s']} s)")
    print(f"canary: {out['canary']['outcome']} after {out['canary']['seconds']} s, {out['canary']['compared']} "
          f"compared; instances {out['instances']['before']} -> {out['instances']['after_promotion']} -> "
          f"{out['instances']['after_rollback']} (after the rollback)")  # fmt: skip
    print(f"client requests: {out['canary']['load']['requests']} during the canary, "
          f"{out['rollback']['load']['requests']} during the rollback; failed: {failures}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
