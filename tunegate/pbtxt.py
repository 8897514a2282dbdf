"""config.pbtxt through Triton's own protobuf (`model_config_pb2.ModelConfig` and `text_format`).

Reading parses with the protobuf, so every valid spelling is understood: `versions: [1, 2]`, repeated
`versions: 1 versions: 2`, `<>` for `{}`, optional colons, comments. Writing edits the text in place where a
plain edit does it (comments and layout kept) and checks the result by parsing it again: the edited config
must equal the original with only the intended change. Where the in-place edit cannot say so, the config is
written in the protobuf's canonical text form instead (same content, comments lost).

Fields this protobuf release does not know are kept in the text and skipped by the parse
(`allow_unknown_field`): a config written for a newer Triton still reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tunegate.errors import InputError

ModelConfig = model_config_pb2.ModelConfig


class ConfigTextError(InputError):
    """A config.pbtxt that Triton's protobuf cannot parse; the message says where."""


def parse(text: str) -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg, allow_unknown_field=True)
    except text_format.ParseError as exc:
        raise ConfigTextError(f"config.pbtxt is not valid protobuf text: {exc}") from exc
    return cfg


def specific_versions(text: str) -> tuple[int, ...] | None:
    """The versions of a `specific` version policy, in order; None for `latest`, `all` or no policy."""
    cfg = parse(text)
    if cfg.version_policy.WhichOneof("policy_choice") != "specific":
        return None
    return tuple(int(v) for v in cfg.version_policy.specific.versions)


def _policy_text(versions: Sequence[int]) -> str:
    return f"version_policy: {{ specific: {{ versions: [ {', '.join(str(int(v)) for v in versions)} ] }} }}"


def _block_span(text: str, keyword: str) -> tuple[int, int] | None:
    """The span of `keyword [:] { ... }` (or `< ... >`) at the top level of `text`, skipping strings and comments."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c in "{<":
            depth += 1
        elif c in "}>":
            depth -= 1
        elif (
            depth == 0
            and text.startswith(keyword, i)
            and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))
        ):
            m = re.compile(r"\s*:?\s*([{<])").match(text, i + len(keyword))
            if m:
                close = "}" if m.group(1) == "{" else ">"
                d, j = 1, m.end()
                while j < n and d:
                    if text[j] == "#":
                        k = text.find("\n", j)
                        j = n if k < 0 else k
                        continue
                    if text[j] in "\"'":
                        q, j = text[j], j + 1
                        while j < n and text[j] != q:
                            j += 2 if text[j] == "\\" else 1
                    elif text[j] in "{<":
                        d += 1
                    elif text[j] in "}>":
                        d -= 1
                    j += 1
                if d == 0 and text[j - 1] == close:
                    return i, j
        i += 1
    return None


def _checked(edited: str, change: model_config_pb2.ModelConfig) -> str:
    """`edited` when it parses to `change`, else the canonical text of `change`."""
    try:
        if parse(edited) == change:
            return edited
    except ConfigTextError:
        pass
    return str(text_format.MessageToString(change))


def with_version_policy(text: str, versions: Sequence[int]) -> str:
    """`text` with `version_policy: { specific: { versions: [...] } }` (replaced, or added at the end)."""
    want = parse(text)
    want.version_policy.Clear()
    want.version_policy.specific.versions.extend(int(v) for v in versions)
    span = _block_span(text, "version_policy")
    if span is None:
        edited = text.rstrip("\n") + "\n" + _policy_text(versions) + "\n"
    else:
        edited = text[: span[0]] + _policy_text(versions) + text[span[1] :]
    return _checked(edited, want)


def with_name(text: str, name: str) -> str:
    """`text` with the model's top-level `name` set to `name` (replaced, or added first)."""
    want = parse(text)
    want.name = name
    quoted = '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    edited, n = re.subn(r'^(\s*name\s*:\s*)("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')', lambda m: m.group(1) + quoted,
                        text, count=1, flags=re.MULTILINE)  # fmt: skip
    if n == 0:
        edited = f"name: {quoted}\n" + text
    return _checked(edited, want)
