"""The embedded Triton: starts, serves demo v1 over JSON and binary, stops without leftovers, fails fast."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import http
from tunegate import codec
from tunegate.textdata import Tokenizer
from tunegate.triton import (
    EmbeddedTriton,
    TritonDistribution,
    TritonOptions,
    TritonStartError,
    process_group_alive,
    server_env,
)

pytestmark = pytest.mark.triton


def _feeds() -> dict[str, np.ndarray]:
    return Tokenizer()(["The quick brown fox jumps over the lazy dog.", "Servers answer requests."])


def test_serves_demo_v1_json_and_binary(demo_triton: EmbeddedTriton) -> None:
    feeds = _feeds()
    url = f"{demo_triton.http_url}/v2/models/minilm/infer"
    body, hl = codec.encode_request(feeds, binary=False, binary_outputs=False)
    code, _h, raw = http("POST", url, body, {"Content-Type": "application/json"})
    assert code == 200, raw
    as_json = codec.decode_response(raw)
    assert as_json.header["model_version"] == "1"

    body, hl = codec.encode_request(feeds, binary=True)
    code, headers, raw = http("POST", url, body, {codec.HEADER: str(hl)})
    assert code == 200, raw
    as_bin = codec.decode_response(raw, codec.parse_header_length(headers.get(codec.HEADER)))
    a, b = as_json.arrays()["embedding"], as_bin.arrays()["embedding"]
    assert a.shape == (2, 384) and a.dtype == np.float32
    # JSON carries floats as decimal text; both encodings must give the same numbers.
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert np.allclose(np.linalg.norm(b, axis=1), 1.0, atol=1e-5)


def test_stop_leaves_no_process(minilm_onnx_path: Path, demo_repository: Path, tmp_path: Path) -> None:
    server = EmbeddedTriton(TritonOptions(repository=demo_repository, models=("minilm",)), workdir=tmp_path)
    server.start()
    assert server.proc is not None
    pgid = server.proc.pid
    # the python backend stub runs in the same process group
    assert len(process_group_alive(pgid)) >= 2
    server.stop()
    deadline = time.monotonic() + 5
    while process_group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_group_alive(pgid) == []


def test_busy_port_fails_fast_with_message(demo_repository: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = EmbeddedTriton(TritonOptions(repository=demo_repository, http_port=port), workdir=tmp_path)
        t0 = time.monotonic()
        with pytest.raises(TritonStartError, match=f"HTTP port {port} is already in use"):
            server.start()
        assert time.monotonic() - t0 < 5


def test_broken_repository_fails_fast_with_log_tail(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "python"\ninput [ { name: "x" ')
    server = EmbeddedTriton(TritonOptions(repository=repo, models=("broken",)), workdir=tmp_path / "w")
    t0 = time.monotonic()
    with pytest.raises(TritonStartError) as info:
        server.start()
    assert time.monotonic() - t0 < 30
    msg = str(info.value)
    assert "exited with code" in msg and "tritonserver.log" in msg
    assert "broken" in msg  # the log tail names the model that failed


def test_missing_repository_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TritonStartError, match="does not exist"):
        EmbeddedTriton(TritonOptions(repository=tmp_path / "nope")).start()


def test_the_stub_finds_packages_in_this_processs_order(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The python backend's stub is another Python process: a PYTHONPATH entry must come before the site-packages
    there too, as it does here (a PYTHONPATH carrying numpy<2 beside a system numpy 2 otherwise loses in the stub
    alone, and the backend answers empty outputs)."""
    import site

    ours = tmp_path / "pinned"
    monkeypatch.setenv("PYTHONPATH", f"{ours}:{tmp_path / 'second'}")
    paths = server_env(TritonDistribution.locate(), ["/project"])["PYTHONPATH"].split(":")
    assert paths[:3] == ["/project", str(ours), str(tmp_path / "second")], paths
    assert all(paths.index(str(ours)) < paths.index(s) for s in site.getsitepackages()), paths
    monkeypatch.setenv("PYTHONPATH", "relative/dir")
    paths = server_env(TritonDistribution.locate())["PYTHONPATH"].split(":")
    assert paths[0] == os.path.abspath("relative/dir"), paths  # the stub's working directory is another
