"""Torch model factories for the Inductor builder, built from their configs with a fixed seed (no downloads).

Each factory takes no arguments and returns an eval-mode module whose forward takes the inputs
named in `INTERFACES[name]` in that order and returns a tuple of tensors named by its outputs.
`export_onnx` writes the source ONNX (the tuner's interface and reference) from the same factory.

  tiny        MLP with LayerNorm (x[N,16] -> y[N,8], score[N,1]): CPU tests
  tiny_bert   a 2-layer BERT (hidden 64): CPU tests of the transformer path
  bert_base   transformers BertModel(BertConfig()) (110M parameters)
  resnet50    transformers ResNetModel(ResNetConfig()) (ResNet-50 layout, 25M parameters)
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

SEED = 0


@dataclasses.dataclass(frozen=True)
class Interface:
    inputs: tuple[
        tuple[str, str, tuple[int | str, ...]], ...
    ]  # (name, torch dtype name, dims; str = symbolic)
    outputs: tuple[tuple[str, tuple[int | str, ...]], ...]


BERT_IO = Interface(
    inputs=(
        ("input_ids", "int64", ("batch", "sequence")),
        ("attention_mask", "int64", ("batch", "sequence")),
    ),
    outputs=(("last_hidden_state", ("batch", "sequence", "hidden")), ("pooler_output", ("batch", "hidden"))),
)
INTERFACES = {
    "tiny": Interface(
        inputs=(("x", "float32", ("batch", 16)),), outputs=(("y", ("batch", 8)), ("score", ("batch", 1)))
    ),
    "tiny_bert": BERT_IO,
    "bert_base": BERT_IO,
    "resnet50": Interface(
        inputs=(("pixel_values", "float32", ("batch", 3, 224, 224)),), outputs=(("pooled", ("batch", 2048)),)
    ),
}


def tiny() -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.norm = torch.nn.LayerNorm(32)
            self.fc2 = torch.nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))
            return y, y.sum(dim=1, keepdim=True)

    torch.manual_seed(SEED)
    return Tiny().eval()


def _bert(**config: Any) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    class Bert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.bert = BertModel(BertConfig(**config), add_pooling_layer=True)

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
            return out.last_hidden_state, out.pooler_output

    return Bert().eval()


def tiny_bert() -> Any:
    return _bert(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000
    )


def bert_base() -> Any:
    return _bert()


def resnet50() -> Any:
    import torch
    from transformers import ResNetConfig, ResNetModel

    class ResNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.net = ResNetModel(ResNetConfig())  # the default config is ResNet-50 (bottleneck, 3-4-6-3)

        def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.net(pixel_values=pixel_values).pooler_output.flatten(1),)

    return ResNet().eval()


FACTORIES = {"tiny": tiny, "tiny_bert": tiny_bert, "bert_base": bert_base, "resnet50": resnet50}


def export_onnx(name: str, dest: Path, opset: int = 17) -> Path:
    """Export factory `name` to ONNX at `dest` (dynamic axes from its interface), atomically."""
    import torch

    io = INTERFACES[name]
    model = FACTORIES[name]()
    examples = []
    for _, dtype, dims in io.inputs:
        shape = [d if isinstance(d, int) else (2 if i == 0 else 16) for i, d in enumerate(dims)]
        dt = getattr(torch, dtype)
        examples.append(torch.ones(shape, dtype=dt) if not dt.is_floating_point else torch.randn(shape))
    axes = {n: {i: d for i, d in enumerate(dims) if isinstance(d, str)} for n, _, dims in io.inputs}
    axes.update({n: {i: d for i, d in enumerate(dims) if isinstance(d, str)} for n, dims in io.outputs})
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=dest.parent)
    os.close(fd)
    try:
        # The TorchScript exporter on purpose (as tunegate/models.py): the dynamo one needs onnxscript.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(
                model,
                tuple(examples),
                tmp,
                input_names=[n for n, _, _ in io.inputs],
                output_names=[n for n, _ in io.outputs],
                dynamic_axes=axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest
