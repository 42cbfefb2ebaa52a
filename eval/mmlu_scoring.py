"""Letter scoring for MMLU: the next-token logits of " A", " B", " C", " D" after each prompt,
and the statistics of the results table (accuracy per subject, agreement with a reference).

Protocol of Hendrycks et al. (ICLR 2021) as in lm-evaluation-harness's ``mmlu`` task: the
prediction is the argmax over the four letter tokens of the logits at the prompt's last
position (the prompt ends in "Answer:").
"""
from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from gdn_fused.models.hf_calls import cache_kwarg, output_cache

from .mmlu_data import CHOICES


def letter_token_ids(tokenizer) -> list[int]:
    """Token ids of " A", " B", " C", " D" (leading space: they follow "Answer:").

    Raises ValueError when the tokenizer splits a letter into several tokens (the single-token
    argmax protocol would then not apply)."""
    ids = []
    for letter in CHOICES:
        tokens = tokenizer.encode(" " + letter, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(f"the tokenizer splits {' ' + letter!r} into {len(tokens)} tokens "
                             f"{tokens}; MMLU letter scoring needs one token per letter")
        ids.append(tokens[0])
    return ids


def tokenize_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt without special tokens (as lm-evaluation-harness encodes a
    context; Qwen tokenizers add no BOS anyway)."""
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def _forward_last(model, ids: torch.Tensor, last: torch.Tensor, stream: int | None):
    """Logits ``[B, vocab]`` of each row of ``ids [B, T]`` at its position ``last[r]``.

    stream None: one forward over the whole batch. stream = n: the batch is fed through the
    model's cache as one token and then pieces of n tokens, the decode path (a swapped layer
    runs its recurrent op on continuations of <= n tokens; the first token alone needs no
    inverse), and each row's logits are taken in the piece that holds its last position."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    if stream is None:
        # The distinct last positions of this batch; `slot` maps each row to its own.
        keep, slot = torch.unique(last, return_inverse=True)
        return model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits[rows, slot]
    bounds = [0] + list(range(1, ids.shape[1], stream)) + [ids.shape[1]]
    picked, cache, cache_name = [None] * ids.shape[0], None, cache_kwarg(model)
    for start, end in zip(bounds, bounds[1:]):
        here = ((last >= start) & (last < end)).nonzero().flatten()
        keep, slot = torch.unique(last[here] - start, return_inverse=True)
        out = model(input_ids=ids[:, start:end], logits_to_keep=keep if len(here) else 1,
                    use_cache=True, **{cache_name: cache})
        cache = output_cache(out)
        for r, s in zip(here.tolist(), slot.tolist()):
            picked[r] = out.logits[r, s]
    return torch.stack(picked)


@torch.inference_mode()
def answer_logits(model, prompts: list[list[int]], letter_ids: list[int], batch_size: int = 8,
                  device: str | torch.device = "cpu", desc: str | None = None,
                  progress: bool = True, stream: int | None = None) -> torch.Tensor:
    """The logits of the four letter tokens after each prompt, ``[N, 4]`` fp32 on the CPU.

    Args:
        model: a Hugging Face causal LM (called as ``model(input_ids=[B, T] int64,
            logits_to_keep=[P] int64, use_cache=...)`` returning ``.logits [B, P, vocab]``).
        prompts: N token-id lists (each non-empty).
        letter_ids: the 4 token ids of " A".." D" (:func:`letter_token_ids`).
        batch_size: prompts per forward pass.
        device: where the model lives.
        stream: None for one forward per batch (prefill); n to feed each batch through the
            model's cache in pieces of n tokens (the decode path, for the recurrent backend).

    Prompts are sorted by length (longest first, so peak memory shows at once) and batched with
    *right* padding and no attention mask: every layer of a causal LM (attention, causal
    convolution, the Gated DeltaNet recurrence) lets position t see only positions <= t, so the
    pads after a prompt cannot change its last logits, whatever a swapped layer does with masks.
    The logits are computed only at the batch's last positions (``logits_to_keep``), since the
    vocabulary projection (151,936 rows for Qwen3) would otherwise dominate a small model.

    Raises ValueError for an empty prompt."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    letters = torch.tensor(letter_ids, device=device)
    out = torch.empty(len(prompts), len(letter_ids), dtype=torch.float32)
    with tqdm(total=len(prompts), desc=desc, unit="q", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            lengths = torch.tensor([len(prompts[i]) for i in rows])
            # Pad id 0 is an ordinary token: right padding is never attended to (see above).
            ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
            logits = _forward_last(model, ids.to(device), (lengths - 1).to(device), stream)
            out[rows] = logits[:, letters].float().cpu()
            bar.update(len(rows))
    return out


def predictions(logits: torch.Tensor) -> list[str]:
    """The predicted letter of each row of ``[N, 4]`` letter logits (NaN rows predict "-")."""
    best = logits.argmax(dim=1).tolist()
    nan = torch.isnan(logits).any(dim=1).tolist()
    return ["-" if bad else CHOICES[i] for i, bad in zip(best, nan)]


def accuracy_by_subject(preds: list[str], answers: list[str], subjects: list[str]) -> dict:
    """``{"avg": micro-average over all questions, subject: accuracy, ...}`` (subjects in first
    appearance order). The paper's "Avg." is the micro-average: its Table 3 rows reproduce as
    question-weighted means of the subject columns, not as plain means."""
    correct: dict[str, list[int]] = {}
    for p, a, s in zip(preds, answers, subjects):
        correct.setdefault(s, []).append(int(p == a))
    total = sum(sum(c) for c in correct.values())
    result = {"avg": total / max(len(preds), 1)}
    result.update({s: sum(c) / len(c) for s, c in correct.items()})
    return result


def compare_to_reference(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Agreement of predicted letters and the abs difference of the four letter logits.

    Args: two ``[N, 4]`` fp32 tensors. Returns ``{"agreement": fraction of equal predictions,
    "max_abs_logit_diff", "mean_abs_logit_diff", "nonfinite": rows with a NaN/inf logit}``; the
    differences are NaN when a logit is not finite (an unstable inverse can overflow)."""
    agree = sum(a == b for a, b in zip(predictions(logits), predictions(reference)))
    diff = (logits.double() - reference.double()).abs()
    return {
        "agreement": agree / max(len(logits), 1),
        "max_abs_logit_diff": float(diff.max()) if diff.numel() else 0.0,
        "mean_abs_logit_diff": float(diff.mean()) if diff.numel() else 0.0,
        "nonfinite": int((~torch.isfinite(logits)).any(dim=1).sum()),
    }


def finite_or_none(x: float) -> float | None:
    """JSON has no NaN/inf: map them to null."""
    return x if math.isfinite(x) else None
