"""Load replay: capture parsing, payload synthesis, arrival profiles, and real Locust runs against a real Triton."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadtest.replay import (
    ArrivalProfile,
    ReplayPlan,
    Synthesizer,
    batch_of,
    exact_payloads,
    mix,
    total_variation,
)
from loadtest.runner import LoadOptions, run
from loadtest.synth import SynthSpec, synthesize
from tunegate import codec
from tunegate.capture import CaptureError, CaptureRecord, CaptureWriter, load_capture, write_capture_file
from tunegate.triton import EmbeddedTriton


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cap") / "capture-demo.jsonl"
    write_capture_file(path, synthesize(SynthSpec(requests=40, rate=20.0, seed=3)))
    return path


def test_synthetic_capture_has_a_long_tailed_batch_mix(capture: Path) -> None:
    recs = load_capture(capture)
    batches = Counter(batch_of({n: v["shape"] for n, v in r.inputs.items()}) for r in recs)
    assert batches[1] > batches.get(8, 0) + batches.get(16, 0)
    assert set(batches) <= {1, 2, 4, 8, 16}
    assert all(r.decode().tensors["input_ids"].datatype == "INT64" for r in recs)
    ts = [r.ts for r in recs]
    assert ts == sorted(ts) and 0.5 < (ts[-1] - ts[0]) / (len(ts) / 20.0) < 2.0


def test_synthesized_payloads_keep_shapes_and_dtypes(capture: Path) -> None:
    recs = load_capture(capture)
    synth = Synthesizer(recs, seed=1)
    for i in range(len(recs)):
        p = synth.payload(i)
        got = codec.decode_request(p.body, int(p.headers[codec.HEADER]))
        want = recs[i].decode()
        for name, t in want.tensors.items():
            assert got.tensors[name].shape == t.shape and got.tensors[name].datatype == t.datatype
        # values come from the capture's own pool (token ids stay token ids)
        assert set(np.unique(got.tensors["attention_mask"].array)) <= {0, 1}
    assert synth.payload(0).body != recs[0].body or len(recs[0].body) < 64


def test_arrival_profile_is_time_scaled() -> None:
    ts = [0.0, 0.1, 0.2, 1.5, 3.9]
    p = ArrivalProfile.from_timestamps(ts)
    assert p.rates == (3.0, 1.0, 0.0, 1.0) and p.duration_s == 4.0
    fast = ArrivalProfile.from_timestamps(ts, time_scale=2.0)
    assert fast.rates == (4.0, 1.0) and sum(fast.rates) * fast.step_s == len(ts)
    assert p.rate_at(10) is None


@pytest.mark.parametrize(
    "line,match",
    [
        ("not json", "not JSON"),
        ('{"v": 9, "ts": 1, "model": "m", "body_b64": ""}', "format version"),
        ('{"v": 1, "ts": 1, "body_b64": ""}', "'model'"),
        ('{"v": 1, "ts": 1, "model": "m", "body_b64": "%%%"}', "base64"),
        ('{"v": 1, "ts": 1, "model": "m", "body_b64": "", "header_length": -3}', "header_length"),
    ],
)
def test_bad_capture_lines_name_file_and_line(tmp_path: Path, line: str, match: str) -> None:
    good = CaptureRecord(1.0, "m", None, b"{}", None).to_json()
    path = tmp_path / "capture-x.jsonl"
    path.write_text(json.dumps(good) + "\n" + line + "\n" + json.dumps(good) + "\n")
    with pytest.raises(CaptureError, match=match) as info:
        load_capture(path)
    assert f"{path}:2" in str(info.value)


def test_missing_and_empty_captures(tmp_path: Path) -> None:
    with pytest.raises(CaptureError, match="no such capture"):
        load_capture(tmp_path / "nope.jsonl")
    with pytest.raises(CaptureError, match="no capture-"):
        load_capture(tmp_path)
    (tmp_path / "capture-e.jsonl").write_text("")
    with pytest.raises(CaptureError, match="no records"):
        load_capture(tmp_path)
    body = b'{"inputs": 1}'
    bad = CaptureRecord(1.0, "m", None, body, None)
    write_capture_file(tmp_path / "capture-e.jsonl", [bad])
    with pytest.raises(CaptureError, match="does not decode"):
        exact_payloads(load_capture(tmp_path))


def test_capture_writer_rotates_and_caps(tmp_path: Path) -> None:
    rec = CaptureRecord(1.0, "m", "2", base64.b64decode(base64.b64encode(b"x" * 300)), None)
    w = CaptureWriter(tmp_path, max_file_bytes=1000, max_files=3, max_per_second=1000, max_body_bytes=400)
    for _ in range(20):
        w.write(rec)
    assert not w.write(CaptureRecord(1.0, "m", None, b"y" * 500, None))  # over the body cap
    w.close()
    files = sorted(tmp_path.glob("capture-*.jsonl"))
    assert len(files) == 3 and all(f.stat().st_size <= 1000 for f in files)
    assert w.written == 20 and w.skipped == 1
    assert all(r.version == "2" and r.body == b"x" * 300 for r in load_capture(tmp_path))
    slow = CaptureWriter(tmp_path / "s", max_per_second=2)
    assert sum(slow.write(rec) for _ in range(10)) <= 3
    slow.close()


@pytest.mark.triton
@pytest.mark.parametrize("mode", ["exact", "synth"])
def test_replay_reproduces_the_capture_shape_mix(
    demo_triton: EmbeddedTriton, capture: Path, tmp_path: Path, mode: str
) -> None:
    users = 3
    result = run(
        LoadOptions(
            capture=capture,
            host=demo_triton.http_url,
            users=users,
            spawn_rate=users,
            duration_s=6,
            mode=mode,
            name_by="batch",
            csv_prefix=tmp_path / "s",
        )
    )
    assert result.total.failures == 0 and result.total.requests >= 10
    # Payloads go out in capture order, cycling; those in flight at the stop are not counted, so each
    # batch size may be short by at most `users` requests. Stated tolerance: that, nothing more.
    recs = load_capture(capture)
    sent = Counter(
        f"minilm b={batch_of({n: v['shape'] for n, v in recs[i % len(recs)].inputs.items()})}"
        for i in range(result.total.requests + users)
    )
    got = {k: v.requests for k, v in result.by_name.items()}
    for name, n in got.items():
        assert 0 <= sent[name] - n <= users, (name, n, sent[name])
    plan_mix = ReplayPlan.load(capture).shape_mix()
    assert plan_mix and total_variation(mix(got), mix(Counter({k: v for k, v in sent.items()}))) < 0.15


@pytest.mark.triton
@pytest.mark.parametrize("stop_after_s", [0.0, 0.7, 3.0])
def test_a_replay_asked_to_stop_ends_cleanly_with_its_stats(
    demo_triton: EmbeddedTriton, capture: Path, tmp_path: Path, stop_after_s: float
) -> None:
    # A canary that decides stops its load at any moment, Locust's start-up included. A stop that lands as
    # Ctrl-C there made Locust exit 1 or 2 (or die of the signal) and a decided canary report a failed replay.
    result = run(
        LoadOptions(
            capture=capture, host=demo_triton.http_url, users=4, spawn_rate=4, duration_s=120, rate=40,
            csv_prefix=tmp_path / "s",
        ),
        progress=lambda elapsed_s: elapsed_s >= stop_after_s,
    )  # fmt: skip
    assert result.wall_s < 60, result.wall_s  # stopped, not run to its 120 s
    assert result.total.failures == 0
    if stop_after_s >= 3.0:
        assert result.total.requests > 0


@pytest.mark.triton
def test_loadtest_cli_fails_on_errors_and_bad_captures(demo_triton: EmbeddedTriton, tmp_path: Path) -> None:
    wrong = [
        CaptureRecord(
            1.0 + i, "no_such_model", None, *codec.encode_request({"x": np.ones((1, 2), np.float32)})
        )
        for i in range(5)
    ]
    write_capture_file(tmp_path / "capture-w.jsonl", wrong)
    cmd = [
        sys.executable,
        "-m",
        "tunegate.app.cli",
        "loadtest",
        "--host",
        demo_triton.http_url,
        "--users",
        "1",
        "--duration",
        "2",
        "--json",
    ]
    proc = subprocess.run(
        [*cmd, "--capture", str(tmp_path / "capture-w.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["failure_ratio"] == 1.0 and summary["requests"] > 0 and summary["ok"] is False
    (tmp_path / "capture-bad.jsonl").write_text("garbage\n")
    proc = subprocess.run(
        [*cmd, "--capture", str(tmp_path / "capture-bad.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "capture-bad.jsonl:1: not JSON" in proc.stderr


def test_loadtest_refuses_a_host_where_nothing_answers(tmp_path: Path) -> None:
    write_capture_file(
        tmp_path / "capture-a.jsonl",
        [CaptureRecord(1.0, "m", None, *codec.encode_request({"x": np.ones((1, 2), np.float32)}))],
    )
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "tunegate.app.cli", "loadtest", "--capture", str(tmp_path / "capture-a.jsonl"),
         "--host", f"http://127.0.0.1:{port}", "--duration", "30"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "nothing answers at" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("protocol", "host", "message"),
    [
        ("grpc", "http://127.0.0.1:8081", "HOST:PORT"),
        ("grpc", "127.0.0.1", "HOST:PORT"),
        ("http", "127.0.0.1:8081", "http"),
        ("h3", "http://x", "protocol"),
    ],
)
def test_load_options_refuse_a_host_the_protocol_cannot_use(protocol: str, host: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadOptions(capture=Path("c.jsonl"), host=host, protocol=protocol)
    assert LoadOptions(capture=Path("c"), host="grpc://127.0.0.1:8081", protocol="grpc").protocol == "grpc"
