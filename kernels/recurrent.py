"""Decode: the token-by-token recurrence in one launch, state in fp32 registers.

    S ← e^{g_t} S;  S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;  o_t = scale · Sᵀ q_t
(Yang, Kautz & Hatamizadeh, arXiv:2412.06464, eq. 10). One program per (sequence, value head,
V-block): the K×BV slice of the state never leaves registers between tokens.
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import sequence_program
from gdn_fused.kernels.materialized import contiguous


@triton.jit
def recurrent_kernel(q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_INITIAL_STATE: tl.constexpr,
                     STORE_FINAL_STATE: tl.constexpr, IS_VARLEN: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos, seqlen = sequence_program(i_n, T, cu_seqlens, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    p_state = (i_n * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h = tl.load(h0 + p_state, mask=m_h, other=0.).to(tl.float32)
    for t in range(seqlen):
        row = bos + t
        b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (row * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (row * HV + i_hv) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_g = tl.load(g + row * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + row * HV + i_hv).to(tl.float32)
        b_h = b_h * tl.exp(b_g)
        b_err = b_v - tl.sum(b_h * b_k[:, None], 0)
        b_h = b_h + b_k[:, None] * (b_beta * b_err)[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale
        tl.store(o + (row * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_FINAL_STATE:
        tl.store(ht + p_state, b_h, mask=m_h)


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Validated inputs (gdn_fused.ops conventions) -> (o in q's dtype, final_state fp32|None)."""
    q, k, v, g, beta, initial_state, cu_seqlens = contiguous(q, k, v, g, beta, initial_state,
                                                             cu_seqlens)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    o = torch.zeros_like(v) if cu_seqlens is not None else torch.empty_like(v)
    ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if output_final_state else None
    BK = triton.next_power_of_2(K)
    BV = min(32, triton.next_power_of_2(V))  # small V-blocks: more programs for tiny batches
    direct.launch(
        recurrent_kernel, (triton.cdiv(V, BV), N * HV),
        q, k, v, g, beta, o, initial_state, ht, cu_seqlens, scale, T, H=H, HV=HV, K=K, V=V,
        BK=BK, BV=BV, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, IS_VARLEN=cu_seqlens is not None)
    return o, ht
