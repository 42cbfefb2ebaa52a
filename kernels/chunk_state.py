"""The chunk-state recurrence: per sequence and value head, sequential over chunks.

    h_c   = state entering chunk c (stored for the output kernel)
    V'_c  = U_c − W_c h_c                                 ("v_new")
    h_c+1 = e^{G_C} h_c + (diag(e^{G_C − G}) K_c)ᵀ V'_c    (fp32, in registers)
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import load_state_tile, sm_count, state_program


@triton.jit
def chunk_state_kernel(k, w, u, G, h, v_new, h0, ht, cu_seqlens, chunk_offsets, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    i_v, i_n, i_hv, i_h, bos, seqlen, NT, boh, p_state = state_program(
        T, cu_seqlens, chunk_offsets, H, HV, K, V, BT, IS_VARLEN)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        b_h = load_state_tile(h0, p_state, i_v, K, V, BK, BV)
    o_i = tl.arange(0, BT)
    for i_t in range(NT):
        p_h = tl.make_block_ptr(h + ((boh + i_t).to(tl.int64) * HV + i_hv) * K * V, (K, V), (V, 1),
                                (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), boundary_check=(0, 1))
        p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                                (i_t * BT, 0), (BT, BK), (1, 0))
        p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, seqlen), (1, H * K),
                                (0, i_t * BT), (BK, BT), (0, 1))
        b_w = tl.load(p_w, boundary_check=(0, 1))
        b_vn = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32) - \
            tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PREC)
        tl.store(p_vn, b_vn.to(p_vn.dtype.element_ty), boundary_check=(0, 1))
        last = tl.minimum((i_t + 1) * BT, seqlen) - 1
        b_G_last = tl.load(G + (bos + last) * HV + i_hv)
        valid = (i_t * BT + o_i) < seqlen
        b_G = tl.load(G + (bos + i_t * BT + o_i) * HV + i_hv, mask=valid, other=0.)
        # decay each row to the chunk end; G_C − G_i ≤ 0, so the exp cannot overflow
        decay = (b_G_last - b_G).to(tl.float32)
        b_vn = b_vn * tl.where(valid, tl.exp(tl.where(valid, decay, 0.)), 0.)[:, None]
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_h = b_h * tl.exp(b_G_last.to(tl.float32)) + \
            tl.dot(b_k, b_vn.to(b_k.dtype), input_precision=DOT_PREC)
    if STORE_FINAL_STATE:
        p_ht = tl.make_block_ptr(ht + p_state, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_ht, b_h, boundary_check=(0, 1))


def state_blocks(K, V, num_seq_heads, device, min_block_v=32):
    """(BK, BV) for a sequential-over-chunks kernel with one [BK, BV] fp32 state per program.

    BV is at most 64 (32 past K = 128) to keep the state in registers, and is halved to 32
    when the programs, num_seq_heads · cdiv(V, BV), would leave SMs idle. Measured on the H200
    at B = 1, T = 32768, HV = 32, K = V = 128 (eval.bench --sweep, 2026-11-29): BV = 64 (64
    programs) 877 µs, 32 (128 programs) 659 µs, 16 (256 programs) 796 µs — halving again adds
    programs but each pays an N = 16 product and re-reads w and k. The backward's state pass
    (chunk_bwd_state) measured alike on 2026-11-30: BV = 16 1,563 µs, 32 934 µs, 64 1,675 µs.
    ``min_block_v`` is where the halving stops (launch sweeps)."""
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64 if BK <= 128 else 32, max(16, triton.next_power_of_2(V)))
    while BV > min_block_v and num_seq_heads * triton.cdiv(V, BV) < sm_count(device):
        BV //= 2
    return BK, BV


def state_stages(num_programs, device):
    """Software-pipeline stages of a sequential-over-chunks kernel: Triton's 3 while its
    programs fit the SMs in one wave, 2 past that, where the third stage's shared memory (117
    KB against 81 at K = 128) keeps a second program off each SM. H200 (eval.bench --sweep
    launch, 2026-11-30): (8, 4096), 512 programs: chunk_state 454 → 420 µs, chunk_bwd_state
    905 → 836; (1, 32768), 128 programs: 666 → 886 and 940 → 1,262 (so not there). The
    forward's (8, 4096) output was bit-identical with either (eval.bench's Gluon comparison)."""
    return 2 if num_programs > sm_count(device) else 3


def chunk_state(k, w, u, G, initial_state, output_final_state, chunk_size, num_seqs,
                cu_seqlens=None, chunk_offsets=None, num_chunks=None, dot_precision="ieee",
                block_v=None, **launch):
    """Returns (h [NT_total, HV, K, V] in k's dtype, v_new like u, final_state fp32 or None).

    block_v: value columns per program, overriding :func:`state_blocks`; launch: num_warps,
    num_stages (launch sweeps)."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    NT = num_chunks if cu_seqlens is not None else B * triton.cdiv(T, chunk_size)
    h = k.new_empty(NT, HV, K, V)
    v_new = torch.empty_like(u)
    ht = k.new_empty(num_seqs, HV, K, V, dtype=torch.float32) if output_final_state else None
    BK, BV = state_blocks(K, V, num_seqs * HV, k.device)
    BV = block_v or BV
    grid = (triton.cdiv(V, BV), num_seqs * HV)
    launch = {"num_stages": state_stages(grid[0] * grid[1], k.device), **launch}
    direct.launch(chunk_state_kernel, grid, k, w, u, G, h, v_new, initial_state, ht, cu_seqlens,
                  chunk_offsets, T, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BV,
                  USE_INITIAL_STATE=initial_state is not None,
                  STORE_FINAL_STATE=output_final_state,
                  IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision, **launch)
    return h, v_new, ht
