#!/usr/bin/env bash
# Entry point on a GPU host's CPUs (16 cores, no registry): the gRPC clients' p99 behind a 100 ms slower candidate,
# benchmarks/grpc_slow_candidate_p99.py on a machine whose cores the clients, Triton and the mirror need not share.
#   bash benchmarks/gpu/grpc_p99.sh [benchmark options]          (carry: benchmarks/gpu/grpc-carry)
# benchmarks/gpu/prepare_grpc.sh packs benchmarks/gpu/grpc-carry/ beforehand, on a machine with the registries.
set -uo pipefail
OUT=${OUT:-benchmarks/gpu/out}
mkdir -p "$OUT" /tmp/grpc-p99
tar -C /tmp/grpc-p99 -xJf benchmarks/gpu/grpc-carry/grpc-p99.tar.xz || exit 1
cp /tmp/grpc-p99/lib/libb64.so.0d /usr/lib/x86_64-linux-gnu/ || exit 1  # where tunegate.perf looks for it
export PYTHONPATH=/tmp/grpc-p99/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/grpc-p99/bin:$PATH
export TUNEGATE_GRPC_FRONT=/tmp/grpc-p99/bin/tunegate-grpc-front
export LD_LIBRARY_PATH=/tmp/grpc-p99/lib:/tmp/grpc-p99/site/nvidia/cuda_runtime/lib
{
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket)'
  python3 -c "import sys, grpc, numpy, aiohttp; print(sys.version); print('grpc', grpc.__version__, 'numpy', numpy.__version__, 'aiohttp', aiohttp.__version__)"
  "$TUNEGATE_GRPC_FRONT" --help 2>&1 | head -1
  perf_analyzer --version 2>&1 | head -1
} 2>&1 | tee "$OUT/env.txt"
python3 benchmarks/grpc_slow_candidate_p99.py --json "$OUT/grpc-p99.json" "$@" 2>&1 | tee "$OUT/run.log"
