"""Optional lm-evaluation-harness adapter (needs ``pip install "lm-eval[hf]"``): our swapped
model as an lm-eval Hugging Face model, and offline MMLU task definitions over the local CSV
files.

- :class:`SwappedLM` (registered as lm-eval model ``gdn_fused``): an ``HFLM`` over a local
  checkpoint or the embedded model, swapped to one backend / inverse method.
- :func:`task_configs`: one lm-eval task per subject, reading ``dev/`` and ``test/`` of a data
  directory in the original layout (no download); the prompt text comes from
  :mod:`.mmlu_data`, so lm-eval sees exactly the prompts of ``python -m eval.mmlu``.
- ``python -m eval.lm_eval_adapter`` (the arguments of ``python -m eval.mmlu``, one backend and
  one solve method): runs lm-eval's ``simple_evaluate`` and the script's scorer on the same
  model and questions and reports whether the prompts, the accuracies and every prediction
  agree. Exit 1 when they differ.

lm-eval scores a choice by its log-likelihood (``multiple_choice``, metric ``acc``); for the
single-token continuations " A".." D" the argmax of the log-softmax is the argmax of the
logits, so both must pick the same letters up to exact ties.
"""
from __future__ import annotations

import sys

from .mmlu_data import CHOICES, Question, format_question, prompt_header, read_split
from .mmlu_models import DTYPES, ModelSource, make_variants

try:
    import lm_eval
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # the adapter is optional: say how to get it
    _NEEDS = ("the lm-eval adapter needs lm-evaluation-harness: `pip install \"lm-eval[hf]\"` "
              "(or `pip install -e .[lmeval]`)")
    if __name__ == "__main__":  # run as a script: the message alone, as argparse would
        if {"-h", "--help"} & set(sys.argv[1:]):  # the options are readable without it
            from .mmlu import build_parser
            _parser = build_parser()
            _parser.prog, _parser.epilog = "python -m eval.lm_eval_adapter", _NEEDS
            _parser.print_help()
            sys.exit(0)
        sys.exit(f"python -m eval.lm_eval_adapter: error: {_NEEDS}")
    raise ModuleNotFoundError(_NEEDS) from e


def _doc(q: Question) -> dict:
    return {"subject": q.subject, "question": q.text, "choices": list(q.choices),
            "answer": CHOICES.index(q.answer)}


def _question(doc: dict) -> Question:
    return Question(doc["subject"], doc["question"], tuple(doc["choices"]),
                    CHOICES[doc["answer"]])


def _doc_to_text(doc: dict) -> str:
    return format_question(_question(doc), with_answer=False)


def _doc_to_target(doc: dict) -> int:
    return doc["answer"]


def load_subject(data_dir: str, subject: str, **_metadata):
    """A ``datasets.DatasetDict`` with the "dev" and "test" splits of one subject (lm-eval's
    ``custom_dataset`` hook; it also passes the run's metadata, which is not needed here)."""
    import datasets
    return datasets.DatasetDict({
        split: datasets.Dataset.from_list([_doc(q) for q in read_split(data_dir, subject, split)])
        for split in ("dev", "test")})


def task_name(subject: str) -> str:
    return f"gdn_fused_mmlu_{subject}"


def task_configs(data_dir, subjects: list[str], num_fewshot: int = 5) -> list[dict]:
    """lm-eval task configs (dicts for ``simple_evaluate(tasks=...)``), one per subject: test
    split scored, the first ``num_fewshot`` dev questions as exemplars (sampler ``first_n``,
    as the script), description = :func:`.mmlu_data.prompt_header`."""
    return [{
        "task": task_name(subject),
        "custom_dataset": load_subject,
        "dataset_kwargs": {"data_dir": str(data_dir), "subject": subject},
        "test_split": "test",
        "fewshot_split": "dev",
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": num_fewshot,
        "output_type": "multiple_choice",
        "description": prompt_header(subject),
        "doc_to_text": _doc_to_text,
        "doc_to_choice": list(CHOICES),
        "doc_to_target": _doc_to_target,
        "target_delimiter": " ",
        "fewshot_delimiter": "\n\n",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    } for subject in subjects]


