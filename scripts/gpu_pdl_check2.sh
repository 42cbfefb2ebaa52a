#!/usr/bin/env bash
# The second device call of session 23: the GPU tests the first one's time limit cut (PDL's
# bits, the output's 2^x against its torch twin, the Gluon inverse, the backward), then
# fwd+bwd at two anchor shapes.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 280 python3 -m pytest -m gpu -q -s -rs tests/test_pdl.py tests/test_gluon_transposed.py \
  tests/test_kkt_solve.py tests/test_backward.py \
  -k "pdl or twin or chain_rows or gluon_from_k or bf16_gpu" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc $?"; grep -E "vs its torch twin|passed|failed|Error" "$OUT/gpu_tests.log" | tail -30
timeout 200 python3 -m eval.bench --out "$OUT/bench" --no-kkt --no-stages --backward-graph \
  --shapes 1:32768,8:4096 > "$OUT/bench.log" 2>&1
echo "bench rc $?"; grep -E "^\|" "$OUT/bench.log" | tail -4
rm -f "$OUT"/bench/*.png
