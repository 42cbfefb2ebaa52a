#!/usr/bin/env bash
# One device call (session 23): the GPU tests the PDL launches and the output's 2^x touch, then
# the forward benchmark at the anchor shapes (its fused_no_pdl columns: the A/B in one run).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout 240 python3 -m pytest -m gpu -q -s -rs tests/test_pdl.py tests/test_fused.py \
  tests/test_kkt_solve.py tests/test_gluon_transposed.py \
  -k "pdl or fused_gpu or gluon_from_k or twin or two_segments or chain_rows" \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc $?"; grep -E "vs its torch twin|passed|failed|Error" "$OUT/gpu_tests.log" | tail -30
timeout 200 python3 -m eval.bench --out "$OUT/bench" --no-kkt --no-stages --no-backward \
  --shapes ${SHAPES:-1:32768,8:4096,32:2048,1:8192,1:2048} > "$OUT/bench.log" 2>&1
echo "bench rc $?"; grep -E "^\|" "$OUT/bench.log" | tail -7
python3 - "$OUT/bench/bench.csv" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    f = lambda k: float(r[k]) if r.get(k) else float("nan")
    print(r["B"], r["T"], "graph pdl %.4f no_pdl %.4f (%.3f)" % (f("fused_graph_ms"), f("fused_no_pdl_graph_ms"), f("fused_graph_ms") / f("fused_no_pdl_graph_ms")),
          "eager pdl %.4f no_pdl %.4f" % (f("fused_ms"), f("fused_no_pdl_ms")))
PY
rm -f "$OUT"/bench/*.png
