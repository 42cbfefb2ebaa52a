#!/usr/bin/env bash
# ncu --set full of the Gluon backward kernels (dq/dk/dw/dg, wu_bwd, the reverse state pass)
# in one fused fwd+bwd at B=1, T=${T:-32768}: the details page, the raw metrics and the SASS
# source page (per-instruction stall samples) of each, under $OUT. One device call.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD GDN_OVERLAP_RECOMPUTE=0
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
cat > /tmp/ncu_bwd.py <<PY
import torch
from eval.bench import make_inputs
from gdn_fused import chunk_gated_delta_rule
q, k, v, g, beta, h0 = make_inputs(1, ${T:-32768})
leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
o, _ = chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True,
                              backend="fused")
torch.autograd.grad(o, leaves, torch.randn_like(o))
torch.cuda.synchronize()
PY
timeout ${T1:-400} "$NCU" --kernel-name regex:"${KERNELS:-dqkwg_gluon|wu_bwd_gluon|bwd_state_t}" \
  --set full --import-source no -f -o "$OUT/prof" python3 /tmp/ncu_bwd.py > "$OUT/ncu_run.log" 2>&1
echo "ncu rc $?"; tail -3 "$OUT/ncu_run.log"
"$NCU" --import "$OUT/prof.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" --import "$OUT/prof.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>&1
"$NCU" --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/sass.csv" 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Throughput|Issue Slots|Eligible|Registers|Shared Memory Config" "$OUT/details.txt" | head -80
# per kernel: stall samples by instruction execution count (the compute loop is the count with
# the most instructions; the padding warps and the producer's waits have their own counts), the
# loop's stall reasons and its instruction mix
python3 - "$OUT/sass.csv" > "$OUT/sass_summary.txt" <<'PY'
import collections, csv, io, sys
num = lambda d, k: float((d.get(k) or "0").replace(",", "") or 0)
for part in open(sys.argv[1]).read().split('"Kernel Name"')[1:]:
    name, body = part.split("\n", 1)
    rows = list(csv.reader(io.StringIO(body)))
    data = [dict(zip(rows[0], r)) for r in rows[1:] if len(r) == len(rows[0])]
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    count, samples = collections.Counter(), collections.Counter()
    for d in data:
        e = num(d, "Instructions Executed")
        count[e] += 1
        samples[e] += num(d, "Warp Stall Sampling (All Samples)")
    total = sum(samples.values())
    print(name, {int(e): f"{count[e]} instrs {100 * samples[e] / total:.1f}%"
                 for e, _ in samples.most_common(5)})
    loop = max((e for e in count if e > 0), key=count.get)
    body = [d for d in data if num(d, "Instructions Executed") == loop]
    why = collections.Counter({r[6:]: sum(num(d, r) for d in body) for r in reasons})
    ops = collections.Counter(d["Source"].split()[1 if d["Source"].startswith("@") else 0]
                              .split(".")[0] for d in body)
    s = sum(why.values())
    print("  loop:", len(body), "instrs;", {k: f"{100 * v / s:.0f}%" for k, v in why.most_common(6)})
    print("  ops:", dict(ops.most_common(20)))
PY
cat "$OUT/sass_summary.txt"
ls -la "$OUT"
