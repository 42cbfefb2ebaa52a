#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then the benchmark (see ../shared/device.md).
#   bash scripts/gpu_check.sh [pytest -k expression] [extra eval.bench args]
# Needs fla 0.6.0 wheels in .whl/ (carried) for the baseline columns; writes logs under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
KEXPR=${1:-}
timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -s -rs --continue-on-collection-errors ${KEXPR:+-k "$KEXPR"} tests/ 2>&1 | tee "$OUT/gpu_tests.log"
shift || true
timeout ${BENCH_TIMEOUT:-240} python3 -m eval.bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log"
