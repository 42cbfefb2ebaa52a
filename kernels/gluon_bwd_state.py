"""The backward's reverse state recurrence (kernels/chunk_bwd_state.py) as a warp-specialized
Gluon kernel for Hopper (sm_90a) with the state gradient held *transposed*, as the forward's
chain in kernels/gluon_transposed.py: the same outputs (dh, dV' "dv2", dh0) from the same
inputs.

Per sequence, value head and block of BV = 64 value columns, over chunks c in reverse, with
dHᵀ [BV, K] the gradient of the state leaving chunk c (fp32, registers):

    store dh_c = dH                                                       (bf16)
    dV'ᵀ = dV'_localᵀ + (dHᵀ Kᵀ) D_{e^{G_C − G}}                          (stored bf16: dv2)
    dHᵀ ← e^{G_C} dHᵀ + (dOᵀ D_{scale·e^G}) Q − dV'ᵀ W

Why transposed: in chunk_bwd_state the running dh is the *right* operand of K dh and its
update's products take dV' on the right too, which warpgroup MMA reads only from shared
memory; with dHᵀ on the left both chained products take their left operand from registers
(bf16 of the fp32 accumulator, converted in place), and the chunk's third product,
(dOᵀ D) Q, does not depend on the chain: it is issued first, into the accumulator e^{G_C} dHᵀ.
One producer warp streams the chunk's k, q, w (all K columns), dO and dV'_local (this
block's columns) and its row of G by TMA into a two-stage ring, in reverse chunk order; the
chain stages dh_c and dV' in shared memory through transposed views and stores them by TMA
(two staging tiles each, so a store waits only for the one two chunks back).

With T in W's place (``chain_t``, the backward's default since session 19: W is never formed)
the ring holds T's [C, C] tiles and the forward's chain rows (β, e^G, the decay and γ in fp32
beside G, since session 22: chunk_gate.store_gate_rows), and the last term is
((dV'ᵀ T) D_{β e^G}) K: one product more on the chain (20 wgmma a step instead of 16; 166 KB
of shared memory, no spills). H200, (1, 32768), session 19: 893 µs against 814 reading W,
dh and dV' within 1e-4 of the W form's and as close to fp64 as chunk_bwd_state's chain form
(tests/test_gluon_bwd_state.py); the backward loses recompute_w_u's 301 µs for it.

Measured (H200, (1, 32768), eval.bench --sweep bwd, session 16): 815 µs against 925 for
chunk_bwd_state in the same run, 1.59 µs a chunk step (the PTX stages both tiles with
stmatrix.trans and reads dO and dV'_local with ldmatrix.trans: 867 SASS instructions a step,
no spills, 181 KB of shared memory); the fused fwd+bwd at (8, 4096) 5.18 → 4.88 ms.

The roundings are chunk_bwd_state's (dh and dV' rounded to bf16 for their products, dO·e^G to
bf16, fp32 accumulation); the accumulation order differs (the three terms of the update are
one accumulator here), so the bits may differ in the last place.

Scope: that of the forward's transposed kernels (materialized.gluon_tiles_apply: dense
batches where no chunk straddles two sequences, K = V = 128, chunk 64, bf16). Math: the
chunkwise Gated DeltaNet backward (docs/backward.md; flash-linear-attention's
chunk_gated_delta_rule_bwd_dhu).
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.gluon_ring import (CHUNK, HEAD_DIM, LOAD_REGS, LOAD_WARPS,
                                          accumulator_layout, check_heads, check_operands,
                                          descriptor_layout, ring_barriers, ring_buffers,
                                          tile_bytes)
from gdn_fused.kernels.gluon_transposed import (CHAIN_GATE_BLOCK, CHAIN_GATE_LAYOUT, GATE_LAYOUT,
                                                _chain_rows, _chunk_decay, _gate_row,
                                                _state_tile_t)

BV = 64  # value rows of dHᵀ a program: wgmma's M, one warpgroup
STAGES = 2
DESCRIPTOR_BLOCKS = dict(k=[CHUNK, HEAD_DIM], q=[CHUNK, HEAD_DIM], w=[CHUNK, HEAD_DIM],
                         do=[CHUNK, BV], dvl=[CHUNK, BV], g=[1, CHUNK], dv2=[CHUNK, BV],
                         dh=[HEAD_DIM, BV])
# with T in place of W (CHAIN_T): T's [C, C] tiles and the chain rows (the forward's: G, then
# β, e^G, the decay e^{G_C − G} and γ in fp32; chunk_gate.store_gate_rows)
CHAIN_T_BLOCKS = dict(DESCRIPTOR_BLOCKS, w=[CHUNK, CHUNK], g=CHAIN_GATE_BLOCK)
# the chain's warpgroup and the producer warp (padded to 4): 8 warps
MAXNREG = 240
# Both value blocks of a head in one program (CHAINS = 2), two chain warpgroups: off until
# timed on the GPU (session 26 built it after the forward's two chains a program, whose chains
# alone stepped 1.73× as fast as one a program; docs/speed_log.md). 4 + 1 + 4 warps padded
# to 12 at 168 registers before setmaxnreg: the producer 24, chain 1 CHAIN_REGS, chain 0 the
# rest (240 too)
TWO_CHAINS = False
MAXNREG_TWO_CHAINS = 168
CHAIN_WARPS = gl.constexpr(4)
CHAIN_REGS = gl.constexpr(240)


@gluon.jit
def _producer(descs, bufs, ready, empty, row0, NT, kcol, wcol, vcol, g_row, bufs1=None):
    """One warp: chunk NT − 1 − j's tiles into stage j % STAGES once the chain(s) released it;
    with ``bufs1`` (two chains a program) also dO's and dV'_local's second value block
    (columns vcol + BV) into bufs1's two rings."""
    k_desc, q_desc, w_desc, do_desc, dvl_desc, g_desc = descs
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BVr: gl.constexpr = do_desc.block_type.shape[1]
    STAGES: gl.constexpr = bufs[0].type.shape[0]
    if bufs1 is None:
        nbytes: gl.constexpr = tile_bytes(descs)
    else:
        nbytes: gl.constexpr = tile_bytes(descs) + tile_bytes((do_desc, dvl_desc))
    for j in range(NT):
        i_t = NT - 1 - j
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        row = row0 + i_t * BT
        tma.async_copy_global_to_shared(k_desc, [row, kcol], bar, bufs[0].index(s))
        tma.async_copy_global_to_shared(q_desc, [row, kcol], bar, bufs[1].index(s))
        tma.async_copy_global_to_shared(w_desc, [row, wcol], bar, bufs[2].index(s))
        tma.async_copy_global_to_shared(do_desc, [row, vcol], bar, bufs[3].index(s))
        tma.async_copy_global_to_shared(dvl_desc, [row, vcol], bar, bufs[4].index(s))
        tma.async_copy_global_to_shared(g_desc, [g_row, i_t * BT], bar, bufs[5].index(s))
        if bufs1 is not None:
            tma.async_copy_global_to_shared(do_desc, [row, vcol + BVr], bar, bufs1[0].index(s))
            tma.async_copy_global_to_shared(dvl_desc, [row, vcol + BVr], bar,
                                            bufs1[1].index(s))


