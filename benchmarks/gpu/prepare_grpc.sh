#!/usr/bin/env bash
# Run here (not on the device), after `make venv native`: pack what benchmarks/grpc_slow_candidate_p99.py needs on a
# GPU host's CPUs into benchmarks/gpu/grpc-carry/ (git-ignored; name it in the call's `carry`), for
# benchmarks/gpu/grpc_p99.sh there. The carry limit is 64 MiB, so nothing travels as a wheel: one xz archive holds
#   site/      pytriton's server, python backend and its stub for the host's Python 3.12, its bundled libraries,
#              tritonclient's Python package (the sidecar's codec and protos), httptools, orjson, rapidjson and numpy<2
#              for 3.12 (tritonclient 2.51's codec reads empty tensors under numpy 2: pytriton pins numpy<2 too),
#              and the cu12 libcudart that perf_analyzer links (the host's nvidia.cuda_runtime is cu13)
#   bin/       perf_analyzer (from the tritonclient wheel) and the compiled gRPC front (`make native`)
#   lib/       the front's libgrpc++, abseil, re2, c-ares and upb, and perf_analyzer's libb64 (Debian builds)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
OUT=benchmarks/gpu/grpc-carry
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/site/nvidia/cuda_runtime/lib" "$stage/bin" "$stage/lib" "$OUT"
# pytriton: the server tree with only the 3.12 stub, and the libraries its wheel bundles.
cp -a "$SITE/pytriton" "$SITE/nvidia_pytriton.libs" "$SITE/tritonclient" "$stage/site/"
find "$stage/site/pytriton/tritonserver/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} +
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
touch "$stage/site/nvidia/__init__.py"
cp "$SITE/nvidia/cuda_runtime/lib/libcudart.so.12" "$stage/site/nvidia/cuda_runtime/lib/"
touch "$stage/site/nvidia/cuda_runtime/__init__.py"
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    httptools orjson python-rapidjson "numpy<2" -d "$stage/wheels"
for w in "$stage"/wheels/*.whl; do (cd "$stage/site" && unzip -q -o "$w"); done
rm -rf "$stage/wheels"
cp "$VENV/bin/perf_analyzer" "$VENV/bin/tunegate-grpc-front" "$stage/bin/"
# The front's shared libraries, less the C/C++ runtime, OpenSSL and zlib the host has.
ldd "$VENV/bin/tunegate-grpc-front" | awk '$3 ~ /^\// {print $3}' \
    | grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libssl|libcrypto|libz)\.so' | xargs -I{} cp -L {} "$stage/lib/"
cp -L /usr/lib/x86_64-linux-gnu/libb64.so.0d "$stage/lib/"
tar -C "$stage" -cf - site bin lib | xz -T1 -6 > "$OUT/grpc-p99.tar.xz"
du -sh "$OUT"/*
