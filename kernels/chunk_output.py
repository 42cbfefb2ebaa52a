"""The output of a chunk: O = scale (diag(e^G) Q h + lowerIncl(Γ ⊙ Q Kᵀ) V')."""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import (chunk_head_grid, chunk_program, first_chunk,
                                           grid_position)
from gdn_fused.kernels.chunk_gate import gated_decay


@triton.jit
def chunk_output_kernel(q, k, v_new, h, G, o, cu_seqlens, chunk_indices, chunk_offsets, scale, T,
                        H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    i_v, i_bh, i_tg = grid_position(T, HV, BT, IS_VARLEN, (V + BV - 1) // BV)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    i_n, i_t, bos, seqlen = chunk_program(i_tg, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_c = first_chunk(i_n, T, chunk_offsets, BT, IS_VARLEN) + i_t
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, seqlen), (1, H * K), (0, i_t * BT),
                            (BK, BT), (0, 1))
    p_h = tl.make_block_ptr(h + (i_c.to(tl.int64) * HV + i_hv) * K * V, (K, V), (V, 1), (0, i_v * BV),
                            (BK, BV), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_h = tl.load(p_h, boundary_check=(0, 1))
    b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PREC)
    b_A = tl.dot(b_q, b_k, input_precision=DOT_PREC)
    p_G = tl.make_block_ptr(G + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    b_G = tl.load(p_G, boundary_check=(0,))
    o_i = tl.arange(0, BT)
    # rows past the sequence end are selected away too: their G reads 0, so G_i − G_j > 0
    incl = (o_i[:, None] >= o_i[None, :]) & ((i_t * BT + o_i) < seqlen)[:, None]
    b_A = b_A * gated_decay(b_G, b_G, incl)
    p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                             (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    b_vn = tl.load(p_vn, boundary_check=(0, 1))
    b_o = b_o * tl.exp(b_G.to(tl.float32))[:, None] + \
        tl.dot(b_A.to(b_vn.dtype), b_vn, input_precision=DOT_PREC)
    p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                            (i_t * BT, i_v * BV), (BT, BV), (1, 0))
    tl.store(p_o, (b_o * scale).to(p_o.dtype.element_ty), boundary_check=(0, 1))


def chunk_output(q, k, v_new, h, G, scale, chunk_size, cu_seqlens=None, chunk_indices=None,
                 chunk_offsets=None, num_chunks=None, dot_precision="ieee", **launch):
    """o [B,T,HV,V] in q's dtype; a packed buffer's tail past cu_seqlens[-1] stays 0.
    launch: num_warps, num_stages (launch sweeps)."""
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.zeros_like(v_new) if cu_seqlens is not None else torch.empty_like(v_new)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64 if BK <= 128 else 32, max(16, triton.next_power_of_2(V)))
    direct.launch(
        chunk_output_kernel, chunk_head_grid(NT, B, HV, triton.cdiv(V, BV)),
        q, k, v_new, h, G, o, cu_seqlens, chunk_indices, chunk_offsets, scale, T, H=H, HV=HV,
        K=K, V=V, BT=chunk_size, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision, **launch)
    return o
