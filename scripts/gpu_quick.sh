#!/usr/bin/env bash
# One short device call: the named GPU tests (TESTS, KEXPR), the backward kernels' sweep
# (SWEEP=0 skips it) and eval.bench at SHAPES (BENCH_ARGS added); each step on its own timeout
# (T1, T2, T3 seconds). Needs fla 0.6.0 wheels in .whl/ (carried) for the baseline columns.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout ${T1:-220} python3 -m pytest -m gpu -q -s -rs ${TESTS:-tests/test_checkpoints.py} \
  ${KEXPR:+-k "$KEXPR"} > "$OUT/gpu_tests.log" 2>&1
echo "tests rc $?"; grep -v "^\s*$" "$OUT/gpu_tests.log" | grep -i "gluon\|wu_bwd\|passed\|failed\|error\|backward bf16" | tail -40
if [ "${SWEEP:-1}" = 1 ]; then
  timeout ${T2:-130} python3 -m eval.bench --sweep bwd > "$OUT/sweep_bwd.log" 2>&1
  echo "sweep rc $?"; tail -4 "$OUT/sweep_bwd.log"
fi
timeout ${T3:-230} python3 -m eval.bench --out "$OUT/bench" --no-kkt --no-stages \
  --shapes ${SHAPES:-1:32768,8:4096,1:8192} ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc $?"; grep "^|" "$OUT/bench.log" | tail -8
