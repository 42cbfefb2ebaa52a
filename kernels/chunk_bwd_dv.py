"""Intra-chunk part of the gradient w.r.t. V' (v_new): dV'_local = scale · Mᵀ dO.

The output of a chunk is O = scale (diag(e^G) Q h + M V') with M = lowerIncl(Γ ⊙ Q Kᵀ),
Γ_ij = exp(G_i − G_j). The term through M depends on nothing sequential, so it is computed for
all chunks in parallel before the reverse state recurrence adds the part that flows back through
the next chunk's state (kernels/chunk_bwd_state.py).
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_gate import chunk_log_decay, gated_decay
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program


@triton.jit
def chunk_bwd_dv_local_kernel(q, k, g, do, dv, cu_seqlens, chunk_indices, scale, T,
                              H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                              BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                              DOT_PREC: tl.constexpr):
    i_t, i_hv, i_h, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, H, HV, BT,
                                                     IS_VARLEN)
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    b_G = chunk_log_decay(g, bos, i_t, seqlen, i_hv, HV, BT)
    o_i = tl.arange(0, BT)
    incl = (o_i[:, None] >= o_i[None, :]) & ((i_t * BT + o_i) < seqlen)[:, None]
    b_M = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * gated_decay(b_G, b_G, incl)
    b_Mt = tl.trans(b_M * scale).to(do.dtype.element_ty)
    for i_v in range(tl.cdiv(V, BV)):
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero")
        tl.store(p_dv, tl.dot(b_Mt, b_do, input_precision=DOT_PREC).to(p_dv.dtype.element_ty),
                 boundary_check=(0, 1))


def chunk_bwd_dv_local(q, k, g, do, scale, chunk_size, cu_seqlens=None, chunk_indices=None,
                       num_chunks=None, dot_precision="ieee"):
    """q, k [B,T,H,K]; g [B,T,HV] per-token log-decay; do [B,T,HV,V]
    -> dV'_local [B,T,HV,V] in do's dtype (a packed buffer's tail past cu_seqlens[-1] is 0).
    Stored as fla stores it (fla/ops/common/chunk_o.py, chunk_bwd_dv_local): the kernel moved
    4 bytes per token, value head and value column in fp32 of its 6 (q, k and dO read once);
    chunk_bwd_state adds its state term in fp32 to the rounded value."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    alloc = torch.zeros if cu_seqlens is not None else torch.empty
    dv = alloc(B, T, HV, V, dtype=do.dtype, device=q.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    direct.launch(
        chunk_bwd_dv_local_kernel, chunk_head_grid(NT, B, HV),
        q, k, g, do, dv, cu_seqlens, chunk_indices, scale, T, H=H, HV=HV, K=K, V=V,
        BT=chunk_size, BK=max(16, triton.next_power_of_2(K)),
        BV=min(64, max(16, triton.next_power_of_2(V))), IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision)
    return dv
