"""Memory per version in the canary's evidence, mirroring that keeps request semantics, and the sampled requests
that give no evidence (each counted as skipped, with its reason).

Pure checks first (the judge's memory check, the config parse, the per-request sequence check); then a real
Triton (python backend, CPU) with the production sidecar (`sidecar.app.start`) in the test's event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from tritonclient.grpc import InferInput
from tritonclient.grpc import aio as grpcaio

from sidecar import mirror_job
from sidecar.app import RunningSidecar, start
from sidecar.config import CanaryParams, ConfigError, SidecarConfig
from sidecar.control import shadow_name
from sidecar.judge import CONTINUE, PIN, Evidence, JudgeParams, judge
from sidecar.memory import MemoryProbe
from sidecar.semantics import ModelSemantics, _parse_text, parse_model_config, sequence_request
from tests.sidecar_models import FAST_PARAMS, TOKEN, add_model
from tunegate import codec
from tunegate.repository import write_version
from tunegate.triton import EmbeddedTriton, TritonOptions

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MiB = 1 << 20


# -- the judge's memory check (no server) ---------------------------------------------------------
@pytest.mark.parametrize(
    ("memory", "pinned"),
    [
        ({"candidate": 400 * MiB, "baseline": 100 * MiB}, True),  # 4x
        ({"candidate": 160 * MiB, "baseline": 100 * MiB}, True),  # just over 1.5x
        ({"candidate": 140 * MiB, "baseline": 100 * MiB}, False),
        ({"candidate": 50 * MiB, "baseline": 100 * MiB}, False),  # smaller is fine
        ({"candidate": 400 * MiB}, False),  # the baseline unknown: nothing to compare with
        ({}, False),
    ],
)
def test_judge_pins_on_memory_only_when_both_are_known_and_the_ratio_exceeds(memory: dict[str, float],
                                                                              pinned: bool) -> None:  # fmt: skip
    j = judge(Evidence(memory=memory), JudgeParams(), now=0.0, deadline=100.0)
    assert (j.outcome is PIN) is pinned
    mem_reasons = [r for r in j.reasons if "memory" in r]
    if pinned:
        assert len(mem_reasons) == 1
        c, b = memory["candidate"] / MiB, memory["baseline"] / MiB
        assert f"{c:.1f} MiB" in mem_reasons[0] and f"{b:.1f} MiB" in mem_reasons[0]
        assert j.stats["memory"]["ratio"] == pytest.approx(c / b)
    else:
        assert j.outcome is CONTINUE and not mem_reasons
    assert j.stats["memory"]["max_ratio"] == 1.5


def test_memory_ratio_is_a_validated_canary_parameter() -> None:
    assert CanaryParams.from_dict({"max_memory_ratio": 3}).judge_params().max_memory_ratio == 3.0
    j = judge(Evidence(memory={"candidate": 250 * MiB, "baseline": 100 * MiB}), JudgeParams(max_memory_ratio=3.0),
              now=0.0, deadline=100.0)  # fmt: skip
    assert j.outcome is CONTINUE
    for bad in (0, -1.0, float("nan"), "2"):
        with pytest.raises(ConfigError, match="max_memory_ratio"):
            CanaryParams.from_dict({"max_memory_ratio": bad})


# -- semantics (no server) --------------------------------------------------------------------------
CONFIGS = {
    'name: "m"\nbackend: "python"\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] } ]\n': (False, False, "python"),
    'name: "m"\nplatform: "onnxruntime_onnx"\nsequence_batching { max_sequence_idle_microseconds: 5000000 }\n':
        (True, False, "onnxruntime_onnx"),
    'name: "m"\nbackend: "python"\nsequence_batching: {}\n': (True, False, "python"),
    'name: "m"\nbackend: "python"\nmodel_transaction_policy { decoupled: true }\n': (False, True, "python"),
    'name: "m"\nbackend: "python"\nmodel_transaction_policy: { decoupled: False }\n': (False, False, "python"),
    # comments and strings that mention the fields are not the fields
    'name: "m" # sequence_batching { }\nbackend: "python"\nparameters { key: "sequence_batching" '
    'value: { string_value: "decoupled: true" } }\n': (False, False, "python"),
    'name: "m"\nbackend: "tensorrt"\ninstance_group [ { count: 2 kind: KIND_GPU } ]\n'
    'model_transaction_policy <decoupled: 1>\n': (False, True, "tensorrt"),
}  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), list(CONFIGS.items()))
def test_model_config_semantics_with_protobuf_and_with_the_text_parse(text: str,
                                                                      expected: tuple[bool, bool, str]) -> None:  # fmt: skip
    for parse in (parse_model_config, _parse_text):
        sem = parse(text)
        assert (sem.sequence, sem.decoupled, sem.backend) == expected, parse
    assert ModelSemantics.from_dict(parse_model_config(text).to_dict()) == parse_model_config(text)


def test_sequence_parameters_are_found_in_the_json_header_only() -> None:
    x = {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}
    plain = json.dumps({"inputs": [x]}).encode()
    assert not sequence_request(plain, [(b"Content-Type", b"application/json")])
    for params in (
        {"sequence_id": 7},
        {"sequence_id": "abc", "sequence_start": True},
        {"sequence_end": True},
    ):
        body = json.dumps({"inputs": [x], "parameters": params}).encode()
        assert sequence_request(body, [])
    # an input named like a parameter is not one
    assert not sequence_request(json.dumps({"inputs": [{**x, "name": "sequence_id"}]}).encode(), [])
    # binary tensors: only the JSON header is searched, not the tensor bytes after it
    rng = np.random.default_rng(0)
    body, hl = codec.encode_request({"x": rng.standard_normal((2, 4)).astype(np.float32)}, binary=True)
    assert hl is not None
    headers = [(b"Inference-Header-Content-Length", str(hl).encode())]
    assert not sequence_request(body + b'"sequence_id"', headers)
    head = json.loads(body[:hl])
    head["parameters"] = {"sequence_id": 3}
    new_head = json.dumps(head).encode()
    assert sequence_request(
        new_head + body[hl:], [(b"inference-header-content-length", str(len(new_head)).encode())]
    )


def test_memory_is_unknown_with_a_reason_where_triton_runs_elsewhere(tmp_path: Path) -> None:
    """A sidecar that sees no Triton processes (a fake, empty /proc: the seam) reports unknown, never fails."""
    fake_proc = tmp_path / "proc"
    fake_proc.mkdir()
    targets = {"candidate": ("m__canary", 2), "baseline": ("m__canary", 1)}
    r = MemoryProbe(
        tmp_path, "http://triton.invalid:8000", targets, "python", proc=fake_proc, gpu=False
    ).read()
    assert (
        r.bytes == {}
        and r.unknown is not None
        and "another host" in r.unknown
        and "triton.invalid" in r.unknown
    )
    r = MemoryProbe(tmp_path, "http://triton:8000", targets, "tensorrt", proc=fake_proc, gpu=False).read()
    assert r.bytes == {} and r.unknown is not None and "tensorrt" in r.unknown


# -- against a real Triton ------------------------------------------------------------------------------
SEQ_MODEL_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Running sum per sequence: y = the sum of the sequence's inputs so far."""

    def initialize(self, args):
        self.state = {}

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            cid = r.correlation_id()
            acc = self.state.get(cid, np.zeros_like(x)) + x
            self.state[cid] = acc
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", acc.astype(np.float32))]))
        return out
