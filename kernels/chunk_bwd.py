"""The chunkwise backward: exact gradients of chunk_gated_delta_rule from its inputs alone.

Nothing from the forward is needed but its inputs (q, k, v, g, beta, initial_state,
cu_seqlens) and, optionally, its T (the autograd Function passes the materialized forward's,
and the fused backend's Hopper route's: gdn_fused/autograd.py). The backward first recomputes
the forward's other intermediates with the materialized forward kernels (G, T, the per-chunk
states h and v_new — one cumsum, one KKᵀ+inverse unless T is given, one state pass;
everything but the output kernel). The state pass runs in the chain form of the fused
forward (:data:`CHAIN_T`): V' = T diag(β) (V − diag(e^G) K h) from T and v, so W and U are
never formed, and the reverse pass below applies Wᵀ dV' as Kᵀ diag(β e^G) (Tᵀ dV'). Then it
runs four kernels:

    dV'_local           = chunk_bwd_dv_local   (parallel over chunks)   kernels/chunk_bwd_dv.py
    dh, dV' (dv2), dh0  = chunk_bwd_state      (reverse over chunks)    kernels/chunk_bwd_state.py
    dQ, dK, dW, dg      = chunk_bwd_dqkwg      (parallel)               kernels/chunk_bwd_dqkwg.py
    dK, dV, dβ, dg      = wu_bwd               (parallel; through W = T diag(β e^G) K,
                                                U = T diag(β) V, T, A, and the reverse cumsum
                                                to per-token dg)         kernels/wu_bwd.py

(on Hopper, where they apply, the last three as warp-specialized Gluon kernels:
kernels/gluon_bwd_state.py, kernels/gluon_dqkwg.py, kernels/gluon_wu_bwd.py), then sums dQ
and dK over the value heads that share a q/k head (GVA, kernels/group_sum.py; the Gluon
wu_bwd sums dK itself). Where the Gluon reverse pass leaves half the SMs idle (B·HV ≤ 33 on
the H200) it runs on a side stream beside the recompute of h and v_new
(kernels/streams.py, side_by_side).
Derivation and the precision of every intermediate: docs/backward.md.

Why recompute rather than save: h is K·V per chunk and value head (32 KB in bf16 at K = V = 128,
half a KB per token-head at C = 64); recomputing it costs one state pass (checkpointed:
segments side by side from the forward's stored states), and the fused forward never
materializes it, so one backward serves both Triton backends. T is the exception when the
forward has it (C values per token-head, 128 B in bf16): its recompute is a latency-bound
solve (250 µs at B = 1, T = 32768 on the H200), as fla's backward reads its forward's A.
"""
import os

import torch
import triton

from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
from gdn_fused.kernels.chunk_gate import chunk_cumsum
from gdn_fused.kernels.chunk_index import chunk_layout, sm_count
from gdn_fused.kernels.chunk_state import chunk_state
from gdn_fused.kernels.group_sum import group_sum
from gdn_fused.kernels.kkt import dot_precision
from gdn_fused.kernels.kkt_solve import chunk_inverse, default_inverse_dtype
from gdn_fused.kernels.materialized import (contiguous, gluon_tiles_apply,
                                            uses_state_output_kernel)
from gdn_fused.kernels.streams import side_by_side
from gdn_fused.kernels.wu import recompute_w_u
from gdn_fused.kernels.wu_bwd import wu_bwd


# dQ, dK, dW and the partial dg from the persistent warp-specialized Gluon kernel
# (kernels/gluon_dqkwg.py) where it applies (materialized.gluon_tiles_apply), else
# chunk_bwd_dqkwg.
# GDN_GLUON_DQKWG=0 keeps the Triton kernel (A/B timing)
GLUON_DQKWG = os.environ.get("GDN_GLUON_DQKWG", "1") != "0"


