"""Which client requests may be mirrored: stateful sequences and decoupled models are passed through only.

Replaying part of a sequence to another instance corrupts both sequences' state: the copy's instance
sees steps out of context, and a replay to the client-serving baseline (`latency_pairing="primary"`)
feeds the client's own sequence a step twice. So a request that carries the KServe v2 sequence
parameters (`sequence_id`, `sequence_start`, `sequence_end`) in its JSON header is not mirrored, nor is
any request to a model whose config has `sequence_batching`. A decoupled model
(`model_transaction_policy { decoupled: true }`) answers with a stream, not one response to compare, so
its requests pass through unmirrored too. The model's config is read once, at canary start.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

SEQUENCE = "sequence"
DECOUPLED = "decoupled"
SKIP_REASONS = (SEQUENCE, DECOUPLED)
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")
_MARK = b'"sequence_'  # every sequence parameter's name starts so: one byte search before any JSON parse
_HL = b"inference-header-content-length"


@dataclasses.dataclass(frozen=True)
class ModelSemantics:
    """What a model's config says about mirroring its requests (sidecar.semantics)."""

    sequence: bool = False  # sequence_batching: every request belongs to a stateful sequence
    decoupled: bool = False  # model_transaction_policy { decoupled: true }
    backend: str = ""  # `backend`, else `platform` ("" when the config names neither)

    @property
    def skip(self) -> str | None:
        """Why none of this model's requests is mirrored, or None."""
        return DECOUPLED if self.decoupled else SEQUENCE if self.sequence else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> ModelSemantics | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(
            bool(raw.get("sequence", False)), bool(raw.get("decoupled", False)), str(raw.get("backend", ""))
        )


def parse_model_config(text: str) -> ModelSemantics:
    """Parse a config.pbtxt with Triton's protobuf when it is installed, else with a careful text parse."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return _parse_text(text)
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg, allow_unknown_field=True)
    except text_format.ParseError:  # a field this protobuf does not know in a form it cannot skip
        return _parse_text(text)
    return ModelSemantics(sequence=cfg.HasField("sequence_batching"),
                          decoupled=bool(cfg.model_transaction_policy.decoupled),
                          backend=cfg.backend or cfg.platform)  # fmt: skip


_TOKEN = re.compile(
    rb"""\s+|\#[^\n]*|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[{}\[\]<>:,;]|[^\s{}\[\]<>:,;"'\#]+"""
)
_TRUE = frozenset({"true", "True", "t", "1"})


def _parse_text(text: str) -> ModelSemantics:
    """The protobuf text format's structure, enough for three fields: messages nest in {} or <>, repeated
    fields in [], comments run from # to the end of a line (outside strings)."""
    frames: list[tuple[str, bool]] = []  # (field name, is a [ ] list) of each open brace or bracket
    tokens = [t.decode("utf-8", "replace") for t in _TOKEN.findall(text.encode()) if not t[:1].isspace()]
    tokens = [t for t in tokens if not t.startswith("#")]
    sequence = decoupled = False
    backend = platform = ""
    name = ""
    for i, tok in enumerate(tokens):
        if tok in ("{", "<"):
            frames.append((frames[-1][0] if frames and frames[-1][1] else name, False))
        elif tok == "[":
            frames.append((name, True))
        elif tok in ("}", ">", "]"):
            if frames:
                frames.pop()
        elif tok not in (":", ",", ";"):
            path = [f for f, is_list in frames if not is_list]
            value = tokens[i + 2] if i + 2 < len(tokens) and tokens[i + 1] == ":" else None
            if not path and tok == "sequence_batching" and (value is None or value in ("{", "<")):
                sequence = True
            elif path == ["model_transaction_policy"] and tok == "decoupled" and value is not None:
                decoupled = value in _TRUE
            elif not path and tok in ("backend", "platform") and value is not None and value[:1] in "\"'":
                if tok == "backend":
                    backend = value[1:-1]
                else:
                    platform = value[1:-1]
            name = tok
    return ModelSemantics(sequence=sequence, decoupled=decoupled, backend=backend or platform)


def sequence_request(body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a KServe v2 infer request carries sequence parameters in its JSON header.

    Cheap for the usual request: a byte search of the JSON header (the whole body, or its first
    Inference-Header-Content-Length bytes) for the parameters' common prefix, and a JSON parse only on a
    hit. A compressed body is not searched: its model's config decides (`ModelSemantics.sequence`).
    """
    end = len(body)
    for name, value in headers:
        lname = name.lower()
        if lname == _HL:
            try:
                end = min(end, int(value))
            except ValueError:
                return False  # Triton refuses it; it is never answered 200
        elif lname == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            return False
    if body.find(_MARK, 0, end) < 0:
        return False
    try:
        header = orjson.loads(body[:end])
    except orjson.JSONDecodeError:
        return True  # mentions a sequence parameter and cannot be read: not replayed, to be safe
    params = header.get("parameters") if isinstance(header, dict) else None
    return isinstance(params, dict) and any(k in params for k in SEQUENCE_PARAMETERS)


__all__ = [
    "DECOUPLED",
    "SEQUENCE",
    "SKIP_REASONS",
    "ModelSemantics",
    "parse_model_config",
    "sequence_request",
]
