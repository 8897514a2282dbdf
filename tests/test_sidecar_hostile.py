"""Hostile input through a real sidecar process in front of a real Triton: random and mutated requests.

Hypothesis generates raw bytes and mutations of valid requests (flipped, cut, repeated, with clashing framing
headers or huge shapes); each goes over its own connection, which is then half-closed. Whatever arrives, the
sidecar answers with a well-formed HTTP/1.1 response that is not a 5xx (or closes without an answer when the
request never completed), Triton stays up, and a good request is served after every example.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sidecar.client import SidecarProcess, write_token_file
from tests.sidecar_models import TOKEN, add_model, infer_body
from tunegate.triton import EmbeddedTriton, TritonOptions

pytestmark = [pytest.mark.triton, pytest.mark.slow]
BODY, _ = infer_body(np.random.default_rng(0))
GOOD = (b"POST /v2/models/plain/versions/1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))  # fmt: skip
BINARY_HEAD = (
    b'{"inputs":[{"name":"x","shape":[2,4],"datatype":"FP32","parameters":{"binary_data_size":32}}]}'
)
GOOD_BINARY = (b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nInference-Header-Content-Length: %d\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(BINARY_HEAD), len(BINARY_HEAD) + 32, BINARY_HEAD + b"\0" * 32))  # fmt: skip
TEMPLATES = [GOOD, GOOD_BINARY, b"GET /v2/models/plain/config HTTP/1.1\r\nHost: x\r\n\r\n",
             b"POST /canary/plain HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
             + b"\r\nContent-Length: 17\r\n\r\n{\"candidate\": 9}",
             b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n0\r\n\r\n"]  # fmt: skip
INSERTS = [
    b"\r\n",
    b"Content-Length: 5\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"\x00",
    b"%",
    b"..",
    b"/",
    b"Expect: 100-continue\r\n",
    b'"shape":[99999999999]',
    b"Connection: close\r\n",
    b" ",
    b"\xff",
]


@pytest.fixture(scope="module")
def sidecar_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    work = tmp_path_factory.mktemp("hostile")
    add_model(work / "repo", "plain", {})
    with EmbeddedTriton(TritonOptions(repository=work / "repo", models=("plain",)), workdir=work / "t") as triton, \
            SidecarProcess(upstream=triton.http_url, state_dir=work / "state", repository=work / "repo",
                           token_file=write_token_file(work / "token", TOKEN)) as sc:  # fmt: skip
        yield sc.port


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the sidecar answered and closed while we were still sending
            pass
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:
            pass
        return out


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(min_size=1, max_size=600))
    data = bytearray(draw(st.sampled_from(TEMPLATES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 40))]
        elif op == "insert":
            data[at:at] = draw(st.sampled_from(INSERTS))
        else:
            data[at:at] = bytes(data[at : at + draw(st.integers(1, 60))])
    return bytes(data)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])  # fmt: skip
@given(data=hostile())
# Triton's 500 "Unable to parse 'inputs'" (and 'data'), answered as 400
@example(data=GOOD.replace(b'"inputs"', b'"hnputs"'))
@example(data=GOOD.replace(b'"data"', b'"dbta"'))
def test_hostile_requests_get_a_clear_answer_and_nothing_breaks(sidecar_port: int, data: bytes) -> None:
    out = exchange(sidecar_port, data)
    for line in [x for x in out.split(b"\r\n") if x.startswith(b"HTTP/1.1 ")]:
        status = int(line.split(b" ", 2)[1])
        assert status < 500, (data[:300], out[:500])
    if out:
        assert out.startswith(b"HTTP/1.1 "), (data[:300], out[:300])
    assert exchange(sidecar_port, GOOD.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")).startswith(
        b"HTTP/1.1 200"), data[:300]  # fmt: skip