def dqkwg(q, k, v_new, h, dh, g, G, do, dv2, scale, chunk_size, chunk_offsets, prec, idx):
    """(dq, dk, dw, partial dg) per value head: the Gluon kernel where GLUON_DQKWG and it
    applies, else chunk_bwd_dqkwg; the same math (tests/test_gluon_dqkwg.py)."""
    if GLUON_DQKWG and gluon_tiles_apply(q, do, chunk_size, idx["cu_seqlens"]):
        from gdn_fused.kernels.gluon_dqkwg import chunk_bwd_dqkwg_gluon
        return chunk_bwd_dqkwg_gluon(q, k, v_new, h, dh, G, do, dv2, scale)
    return chunk_bwd_dqkwg(q, k, v_new, h, dh, g, do, dv2, scale, chunk_size,
                           chunk_offsets=chunk_offsets, dot_precision=prec, **idx)


# dK, dV, dβ and dg through W, U and T from the persistent warp-specialized Gluon kernel
# (kernels/gluon_wu_bwd.py) where it applies (materialized.gluon_tiles_apply, T in bf16), else
# wu_bwd. GDN_GLUON_WU_BWD=0 keeps the Triton kernel (A/B timing)
GLUON_WU_BWD = os.environ.get("GDN_GLUON_WU_BWD", "1") != "0"


def wu_backward(k, v, g, G, beta, Ai, dw, dv2, dk, dg_part, chunk_size, prec, idx):
    """(dk summed over the value heads of each q/k head, dv, dbeta, dg) from dk's per-value-head
    partial: the Gluon kernel where GLUON_WU_BWD and it applies, else wu_bwd (completing dk in
    place) and group_sum; the same math (tests/test_gluon_wu_bwd.py)."""
    if (GLUON_WU_BWD and all(x.dtype == torch.bfloat16 for x in (Ai, dw, dv2, dk))
            and gluon_tiles_apply(k, v, chunk_size, idx["cu_seqlens"])):
        from gdn_fused.kernels.gluon_wu_bwd import wu_bwd_gluon
        return wu_bwd_gluon(k, v, G, beta, Ai, dw, dv2, dk, dg_part, g.dtype)
    dv, dbeta, dg = wu_bwd(k, v, g, beta, Ai, dw, dv2, dk, dg_part, chunk_size,
                           dot_precision=prec, **idx)
    return group_sum(dk, k.shape[2], k.dtype), dv, dbeta, dg


# the reverse state pass on a transposed Gluon chain (kernels/gluon_bwd_state.py) where it
# applies (materialized.gluon_tiles_apply), else chunk_bwd_state. GDN_GLUON_BWD_STATE=0 keeps
# the Triton kernel (A/B timing)
GLUON_BWD_STATE = os.environ.get("GDN_GLUON_BWD_STATE", "1") != "0"


def reverse_states(q, k, w, g, gate_rows, do, dv_local, scale, dht, initial_state, chunk_size,
                   N, cu_seqlens, chunk_offsets, num_chunks, prec, beta=None):
    """(dh, dv2, dh0): the Gluon kernel where ``gate_rows`` (chunk_cumsum's, given where
    :func:`uses_gluon_bwd_state`) are given, else chunk_bwd_state; the same math
    (tests/test_gluon_bwd_state.py). ``w``: W, or with ``beta`` T (the chain form)."""
    if gate_rows is not None:
        from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
        return chunk_bwd_state_t(q, k, w, gate_rows, do, dv_local, scale, dht, initial_state,
                                 chain_t=beta is not None)
    return chunk_bwd_state(q, k, w, g, do, dv_local, scale, dht, initial_state, chunk_size, N,
                           cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets,
                           num_chunks=num_chunks, dot_precision=prec, beta=beta)


def uses_gluon_bwd_state(q, do, chunk_size, cu_seqlens):
    """Whether the reverse state pass runs as kernels/gluon_bwd_state.py's kernel."""
    return GLUON_BWD_STATE and gluon_tiles_apply(q, do, chunk_size, cu_seqlens)


