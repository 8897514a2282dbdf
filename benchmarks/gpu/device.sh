#!/usr/bin/env bash
# Entry point on the GPU host (an H200 without internet access): install the carried pytriton wheel, record the environment, run the tuning.
#   bash benchmarks/gpu/device.sh --models bert_base --budget-s 420 [--canary]   (carry: benchmarks/gpu/wheels)
# benchmarks/gpu/prepare.sh fills benchmarks/gpu/wheels/ beforehand, on a machine with the package registries.
set -uo pipefail
OUT=${OUT:-benchmarks/gpu/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/gpu/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/gpu/wheels/tritonclient-utils PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, numpy, onnx, onnxruntime, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'onnx', onnx.__version__, 'ort', onnxruntime.__version__, 'transformers', transformers.__version__)"
  echo "cpus $(nproc)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m benchmarks.gpu.run --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
