"""Chunk-local cumulative log-decay G_i = g_1 + … + g_i, the first materialized kernel.

G is kept in fp64 (8 bytes per token and value head, next to ~1 KB of q, k, v, o): every
decay the chunk uses is a difference G_i − G_j or G_C − G_i, and in fp32 such a difference
loses ulp(|G|) — 1e-3 absolute once a very negative gate has pushed |G| to 1e4, which was a
1e-3 relative error on o. Kernels take the difference in fp64 and exponentiate in fp32."""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels.chunk_index import chunk_head_program


@triton.jit
def chunk_cumsum_kernel(g, G, cu_seqlens, chunk_indices, T, HV: tl.constexpr, BT: tl.constexpr,
                        IS_VARLEN: tl.constexpr):
    i_t, i_hv, _, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, HV, HV,
                                                   IS_VARLEN)
    p_g = tl.make_block_ptr(g + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    p_G = tl.make_block_ptr(G + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    # rows past the sequence end load g = 0, so G stays flat there: G[C-1] == G at the last row
    b_g = tl.load(p_g, boundary_check=(0,)).to(tl.float64)
    tl.store(p_G, tl.cumsum(b_g, axis=0), boundary_check=(0,))


def chunk_cumsum(g, chunk_size, cu_seqlens=None, chunk_indices=None, num_chunks=None):
    """g [B, T, HV] (any float dtype) -> G [B, T, HV] fp64, cumulated within each chunk."""
    B, T, HV = g.shape
    G = torch.empty(B, T, HV, dtype=torch.float64, device=g.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    chunk_cumsum_kernel[(NT, B * HV)](g, G, cu_seqlens, chunk_indices, T, HV=HV, BT=chunk_size,
                                      IS_VARLEN=cu_seqlens is not None)
    return G