# The backward in the forward's chain form (forward_t, kernels/gluon_transposed.py): the
# recompute of h and v_new forms V' = T diag(β) (V − diag(e^G) K h) and the reverse state pass
# Wᵀ dV' = Kᵀ diag(β e^G) (Tᵀ dV'), so W and U are never formed (recompute_w_u and their HBM
# round trips gone; one product more a chunk on each state pass's chain). dQ/dK/dW/dg and
# wu_bwd are unchanged: dW = −dV' hᵀ needs no W. GDN_BACKWARD_W_U=1 forms W and U as before
# (A/B timing).
CHAIN_T = os.environ.get("GDN_BACKWARD_W_U", "0") != "1"


# The recompute of h and v_new on the forward's transposed Gluon chain (gluon_transposed.
# chunk_state_t) where the forward runs that kernel: bit-identical to chunk_state (GPU
# tests), but slower on the H200 (1,170 vs 664 µs at (1, 32768), 607 vs 423 at (8, 4096);
# the backward 6.47 → 6.97 ms; session 7), so off until chunk_state_t wins.
RECOMPUTE_ON_TRANSPOSED_CHAIN = False


def recompute_states(q, k, w, u, G, initial_state, chunk_size, N, cu_seqlens, chunk_offsets,
                     num_chunks, prec, checkpoints=None, beta=None):
    """(h, v_new) of the forward, from chunk_state (split at the forward's ``checkpoints``
    when it stored them; ``w``, ``u``: W and U, or with ``beta`` T and v, the chain form) or,
    on Hopper where the forward uses the transposed Gluon kernel (and
    RECOMPUTE_ON_TRANSPOSED_CHAIN, W/U form only), from chunk_state_t — the same bits either
    way."""
    if (RECOMPUTE_ON_TRANSPOSED_CHAIN and beta is None
            and uses_state_output_kernel(q, u, chunk_size, cu_seqlens)):
        from gdn_fused.kernels.gluon_transposed import chunk_state_t
        h, v_new, _ = chunk_state_t(k, w, u, G, initial_state, False)
        return h, v_new
    h, v_new, _ = chunk_state(k, w, u, G, initial_state, False, chunk_size, N,
                              cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets,
                              num_chunks=num_chunks, dot_precision=prec,
                              checkpoints=checkpoints, beta=beta)
    return h, v_new


# The reverse state pass beside the recompute of h and v_new (two streams) where the Gluon
# reverse pass leaves at least half the SMs idle (B·HV·V / 64 programs, one an SM: B·HV ≤ 33 at
# V = 128 on the H200's 132 SMs): the two are independent (the reverse pass reads W, not h),
# and the recompute's programs (chunk-parallel at the forward's checkpoints, else one per
# sequence, value head and value block) fill the idle SMs. H200, session 17: the pair 1,228 →
# 1,106 µs at (1, 32768), graph fwd+bwd (1, 8192) 1.47 → 1.42 ms, (1, 2048) 0.47 → 0.43.
# GDN_OVERLAP_RECOMPUTE=0 runs them one after the other (A/B timing).
OVERLAP_RECOMPUTE = os.environ.get("GDN_OVERLAP_RECOMPUTE", "1") != "0"


