"""The search: routes -> build (child process) -> gate -> benchmark -> finalists through Triton -> winner.

`tune(spec)` is the Python API (the CLI and the demo call it). Every finished route is a line in
the cache, so `resume=True` after a kill skips it; the time budget stops the search between (or
during) builds and keeps what finished. "No route beats the baseline within tolerance" is a valid
result: nothing is written and `TuneResult.winner` is None.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegate.procs import TUNE_KILL_AT_ENV, kill_point
from tunegate.repository import clean_staging, parse_version_policy, sha256_file, versions
from tuner import gate
from tuner.bench import bench_paired, bench_runner, objective, speedup, speedup_lower
from tuner.builders import Artifact, BuildContext, Builder, BuildError, get_builder
from tuner.builders.base import Runner, save_batches
from tuner.builders.ort import ort_runner
from tuner.builders.worker import BuildTimeout, run_build
from tuner.cache import SearchCache
from tuner.form import NATIVE_E2E_SKIPPED, Form
from tuner.inputs import InputSet, make_inputs
from tuner.progress import Reporter
from tuner.release import tool_versions
from tuner.report import write_report
from tuner.result import RouteResult, TuneError, TuneResult, route_id
from tuner.routes import Route, fast_routes, full_routes, mixed_routes, parse_space, route_string
from tuner.spec import STRATEGIES, TuneSpec
from tuner.winner import same_as_baseline, serve_finalists, write_winner

LOG = logging.getLogger(__name__)


class _BudgetSpent(Exception):
    pass


def find_baseline(spec: TuneSpec) -> tuple[int, Path]:
    """The version the model serves now (highest in config.pbtxt's specific policy, else the highest).

    A python-backend version has a runtime.json naming its model file and session settings; a native
    onnxruntime one is the model file alone (config.pbtxt's `default_model_filename`, else model.onnx),
    run with the session settings config.pbtxt gives the onnxruntime backend (tuner.form)."""
    model_dir = spec.model.repository / spec.model.name
    config = model_dir / "config.pbtxt"
    if not config.is_file():
        raise TuneError(f"{config} does not exist: the model needs a baseline version in the repository")
    served = parse_version_policy(config.read_text()) or tuple(versions(model_dir))
    present = [v for v in served if (model_dir / str(v)).is_dir()]
    if not present:
        raise TuneError(f"{model_dir}: no baseline version directory (served: {list(served)})")
    v = max(present)
    runtime = Form.read(config).baseline_runtime(model_dir / str(v))
    artifact = model_dir / str(v) / str(runtime.get("artifact", "model.onnx"))
    if not artifact.is_file():
        fix = (
            "run `tunegate model prepare` first: it exports the demo model and installs it as version 1"
            if spec.model.name == "minilm"
            else "put the baseline's model file there"
        )
        raise TuneError(f"{artifact} does not exist (the baseline version {v} has no model file yet); {fix}")
    return v, model_dir / str(v)


def written_before(
    spec: TuneSpec, route: str, baseline_version: int
) -> tuple[int, Path, dict[str, Any]] | None:
    """A version above the baseline whose release.json is this search's winner (same spec digest, route and
    baseline): what a run killed just after writing it left; None when there is none."""
    model_dir = spec.model.repository / spec.model.name
    for v in sorted(versions(model_dir), reverse=True):
        if v <= baseline_version:
            break
        try:
            rel = json.loads((model_dir / str(v) / "release.json").read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(rel, dict) and rel.get("spec_digest") == spec.digest and rel.get("route") == route
                and rel.get("baseline_version") == baseline_version):  # fmt: skip
            return v, model_dir / str(v), rel
    return None


def _tree_digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.name.encode() + b"\0" + sha256_file(p).encode() + b"\0")
    return h.hexdigest()


def run_digests(
    spec: TuneSpec, baseline_dir: Path, versions_info: dict[str, Any], serving: Form
) -> dict[str, str]:
    """A digest of each thing a search's results depend on (tuner.cache.DIGEST_NAMES): `--continue` resumes only
    when all are the same."""
    source = Path(spec.model.source)
    capture = spec.inputs.capture if spec.inputs.source == "capture" else None
    if capture is None:
        inputs = "declared in the spec"
    elif Path(capture).is_dir():
        inputs = _tree_digest(list(Path(capture).glob("capture-*.jsonl")))
    else:
        inputs = sha256_file(Path(capture))
    return {
        "spec": spec.digest,
        "source": sha256_file(source)
        if source.is_file()
        else _tree_digest([p for p in source.rglob("*") if p.is_file()]),
        "baseline": _tree_digest([p for p in baseline_dir.iterdir() if p.is_file()]),
        "inputs": inputs,
        "tools": hashlib.sha256(json.dumps(versions_info, sort_keys=True, default=str).encode()).hexdigest(),
        # A python version's session settings are its runtime.json (in "baseline"); a native one's are config.pbtxt's.
        "serving": hashlib.sha256(
            json.dumps(
                [serving.form, serving.baseline_runtime(baseline_dir) if serving.native else None],
                sort_keys=True,
            ).encode()
        ).hexdigest(),
    }


def reference_runner(spec: TuneSpec) -> Runner:
    """The source model as the spec's [reference] runs it."""
    runtime = {
        "session": {
            "graph_optimization_level": spec.reference.graph_optimization_level,
            "intra_op_num_threads": spec.reference.intra_op_num_threads,
        },
        "config_entries": {"session.intra_op.allow_spinning": "0"},
    }
    return ort_runner(spec.model.source, runtime)


def reference_outputs(spec: TuneSpec, inputs: InputSet) -> gate.Outputs:
    """The reference's outputs for every gate request."""
    return gate.run_all(reference_runner(spec), inputs)


def plan(spec: TuneSpec, strategy: str | None = None) -> dict[str, Any]:
    """What a search would run (no builds): knobs, the space and the routes of the first phase."""
    strategy = strategy or spec.search.strategy
    builder = get_builder(spec.search.backend)
    ok, why = builder.available()
    knobs = builder.route_knobs(spec.search.routes)
    space = parse_space(knobs, spec.search.routes)
    first = fast_routes(knobs, space) if strategy in ("fast", "mixed") else full_routes(knobs, space)
    return {
        "backend": builder.name,
        "available": ok,
        "why": why,
        "strategy": strategy,
        "knobs": [k.to_dict() for k in knobs],
        "space": {k: list(v) for k, v in space.items()},
        "routes": [route_string(r) for r in first],
        "full_size": len(full_routes(knobs, space)),
        "note": {
            "fast": "base route plus one knob changed at a time",
            "full": "Cartesian product of the space",
            "mixed": "these, then the product of the knob values that helped",
            "halving": "all, cheap benchmark; then the best fraction benchmarked longer; finalists through Triton",
        }[strategy],
    }


class _Search:
    """One run of tune(): holds the inputs, reference outputs, cache and deadline."""

    def __init__(
        self,
        spec: TuneSpec,
        serving: Form,
        builder: Builder,
        cache: SearchCache,
        inputs: InputSet,
        reference: gate.Outputs,
        baseline_runner: Runner,
        deadline: float,
        reporter: Reporter,
    ) -> None:
        self.spec, self.builder, self.cache, self.inputs = spec, builder, cache, inputs
        self.reference, self.baseline_runner, self.deadline = reference, baseline_runner, deadline
        self.reporter = reporter
        self.builds = spec.workdir / "builds"
        calib = spec.workdir / "calibration.npz"
        self.ctx = BuildContext(options=spec.search.options, calibration=calib, form=serving.form)
        self.stopped = False

    def build(self, route: Route, dest: Path) -> tuple[Artifact, float]:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _BudgetSpent
        timeout = min(self.spec.search.build_timeout_s, remaining)
        try:
            return run_build(
                self.spec.search.backend,
                self.spec.model.source,
                dict(route),
                dest,
                self.ctx,
                timeout_s=timeout,
            )
        except BuildTimeout:
            if timeout < self.spec.search.build_timeout_s:
                raise _BudgetSpent from None  # the budget ran out mid-build: not a verdict on the route
            raise

    def evaluate(self, route: Route, stage: str, repeats: int) -> RouteResult:
        key = route_string(route)
        cached = self.cache.find("route", key, stage)
        if cached is not None:
            return RouteResult.from_record(cached)
        if time.monotonic() >= self.deadline:
            raise _BudgetSpent
        self.reporter.route(key)
        knobs = dict(route)
        problem = self.builder.route_problem(knobs)
        if problem:
            return self._done(RouteResult(key, knobs, stage, "skipped", error=problem))
        dest = self.builds / route_id(key)
        build_s: float | None = None
        try:
            earlier = self.cache.find("route", key)
            if earlier is not None and earlier.get("artifact") and (dest / "artifact.json").exists():
                artifact, build_s = Artifact.load(dest), earlier.get("build_seconds")
            else:
                artifact, build_s = self.build(route, dest)
        except BuildError as exc:
            return self._done(RouteResult(key, knobs, stage, "failed", error=str(exc)))
        try:
            runner = self.builder.load(artifact)
            outputs = gate.run_all(runner, self.inputs)
        except Exception as exc:  # noqa: BLE001 - a route whose artifact will not run fails alone
            return self._done(
                RouteResult(key, knobs, stage, "failed", error=f"run failed: {exc}", build_seconds=build_s)
            )
        evidence = gate.gate_evidence(
            self.reference, outputs, self.spec.tolerance, self.spec.gate, self.inputs
        )
        b = self.spec.bench
        latency, base_latency = bench_paired(
            runner,
            self.baseline_runner,
            self.inputs.bench,
            warmup=b.warmup,
            repeats=repeats,
            bootstrap=b.bootstrap,
        )
        ob = self.spec.objective
        obj = objective(latency, self.inputs.bench, ob)
        base_obj = objective(base_latency, self.inputs.bench, ob)
        lower = speedup_lower(latency, base_latency, self.inputs.bench, ob, confidence=ob.confidence,
                              bootstrap=b.bootstrap)  # fmt: skip
        status = "passed" if evidence["passed"] else "rejected"
        return self._done(
            RouteResult(
                key,
                knobs,
                stage,
                status,
                None,
                build_s,
                obj,
                base_obj,
                speedup(base_obj, obj),
                lower,
                latency,
                evidence,
                str(dest),
            )
        )

    def _done(self, result: RouteResult) -> RouteResult:
        self.cache.append(result.record())
        kill_point(TUNE_KILL_AT_ENV, "search")
        return result

    def run_all(self, routes: list[Route], stage: str, repeats: int) -> list[RouteResult]:
        self.reporter.plan(len(routes))
        results = []
        for r in routes:
            if self.stopped:
                break
            try:
                result = self.evaluate(r, stage, repeats)
            except _BudgetSpent:
                self.stopped = True
                self.reporter.note("[yellow]the time budget is spent: stopping, keeping what finished[/]")
                break
            self.reporter.done(result)
            results.append(result)
        return results


def fast_enough(r: RouteResult, min_speedup: float) -> bool:
    """Faster than `min_speedup` with confidence: the paired lower bound of the speedup, not its point estimate.

    On a shared machine a route that computes what the baseline computes measures anywhere from 0.95x to
    1.07x; its point estimate crosses a 1.05 bar on noise, its lower bound does not.
    """
    return r.speedup is not None and r.speedup_lower is not None and r.speedup_lower >= min_speedup


def _winners(results: list[RouteResult], min_speedup: float) -> list[RouteResult]:
    # A route that only had halving's cheap round was eliminated there: noise in the full round must
    # not let it overtake the survivors it lost to.
    ok = [r for r in results if r.status == "passed" and r.stage != "cheap" and fast_enough(r, min_speedup)]
    return sorted(ok, key=lambda r: r.objective_ms or math.inf)


def _strategy(search: _Search, strategy: str) -> list[RouteResult]:
    spec = search.spec
    knobs = search.builder.route_knobs(spec.search.routes)
    space = parse_space(knobs, spec.search.routes)
    reps = spec.bench.repeats
    if strategy == "full":
        return search.run_all(full_routes(knobs, space), "bench", reps)
    if strategy in ("fast", "mixed"):
        first = search.run_all(fast_routes(knobs, space), "bench", reps)
        if strategy == "fast" or search.stopped or not first:
            return first
        helped = [
            tuple(r.knobs.items())
            for r in first[1:]
            if r.status == "passed" and fast_enough(r, spec.objective.min_speedup)
        ]
        done = {r.route for r in first}
        more = [r for r in mixed_routes(knobs, space, helped) if route_string(r) not in done]
        return first + search.run_all(more, "bench", reps)
    # halving: a cheap round over everything, then the best fraction again with the full repeats
    cheap = search.run_all(full_routes(knobs, space), "cheap", spec.bench.cheap_repeats)
    ranked = sorted((r for r in cheap if r.status == "passed"), key=lambda r: r.objective_ms or math.inf)
    keep = ranked[: max(1, math.ceil(len(ranked) * spec.search.halving_keep))] if ranked else []
    by_key = {route_string(r): r for r in full_routes(knobs, space)}
    second = search.run_all([by_key[r.route] for r in keep], "full", reps)
    seen = {r.route for r in second}
    return second + [r for r in cheap if r.route not in seen]


def tune(
    spec: TuneSpec,
    *,
    strategy: str | None = None,
    budget_s: float | None = None,
    resume: bool = False,
    progress: bool = True,
    write: bool = True,
) -> TuneResult:
    """Search `spec`'s routes and write the winner (unless `write=False`); see the module docstring."""
    t_start = time.monotonic()
    strategy = strategy or spec.search.strategy
    if strategy not in STRATEGIES:
        raise TuneError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    budget = budget_s if budget_s is not None else spec.search.budget_s
    builder = get_builder(spec.search.backend)
    ok, why = builder.available()
    if not ok:
        raise TuneError(f"backend {builder.name} cannot run here: {why}")
    parse_space(builder.route_knobs(spec.search.routes), spec.search.routes)  # fails before any work
    baseline_version, baseline_dir = find_baseline(spec)
    serving = Form.read(spec.model.repository / spec.model.name / "config.pbtxt")
    serving.check(builder)
    spec.workdir.mkdir(parents=True, exist_ok=True)
    with exclusive(spec.workdir):
        # A kill -9 leaves a temporary build directory, an e2e serving directory or a version's staging
        # directory; under the lock nothing else uses them.
        for stale in [*(spec.workdir / "builds").glob(".tmp-*"), *spec.workdir.glob("e2e-*")]:
            shutil.rmtree(stale, ignore_errors=True)
        clean_staging(spec.model.repository / spec.model.name)
        return _tune(
            spec, serving, builder, strategy, budget, resume, progress, write, baseline_version, baseline_dir,
            t_start)  # fmt: skip


@contextlib.contextmanager
def exclusive(workdir: Path) -> Iterator[None]:
    """One search per work directory at a time (the kernel drops the lock if the process dies)."""
    with open(workdir / ".lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TuneError(f"another search is running in {workdir}; wait for it or stop it") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _tune(
    spec: TuneSpec,
    serving: Form,
    builder: Builder,
    strategy: str,
    budget: float,
    resume: bool,
    progress: bool,
    write: bool,
    baseline_version: int,
    baseline_dir: Path,
    t_start: float,
) -> TuneResult:
    versions_info = tool_versions(builder)
    header = {
        "spec_digest": spec.digest,
        "spec_path": str(spec.path),
        "model": spec.model.name,
        "backend": builder.name,
        "strategy": strategy,
        "budget_s": budget,
        "routes": spec.search.routes,
        "versions": versions_info,
        "digests": run_digests(spec, baseline_dir, versions_info, serving),
    }
    cache = SearchCache.open(spec.workdir / "cache.jsonl", header, resume=resume)

    with Reporter(progress) as rep:
        g = spec.gate
        rep.note(
            f"preparing inputs and the reference (gate: {g.samples} samples, out-of-tolerance budget "
            f"{100 * g.oot_budget:g}% at {g.confidence:g} confidence)"
        )
        inputs = make_inputs(spec.inputs, spec.model.source, spec.model.name, g.samples, g.needed)
        save_batches(spec.workdir / "calibration.npz", [dict(b.feeds) for b in inputs.gate])
        reference = reference_outputs(spec, inputs)

        base_runtime = serving.baseline_runtime(baseline_dir)
        base_runner = ort_runner(baseline_dir / base_runtime.get("artifact", "model.onnx"), base_runtime)
        base_outputs = gate.run_all(base_runner, inputs)
        base_rec = cache.find("baseline")
        if base_rec is None:
            rep.note(f"benchmarking the baseline (version {baseline_version})")
            b = spec.bench
            lat = bench_runner(
                base_runner, inputs.bench, warmup=b.warmup, repeats=b.repeats, bootstrap=b.bootstrap
            )
            base_rec = {
                "kind": "baseline",
                "version": baseline_version,
                "latency": lat,
                "objective_ms": objective(lat, inputs.bench, spec.objective),
                "accuracy": gate.gate_evidence(reference, base_outputs, spec.tolerance, spec.gate, inputs),
            }
            cache.append(base_rec)
        baseline = {k: base_rec[k] for k in ("version", "objective_ms", "latency", "accuracy")}

        search = _Search(spec, serving, builder, cache, inputs, reference, base_runner, t_start + budget, rep)
        results = _strategy(search, strategy)
        same = same_as_baseline(baseline_dir, base_runtime)
        fast_enough = _winners(results, spec.objective.min_speedup)
        finalists = [r for r in fast_enough if not same(r)][: spec.search.finalists]

        e2e: dict[str, Any] = {}
        if finalists and spec.bench.e2e and serving.native:
            rep.note(f"finalists {NATIVE_E2E_SKIPPED}")
        elif finalists and spec.bench.e2e:
            rep.note(f"serving {len(finalists)} finalist(s) and the baseline through the embedded Triton")
            e2e = serve_finalists(spec, builder, baseline_dir, finalists, base_outputs, inputs)
            finalists = [f for f in finalists if e2e.get(f.route, {}).get("served_passed", True)]

        winner = finalists[0] if finalists else None
        reason = _reason(results, winner, search.stopped, spec)
        if winner is None and fast_enough:
            reason = (
                "the routes that pass and beat the baseline build exactly the baseline (same artifact and runtime)"
                + (" (the time budget stopped the search)" if search.stopped else "")
            )
        version = version_path = release = None
        if winner is not None and write:
            earlier = written_before(spec, winner.route, baseline_version)
            if earlier is not None:  # a run killed after writing it: --continue does not write it twice
                version, version_path, release = earlier
                rep.note(
                    f"version {version} already holds this search's winner ({version_path}); not written again"
                )
            else:
                rep.note(f"rebuilding the winner once and writing it: {winner.route}")
                version, version_path, release = write_winner(
                    spec, serving, builder, winner, baseline, e2e, inputs, versions_info,
                    {k: header[k] for k in ("backend", "strategy", "budget_s", "routes")})  # fmt: skip
                kill_point(TUNE_KILL_AT_ENV, "written")
            cache.append(
                {"kind": "written", "route": winner.route, "version": version, "path": str(version_path)}
            )
    report = write_report(
        spec.workdir / "report.html",
        {
            "model": spec.model.name,
            "spec": str(spec.path),
            "spec_digest": spec.digest,
            "strategy": strategy,
            "objective": spec.objective.metric,
            "baseline": baseline,
            "winner": winner.route if winner else None,
            "version": version,
            "reason": reason,
        },
        [dataclasses.asdict(r) for r in results],
        spec.tolerance,
        spec.gate,
    )
    return TuneResult(
        spec.model.name,
        strategy,
        winner,
        version,
        version_path,
        report,
        cache.path,
        results,
        baseline,
        e2e,
        reason,
        search.stopped,
        release,
    )


def _reason(results: list[RouteResult], winner: RouteResult | None, stopped: bool, spec: TuneSpec) -> str:
    budget = " (the time budget stopped the search)" if stopped else ""
    if winner is not None:
        rate = (winner.accuracy or {}).get("rate") or {}
        within = (
            (
                f"{rate['k']}/{rate['n']} requests out of tolerance, upper bound {100 * rate['upper']:.2f}% <= "
                f"budget {100 * rate['budget']:g}%"
            )
            if rate
            else "within tolerance"
        )
        return (
            f"{winner.route} is {winner.speedup:.2f}x the baseline (at least {winner.speedup_lower or 0:.2f}x at "
            f"{spec.objective.confidence:g} confidence), {within}{budget}"
        )
    passed = [r for r in results if r.status == "passed"]
    if not results:
        return f"no route finished{budget}"
    if not passed:
        return (
            f"no route passed the accuracy gate ({len(results)} tried; out-of-tolerance budget "
            f"{100 * spec.gate.oot_budget:g}% at {spec.gate.confidence:g} confidence){budget}"
        )
    best = max(passed, key=lambda r: r.speedup_lower or 0.0)
    return (
        f"no route beats the baseline within tolerance: the best passing route is {best.speedup or 0:.2f}x, at "
        f"least {best.speedup_lower or 0:.2f}x at {spec.objective.confidence:g} confidence; needs >= "
        f"{spec.objective.min_speedup:g}x{budget}"
    )


__all__ = ["RouteResult", "TuneError", "TuneResult", "find_baseline", "plan", "route_id", "tune"]
