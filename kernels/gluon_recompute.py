"""The backward's recompute of h and v_new (kernels/chunk_state.py, what chunk_bwd's
recompute_states runs) on the forward's transposed Gluon chain, storing both by TMA:
experimental, not routed (chunk_bwd.RECOMPUTE_ON_GLUON_CHAIN).

Per sequence, value head, block of BV = 64 value columns and segment of chunks (from the
forward's state checkpoints: segment s starts from checkpoint s − 1, segment 0 from h0), over
chunks c, with Sᵀ [BV, K] the state entering chunk c (fp32, registers):

    store h_c = S                                                          (bf16)
    V'ᵀ = Uᵀ − Sᵀ Wᵀ                                                       (stored bf16: v_new)
    Sᵀ  ← e^{G_C} Sᵀ + V'ᵀ D_{e^{G_C − G}} K

the products and roundings of kernels/gluon_transposed.py's chain (bit-identical there to
chunk_state's). Why another kernel: gluon_transposed.chunk_state_t stores h_c through a second
warpgroup that reads the transposed tile with 64 scalar 16-bit shared loads a thread a chunk
(1,121–1,187 µs against chunk_state's 655, session 7); here the chain stages h_c and V'
through transposed views (stmatrix.trans) and stores them by TMA, as kernels/gluon_bwd_state.py
does for dh and dV' (925 → 815 µs for the reverse pass, session 16). One staging tile each, so
that two CTAs fit an SM (the checkpoint segments give 512 programs at (1, 32768)).

Measured (H200, session 16, `docs/results/recompute_gluon_2026-11-30_s16.log`): the same
bits as chunk_state in every GPU test case, but **444 µs against 422** at (1, 32768) from 7
checkpoints (512 programs) and 441 against 422 at (8, 4096): two CTAs an SM of this chain step
no faster than chunk_state's 2-stage Triton programs (~3.5 µs a chunk step each, shared). Not
routed; what it lacks against the reverse pass's 1.6 µs step is not known (not profiled).

Scope: that of the forward's transposed kernels (materialized.gluon_tiles_apply).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS, checkpoint_slabs
from gdn_fused.kernels.gluon_ring import (LOAD_REGS, LOAD_WARPS, accumulator_layout,
                                          check_operands, descriptor_layout, load_ring,
                                          ring_barriers, ring_buffers)
from gdn_fused.kernels.gluon_transposed import (GATE_LAYOUT, _chunk_decay, _gate_row,
                                                _state_tile_t)

CHUNK = 64
HEAD_DIM = 128
BV = 64
STAGES = 2
DESCRIPTOR_BLOCKS = dict(k=[CHUNK, HEAD_DIM], w=[CHUNK, HEAD_DIM], u=[CHUNK, BV], g=[1, CHUNK],
                         vn=[CHUNK, BV], h=[HEAD_DIM, BV])
# two CTAs an SM: 8 warps each (the chain, the producer warp padded to 4) at 128 registers
MAXNREG = 128


@gluon.jit
def _chain(bufs, ready, empty, h_tile, vn_tile, h_desc, vn_desc, h0, checkpoints, T, NT, c0, n,
           i_n, i_hv, i_v, i_seg, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
           USE_INITIAL_STATE: gl.constexpr, HAS_CHECKPOINTS: gl.constexpr):
    """Chunks c0 … c0 + n − 1 of one (sequence, value head, value block) from the state
    entering chunk c0."""
    k_bufs, w_bufs, u_bufs, g_bufs = bufs
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = u_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)    # Sᵀ [BV, K]
    acc_t: gl.constexpr = accumulator_layout(BT)   # Sᵀ Wᵀ, V'ᵀ [BV, C]
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    if USE_INITIAL_STATE:
        S = gl.load(_state_tile_t(h0, i_n, i_hv, i_v, HV, K, V, BVr, acc_k))
    else:
        S = gl.zeros([BVr, K], gl.float32, acc_k)
    if HAS_CHECKPOINTS:
        if i_seg > 0:
            slab = (i_seg - 1).to(gl.int64) * gl.num_programs(1) * K * V
            S = gl.load(_state_tile_t(checkpoints + slab, i_n, i_hv, i_v, HV, K, V, BVr,
                                      acc_k))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, acc_t))
    for j in range(n):
        i_t = c0 + j
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        s16 = S.to(gl.bfloat16)
        s_op = gl.convert_layout(s16, a_t)
        X = warpgroup_mma(s_op, w_bufs.index(s).permute((1, 0)),
                          gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False, is_async=True)
        # h_c staged for its store, transposed to [K, BV] (the previous chunk's stores must
        # have read the staging tiles)
        tma.store_wait(0)
        gl.thread_barrier()
        h_tile.permute((1, 0)).store(s16)
        b_G = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(0, acc_t))
        decay, gam = _chunk_decay(b_G, i_t, T, o_c)
        X, s_op = warpgroup_mma_wait(num_outstanding=0, deps=[X, s_op])
        vn = u_bufs.index(s).permute((1, 0)).load(acc_t).to(gl.float32) - X
        d_op = gl.convert_layout((vn * decay[None, :]).to(gl.bfloat16), a_k)
        S = warpgroup_mma(d_op, k_bufs.index(s), S * gam, is_async=True)
        vn_tile.permute((1, 0)).store(vn.to(gl.bfloat16))
        S, d_op = warpgroup_mma_wait(num_outstanding=0, deps=[S, d_op])
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        tma.async_copy_shared_to_global(h_desc, [((i_n * NT + i_t) * HV + i_hv) * K, i_v * BVr],
                                        h_tile)
        tma.async_copy_shared_to_global(vn_desc, [i_n * T + i_t * BT, i_hv * V + i_v * BVr],
                                        vn_tile)
    tma.store_wait(0)


@gluon.jit
def chunk_state_seg_t_kernel(k_desc, w_desc, u_desc, g_desc, vn_desc, h_desc, h0, checkpoints,
                             T, seg, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                             V: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                             HAS_CHECKPOINTS: gl.constexpr, STAGES: gl.constexpr):
    """Grid (V / BV, B·HV, segments): segment i_seg covers chunks i_seg·seg … (seg chunks)."""
    i_v, i_nh, i_seg = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BVr: gl.constexpr = u_desc.block_type.shape[1]
    NT = gl.cdiv(T, BT)
    c0 = i_seg * seg
    n = gl.minimum(NT - c0, seg)
    descs = (k_desc, w_desc, u_desc)
    k_bufs = ring_buffers(k_desc, STAGES)
    w_bufs = ring_buffers(w_desc, STAGES)
    u_bufs = ring_buffers(u_desc, STAGES)
    g_bufs = ring_buffers(g_desc, STAGES)
    h_tile = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
    vn_tile = gl.allocate_shared_memory(vn_desc.dtype, vn_desc.block_type.shape, vn_desc.layout)
    ready, empty = ring_barriers(STAGES)
    gl.warp_specialize([
        (_chain, ((k_bufs, w_bufs, u_bufs, g_bufs), ready, empty, h_tile, vn_tile, h_desc,
                  vn_desc, h0, checkpoints, T, NT, c0, n, i_n, i_hv, i_v, i_seg, HV, K, V,
                  USE_INITIAL_STATE, HAS_CHECKPOINTS)),
        (load_ring, (descs, (k_bufs, w_bufs, u_bufs), (i_h * K, i_hv * K, i_hv * V + i_v * BVr),
                     (ready, empty), i_n * T + c0 * BT, n, g_desc, g_bufs, i_nh, c0 * BT)),
    ], [LOAD_WARPS], [LOAD_REGS])


def chunk_state_seg_t(k, w, u, gate_rows, initial_state, checkpoints=None):
    """chunk_state(k, w, u, G, initial_state, False, 64, B, checkpoints=checkpoints)'s h and
    v_new where materialized.gluon_tiles_apply(k, u, 64, None) holds (the caller checks).

    k [B, T, H, 128], w [B, T, HV, 128], u [B, T, HV, 128] bf16; gate_rows [B·HV, ⌈T/64⌉·64]
    fp64 (chunk_cumsum(..., gate_rows=[])); initial_state [B, HV, 128, 128] or None;
    checkpoints [S − 1, B, HV, 128, 128] fp32 (the states entering chunks 64, 128, …) or None.
    Returns (h [B·NT, HV, 128, 128] bf16, v_new like u). ValueError for other shapes or
    dtypes."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    NT = triton.cdiv(T, CHUNK)
    bf16 = torch.bfloat16
    if K != HEAD_DIM or V != HEAD_DIM or HV % H:
        raise ValueError(f"chunk_state_seg_t: needs K = V = {HEAD_DIM} and HV a multiple of H, "
                         f"got k {tuple(k.shape)}, u {tuple(u.shape)}")
    slabs = checkpoint_slabs(NT) if checkpoints is not None else 0
    check_operands("chunk_state_seg_t", [
        ("k", k, k.shape, bf16), ("w", w, (B, T, HV, K), bf16), ("u", u, (B, T, HV, V), bf16),
        ("gate_rows", gate_rows, (B * HV, NT * CHUNK), torch.float64),
        ("initial_state", initial_state, (B, HV, K, V), None),
        ("checkpoints", checkpoints, (slabs, B, HV, K, V), torch.float32)])
    k, w, u = (x.contiguous() for x in (k, w, u))
    h = k.new_empty(B * NT, HV, K, V)
    v_new = torch.empty_like(u)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    views = dict(k=k.view(B * T, H * K), w=w.view(B * T, HV * K), u=u.view(B * T, HV * V),
                 g=gate_rows, vn=v_new.view(B * T, HV * V), h=h.view(B * NT * HV * K, V))
    descs = [TensorDescriptor.from_tensor(
        x, DESCRIPTOR_BLOCKS[n],
        GATE_LAYOUT if n == "g" else descriptor_layout(DESCRIPTOR_BLOCKS[n]))
        for n, x in views.items()]
    segments = slabs + 1
    direct.launch(chunk_state_seg_t_kernel, (V // BV, B * HV, segments), *descs, h0,
                  checkpoints.contiguous() if checkpoints is not None else None, T,
                  SEGMENT_CHUNKS if segments > 1 else max(NT, 1), H=H, HV=HV, K=K, V=V,
                  USE_INITIAL_STATE=h0 is not None, HAS_CHECKPOINTS=checkpoints is not None,
                  STAGES=STAGES, num_warps=4, maxnreg=MAXNREG)
    return h, v_new
