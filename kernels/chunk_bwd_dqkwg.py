"""Chunk-parallel gradients through the output and the state update: dQ, dK (partial), dW, dg
(partial), given the forward states h, v_new and the state gradients dh, dv2.

Per chunk, with h = state entering, dh = ∂L/∂(state leaving), dV' = dv2 (kernels/
chunk_bwd_state.py), M = lowerIncl(Γ ⊙ Q Kᵀ), P = lowerIncl(Γ ⊙ scale dO V'ᵀ):

    dQ = scale diag(e^G) dO hᵀ + P K
    dK = diag(e^{G_C − G}) V' dhᵀ + Pᵀ Q           (the W/U part is added in kernels/wu_bwd.py)
    dW = −dV' hᵀ

and the per-token gate gradient of these terms (kernels/chunk_gate_bwd.py): row terms
q_i · (scale e^{G_i} dO_i hᵀ) and e^{G_C} ⟨h, dh⟩ at the last row; pair terms P_ij q_i·k_j
(i > j) and k_j · (e^{G_C − G_j} dh v'_j) for the pair (C, j). Every exponential is of a masked
difference G_i − G_j ≤ 0 or of G ≤ 0 itself: no overflow and no cancelling pairs, whatever the
decay. Same dQ/dK/dW math as flash-linear-attention's chunk_bwd_dqkwg (fla/ops/common/
chunk_o.py), which however forms dg by cancellation; the key dimension is split in blocks of
BLOCK_K, each program writing its own partial dg (all terms are linear in the key
block; summed in kernels/wu_bwd.py).
"""
import os

import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_gate import chunk_log_decay, decay, gated_decay
from gdn_fused.kernels.chunk_gate_bwd import chunk_gate_bwd
from gdn_fused.kernels.chunk_index import (chunk_head_grid, chunk_program, first_chunk,
                                           grid_position)

# The default launch at K = 128: two programs a (chunk, value head), 64 key columns each, in 4
# warps (255 registers: 2 programs an SM), all 128 value columns in one loop step. Past one
# value step, Triton 3.6's software pipelining keeps the step's wgmmas in flight while it
# prefetches into the h and dh tile slots they read (eval/wgmma_hazards.py flags it at 2 and 3
# stages), the race that made wu_bwd's dβ / dg vary (docs/backward.md, "Determinism"): such
# launches run one stage. H200, (1, 32768), dq / dk partials in bf16 (session 9): this launch
# 1,820 µs; all 128 key columns a program in 8 warps (V', dO and dV' read once, not twice:
# 3.1 GB moved instead of 3.9; 242 registers, one program an SM) with two value steps of 64
# at one stage 1,993, with one step of 128 (572 B of spills) 2,519; two value steps of 64 at
# 4 warps pipelined over 3 stages (the race) 1,642. One program an SM at one stage leaves
# every load exposed; two programs an SM hide each other's.
BLOCK_K = 64
BLOCK_V = 128
WIDE_WARPS = 8  # warps of a program past 64 key columns (launch sweeps: block_k = 128)


def key_block(K: int, block: int = None) -> int:
    """Key columns a program or loop step takes: ``block`` (default BLOCK_K, read at the call,
    the blocks of the partial dg), or all K rounded up to a power of two (at least 16) when
    fewer."""
    return min(block or BLOCK_K, max(16, triton.next_power_of_2(K)))


def default_launch(K: int, V: int, block_k: int = None, block_v: int = None) -> dict:
    """BK, BV, num_warps and (past one value step) num_stages of a launch (see BLOCK_K): up to
    BLOCK_K key columns a program, in 4 warps (WIDE_WARPS past 64 key columns); up to BLOCK_V
    value columns a step; one stage when the value loop has more than one step.
    ``block_k``, ``block_v``: other blocks (launch sweeps), the rest chosen for them."""
    BK = block_k or key_block(K)
    BV = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(V)))
    launch = dict(BK=BK, BV=BV, num_warps=WIDE_WARPS if BK > 64 else 4)
    if triton.cdiv(V, BV) > 1:
        launch["num_stages"] = 1
    return launch


