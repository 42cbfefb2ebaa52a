"""Fused chunkwise Gated DeltaNet forward: one launch over the chunks, every intermediate on
chip — this module's plain-Triton kernel, and on Hopper for dense bf16 batches of 2,048+
tokens at K = V = 128 the warp-specialized Gluon kernel it routes to (WARP_SPECIALIZED below).

Each program owns one (sequence, value head, block of BV value columns) and walks that
sequence's chunks in order, carrying its K×BV slice of the state S in fp32 registers. Per chunk
of C tokens (design card §Chunkwise form; Yang, Kautz & Hatamizadeh, *Gated Delta Networks*,
arXiv:2412.06464, §3.3)::

    G  = cumsum(g)                                  cumulative log-decay, natural log
    A  = strictLower(D_beta (Γ ⊙ K Kᵀ)),  Γ_ij = exp(G_i − G_j)
    T  = (I + A)⁻¹                                  blocked recursion, fp32
    W  = T D_beta D_exp(G) K,   U = T D_beta V
    V' = U − W S  =  T D_beta (V − D_exp(G) K S)      (W never formed)
    O  = scale (D_exp(G) Q S + lowerIncl(Γ ⊙ Q Kᵀ) V')
    S ← exp(G_C) S + Kᵀ (D_exp(G_C − G) V')

In the plain kernel only o and the final state are written to HBM, except that by default
(PRECOMPUTE_INVERSE) each chunk's T is first computed by chunk-parallel launches and read
here, which takes the inverse off the sequential chunk loop at the cost of fp32 scratch A and
T (B·T·HV·C each); the Hopper route's T is bf16 and is returned for the backward.
Long sequences with few heads can be cut into segments run side by side (:mod:`gdn_fused.kernels.fused_split`): one extra launch summarises
each segment's affine state map, and each program here first composes its exact entering state.

Numerics. Every exponent is ≤ 0 for g ≤ 0: Γ is formed from differences G_i − G_j with the
upper triangle and the rows past the sequence end selected away *before* the exp (G_i − G_j > 0
there and may overflow; inf·0 is NaN), so a decay of −70 per token underflows to 0 and never
gives inf or NaN. The inverse is computed in fp32 (input_precision="ieee"). With 16-bit
inputs, K Kᵀ, Q Kᵀ, K S, Q S and P V' take 16-bit operands (fp32 accumulation, tensor cores),
while the two products whose rounding accumulates in the state, T·R and Kᵀ·V', keep fp32
operands at tf32 (see :func:`dot_precisions` and docs/fused_design.md for the error study).
fp32 inputs use exact fp32 products throughout.

Design notes and the reasons behind them: docs/fused_design.md.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from gdn_fused.kernels import chunk_index
from gdn_fused.kernels import launch as direct
from gdn_fused.kernels import replay
from gdn_fused.kernels.chunk_gate import floored, gated_decay
from gdn_fused.kernels.chunk_index import sm_count
from gdn_fused.kernels.chunk_state import checkpoint_count, new_checkpoints
from gdn_fused.kernels.kkt_solve import invert_diagonal_blocks
from gdn_fused.validation import CHUNK_SIZES, triton_interpreted

HEAD_DIMS = (64, 128)      # K and V the kernel is built and tested for
SUB = 16                   # diagonal block of the blocked inverse: tl.dot's smallest tile
# value columns and warps per program: (64, 8), the only launch verified on the H200. ptxas
# (sm_90a, K = V = 128, bf16) would spill less at (32, 4) — 512 B a thread with T read against
# 1,868 B — but Triton 3.6 miscompiles the kernel there: compute-sanitizer reports an
# out-of-bounds shared-memory read at the P·V' output product (line "b_o += tl.dot(attn, …)")
# with T read, and with the on-chip inverse o comes out wrong (relative difference 1.06 against
# materialized, final state right). Keep the launch overrides for sweeps on verified values.
BLOCK_V = 64
NUM_WARPS = 8
# Invert each chunk in a chunk-parallel launch before the fused one and read T there (the
# structure of FlashQLA's forward, ../shared/anchors.md), rather than on the chunk loop, where
# the inverse's dependency chain measured ~20 µs a chunk step on the H200: B=8, T=4096 went
# 5.78 → 2.89 ms, B=1, T=32768 11.56 → 4.17 ms (eval.bench, docs/speed_log.md).
PRECOMPUTE_INVERSE = True
# On Hopper, for the inputs the Gluon state + output kernel takes (materialized.
# uses_state_output_kernel: sm_90, bf16, K = V = 128, chunk 64, dense batches of 2,048+
# tokens), the fused forward runs the same structure as this kernel (every chunk's T first,
# chunk-parallel, then one launch over the chunks doing W, U, the state recurrence and the
# output on chip) warp-specialized in Gluon: kernels/gluon_transposed.forward_t, whose state
# chain forms V' = T D_β (V − D_{e^G} K S) itself beside its output warpgroup (session 18, two
# until session 23; sessions 10–17 a fourth warpgroup formed W and U), after the Gluon
# kkt_solve_from_k's bf16 T; the three launches chained by programmatic dependent launch
# (kernels/pdl.py).
# This plain-Triton kernel keeps every other input, the interpreter and the launch overrides
# (a call naming num_segments, precompute_inverse, block_v, num_warps or num_stages runs it).
# H200, (1, 32768): 4.00 ms for this kernel (register spills of a one-program-per-head chunk
# loop, docs/fused_design.md). GDN_FUSED_WARP_SPECIALIZED=0 turns the route off (A/B timing).
WARP_SPECIALIZED = os.environ.get("GDN_FUSED_WARP_SPECIALIZED", "1") != "0"
IEEE = tl.constexpr("ieee")  # exact for fp32 operands; 16-bit operands use tensor cores anyway
# Where forward_t runs segment 0's state pass alone first (two segments at B = 1: 64 programs
# at HV = 32 for 132 SMs), the inverse of segment 1's chunks runs beside it instead of before
# it (session 19). GDN_SPLIT_INVERSE=0: the whole inverse first (A/B timing)
SPLIT_INVERSE = os.environ.get("GDN_SPLIT_INVERSE", "1") != "0"


# ----------------------------------------------------------------------------------------------
# On-chip chunk math, shared with the segment-map kernel of fused_split.py
# ----------------------------------------------------------------------------------------------

@triton.jit
def _block_rows(A, sel, S: tl.constexpr):
    """The S×S block of each block row of A [C, C] that ``sel`` selects (at most one per block
    row; zero where none): [C/S, S, S]."""
    C: tl.constexpr = A.shape[0]
    return tl.sum(tl.reshape(tl.where(sel, A, 0.0), (C // S, S, C // S, S)), axis=2)


@triton.jit
def _halves(x):
    """The even- and odd-indexed blocks of x [2P, S, S]: two [P, S, S] tensors."""
    y = tl.reshape(x, (x.shape[0] // 2, 2, x.shape[1], x.shape[2]))
    return tl.split(tl.permute(y, (0, 2, 3, 1)))


@triton.jit
def _cat_cols(a, b):
    """[a | b] along the last axis: two [P, S, S] → [P, S, 2S]."""
    ab = tl.permute(tl.join(a, b), (0, 1, 3, 2))
    return tl.reshape(ab, (a.shape[0], a.shape[1], 2 * a.shape[2]))


@triton.jit
def _merge_level(X, A):
    """One level of the blocked recursion: merge consecutive diagonal blocks of (I + A)⁻¹.

    X [2P, S, S] holds the inverses of the S×S diagonal blocks of I + A (A [C, C] strictly lower,
    C = 2P·S); returns those of the 2S×2S ones, [P, 2S, 2S], by
    ``[[I + A00, 0], [A10, I + A11]]⁻¹ = [[X0, 0], [−X1 A10 X0, X1]]`` (two fp32 products)."""
    P: tl.constexpr = X.shape[0] // 2
    S: tl.constexpr = X.shape[1]
    bi = tl.arange(0, A.shape[0])[:, None] // S
    bj = tl.arange(0, A.shape[0])[None, :] // S
    # A10 of pair p is block (2p + 1, 2p): odd block rows, the block left of the diagonal
    A10 = _block_rows(A, (bi % 2 == 1) & (bj == bi - 1), S)  # even block rows are 0
    A10 = tl.sum(tl.reshape(A10, (P, 2, S, S)), axis=1)
    X0, X1 = _halves(X)
    X10 = -tl.dot(X1, tl.dot(A10, X0, input_precision=IEEE), input_precision=IEEE)
    rows = tl.join(_cat_cols(X0, tl.zeros_like(X0)), _cat_cols(X10, X1))  # [P, S, 2S, 2]
    return tl.reshape(tl.permute(rows, (0, 3, 1, 2)), (P, 2 * S, 2 * S))


@triton.jit
def _unit_lower_inverse(A, SUB: tl.constexpr):
    """(I + A)⁻¹ [C, C] fp32 for A [C, C] fp32 strictly lower triangular, C in {16, 32, 64}.

    Blocked recursion (design card, inversion algorithms): the SUB×SUB diagonal blocks by
    forward substitution side by side, then log2(C/SUB) merge levels whose coupling blocks are
    fp32 products; no pivoting (unit triangular)."""
    C: tl.constexpr = A.shape[0]
    NB: tl.constexpr = C // SUB
    tl.static_assert(NB == 1 or NB == 2 or NB == 4, "chunk must be 16, 32 or 64 rows")
    bi = tl.arange(0, C)[:, None] // SUB
    bj = tl.arange(0, C)[None, :] // SUB
    tl.static_assert(SUB == 16, "kkt_solve's diagonal-block substitution is 16×16")
    X = invert_diagonal_blocks(_block_rows(A, bi == bj, SUB), NB)
    if NB >= 2:
        X = _merge_level(X, A)
    if NB >= 4:
        X = _merge_level(X, A)
    return tl.reshape(X, (C, C))


@triton.jit
def _chunk_gate_inverse(k, g, beta, n_valid, SUB: tl.constexpr):
    """Cumulative gate and UT-transform inverse of one chunk.

    k [C, K] in the input dtype, g, beta [C] fp32, all zero past the sequence end (row n_valid
    on). Returns G [C] fp64 (cumulative log-decay) and T = (I + A)⁻¹ [C, C] fp32,
    A = strictLower(D_beta (Γ ⊙ K Kᵀ))."""
    C: tl.constexpr = k.shape[0]
    # G in fp64: decays are differences of G, which in fp32 lose ulp(|G|) once a very
    # negative gate has made |G| large (the materialized path does the same, chunk_gate.py)
    G = tl.cumsum(g.to(tl.float64), axis=0)
    rows = tl.arange(0, C)
    strict = (rows[:, None] > rows[None, :]) & (rows < n_valid)[:, None]
    A = beta[:, None] * gated_decay(G, G, strict) * tl.dot(k, tl.trans(k), input_precision=IEEE)
    return G, _unit_lower_inverse(A, SUB)


@triton.jit
def _chunk_gate_inverse_or_load(k, g, beta, Ai, t0, n_valid, s_at, SUB: tl.constexpr,
                                LOAD_T: tl.constexpr):
    """(G [C] fp64, T [C, C] fp32) of one chunk: both on chip (:func:`_chunk_gate_inverse`), or
    with LOAD_T T read from ``Ai`` — chunk_inverse's output, advanced to this program's batch
    row and value head, row stride ``s_at`` — and only G formed here. Reading T takes the
    inverse's 15-step substitution off the chunk loop's dependency chain, where it serialises
    every chunk; the inverse then runs chunk-parallel in its own launch."""
    C: tl.constexpr = k.shape[0]
    if LOAD_T:
        rows = tl.arange(0, C)
        # kkt_solve writes rows past the sequence end not at all and zeros above the diagonal
        keep = (rows < n_valid)[:, None] & (rows[:, None] >= rows[None, :])
        T_inv = tl.load(Ai + (t0 + rows)[:, None] * s_at + rows[None, :], mask=keep, other=0.0)
        return tl.cumsum(g.to(tl.float64), axis=0), T_inv.to(tl.float32)
    return _chunk_gate_inverse(k, g, beta, n_valid, SUB)


@triton.jit
def _delta_values(T, k, v, G, beta, S, STATE_PRECISION: tl.constexpr):
    """V' = U − W S = T D_beta (V − D_exp(G) K S) [C, BV] fp32.

    Factoring T D_beta out of W = T D_beta D_exp(G) K and U = T D_beta V saves the C×C×K
    product that forms W and its C×K tile; it is the same algebra. T [C, C] fp32, k [C, K] in
    the input dtype, v [C, BV] (zero past the end), G, beta [C] fp32, S [K, BV] fp32.
    K S takes S rounded to the input dtype; T·(…) stays on fp32 operands at STATE_PRECISION
    (its rounding feeds the state directly: docs/fused_design.md, precision)."""
    ks = tl.dot(k, S.to(k.dtype), input_precision=IEEE)
    r = beta[:, None] * (v.to(tl.float32) - tl.exp(G.to(tl.float32))[:, None] * ks)
    return tl.dot(T, r, input_precision=STATE_PRECISION)


@triton.jit
def _state_step(S, k, G, v_new, STATE_PRECISION: tl.constexpr):
    """S ← exp(G_C) S + Kᵀ (D_exp(G_C − G) V') for one chunk: S [K, BV] fp32, k [C, K],
    G [C] fp64 (G_C its last entry: padded rows have g = 0), v_new [C, BV] fp32.

    The decay is applied to V' rather than to K, so K enters unscaled (exactly, widened to
    fp32) and no scaled copy of it stays live; the product runs on fp32 operands at
    STATE_PRECISION because its rounding accumulates in the state."""
    C: tl.constexpr = k.shape[0]
    G_C = tl.sum(tl.where(tl.arange(0, C) == C - 1, G, 0.0), axis=0)
    v_decayed = v_new * tl.exp((G_C - G).to(tl.float32))[:, None]
    kv = tl.dot(tl.trans(k.to(tl.float32)), v_decayed, input_precision=STATE_PRECISION)
    return S * tl.exp(G_C.to(tl.float32)) + kv


@triton.jit
def _program_coords(NB: tl.constexpr, HV: tl.constexpr, H: tl.constexpr):
    """(column block, sequence, value head, q/k head) of this program: axis 0 of the grid
    enumerates sequence-major, then value head, then the NB column blocks, so programs reading
    the same keys run side by side."""
    pid = tl.program_id(0)
    i_hv = (pid // NB) % HV
    return pid % NB, pid // (NB * HV), i_hv, i_hv // (HV // H)  # GVA: head j reads j // (HV/H)


@triton.jit
def _seq_bounds(cu_seqlens, i_n, T, VARLEN: tl.constexpr):
    """Batch row and [bos, eos) token range of sequence i_n (int64): row i_n and [0, T), or
    row 0 and [cu_seqlens[i_n], cu_seqlens[i_n + 1]) for packed input (read on the device)."""
    if VARLEN:
        i_b = tl.zeros([], dtype=tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        i_b = i_n.to(tl.int64)
        bos = tl.zeros([], dtype=tl.int64)
        eos = bos + T
    return i_b, bos, eos


@triton.jit
def _head_pointers(k, v, g, beta, i_b, i_h, i_hv, s_kb, s_kh, s_vb, s_vh, s_gb, s_gh):
    """k, v, g, beta advanced to batch row i_b and this program's heads (k: q/k head i_h; v, g,
    beta: value head i_hv); g and beta share one layout."""
    return (k + i_b * s_kb + i_h * s_kh, v + i_b * s_vb + i_hv * s_vh,
            g + i_b * s_gb + i_hv * s_gh, beta + i_b * s_gb + i_hv * s_gh)


@triton.jit
def _segment_chunks(bos, eos, seg, C: tl.constexpr, NUM_SEG: tl.constexpr):
    """Chunk range [c_lo, c_hi) of segment ``seg`` of a sequence: ceil(chunks / NUM_SEG) each,
    so segments start on the same chunk grid as an unsplit run (empty ones are allowed)."""
    n_chunks = tl.cdiv(eos - bos, C)
    per_seg = tl.cdiv(n_chunks, NUM_SEG)
    c_lo = seg * per_seg
    return c_lo, tl.minimum(c_lo + per_seg, n_chunks)


@triton.jit
def _load_chunk_rows(k, g, beta, t0, n_valid, s_kt, s_gt, K: tl.constexpr, C: tl.constexpr):
    """Keys [C, K] (input dtype) and g, beta [C] fp32 of the chunk starting at token t0, zero
    from row n_valid on (past the sequence end). k, g, beta point at this program's batch row
    and head; s_kt, s_gt are their token strides (g and beta share a layout)."""
    rows = tl.arange(0, C)
    valid = rows < n_valid
    tok = t0 + rows
    b_k = tl.load(k + tok[:, None] * s_kt + tl.arange(0, K)[None, :], mask=valid[:, None],
                  other=0.0)
    b_g = floored(tl.load(g + tok * s_gt, mask=valid, other=0.0).to(tl.float32))
    b_beta = tl.load(beta + tok * s_gt, mask=valid, other=0.0).to(tl.float32)
    return b_k, b_g, b_beta


# ----------------------------------------------------------------------------------------------
# The forward kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fused_fwd_kernel(q, k, v, g, beta, Ai, o, h0, ht, seg_maps, cu_seqlens, scale, T, N,
                      s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_gb, s_gt, s_gh,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BV: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
                      NUM_SEG: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                      VARLEN: tl.constexpr, LOAD_T: tl.constexpr,
                      STATE_PRECISION: tl.constexpr, COMPOSE_PRECISION: tl.constexpr):
    """Grid (N·HV·V/BV, NUM_SEG): program (sequence, value head, V-block) × segment.

    q and k share the (batch, token, head) strides s_q*, v has s_v*, g and beta s_g*; the last
    dim of q, k, v is contiguous; o [B, T, HV, V] is contiguous. With LOAD_T, Ai [B, T, HV, C]
    (contiguous) holds each chunk's inverse T in the rows of its tokens."""
    i_v, i_n, i_hv, i_h = _program_coords(V // BV, HV, H)
    seg = tl.program_id(1)
    i_b, bos, eos = _seq_bounds(cu_seqlens, i_n, T, VARLEN)
    c_lo, c_hi = _segment_chunks(bos, eos, seg, C, NUM_SEG)
    q += i_b * s_qb + i_h * s_qh
    k, v, g, beta = _head_pointers(k, v, g, beta, i_b, i_h, i_hv, s_qb, s_qh, s_vb, s_vh, s_gb,
                                   s_gh)
    o += (i_b * T * HV + i_hv) * V
    if LOAD_T:
        Ai += (i_b * T * HV + i_hv) * C

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, C)
    head = (i_n * HV + i_hv).to(tl.int64)
    if USE_H0:
        S = tl.load(h0 + head * K * V + o_k[:, None] * V + o_v[None, :]).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if NUM_SEG > 1:
        # exact entering state: S ← M_j S + b_j through the earlier segments' affine maps,
        # stored as [M | b] rows of width K + V by fused_split's map kernel
        maps = seg_maps + head * (NUM_SEG - 1) * K * (K + V) + o_k[:, None] * (K + V)
        for j in range(0, seg):
            M = tl.load(maps + j * K * (K + V) + o_k[None, :])
            b = tl.load(maps + j * K * (K + V) + K + o_v[None, :])
            S = tl.dot(M, S, input_precision=COMPOSE_PRECISION) + b

    for c in range(c_lo, c_hi):
        t0 = bos + c * C
        n_valid = eos - t0
        valid = rows < n_valid
        tok = t0 + rows
        b_k, b_g, b_beta = _load_chunk_rows(k, g, beta, t0, n_valid, s_qt, s_gt, K, C)
        b_q = tl.load(q + tok[:, None] * s_qt + o_k[None, :], mask=valid[:, None], other=0.0)
        b_v = tl.load(v + tok[:, None] * s_vt + o_v[None, :], mask=valid[:, None], other=0.0)

        G, T_inv = _chunk_gate_inverse_or_load(b_k, b_g, b_beta, Ai, t0, n_valid, HV * C, SUB,
                                               LOAD_T)
        v_new = _delta_values(T_inv, b_k, b_v, G, b_beta, S, STATE_PRECISION)

        qk = tl.dot(b_q, tl.trans(b_k), input_precision=IEEE)
        causal = (rows[:, None] >= rows[None, :]) & valid[:, None]
        attn = gated_decay(G, G, causal) * qk * scale
        # gate rows after the product: q stays the loaded tile (no scaled copy in registers)
        b_o = (scale * tl.exp(G.to(tl.float32)))[:, None] * \
            tl.dot(b_q, S.to(b_k.dtype), input_precision=IEEE)
        b_o += tl.dot(attn.to(b_k.dtype), v_new.to(b_k.dtype), input_precision=IEEE)
        tl.store(o + tok[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=valid[:, None])

        S = _state_step(S, b_k, G, v_new, STATE_PRECISION)

    if seg == NUM_SEG - 1:
        if STORE_HT:
            tl.store(ht + head * K * V + o_k[:, None] * V + o_v[None, :], S)
        if VARLEN:
            if i_n == N - 1:
                # a packed buffer longer than cu_seqlens[-1]: its tail gets o = 0
                for t in range(eos, T, C):
                    tail = t + rows
                    tl.store(o + tail[:, None] * (HV * V) + o_v[None, :],
                             tl.zeros([C, BV], dtype=o.dtype.element_ty),
                             mask=(tail < T)[:, None])


# ----------------------------------------------------------------------------------------------
# Host side: support check, launch configuration, custom op
# ----------------------------------------------------------------------------------------------

def unsupported_reason(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> Optional[str]:
    """Why the fused kernel cannot run these inputs, or None when it can (no device sync).

    q [B, T, H, K], v [B, T, HV, V]: K and V must be 64 or 128, the dtype fp16/bf16/fp32, the
    chunk 16/32/64, and a CUDA device of compute capability ≥ 8.0 (16-bit tensor-core dots)
    or CPU under TRITON_INTERPRET=1."""
    K, V = q.shape[-1], v.shape[-1]
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        return f"head dims K={K}, V={V} not in {HEAD_DIMS}"
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} not supported (fp16, bf16, fp32)"
    if chunk_size not in CHUNK_SIZES:
        return f"chunk_size {chunk_size} not in {CHUNK_SIZES}"
    if q.device.type == "cuda":
        if chunk_index.capability(q.device) < (8, 0):
            return "needs compute capability >= 8.0"
    elif not triton_interpreted():
        return f"tensors on {q.device.type} need TRITON_INTERPRET=1"
    return None


def dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """input_precision of the products on fp32 operands: (state path T·R and Kᵀ·V', segment
    composition M·S). Exact fp32 ("ieee") for fp32 inputs. For 16-bit inputs the state path
    uses tf32 (10-bit mantissa, tensor cores) — bf16 operands there cost the final state ~8×
    more error (docs/fused_design.md) — and the composition tf32x3 (≈ fp32 accuracy on tensor
    cores; a 128×128 fp32 FMA product spills ~7 KB per thread on sm_90)."""
    if dtype == torch.float32:
        return "ieee", "ieee"
    return "tf32", "tf32x3"


def launch_config(V: int, block_v: int = 0, num_warps: int = 0,
                  num_stages: int = 0) -> tuple[int, dict]:
    """(BV, launch options) of both fused launches, fixed by the shape (no autotuning, so CUDA
    graph capture sees one plan): BLOCK_V value columns per program and NUM_WARPS warps, the
    one launch verified on the H200 (see BLOCK_V for the miscompiled alternative); one stage, because the chunk loop's loads feed register math before any product and a
    deeper software pipeline prefetches nothing (same shared memory at 2 stages on sm_90).
    block_v, num_warps, num_stages: nonzero values override the defaults (launch sweeps,
    eval.bench; with T read from HBM, 2 stages let Triton prefetch the next chunk's tiles)."""
    return min(block_v or BLOCK_V, V), dict(num_warps=num_warps or NUM_WARPS,
                                            num_stages=num_stages or 1)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) strides of a [B, T, heads, …] tensor, in elements."""
    return x.stride(0), x.stride(1), x.stride(2)


def _kernel_layout(q, k, v, g, beta):
    """Views the kernel reads in place: the last dim of q, k, v contiguous, q and k with one
    layout, g and beta with one layout (Hugging Face passes slices of fused projections);
    anything else is copied to a contiguous tensor."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if g.stride() != beta.stride():
        g, beta = g.contiguous(), beta.contiguous()
    return q, k, v, g, beta


