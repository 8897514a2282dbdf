"""The gate's outputs one request at a time against one request per core at a time (tuner.gate.run_all).

MiniLM as the strict spec's [reference] runs it (`tuner.search.reference_runner`: one intra-op thread, no graph
optimisation), over the spec's declared gate requests (specs/minilm.toml: text of natural lengths, its batch
mix). Rounds interleave the two ways; the figure is the median of each round's own ratio. The outputs of both
ways are compared bit for bit every round.

    .venv/bin/python benchmarks/gate_workers.py                 # 500 requests, 3 rounds (a few minutes)
    .venv/bin/python benchmarks/gate_workers.py --samples 60 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tunegate import models, project
from tuner import gate
from tuner.inputs import make_inputs
from tuner.search import reference_runner
from tuner.spec import load_spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    models.minilm_onnx()  # exported once into the cache, where the spec's `demo:minilm` source points
    spec = load_spec(project.specs_dir() / "minilm.toml")
    inputs = make_inputs(spec.inputs, spec.model.source, spec.model.name, args.samples)
    runner = reference_runner(spec)
    workers = gate.gate_workers()
    gate.run_all(runner, inputs, workers=1)  # warm
    seconds: dict[int, list[float]] = {1: [], workers: []}
    for rnd in range(args.rounds):
        outs = {}
        for n in (1, workers) if rnd % 2 == 0 else (workers, 1):
            t0 = time.perf_counter()
            outs[n] = gate.run_all(runner, inputs, workers=n)
            seconds[n].append(time.perf_counter() - t0)
        same = all(
            all(np.array_equal(a[k], b[k]) for k in a) for a, b in zip(outs[1], outs[workers], strict=True)
        )
        print(f"round {rnd + 1}: one at a time {seconds[1][-1]:.1f} s, {workers} at a time {seconds[workers][-1]:.1f} s, "
              f"outputs {'identical' if same else 'DIFFERENT'}")  # fmt: skip
        if not same:
            return 1
    ratio = statistics.median(a / b for a, b in zip(seconds[1], seconds[workers], strict=True))
    data: dict[str, Any] = {"samples": args.samples, "workers": workers, "seconds": seconds, "speedup": ratio}
    print(f"{args.samples} gate requests: {workers} at a time is {ratio:.2f}x as fast as one at a time "
          f"(median of {args.rounds} rounds; {statistics.median(seconds[1]):.1f} s -> "
          f"{statistics.median(seconds[workers]):.1f} s)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
