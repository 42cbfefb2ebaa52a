"""flash-linear-attention 0.6.0's keyword options of ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule``, mapped onto the inputs of our ops.

fla's functions take these beyond the common signature (and swallow any other keyword). Code
written for fla passes them, and most change the result: ignoring ``state_v_first`` would
transpose the state, ignoring ``use_gate_in_kernel`` would read raw gate pre-activations as
log-decays. So each one is either honoured here, with the same meaning as in fla, or refused:

- ``use_gate_in_kernel`` (with ``A_log [HV]``, optional ``dt_bias [HV]``): g is the raw
  pre-activation, the log-decay is ``−exp(A_log) · softplus(g + dt_bias)`` (computed by
  :func:`gdn_fused.gates.gdn_decay`, in fp32, as in the layer);
- ``use_beta_sigmoid_in_kernel`` (and ``allow_neg_eigval``, which needs it): beta is the raw
  pre-activation, the write strength ``sigmoid(beta)`` or ``2·sigmoid(beta)``;
- ``state_v_first`` (fla's deprecated name ``transpose_state_layout`` too): initial and final
  states are ``[N, HV, V, K]``;
- ``cu_seqlens_cpu``, ``chunk_indices``: fla's precomputed helpers; ours are derived from
  ``cu_seqlens``, so these are accepted and not read;
- ``cp_context`` (context parallelism) and ``head_first=True``: not supported, ValueError;
- any other keyword: TypeError naming it (fla would drop it silently; a misspelt
  ``output_final_states=True`` would then return no state).

Gradients flow through the gate, the sigmoid and the transposes by autograd.
"""
from __future__ import annotations

import torch

from gdn_fused.gates import gdn_beta, gdn_decay

# fla's precomputed helpers: consistent with cu_seqlens by contract, and ours are derived from it
UNREAD = ("cu_seqlens_cpu", "chunk_indices")


def _flag(kwargs: dict, name: str) -> bool:
    value = kwargs.pop(name, False)
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def apply_fla_options(kwargs: dict, g, beta, initial_state, op: str):
    """``(g, beta, initial_state, state_v_first)`` with fla's options in ``kwargs`` applied:
    g a log-decay, beta a write strength and initial_state ``[N, HV, K, V]``, as our ops take
    them; pass the final state through :func:`final_state_layout` with ``state_v_first``.

    Raises TypeError for an unknown keyword or a non-bool flag, ValueError for unsupported
    options (``head_first=True``, ``cp_context``) and inconsistent ones (A_log without
    ``use_gate_in_kernel`` or missing with it, ``allow_neg_eigval`` without
    ``use_beta_sigmoid_in_kernel``, both ``state_v_first`` and ``transpose_state_layout``).
    ``op`` names the function in the messages."""
    kwargs = dict(kwargs)
    if kwargs.pop("head_first", False):
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, K] "
                         "(fla's default layout)")
    if kwargs.pop("cp_context", None) is not None:
        raise ValueError(f"cp_context: context parallelism is not supported by {op}")
    state_v_first = _flag(kwargs, "state_v_first")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass state_v_first or its old name transpose_state_layout, "
                             "not both")
        state_v_first = _flag(kwargs, "transpose_state_layout")
    use_gate = _flag(kwargs, "use_gate_in_kernel")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    use_sigmoid = _flag(kwargs, "use_beta_sigmoid_in_kernel")
    neg_eigval = _flag(kwargs, "allow_neg_eigval")
    for name in UNREAD:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{op}() got unexpected keyword argument(s) {sorted(kwargs)}")

    if use_gate:
        if not isinstance(A_log, torch.Tensor) or A_log.dim() != 1:
            raise ValueError("use_gate_in_kernel=True needs A_log, a [HV] tensor")
        if not isinstance(g, torch.Tensor):
            raise TypeError("use_gate_in_kernel=True needs g, the raw gate pre-activation")
        if A_log.shape[0] != g.shape[-1]:
            raise ValueError(f"A_log must have HV = {g.shape[-1]} entries, got {A_log.shape[0]}")
        if dt_bias is None:
            dt_bias = A_log.new_zeros(A_log.shape)
        elif not isinstance(dt_bias, torch.Tensor) or dt_bias.shape != A_log.shape:
            raise ValueError(f"dt_bias must be a [HV] = [{A_log.shape[0]}] tensor")
        g = gdn_decay(A_log, g, dt_bias)
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are read only with use_gate_in_kernel=True")
    if neg_eigval and not use_sigmoid:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if use_sigmoid and isinstance(beta, torch.Tensor):
        beta = gdn_beta(beta, neg_eigval)
    if state_v_first and isinstance(initial_state, torch.Tensor):
        initial_state = initial_state.transpose(-1, -2)
    return g, beta, initial_state, state_v_first


def final_state_layout(final_state, state_v_first: bool):
    """The op's ``[N, HV, K, V]`` final state in the caller's layout (``[N, HV, V, K]`` with
    ``state_v_first``), contiguous; None stays None."""
    if final_state is None or not state_v_first:
        return final_state
    return final_state.transpose(-1, -2).contiguous()
