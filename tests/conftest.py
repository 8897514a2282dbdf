"""Shared test helpers. Fixtures for the real Triton come from the `tunegate` pytest plugin."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def http_json(method: str, url: str, obj: Any = None, timeout: float = 30) -> tuple[int, Any]:
    body = json.dumps(obj).encode() if obj is not None else None
    code, _h, raw = http(method, url, body, {"Content-Type": "application/json"}, timeout)
    return code, (json.loads(raw) if raw else None)


# Tests whose assertions no other test's CPU load can change: outputs, files, exit codes, processes, accuracy
# (never latency, throughput, a share of the CPU or a deadline under a minute). `make test` runs them three at
# a time (pytest-xdist) after the others, which run alone: the sidecar's and the demo's canaries judge latency,
# the serving tuner and the soak measure it, and those figures must not carry another test's load.
CONCURRENT_MODULES = frozenset({
    "test_budget_controller",  # the mirror budget on simulated latencies and a simulated clock
    "test_cli", "test_codec", "test_compose", "test_dashboard", "test_decision_record", "test_errors", "test_fuzz",
    "test_inductor", "test_inductor_triton", "test_install", "test_loadtest", "test_mirror_compare", "test_model",
    "test_pbtxt", "test_prometheus_rules", "test_readme", "test_repository", "test_serving", "test_sidecar_config",
    "test_sidecar_judge",  # the judge on simulated streams and hand-made evidence: no clock, no server
    "test_sidecar_state", "test_tolerance", "test_triton", "test_tuner_builders", "test_tuner_faults",
    "test_tuner_gate", "test_tuner_inputs", "test_tuner_native", "test_tuner_routes", "test_tuner_search",
    "test_tuner_spec", "test_tuner_speed", "test_tuner_tensorrt",
})  # fmt: skip
# The bad demo pins on accuracy (per-channel int8 is 2x faster and far out of tolerance), not on time.
CONCURRENT_TESTS = frozenset({"test_demo.py::test_bad_scenario_pins_the_baseline"})
# An 8-second search budget that one route must fit in.
SERIAL_TESTS = frozenset(
    {"test_tuner_faults.py::test_the_budget_stops_the_search_cleanly_and_keeps_what_finished"}
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path
        test_id = f"{path.name}::{item.name.split('[')[0]}"
        if test_id in SERIAL_TESTS:
            continue
        if path.stem in CONCURRENT_MODULES or test_id in CONCURRENT_TESTS:
            item.add_marker(pytest.mark.concurrent)
