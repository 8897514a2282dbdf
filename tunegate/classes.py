"""Request classes: a KServe v2 request's batch size and sequence bucket ("b4xs64"), as the judge and the gate name them.

The sidecar's judge pins a candidate that is slower, or out of tolerance, on one class alone; the tuner's
gate counts its requests per class in the same terms, so a release record and a decision record compare.
"""

from __future__ import annotations

from collections.abc import Sequence

from tunegate import codec

CLASS_PARSE_MAX_BYTES = (
    64 << 10
)  # a JSON body bigger than this is not parsed for its class (binary ones always are)


def request_class(body: bytes, headers: Sequence[tuple[bytes, bytes]]) -> str:
    """A request's class for the judge: batch size and sequence bucket of its first input ("b4xs64"), "" unknown.

    The judge pins a candidate that is slower, or out of tolerance, on one class alone (the long-tail shapes
    a benchmark's average hides). Sequences are bucketed by powers of two so classes stay few.
    """
    hl = None
    for name, value in headers:
        if name.lower() == b"inference-header-content-length":
            try:
                hl = int(value)
            except ValueError:
                return ""
            break
    if hl is None and len(body) > CLASS_PARSE_MAX_BYTES:
        return ""
    try:
        header, _ = codec.split_body(body, hl)
        shape = header["inputs"][0]["shape"]
        batch = int(shape[0])
    except (codec.CodecError, KeyError, IndexError, TypeError, ValueError):
        return ""
    if len(shape) < 2:
        return f"b{batch}"
    seq = max(1, int(shape[1]))
    return f"b{batch}xs{1 << (seq - 1).bit_length()}"
