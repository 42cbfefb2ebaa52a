"""Experimental: the chunk-state recurrence (kernels/chunk_state.py) and the chunk output
(kernels/chunk_output.py) of the materialized forward in one warp-specialized Gluon kernel for
Hopper (sm_90a). Not wired into any backend; compile-verified on a CPU (eval.ptxas) and meant
to be checked on a GPU against ``chunk_state`` + ``chunk_output``.

Per sequence, value head and block of BV = 64 value columns, over chunks c of C = 64 tokens,
with S the state entering chunk c (h_c of the materialized forward):

    V'_c  = U_c − W_c S                                                 ("v_new")
    O_c   = scale (diag(e^{G}) Q_c S + (Q_c K_cᵀ ⊙ M) V'_c),  M_ij = e^{G_i − G_j}, j ≤ i
    S     ← e^{G_C} S + (diag(e^{G_C − G}) K_c)ᵀ V'_c                     (fp32)

Why fuse: the materialized forward stores h (K·V bf16 per chunk and value head, 536 MB at
B = 1, T = 32768, HV = 32) and v_new only for chunk_output to read them back, plus a launch.
Here S never leaves the SM and V'_c is used from shared memory the moment it exists, so neither
is written: the forward's only outputs are o and the final state. (The materialized forward
also hands h and v_new to the backward; a backward over this kernel must recompute them.)

Why this shape:

- As in kernels/gluon_state.py: the recurrence is sequential over chunks, so one producer warp
  (``gluon_ring.load_ring``, 24 registers) streams chunk c+1's q, k, w, u tiles by TMA into a
  2-stage ring guarded by ready/empty mbarriers, and the consumer warpgroup keeps S (128 × 64
  fp32, 64 registers a thread) in registers for the whole sequence.
- Five warpgroup MMAs a chunk. Q S and W S read S from the bf16 shared copy written once per
  chunk (before the update: the output uses h_c, as chunk_output does); Q Kᵀ reads k through a
  transposed view of its [C, K] tile; (Q Kᵀ ⊙ M) V' takes its A operand from registers (the
  masked product converted in place to the wgmma operand layout, nothing through shared) and
  V' from shared; Kᵀ (decayed V') reads k transposed again as A.
- V' is stored to shared twice, as is (for the output) and with each row decayed to the chunk
  end (for the state): two 8 KB buffers, one fence and barrier, instead of reusing one buffer
  behind an extra barrier. Shared memory stays within one program an SM either way.
- Masking and precision as the Triton kernels: G is read in fp64, G_i − G_j is formed in fp64,
  rounded to fp32 and selected by the causal mask before the exp (kkt.gated_decay), so entries
  above the diagonal never overflow; Q Kᵀ ⊙ M and V' are rounded to bf16 before their product,
  as chunk_output rounds them.
- Q Kᵀ and its mask do not depend on the value block, so both V/BV = 2 programs of a value
  head compute them (64 × 64 × 128 multiply-adds a chunk, as many as Q S): accepted, as it
  keeps one program per (head, value block) with its S in registers; chunk_output does the
  same. The masked product is formed first in the chunk, so its fp64 G columns and fp32
  temporaries are dead before V' and the output accumulator are live.

Shared memory (bf16 tiles): a ring stage holds q, k, w [64, 128] (16 KB each) and u [64, 64]
(8 KB): 56 KB, so 2 stages are 112 KB; S [128, 64] 16 KB; V' and decayed V' [64, 64] 8 KB
each; four mbarriers: 144 KB (147,668 B with the compiler's scratch, as compiled), within
227 KB: one program an SM (two would need a 1-stage ring; at B = 1, HV = 32 there are only 64
programs for 132 SMs anyway). Registers: 8 warps (the consumer warpgroup and the producer's,
padded to 4) × MAXNREG = 128, which setmaxnreg splits into 232 for the consumer and 24 for the
producer. The consumer's live set is S (64 a thread), at most three 64 × 64 fp32 tiles (32
each) and the bf16 masked product (16); pointers are 64-bit scalar bases plus 32-bit tile
offsets (an int64 [128, 64] pointer tile alone would take 128). ptxas: 8 bytes of spill, one
64-bit value stored before the chunk loop and loaded after it (SASS), none inside.

Scope: dense batches (no cu_seqlens), K = V = 128, chunk 64, bf16 q/k/w/u. T need not be a
multiple of 64: TMA tiles are 2-D over the flattened [B·T] token axis, so the last chunk of a
sequence may read the next sequence's first rows (the last sequence's are zero-filled); those
rows get a zero decay weight and a zero row of M, and M's columns past T are nonzero only in
such rows, so they add 0 · finite to S and O; output rows past T are masked on store.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels.gluon_ring import (LOAD_REGS, LOAD_WARPS, accumulator_layout,
                                          chunk_gates, descriptor_layout, initial_state,
                                          load_ring, ring_barriers, ring_buffers, ring_program,
                                          state_tile)
from gdn_fused.kernels.gluon_state import BV, CHUNK, HEAD_DIM

NUM_STAGES = 2  # ring depth of q/k/w/u tiles (56 KB a stage): chunk c+1 loads while c computes
# setmaxnreg then gives the consumer 232 registers: enough (ptxas, see above); a larger cap
# (measured up to 168, consumer 256) leaves the same 8 bytes of spill outside the loop
MAXNREG = 128


@gluon.jit
def _state_output_partition(bufs, bars, s_smem, vn_smem, vd_smem, G, o, h0, ht, scale, T, NT,
                            i_n, i_hv, i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                            USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr):
    q_bufs, k_bufs, w_bufs, u_bufs = bufs
    ready, empty = bars
    BT: gl.constexpr = k_bufs.type.shape[1]
    BV: gl.constexpr = u_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    # N = 64 for every product: BV = BT = 64
    acc: gl.constexpr = accumulator_layout(BV)
    # the masked Q Kᵀ as a register A operand: two bf16 a 32-bit register
    a_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, acc)
    cols_l: gl.constexpr = gl.SliceLayout(0, acc)
    o_t = gl.arange(0, BT, layout=rows_l)
    o_j = gl.arange(0, BT, layout=cols_l)
    o_v = gl.arange(0, BV, layout=cols_l)
    S = initial_state(h0, i_n, i_hv, i_v, HV, K, V, BV, acc, USE_INITIAL_STATE)
    bos = i_n * T
    for i_t in range(NT):
        s = i_t % STAGES
        # the chunk's gates first: their global-load latency then overlaps the S store and the
        # ready wait instead of stalling the mask and the decay
        valid, b_G, G_last = chunk_gates(G, bos, i_t, T, o_t, HV, i_hv)
        b_Gj = gl.load(G + (bos + i_t * BT + o_j).to(gl.int64) * HV + i_hv,
                       mask=i_t * BT + o_j < T, other=0.)
        # h_c: the state before this chunk's update, for both the output and V'
        s_smem.store(S.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(ready.index(s), (i_t // STAGES) & 1)
        q_s = q_bufs.index(s)
        k_s = k_bufs.index(s)
        # first the masked Q Kᵀ, which needs no S: kept as a bf16 A operand (16 registers),
        # its fp64 G columns and fp32 temporaries are dead before V' and the output are live
        qk = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc),
                           use_acc=False)
        # rows past T are selected away too: their G reads 0, so G_i − G_j may be > 0
        incl = (o_t[:, None] >= o_j[None, :]) & valid[:, None]
        diff = (b_G[:, None] - b_Gj[None, :]).to(gl.float32)
        qk = qk * gl.where(incl, gl.exp(gl.where(incl, diff, 0.)), 0.)
        p = gl.convert_layout(qk.to(gl.bfloat16), a_reg)
        vn = u_bufs.index(s).load(acc).to(gl.float32) - \
            warpgroup_mma(w_bufs.index(s), s_smem, gl.zeros([BT, BV], gl.float32, acc),
                          use_acc=False)
        # G_C − G_i ≤ 0: the exp cannot overflow; rows past T get weight 0
        decay = gl.where(valid, gl.exp((G_last - b_G).to(gl.float32)), 0.)
        vn_smem.store(vn.to(gl.bfloat16))
        vd_smem.store((vn * decay[:, None]).to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        b_o = warpgroup_mma(q_s, s_smem, gl.zeros([BT, BV], gl.float32, acc), use_acc=False)
        b_o = warpgroup_mma(p, vn_smem, b_o * gl.exp(b_G.to(gl.float32))[:, None])
        p_o = o + ((bos + i_t * BT).to(gl.int64) * HV + i_hv) * V + i_v * BV
        gl.store(p_o + (o_t[:, None] * (HV * V) + o_v[None, :]),
                 (b_o * scale).to(o.dtype.element_ty), mask=valid[:, None])
        S = warpgroup_mma(k_s.permute((1, 0)), vd_smem, S * gl.exp(G_last.to(gl.float32)))
        # order the generic-proxy read of u before the next TMA write into stage s, and have
        # all four warps past their reads (and past s_smem, vn_smem, vd_smem) before the
        # producer may refill the stage and the next chunk overwrites the buffers
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
    if STORE_FINAL_STATE:
        gl.store(state_tile(ht, i_n, i_hv, i_v, HV, K, V, BV, acc), S)


@gluon.jit
def chunk_state_output_gluon_kernel(q_desc, k_desc, w_desc, u_desc, G, o, h0, ht, scale, T,
                                    H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                                    V: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                                    STORE_FINAL_STATE: gl.constexpr, STAGES: gl.constexpr):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    i_v, i_n, i_hv, i_h = ring_program(H, HV)
    NT = gl.cdiv(T, BT)
    descs = (q_desc, k_desc, w_desc, u_desc)
    bufs = (ring_buffers(q_desc, STAGES), ring_buffers(k_desc, STAGES),
            ring_buffers(w_desc, STAGES), ring_buffers(u_desc, STAGES))
    tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BV], gl.bfloat16)
    s_smem = gl.allocate_shared_memory(
        gl.bfloat16, [K, BV], gl.NVMMASharedLayout.get_default_for([K, BV], gl.bfloat16))
    vn_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], tile)
    vd_smem = gl.allocate_shared_memory(gl.bfloat16, [BT, BV], tile)
    bars = ring_barriers(STAGES)
    gl.warp_specialize([
        (_state_output_partition, (bufs, bars, s_smem, vn_smem, vd_smem, G, o, h0, ht, scale, T,
                                   NT, i_n, i_hv, i_v, HV, K, V, USE_INITIAL_STATE,
                                   STORE_FINAL_STATE)),
        (load_ring, (descs, bufs, (i_h * K, i_h * K, i_hv * K, i_hv * V + i_v * BV), bars,
                     i_n * T, NT)),
    ], [LOAD_WARPS], [LOAD_REGS])


# TMA block shape of each descriptor argument: q, k, w [C, K]; u [C, BV]
DESCRIPTOR_BLOCKS = dict(q=[CHUNK, HEAD_DIM], k=[CHUNK, HEAD_DIM], w=[CHUNK, HEAD_DIM],
                         u=[CHUNK, BV])


def chunk_state_output_gluon(q, k, w, u, G, scale, initial_state, output_final_state):
    """The materialized forward's chunk_state + chunk_output without h or v_new in HBM.

    q, k [B, T, H, 128] bf16; w, u [B, T, HV, 128] bf16 (recompute_w_u); G [B, T, HV]
    (natural-log decay cumulated within each chunk of 64; read in fp64); scale a float;
    initial_state [B, HV, 128, 128] (read in fp32) or None. Returns (o [B, T, HV, 128] bf16,
    final state [B, HV, 128, 128] fp32 or None). Raises ValueError for tensors not on an NVIDIA
    sm_90 GPU, T = 0, head dims other than 128, non-bf16 q/k/w/u, shapes that do not match or
    HV not a multiple of H (gluon_transposed.check_state_inputs); dense batches only (the
    chunk size is fixed at 64). Math: the chunkwise Gated DeltaNet forward (Yang, Kautz &
    Hatamizadeh, arXiv:2412.06464, §3.3)."""
    from gdn_fused.kernels.gluon_transposed import check_state_inputs
    check_state_inputs("chunk_state_output_gluon", q, k, u, G, initial_state, None,
                       (("w", w, HEAD_DIM), ("u", u, HEAD_DIM)))
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    q, k, w, u = (x.contiguous() for x in (q, k, w, u))
    G = G.to(torch.float64).contiguous()
    o = torch.empty_like(u, dtype=q.dtype)
    ht = q.new_empty(B, HV, K, V, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    views = dict(q=q.view(B * T, H * K), k=k.view(B * T, H * K), w=w.view(B * T, HV * K),
                 u=u.view(B * T, HV * V))
    descs = [TensorDescriptor.from_tensor(x, DESCRIPTOR_BLOCKS[n],
                                          descriptor_layout(DESCRIPTOR_BLOCKS[n]))
             for n, x in views.items()]
    grid = (V // BV, B * HV)
    chunk_state_output_gluon_kernel[grid](*descs, G, o, h0, ht, float(scale), T, H=H, HV=HV,
                                          K=K, V=V, USE_INITIAL_STATE=h0 is not None,
                                          STORE_FINAL_STATE=output_final_state,
                                          STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG)
    return o, ht
