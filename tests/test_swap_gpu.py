"""GPU: a Qwen3-Next-80B-A3B-shaped stack (3 Gated DeltaNet layers + 1 attention layer, random
weights at trained-model scale) with our layers swapped in vs transformers' torch fallback, bf16.

The fallback in fp32 is the truth (it computes the recurrence in fp32; ~1e-6 from fp64). bf16
has its own noise: on this stack one Gated DeltaNet layer in bf16 is ~7e-3 (relative) from its
fp32 self in *either* implementation, and the fallback's bf16 logits are ~7e-3 from the truth,
with top-1 flips at a few % of positions where the random-weight logits are near-ties. So the
test asserts the issue's criteria (relative logit error ≤ 1e-2, top-1 agreement ≥ 99 %) and, to
keep them meaningful, that our bf16 logits are no further from the truth than the fallback's;
top-1 agreement is taken over the positions whose top-1 is decided beyond bf16 noise (fp32
margin between the two best tokens > DECIDED_MARGIN × the fallback's own logit error there).

The stack is built and its weights drawn on the GPU (:func:`qwen3_next_stack`, milliseconds);
drawn on the CPU its 780 M parameters took ~30 s per test, most of the file's runtime.
"""
import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCH, SEQ = 2, 512  # 1024 positions
REL_MAX = 1e-2
TOP1_MIN = 0.99
NO_WORSE = 1.25  # our error vs the truth may exceed the fallback's by this factor at most
DECIDED_MARGIN = 6.0  # margin / (rms logit error): a flip needs a ≥ 4-sigma error difference


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def compare_stack(device="cuda", backend="auto", decode_steps=0, seed=0):
    """Logits of the stack: fp32 fallback (truth), bf16 fallback, bf16 swapped.

    Returns a dict of metrics (printed by the tests); with ``decode_steps`` > 0 the last
    ``decode_steps`` positions are fed one token at a time through HF's cache."""
    from gdn_fused.eval.bench_layer import qwen3_next_stack
    from gdn_fused.models import swap_gated_deltanet

    model = qwen3_next_stack(3, dtype=torch.float32, device=device, seed=seed)
    torch.manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), device=device)

    def run(m):
        if decode_steps == 0:
            return m(ids).logits.float()
        out = m(ids[:, :-decode_steps], use_cache=True)
        logits, cache = [out.logits.float()], out.past_key_values
        for t in range(SEQ - decode_steps, SEQ):
            out = m(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits.float())
        return torch.cat(logits, 1)

    truth = run(model)
    model.to(torch.bfloat16)
    hf = run(model)
    ours_model = copy.deepcopy(model)
    assert swap_gated_deltanet(ours_model, backend=backend) == 3
    ours = run(ours_model)

    noise = (hf - truth).pow(2).mean(-1).sqrt()  # per-position rms error of the fallback
    top2 = truth.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > DECIDED_MARGIN * noise
    agree = ours.argmax(-1) == hf.argmax(-1)
    return {
        "rel_ours_hf": rel(ours, hf),
        "rel_hf_truth": rel(hf, truth),
        "rel_ours_truth": rel(ours, truth),
        "top1_all": agree.float().mean().item(),
        "top1_decided": agree[decided].float().mean().item(),
        "decided": decided.float().mean().item(),
        "top1_hf_truth": (hf.argmax(-1) == truth.argmax(-1)).float().mean().item(),
        "top1_ours_truth": (ours.argmax(-1) == truth.argmax(-1)).float().mean().item(),
    }


def check(metrics, label):
    print(f"\n{label}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    assert metrics["rel_ours_hf"] <= REL_MAX
    assert metrics["rel_ours_truth"] <= NO_WORSE * metrics["rel_hf_truth"]
    assert metrics["decided"] >= 0.5  # the top-1 check covers most positions
    assert metrics["top1_decided"] >= TOP1_MIN


@pytest.mark.parametrize("backend", ["auto", "materialized"])
def test_qwen3_next_stack_prefill_matches_fallback_bf16(backend):
    check(compare_stack(backend=backend), f"prefill, backend={backend}")


def test_qwen3_next_stack_decode_matches_fallback_bf16():
    """The last 32 positions through HF's cache: our recurrent kernel vs HF's token loop."""
    check(compare_stack(decode_steps=32), "prefill + 32 decode steps, backend=auto")