def overlaps_recompute(gluon_reverse, q, v):
    """Whether the backward runs the reverse state pass and the recompute side by side: the
    Gluon reverse pass (``gluon_reverse``: :func:`uses_gluon_bwd_state`) on at most half the
    SMs."""
    if not OVERLAP_RECOMPUTE or not gluon_reverse or not q.is_cuda:
        return False
    from gdn_fused.kernels.gluon_bwd_state import BV
    programs = v.shape[0] * v.shape[2] * triton.cdiv(v.shape[3], BV)
    return 2 * programs <= sm_count(q.device)


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens,
                               chunk_size=64, cu_seqlens_cpu=None, Ai=None, checkpoints=None):
    """Gradients of (o, final_state) = chunk_gated_delta_rule(q, k, v, g, beta, ...).

    Args:
        q, k: ``[B, T, H, K]`` fp16/bf16/fp32 (already L2-normalised if the op normalises).
        v: ``[B, T, HV, V]``, q's dtype. g, beta: ``[B, T, HV]`` (g per token, natural log).
        scale: float. initial_state: ``[N, HV, K, V]`` or None. cu_seqlens: ``[N+1]`` or None.
        do: ``[B, T, HV, V]`` cotangent of o. dht: ``[N, HV, K, V]`` cotangent of the final
        state, or None (treated as 0). chunk_size: 16, 32 or 64 (as in the forward).
        cu_seqlens_cpu: the offsets on the host if known (the forward's validated copy).
        Ai: the forward's T ``[B, T, HV, C]`` from the blocked inverse in
        ``default_inverse_dtype(q.dtype)`` (what the materialized forward computes), or None to
        recompute it (the same bits).
        checkpoints: the forward's fp32 states entering chunks SEGMENT_CHUNKS, 2·SEGMENT_CHUNKS,
        … ``[n, N, HV, K, V]`` (kernels/chunk_state.py, new_checkpoints), or None: with them the
        recompute of h and v_new runs each sequence's segments side by side.
    Returns:
        ``(dq, dk, dv, dg, dbeta, dh0)`` in the dtypes and shapes of q, k, v, g, beta and
        initial_state (dh0 None without an initial state). dq, dk are summed over the HV // H
        value heads of each q/k head. Rows of a packed buffer past cu_seqlens[-1] get exactly 0.
    """
    q, k, v, g, beta, initial_state, do, dht, cu_seqlens = contiguous(
        q, k, v, g, beta, initial_state, do, dht, cu_seqlens)
    B, H = q.shape[0], q.shape[2]
    HV = v.shape[2]
    prec = dot_precision(q.dtype)
    N, chunk_offsets, idx = chunk_layout(cu_seqlens, B, chunk_size, cu_seqlens_cpu)
    # recompute the forward's intermediates with its kernels and T's storage dtype (always the
    # stable blocked inverse, whatever solve_method the forward ran); h and v_new by the chain
    # form (CHAIN_T, W and U never formed: fp32 sums and bf16 roundings of their own, within
    # the state bound of the forward's) or, with GDN_BACKWARD_W_U=1, from W and U as a default
    # materialized forward computes them
    gate_rows = None
    if uses_gluon_bwd_state(q, do, chunk_size, cu_seqlens):
        G, gate_rows = chunk_cumsum(g, chunk_size, gate_rows=[beta] if CHAIN_T else [],
                                    chain_rows=CHAIN_T, **idx)
    else:
        G = chunk_cumsum(g, chunk_size, **idx)
    if Ai is None:
        Ai = chunk_inverse(k, G, beta, HV, chunk_size, default_inverse_dtype(q.dtype), **idx)
    # the chain form: T and v in the places of W and U (never formed), β to the state passes
    w, u, chain_beta = (Ai, v, beta) if CHAIN_T else (
        *recompute_w_u(k, v, G, beta, Ai, dot_precision=prec, **idx), None)
    dv_local = chunk_bwd_dv_local(q, k, g, do, scale, chunk_size, dot_precision=prec, **idx)

    def reverse():
        return reverse_states(q, k, w, g, gate_rows, do, dv_local, scale, dht, initial_state,
                              chunk_size, N, cu_seqlens, chunk_offsets, idx["num_chunks"], prec,
                              chain_beta)

    def recompute():
        return recompute_states(q, k, w, u, G, initial_state, chunk_size, N, cu_seqlens,
                                chunk_offsets, idx["num_chunks"], prec, checkpoints, chain_beta)
    if overlaps_recompute(gate_rows is not None, q, v):
        (dh, dv2, dh0), (h, v_new) = side_by_side(reverse, recompute, q.device)
    else:
        h, v_new = recompute()
        dh, dv2, dh0 = reverse()
    del u, dv_local
    dq, dk, dw, dg_part = dqkwg(q, k, v_new, h, dh, g, G, do, dv2, scale, chunk_size,
                                chunk_offsets, prec, idx)
    del h, dh, v_new
    dk, dv, dbeta, dg = wu_backward(k, v, g, G, beta, Ai, dw, dv2, dk, dg_part, chunk_size,
                                    prec, idx)
    return group_sum(dq, H, q.dtype), dk, dv, dg, dbeta, dh0
