"""`tunegate triton`: run the embedded Triton in the foreground until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from tunegate.console import CliError, emit_json, err
from tunegate.triton import EmbeddedTriton, TritonError, TritonOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "triton", help="run the embedded Triton server (pytriton's tritonserver) in the foreground"
    )
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument(
        "--model", action="append", default=None, help="model to load at start (repeatable; default: all)"
    )
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help="print the endpoints as JSON once ready")
    p.set_defaults(func=cmd_triton)


def cmd_triton(args: argparse.Namespace) -> int:
    models = args.model
    if models is None:
        models = (
            sorted(d.name for d in args.repository.iterdir() if d.is_dir() and (d / "config.pbtxt").exists())
            if args.repository.is_dir()
            else []
        )
    server = EmbeddedTriton(
        TritonOptions(
            repository=args.repository,
            models=tuple(models),
            http_port=args.http_port or None,
            grpc_port=args.grpc_port or None,
            metrics_port=args.metrics_port or None,
            startup_timeout_s=args.startup_timeout,
        )
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server.start()
    except TritonError as exc:
        raise CliError(str(exc), code=1) from exc
    try:
        info = {
            "http": server.http_url,
            "grpc_port": server.grpc_port,
            "metrics": server.metrics_url,
            "models": list(models),
            "log": str(server.log_path),
        }
        if args.json:
            emit_json(info)
        else:
            err.print(
                f"[green]Triton ready[/] http={server.http_url} metrics={server.metrics_url} "
                f"models={','.join(models) or '-'} (Ctrl-C stops)"
            )
        while not stop.wait(0.5):
            if server.proc is None or server.proc.poll() is not None:
                raise CliError(f"tritonserver exited unexpectedly:\n{server.log_tail()}", code=1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
