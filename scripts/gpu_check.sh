#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, the benchmark and the launch sweeps (../shared/device.md).
#   bash scripts/gpu_check.sh [pytest -k expression]
#   STEPS="gluon tests" bash scripts/gpu_check.sh; STEPS="bench sweep" bash scripts/gpu_check.sh
#   TESTS=tests/test_fused.py SWEEP=fused,kkt STEPS="tests bench sweep" bash scripts/gpu_check.sh
# STEPS picks among gluon (the experimental Gluon kernels' GPU tests), tests (every other gpu
# test), bench (eval.bench at the anchor shapes) and sweep (eval.bench --sweep); default all
# four, which need more than one 600 s call when every gpu test runs: split them as above
# (TESTS narrows the gpu tests to some files, SWEEP picks eval.bench --sweep parts,
# BENCH_ARGS adds eval.bench options such as --no-stages), and
# give the second call GDN_BENCH_SKIP_GLUON=1 (or _GLUON_OUTPUT, _GLUON_WU, _GLUON_FORWARD, _GLUON_T,
# _GLUON_T_EXPERIMENTAL) for
# each Gluon kernel whose test failed or hung in the first (the sweep would hang on it too).
# Needs fla 0.6.0 wheels in .whl/ (carried) for the baseline columns; writes logs under $OUT.
# The steps share one budget (BUDGET seconds, default 580: a device call runs at most 600), each
# getting what is left less what the later ones hold back, so a slow step cannot starve the
# later ones of their logs.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
left() {  # seconds left of the budget, less $1 held back for later steps; at least 10
  local n=$(( ${BUDGET:-580} - SECONDS - ${1:-0} )); echo $(( n > 10 ? n : 10 )); }
STEPS=" ${STEPS:-gluon tests bench sweep} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
# seconds held back for the later steps that will run
# (SWEEP_S, BENCH_S: seconds to hold for each, default 100 and 180)
HOLD_SWEEP=$(want sweep && echo ${SWEEP_S:-100} || echo 0)
HOLD_BENCH=$(( $(want bench && echo ${BENCH_S:-180} || echo 0) + HOLD_SWEEP ))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
KEXPR=${1:-}
# 1. The experimental Gluon kernels first, each alone on a short leash: a wrong mbarrier
#    handshake deadlocks instead of failing. One that fails or hangs is left out of the sweep.
if want gluon; then
  : > "$OUT/gluon_output_tests.log"
  timeout 90 python3 -m pytest -m gpu -q -s -rs tests/test_gluon_state.py 2>&1 | \
    tee "$OUT/gluon_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON=1
  # the other two append to one log, to keep $OUT at 8 files
  timeout 60 python3 -m pytest -m gpu -q -s -rs tests/test_gluon_state_output.py 2>&1 | \
    tee -a "$OUT/gluon_output_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON_OUTPUT=1
  timeout 60 python3 -m pytest -m gpu -q -s -rs tests/test_gluon_wu.py 2>&1 | \
    tee -a "$OUT/gluon_output_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON_WU=1
  # 24 cases, each segment count its own compiles: 111 s measured (session 7), plus the
  # long bit-exactness run and the one-group compiles added since
  timeout 240 python3 -m pytest -m gpu -q -s -rs \
    -k "not w_u_on_chip and not storing_h and not same_bits" \
    tests/test_gluon_transposed.py 2>&1 | tee -a "$OUT/gluon_output_tests.log"
  # the materialized forward routes through this kernel too: off with it when it fails
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON_T=1 GDN_STATE_OUTPUT_KERNEL=0
  # its experimental modes (forward_t: W/U on chip; chunk_state_t: h and v_new stored; the
  # launch variants' bit-identity) on their own leash
  timeout 300 python3 -m pytest -m gpu -q -s -rs -k "w_u_on_chip or storing_h or same_bits" \
    tests/test_gluon_transposed.py 2>&1 | tee -a "$OUT/gluon_output_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON_T_EXPERIMENTAL=1
  # the three-launch forward built from them (skipped by its test when a piece fails)
  timeout 90 python3 -m pytest -m gpu -q -s -rs tests/test_gluon_forward.py 2>&1 | \
    tee -a "$OUT/gluon_output_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || export GDN_BENCH_SKIP_GLUON_FORWARD=1
fi
# 2. Every other gpu test, after the backward's determinism check (each kernel twice on the
#    same inputs: the dg / dbeta differences of docs/backward.md, "Determinism").
if want tests; then
  timeout 120 python3 -m eval.determinism --warps 2 8 2>&1 | tee "$OUT/gpu_tests.log"
  timeout $(left $HOLD_BENCH) python3 -m pytest -m gpu -q -s -rs --continue-on-collection-errors \
    --ignore=tests/test_gluon_state.py --ignore=tests/test_gluon_state_output.py \
    --ignore=tests/test_gluon_wu.py --ignore=tests/test_gluon_forward.py \
    --ignore=tests/test_gluon_transposed.py \
    ${KEXPR:+-k "$KEXPR"} ${TESTS:-tests/} 2>&1 | tee -a "$OUT/gpu_tests.log"
fi
# 3. The benchmark: forward and forward+backward at the anchor shapes, kkt_solve, stages.
if want bench; then
  timeout $(left $HOLD_SWEEP) python3 -m eval.bench --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | \
    tee "$OUT/bench.log"
fi
# 4. Launch sweeps: kkt_solve variants, each forward and backward kernel's time (the Gluon
#    kernels beside the ones they would replace), the fused kernel's segments and chunk 32.
if want sweep; then
  timeout $(left) python3 -m eval.bench --sweep ${SWEEP:-} 2>&1 | tee "$OUT/sweep.log"
fi