@gluon.jit
def _chain(bufs, ready, empty, dh_tiles, dv_tiles, dh_desc, dv2_desc, dht, dh0, scale, T, NT,
           i_n, i_hv, i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
           USE_FINAL_STATE_GRAD: gl.constexpr, STORE_INITIAL_STATE_GRAD: gl.constexpr,
           CHAIN_T: gl.constexpr):
    """The reverse recurrence of one (sequence, value head, value block); with CHAIN_T the
    ring's w tiles are T's and dV'ᵀ W is ((dV'ᵀ T) D_{β e^G}) K, one product more on the
    chain."""
    k_bufs, q_bufs, w_bufs, do_bufs, dvl_bufs, g_bufs = bufs
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = do_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)    # dHᵀ [BV, K]
    acc_t: gl.constexpr = accumulator_layout(BT)   # dHᵀ Kᵀ, dV'ᵀ [BV, C]
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    if USE_FINAL_STATE_GRAD:
        dH = gl.load(_state_tile_t(dht, i_n, i_hv, i_v, HV, K, V, BVr, acc_k))
    else:
        dH = gl.zeros([BVr, K], gl.float32, acc_k)
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, acc_t))
    col = i_hv * V + i_v * BVr
    for j in range(NT):
        i_t = NT - 1 - j
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        d16 = dH.to(gl.bfloat16)
        d_op = gl.convert_layout(d16, a_t)
        X = warpgroup_mma(d_op, k_bufs.index(s).permute((1, 0)),
                          gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False, is_async=True)
        if CHAIN_T:
            # the gate math from the chain rows (formed by chunk_cumsum, as the forward's
            # chain reads them; e^G and the decay are 0 past T, β too)
            b_beta, e_G, decay, gam = _chain_rows(g_bufs, s, gl.SliceLayout(0, acc_t))
        else:
            b_G = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(0, acc_t))
            decay, gam = _chunk_decay(b_G, i_t, T, o_c)
            valid = i_t * BT + o_c < T
            e_G = gl.where(valid, gl.exp(gl.where(valid, b_G, 0.).to(gl.float32)), 0.)
        e_g = e_G * scale
        # (dOᵀ D_{scale·e^G}) Q into e^{G_C} dHᵀ: independent of the chain's first product
        do_t = do_bufs.index(s).permute((1, 0)).load(acc_t).to(gl.float32)
        o_op = gl.convert_layout((do_t * e_g[None, :]).to(gl.bfloat16), a_k)
        S = warpgroup_mma(o_op, q_bufs.index(s), dH * gam, is_async=True)
        # dh_c staged for its store, transposed to [K, BV] (the tile's store two chunks back
        # must have read it: two stores a chunk). With one dh_c tile (two chains a program:
        # shared memory) the previous chunk's dh_c store must have read it; its dV' store,
        # issued after it, may still run
        tile = j % 2
        DH_TILES: gl.constexpr = dh_tiles.type.shape[0]
        tma.store_wait(2 if DH_TILES == 2 else 1)
        gl.thread_barrier()
        dh_tiles.index(j % DH_TILES).permute((1, 0)).store(d16)
        X, d_op = warpgroup_mma_wait(1, deps=[X, d_op])
        dv = dvl_bufs.index(s).permute((1, 0)).load(acc_t).to(gl.float32) + X * decay[None, :]
        dv16 = dv.to(gl.bfloat16)
        if CHAIN_T:
            # dV'ᵀ T, its columns scaled by β e^G (β is 0 past T: zero-padded rows), then K
            y_op = gl.convert_layout(dv16, a_t)
            Y = warpgroup_mma(y_op, w_bufs.index(s), gl.zeros([BVr, BT], gl.float32, acc_t),
                              use_acc=False, is_async=True)
            dv_tiles.index(tile).permute((1, 0)).store(dv16)
            Y, y_op, S = warpgroup_mma_wait(0, deps=[Y, y_op, S])
            n_op = gl.convert_layout((Y * (-(e_G * b_beta))[None, :]).to(gl.bfloat16), a_k)
            S = warpgroup_mma(n_op, k_bufs.index(s), S, is_async=True)
        else:
            n_op = gl.convert_layout(-dv16, a_k)
            S = warpgroup_mma(n_op, w_bufs.index(s), S, is_async=True)
            dv_tiles.index(tile).permute((1, 0)).store(dv16)
        S, o_op, n_op = warpgroup_mma_wait(0, deps=[S, o_op, n_op])
        # the stage's tiles are read (and the staging tiles written): fence for the TMA
        # stores, every warp, then the one arrive and the stores
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        tma.async_copy_shared_to_global(dh_desc, [((i_n * NT + i_t) * HV + i_hv) * K,
                                                  i_v * BVr], dh_tiles.index(j % DH_TILES))
        tma.async_copy_shared_to_global(dv2_desc, [i_n * T + i_t * BT, col],
                                        dv_tiles.index(tile))
        dH = S
    if STORE_INITIAL_STATE_GRAD:
        gl.store(_state_tile_t(dh0, i_n, i_hv, i_v, HV, K, V, BVr, acc_k), dH)
    tma.store_wait(0)