@register_model("gdn_fused")
class SwappedLM(HFLM):
    """lm-eval's HFLM over a Qwen3-Next / Qwen3.5 model with our Gated DeltaNet swapped in.

    Registered as lm-eval model ``gdn_fused`` (once this module is imported), so also
    ``simple_evaluate(model="gdn_fused", model_args="model=PATH,backend=fused,...")``.

    Args (strings accepted, as lm-eval's ``model_args`` passes them):
        model: a local checkpoint directory, or None for the embedded model (``shape``,
            ``seed``, ``layers``: see :mod:`.embedded`).
        backend: a backend of ``python -m eval.mmlu`` except "recurrent" (lm-eval runs one
            prefill per request, which is the chunk path); "hf" = unswapped.
        solve_method: "name" or "name:iters" of :data:`gdn_fused.inverse.METHODS`.
        dtype, device, chunk_size: as in ``python -m eval.mmlu``.
        batch_size: lm-eval's batch size. lm-eval computes the logits of every position, so
            keep it small on a CPU (151,936 vocabulary entries per token).

    Raises ValueError for an unknown or the recurrent backend or an unknown solve method, and
    what :meth:`.mmlu_models.ModelSource.load` raises."""

    def __init__(self, model: str | None = None, backend: str = "torch",
                 solve_method: str = "blocked", shape: str = "tiny", seed: int = 0,
                 layers: int | None = None, dtype: str = "float32", device: str = "cpu",
                 chunk_size: int = 64, batch_size: int = 1):
        (variant,) = make_variants([backend], [solve_method])
        if variant.backend == "recurrent":
            raise ValueError("the lm-eval adapter runs prefill only; use the chunked backends")
        source = ModelSource(path=model, shape=shape, seed=int(seed),
                             num_layers=None if layers is None else int(layers),
                             dtype=DTYPES[dtype], device=device, chunk_size=int(chunk_size))
        super().__init__(pretrained=source.load(variant), tokenizer=source.tokenizer(),
                         batch_size=batch_size, device=device)


def cross_check(args, lm_batch_size: int = 1) -> dict:
    """Evaluate ``args.variants[0]`` (parsed and checked as by ``python -m eval.mmlu``) with
    lm-eval and with the script's scorer on the same model and questions.

    Returns ``{"lm_eval": {subject: acc}, "script": {subject: acc}, "prompts_equal": bool (lm-eval's
    contexts are the script's prompts, character for character), "predictions_equal": bool}``
    plus per-question predictions of both."""
    import torch

    from .mmlu import load_questions
    from .mmlu_scoring import (accuracy_by_subject, answer_logits, letter_token_ids,
                               predictions, tokenize_prompts)

    lm = SwappedLM(model=args.model, backend=args.backend[0], solve_method=args.solve_method[0],
                   shape=args.shape, seed=args.seed, layers=args.layers, dtype=args.dtype,
                   device=args.device, chunk_size=args.chunk_size, batch_size=lm_batch_size)
    out = lm_eval.simple_evaluate(model=lm, tasks=task_configs(args.data_dir, args.subjects,
                                                               args.num_fewshot),
                                  limit=args.limit, log_samples=True, bootstrap_iters=0,
                                  verbosity="ERROR")
    lm_acc, lm_preds, lm_prompts = {}, [], []
    for subject in args.subjects:
        name = task_name(subject)
        lm_acc[subject] = out["results"][name]["acc,none"]
        for sample in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            # one (log-likelihood, is_greedy) and one (context, continuation) per choice
            lls = torch.tensor([r[0] for r in sample["filtered_resps"]])
            lm_preds.append(CHOICES[int(lls.argmax())])
            lm_prompts.append(sample["arguments"][0][0])

    questions, prompts = load_questions(args.data_dir, args.subjects, args.num_fewshot,
                                        args.limit)
    tok = lm.tokenizer
    logits = answer_logits(lm.model, tokenize_prompts(tok, prompts), letter_token_ids(tok),
                           args.batch_size, args.device, progress=not args.no_progress)
    preds = predictions(logits)
    script_acc = accuracy_by_subject(preds, [q.answer for q in questions],
                                     [q.subject for q in questions])
    script_acc.pop("avg")
    return {"lm_eval": lm_acc, "script": script_acc, "prompts_equal": prompts == lm_prompts,
            "predictions_equal": preds == lm_preds,
            "lm_eval_predictions": "".join(lm_preds), "script_predictions": "".join(preds)}


def main(argv: list[str] | None = None) -> int:
    """``python -m eval.lm_eval_adapter``: the cross-check for one backend / solve method;
    prints both accuracies per subject, returns 0 when all predictions agree, else 1."""
    from .mmlu import build_parser, check_args, configure
    parser = build_parser()
    parser.prog = "python -m eval.lm_eval_adapter"
    parser.set_defaults(backend=["torch"])
    args = parser.parse_args(argv)
    check_args(parser, args)
    if len(args.variants) != 1:
        parser.error("the cross-check takes one backend and one solve method")
    configure(args)
    result = cross_check(args)
    print(f"{'subject':<28} {'lm-eval':>8} {'script':>8}")
    for subject, acc in result["lm_eval"].items():
        print(f"{subject:<28} {acc:8.3f} {result['script'][subject]:8.3f}")
    print("prompts equal:", result["prompts_equal"])
    print("predictions equal:", result["predictions_equal"])
    return 0 if result["prompts_equal"] and result["predictions_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
