"""The gates of Gated DeltaNet computed from raw projections: the log-decay
``g = −exp(A_log) · softplus(a + dt_bias)`` and the write strength ``beta = sigmoid(b)``.

Shared by the layer (gdn_fused.layer) and by the ops' fla options ``use_gate_in_kernel`` /
``use_beta_sigmoid_in_kernel`` (gdn_fused.fla_options), so both round alike.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdn_fused.reference import LOG_DECAY_MIN

# exp(88.7) overflows fp32: clamping A_log below it keeps A = exp(A_log) finite, so
# A · softplus(·) can never be inf · 0.
LOG_A_MAX = 80.0
# softplus(x) = x beyond this; capping its argument here bounds every term of A_log's gradient
# sum (so the sum cannot overflow to inf and meet exp(A_log) = 0), and changes g only where
# A < 128 / SOFTPLUS_ARG_MAX, far outside trained models (|a + dt_bias| is O(10) there).
SOFTPLUS_ARG_MAX = 1e4


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types and fp32, fp64 for fp64 (the fp64 tests' truth)."""
    return torch.promote_types(dtype, torch.float32)


def gdn_decay(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Log-decay ``g = −exp(A_log) · softplus(a + dt_bias)`` (natural log, ≤ 0).

    Args:
        A_log: ``[HV]`` any float dtype.
        a: ``[..., HV]`` any float dtype (the ``a`` rows of the input projection).
        dt_bias: ``[HV]`` any float dtype.

    Returns:
        ``[..., HV]`` in fp32 (fp64 when ``a`` is fp64), finite and in ``[LOG_DECAY_MIN, 0]``
        for every finite input: ``A_log`` is clamped at ``LOG_A_MAX`` so ``exp`` stays finite,
        the softplus argument at ``SOFTPLUS_ARG_MAX`` (it may overflow to inf in
        ``a + dt_bias``; softplus may underflow to 0: finite · 0 = 0, never inf · 0), and g
        at ``LOG_DECAY_MIN``, where the decay is already 0 in fp32. Gradients are finite as
        well (clamped entries get zero gradient). Formula and rounding as in Hugging Face's
        Qwen3-Next layer, so unclamped values are bitwise equal to its.
    """
    dtype = compute_dtype(a.dtype)
    A = A_log.to(dtype).clamp(max=LOG_A_MAX).exp()
    sp = F.softplus((a.to(dtype) + dt_bias.to(dtype)).clamp(max=SOFTPLUS_ARG_MAX))
    return (-A * sp).clamp(min=LOG_DECAY_MIN)


def gdn_beta(b: torch.Tensor, allow_neg_eigval: bool = False) -> torch.Tensor:
    """Write strength ``beta = sigmoid(b)`` in (0, 1), or ``2·sigmoid(b)`` in (0, 2) when
    negative eigenvalues of the transition ``I − beta k kᵀ`` are allowed (Grazzi et al.,
    arXiv:2411.12537). ``b [..., HV]`` any float dtype; returns fp32 (fp64 for fp64 input)."""
    beta = torch.sigmoid(b.to(compute_dtype(b.dtype)))
    return 2.0 * beta if allow_neg_eigval else beta
