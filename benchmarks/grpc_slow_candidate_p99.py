"""gRPC clients' p99 through the sidecar while a candidate 100 ms slower is mirrored, by the canary's sample rate.

The question: does a slow candidate reach the live version's clients? The compiled gRPC front answers each call
from the live version and the canary mirrors a sample after the client has its answer, so the candidate's
slowness itself should not; what mirroring does cost is the copies' work (the candidate copy, the shadow
baseline's copy, the sidecar's comparison) on the machine the clients share. To tell the two apart, each sample
rate is run twice: with the 100 ms slower candidate and with an identical one.

Load: perf_analyzer (`-i grpc`) at each concurrency against python-backend identity models FP32[16] on the
embedded Triton, through one sidecar's compiled front (`tunegate-grpc-front`). Setups, each its own model:

  passthrough          no canary
  slow@R / ident@R     a canary at sample rate R (shadow latency pairing: one pair of copies out at a time)
                       of a candidate 100 ms slower / identical
  ... pQ<=S            the same with the mirror budget on (`--budgets S@Q`, e.g. 0.05@0.99: the clients' p99
                       may rise 5%); each such canary first runs `--warm` seconds at each concurrency so that its
                       controller finds its rate, and its pauses count in what the clients see

Every setup is up at once; the runs interleave (each round, each concurrency, the setups in an order that
reverses every round); figures are medians over the rounds, ratios the medians of each round's own ratios to
passthrough's p99 (measured seconds apart). Pairs per second come from each canary's own count of copies compared.

One round's p99 on a small shared machine moves by tens of percent (scheduler noise), so the medians of ratios
say little about a 5% question. The pooled figures answer it: every request's latency in the measurement windows
(perf_analyzer's profile export), all rounds together, one p99 per setup and concurrency; its ratio to
passthrough's pooled p99 (and the slow candidate's to the identical one's, same rate and budget) with a 95%
interval from a bootstrap over rounds (the same rounds drawn for both sides: they ran seconds apart).

    .venv/bin/python benchmarks/grpc_slow_candidate_p99.py                        # about 12 minutes
    .venv/bin/python benchmarks/grpc_slow_candidate_p99.py --duration 2 --repeats 1 -c 1   # smoke
    .venv/bin/python benchmarks/grpc_slow_candidate_p99.py --rates 1 --budgets off 0.05@0.99 --repeats 6

Needs the compiled front (`make native`) and perf_analyzer's libraries (see benchmarks/sidecar_grpc.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from sidecar_grpc import concurrency_table, measure, perf_analyzer, perf_env
from sidecar_vs_nginx import IDENTITY_PY, median_run

from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tunegate.repository import ModelConfig, TensorSpec, write_config, write_version
from tunegate.triton import EmbeddedTriton, TritonOptions

TOKEN = "benchmark-admin-token-0123456789"
DEFAULT_RATES = (1.0, 0.01, 0.001)


Budget = tuple[float, float] | None  # (max_client_slowdown, quantile), or None: off


def parse_budget(text: str) -> Budget:
    if text == "off":
        return None
    slowdown, _, q = text.partition("@")
    return float(slowdown), float(q or 0.5)


def model_name(kind: str, rate: float, b: int = 0) -> str:
    return f"{kind}_{str(rate).replace('.', 'p')}" + (f"_b{b}" if b else "")


def setup_name(kind: str, rate: float, budget: Budget) -> str:
    return f"{kind}@{rate:g}" + ("" if budget is None else f" p{100 * budget[1]:g}<={budget[0]:.0%}")


def build_repository(
    root: Path, rates: list[float], budgets: list[Budget]
) -> tuple[dict[str, str], dict[str, Budget]]:
    """Triton models for each setup; returns setup -> model name, and setup -> its canary's budget."""

    def model(name: str, versions: dict[int, dict[str, float]]) -> None:
        for v, behaviour in versions.items():
            write_version(
                root, name, {"model.py": IDENTITY_PY, "behaviour.json": json.dumps(behaviour)}, version=v
            )
        write_config(root, ModelConfig(name, (TensorSpec("x", "FP32", (16,)),), (TensorSpec("y", "FP32", (16,)),),
                                       versions=(1,)))  # fmt: skip

    setups, budget_of = {"passthrough": "plain"}, {}
    model("plain", {1: {}})
    for rate in rates:
        candidates: tuple[tuple[str, dict[str, float]], ...] = (("slow", {"delay_ms": 100.0}), ("ident", {}))
        for b, budget in enumerate(budgets):
            for kind, cand in candidates:
                name = model_name(kind, rate, b)
                model(name, {1: {}, 2: cand})
                setup = setup_name(kind, rate, budget)
                setups[setup], budget_of[setup] = name, budget
    return setups, budget_of


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = perf_env()
    work = Path(tempfile.mkdtemp(prefix="bench-grpc-p99-"))
    setups, budget_of = build_repository(work / "repo", args.rates, args.budgets)
    token = write_token_file(work / "token", TOKEN)
    raw: dict[str, dict[int, list[dict[str, float]]]] = {}
    lat: dict[str, dict[int, list[np.ndarray]]] = {}
    console = Console(stderr=True)
    with contextlib.ExitStack() as stack:
        triton = stack.enter_context(EmbeddedTriton(TritonOptions(repository=work / "repo",
                                                                  models=tuple(setups.values())), workdir=work / "t"))  # fmt: skip
        triton_pid = triton.proc.pid if triton.proc is not None else None
        sc = stack.enter_context(SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address,
                                                grpc_listen="127.0.0.1:0", state_dir=work / "state",
                                                repository=work / "repo", token_file=token,
                                                extra_args=("--grpc-front", "native")))  # fmt: skip
        sc_pid = sc.proc.pid if sc.proc is not None else None
        if args.nice_sidecar and sc_pid is not None:  # the sidecar's own threads, not its compiled front
            for task in Path(f"/proc/{sc_pid}/task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), args.nice_sidecar)
        admin = AdminClient(sc.url, TOKEN)
        # Every sampled call compared, no judge decision ends a run (as in sidecar_grpc.py).
        unjudged = {"min_samples": 10**9, "deadline_s": 86400.0, "aa_rate": 0.0, "warmup_samples": 10**9}
        tol = {"y": {"metric": "linf", "threshold": 1e-6}}
        for setup, model in setups.items():
            if setup != "passthrough":
                budget = budget_of[setup]
                on = {} if budget is None else {"max_client_slowdown": budget[0], "budget_quantile": budget[1],
                                                "budget_period_s": args.budget_period, "budget_pause_s": args.budget_pause}  # fmt: skip
                admin.start(
                    model, 2, tol, sample_rate=float(setup.split("@")[1].split()[0]), **unjudged, **on
                )
        names = list(setups)
        for name in names:  # warm each path; a budget's controller finds its rate at each concurrency
            for c in args.concurrency if budget_of.get(name) else [1]:
                perf_analyzer(
                    sc.grpc_address, setups[name], c, args.warm if budget_of.get(name) else 1.5, work, env
                )
        for rnd in range(args.repeats):
            console.print(f"[bold]round {rnd + 1} of {args.repeats}")
            for c in args.concurrency:
                for name in names if rnd % 2 == 0 else names[::-1]:
                    model = setups[name]
                    compared0 = compared(admin, model)
                    r = measure(raw, name, sc.grpc_address, model, c, args.duration, work, env, (sc_pid, triton_pid),
                                console, lat.setdefault(name, {}).setdefault(c, []))  # fmt: skip
                    r["pairs_per_s"] = (compared(admin, model) - compared0) / r["wall_s"]
        errors = {m: (admin.status(m)["canary"] or {}).get("evidence", {}).get("errors")
                  for s, m in setups.items() if s != "passthrough"}  # fmt: skip
        budgets = {s: (admin.status(m)["canary"] or {}).get("mirror_budget")
                   for s, m in setups.items() if budget_of.get(s)}  # fmt: skip
        canaries = {s: canary_summary(admin.status(m)) for s, m in setups.items() if s != "passthrough"}
    results = {name: {c: median_run(runs) for c, runs in per.items()} for name, per in raw.items()}
    ratios: dict[str, dict[int, dict[str, float]]] = {}
    for name, per in raw.items():
        if name == "passthrough":
            continue
        for c, runs in per.items():
            rs = [a["p99_ms"] / b["p99_ms"] for a, b in zip(runs, raw["passthrough"][c], strict=True)]
            ratios.setdefault(name, {})[c] = {"p99": statistics.median(rs), "min": min(rs), "max": max(rs)}
    return {"results": results, "p99_vs_passthrough": ratios, "pooled": pooled(lat, args.seed), "runs": raw,
            "duration_s": args.duration,
            "nice_sidecar": args.nice_sidecar,
            "repeats": args.repeats, "replay_errors": errors, "budgets": budgets, "canaries": canaries}  # fmt: skip


def pooled_p99(rounds: list[np.ndarray], pick: np.ndarray | None = None) -> float:
    chosen = rounds if pick is None else [rounds[i] for i in pick]
    return float(np.percentile(np.concatenate(chosen), 99))


# Bootstrap resamples sum per-round histograms, not latencies: bins 0.1% wide (log-spaced, 1 us to 100 s), so a
# resample costs a few thousand additions however many requests a round holds. Point estimates stay exact.
P99_BINS = np.geomspace(1e-3, 1e5, 8 * 2303 + 1)


def binned_p99(counts: np.ndarray) -> float:
    """The p99 of pooled per-round histograms (rows), to a bin's width (the geometric middle of the bin)."""
    total = counts.sum(axis=0).cumsum()
    i = int(np.searchsorted(total, 0.99 * total[-1]))
    return float(np.sqrt(P99_BINS[i] * P99_BINS[i + 1]))


def pooled_ratio(
    a: list[np.ndarray], b: list[np.ndarray], rng: np.random.Generator, n_boot: int = 2000
) -> dict[str, float]:
    """p99 of `a`'s pooled latencies over `b`'s, with a 95% percentile interval from resampling rounds (the same
    round indices for both sides: round i of `a` ran seconds from round i of `b`)."""
    n = min(len(a), len(b))
    ha = np.stack([np.histogram(r, P99_BINS)[0] for r in a[:n]])
    hb = np.stack([np.histogram(r, P99_BINS)[0] for r in b[:n]])
    boot = []
    for _ in range(n_boot):
        pick = rng.integers(0, n, n)
        boot.append(binned_p99(ha[pick]) / binned_p99(hb[pick]))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": pooled_p99(a[:n]) / pooled_p99(b[:n]), "lo": float(lo), "hi": float(hi), "rounds": n}


def pooled(
    lat: Mapping[str, Mapping[int, list[np.ndarray]]], seed: int
) -> dict[str, dict[int, dict[str, Any]]]:
    """Per setup and concurrency: the pooled p99, its ratio to passthrough's and, for a slow candidate, to the
    identical candidate's at the same rate and budget."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, per in lat.items():
        for c, rounds in per.items():
            row: dict[str, Any] = {"p99_ms": pooled_p99(rounds), "requests": int(sum(len(r) for r in rounds))}
            if name != "passthrough":
                row["vs_passthrough"] = pooled_ratio(rounds, lat["passthrough"][c], rng)
            twin = name.replace("slow@", "ident@", 1)
            if name.startswith("slow@") and twin in lat:
                row["vs_identical"] = pooled_ratio(rounds, lat[twin][c], rng)
            out.setdefault(name, {})[c] = row
    return out


def canary_summary(status: Mapping[str, Any]) -> dict[str, Any]:
    """What each canary did by the end: its state, the copies it sent, compared and skipped (and why), paused."""
    c = status.get("canary") or {}
    ev = c.get("evidence") or {}
    keep = ("sent", "compared", "errors", "timeouts", "skipped", "aa_sent", "pairs_total", "protocols")
    return {"state": status.get("state"), "paused": c.get("paused"), **{k: ev.get(k) for k in keep},
            "judgement": (c.get("judgement") or {}).get("outcome")}  # fmt: skip


def compared(admin: AdminClient, model: str) -> int:
    canary = admin.status(model).get("canary")
    return int(((canary or {}).get("evidence") or {}).get("compared") or 0)


def report(data: dict[str, Any]) -> None:
    def ratio(name: str, c: int, _r: dict[str, float]) -> str:
        q = data["p99_vs_passthrough"].get(name, {}).get(c)
        return f"{q['p99']:.2f}x ({q['min']:.2f}-{q['max']:.2f})" if q else "-"

    t = concurrency_table(
        f"gRPC clients through the sidecar, by canary (perf_analyzer, medians of {data['repeats']} rounds)",
        data["results"],
        [("req/s", lambda _n, _c, r: f"{r['rps']:.0f}"), ("p99 ms", lambda _n, _c, r: f"{r['p99_ms']:.2f}"),
         ("p99 / passthrough", ratio), ("pairs/s", lambda _n, _c, r: f"{r['pairs_per_s']:.1f}")],
    )  # fmt: skip
    console = Console(width=200)
    console.print(t)

    def interval(q: dict[str, float] | None) -> str:
        return f"{q['ratio']:.3f}x [{q['lo']:.3f}-{q['hi']:.3f}]" if q else "-"

    pooled_t = concurrency_table(
        "Pooled over the rounds: p99, and its ratio with a 95% bootstrap interval over rounds",
        data["pooled"],
        [("p99 ms", lambda _n, _c, r: f"{r['p99_ms']:.3f}"),
         ("/ passthrough", lambda _n, _c, r: interval(r.get("vs_passthrough"))),
         ("/ identical", lambda _n, _c, r: interval(r.get("vs_identical")))],
    )  # fmt: skip
    console.print(pooled_t)
    bad = {m: e for m, e in data["replay_errors"].items() if e}
    console.print(f"[red]replay errors: {bad}" if bad else "[green]no replay errors in any canary")
    for setup, b in (data.get("budgets") or {}).items():
        if b:
            console.print(f"{setup}: sample rate {b['sample_rate']:.3g} (lowest {b['min_sample_rate_seen']:.3g}, floor "
                          f"{b['floor_sample_rate'] or 0:.3g}), {b['decreases']} halvings, {b['increases']} increases, "
                          f"{b['pauses']} pauses, overall added {b['overall']['added']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--repeats", type=int, default=5, help="rounds")
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="canary sample rates")
    p.add_argument(
        "--budgets",
        type=parse_budget,
        nargs="+",
        default=[None],
        help="each canary setup with each mirror budget: off, or SLOWDOWN@QUANTILE (0.05@0.99)",
    )
    p.add_argument("--budget-period", type=float, default=10.0, help="the budget's budget_period_s")
    p.add_argument("--budget-pause", type=float, default=1.0, help="the budget's budget_pause_s")
    p.add_argument(
        "--warm", type=float, default=20.0, help="seconds a budget's canary runs before the rounds"
    )
    p.add_argument(
        "--nice-sidecar",
        type=int,
        default=0,
        help="run the sidecar's Python threads at this niceness (its compiled front stays at 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    data = run(args)
    report(data)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
