"""The whole loop on the embedded default, in production's order: live traffic -> capture -> tune -> canary.

1. Triton serves the baseline (version 1) only; the sidecar sits in front of it with capture on and no
   canary. Locust plays the clients, replaying synthetic "live traffic" (loadtest.synth: real
   sentences, the long-tailed batch mix) through the sidecar, which writes what it saw to its capture.
2. The tuner tunes on the sidecar's capture (the scenario's spec with `[inputs] source = "capture"`):
   every captured request is one sample of the gate's out-of-tolerance rate.
3. The sidecar starts the canary of the winner; Locust replays fresh traffic from the same
   distribution until the judge decides.

Every run works in its own directory (a private copy of model_repository/, the traffic files, the
sidecar's capture, state and decision records, the tuner's cache and report, Locust's stats, the
canary report), so the committed repository is never changed and runs never interfere.

Scenarios (the margins behind them are in README.md, "The demo", and the specs' comments):
  good  the strict spec (specs/minilm.toml): its gate admits a faster route whose out-of-tolerance rate
        is far below the budget -> the canary PROMOTEs it.
  bad   the loose spec (specs/minilm-loose.toml) admits a route that breaks the strict per-request
        tolerance many times more often than the budget allows; the canary judges live traffic with the
        strict spec's tolerance and budget, as production would -> PIN.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.runner import LoadOptions, LoadTestError
from loadtest.runner import run as run_locust
from loadtest.synth import SynthSpec, write_synthetic
from sidecar.client import AdminClient, AdminError, SidecarProcess, write_token_file
from tunegate import models, project
from tunegate.app.canary_report import write_canary_report
from tunegate.errors import ServiceError
from tunegate.triton import EmbeddedTriton, TritonOptions
from tuner.cache import CacheError
from tuner.inputs import InputsError
from tuner.routes import RouteError
from tuner.search import TuneError, tune
from tuner.spec import SpecError, TuneSpec, load_spec, parse_spec

SPECS = {"good": "minilm.toml", "bad": "minilm-loose.toml"}  # in the project's specs/ (tunegate.project)
STRICT = "minilm.toml"


def spec_path(name: str) -> Path:
    return project.specs_dir() / name


CAPTURE_MARGIN = 1.15  # live traffic sent before tuning, per captured request the gate uses


class DemoError(ServiceError):
    """A step of the demo failed; the message says which and where its logs are."""


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    scenario: str = "good"
    run_dir: Path | None = None
    cache: Path | None = None
    tune_budget_s: float | None = None  # None: the spec's budget
    capture_s: float = (
        120.0  # longest live replay before tuning; stops once the capture holds the gate's samples
    )
    load_s: float = 150.0  # longest Locust replay of the canary; stops early once the canary decides
    users: int = 6
    # Live traffic during the canary, requests per second: what the mirror keeps up with on two cores.
    # A saturated mirror drops copies, and the ones it keeps are biased toward slow (large) requests.
    canary_rate: float = 10.0
    min_samples: int = 300
    deadline_s: float = 140.0
    sample_rate: float = 1.0
    # Share of requests allowed outside the strict per-request tolerance, above the A/A noise floor.
    # None: the strict spec's [gate].oot_budget, so the canary and the gate judge by the same budget
    # (and confidence).
    oot_budget: float | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.scenario not in SPECS:
            raise ValueError(f"scenario must be one of {', '.join(SPECS)}, got {self.scenario!r}")
        if (
            self.users < 1
            or self.load_s <= 0
            or self.deadline_s <= 0
            or self.min_samples < 1
            or self.capture_s <= 0
            or self.canary_rate <= 0
        ):
            raise ValueError(
                "users, capture_s, load_s, canary_rate, deadline_s and min_samples must be positive"
            )
        if self.oot_budget is not None and not 0.0 < self.oot_budget < 1.0:
            raise ValueError(f"oot_budget must be within (0, 1), got {self.oot_budget}")


Step = Callable[[str], None]


def _default_run_dir(scenario: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return project.project_root() / ".tunegate" / "runs" / f"{stamp}-{scenario}"


def captured_requests(directory: Path) -> int:
    """Requests the sidecar has written to its capture so far (one JSON line each)."""
    n = 0
    for p in sorted(directory.glob("capture-*.jsonl")):
        try:
            with open(p, "rb") as f:
                n += sum(1 for line in f if line.endswith(b"\n"))
        except OSError:
            continue
    return n


def capture_spec(
    spec_path: Path, capture_dir: Path, repository: Path, source: Path, workdir: Path
) -> TuneSpec:
    """The scenario's spec, tuning on the sidecar's capture (as a tuner next to production would)."""

    raw = tomllib.loads(spec_path.read_text())
    inputs = dict(raw.get("inputs", {}))
    for key in (
        "shapes",
        "values",
        "seed",
        "edge_cases",
    ):  # declared-distribution keys: the capture replaces them
        inputs.pop(key, None)
    inputs.update(source="capture", capture=str(capture_dir))
    raw["inputs"] = inputs
    raw["model"] = {**raw["model"], "source": str(source), "repository": str(repository)}
    raw["objective"] = {k: v for k, v in raw.get("objective", {}).items() if k != "batch_sizes"}
    # The canary serves the winner through the same Triton right after; the tuner's own finalist check
    # through a second embedded Triton is left out to keep the demo short.
    raw["bench"] = {**raw.get("bench", {}), "e2e": False}
    raw["output"] = {"workdir": str(workdir)}
    return parse_spec(raw, spec_path)


def run_demo(opts: DemoOptions, step: Step = lambda _msg: None) -> dict[str, Any]:
    """Run the loop; returns a JSON-able summary (decision, evidence, gate vs canary, timings, paths)."""

    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(name: str, since: float) -> float:
        now = time.monotonic()
        timings[name] = round(now - since, 2)
        return now

    run_dir = Path(opts.run_dir or _default_run_dir(opts.scenario)).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    step(f"run directory {run_dir}")

    step("preparing the demo model (the first run exports MiniLM to ONNX)")
    onnx = models.minilm_onnx(opts.cache)
    repo = run_dir / "model_repository"
    if not repo.exists():
        models.copy_repository(repo, [models.MINILM], onnx, src=project.repository())
    t = mark("prepare", t0)

    capture_dir = run_dir / "capture"
    try:
        strict = load_spec(spec_path(STRICT))
        spec = capture_spec(spec_path(SPECS[opts.scenario]), capture_dir, repo, onnx, run_dir / "tune")
    except SpecError as exc:
        raise DemoError(f"cannot load the demo's tuning spec: {exc}") from exc
    budget = opts.oot_budget if opts.oot_budget is not None else strict.gate.oot_budget
    samples = spec.gate.samples

    traffic = run_dir / "traffic"
    before = traffic / "live-before-tuning.jsonl"
    after = traffic / "live-canary.jsonl"
    write_synthetic(
        before, SynthSpec(model=models.MINILM, requests=int(samples * CAPTURE_MARGIN) + 20, seed=0)
    )
    write_synthetic(after, SynthSpec(model=models.MINILM, requests=3000, seed=1))
    sidecar_cfg = run_dir / "sidecar.toml"
    # Every request is captured: the sidecar's default rate cap (50/s) would thin out a fast replay.
    sidecar_cfg.write_text(
        f'capture_dir = "{capture_dir}"\ncapture_rate = 1.0\ncapture_max_per_second = 10000.0\n'
    )

    triton = EmbeddedTriton(
        TritonOptions(repository=repo, models=(models.MINILM,)), workdir=run_dir / "triton"
    )
    step("starting the embedded Triton (the baseline, version 1, only)")
    triton.start()
    try:
        t = mark("triton_ready", t)
        token = secrets.token_urlsafe(24)
        token_file = write_token_file(run_dir / "admin.token", token)
        step("starting the sidecar in front of it (capture on, no canary)")
        with SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address, state_dir=run_dir / "sidecar", repository=repo,
                            token_file=token_file, extra_args=("--config", str(sidecar_cfg))) as sidecar:  # fmt: skip
            admin = AdminClient(sidecar.url, token)
            step(f"live traffic: Locust replays {before.name} through the sidecar until it has captured "
                 f"{samples} requests")  # fmt: skip

            def captured_enough(_elapsed: float) -> bool:
                return captured_requests(capture_dir) >= samples

            try:
                live = run_locust(
                    LoadOptions(capture=before, host=sidecar.url, users=opts.users, spawn_rate=opts.users,
                                duration_s=opts.capture_s, csv_prefix=run_dir / "locust" / "live"),
                    progress=captured_enough,
                )  # fmt: skip
            except LoadTestError as exc:
                raise DemoError(f"the live traffic replay failed: {exc}") from exc
            n_captured = captured_requests(capture_dir)
            step(f"the sidecar captured {n_captured} requests ({live.total.requests} sent, "
                 f"{live.total.failures} failed, {live.total.rps:.0f} req/s)")  # fmt: skip
            t = mark("live_capture", t)

            step(
                f"tuning {spec.model.name} on the capture ({spec.search.strategy} search, routes {spec.search.routes}; "
                f"gate: out-of-tolerance upper bound <= {100 * spec.gate.oot_budget:g}% over {samples} requests)"
            )
            try:
                result = tune(spec, budget_s=opts.tune_budget_s, progress=opts.progress)
            except (TuneError, CacheError, InputsError, RouteError, SpecError) as exc:
                raise DemoError(f"tuning failed: {exc}") from exc
            t = mark("tune", t)
            for r in result.routes:
                rate = (r.accuracy or {}).get("rate")
                if rate:
                    step(
                        f"  gate {r.status:8s} {r.route}: {rate['k']}/{rate['n']} out of tolerance, upper bound "
                        f"{100 * rate['upper']:.2f}% vs {100 * rate['budget']:g}%"
                        + (f", {r.speedup:.2f}x" if r.speedup is not None else "")
                        + (f" (>= {r.speedup_lower:.2f}x)" if r.speedup_lower is not None else "")
                    )
            gate_rate = dict((result.winner.accuracy or {}).get("rate") or {}) if result.winner else {}
            summary: dict[str, Any] = {
                "scenario": opts.scenario,
                "run_dir": str(run_dir),
                "capture": {"dir": str(capture_dir), "requests": n_captured, "live_load": live.to_dict()},
                "tune": {k: v for k, v in result.summary().items() if k not in ("routes", "e2e", "baseline")},
                "tune_report": str(result.report_path),
                "gate": gate_rate,
                "gate_routes": [
                    {
                        "route": r.route,
                        "status": r.status,
                        "speedup": r.speedup,
                        "speedup_lower": r.speedup_lower,
                        "rate": (r.accuracy or {}).get("rate"),
                    }
                    for r in result.routes
                ],
            }
            if result.version is None:
                summary.update(decision=None, reason=f"no candidate: {result.reason}", seconds={**timings,
                               "total": round(time.monotonic() - t0, 2)})  # fmt: skip
                return summary

            # Latency paired with the client's own request: with two cores, a shadow copy of the baseline for
            # every sample halves what the mirror can compare, and its one-at-a-time slot keeps mostly the
            # slow (large) requests, whose out-of-tolerance rate is higher than the traffic's.
            params: dict[str, Any] = {"min_samples": opts.min_samples, "deadline_s": opts.deadline_s,
                                      "sample_rate": opts.sample_rate, "oot_budget": budget,
                                      "confidence": strict.gate.confidence, "latency_pairing": "primary"}  # fmt: skip
            if opts.scenario == "bad":
                # Production judges live traffic with the strict tolerance, whatever the tuner admitted.
                params["tolerance"] = strict.tolerance.to_dict()
            step(
                f"canary: {models.MINILM} v{result.version} against the live version, Locust replaying {after.name} "
                f"at {opts.canary_rate:g} req/s (out-of-tolerance budget {100 * budget:g}%)"
            )
            try:
                admin.start(models.MINILM, result.version, **params)
            except AdminError as exc:
                raise DemoError(f"the sidecar refused the canary: {exc}") from exc
            t = mark("canary_started", t)
            timeline: list[dict[str, Any]] = []
            decided = threading.Event()
            last_note = [0.0]

            def poll(elapsed: float) -> bool:
                try:
                    st = admin.status(models.MINILM)
                except AdminError:
                    return False
                canary = st.get("canary")
                if canary is not None:
                    ev = canary.get("evidence") or {}
                    point = {k: ev.get(k) for k in ("compared", "out_of_tolerance", "aa_compared",
                                                    "aa_out_of_tolerance", "sent", "errors", "timeouts")}  # fmt: skip
                elif timeline:  # decided: the canary's evidence is final, the state has changed
                    point = {k: v for k, v in timeline[-1].items() if k not in ("t", "state")}
                else:
                    point = {}
                timeline.append({"t": round(elapsed, 2), "state": st.get("state"), **point})
                if elapsed - last_note[0] >= 15 and point.get("compared"):
                    last_note[0] = elapsed
                    step(f"  {elapsed:.0f}s: {point.get('compared')} compared, {point.get('out_of_tolerance')} out of "
                         f"tolerance")  # fmt: skip
                if st.get("state") in ("promoted", "pinned"):
                    decided.set()
                return decided.is_set()

            try:
                load = run_locust(
                    LoadOptions(capture=after, host=sidecar.url, users=opts.users, spawn_rate=opts.users,
                                duration_s=opts.load_s, rate=opts.canary_rate, csv_prefix=run_dir / "locust" / "locust"),
                    progress=poll,
                )  # fmt: skip
            except LoadTestError as exc:
                raise DemoError(f"the load replay failed: {exc}") from exc
            if not decided.is_set():
                remaining = max(5.0, opts.deadline_s + 10 - (time.monotonic() - t))
                step("load finished; waiting for the judge")
                try:
                    admin.wait_decision(models.MINILM, timeout_s=remaining)
                except AdminError as exc:
                    raise DemoError(str(exc)) from exc
            t_decided = time.monotonic()
            timings["canary_to_decision"] = round(t_decided - t, 2)
            records = admin.decisions(models.MINILM)
            status = admin.status(models.MINILM)
            metrics_text = _fetch(f"{sidecar.url}/metrics")
        record = records[-1] if records else {}
        summary.update(
            decision=record.get("outcome"),
            reasons=record.get("reasons", []),
            decided_by=record.get("decided_by"),
            candidate=result.version,
            live_version=status.get("live"),
            evidence=record.get("evidence", {}),
            canary={
                "oot_budget": budget,
                "confidence": strict.gate.confidence,
                "tolerance": params.get("tolerance") or (result.release or {}).get("tolerance"),
            },
            load=load.to_dict(),
            records=str(run_dir / "sidecar" / "decisions.jsonl"),
            timeline=timeline,
        )

        summary["canary_report"] = str(
            write_canary_report(run_dir / "canary-report.html", summary, metrics_text)
        )
        summary["seconds"] = {**timings, "total": round(time.monotonic() - t0, 2)}
        (run_dir / "summary.json").write_text(
            json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n"
        )
        return summary
    finally:
        triton.stop()


def _fetch(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())
