"""Sidecar configuration at the edge: TOML plus flags, validated once, clear errors; the bounded mirror task set."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import CanaryParams, ConfigError, load_config
from sidecar.mirror import MirrorSlots


def test_toml_and_flags(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("0123456789abcdef-token\n")
    cfg_file = tmp_path / "s.toml"
    cfg_file.write_text(
        f'listen = "0.0.0.0:9000"\nupstream = "http://triton:8000"\nrepository = "{tmp_path}"\n'
        f'state_dir = "{tmp_path / "st"}"\nadmin_token_file = "{tmp_path / "token"}"\n'
        "[canary]\nmin_samples = 50\ndeadline_s = 120\n"
    )
    cfg = load_config(cfg_file, {"upstream": "http://127.0.0.1:8001", "listen": None})
    assert (cfg.listen_host, cfg.listen_port) == ("0.0.0.0", 9000)
    assert cfg.upstream == "http://127.0.0.1:8001"  # a flag beats the file
    assert cfg.admin_token == "0123456789abcdef-token"
    assert cfg.canary.min_samples == 50 and cfg.canary.deadline_s == 120.0 and cfg.canary.sample_rate == 1.0


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('upstream = "triton:8000"', r"http\(s\) URL"),
        ('upstream = "http://x"\nlisten = "nope"', "host:port"),
        ('upstream = "http://x"\nbogus = 1', "unknown settings"),
        ('upstream = "http://x"\n[canary]\nsample_rate = 0', "sample_rate"),
        ('upstream = "http://x"\n[canary]\nmin_sample = 3', "unknown canary parameters"),
        ('upstream = "http://x"\ncapture_rate = 0.5', "capture_dir"),
        ("upstream = ", "not valid TOML"),
        ('upstream = "http://x"\ngrpc_listen = "127.0.0.1:8081"', "needs upstream_grpc"),
        ('upstream = "http://x"\nupstream_grpc = "t:8001"\ngrpc_listen = "8081"', "host:port"),
        ('upstream = "http://x"\ngrpc_max_message_bytes = 0', "grpc_max_message_bytes"),
        ('upstream = "http://x"\ngrpc_front = "fast"', "grpc_front must be one of auto, native, python"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, toml: str, message: str) -> None:
    f = tmp_path / "s.toml"
    f.write_text(toml + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(f, {"repository": tmp_path, "state_dir": tmp_path / "st"})


def test_canary_params_from_request_body() -> None:
    base = CanaryParams(min_samples=500)
    p = CanaryParams.from_dict({"deadline_s": 90, "required_speedup": 1.2}, base)
    assert (
        p.min_samples == 500
        and p.deadline_s == 90.0
        and p.judge_params().max_ratio == pytest.approx(1.05 / 1.2)
    )
    for bad in ({"max_in_flight": 0}, {"confidence": 1.0}, {"timeout_s": "5"}, {"aa_rate": 2}):
        with pytest.raises(ConfigError):
            CanaryParams.from_dict(bad)
    # Sets of instances for the latency verdict: shadow pairing only (primary pairing never reloads the live model).
    assert (
        CanaryParams().judge_params().placements == 2 and CanaryParams().judge_params().placement_pairs == 200
    )
    assert CanaryParams(latency_pairing="primary").judge_params().placements == 1
    for bad in ({"placements": 0}, {"placements": 5}, {"placements": 2.0}, {"placement_pairs": 49},
                {"placement_pairs": 1001}):  # fmt: skip
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CanaryParams.from_dict(bad)


def test_cli_exits_2_on_bad_config(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tunegate.app.cli", "sidecar", "--upstream", "http://x", "--repository", str(tmp_path / "no"),
         "--state-dir", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "is not a directory" in out.stderr


def test_a_required_compiled_grpc_front_that_is_missing_is_a_clear_error(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tunegate.app.cli", "sidecar", "--upstream", "http://x", "--repository", str(tmp_path),
         "--state-dir", str(tmp_path), "--upstream-grpc", "127.0.0.1:1", "--grpc-listen", "127.0.0.1:0",
         "--grpc-front", "native"],
        check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, "TUNEGATE_GRPC_FRONT": str(tmp_path / "missing")},
    )  # fmt: skip
    assert out.returncode == 2 and "tunegate-grpc-front is not installed" in out.stderr, out.stderr


async def test_mirror_slots_drop_when_full_and_close_on_drain() -> None:
    slots = MirrorSlots(2)
    assert slots.acquire() and slots.acquire()
    assert not slots.acquire()  # full: the offer is dropped
    slots.release()
    assert slots.acquire() and len(slots) == 2
    slots.release()
    asyncio.get_running_loop().call_later(0.05, slots.release)  # one mirror finishes while draining
    assert await slots.drain(timeout_s=2) == 0 and slots.closed
    assert not slots.acquire()  # a decided canary mirrors no more
    slots2 = MirrorSlots(1)
    told: list[bool] = []
    slots2.listener = told.append  # what the compiled gRPC front hears: the pair out, back, closed
    assert slots2.acquire() and told == [True]
    assert not slots2.acquire() and told == [True]  # refused: nothing new to tell
    slots2.release()
    assert told == [True, False]
    assert slots2.acquire()
    assert await slots2.drain(timeout_s=0.02) == 1  # left behind: its answer will be ignored
    assert told == [True, False, True, False]  # closed: no stale "out" left with the front
    slots2.release()  # the late answer
    assert told == [True, False, True, False]


async def test_unreachable_upstream_is_a_clear_502(tmp_path: Path) -> None:
    import aiohttp
    from prometheus_client import CollectorRegistry

    from sidecar.app import start
    from sidecar.config import SidecarConfig
    from tunegate.triton import free_port

    cfg = SidecarConfig(upstream=f"http://127.0.0.1:{free_port()}", state_dir=tmp_path / "st", repository=tmp_path,
                        admin_token="0123456789abcdef-token")  # fmt: skip
    registry = CollectorRegistry()
    running = await start(dataclasses.replace(cfg, listen_port=0), registry)
    url = f"http://127.0.0.1:{running.port}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v2/models/m/infer", data=b"{}") as r:
                assert r.status == 502 and "unreachable" in (await r.json())["error"]
            async with s.get(f"{url}/v2/health/ready") as r:
                assert r.status == 502
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200  # the sidecar itself stays up
    finally:
        await running.close()
    # A model the repository does not hold is counted under "other" (bounded labels, sidecar.metrics).
    assert registry.get_sample_value("tunegate_requests_total", {"model": "other", "version": "other", "role": "primary",
                                                                 "code": "502"}) == 1  # fmt: skip
