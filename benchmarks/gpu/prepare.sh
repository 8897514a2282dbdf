#!/usr/bin/env bash
# Run here (not on the device) before a device call: fetch what the H200 image lacks into benchmarks/gpu/wheels/
# (git-ignored; name it in the call's `carry`). The carry limit is 64 MiB and pytriton alone is 55 MB, so of
# tritonclient (14 MB, perf_analyzer inside) only its pure-python `utils` travel, unchanged: tunegate.codec
# (the sidecar's decoding) imports nothing else from it.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
PIP=${PIP:-../../.venv/bin/pip}
[ -f wheels/nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl ] || "$PIP" download -q --no-deps nvidia-pytriton==0.7.0 -d wheels
tmp=$(mktemp -d)
"$PIP" download -q --no-deps tritonclient==2.51.0 -d "$tmp"
rm -rf wheels/tritonclient-utils
mkdir -p wheels/tritonclient-utils
unzip -q "$tmp"/tritonclient-2.51.0-*.whl 'tritonclient-2.51.0.data/purelib/tritonclient/__init__.py' \
    'tritonclient-2.51.0.data/purelib/tritonclient/utils/*' -d "$tmp/x"
mv "$tmp/x/tritonclient-2.51.0.data/purelib/tritonclient" wheels/tritonclient-utils/
rm -rf "$tmp"
# The sidecar's client path (httptools), event loop (uvloop) and JSON (orjson), for the image's Python 3.12.
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    httptools uvloop orjson -d wheels
du -sh wheels/*
