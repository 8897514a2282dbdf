"""`tunegate demo`: the main job on the embedded default (prepare the model, serve it on Triton, infer)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from tunegate import models
from tunegate.console import CliError, emit_json, err, out
from tunegate.textdata import Tokenizer
from tunegate.triton import EmbeddedTriton, TritonError, TritonOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded Triton (prepare, serve, infer)")
    p.add_argument("--repository", type=Path, default=Path("model_repository"))
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--text", default="Triton serves the baseline while tunegate judges the candidate.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import tritonclient.http as httpclient

    t0 = time.perf_counter()
    with err.status("preparing the demo model (first run exports MiniLM to ONNX)"):
        try:
            onnx_path = models.minilm_onnx(args.cache)
            models.install_baseline(args.repository, onnx_path)
        except models.ModelError as exc:
            raise CliError(str(exc)) from exc
    t_prepared = time.perf_counter()
    server = EmbeddedTriton(TritonOptions(repository=args.repository, models=(models.MINILM,)))
    with err.status("starting the embedded Triton"):
        try:
            server.start()
        except TritonError as exc:
            raise CliError(str(exc), code=1) from exc
    try:
        t_ready = time.perf_counter()
        feeds = Tokenizer()([args.text])
        client = httpclient.InferenceServerClient(server.http_address)
        try:
            inputs = []
            for name, arr in feeds.items():
                inp = httpclient.InferInput(name, list(arr.shape), "INT64")
                inp.set_data_from_numpy(arr, binary_data=True)
                inputs.append(inp)
            result = client.infer(models.MINILM, inputs)
        finally:
            client.close()
        emb = result.as_numpy("embedding")
        t_first = time.perf_counter()
    finally:
        server.stop()
    if emb is None:
        raise CliError("Triton returned no 'embedding' output", code=1)
    summary = {
        "model": models.MINILM,
        "version": result.get_response().get("model_version"),
        "text": args.text,
        "embedding_shape": list(emb.shape),
        "embedding_norm": float(np.linalg.norm(emb[0])),
        "embedding_head": [round(float(x), 6) for x in emb[0, :8]],
        "seconds": {
            "prepare": round(t_prepared - t0, 2),
            "triton_ready": round(t_ready - t_prepared, 2),
            "to_first_inference": round(t_first - t0, 2),
        },
    }
    if args.json:
        emit_json(summary)
    else:
        out.print(f"[bold]{models.MINILM}[/] v{summary['version']} embedding of {args.text!r}")
        out.print(f"  shape {summary['embedding_shape']}, L2 norm {summary['embedding_norm']:.6f}")
        out.print(f"  first values {summary['embedding_head']}")
        s = summary["seconds"]
        out.print(f"  time to first inference {s['to_first_inference']}s (prepare {s['prepare']}s, Triton ready {s['triton_ready']}s)")
    return 0
