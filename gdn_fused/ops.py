"""The functional API: flash-linear-attention compatible Gated DeltaNet ops with backend dispatch."""
from __future__ import annotations

import logging

import torch

from gdn_fused.fla_options import parse_fla_options
from gdn_fused.reference import (LOG_DECAY_MIN, chunk_gated_delta_rule_ref, l2norm,
                                 recurrent_gated_delta_rule_ref)
from gdn_fused.validation import (as_chunk_size, as_flag, as_scale, check_device_for_backend,
                                  check_inputs, check_solve_method)

logger = logging.getLogger("gdn_fused")


def _fused_supported(q, v, chunk_size):
    """Why the fused kernel cannot take these inputs, or None when it can."""
    from gdn_fused.kernels import fused_fwd
    return fused_fwd.unsupported_reason(q, v, chunk_size)


# auto picks the fused backend where it has been measured faster than materialized: its
# Hopper route (kernels/fused_fwd.uses_warp_specialized: forward_t, V' formed on the state
# chain) wherever it applies: faster at all five anchor shapes (only H = 16, HV = 32, K = V =
# 128 measured). H200, H=16, HV=32, K=V=128, bf16, session 18 (eval.bench,
# docs/results/bench_final_2026-12-01_s18.md), fused vs materialized: forward 1.073 vs 1.227 ms
# at (1, 32768) (both split in two segments there), 0.728 vs 0.964 at (8, 4096), 1.494 vs
# 1.979 at (32, 2048), 0.314 vs 0.354 at (1, 8192), CUDA-graph replays 0.098 vs 0.111 at
# (1, 2048); fwd+bwd 5.13 vs 5.34, 4.61 vs 4.88, 9.34 vs 9.85, graph 1.36 vs 1.44 at (1, 8192).
# (Until session 17 the split shapes went to materialized, whose two output warpgroups won
# there: 1.28 vs 1.34 ms at (1, 32768).) Batches of many short sequences in the route's range
# (e.g. (32, 64)) are not measured. Elsewhere the plain-Triton fused kernel is slower than
# materialized at every shape the GPU binds (4.00 vs 1.29 ms at (1, 32768): register spills of
# its one-program-per-head chunk loop).
def _auto_picks_fused(q, v, chunk_size, cu_seqlens) -> bool:
    from gdn_fused.kernels.fused_fwd import uses_warp_specialized
    return uses_warp_specialized(q, v, chunk_size, cu_seqlens)