'''
IO = 'input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\noutput [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]\n'
MODELS = ("memsame", "memhungry", "seqsum", "seqparams", "noout", "mirrorbug")


def _seq_model(repo: Path, name: str) -> None:
    for v in (1, 2):
        write_version(repo, name, {"model.py": SEQ_MODEL_PY}, version=v,
                      release={"tolerance": {"y": {"metric": "linf", "threshold": 1e-3}}})  # fmt: skip
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\nversion_policy: {{ specific: {{ versions: [ 1 ] }} }}\n'
        + IO + "sequence_batching { max_sequence_idle_microseconds: 10000000 }\n"
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )  # fmt: skip


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("semantics-repo")
    add_model(repo, "memsame", {2: {}})
    add_model(repo, "memhungry", {2: {"alloc_mb": 200}})
    add_model(repo, "seqparams", {2: {}})
    add_model(repo, "noout", {2: {}}, baseline={"no_output": True})
    add_model(repo, "mirrorbug", {2: {}})
    _seq_model(repo, "seqsum")
    return repo


@pytest.fixture(scope="module")
def triton(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(
        TritonOptions(repository=repo, models=MODELS), workdir=tmp_path_factory.mktemp("t")
    )
    server.start()
    yield server
    server.stop()


class Sidecar:
    def __init__(self, url: str, registry: CollectorRegistry) -> None:
        self.url, self.registry = url, registry

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


@pytest.fixture
async def sidecar(triton: EmbeddedTriton, repo: Path, tmp_path: Path) -> AsyncIterator[Sidecar]:
    registry = CollectorRegistry()
    cfg = SidecarConfig(upstream=triton.http_url, state_dir=tmp_path / "state", repository=repo, listen_port=0,
                        admin_token=TOKEN, judge_interval_s=0.2, canary=CanaryParams())  # fmt: skip
    running: RunningSidecar = await start(cfg, registry)
    yield Sidecar(f"http://127.0.0.1:{running.port}", registry)
    await running.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def start_canary(client: aiohttp.ClientSession, sc: Sidecar, model: str, **body: Any) -> Any:
    async with client.post(
        f"{sc.url}/canary/{model}", json={"candidate": 2, **FAST_PARAMS, **body}, headers=AUTH
    ) as r:
        assert r.status == 201, await r.text()
        return await r.json()


async def status(client: aiohttp.ClientSession, sc: Sidecar, model: str) -> Any:
    async with client.get(f"{sc.url}/canary/{model}", headers=AUTH) as r:
        return await r.json()


async def wait_for(
    client: aiohttp.ClientSession, sc: Sidecar, model: str, pred: Any, timeout_s: float = 30
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        st = await status(client, sc, model)
        if pred(st) or time.monotonic() > deadline:
            return st
        await asyncio.sleep(0.2)


@pytest.mark.triton
async def test_memory_of_both_versions_is_in_status_and_metrics(
    sidecar: Sidecar, client: aiohttp.ClientSession
) -> None:
    await start_canary(client, sidecar, "memsame", deadline_s=120)
    st = await wait_for(client, sidecar, "memsame", lambda s: len(s["canary"]["evidence"]["memory"]) == 2)
    c = st["canary"]
    mem = c["evidence"]["memory"]
    assert c["memory"]["unknown"] is None and c["memory"]["kind"] == "rss", c["memory"]
    assert mem["candidate"] > MiB and mem["baseline"] > MiB, mem
    # the same model in two versions: similar memory, not pinned on it
    assert 0.67 < mem["candidate"] / mem["baseline"] < 1.5, mem
    assert (
        c["memory"]["candidate"]["model"] == shadow_name("memsame")
        and c["memory"]["candidate"]["processes"] >= 1
    )
    for role, version in (("candidate", "2"), ("baseline", "1")):
        value = sidecar.metric("tunegate_model_memory_bytes", model="memsame", version=version, role=role)
        assert value is not None and value > MiB, (role, value)
    st = await wait_for(client, sidecar, "memsame", lambda s: s["canary"]["judgement"] is not None)
    assert st["canary"]["judgement"]["stats"]["memory"]["ratio"] < 1.5
    assert st["state"] == "running" and not any("memory" in r for r in st["canary"]["judgement"]["reasons"])
    async with client.post(f"{sidecar.url}/canary/memsame/pin", headers=AUTH) as r:
        assert r.status == 200
    await asyncio.sleep(0.5)  # a judge tick: an ended canary's memory leaves the exposition
    assert (
        sidecar.metric("tunegate_model_memory_bytes", model="memsame", version="2", role="candidate") is None
    )


@pytest.mark.triton
async def test_a_candidate_that_takes_much_more_memory_is_pinned(
    sidecar: Sidecar, client: aiohttp.ClientSession
) -> None:
    await start_canary(client, sidecar, "memhungry", deadline_s=120)
    st = await wait_for(client, sidecar, "memhungry", lambda s: s["state"] != "running")
    assert st["state"] == "pinned", st
    reasons = st["last"]["reasons"]
    assert any("memory" in r and "MiB" in r for r in reasons), reasons
    async with client.get(f"{sidecar.url}/canary/memhungry/decisions", headers=AUTH) as r:
        rec = (await r.json())["decisions"][-1]
    mem = rec["evidence"]["memory"]
    assert mem["candidate_bytes"] - mem["baseline_bytes"] > 150 * MiB and mem["ratio"] > 1.5, mem
    assert f"{mem['candidate_bytes'] / MiB:.1f} MiB" in " ".join(reasons)


async def _infer(client: aiohttp.ClientSession, url: str, model: str, x: np.ndarray[Any, Any],
                 params: dict[str, Any] | None) -> tuple[int, Any]:  # fmt: skip
    body: dict[str, Any] = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                        "data": x.ravel().tolist()}]}  # fmt: skip
    if params:
        body["parameters"] = params
    async with client.post(f"{url}/v2/models/{model}/infer", json=body) as r:
        return r.status, await r.json()


async def _shadow_inferences(client: aiohttp.ClientSession, triton: EmbeddedTriton, model: str) -> int:
    async with client.get(f"{triton.http_url}/v2/models/{shadow_name(model)}/stats") as r:
        stats = await r.json()
    return sum(int(m["inference_stats"]["success"]["count"]) for m in stats["model_stats"])


@pytest.mark.triton
async def test_sequence_requests_pass_through_intact_and_are_not_mirrored(
    sidecar: Sidecar, client: aiohttp.ClientSession, triton: EmbeddedTriton
) -> None:
    # Primary pairing with every request also replayed to the baseline: a mirrored step would reach the
    # client-serving instance twice and break the client's running sums.
    await start_canary(client, sidecar, "seqsum", latency_pairing="primary", aa_rate=1.0, deadline_s=120)
    rng = np.random.default_rng(0)
    steps, seqs = 6, (11, 12, 13)
    sums = {s: np.zeros((1, 4), np.float32) for s in seqs}
    for s in seqs:  # one after another: the model's one instance holds one sequence at a time
        for i in range(steps):
            x = rng.standard_normal((1, 4)).astype(np.float32)
            sums[s] += x
            params = {"sequence_id": s, "sequence_start": i == 0, "sequence_end": i == steps - 1}
            code, out = await _infer(client, sidecar.url, "seqsum", x, params)
            assert code == 200, out
            np.testing.assert_allclose(
                np.asarray(out["outputs"][0]["data"]).reshape(1, 4), sums[s], rtol=1e-5
            )
    await asyncio.sleep(0.5)  # anything mirrored would have been sent by now
    n = steps * len(seqs)
    assert sidecar.metric("tunegate_mirror_skipped_total", model="seqsum", reason="sequence") == n
    assert sidecar.metric("tunegate_mirror_sampled_total", model="seqsum", role="candidate") == 0
    assert await _shadow_inferences(client, triton, "seqsum") == 0
    st = await status(client, sidecar, "seqsum")
    assert st["canary"]["evidence"]["skipped"] == {"sequence": n}
    assert st["canary"]["semantics"]["sequence"] is True


@pytest.mark.triton
async def test_requests_with_sequence_parameters_are_not_mirrored_the_others_are(
    sidecar: Sidecar, client: aiohttp.ClientSession, triton: EmbeddedTriton
) -> None:
    await start_canary(client, sidecar, "seqparams", latency_pairing="primary", aa_rate=0.0, max_in_flight=32,
                       deadline_s=120)  # fmt: skip
    rng = np.random.default_rng(1)
    for i in range(20):
        params = {"sequence_id": 100 + i, "sequence_start": True} if i % 2 else None
        code, out = await _infer(
            client, sidecar.url, "seqparams", rng.standard_normal((2, 4)).astype(np.float32), params
        )
        assert code == 200, out
    st = await wait_for(
        client, sidecar, "seqparams", lambda s: s["canary"]["evidence"]["sent"] >= 10, timeout_s=10
    )
    assert st["canary"]["evidence"]["skipped"] == {"sequence": 10}
    assert st["canary"]["evidence"]["sent"] == 10
    assert sidecar.metric("tunegate_mirror_skipped_total", model="seqparams", reason="sequence") == 10
    assert sidecar.metric("tunegate_mirror_sampled_total", model="seqparams", role="candidate") == 10
    assert await _shadow_inferences(client, triton, "seqparams") == 10
    assert st["canary"]["semantics"] == {"sequence": False, "decoupled": False, "backend": "python"}


def _skipped(st: Any) -> int:
    return sum(st["canary"]["evidence"]["skipped"].values())


@pytest.mark.triton
async def test_primary_answers_the_comparison_cannot_use_are_counted_as_skipped(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    # The live version answers 200 without its output, as a python-backend model whose stub misreads its numpy
    # arrays answers with an output that has no data: nothing to compare the candidate's answer with. Over HTTP
    # and the gRPC front alike, each such sampled request is counted as skipped, none as a comparison.
    registry = CollectorRegistry()
    cfg = SidecarConfig(upstream=triton.http_url, upstream_grpc=triton.grpc_address, grpc_listen=("127.0.0.1", 0),
                        state_dir=tmp_path / "state", repository=repo, listen_port=0, admin_token=TOKEN,
                        judge_interval_s=0.2, canary=CanaryParams())  # fmt: skip
    running = await start(cfg, registry)
    sc = Sidecar(f"http://127.0.0.1:{running.port}", registry)
    try:
        await start_canary(client, sc, "noout", latency_pairing="primary", aa_rate=0.0, max_in_flight=32,
                           deadline_s=120)  # fmt: skip
        rng = np.random.default_rng(2)
        for _ in range(10):
            x = rng.standard_normal((2, 4)).astype(np.float32)
            code, out = await _infer(client, sc.url, "noout", x, None)
            assert code == 200 and out["outputs"] == [], out
        await asyncio.sleep(0.2)  # the compiled gRPC front has the routing table (sent every 50 ms)
        via = grpcaio.InferenceServerClient(f"127.0.0.1:{running.grpc_port}")
        try:
            for _ in range(10):
                inp = InferInput("x", [2, 4], "FP32")
                inp.set_data_from_numpy(rng.standard_normal((2, 4)).astype(np.float32))
                assert not (await via.infer("noout", [inp])).get_response().outputs
        finally:
            await via.close()
        st = await wait_for(client, sc, "noout", lambda s: _skipped(s) >= 20, timeout_s=10)
        ev = st["canary"]["evidence"]
        # Not compared; the candidate answered each (no error), which the error rate counts.
        assert ev["skipped"] == {"primary_unusable": 20} and ev["compared"] == 0, ev
        assert ev["sent"] == 20 and ev["errors"] == 0, ev
        assert sc.metric("tunegate_mirror_skipped_total", model="noout", reason="primary_unusable") == 20
        assert sc.metric("tunegate_mirror_sampled_total", model="noout", role="candidate") == 20
    finally:
        await running.close()


@pytest.mark.triton
async def test_a_mirror_that_fails_in_the_sidecar_is_counted_as_skipped(
    sidecar: Sidecar, client: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object, **_kw: object) -> None:
        raise RuntimeError("a fault in the comparison")

    monkeypatch.setattr(mirror_job, "compare_responses", broken)
    await start_canary(client, sidecar, "mirrorbug", latency_pairing="primary", aa_rate=0.0, max_in_flight=32,
                       deadline_s=120)  # fmt: skip
    rng = np.random.default_rng(3)
    for _ in range(10):
        code, out = await _infer(
            client, sidecar.url, "mirrorbug", rng.standard_normal((2, 4)).astype(np.float32), None
        )
        assert code == 200, out
    st = await wait_for(client, sidecar, "mirrorbug", lambda s: _skipped(s) >= 10, timeout_s=10)
    ev = st["canary"]["evidence"]
    assert ev["skipped"] == {"internal": 10} and ev["sent"] == 0, ev
    assert sidecar.metric("tunegate_mirror_skipped_total", model="mirrorbug", reason="internal") == 10
    assert st["canary"]["in_flight"] == 0  # every job ended and gave its slot back
