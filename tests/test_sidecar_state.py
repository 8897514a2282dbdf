"""The sidecar's state file: what it saves, it reads back, whatever the admin API let in."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.state import StateStore


@pytest.mark.parametrize("value", [
    {"min_samples": 2**70, "note": "beyond 64 bits: orjson refuses it, json writes it"},
    {"output": "\ud800", "threshold": 0.5},  # a lone surrogate, which json.loads accepts from a request
    {"output": "Grüße ✓", "ratio": 1e-5, "pairs": [0.001, 0.0025]},  # UTF-8 in the file, read as UTF-8
])  # fmt: skip
def test_state_reads_back_what_it_saved(tmp_path: Path, value: dict[str, object]) -> None:
    store = StateStore(tmp_path)
    store.model("m")["canary"] = {"params": value}
    store.save(store.snapshot())
    assert StateStore(tmp_path).model("m")["canary"] == {"params": value}
