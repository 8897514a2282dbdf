"""Builders by name: `onnxruntime`, `tensorrt`, `inductor`, or `package.module:Class` for one outside this package."""

from __future__ import annotations

import importlib

from tuner.builders.base import Artifact, BuildContext, Builder, BuildError

BUILDERS = {
    "onnxruntime": "tuner.builders.ort:OrtBuilder",
    "tensorrt": "tuner.builders.tensorrt:TensorRTBuilder",
    "inductor": "tuner.builders.inductor:InductorBuilder",
}

__all__ = ["BUILDERS", "Artifact", "BuildContext", "BuildError", "Builder", "get_builder"]


def get_builder(ref: str) -> Builder:
    """The builder named `ref` (a key of BUILDERS or `module:Class`)."""
    target = BUILDERS.get(ref, ref)
    if ":" not in target:
        raise BuildError(f"unknown backend {ref!r}: expected one of {', '.join(BUILDERS)} or module:Class")
    module, _, cls = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise BuildError(f"backend {ref!r}: cannot import {target} ({exc})") from exc
    if not (isinstance(obj, type) and issubclass(obj, Builder)):
        raise BuildError(f"backend {ref!r}: {target} is not a Builder")
    return obj()
