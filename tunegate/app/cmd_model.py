"""`tunegate model prepare|tiny|native`: export the demo model and lay out model repositories."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from tunegate import models
from tunegate.console import CliError, emit_json, err
from tunegate.repository import onnx_version_files, sha256_file, write_config, write_native, write_version


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="prepare the demo model and model repositories")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    prep = msub.add_parser(
        "prepare",
        help="export all-MiniLM-L6-v2 to ONNX (cached) and install it as version 1 of the repository",
    )
    prep.add_argument("--repository", type=Path, default=Path("model_repository"))
    prep.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default $TUNEGATE_CACHE or ~/.cache/tunegate)",
    )
    prep.add_argument("--force", action="store_true", help="re-export even if the cached ONNX exists")
    prep.add_argument("--json", action="store_true", help="machine-readable output")
    prep.set_defaults(func=cmd_prepare)

    tiny = msub.add_parser(
        "tiny", help="write the tiny synthetic model (no torch) as a new version of a repository"
    )
    tiny.add_argument("--repository", type=Path, required=True)
    tiny.add_argument("--name", default=models.TINY)
    tiny.add_argument("--json", action="store_true")
    tiny.set_defaults(func=cmd_tiny)

    native = msub.add_parser(
        "native", help="emit the production form of the demo model (Triton's native onnxruntime backend)"
    )
    native.add_argument("--dest", type=Path, required=True, help="destination model repository")
    native.add_argument("--cache", type=Path, default=None)
    native.add_argument("--json", action="store_true")
    native.set_defaults(func=cmd_native)


def cmd_prepare(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cached = models.cache_dir(args.cache) / "minilm" / "model.onnx"
    if args.force and cached.exists():
        cached.unlink()
    exported = not cached.exists()
    try:
        onnx_path = models.minilm_onnx(args.cache)
        dest = models.install_baseline(args.repository, onnx_path)
    except models.ModelError as exc:
        raise CliError(str(exc)) from exc
    result = {
        "model": models.MINILM,
        "onnx": str(onnx_path),
        "exported": exported,
        "version_dir": str(dest.parent),
        "sha256": sha256_file(dest),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if args.json:
        emit_json(result)
    else:
        err.print(f"[green]ok[/] {'exported' if exported else 'cached'} {onnx_path} -> {dest}")
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    tmp = models.cache_dir() / "tiny" / "model.onnx"
    models.build_tiny(tmp)
    version = write_version(args.repository, args.name, onnx_version_files(tmp))
    cfg = models.tiny_config(args.name)
    write_config(args.repository, dataclasses.replace(cfg, versions=(version,)))
    if args.json:
        emit_json({"model": args.name, "version": version})
    else:
        err.print(f"[green]ok[/] {args.name} version {version} in {args.repository}")
    return 0


def cmd_native(args: argparse.Namespace) -> int:
    onnx_path = models.minilm_onnx(args.cache)
    native = models.minilm_native_config()
    path = write_native(args.dest, native, onnx_path)
    if args.json:
        emit_json({"config": str(path)})
    else:
        err.print(f"[green]ok[/] wrote {path}")
    return 0
