"""The gated KKᵀ of a chunk: A = strictLower(diag(β)(Γ ⊙ K Kᵀ)), Γ_ij = exp(G_i − G_j), in fp32."""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_gate import gated_decay
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program


@triton.jit
def chunk_kkt_kernel(k, G, beta, A, cu_seqlens, chunk_indices, T, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    i_t, i_hv, i_h, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, H, HV, BT,
                                                     IS_VARLEN)
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                            (BT, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1))
    b_A = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    p_G = tl.make_block_ptr(G + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    p_b = tl.make_block_ptr(beta + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    b_G = tl.load(p_G, boundary_check=(0,))
    b_beta = tl.load(p_b, boundary_check=(0,)).to(tl.float32)
    o_i = tl.arange(0, BT)
    strict = (o_i[:, None] > o_i[None, :]) & ((i_t * BT + o_i) < seqlen)[:, None]
    b_A = b_A * gated_decay(b_G, b_G, strict) * b_beta[:, None]
    p_A = tl.make_block_ptr(A + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                            (i_t * BT, 0), (BT, BT), (1, 0))
    tl.store(p_A, b_A, boundary_check=(0,))


def dot_precision(dtype):
    """fp32 data gets exact (ieee) products; tf32 is never chosen silently (precision policy)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def chunk_kkt(k, G, beta, num_value_heads, chunk_size, cu_seqlens=None, chunk_indices=None,
              num_chunks=None):
    """k [B,T,H,K], G and beta [B,T,HV] -> A [B,T,HV,C] fp32 (row t holds its chunk's row)."""
    B, T, H, K = k.shape
    HV = num_value_heads
    A = torch.empty(B, T, HV, chunk_size, dtype=torch.float32, device=k.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    direct.launch(
        chunk_kkt_kernel, chunk_head_grid(NT, B, HV),
        k, G, beta, A, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, BT=chunk_size,
        BK=max(16, triton.next_power_of_2(K)), IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(k.dtype))
    return A
