"""Experimental: the chunk-state recurrence of kernels/chunk_state.py as a warp-specialized Gluon
kernel for Hopper (sm_90a). Not wired into any backend; it exists to show, from PTX compiled on
a CPU and from a GPU test against ``chunk_state``, that the recurrence can use the Hopper
features the Triton kernel does not get (TMA, mbarriers, per-role register budgets).

Per sequence, value head and block of BV = 64 value columns, over chunks c of C = 64 tokens:

    h_c   = S                                          (stored bf16, like the reference)
    V'_c  = U_c − W_c S                                ("v_new")
    S     ← e^{G_C} S + (diag(e^{G_C − G}) K_c)ᵀ V'_c   (fp32)

Why this shape:

- The recurrence is sequential over chunks, so the only overlap to win is loading chunk c+1's
  k, w, u while chunk c computes. One producer warp (``gluon_ring.load_ring``, 24 registers) issues
  TMA loads into a 2-stage ring guarded by ready/empty mbarriers; the consumer warpgroup keeps
  S (128 × 64 fp32 = 64 registers a thread) in registers for the whole sequence.
- Both products are warpgroup MMAs with shared operands: W S needs S as the B operand, so S
  is written to shared as bf16 once per chunk, and that same buffer is TMA-stored as h_c;
  Kᵀ V' reads the k tile through a transposed (permuted) view, so k is loaded once in its
  [B, T, H, K] layout and never transposed in registers.
- v_new is stored with a masked ``gl.store`` (rows past T are not written); G is read in fp64
  like the reference and the decay is taken in fp32 after subtracting.

Scope: dense batches (no cu_seqlens), K = V = 128, chunk 64, bf16 k/w/u. T need not be a
multiple of 64: TMA tiles are 2-D over the flattened [B·T] token axis, so the last chunk of a
sequence may read the next sequence's first rows; those rows get a zero decay weight, so they
add 0 · k (k is finite) to S, and v_new rows past T are masked on store.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels.gluon_ring import (CHUNK, HEAD_DIM, LOAD_REGS, LOAD_WARPS,
                                          accumulator_layout, chunk_gates, descriptor_layout,
                                          initial_state, load_ring, ring_barriers, ring_buffers,
                                          ring_program, state_tile)

BV = 64  # value columns per program: S is 128 × 64 fp32, half the registers of a warpgroup
NUM_STAGES = 2  # ring depth of k/w/u tiles: chunk c+1 loads while chunk c computes
# 8 warps (the consumer warpgroup and the producer's, padded to 4) × 128 registers: two programs
# fit an SM's 64K registers, as two fit its shared memory (104 KB each). setmaxnreg then gives
# the consumer 232 registers (ptxas: no spills) and the producer 24.
MAXNREG = 128


@gluon.jit
def _state_partition(bufs, bars, s_smem, vn_smem, h_desc, G, v_new, h0, ht, T, NT, i_n, i_hv,
                     i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                     USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr):
    k_bufs, w_bufs, u_bufs = bufs
    ready, empty = bars
    BT: gl.constexpr = k_bufs.type.shape[1]
    BV: gl.constexpr = u_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc: gl.constexpr = accumulator_layout(BV)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc)
    o_t = gl.arange(0, BT, layout=rows_l)
    o_v = gl.arange(0, BV, layout=cols_l)
    S = initial_state(h0, i_n, i_hv, i_v, HV, K, V, BV, acc, USE_INITIAL_STATE)
    bos = i_n * T
    for i_t in range(NT):
        s = i_t % STAGES
        t = i_t * BT + o_t
        # the chunk's gates first: their global-load latency then overlaps the h store, the
        # ready wait and W S instead of stalling the decay (no store or barrier ahead of them)
        valid, b_G, G_last = chunk_gates(G, bos, i_t, T, o_t, HV, i_hv)
        # the previous h_c TMA store must have read s_smem before it is overwritten
        tma.store_wait(0)
        s_smem.store(S.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(h_desc, [((i_n * NT + i_t) * HV + i_hv) * K, i_v * BV],
                                        s_smem)
        mbarrier.wait(ready.index(s), (i_t // STAGES) & 1)
        w_s = warpgroup_mma(w_bufs.index(s), s_smem, gl.zeros([BT, BV], gl.float32, acc),
                            use_acc=False)
        vn = u_bufs.index(s).load(acc).to(gl.float32) - w_s
        p_vn = v_new + ((bos + t).to(gl.int64) * HV + i_hv)[:, None] * V + i_v * BV + o_v[None, :]
        gl.store(p_vn, vn.to(gl.bfloat16), mask=valid[:, None])
        # G_C − G_i ≤ 0: the exp cannot overflow; rows past T get weight 0
        decay = gl.where(valid, gl.exp((G_last - b_G).to(gl.float32)), 0.)
        vn_smem.store((vn * decay[:, None]).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        S = warpgroup_mma(k_bufs.index(s).permute((1, 0)), vn_smem,
                          S * gl.exp(G_last.to(gl.float32)))
        # order the generic-proxy read of u before the next TMA write into stage s, and have
        # all four warps past their reads before the producer may refill it
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
    tma.store_wait(0)
    if STORE_FINAL_STATE:
        gl.store(state_tile(ht, i_n, i_hv, i_v, HV, K, V, BV, acc), S)


@gluon.jit
def chunk_state_gluon_kernel(k_desc, w_desc, u_desc, h_desc, G, v_new, h0, ht, T,
                             H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                             V: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                             STORE_FINAL_STATE: gl.constexpr, STAGES: gl.constexpr):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    i_v, i_n, i_hv, i_h = ring_program(H, HV)
    NT = gl.cdiv(T, BT)
    k_bufs = ring_buffers(k_desc, STAGES)
    w_bufs = ring_buffers(w_desc, STAGES)
    u_bufs = ring_buffers(u_desc, STAGES)
    s_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
    vn_smem = gl.allocate_shared_memory(
        gl.bfloat16, [BT, BV], gl.NVMMASharedLayout.get_default_for([BT, BV], gl.bfloat16))
    bufs = (k_bufs, w_bufs, u_bufs)
    bars = ring_barriers(STAGES)
    gl.warp_specialize([
        (_state_partition, (bufs, bars, s_smem, vn_smem, h_desc, G, v_new, h0, ht, T, NT, i_n,
                            i_hv, i_v, HV, K, V, USE_INITIAL_STATE, STORE_FINAL_STATE)),
        (load_ring, ((k_desc, w_desc, u_desc), bufs, (i_h * K, i_hv * K, i_hv * V + i_v * BV),
                     bars, i_n * T, NT)),
    ], [LOAD_WARPS], [LOAD_REGS])


# TMA block shape of each descriptor argument: k, w [C, K]; u [C, BV]; h [K, BV]
DESCRIPTOR_BLOCKS = dict(k=[CHUNK, HEAD_DIM], w=[CHUNK, HEAD_DIM], u=[CHUNK, BV],
                         h=[HEAD_DIM, BV])


def chunk_state_gluon(k, w, u, G, initial_state, output_final_state, chunk_size=CHUNK,
                      num_seqs=None, cu_seqlens=None):
    """Same contract as ``chunk_state`` for the case this kernel covers.

    k [B, T, H, 128] bf16; w [B, T, HV, 128] bf16; u [B, T, HV, 128] bf16; G [B, T, HV] fp64
    (natural-log decay cumulated within each chunk of 64); initial_state [B, HV, 128, 128] fp32
    or None. Returns (h [B·cdiv(T, 64), HV, 128, 128] bf16, v_new like u, final state
    [B, HV, 128, 128] fp32 or None). Raises ValueError for packed sequences, a chunk size
    other than 64, head dims other than 128, non-bf16 inputs or HV not a multiple of H.
    Needs a Hopper GPU (sm_90)."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if cu_seqlens is not None:
        raise ValueError("chunk_state_gluon: packed sequences (cu_seqlens) are not supported")
    if chunk_size != CHUNK or K != HEAD_DIM or V != HEAD_DIM or w.shape[3] != K:
        raise ValueError(f"chunk_state_gluon: needs chunk {CHUNK} and K = V = {HEAD_DIM}, got "
                         f"chunk {chunk_size}, K {K}, V {V}")
    if any(x.dtype != torch.bfloat16 for x in (k, w, u)):
        raise ValueError("chunk_state_gluon: k, w, u must be bf16")
    if (HV % H or w.shape[:3] != (B, T, HV) or u.shape[:2] != (B, T) or G.shape != (B, T, HV)
            or (initial_state is not None and initial_state.shape != (B, HV, K, V))):
        raise ValueError(f"chunk_state_gluon: shapes k {tuple(k.shape)}, w {tuple(w.shape)}, "
                         f"u {tuple(u.shape)}, G {tuple(G.shape)} do not match")
    if num_seqs not in (None, B):
        raise ValueError(f"chunk_state_gluon: num_seqs {num_seqs} != batch {B}")
    k, w, u, G = (x.contiguous() for x in (k, w, u, G))
    G = G.to(torch.float64)
    NT = triton.cdiv(T, CHUNK)
    h = k.new_empty(B * NT, HV, K, V)
    v_new = torch.empty_like(u)
    ht = k.new_empty(B, HV, K, V, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    views = dict(k=k.view(B * T, H * K), w=w.view(B * T, HV * K), u=u.view(B * T, HV * V),
                 h=h.view(B * NT * HV * K, V))
    descs = {n: TensorDescriptor.from_tensor(x, DESCRIPTOR_BLOCKS[n],
                                             descriptor_layout(DESCRIPTOR_BLOCKS[n]))
             for n, x in views.items()}
    grid = (V // BV, B * HV)
    chunk_state_gluon_kernel[grid](descs["k"], descs["w"], descs["u"], descs["h"], G, v_new, h0,
                                   ht, T, H=H, HV=HV, K=K, V=V,
                                   USE_INITIAL_STATE=h0 is not None,
                                   STORE_FINAL_STATE=output_final_state, STAGES=NUM_STAGES,
                                   num_warps=4, maxnreg=MAXNREG)
    return h, v_new, ht
