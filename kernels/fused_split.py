"""Sequence splitting for the fused forward: exact composition of segment state maps.

With few (sequence, value head) pairs — a Qwen3-Next layer at B = 1 has 32 value heads for
132 SMs — the fused kernel's one-program-per-head grid leaves most of the chip idle on a long
prompt. Cutting each sequence into NS segments run side by side fills it, provided each segment
can start from its true entering state.

Per chunk the state update is affine in the entering state (design card §Chunkwise form)::

    S_C = exp(G_C) S₀ + (D K)ᵀ (U − W S₀) = M_c S₀ + b_c,
    M_c = exp(G_C) I − (D K)ᵀ W   (K×K),   b_c = (D K)ᵀ U   (K×V),   D = D_exp(G_C − G)

so a segment maps S_in to S_out = M S_in + b with M the product of its chunks' M_c and b its
final state from a zero start. Both come out of one recurrence run on the K + V columns of
[M | b], started from [I | 0], with the value columns fed by U and the M columns by U = 0.
:func:`segment_maps` runs it for all segments but the last (one launch, no output written);
the fused kernel's program for segment s then composes S_in(s) = M_{s−1}(… (M_0 h0 + b_0) …)
+ b_{s−1} and proceeds as usual. The composition is exact algebra — no truncation of the
gate product — so heads with g = 0 (no decay, M far from 0) are as exact as decaying ones.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.fused_fwd import (SUB, _chunk_gate_inverse_or_load, _delta_values,
                                         _head_pointers, _load_chunk_rows, _program_coords,
                                         _segment_chunks, _seq_bounds, _state_step, _strides)

MAX_SEGMENTS = 8
# Cost model of choose_num_segments, in units of one fused-kernel chunk step (guesses to be
# calibrated on the H200): a map-kernel chunk step per BV columns skips QKᵀ, Q·S, P·V' and the
# o store (≈ 0.65 of the work); composing the entering state through one earlier segment costs
# a K×K by K×BV fp32 product, about one chunk step.
MAP_STEP_COST = 0.65
COMPOSE_COST = 1.0
PROGRAMS_PER_SM = 1  # resident fused programs per SM: registers of one 256-thread program


@triton.jit
def _segment_map_kernel(k, v, g, beta, Ai, seg_maps, cu_seqlens, T,
                        s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
                        NUM_SEG: tl.constexpr, VARLEN: tl.constexpr, LOAD_T: tl.constexpr,
                        STATE_PRECISION: tl.constexpr):
    """Grid (N·HV·(K+V)/BV, NUM_SEG − 1): program (sequence, value head, column block of
    [M | b]) × segment; writes seg_maps[n, hv, seg, :, columns] fp32. Strides as in the fused
    kernel (g and beta share theirs); Ai as there (LOAD_T)."""
    i_c, i_n, i_hv, i_h = _program_coords((K + V) // BV, HV, H)
    seg = tl.program_id(1)
    i_b, bos, eos = _seq_bounds(cu_seqlens, i_n, T, VARLEN)
    c_lo, c_hi = _segment_chunks(bos, eos, seg, C, NUM_SEG)
    k, v, g, beta = _head_pointers(k, v, g, beta, i_b, i_h, i_hv, s_kb, s_kh, s_vb, s_vh, s_gb,
                                   s_gh)
    if LOAD_T:
        Ai += (i_b * T * HV + i_hv) * C

    o_k = tl.arange(0, K)
    col = i_c * BV + tl.arange(0, BV)  # column of [M | b]
    is_b = col >= K
    rows = tl.arange(0, C)
    # [I | 0] start: identity columns for M; b columns (col ≥ K) match no row and start at 0
    S = tl.where(o_k[:, None] == col[None, :], 1.0, 0.0)
    for c in range(c_lo, c_hi):
        t0 = bos + c * C
        n_valid = eos - t0
        tok = t0 + rows
        b_k, b_g, b_beta = _load_chunk_rows(k, g, beta, t0, n_valid, s_kt, s_gt, K, C)
        # only b columns read values; M columns see U = 0 (their loads are masked off)
        b_v = tl.load(v + tok[:, None] * s_vt + (col - K)[None, :],
                      mask=(rows < n_valid)[:, None] & is_b[None, :], other=0.0)
        G, T_inv = _chunk_gate_inverse_or_load(b_k, b_g, b_beta, Ai, t0, n_valid, HV * C, SUB,
                                               LOAD_T)
        v_new = _delta_values(T_inv, b_k, b_v, G, b_beta, S, STATE_PRECISION)
        S = _state_step(S, b_k, G, v_new, STATE_PRECISION)
    head = (i_n * HV + i_hv).to(tl.int64)
    out = seg_maps + ((head * (NUM_SEG - 1) + seg) * K + o_k[:, None]) * (K + V) + col[None, :]
    tl.store(out, S)


def segment_maps(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 Ai: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], N: int,
                 num_segments: int, chunk_size: int, BV: int, state_precision: str,
                 options: dict) -> torch.Tensor:
    """Affine state maps [M | b] of segments 0 … NS−2 of every (sequence, value head).

    k [B, T, H, K], v [B, T, HV, V] (same dtype, last dim contiguous), g, beta [B, T, HV] any
    float dtype with one layout, Ai [B, T, HV, C] fp32 (each chunk's inverse, read instead of
    recomputed) or None, cu_seqlens [N+1] or None. Segment s covers chunks
    [s·P, (s+1)·P) of its sequence, P = ceil(chunks / NS). BV (capped to divide K),
    state_precision and the launch options are the fused launch's
    (:func:`gdn_fused.kernels.fused_fwd.launch_config`,
    :func:`~gdn_fused.kernels.fused_fwd.dot_precisions`), so both round alike.

    Returns seg_maps [N, HV, NS−1, K, K+V] fp32 with S_out = seg_maps[..., :K] @ S_in +
    seg_maps[..., K:] for each segment (one launch)."""
    _, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    # the column blocks must tile K + V: with K = 64 a main-launch BV of 128 would leave the
    # last 64 columns of b unwritten
    BV = math.gcd(BV, K)
    maps = torch.empty(N, HV, num_segments - 1, K, K + V, dtype=torch.float32, device=k.device)
    grid = (N * HV * ((K + V) // BV), num_segments - 1)
    direct.launch(
        _segment_map_kernel, grid,
        k, v, g, beta, Ai, maps, cu_seqlens, T, *_strides(k), *_strides(v), *_strides(g),
        H=H, HV=HV, K=K, V=V, BV=BV, C=chunk_size, SUB=SUB, NUM_SEG=num_segments,
        VARLEN=cu_seqlens is not None, LOAD_T=Ai is not None, STATE_PRECISION=state_precision,
        **options)
    return maps


@functools.lru_cache(maxsize=256)  # a pure function of the shape, evaluated on every call
def choose_num_segments(N: int, HV: int, K: int, V: int, BV: int, mean_len: float,
                        chunk_size: int, sms: int) -> int:
    """Segments per sequence for the fused forward, from the shape alone (deterministic, no
    device read, so CUDA-graph capture sees the same plan every time).

    Models the wall time in chunk steps as the chunks per segment times the waves of the map
    launch and of the main launch, plus the composition of up to NS−1 maps, and returns the NS
    in 1 … MAX_SEGMENTS that minimises it (ties to fewer segments). Packed sequences use the
    mean length, since their lengths live on the device."""
    chunks = max(1, math.ceil(mean_len / chunk_size))
    slots = sms * PROGRAMS_PER_SM
    main_programs = N * HV * (V // BV)
    map_programs = N * HV * ((K + V) // BV)

    def cost(ns: int) -> float:
        per_seg = math.ceil(chunks / ns)
        t = per_seg * math.ceil(main_programs * ns / slots)
        if ns > 1:
            t += per_seg * MAP_STEP_COST * math.ceil(map_programs * (ns - 1) / slots)
            t += COMPOSE_COST * (ns - 1)
        return t

    return min(range(1, MAX_SEGMENTS + 1), key=lambda ns: (cost(ns), ns))
