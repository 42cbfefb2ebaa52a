"""The model variants an MMLU run compares: one per (backend, inverse method), each from one
source (a local checkpoint, loaded afresh per row, or the embedded model, built once per run and
shared by every row) and swapped.

``hf`` is the unswapped Hugging Face model, the reference of the agreement columns; every other
backend is that model with its Qwen3-Next / Qwen3.5 Gated DeltaNet layers replaced by ours
(:func:`gdn_fused.models.swap_gated_deltanet`).
"""
from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field

import torch

REFERENCE = "hf"
BACKENDS = (REFERENCE, "auto", "torch", "materialized", "fused", "recurrent")
# Backends that never invert a chunk's A (hf's own code; the token-by-token recurrence), so a
# solve method does not apply to them: they get one row, method "-".
NO_SOLVE = (REFERENCE, "recurrent")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Variant:
    """One row of the table: a backend and, for chunked backends, an inverse method."""

    backend: str
    solve_method: str | None = None
    solve_iters: int | None = None

    @property
    def stream(self) -> int | None:
        """Piece length for feeding prompts through the cache: the recurrent backend is our
        swapped layer on its decode path (continuations of <= RECURRENT_MAX_TOKENS tokens run
        the recurrent op, no inverse anywhere); None (one prefill) for the others."""
        if self.backend != "recurrent":
            return None
        from gdn_fused.layer import RECURRENT_MAX_TOKENS
        return RECURRENT_MAX_TOKENS

    @property
    def method_label(self) -> str:
        if self.solve_method is None:
            return "-"
        return self.solve_method + ("" if self.solve_iters is None else f":{self.solve_iters}")


def parse_solve_method(spec: str) -> tuple[str, int | None]:
    """``"name"`` or ``"name:iters"`` -> (name, iters), checked against
    :data:`gdn_fused.inverse.METHODS` (e.g. "blocked", "mxr", "newton_schulz:6", "mch").

    Raises ValueError for an unknown name, a count that is not a positive integer, or a count
    given to a method the chunk op takes none for (every method but the Newton-Schulz ones;
    :func:`gdn_fused.validation.check_solve_method`)."""
    from gdn_fused.inverse import METHODS
    from gdn_fused.validation import check_solve_method
    name, _, count = spec.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown solve method {name!r}; choose from {', '.join(METHODS)} "
                         "(append :N for an iteration count, e.g. newton_schulz:6)")
    if not count:
        return name, None
    if not count.isdigit():
        raise ValueError(f"iteration count of {spec!r} must be a positive integer")
    try:
        # the torch backend takes every method, so this checks the count alone
        return name, check_solve_method("torch", name, int(count))
    except ValueError as e:
        raise ValueError(f"{spec!r}: {e}") from None


def unique(items) -> list:
    """``items`` without repeats, each kept at its first position."""
    return list(dict.fromkeys(items))


def make_variants(backends: list[str], solve_methods: list[str]) -> list[Variant]:
    """The rows of a run, the reference first: each backend of ``NO_SOLVE`` once, every other
    backend once per solve method (in the given order). Repeated backends and methods (also
    spelt differently, e.g. newton_schulz:6 and newton_schulz:06) give one row.

    Raises ValueError for an unknown backend or solve method."""
    methods = [parse_solve_method(s) for s in solve_methods]
    rows: list[Variant] = []
    for backend in sorted(backends, key=lambda b: b != REFERENCE):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        rows += [Variant(backend)] if backend in NO_SOLVE else [Variant(backend, m, it)
                                                                for m, it in methods]
    return unique(rows)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: ``path`` (a local Qwen3-Next / Qwen3.5 checkpoint directory
    with its tokenizer) or, when None, the embedded random model (``shape``, ``seed``,
    ``num_layers``; :mod:`.embedded`)."""

    path: str | None = None
    shape: str = "tiny"
    seed: int = 0
    num_layers: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    chunk_size: int = 64
    # The embedded model, built on the first load() and shared by every row (release() drops
    # it): drawing its weights is the slow part (qwen3-next-80b: 750 M parameters from the
    # CPU generator, ~20 s single-threaded), the same for every row.
    _built: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def describe(self) -> str:
        if self.path is not None:
            return self.path
        layers = "" if self.num_layers is None else f", {self.num_layers} layers"
        return f"embedded Qwen3-Next '{self.shape}' (random init, seed {self.seed}{layers})"

    def tokenizer(self):
        """The checkpoint's own tokenizer, or Qwen3's for the embedded model (offline)."""
        if self.path is None:
            from .embedded import load_qwen3_tokenizer
            return load_qwen3_tokenizer()
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if len(tokenizer) == 0:
            # (transformers builds an empty tokenizer from a directory without its files)
            raise ValueError(f"{self.path}: no tokenizer there (tokenizer.json or the like); "
                             "--model needs a checkpoint saved with its tokenizer")
        return tokenizer

    def load(self, variant: Variant):
        """A model for ``variant``, in eval mode on ``device`` in ``dtype``: the unswapped HF
        model for "hf", else that model with our layers swapped in
        (:func:`gdn_fused.models.load_swapped` for a checkpoint).

        A checkpoint is loaded afresh for each call (one model in memory at a time). The
        embedded model is built once (:meth:`embedded_model`); "hf" gets it as is, every other
        variant a copy of its module tree that shares all parameters and buffers, swapped: the
        swap replaces modules of the copy and re-uses (never writes) the shared weights, so
        rows cost no rebuild and no weight copy and every row sees the same weights.

        Raises ValueError when the swap finds no Gated DeltaNet layer to replace (the checkpoint
        is not a Qwen3-Next / Qwen3.5 model), OSError for an unreadable checkpoint."""
        from gdn_fused.models import load_swapped, swap_gated_deltanet
        # The recurrent backend is the layer's decode path, which follows the chunk backend
        # "auto" (torch recurrence on CPU, one Triton launch on CUDA).
        swap = dict(backend="auto" if variant.backend == "recurrent" else variant.backend,
                    chunk_size=self.chunk_size, solve_method=variant.solve_method or "blocked",
                    solve_iters=variant.solve_iters)
        if self.path is not None:
            # Loaded on the CPU, then moved: a device_map (device=...) needs accelerate.
            if variant.backend != REFERENCE:
                return load_swapped(self.path, dtype=self.dtype, **swap).to(self.device)
            from transformers import AutoModelForCausalLM
            return AutoModelForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, local_files_only=True).to(self.device).eval()
        base = self.embedded_model()
        if variant.backend == REFERENCE:
            return base
        model = share_weights_copy(base)
        swap_gated_deltanet(model, **swap)
        return model

    def embedded_model(self):
        """The embedded model (:func:`.embedded.build_embedded_model`), built on the first
        call and kept until :meth:`release`."""
        if "model" not in self._built:
            from .embedded import build_embedded_model
            self._built["model"] = build_embedded_model(self.shape, self.seed, self.num_layers,
                                                        self.dtype, self.device)
        return self._built["model"]

    def release(self) -> None:
        """Drop the kept embedded model."""
        self._built.clear()


def share_weights_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``'s module tree whose parameters and buffers are ``model``'s own
    tensors (no memory, no copy time): replacing modules in the copy leaves ``model`` as it was."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def free_memory() -> None:
    """Return a dropped variant's memory before the next one loads (one model at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
