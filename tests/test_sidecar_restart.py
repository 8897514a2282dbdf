"""A sidecar killed with SIGKILL mid-canary resumes it: same routing, evidence kept, no decision lost or doubled."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.client import AdminClient, SidecarProcess, write_token_file
from sidecar.control import shadow_name
from tests.conftest import http
from tests.sidecar_models import FAST_PARAMS, TOKEN, add_model, canary_cli, infer_body

pytestmark = pytest.mark.triton


def infer_versions(url: str, model: str, n: int) -> set[str]:
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(n):
        body, headers = infer_body(rng)
        code, _h, raw = http("POST", f"{url}/v2/models/{model}/infer", body, headers)
        assert code == 200, raw
        seen.add(json.loads(raw)["model_version"])
    return seen


def state(state_dir: Path) -> dict[str, Any]:
    return dict(json.loads((state_dir / "state.json").read_text())["models"]["rs"])


def records(state_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (state_dir / "decisions.jsonl").read_text().splitlines()]


def test_sigkill_mid_canary_resumes_without_losing_or_doubling(triton_factory: Any, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    add_model(repo, "rs", {2: {}})
    triton = triton_factory(repo, ["rs"])
    token_file = write_token_file(tmp_path / "token", TOKEN)
    st_dir = tmp_path / "state"

    def sidecar() -> SidecarProcess:
        return SidecarProcess(
            upstream=triton.http_url, state_dir=st_dir, repository=repo, token_file=token_file
        )

    sc = sidecar().start()
    admin = AdminClient(sc.url, TOKEN)
    started = admin.start("rs", 2, **{**FAST_PARAMS, "min_samples": 10**6, "deadline_s": 600})
    canary_id = started["canary"]["id"]
    assert infer_versions(sc.url, "rs", 150) == {"1"}
    deadline = time.monotonic() + 30
    while not (persisted := state(st_dir)["canary"]["evidence"]["compared"]) and time.monotonic() < deadline:
        time.sleep(0.2)  # the judge tick persists the evidence
    assert persisted > 0
    sc.kill()

    sc = sidecar().start()  # the port changes; nothing else does
    admin = AdminClient(sc.url, TOKEN)
    st = admin.status("rs")
    assert st["state"] == "running" and st["canary"]["id"] == canary_id and st["live"] == 1
    assert st["canary"]["evidence"]["compared"] >= persisted
    assert infer_versions(sc.url, "rs", 20) == {"1"}  # routes the same way
    assert infer_versions(triton.http_url, "rs", 3) == {"1"}  # bypassing clients still get the baseline
    sc.kill()

    # Killed between writing the pending decision and acting on it: the restart finishes it, once.
    s = json.loads((st_dir / "state.json").read_text())
    s["models"]["rs"]["canary"]["pending"] = {
        "canary_id": canary_id, "model": "rs", "candidate": 2, "baseline": 1, "outcome": "pin",
        "reasons": ["manual pin by an operator"], "evidence": {}, "decided_by": "operator", "exemplars": [], "at": 1.0,
    }  # fmt: skip
    pending_state = json.dumps(s)
    (st_dir / "state.json").write_text(pending_state)
    sc = sidecar().start()
    admin = AdminClient(sc.url, TOKEN)
    assert admin.status("rs")["state"] == "pinned"
    assert [r["canary_id"] for r in records(st_dir)] == [canary_id]
    assert not (repo / shadow_name("rs")).exists()
    sc.kill()

    # Killed after the record was appended but before the state was cleared: not written twice.
    (st_dir / "state.json").write_text(pending_state)
    with sidecar() as sc:
        assert AdminClient(sc.url, TOKEN).status("rs")["state"] == "pinned"
        assert [r["canary_id"] for r in records(st_dir)] == [canary_id]
        assert state(st_dir)["live"] == 1 and infer_versions(sc.url, "rs", 3) == {"1"}
        # ... and the CLI reads the same record
        cli = canary_cli(sc.url, token_file)
        out = subprocess.run(
            [*cli, "--json", "decisions", "rs"], check=False, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert [r["outcome"] for r in json.loads(out.stdout)["decisions"]] == ["pin"]
        bad = subprocess.run([*cli, "promote", "rs"], check=False, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "no running canary" in bad.stderr
