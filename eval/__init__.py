"""Evaluation of gdn-fused end to end: MMLU on Qwen3-Next / Qwen3.5 models with our Gated
DeltaNet layers swapped in (``python -m eval.mmlu``), an embedded random-weight default model,
and an optional lm-evaluation-harness adapter; the accuracy study of the triangular-inverse
methods (``python -m eval.inverse_accuracy``). Installed as ``gdn_fused.eval``."""
