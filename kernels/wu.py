"""W = T diag(β e^G) K and U = T diag(β) V per chunk (design card, chunkwise form)."""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program


@triton.jit
def wu_kernel(k, v, G, beta, Ai, w, u, cu_seqlens, chunk_indices, T, H: tl.constexpr,
              HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
              DOT_PREC: tl.constexpr):
    i_t, i_hv, i_h, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, H, HV, BT,
                                                     IS_VARLEN)
    p_T = tl.make_block_ptr(Ai + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                            (i_t * BT, 0), (BT, BT), (1, 0))
    p_G = tl.make_block_ptr(G + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    p_b = tl.make_block_ptr(beta + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    # products run in the data dtype with fp32 accumulation (bf16 tensor cores for bf16 data)
    b_T = tl.load(p_T, boundary_check=(0,)).to(k.dtype.element_ty)
    b_beta = tl.load(p_b, boundary_check=(0,)).to(tl.float32)
    b_G = tl.load(p_G, boundary_check=(0,))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1)).to(tl.float32)
    b_kb = (b_k * (b_beta * tl.exp(b_G.to(tl.float32)))[:, None]).to(k.dtype.element_ty)
    tl.store(p_w, tl.dot(b_T, b_kb, input_precision=DOT_PREC).to(w.dtype.element_ty),
             boundary_check=(0, 1))
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1)).to(tl.float32)
        b_vb = (b_v * b_beta[:, None]).to(v.dtype.element_ty)
        tl.store(p_u, tl.dot(b_T, b_vb, input_precision=DOT_PREC).to(u.dtype.element_ty),
                 boundary_check=(0, 1))


# Warps by T's dtype. H200 (eval.bench --sweep launch / stages, 2026-11-30): with fp32 T (fp32
# data, or materialized_fwd's inverse_dtype; the backward's recompute until session 8) 8 warps
# take 345 / 350 µs at (1, 32768) / (8, 4096) against 424 / 426 at 4; with bf16 T (the forward
# and, since session 9, the backward's recompute) 8 warps took 323 µs at (1, 32768) against
# 298–300 at 4.
def _num_warps(Ai):
    return 8 if Ai.dtype == torch.float32 else 4


def recompute_w_u(k, v, G, beta, Ai, cu_seqlens=None, chunk_indices=None, num_chunks=None,
                  dot_precision="ieee", **launch):
    """k [B,T,H,K], v [B,T,HV,V], G/beta [B,T,HV], Ai [B,T,HV,C] -> (W [B,T,HV,K], U like v).
    launch: num_warps, num_stages (launch sweeps)."""
    B, T, H, K = k.shape
    HV, V, C = v.shape[2], v.shape[3], Ai.shape[-1]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty_like(v)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, C)
    direct.launch(
        wu_kernel, chunk_head_grid(NT, B, HV),
        k, v, G, beta, Ai, w, u, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, V=V, BT=C,
        BK=max(16, triton.next_power_of_2(K)), BV=min(64, max(16, triton.next_power_of_2(V))),
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision,
        **{"num_warps": _num_warps(Ai), **launch})
    return w, u
