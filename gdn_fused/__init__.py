"""gdn-fused: chunkwise Gated DeltaNet (Yang, Kautz & Hatamizadeh, arXiv:2412.06464).

Public API (flash-linear-attention compatible):

- :func:`chunk_gated_delta_rule` — prefill / training, backends torch, materialized, fused.
- :func:`fused_recurrent_gated_delta_rule` — decode over a few tokens, fp32 state.

Subpackages ``gdn_fused.kernels`` (Triton), ``gdn_fused.models`` (Hugging Face integration)
and ``gdn_fused.eval`` (MMLU, benchmarks) live at the repository root as ``kernels/``,
``models/`` and ``eval/`` (design card) and are installed only under ``gdn_fused``.
"""
import os as _os

# Running from a source checkout without installing: let gdn_fused.kernels / .models / .eval
# resolve to the root-level folders. Installed copies are found first through the mapping in
# pyproject.toml, so this only matters for `PYTHONPATH=. python ...` use.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)  # noqa: F821  (module __path__ of a package)

from gdn_fused.ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "GatedDeltaNet"]
__version__ = "0.1.0"
from gdn_fused.layer import GatedDeltaNet  # noqa: E402
