"""Triton's serving configuration as a release carries it: instance count, batching and backend parameters.

A version's files are per version, but Triton reads config.pbtxt per *model*: a serving configuration cannot
live in a version directory. A release that changes it says so in release.json (`"serving"`), the canary's
shadow model serves the candidate with it, promotion writes it into the model's config, and the config that
served before is kept beside it (`saved_config_name`) so a rollback restores it.

Edits go through Triton's protobuf (tunegate.pbtxt); the result is written in the protobuf's canonical text
form (comments in the config are not kept by these edits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from google.protobuf import text_format

from tunegate import pbtxt
from tunegate.errors import InputError


class ServingError(InputError):
    """A serving configuration that cannot apply to this model's config (the message says why)."""


def saved_config_name(version: int) -> str:
    """Beside config.pbtxt: the config that served `version` before a release changed it (hidden from Triton)."""
    return f".config-v{int(version)}.pbtxt"


@dataclasses.dataclass(frozen=True)
class Serving:
    """The knobs a serving route sets; None leaves the config's own value."""

    instances: int | None = None  # instance_group count (every group; kind and devices kept)
    max_batch_size: int | None = None  # > 0: Triton batches; inputs and outputs lose their leading -1
    queue_delay_us: int | None = None  # dynamic_batching.max_queue_delay_microseconds; < 0 turns it off
    preferred_batch_sizes: tuple[int, ...] = ()
    parameters: Mapping[str, str] = dataclasses.field(default_factory=dict)  # backend parameters
    graph_level: int | None = None  # optimization.graph.level (the onnxruntime backend's graph optimizations)

    def __post_init__(self) -> None:
        if self.instances is not None and not 1 <= self.instances <= 64:
            raise ServingError(f"instances must be within 1..64, got {self.instances}")
        if self.max_batch_size is not None and not 0 <= self.max_batch_size <= 4096:
            raise ServingError(f"max_batch_size must be within 0..4096, got {self.max_batch_size}")
        if self.queue_delay_us is not None and self.queue_delay_us > 10_000_000:
            raise ServingError(f"queue_delay_us must be at most 10 s, got {self.queue_delay_us}")
        if any(b < 1 for b in self.preferred_batch_sizes):
            raise ServingError("preferred batch sizes must be >= 1")

    @property
    def empty(self) -> bool:
        return self == Serving()

    def merged(self, over: Serving) -> Serving:
        """These knobs with `over`'s set ones on top (a serving search on a version that carries its own)."""
        d = {**self.to_dict(), **over.to_dict()}
        d["parameters"] = {**self.parameters, **over.parameters}
        return Serving.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, (), {})}
        if "preferred_batch_sizes" in d:
            d["preferred_batch_sizes"] = list(d["preferred_batch_sizes"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Serving:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ServingError(f"unknown serving keys {sorted(unknown)}; known: {sorted(known)}")
        try:
            return cls(
                instances=None if d.get("instances") is None else int(d["instances"]),
                max_batch_size=None if d.get("max_batch_size") is None else int(d["max_batch_size"]),
                queue_delay_us=None if d.get("queue_delay_us") is None else int(d["queue_delay_us"]),
                preferred_batch_sizes=tuple(int(b) for b in d.get("preferred_batch_sizes") or ()),
                parameters={str(k): str(v) for k, v in dict(d.get("parameters") or {}).items()},
                graph_level=None if d.get("graph_level") is None else int(d["graph_level"]),
            )
        except (TypeError, ValueError) as exc:
            raise ServingError(f"serving configuration {dict(d)!r}: {exc}") from exc

    def apply(self, config_text: str) -> str:
        """`config_text` with these knobs set (canonical protobuf text). Raises ServingError where it cannot."""
        cfg = pbtxt.parse(config_text)
        if self.instances is not None:
            if not cfg.instance_group:
                cfg.instance_group.add()
            for group in cfg.instance_group:
                group.count = self.instances
        if self.max_batch_size is not None and self.max_batch_size != cfg.max_batch_size:
            _rebatch(cfg, self.max_batch_size)
        batching = self.queue_delay_us is not None or self.preferred_batch_sizes
        scheduler = cfg.WhichOneof("scheduling_choice")
        if batching and scheduler not in (None, "dynamic_batching"):
            # one oneof in Triton's protobuf: setting the dynamic batcher would drop the model's own scheduler
            raise ServingError(
                f"the model is scheduled by {scheduler}: the dynamic batcher cannot replace it"
            )
        if batching and self.queue_delay_us is not None and self.queue_delay_us < 0:
            cfg.ClearField("dynamic_batching")
        elif batching:
            if cfg.max_batch_size < 1:
                raise ServingError(
                    "dynamic batching needs max_batch_size > 0 (Triton batches only models that take a batch "
                    "dimension)"
                )
            db = cfg.dynamic_batching
            if self.queue_delay_us is not None:
                db.max_queue_delay_microseconds = self.queue_delay_us
            if self.preferred_batch_sizes:
                del db.preferred_batch_size[:]
                db.preferred_batch_size.extend(self.preferred_batch_sizes)
        if cfg.max_batch_size < 1 and cfg.HasField("dynamic_batching"):
            raise ServingError("dynamic batching needs max_batch_size > 0")
        preferred = (
            list(cfg.dynamic_batching.preferred_batch_size) if cfg.HasField("dynamic_batching") else []
        )
        if any(b > cfg.max_batch_size for b in preferred):
            raise ServingError(
                f"preferred batch sizes {preferred} exceed max_batch_size {cfg.max_batch_size}"
            )
        for key, value in self.parameters.items():
            cfg.parameters[key].string_value = value
        if self.graph_level is not None:
            cfg.optimization.graph.level = self.graph_level
        return str(text_format.MessageToString(cfg))


def _rebatch(cfg: Any, max_batch_size: int) -> None:
    """Move between a full shape ([-1, ...], max_batch_size 0) and Triton's batch dimension (max_batch_size > 0).

    The tensors clients send keep their shape either way: [b, ...] is a batch of b with dims [...] once Triton
    batches. Every input and output must then have a leading variable dimension.
    """
    tensors = list(cfg.input) + list(cfg.output)
    reshaped = [t.name for t in tensors if t.HasField("reshape")]
    if reshaped:
        raise ServingError(f"{reshaped} have a reshape: their batch dimension is not moved automatically")
    if max_batch_size > 0 and cfg.max_batch_size == 0:
        bad = [t.name for t in tensors if not t.dims or t.dims[0] != -1]
        if bad:
            raise ServingError(
                f"batching needs a leading -1 dimension on every input and output; {bad} have none"
            )
        flat = [t.name for t in tensors if len(t.dims) == 1]
        if flat:  # [-1] would leave no dimension, which Triton refuses without a reshape
            raise ServingError(f"{flat} have only the batch dimension: batching them needs a reshape")
        for t in tensors:
            del t.dims[0]
    elif max_batch_size == 0 and cfg.max_batch_size > 0:
        for t in tensors:
            t.dims.insert(0, -1)
        cfg.ClearField("dynamic_batching")
    cfg.max_batch_size = max_batch_size


def describe(serving: Serving | Mapping[str, Any]) -> str:
    s = serving if isinstance(serving, Serving) else Serving.from_dict(serving)
    parts = [f"{k}={v}" for k, v in s.to_dict().items()]
    return ", ".join(parts) or "the model's own configuration"