def _fused_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
                    output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                    chunk_size: int, num_segments: int, precompute_inverse: bool,
                    block_v: int, num_warps: int, num_stages: int,
                    cu_seqlens_cpu: Optional[torch.Tensor] = None, allow_route: bool = False,
                    for_backward: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if _takes_route(q, v, chunk_size, cu_seqlens, allow_route, num_segments, block_v,
                    num_warps, num_stages):
        return _warp_specialized_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                     chunk_size, for_backward)
    from gdn_fused.kernels import fused_split  # builds on this module's chunk helpers
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    q, k, v, g, beta = _kernel_layout(q, k, v, g, beta)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        # the kernels read offset i at cu_seqlens + i: a strided view (cu[::2]) read its
        # other entries, silently (found by a new-user trial, session 23)
        cu_seqlens = cu_seqlens.contiguous()
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    ht = torch.empty((N, HV, K, V) if output_final_state else (0,), dtype=torch.float32,
                     device=q.device)
    BV, options = launch_config(V, block_v, num_warps, num_stages)
    precision, compose_precision = dot_precisions(q.dtype)
    if num_segments <= 0:
        num_segments = fused_split.choose_num_segments(N, HV, K, V, BV, B * T / max(N, 1),
                                                       chunk_size, sm_count(q.device))
    # packed input needs chunk indices built from cu_seqlens on the host, which a CUDA-graph
    # capture forbids: captured packed calls invert on chip (slower, still exact)
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    Ai = precomputed_inverse(k, g, beta, HV, chunk_size, cu_seqlens, cu_seqlens_cpu) \
        if precompute_inverse and (cu_seqlens is None or not capturing) else None
    seg_maps = None
    if num_segments > 1:
        seg_maps = fused_split.segment_maps(k, v, g, beta, Ai, cu_seqlens, N, num_segments,
                                            chunk_size, BV, precision, options)
    grid = (N * HV * (V // BV), num_segments)
    direct.launch(
        _fused_fwd_kernel, grid,
        q, k, v, g, beta, Ai, o, initial_state, ht, seg_maps, cu_seqlens, scale, T, N,
        *_strides(q), *_strides(v), *_strides(g),
        H=H, HV=HV, K=K, V=V, BV=BV, C=chunk_size, SUB=SUB, NUM_SEG=num_segments,
        USE_H0=initial_state is not None, STORE_HT=output_final_state,
        VARLEN=cu_seqlens is not None, LOAD_T=Ai is not None, STATE_PRECISION=precision,
        COMPOSE_PRECISION=compose_precision, **options)
    return o, ht, o.new_empty(0), o.new_empty(0, dtype=torch.float32)


def _takes_route(q, v, chunk_size, cu_seqlens, allow_route, num_segments, block_v, num_warps,
                 num_stages) -> bool:
    """The op's route decision, made inside the op (its real and its fake implementation
    alike) so that torch.compile sees one opaque op and guards on the shapes the decision
    reads: the Hopper route unless the caller forbids it or names a launch override."""
    return (allow_route and not (num_segments or block_v or num_warps or num_stages)
            and uses_warp_specialized(q, v, chunk_size, cu_seqlens))


def uses_warp_specialized(q, v, chunk_size, cu_seqlens) -> bool:
    """Whether the fused forward runs :func:`_warp_specialized_fwd` for these inputs
    (WARP_SPECIALIZED and the Gluon kernel's conditions, materialized.uses_state_output_kernel;
    no device sync)."""
    from gdn_fused.kernels.materialized import uses_state_output_kernel
    return WARP_SPECIALIZED and uses_state_output_kernel(q, v, chunk_size, cu_seqlens)


# segment 1's inverse, beside segment 0's state pass, launched with programmatic dependent launch
# (kernels/pdl.py) after segment 0's. Session 27 suspected its early start for an eager outlier
# at (1, 32768); session 28's A/B (scripts/ab_flag.py, docs/fused_design.md) refuted it: plain
# launches were slower as a graph (758 → 771 µs; 203 → 226 at (1, 8192)) and the outlier came
# and went with the process. False launches it plainly (A/B)
SEGMENT1_INVERSE_PDL = True


def inverse_cut(B: int, T: int, HV: int, device: torch.device, chunk_size: int = 64) -> int:
    """Tokens of segment 0 whose T the Hopper route solves before segment 0's state pass alone,
    the rest of T being solved beside that pass (:data:`SPLIT_INVERSE`, B = 1, where forward_t
    runs two segments: gluon_transposed.segment0_chunks), else 0 (the whole inverse first)."""
    if not SPLIT_INVERSE or B != 1:
        return 0
    from gdn_fused.kernels.gluon_transposed import segment0_chunks
    return segment0_chunks(B, T, HV, device) * chunk_size


def _warp_specialized_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                          chunk_size, for_backward=False):
    """The fused forward on Hopper (WARP_SPECIALIZED): G, then T (bf16, the Gluon
    kkt_solve_from_k, the bits the backward would recompute), then forward_t. Returns
    (o, final state or an empty tensor, T, checkpoints or an empty tensor): with
    ``for_backward``, the states the backward's recompute starts its segments from
    (chunk_state.new_checkpoints; none where B·HV fills the GPU). Inference calls replay
    the launches recorded at their signature's first call (kernels/replay.py: ~0.3 ms of
    host time a call, three launches' worth of Python, where the kernels take 0.08 ms at
    (1, 2048))."""
    if for_backward:
        return _route(q, k, v, g, beta, initial_state, scale, output_final_state, chunk_size,
                      True)
    return replay.run(_route, (q, k, v, g, beta, initial_state),
                      (scale, output_final_state, chunk_size, False), _route_modules())


@functools.cache
def _route_modules():
    """The modules whose flags (upper-case globals) the route's launches are decided from."""
    from gdn_fused.kernels import (chunk_gate, chunk_state, gluon_kkt_roles, gluon_kkt_solve,
                                   gluon_ring, gluon_transposed, kkt_solve, materialized, pdl,
                                   streams)
    return (sys.modules[__name__], materialized, chunk_gate, kkt_solve, gluon_kkt_solve,
            gluon_kkt_roles, gluon_transposed, gluon_ring, chunk_state, chunk_index, pdl,
            direct, streams)


def _route(q, k, v, g, beta, initial_state, scale, output_final_state, chunk_size,
           for_backward):
    """:func:`_warp_specialized_fwd`'s launches (inputs first, for kernels/replay.py)."""
    from gdn_fused.kernels.gluon_transposed import T_ON_CHAIN, forward_t
    from gdn_fused.kernels.kkt_solve import default_inverse_dtype
    from gdn_fused.kernels.materialized import gates_and_inverse
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, HV, V = v.shape
    rest = None
    cut = inverse_cut(B, T, HV, q.device, chunk_size)
    if cut:
        # segment 0's T first; segment 1's beside segment 0's state pass alone (forward_t),
        # on the SMs its programs leave idle. B = 1: a segment's rows are a contiguous slice
        from gdn_fused.kernels.chunk_gate import chunk_cumsum
        from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_from_k_gluon
        G, rows = chunk_cumsum(g, chunk_size, gate_rows=[beta], chain_rows=T_ON_CHAIN)
        Ai = torch.empty(B, T, HV, chunk_size, dtype=default_inverse_dtype(q.dtype),
                         device=q.device)

        def inverse(a, b, pdl=True):
            # the one-warp kernel: the four-role one (gluon_kkt_solve.ROLES) measured slower
            # beside the state pass, (1, 32768) 764 → 823 µs
            kkt_solve_from_k_gluon(k[:, a:b], G[:, a:b], beta[:, a:b], HV, Ai.dtype,
                                   out=Ai[:, a:b], roles=False, pdl=pdl)
        inverse(0, cut)

        def rest():
            inverse(cut, T, SEGMENT1_INVERSE_PDL)
    else:
        G, Ai, rows = gates_and_inverse(k, g, beta, HV, chunk_size,
                                        default_inverse_dtype(q.dtype), {},
                                        gate_rows=[beta], chain_rows=T_ON_CHAIN)  # dense
    checkpoints = new_checkpoints(B, T, HV, q.shape[3], V, chunk_size, q.device) \
        if for_backward else None
    o, ht = forward_t(q, k, v, G, beta, Ai, scale, initial_state, output_final_state,
                      gate_rows=rows, checkpoints=checkpoints, beside_seg0_end=rest)
    empty = o.new_empty(0, dtype=torch.float32)
    return (o, ht if ht is not None else empty, Ai,
            checkpoints if checkpoints is not None else empty)


def precomputed_inverse(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, HV: int,
                        chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None,
                        cu_seqlens_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each chunk's T = (I + A)⁻¹ [B, T, HV, C] fp32 by the materialized path's chunk-parallel
    chunk_inverse (blocked method, same result as the on-chip inverse to ~2e-8), for the
    fused kernel to read instead of recomputing it on its sequential chunk loop. With
    cu_seqlens (packed, B = 1) the chunks start at each sequence's first token, as the fused
    kernel's do, and the chunk indices are built on the host (from cu_seqlens_cpu if given,
    else read from cu_seqlens)."""
    from gdn_fused.kernels.chunk_index import chunk_layout
    from gdn_fused.kernels.materialized import gates_and_inverse
    _, _, idx = chunk_layout(cu_seqlens, k.shape[0], chunk_size, cu_seqlens_cpu)
    return gates_and_inverse(k.contiguous(), g.contiguous(), beta.contiguous(), HV, chunk_size,
                             torch.float32, idx)[1]


# registered as a custom op for torch.compile and other tracers; fused_fwd calls the plain
# function in eager mode (see _eager)
_fused_fwd_op = torch.library.custom_op("gdn_fused::fused_fwd", _fused_fwd_impl,
                                        mutates_args=())


def _eager(q: torch.Tensor) -> bool:
    """Whether fused_fwd may call the op's implementation directly: plain eager execution of a
    plain tensor on a real device that needs no gradient. The custom op's own dispatch (boxing
    its 18 arguments, the autograd and aliasing wrappers) cost 0.025–0.045 ms of host time a
    call on the H200's host (eval.host_time --breakdown at (1, 2048), session 11: 0.283
    against 0.238 ms, 0.316 against 0.286; with these checks 0.262 against 0.288), a tenth of
    a short prompt's call. Everything else meets the registered op and its fake
    implementation, as before: torch.compile and export, make_fx and torch.jit.trace (a
    dispatch mode or the tracer state is active), torch.func's wrapped tensors (vmap, grad)
    and functional tensors, whose ``type`` is torch.Tensor too, and inputs requiring grad (a
    backward through the op's output then raises that it has no autograd formula, where the
    implementation's output would be silently detached; the public API differentiates
    through its own autograd.Function)."""
    return (type(q) is torch.Tensor and q.device.type != "meta"
            and not (q.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch._C._functorch.is_functorch_wrapped_tensor(q)
            and not torch._is_functional_tensor(q)
            and not is_in_torch_dispatch_mode())


@_fused_fwd_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size,
      num_segments, precompute_inverse, block_v, num_warps, num_stages, cu_seqlens_cpu=None,
      allow_route=False, for_backward=False):
    route = _takes_route(q, v, chunk_size, cu_seqlens, allow_route, num_segments, block_v,
                         num_warps, num_stages)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty((N, HV, K, V) if output_final_state else (0,), dtype=torch.float32)
    Ai = q.new_empty((B, T, HV, chunk_size) if route else (0,))
    n = checkpoint_count(B * HV, triton.cdiv(T, chunk_size), K, V, q.device) \
        if route and for_backward else 0
    return o, ht, Ai, q.new_empty((n, B, HV, K, V) if n else (0,), dtype=torch.float32)


def fused_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float, initial_state: Optional[torch.Tensor],
              output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
              chunk_size: int = 64, num_segments: Optional[int] = None,
              precompute_inverse: Optional[bool] = None, block_v: Optional[int] = None,
              num_warps: Optional[int] = None, num_stages: Optional[int] = None,
              cu_seqlens_cpu: Optional[torch.Tensor] = None, for_backward: bool = False):
    """Chunkwise Gated DeltaNet forward, the whole chunk recurrence in one fused launch
    (design card §Chunkwise form), after the chunk-parallel inverse (``precompute_inverse``):
    on Hopper for the inputs :func:`uses_warp_specialized` accepts, the warp-specialized
    Gluon kernel (V' formed on the state chain from T; see WARP_SPECIALIZED), else this
    module's plain-Triton kernel.

    Inputs are taken as validated by :func:`gdn_fused.validation.check_inputs` (q and k already
    L2-normalised if that was asked for) and supported by :func:`unsupported_reason`.

    Args:
        q, k: ``[B, T, H, K]`` fp16/bf16/fp32, K in {64, 128}.
        v: ``[B, T, HV, V]`` same dtype, V in {64, 128}; value head j reads q/k head
            ``j // (HV // H)``.
        g: ``[B, T, HV]`` per-token log-decay (natural log, ≤ 0), any float dtype, used in fp32.
        beta: ``[B, T, HV]`` write strength, any float dtype, used in fp32.
        scale: output scale (a Python float).
        initial_state: ``[N, HV, K, V]`` any float dtype (used in fp32), or None for zeros.
        output_final_state: return the final state.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (B == 1), read by the
            kernels on the device (and on the host for the precomputed inverse, see below);
            empty sequences pass their state through; o past ``cu_seqlens[-1]`` is 0.
        chunk_size: 16, 32 or 64.
        num_segments: segments per sequence run side by side (exact state composition,
            :mod:`gdn_fused.kernels.fused_split`); None or 0 picks it from the shape.
        precompute_inverse: compute every chunk's inverse T first, chunk-parallel, in a second
            launch (:func:`precomputed_inverse`, B·T·HV·C fp32 of scratch) and read it in the
            chunk loop, instead of inverting on the loop; None: :data:`PRECOMPUTE_INVERSE`.
            Packed input (cu_seqlens) then reads cu_seqlens on the host, except while a CUDA
            graph is being captured, when it inverts on chip.
        block_v, num_warps, num_stages: value columns per program (≤ V, a power of two ≥ 16),
            warps and software-pipeline stages, overriding :func:`launch_config` — launch
            sweeps only: (32, 4) miscompiles on sm_90 with Triton 3.6 (see BLOCK_V); None
            keeps the default. A block_v that is not a power of two in
            [16, V] raises ValueError.
        cu_seqlens_cpu: cu_seqlens on the host if the caller has it (validation's copy), so
            the precomputed inverse's chunk indices need no device read.
        for_backward: also return what the backward reads instead of recomputing: the
            warp-specialized route's T ([B, T, HV, 64] bf16, the blocked inverse the backward
            would recompute) and its state checkpoints ([n, B, HV, K, V] fp32, the states
            entering every chunk_state.SEGMENT_CHUNKS-th chunk where B·HV leaves SMs idle;
            chunk_state.checkpoint_count), each None where not made (the plain kernel ran).

    Returns:
        ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None)``, and T
        and the checkpoints with ``for_backward``.

    Registered as the custom op ``torch.ops.gdn_fused.fused_fwd`` (with a fake implementation)
    so torch.compile sees one opaque op; no autotuning, and no host synchronisation except
    the packed inverse's read of cu_seqlens outside a capture, so it can be captured in a CUDA
    graph for fixed shapes.
    """
    V = v.shape[-1]
    if block_v is not None and (not isinstance(block_v, int) or block_v < 16 or block_v > V
                                or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two in [16, V={V}], got {block_v!r}")
    # any launch override (precompute_inverse too: the op sees it resolved) asks for this
    # module's kernel
    overrides = (num_segments, precompute_inverse, block_v, num_warps, num_stages)
    allow_route = all(x is None for x in overrides)
    op = _fused_fwd_impl if _eager(q) else _fused_fwd_op
    o, ht, Ai, checkpoints = op(
        q, k, v, g, beta, float(scale), initial_state, bool(output_final_state), cu_seqlens,
        int(chunk_size), int(num_segments or 0),
        PRECOMPUTE_INVERSE if precompute_inverse is None else bool(precompute_inverse),
        int(block_v or 0), int(num_warps or 0), int(num_stages or 0), cu_seqlens_cpu,
        allow_route, bool(for_backward))
    ht = ht if output_final_state else None
    if not for_backward:
        return o, ht
    return (o, ht, Ai if Ai.numel() else None, checkpoints if checkpoints.numel() else None)