@gluon.jit
def _staging_tiles(dh_desc, dv2_desc, DH_TILES: gl.constexpr):
    """A chain's TMA staging tiles: DH_TILES of dh_c ([K, BV]) and two of dV' ([C, BV])."""
    dh_tiles = gl.allocate_shared_memory(dh_desc.dtype, [DH_TILES] + dh_desc.block_type.shape,
                                         dh_desc.layout)
    dv_tiles = gl.allocate_shared_memory(dv2_desc.dtype, [2] + dv2_desc.block_type.shape,
                                         dv2_desc.layout)
    return dh_tiles, dv_tiles


@gluon.jit
def chunk_bwd_state_t_kernel(k_desc, q_desc, w_desc, do_desc, dvl_desc, g_desc, dv2_desc,
                             dh_desc, dht, dh0, scale, T, H: gl.constexpr, HV: gl.constexpr,
                             K: gl.constexpr, V: gl.constexpr,
                             USE_FINAL_STATE_GRAD: gl.constexpr,
                             STORE_INITIAL_STATE_GRAD: gl.constexpr, STAGES: gl.constexpr,
                             CHAIN_T: gl.constexpr = False, CHAINS: gl.constexpr = 1):
    """Grid (V / (CHAINS·BV), B·HV); with CHAIN_T, w_desc reads T ([C, C] tiles) and g_desc
    the chain rows (four a head). CHAINS = 2 (V = 2·BV): both value blocks of a head in one
    program, a chain warpgroup each (the second a worker beside the default partition),
    sharing the ring's k, q, w and gate tiles, each with its own dO and dV'_local rings and
    one dh_c staging tile (two dV' ones): 212 KB (``TWO_CHAINS``)."""
    gl.static_assert(CHAINS == 1 or V == 2 * do_desc.block_type.shape[1],
                     "two chains a program: both value blocks of a head, V = 2·BV")
    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BVr: gl.constexpr = do_desc.block_type.shape[1]
    NT = gl.cdiv(T, BT)
    descs = (k_desc, q_desc, w_desc, do_desc, dvl_desc, g_desc)
    bufs = (ring_buffers(k_desc, STAGES), ring_buffers(q_desc, STAGES),
            ring_buffers(w_desc, STAGES), ring_buffers(do_desc, STAGES),
            ring_buffers(dvl_desc, STAGES), ring_buffers(g_desc, STAGES))
    # dh_c staging tiles a chain: two, or one with two chains (two would not fit: 244 KB)
    DH_TILES: gl.constexpr = 2 if CHAINS == 1 else 1
    dh_tiles, dv_tiles = _staging_tiles(dh_desc, dv2_desc, DH_TILES)
    ready, empty = ring_barriers(STAGES, consumers=CHAINS)
    if CHAINS == 2:
        bufs1 = (ring_buffers(do_desc, STAGES), ring_buffers(dvl_desc, STAGES))
        dh_tiles1, dv_tiles1 = _staging_tiles(dh_desc, dv2_desc, DH_TILES)
        gl.warp_specialize([
            (_chain, (bufs, ready, empty, dh_tiles, dv_tiles, dh_desc, dv2_desc, dht, dh0, scale,
                      T, NT, i_n, i_hv, 0, HV, K, V, USE_FINAL_STATE_GRAD,
                      STORE_INITIAL_STATE_GRAD, CHAIN_T)),
            (_producer, (descs, bufs, ready, empty, i_n * T, NT, i_h * K,
                         i_hv * w_desc.block_type.shape[1], i_hv * V,
                         i_nh * g_desc.block_type.shape[0], bufs1)),
            (_chain, ((bufs[0], bufs[1], bufs[2], bufs1[0], bufs1[1], bufs[5]), ready, empty,
                      dh_tiles1, dv_tiles1, dh_desc, dv2_desc, dht, dh0, scale, T, NT, i_n,
                      i_hv, 1, HV, K, V, USE_FINAL_STATE_GRAD, STORE_INITIAL_STATE_GRAD,
                      CHAIN_T)),
        ], [LOAD_WARPS, CHAIN_WARPS], [LOAD_REGS, CHAIN_REGS])
        return
    gl.warp_specialize([
        (_chain, (bufs, ready, empty, dh_tiles, dv_tiles, dh_desc, dv2_desc, dht, dh0, scale, T,
                  NT, i_n, i_hv, i_v, HV, K, V, USE_FINAL_STATE_GRAD,
                  STORE_INITIAL_STATE_GRAD, CHAIN_T)),
        (_producer, (descs, bufs, ready, empty, i_n * T, NT, i_h * K,
                     i_hv * w_desc.block_type.shape[1], i_hv * V + i_v * BVr,
                     i_nh * g_desc.block_type.shape[0])),
    ], [LOAD_WARPS], [LOAD_REGS])


