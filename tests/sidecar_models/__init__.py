"""Repository builder for the sidecar tests: models with a baseline v1 and candidate versions of chosen behaviour."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tunegate import codec
from tunegate.repository import ModelConfig, TensorSpec, write_config, write_version

MODEL_PY = Path(__file__).parent / "model.py"
TOLERANCE = {"y": {"metric": "linf", "threshold": 1e-3}}
TOKEN = "test-admin-token-0123456789"
# Small canaries for tests: the statistics still decide, on fewer samples.
FAST_PARAMS = {"min_samples": 60, "oot_budget": 0.05, "error_budget": 0.05, "confidence": 0.95,
               "latency_slack": 0.5, "deadline_s": 60, "aa_rate": 0.2,
               "max_in_flight": 4, "placements": 1}  # fmt: skip
# Fast canaries whose latency verdict is asked of two sets of instances (the default), the first loaded afresh
# after 50 pairs: the tests of placements themselves.
PLACED_PARAMS = {**FAST_PARAMS, "placements": 2, "placement_pairs": 50, "warmup_s": 3.0}


def canary_cli(url: str, token_file: Path) -> list[str]:
    """The `tunegate canary` command line against a sidecar, to run as a subprocess."""
    return [sys.executable, "-m", "tunegate.app.cli", "canary", "--url", url, "--token-file", str(token_file)]


def config(name: str) -> ModelConfig:
    return ModelConfig(
        name, (TensorSpec("x", "FP32", (-1, 4)),), (TensorSpec("y", "FP32", (-1, 4)),), versions=(1,)
    )


def add_model(repo: Path, name: str, candidates: Mapping[int, dict[str, Any] | None],
              release: bool = True, baseline: Mapping[str, Any] | None = None) -> None:  # fmt: skip
    """v1 is the exact baseline (`baseline`: its behaviour); each candidate version gets its behaviour (None: no behaviour.json)."""
    write_version(
        repo,
        name,
        {"model.py": MODEL_PY.read_text(), "behaviour.json": json.dumps(dict(baseline or {}))},
        version=1,
    )
    for v, behaviour in candidates.items():
        files: dict[str, Path | bytes | str] = {"model.py": MODEL_PY.read_text()}
        if behaviour is not None:
            files["behaviour.json"] = json.dumps(behaviour)
        write_version(repo, name, files, version=v, release={"tolerance": TOLERANCE} if release else None)
    write_config(repo, config(name))


def infer_body(rng: np.random.Generator, binary: bool = False, rows: int = 2) -> tuple[bytes, dict[str, str]]:
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    body, hl = codec.encode_request({"x": x}, binary=binary, binary_outputs=binary)
    headers = (
        {"Content-Type": "application/json"}
        if hl is None
        else {codec.HEADER: str(hl), "Content-Type": "application/octet-stream"}
    )
    return body, headers
