"""Coverage-guided fuzzing (atheris, libFuzzer) of what parses bytes from clients and from Triton.

Targets, chosen by the first byte of each input:
- tunegate.codec.decode_request / decode_response: a KServe v2 body, JSON or binary (with the
  Inference-Header-Content-Length taken from the input), as the sidecar's mirror and the tuner's capture
  reader decode them;
- tunegate.classes.request_class: the judge's class of a request, computed on every mirrored body;
- tunegate.pbtxt.parse and specific_versions: a config.pbtxt;
- tunegate.capture's line parser: one line of a capture file.
The property: every input is answered or refused with the module's own InputError; any other exception is a
finding (libFuzzer writes the crashing input as crash-<sha1> in the working directory).

    .venv/bin/python tests/fuzz_codec.py -atheris_runs=200000        # a longer run
    .venv/bin/python tests/fuzz_codec.py -max_total_time=60         # a minute
tests/test_fuzz.py runs it for a few thousand inputs.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from tunegate import capture, classes, codec, pbtxt
    from tunegate.errors import InputError


def one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    target, rest = data[0] % 4, data[1:]
    try:
        if target == 0:
            fdp = atheris.FuzzedDataProvider(rest)
            hl = fdp.ConsumeIntInRange(0, 512) if fdp.ConsumeBool() else None
            body = fdp.ConsumeBytes(fdp.remaining_bytes())
            codec.decode_request(body, hl)
            codec.decode_response(body, hl)
        elif target == 1:
            classes.request_class(rest, [(b"inference-header-content-length", rest[:3])])
            classes.request_class(rest, [])
        elif target == 2:
            text = rest.decode("utf-8", "replace")
            pbtxt.parse(text)
            pbtxt.specific_versions(text)
        else:
            capture._parse(rest.decode("utf-8", "replace"), "fuzz:1")
    except InputError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