def chunk_bwd_state_t(q, k, w, gate_rows, do, dv_local, scale, dht, initial_state,
                      chain_t=False, chains=None):
    """chunk_bwd_state's outputs where materialized.gluon_tiles_apply(q, do, 64, None) holds
    (the caller checks).

    q, k [B, T, H, 128] bf16; w [B, T, HV, 128] bf16 (W), or with ``chain_t`` the forward's
    T [B, T, HV, 64] bf16 (W = T diag(β e^G) K is then never formed); gate_rows
    [B·HV·R, ⌈T/64⌉·64] fp64 as chunk_cumsum(..., gate_rows=[]) (R = 1: G) or, with
    ``chain_t``, chunk_cumsum(..., gate_rows=[beta], chain_rows=True) (R = 4: G and the chain
    rows) lays them out, zero past T; do, dv_local [B, T, HV, 128] bf16; dht [B, HV, 128, 128] or None; initial_state (only
    whether it is given: then dh0 is returned, in its dtype); chains: 1 or 2 value blocks of
    a head a program (None: 2 where TWO_CHAINS is on; the same bits either way). Returns
    (dh [B·NT, HV, 128, 128] bf16, dv2 like do, dh0 or None), as chunk_bwd_state. Raises
    ValueError for other shapes or dtypes, and for chains other than None, 1 or 2."""
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    NT = triton.cdiv(T, CHUNK)
    bf16 = torch.bfloat16
    if chains not in (None, 1, 2):
        raise ValueError(f"chunk_bwd_state_t: chains must be None, 1 or 2, got {chains!r}")
    chains = chains or (2 if TWO_CHAINS else 1)
    check_heads("chunk_bwd_state_t", k, do, HEAD_DIM)
    state = (B, HV, K, V)
    R = 4 if chain_t else 1
    check_operands("chunk_bwd_state_t", [
        ("q", q, k.shape, bf16), ("k", k, k.shape, bf16),
        ("Ai" if chain_t else "w", w, (B, T, HV, CHUNK if chain_t else K), bf16),
        ("gate_rows", gate_rows, (B * HV * R, NT * CHUNK), torch.float64),
        ("do", do, (B, T, HV, V), bf16), ("dv_local", dv_local, (B, T, HV, V), bf16),
        ("dht", dht, state, None), ("initial_state", initial_state, state, None)])
    q, k, w, do, dv_local = (x.contiguous() for x in (q, k, w, do, dv_local))
    dh = k.new_empty(B * NT, HV, K, V)
    dv2 = torch.empty_like(do)
    dh0 = (torch.empty(B, HV, K, V, dtype=torch.float32, device=k.device)
           if initial_state is not None else None)
    dht = dht.float().contiguous() if dht is not None else None
    views = dict(k=k.view(B * T, H * K), q=q.view(B * T, H * K), w=w.view(B * T, -1),
                 do=do.view(B * T, HV * V), dvl=dv_local.view(B * T, HV * V), g=gate_rows,
                 dv2=dv2.view(B * T, HV * V), dh=dh.view(B * NT * HV * K, V))
    blocks = CHAIN_T_BLOCKS if chain_t else DESCRIPTOR_BLOCKS
    gate_layout = CHAIN_GATE_LAYOUT if chain_t else GATE_LAYOUT
    descs = [TensorDescriptor.from_tensor(
        x, blocks[n], gate_layout if n == "g" else descriptor_layout(blocks[n]))
        for n, x in views.items()]
    direct.launch(chunk_bwd_state_t_kernel, (V // (BV * chains), B * HV), *descs, dht, dh0,
                  float(scale), T, H=H, HV=HV, K=K, V=V, USE_FINAL_STATE_GRAD=dht is not None,
                  STORE_INITIAL_STATE_GRAD=dh0 is not None, STAGES=STAGES, CHAIN_T=chain_t,
                  CHAINS=chains, num_warps=4,
                  maxnreg=MAXNREG_TWO_CHAINS if chains == 2 else MAXNREG)
    if dh0 is not None and dh0.dtype != initial_state.dtype:
        dh0 = dh0.to(initial_state.dtype)
    return dh, dv2, dh0
