"""flash-linear-attention 0.6.0's keyword options of ``chunk_gated_delta_rule`` and
``fused_recurrent_gated_delta_rule``, mapped onto the inputs of our ops.

fla's functions take these beyond the common signature (and swallow any other keyword). Code
written for fla passes them, and most change the result: ignoring ``state_v_first`` would
transpose the state, ignoring ``use_gate_in_kernel`` would read raw gate pre-activations as
log-decays. So each one is either honoured here, with the same meaning as in fla, or refused:

- ``use_gate_in_kernel`` (with ``A_log [HV]``, optional ``dt_bias [HV]``): g is the raw
  pre-activation, the log-decay is ``−exp(A_log) · softplus(g + dt_bias)`` (computed by
  :func:`gdn_fused.gates.gdn_decay`, in fp32, as in the layer). As in fla, A_log and dt_bias
  are not read without it (code that always passes them keeps working);
- ``use_beta_sigmoid_in_kernel`` (and ``allow_neg_eigval``, which needs it): beta is the raw
  pre-activation, the write strength ``sigmoid(beta)`` or ``2·sigmoid(beta)``;
- ``state_v_first`` (fla's deprecated name ``transpose_state_layout`` too, with fla's
  DeprecationWarning): initial and final states are ``[N, HV, V, K]``;
- ``cu_seqlens_cpu``, ``chunk_indices``: fla's precomputed helpers; accepted and not read.
  Ours are derived from ``cu_seqlens`` itself (one device-to-host read a call, forward and
  backward together): a host copy that disagreed with the offsets the kernels read would
  size their grids wrongly, and checking that it agrees costs the same read;
- ``cp_context`` (context parallelism) and ``head_first=True``: not supported, ValueError;
- any other keyword: TypeError naming it (fla would drop it silently; a misspelt
  ``output_final_states=True`` would then return no state).

Flags are taken as fla takes them, by truth value, from None, a bool (numpy's too) or 0 / 1;
anything else (a tensor, a string) is a TypeError. Gradients flow through the gate, the
sigmoid and the transposes by autograd.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from gdn_fused.gates import gdn_beta, gdn_decay
from gdn_fused.validation import as_flag

# fla's precomputed helpers: ours are derived from cu_seqlens itself (see the module docstring)
UNREAD = ("cu_seqlens_cpu", "chunk_indices")


def _flag(kwargs: dict, name: str) -> bool:
    return as_flag(name, kwargs.pop(name, None))


@dataclass(frozen=True)
class FlaOptions:
    """fla's options of one call, parsed; apply with :meth:`state_in`, :meth:`gates` and
    :meth:`state_out`."""
    state_v_first: bool = False
    use_gate_in_kernel: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False

    def state_in(self, initial_state):
        """initial_state as the op takes it, ``[N, HV, K, V]`` (a transposed view with
        ``state_v_first``)."""
        if self.state_v_first and isinstance(initial_state, torch.Tensor):
            return initial_state.transpose(-1, -2)
        return initial_state

    def state_out(self, final_state):
        """The op's ``[N, HV, K, V]`` final state in the caller's layout (``[N, HV, V, K]``
        with ``state_v_first``), contiguous; None stays None."""
        if final_state is None or not self.state_v_first:
            return final_state
        return final_state.transpose(-1, -2).contiguous()

    def gates(self, g, beta):
        """(g as a log-decay, beta as a write strength). Call after g and beta are validated
        ([B, T, HV] floating tensors): raises ValueError / TypeError naming A_log or dt_bias
        when they do not fit g's HV value heads."""
        if self.use_gate_in_kernel:
            HV = g.shape[-1]
            for name, x in (("A_log", self.A_log), ("dt_bias", self.dt_bias)):
                if x is None and name == "dt_bias":
                    continue
                if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                    got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                    raise TypeError(f"use_gate_in_kernel=True needs {name}, a floating [HV] "
                                    f"tensor, got {got}")
                if tuple(x.shape) != (HV,):
                    raise ValueError(f"{name} must be [HV] = [{HV}] (g's value heads), got "
                                     f"{tuple(x.shape)}")
                if x.device != g.device:
                    raise ValueError(f"{name} must be on g's device {g.device}, got {x.device}")
            dt_bias = self.dt_bias if self.dt_bias is not None else self.A_log.new_zeros(HV)
            g = gdn_decay(self.A_log, g, dt_bias)
        if self.use_beta_sigmoid_in_kernel:
            beta = gdn_beta(beta, self.allow_neg_eigval)
        return g, beta


def parse_fla_options(kwargs: dict, op: str) -> FlaOptions:
    """Parse fla's keyword options of a call to ``op`` (named in messages).

    Raises TypeError for an unknown keyword or a flag that is not a bool, ValueError for
    unsupported options (``head_first=True``, ``cp_context``) and inconsistent ones
    (``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``, both ``state_v_first`` and
    ``transpose_state_layout``, ``use_gate_in_kernel`` without A_log)."""
    kwargs = dict(kwargs)
    if _flag(kwargs, "head_first"):
        raise ValueError("head_first=True is not supported: pass q, k, v as [B, T, H, K] "
                         "(fla's default layout)")
    if kwargs.pop("cp_context", None) is not None:
        raise ValueError(f"cp_context: context parallelism is not supported by {op}")
    state_v_first = _flag(kwargs, "state_v_first")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("pass state_v_first or its old name transpose_state_layout, "
                             "not both")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = _flag(kwargs, "transpose_state_layout")
    use_gate = _flag(kwargs, "use_gate_in_kernel")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    use_sigmoid = _flag(kwargs, "use_beta_sigmoid_in_kernel")
    neg_eigval = _flag(kwargs, "allow_neg_eigval")
    for name in UNREAD:
        kwargs.pop(name, None)
    if kwargs:
        raise TypeError(f"{op}() got unexpected keyword argument(s) {sorted(kwargs)}")
    if use_gate and A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log, a [HV] tensor")
    if neg_eigval and not use_sigmoid:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if not use_gate:  # fla reads them only with use_gate_in_kernel
        A_log = dt_bias = None
    return FlaOptions(state_v_first, use_gate, A_log, dt_bias, use_sigmoid, neg_eigval)