def resolve_backend(backend: str, q: torch.Tensor, v: torch.Tensor, chunk_size: int,
                    cu_seqlens: torch.Tensor = None) -> str:
    """Map "auto" to a concrete backend: fused where supported and faster (see
    :func:`_auto_picks_fused`), else materialized on GPU, torch on CPU; every fallback is
    logged at debug level with its reason."""
    if backend == "fused":
        why = _fused_supported(q, v, chunk_size)
        if why is not None:
            logger.debug("gdn_fused: fused backend unsupported (%s); using materialized", why)
            return "materialized"
        return backend
    if backend != "auto":
        return backend
    if q.device.type != "cuda":
        logger.debug("gdn_fused: auto -> torch (tensors on %s)", q.device)
        return "torch"
    if _auto_picks_fused(q, v, chunk_size, cu_seqlens):
        return "fused"
    logger.debug("gdn_fused: auto -> materialized (the fused backend is not measured faster "
                 "for these inputs)")
    return "materialized"


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                           chunk_indices=None, cp_context=None, *, chunk_size=64,
                           backend="auto", solve_method="blocked", solve_iters=None, **kwargs):
    """Chunkwise Gated DeltaNet (Yang, Kautz & Hatamizadeh, arXiv:2412.06464, §3.3).

    Per value head, with state S ∈ R^{K×V} (fp32)::

        S_t = exp(g_t) (I − beta_t k_t k_tᵀ) S_{t−1} + beta_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t

    The positional order is fla 0.6.0's, up to ``cp_context``; chunk_size, backend,
    solve_method and solve_iters (this package's) are keyword-only.

    Args:
        q, k: ``[B, T, H, K]`` fp16/bf16/fp32 (fp64 on the torch backend).
        v: ``[B, T, HV, V]``, same dtype as q; HV a multiple of H, value head j reads q/k head
            ``j // (HV // H)`` (GVA).
        g: ``[B, T, HV]`` per-token log-decay, natural log, ≤ 0, *not* cumulated; values below
            ``LOG_DECAY_MIN`` = −128 (−inf included) act as −128, whose decay is already 0 in
            fp32. Positive g is outside the contract and not checked (that would need a sync).
        beta: ``[B, T, HV]`` write strength, usually in (0, 1) (up to 2 with negative
            eigenvalues).
        scale: output scale, a finite real number (int, float or numpy scalar; not a bool),
            default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (N = B, or the number of packed sequences); any float
            dtype, used in fp32.
        output_final_state: return the ``[N, HV, K, V]`` fp32 final state.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (needs B == 1); empty
            segments are legal (their state passes through); a buffer longer than
            ``cu_seqlens[-1]`` gets o = 0 in its tail.
        use_qk_l2norm_in_kernel: L2-normalise q and k (fp32, eps 1e-6) inside the op.
        chunk_size: 16, 32 or 64, an int (numpy integer scalars are taken; floats, bools and
            tensors raise TypeError).
        backend: "auto" | "torch" | "materialized" | "fused". auto: on CUDA fused where it
            is measured faster (Hopper, bf16, K = V = 128, chunk 64, dense batches of
            2,048+ tokens not cut into segments: ``_auto_picks_fused``), else materialized;
            torch on CPU.
        solve_method: the kkt_solve inverse (seed 001, Table 2): "blocked" (default, stable);
            the Triton backends also take "mxr" and "newton_schulz", the torch backend every
            method of :data:`gdn_fused.inverse.METHODS` (including the unstable "mch"). The
            fused backend runs "blocked" only and hands other methods to materialized. The
            others are for the inverse study, not for use: "mxr" (no block refinement) is only
            conditionally stable, in fp32 too — one key repeated over a chunk with beta 1.99
            and g = 0 puts o off by a relative 0.3–1 at T = 64 and up to 70 at T = 200
            (new-user trial, session 28; docs/inverse_accuracy.md).
        solve_iters: Newton–Schulz iterations, a positive int (default 2·log2(chunk_size) + 2;
            convergence is not checked: too few give a wrong inverse without an error, e.g.
            2 is off by ~1 in relative error, docs/inverse_accuracy.md);
            only for the Newton–Schulz methods, None for every other one ("mxr" runs without
            refinement of its block inverses, on every backend).
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens_cpu,
        chunk_indices, cp_context, **kwargs: fla 0.6.0's options, with fla's meaning —
            ``use_beta_sigmoid_in_kernel`` (beta as the raw pre-activation; with
            ``allow_neg_eigval`` 2·sigmoid), ``state_v_first`` (states as ``[N, HV, V, K]``),
            and by keyword ``use_gate_in_kernel`` (+ ``A_log``, ``dt_bias``: g as the raw gate
            pre-activation); ``cu_seqlens_cpu`` and ``chunk_indices`` are accepted and not
            read (cu_seqlens is read to the host once a call, for forward and backward);
            ``cp_context`` must be None (see :mod:`gdn_fused.fla_options`). Any other keyword
            raises TypeError.

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 — fp64 on the torch
        backend with fp64 inputs — or None)``.

    Non-finite inputs: a NaN or inf in k, v, g or beta at token t makes o non-finite from the
    first token of t's chunk on (not from t): the chunkwise form multiplies every token of a
    chunk into the chunk's products (K Kᵀ, W, U), where 0 · NaN = NaN, as fla's does.
    ``fused_recurrent_gated_delta_rule`` is causal token by token. Other sequences of a batch
    or of cu_seqlens and a packed buffer's tail past ``cu_seqlens[-1]`` stay unaffected.
    Padding to be ignored must hold finite values (GatedDeltaNet zeroes its padded positions).

    Gradients: first order on every backend. The Triton backends' backward is not itself
    differentiable: a gradient of their gradients (``create_graph=True`` then backward
    through the result) raises RuntimeError; the torch backend differentiates to any order.

    Raises:
        TypeError / ValueError naming the argument, before any kernel launches, for wrong
        shapes, dtypes, devices, head counts, cu_seqlens, chunk_size, scale, backend,
        solve_method or solve_iters (the same rules on every backend, also for T = 0), for a
        Triton backend on CPU tensors without TRITON_INTERPRET=1, on float64 data, or on bf16
        under the interpreter, and for unknown or unsupported keywords (``head_first=True``,
        ``cp_context``).
    """
    fla = parse_fla_options(dict(kwargs, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                                 cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                                 cp_context=cp_context), "chunk_gated_delta_rule")
    initial_state = fla.state_in(initial_state)
    _, cu_seqlens_cpu = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, backend,
                                     fla.state_v_first)
    chunk_size = as_chunk_size(chunk_size)
    scale = as_scale(scale, q.shape[-1])
    output_final_state = as_flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = as_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    via_auto = backend == "auto"
    if not via_auto:
        # on the backend the caller named, before a fallback could rename it in the message
        check_solve_method(backend, solve_method, solve_iters)
        check_device_for_backend(backend, q.device, q.dtype)
    backend = resolve_backend(backend, q, v, chunk_size, cu_seqlens)
    if backend == "fused" and solve_method != "blocked":
        logger.debug("gdn_fused: fused runs solve_method='blocked' only; using materialized")
        backend = "materialized"
    solve_iters = check_solve_method(backend, solve_method, solve_iters, via_auto)
    check_device_for_backend(backend, q.device, q.dtype)
    g, beta = fla.gates(g, beta)  # after every check: no work for input that raises
    if backend == "torch":
        g = g.clamp(min=LOG_DECAY_MIN)  # (the Triton kernels floor g where they load it)
        o, ht = chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state,
                                           output_final_state, cu_seqlens,
                                           use_qk_l2norm_in_kernel, chunk_size,
                                           solve_method, solve_iters)
        return o.to(q.dtype), fla.state_out(ht)
    from gdn_fused.autograd import chunk_gated_delta_rule_triton
    o, ht = chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state,
                                          output_final_state, cu_seqlens,
                                          use_qk_l2norm_in_kernel, chunk_size, backend,
                                          solve_method, solve_iters, cu_seqlens_cpu)
    return o, fla.state_out(ht)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                     state_v_first=False, cu_seqlens=None, *,
                                     backend="auto", **kwargs):
    """Token-by-token Gated DeltaNet for decode (a few tokens), state updated in fp32.

    Same conventions, shapes, fla options (``**kwargs``) and errors as
    :func:`chunk_gated_delta_rule`; g defaults to 0 (no decay) and beta to 1. The positional
    order is fla 0.6.0's — ``(q, k, v, g, gk, gv, beta, scale, initial_state,
    output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
    use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)``, backend
    keyword-only — so pass beta by keyword; ``gk`` and ``gv``
    (per-key / per-value gates of fla's other models) must be None (ValueError otherwise).
    backend: "auto" (one Triton launch on CUDA, the torch recurrence on CPU or when an input
    requires grad), "torch" (differentiable), or "triton" (CUDA, or CPU with
    TRITON_INTERPRET=1; inference only: raises ValueError when gradients are needed). No
    chunk_size or solve_method: there is no chunked inverse. Math: the Gated DeltaNet
    recurrence (Yang, Kautz & Hatamizadeh, arXiv:2412.06464, §3.3), one token at a time.

    Returns ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 — fp64 on the torch
    backend with fp64 inputs — or None)``. Raises as the chunk op, and ValueError for
    ``use_gate_in_kernel=True`` without g."""
    # beta defaults before fla's options (as in fla, use_beta_sigmoid_in_kernel then acts on
    # the default), g after them (use_gate_in_kernel needs a g)
    for name, gate in (("gk", gk), ("gv", gv)):
        if gate is not None:
            raise ValueError(f"{name}: per-key / per-value gates are not part of Gated DeltaNet; "
                             "pass the scalar log-decay as g (and beta by keyword: the "
                             "positional order is fla's, q, k, v, g, gk, gv, beta)")
    if beta is None and isinstance(v, torch.Tensor):
        beta = v.new_ones(v.shape[:3], dtype=torch.float32)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    fla = parse_fla_options(dict(kwargs, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                                 dt_bias=dt_bias,
                                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first),
                            "fused_recurrent_gated_delta_rule")
    if g is None and fla.use_gate_in_kernel:
        raise ValueError("use_gate_in_kernel=True needs g, the raw gate pre-activation")
    if g is None and isinstance(v, torch.Tensor):
        g = v.new_zeros(v.shape[:3], dtype=torch.float32)
    initial_state = fla.state_in(initial_state)
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, "auto", fla.state_v_first)
    scale = as_scale(scale, q.shape[-1])
    output_final_state = as_flag("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = as_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad
        for x in (q, k, v, g, beta, initial_state, fla.A_log, fla.dt_bias))
    if backend == "auto":
        # the Triton decode kernel has no backward: gradients go through the torch recurrence
        backend = "triton" if q.device.type == "cuda" and not needs_grad else "torch"
    if backend == "triton" and needs_grad:
        raise ValueError("backend='triton' decode is inference-only (no backward); use "
                         "backend='torch' or chunk_gated_delta_rule for gradients")
    check_device_for_backend(backend, q.device, q.dtype)
    g, beta = fla.gates(g, beta)  # after every check: no work for input that raises
    g = g.clamp(min=LOG_DECAY_MIN)  # as in the chunk op, so prefill and decode agree
    if backend == "torch":
        o, ht = recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale, initial_state,
                                               output_final_state, cu_seqlens,
                                               use_qk_l2norm_in_kernel)
        return o.to(q.dtype), fla.state_out(ht)
    from gdn_fused.kernels.recurrent import fused_recurrent_fwd
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    o, ht = fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state,
                                output_final_state, cu_seqlens)
    return o, fla.state_out(ht)