# The chunk's q and k tiles are loaded before the value loop, with its loads, rather than after
# its products, where the gate terms waited on them: H200 (session 9, (1, 32768)) 1,767 µs
# against 1,851 in the same run; eval.ptxas 255 registers, 4 B of spills, 96 KB of shared
# memory instead of 80 (still 2 programs an SM); no wgmma hazard at 1 or 3 stages (eval/
# wgmma_hazards.py). GDN_DQKWG_QK_FIRST=0 restores the old order (A/B runs of the whole
# backward); the QK_FIRST launch option picks either per launch (eval.bench --sweep bwd)
QK_LOADS_FIRST = os.environ.get("GDN_DQKWG_QK_FIRST", "1") != "0"


@triton.jit
def qk_tiles(q, k, bos, i_t, i_k, i_h, seqlen, H: tl.constexpr, K: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr):
    """The chunk's [BT, BK] tiles of q and k (key block i_k, q/k head i_h), zero past seqlen."""
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                            (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                            (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    return (tl.load(p_q, boundary_check=(0, 1), padding_option="zero"),
            tl.load(p_k, boundary_check=(0, 1), padding_option="zero"))


@triton.jit
def chunk_bwd_dqkwg_kernel(q, k, v_new, h, dh, g, do, dv2, dq, dk, dw, dg, cu_seqlens,
                           chunk_indices, chunk_offsets, scale, T, s_dg, H: tl.constexpr,
                           HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                           DOT_PREC: tl.constexpr, QK_FIRST: tl.constexpr = QK_LOADS_FIRST):
    i_k, i_bh, i_tg = grid_position(T, HV, BT, IS_VARLEN, (K + BK - 1) // BK)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, seqlen = chunk_program(i_tg, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_c = first_chunk(i_n, T, chunk_offsets, BT, IS_VARLEN) + i_t
    p_state = (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dM = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([1], dtype=tl.float32)  # ⟨h, dh⟩ over this key block
    if QK_FIRST:  # issued with the value loop's loads rather than after its products
        b_q, b_k = qk_tiles(q, k, bos, i_t, i_k, i_h, seqlen, H, K, BT, BK)
    for i_v in range(tl.cdiv(V, BV)):
        p_h = tl.make_block_ptr(h + p_state, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK),
                                (0, 1))
        p_dh = tl.make_block_ptr(dh + p_state, (V, K), (1, V), (i_v * BV, i_k * BK), (BV, BK),
                                 (0, 1))
        p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv2 + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_ht = tl.load(p_h, boundary_check=(0, 1), padding_option="zero")  # hᵀ [BV, BK]
        b_dht = tl.load(p_dh, boundary_check=(0, 1), padding_option="zero")
        b_vn = tl.load(p_vn, boundary_check=(0, 1), padding_option="zero")
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero")
        b_dv = tl.load(p_dv, boundary_check=(0, 1), padding_option="zero")
        b_dq += tl.dot(b_do, b_ht.to(b_do.dtype), input_precision=DOT_PREC)
        b_dk += tl.dot(b_vn, b_dht.to(b_vn.dtype), input_precision=DOT_PREC)
        b_dw += tl.dot(b_dv, b_ht.to(b_dv.dtype), input_precision=DOT_PREC)
        b_dM += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_hdh += tl.sum(tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 1))
    if not QK_FIRST:
        b_q, b_k = qk_tiles(q, k, bos, i_t, i_k, i_h, seqlen, H, K, BT, BK)
    b_G = chunk_log_decay(g, bos, i_t, seqlen, i_hv, HV, BT)
    o_i = tl.arange(0, BT)
    valid = (i_t * BT + o_i) < seqlen
    last = tl.minimum(BT, seqlen - i_t * BT) - 1  # row of G_C inside the chunk
    b_G_last = tl.sum(tl.where(o_i == last, b_G, 0.))
    b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)
    # through the state leaving the chunk: e^{G_C} h (a row term of G_C) and the keys decayed
    # by e^{G_C − G_j} (pair terms (C, j), j < C; j = C has exponent 0 and no gate gradient)
    b_dk = b_dk * decay(b_G_last - b_G, valid)[:, None]
    b_a = tl.where(o_i == last, tl.sum(b_hdh) * tl.exp(b_G_last.to(tl.float32)), 0.)
    b_Z = tl.where((o_i[:, None] == last) & (o_i[None, :] < last),
                   tl.sum(b_dk * b_kf, 1)[None, :], 0.)
    # through the inter-chunk output term scale·e^{G_i} q_i h: row terms
    b_dq = b_dq * (scale * decay(b_G, valid))[:, None]
    b_a += tl.sum(b_dq * b_qf, 1)
    # through the intra-chunk output term M V': pair terms P_ij q_i·k_j below the diagonal
    incl = (o_i[:, None] >= o_i[None, :]) & valid[:, None]
    b_P = b_dM * scale * gated_decay(b_G, b_G, incl)
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC)
    b_Z += tl.where(o_i[:, None] > o_i[None, :], b_P * b_qk, 0.)
    b_dg = chunk_gate_bwd(b_a, b_Z, BT)
    b_P = b_P.to(b_q.dtype)
    b_dq += tl.dot(b_P, b_k, input_precision=DOT_PREC)
    b_dk += tl.dot(tl.trans(b_P), b_q, input_precision=DOT_PREC)
    p_dq = tl.make_block_ptr(dq + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                             (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_dk = tl.make_block_ptr(dk + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                             (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_dw = tl.make_block_ptr(dw + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                             (i_t * BT, i_k * BK), (BT, BK), (1, 0))
    p_dg = tl.make_block_ptr(dg + i_k * s_dg + bos * HV + i_hv,
                             (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    tl.store(p_dq, b_dq.to(p_dq.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dw, (-b_dw).to(p_dw.dtype.element_ty), boundary_check=(0, 1))
    tl.store(p_dg, b_dg, boundary_check=(0,))


def chunk_bwd_dqkwg(q, k, v_new, h, dh, g, do, dv2, scale, chunk_size, cu_seqlens=None,
                    chunk_indices=None, chunk_offsets=None, num_chunks=None,
                    dot_precision="ieee", block_v=None, block_k=None, **launch):
    """Gradients through the output and the state update, per chunk and value head.

    Args:
        q, k: ``[B, T, H, K]``; v_new, do, dv2: ``[B, T, HV, V]``; h, dh: ``[NT_total, HV, K, V]``
        (state entering / gradient of the state leaving each chunk); g: ``[B, T, HV]`` per-token
        log-decay.
    Returns:
        ``(dq [B,T,HV,K] in q's dtype, dk [B,T,HV,K] in k's dtype (partial), dw like dk,
        dg [NK, B, T, HV] fp32 — per-token, per key block, partial)``, per value head (GVA
        sums later). ``block_v`` (value columns a loop step), ``block_k`` (key columns a
        program; dg then has cdiv(K, block_k) blocks) and ``launch`` (num_warps, num_stages)
        override the defaults for launch sweeps (:func:`default_launch` fills in the rest: a
        loop of several value steps runs one stage unless ``launch`` names num_stages).
    """
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    config = {**default_launch(K, V, block_k, block_v), **launch}
    BK = config["BK"]
    NK = triton.cdiv(K, BK)
    alloc = torch.zeros if cu_seqlens is not None else torch.empty
    # per value head in the data dtype, as fla's chunk_bwd_dqkwg stores them: in fp32 they
    # moved 24 bytes per token, value head and key column through HBM (dq written here and
    # read by group_sum; dk written here, read and rewritten by wu_bwd, read by group_sum),
    # 12 in bf16, for one rounding of each partial before the fp32 GVA sum
    dq = alloc(B, T, HV, K, dtype=q.dtype, device=q.device)
    dk = alloc(B, T, HV, K, dtype=k.dtype, device=q.device)
    dw = alloc(B, T, HV, K, dtype=k.dtype, device=q.device)
    dg = alloc(NK, B, T, HV, dtype=torch.float32, device=q.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    direct.launch(
        chunk_bwd_dqkwg_kernel, chunk_head_grid(NT, B, HV, NK),
        q, k, v_new, h, dh, g, do, dv2, dq, dk, dw, dg, cu_seqlens, chunk_indices, chunk_offsets,
        scale, T, dg.stride(0), H=H, HV=HV, K=K, V=V, BT=chunk_size,
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision, **config)
    return dq, dk, dw, dg
