#!/usr/bin/env bash
# ncu --set full of named kernels in one call of the fused backend at B=${B:-1}, T=${T:-32768}:
# the details page and the per-role summary and listing of the SASS source page (per-instruction
# stall samples, eval.ncu_sass) under $OUT; the report and raw CSVs in /tmp/ncu. One device call.
#   PASS=bwd (default): fwd+bwd, the Gluon backward kernels (dq/dk/dw/dg, wu_bwd, reverse pass)
#   PASS=fwd: the forward alone, its Gluon state + output kernel (KERNELS to change)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD GDN_OVERLAP_RECOMPUTE=0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ "${PASS:-bwd}" = fwd ]; then
  DEFAULT_KERNELS="chunk_state_output_t_kernel"; GRAD=False
else
  DEFAULT_KERNELS="dqkwg_gluon|wu_bwd_gluon|bwd_state_t"; GRAD=True
fi
cat > /tmp/ncu_run.py <<PY
import torch
from eval.bench import make_inputs
from gdn_fused import chunk_gated_delta_rule
q, k, v, g, beta, h0 = make_inputs(${B:-1}, ${T:-32768})
leaves = [x.detach().requires_grad_($GRAD) for x in (q, k, v, g, beta)]
o, _ = chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True,
                              backend="fused")
if $GRAD:
    torch.autograd.grad(o, leaves, torch.randn_like(o))
torch.cuda.synchronize()
PY
mkdir -p /tmp/ncu
timeout ${T1:-400} "$NCU" --kernel-name regex:"${KERNELS:-$DEFAULT_KERNELS}" \
  ${NCU_ARGS:-} --set full --import-source no -f -o /tmp/ncu/prof python3 /tmp/ncu_run.py \
  > "$OUT/ncu_run.log" 2>&1
echo "ncu rc $?"; tail -3 "$OUT/ncu_run.log"
"$NCU" --import /tmp/ncu/prof.ncu-rep --page details > "$OUT/details.txt" 2>&1
"$NCU" --import /tmp/ncu/prof.ncu-rep --page raw --csv > /tmp/ncu/raw.csv 2>&1
"$NCU" --import /tmp/ncu/prof.ncu-rep --page source --csv --print-source sass > /tmp/ncu/sass.csv 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Throughput|Issue Slots|Eligible|Registers|Shared Memory Config" "$OUT/details.txt" | head -80
python3 -m eval.ncu_sass /tmp/ncu/sass.csv --roles ${ROLES:-1} --top ${TOP:-0} > "$OUT/sass_summary.txt"
python3 -m eval.ncu_sass /tmp/ncu/sass.csv --roles ${ROLES:-1} --list > "$OUT/sass_listing.txt"
cat "$OUT/sass_summary.txt"
ls -la "$OUT"
