"""Locust users that replay a tunegate capture against a KServe v2 endpoint (the sidecar or Triton).

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8080 --capture CAPTURE.jsonl \
        --users 8 --spawn-rate 8 --replay-duration 60

Options (each also from the environment): --capture (TUNEGATE_CAPTURE), --replay-mode exact|synth,
--profile fixed|capture (capture: follow the capture's arrival rate, time-scaled by --time-scale),
--rate (total req/s in fixed mode; 0 = as fast as the users go), --per-user-rate (req/s one user sends in
capture mode), --name-by model|batch|shape, --replay-duration (seconds; 0 = the capture's length in capture mode),
--stop-file (once this file exists the replay ends as if its duration were over: users stop, stats are kept).
With TUNEGATE_PROTOCOL=grpc the same payloads go out as gRPC ModelInfer calls (--host HOST:PORT of a gRPC front).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Any

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import FastHttpUser, LoadTestShape, User, constant_throughput, events, task

from loadtest.replay import ArrivalProfile, Payload, ReplayPlan, Synthesizer, exact_payloads, grpc_request

# Locust runs on gevent: grpc's blocking calls must yield to the other users (Locust's gRPC example does this).
grpc_gevent.init_gevent()
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_MAX_MESSAGE = 1 << 30
# Which user replays: TritonReplayUser (HTTP, the default) or GrpcReplayUser (TUNEGATE_PROTOCOL=grpc). Locust
# spawns every concrete user class of a locustfile, so the other one is abstract.
PROTOCOL = os.environ.get("TUNEGATE_PROTOCOL", "http")


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]  # unannotated in locust
def _options(parser: Any) -> None:
    parser.add_argument(
        "--capture", type=str, env_var="TUNEGATE_CAPTURE", default="", help="capture file or dir"
    )
    parser.add_argument(
        "--replay-mode", choices=["exact", "synth"], env_var="TUNEGATE_REPLAY_MODE", default="exact"
    )
    parser.add_argument(
        "--profile", choices=["fixed", "capture"], env_var="TUNEGATE_PROFILE", default="fixed"
    )
    parser.add_argument("--time-scale", type=float, env_var="TUNEGATE_TIME_SCALE", default=1.0)
    parser.add_argument("--rate", type=float, env_var="TUNEGATE_RATE", default=0.0)
    parser.add_argument("--per-user-rate", type=float, env_var="TUNEGATE_PER_USER_RATE", default=2.0)
    parser.add_argument(
        "--name-by", choices=["model", "batch", "shape"], env_var="TUNEGATE_NAME_BY", default="model"
    )
    parser.add_argument("--replay-duration", type=float, env_var="TUNEGATE_REPLAY_DURATION", default=0.0)
    parser.add_argument("--replay-seed", type=int, env_var="TUNEGATE_REPLAY_SEED", default=0)
    parser.add_argument("--stop-file", type=str, env_var="TUNEGATE_STOP_FILE", default="")


class _Replay:
    """Per-process replay state: payloads handed out in capture order, cycling."""

    def __init__(self, opts: Any) -> None:
        if not opts.capture:
            raise SystemExit("tunegate replay: --capture (or TUNEGATE_CAPTURE) is required")
        self.plan = ReplayPlan.load(opts.capture, opts.replay_mode, opts.name_by)
        self.profile = ArrivalProfile.from_timestamps([r.ts for r in self.plan.records], opts.time_scale)
        self._lock = threading.Lock()
        self._order = itertools.cycle(range(len(self.plan.records)))
        self._exact = exact_payloads(self.plan.records, opts.name_by) if opts.replay_mode == "exact" else None
        self._synth = (
            Synthesizer(self.plan.records, opts.replay_seed) if opts.replay_mode == "synth" else None
        )

    @property
    def exact(self) -> bool:
        return self._exact is not None

    def next(self) -> Payload:
        with self._lock:
            i = next(self._order)
            if self._exact is not None:
                return self._exact[i]
            assert self._synth is not None
            return self._synth.payload(i, self.plan.name_by)


REPLAY: dict[str, _Replay] = {}


@events.init.add_listener  # type: ignore[untyped-decorator]  # unannotated in locust
def _load(environment: Any, **_kw: Any) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    try:
        REPLAY["state"] = _Replay(opts)
    except (ValueError, OSError) as exc:
        # CaptureError is a ValueError: a bad capture stops Locust with the reason, not a traceback.
        raise SystemExit(f"tunegate replay: {exc}") from exc


def _wait(user: Any) -> float:
    """Seconds before a user's next request: the fixed profile's share of --rate, or --per-user-rate."""
    opts = user.environment.parsed_options
    if opts.profile == "capture":
        rate = opts.per_user_rate
    else:
        rate = opts.rate / max(1, opts.num_users) if opts.rate > 0 else 0.0
    return float(constant_throughput(rate)(user)) if rate > 0 else 0.0  # type: ignore[no-untyped-call]  # unannotated in locust


class CaptureReplayUser(FastHttpUser):
    """Replays capture payloads; results reach Locust's stats through FastHttpUser's request events."""

    abstract = True

    def wait_time(self) -> float:
        return _wait(self)

    @task
    def replay(self) -> None:
        p = REPLAY["state"].next()
        with self.client.post(  # type: ignore[no-untyped-call]  # FastHttpSession.post is unannotated in locust
            p.path, data=p.body, headers=p.headers, name=p.name, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")


class TritonReplayUser(CaptureReplayUser):
    abstract = PROTOCOL != "http"


class GrpcReplayUser(User):
    """Replays capture payloads as gRPC ModelInfer calls (--host HOST:PORT, or grpc://HOST:PORT), reporting
    each through `events.request` as Locust's gRPC example does. Answers arrive as bytes, not decoded."""

    abstract = PROTOCOL != "grpc"

    def wait_time(self) -> float:
        return _wait(self)

    def on_start(self) -> None:
        target = (self.host or "").removeprefix("grpc://").rstrip("/")
        options = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
                   ("grpc.max_send_message_length", GRPC_MAX_MESSAGE)]  # fmt: skip
        self.channel = grpc.insecure_channel(target, options=options)
        self.infer = self.channel.unary_unary(GRPC_INFER)
        self.requests: dict[int, bytes] = {}  # exact payloads, serialized once

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def replay(self) -> None:
        p = REPLAY["state"].next()
        key = id(p)
        body = self.requests.get(key) if REPLAY["state"].exact else None
        if body is None:
            body = grpc_request(p)
            if REPLAY["state"].exact:
                self.requests[key] = body
        t0 = time.perf_counter()
        exc: Exception | None = None
        size = 0
        try:
            size = len(self.infer(body, timeout=60))
        except grpc.RpcError as e:
            exc = e
        self.environment.events.request.fire(
            request_type="grpc", name=p.name, response_time=(time.perf_counter() - t0) * 1000,
            response_length=size, exception=exc, context={},
        )  # fmt: skip


class ReplayShape(LoadTestShape):
    """Fixed users for --replay-duration, or the capture's own arrival profile (users = rate / per-user rate)."""

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options if self.runner is not None else None
        if opts is None:
            raise RuntimeError(
                "ReplayShape needs a Locust runner started with the replay's command-line options"
            )
        if opts.stop_file and os.path.exists(opts.stop_file):
            return None  # asked to stop: the run ends as at its duration, through Locust's own stop
        t = self.get_run_time()  # type: ignore[no-untyped-call]  # unannotated in locust
        if opts.profile == "capture":
            profile = REPLAY["state"].profile
            limit = opts.replay_duration or profile.duration_s
            rate = profile.rate_at(t % profile.duration_s)
            if t >= limit or rate is None:
                return None
            users = max(1, math.ceil(rate / opts.per_user_rate))
            return users, float(max(users, opts.spawn_rate))
        if opts.replay_duration and t >= opts.replay_duration:
            return None
        return int(opts.num_users or 1), float(opts.spawn_rate or 1)
