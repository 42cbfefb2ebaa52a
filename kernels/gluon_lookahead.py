"""forward_t's main launch with a *lookahead* chain (experimental, ``LOOKAHEAD``; off by
default until measured faster): the state recurrence of kernels/gluon_transposed.py's chain
(V' on the chain, one chain and one output warpgroup a program) with the next chunk's
Sᵀ Kᵀ product split so that two dependent products a step are left on the chain, not three.

In the chain's transposed orientation (S = Sᵀ [BV, K], d_j = V'_j D [BV, C], keys K_j [C, K]):

    S_{j+1} = γ_j S_j + d_j K_j                     (the update; γ_j = e^{G_C} of chunk j)
    X_{j+1} = S_{j+1} K_{j+1}ᵀ = Z_j + d_j C_j,  Z_j = (γ_j S_j) K_{j+1}ᵀ,  C_j = K_j K_{j+1}ᵀ

Z_j needs only S_j, known when step j starts, and C_j only keys, so the step's dependent
products are V'_j = Y_j Tᵀ (k = 64; Y_j = β (V − e^G X_j)) and d_j C_j (k = 64); the shipped
chain has X_j (k = 128) → V'_j → the update (k = 64), each waiting for the last. Z_j
(k = 128) and the update (k = 64) run on the tensor cores in the gaps the dependent ones
leave: per step the chain issues V'_j, Z_j (behind it), then d_j C_j onto Z_j's accumulator
in flight and the update, and leaves the update in flight into step j + 1, whose x-operand
arithmetic it overlaps (its wait comes after V'_{j+1} is issued). The tensor-core work a step
grows by C_j (formed by the output warpgroup) and d_j C_j: 768 cycles of the chain's against
640 (m64n64k16 = 32 cycles).

Rounding (the torch twin, tests/test_gluon_transposed.py ``_chain_form_in_torch(...,
lookahead=True)``, `lookahead_twin_2026-12-02_s28.log`): Z_j takes bf16(γ_j S_j), C_j is rounded
to bf16, and where the update takes d's low half (STATE_UPDATE_LO, γ > 1/2) X takes it too
(d_lo C_j). Final state against fp64, g = 0 over 8,192 tokens: 2.577e-3 (the shipped chain
2.444e-3; without X's low half 2.729e-3; C in fp32 2.594e-3), at γ = 0.6 1.85e-3 (1.86),
normal gates 2.405e-3 (the same).

Shared memory: the keys get a ring of their own, KEY_SLOTS = 4 tiles loaded KEYS_AHEAD = 2
chunks ahead of the main ring (q, T, v, the chain rows; 2 stages): at step j the chain reads
K_j (the update) and K_{j+1} (Z_j), the output warpgroup, at its chunk j − 1 meanwhile,
K_{j−1} (Q Kᵀ), K_j and K_{j+1} (C_j), and one slot loads. C_j goes through C_SLOTS = 2 bf16
[C, C] tiles (c_ready / c_empty barriers). 204 KB: ring 2 × 34, keys 64, h_c and V' hand-off
48, O staging 8, C 16.

Scope: as forward_t's one-chain main launch with the output (dense batches, K = V = 128, the
chain rows, segments with the entering states in h0's slabs, checkpoints). T not a multiple
of 64: a last chunk's key rows past T meet zero decay and zero β (as the shipped chain's);
C_{n−1} and Z_{n−1} of a segment's last step read a stale key slot and C tile, and their sum
is discarded.
"""
import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from gdn_fused.kernels.gluon_ring import (LOAD_REGS, LOAD_WARPS, accumulator_layout,
                                          ring_barriers, ring_buffers, ring_program, tile_bytes)
from gdn_fused.kernels.gluon_transposed import (BETA_ROW, DECAY_ROW, EXP_G_ROW, GAMMA_ROW,
                                                LOG2_G_ROW, OUT_REGS, OUT_WARPS, _chain_row,
                                                _scaled_scores, _state_tile_t)
from gdn_fused.kernels.gluon_wu import _max
from gdn_fused.kernels.pdl import gl_wait_for_previous_grid

# GDN_LOOKAHEAD=1: forward_t's one-chain main launch takes this kernel
LOOKAHEAD = os.environ.get("GDN_LOOKAHEAD", "0") == "1"
# GDN_LOOKAHEAD_STATE_PASS=1: forward_t's first launch of a two-segment split (segment 0's
# state pass alone, SEG0_END) takes this kernel without the output (OUTPUT=False)
LOOKAHEAD_STATE_PASS = os.environ.get("GDN_LOOKAHEAD_STATE_PASS", "0") == "1"
KEY_SLOTS = gl.constexpr(4)
KEYS_AHEAD = gl.constexpr(2)
C_SLOTS = gl.constexpr(2)


@gluon.jit
def _load_key(k_desc, k_bufs, k_ready, k_empty, row0, k_col, i):
    """Key tile i (rows row0 + i·C) into slot i % KEY_SLOTS once its readers released it."""
    BT: gl.constexpr = k_desc.block_type.shape[0]
    KS: gl.constexpr = k_bufs.type.shape[0]
    slot = i % KS
    mbarrier.wait(k_empty.index(slot), ((i // KS) & 1) ^ 1)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + i * BT, k_col], k_ready.index(slot),
                                    k_bufs.index(slot))


@gluon.jit
def _load_ring_and_keys(descs, bufs, cols, ready, empty, row0, n, g_desc, g_bufs, g_row, g_col0,
                        k_desc, k_bufs, k_col, k_ready, k_empty):
    """The producer: chunk j's q, T, v and chain rows into main-ring stage j % STAGES, and
    the keys KEYS_AHEAD chunks ahead into their own ring (key j + KEYS_AHEAD is asked for
    before stage j, so the output warpgroup can form C_{j+1} = K_{j+1} K_{j+2}ᵀ while it
    still holds stage j)."""
    BT: gl.constexpr = descs[0].block_type.shape[0]
    STAGES: gl.constexpr = bufs[0].type.shape[0]
    nbytes: gl.constexpr = tile_bytes(descs) + g_desc.block_type.nbytes
    for i in range(gl.minimum(n, KEYS_AHEAD)):
        _load_key(k_desc, k_bufs, k_ready, k_empty, row0, k_col, i)
    for j in range(n):
        if j + KEYS_AHEAD < n:
            _load_key(k_desc, k_bufs, k_ready, k_empty, row0, k_col, j + KEYS_AHEAD)
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        for t in gl.static_range(len(descs)):
            tma.async_copy_global_to_shared(descs[t], [row0 + j * BT, cols[t]], bar,
                                            bufs[t].index(s))
        tma.async_copy_global_to_shared(g_desc, [g_row, g_col0 + j * BT], bar, g_bufs.index(s))


@gluon.jit
def _form_c(k_bufs, k_ready, c_bufs, c_ready, c_empty, i, acc: gl.constexpr):
    """C_i = K_i K_{i+1}ᵀ (bf16 [C, C]) into C tile i % C_SLOTS once the chain has read the
    one before (its step i − C_SLOTS)."""
    KS: gl.constexpr = k_bufs.type.shape[0]
    CS: gl.constexpr = c_bufs.type.shape[0]
    BT: gl.constexpr = k_bufs.type.shape[1]
    mbarrier.wait(k_ready.index(i % KS), (i // KS) & 1)
    mbarrier.wait(k_ready.index((i + 1) % KS), ((i + 1) // KS) & 1)
    c = warpgroup_mma(k_bufs.index(i % KS), k_bufs.index((i + 1) % KS).permute((1, 0)),
                      gl.zeros([BT, BT], gl.float32, acc), use_acc=False)
    mbarrier.wait(c_empty.index(i % CS), ((i // CS) & 1) ^ 1)
    c_bufs.index(i % CS).store(c.to(gl.bfloat16))
    # read by the chain's wgmma (the async proxy): fence, every warp, then the one arrive
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(c_ready.index(i % CS), count=1)


@gluon.jit
def _output_forming_c(q_bufs, k_bufs, k_ready, k_empty, g_bufs, ready, empty, c_bufs, c_ready,
                      c_empty, st_bufs, vn_bufs, sv_ready, sv_empty, o_smem, o_desc, o, scale, T,
                      c0, n, i_n, i_hv, i_v, HV: gl.constexpr, V: gl.constexpr,
                      OUTPUT: gl.constexpr = True):
    """The output warpgroup of gluon_transposed._output_partition (one group, the chain rows,
    Q in registers, the stage released after Q Kᵀ), its keys from the key ring, and before
    its chunk j the chain's C_{j+1} (C_0 first): the chain needs C_{j+1} at the end of its
    step j + 1, and this warpgroup reaches its chunk j about when the chain ends step j."""
    BT: gl.constexpr = q_bufs.type.shape[1]
    BVr: gl.constexpr = vn_bufs.type.shape[2]
    STAGES: gl.constexpr = q_bufs.type.shape[0]
    KS: gl.constexpr = k_bufs.type.shape[0]
    acc: gl.constexpr = accumulator_layout(BT)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, acc))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))
    bos = i_n * T
    col = i_hv * V + i_v * BVr
    log2_scale = gl.log2(scale)
    if n > 1:
        _form_c(k_bufs, k_ready, c_bufs, c_ready, c_empty, 0, acc)
    if not OUTPUT:
        # the state pass alone: this warpgroup only forms C, releasing each key once the
        # last C that reads it (C_j) is formed
        for j in range(n):
            if j + 2 < n:
                _form_c(k_bufs, k_ready, c_bufs, c_ready, c_empty, j + 1, acc)
            mbarrier.arrive(k_empty.index(j % KS), count=1)
        return
    for j in range(n):
        i_t = c0 + j
        s = j % STAGES
        phase = (j // STAGES) & 1
        if j + 2 < n:
            _form_c(k_bufs, k_ready, c_bufs, c_ready, c_empty, j + 1, acc)
        mbarrier.wait(ready.index(s), phase)
        mbarrier.wait(k_ready.index(j % KS), (j // KS) & 1)
        l_i = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(1, acc)) + log2_scale
        l_j = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(0, acc))
        e_G = _chain_row(g_bufs, s, EXP_G_ROW, gl.SliceLayout(1, acc)) * scale
        q_op = q_bufs.index(s).load(a_op)
        qk = warpgroup_mma(q_op, k_bufs.index(j % KS).permute((1, 0)),
                           gl.zeros([BT, BT], gl.float32, acc), use_acc=False)
        # every warp past its reads of the stage and the key before the arrives
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        mbarrier.arrive(k_empty.index(j % KS), count=1)
        p = gl.convert_layout(_scaled_scores(qk, l_i, l_j, o_t[:, None] >= o_j[None, :]), a_op)
        mbarrier.wait(sv_ready.index(s), phase)
        b_o = warpgroup_mma(q_op, st_bufs.index(s).permute((1, 0)),
                            gl.zeros([BT, BVr], gl.float32, acc), use_acc=False)
        b_o = warpgroup_mma(p, vn_bufs.index(s), b_o * e_G[:, None])
        gl.thread_barrier()
        mbarrier.arrive(sv_empty.index(s), count=1)
        out = b_o.to(o_desc.dtype)
        row = bos + i_t * BT
        if (i_t + 1) * BT <= T:
            tma.store_wait(0)
            o_smem.store(out)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [row, col], o_smem)
        else:
            # a partial chunk (a TMA box would write into the next sequence's rows)
            o_v = gl.arange(0, BVr, layout=gl.SliceLayout(0, acc))
            gl.store(o + (row + o_t).to(gl.int64)[:, None] * (HV * V) + col + o_v[None, :],
                     out, mask=(i_t * BT + o_t < T)[:, None])
    tma.store_wait(0)


@gluon.jit
def _low_half(d):
    """d − bf16(d) in fp32 (gluon_transposed._add_low_half's asm: the compiler cannot merge
    it with the caller's rounding of d)."""
    hi = gl.inline_asm_elementwise(
        "{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; cvt.f32.bf16 $0, t; }", "=f,f", [d],
        dtype=gl.float32, is_pure=True, pack=1)
    return d - hi


@gluon.jit
def _step_head(j, n, S_in, d_prev, l_prev, X, k_bufs, k_ready, k_empty, t_bufs, v_bufs, g_bufs,
               ready, st_bufs, sv_empty, c0, i_n, i_hv, i_v, checkpoints,
               HV: gl.constexpr, V: gl.constexpr, CKPT_EVERY: gl.constexpr,
               HANDOFF: gl.constexpr = True):
    """Step j up to d_j: V'_j = β (V − e^G X_j) Tᵀ issued, then (S_in, the previous step's
    update, may still run: its operands d_prev, l_prev kept live) S_j retired, h_c stored
    for the output, Z_j = bf16(γ_j S_j) K_{j+1}ᵀ issued behind V'_j, and d_j = D V'_j
    formed while Z_j runs. Returns γ_j S_j, bf16 V'_j, d_j (fp32, and bf16 as the operand of
    the update and the C product), Z_j and γ_j, all retired."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    K: gl.constexpr = k_bufs.type.shape[2]
    BVr: gl.constexpr = v_bufs.type.shape[2]
    STAGES: gl.constexpr = t_bufs.type.shape[0]
    KS: gl.constexpr = k_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)
    acc_t: gl.constexpr = accumulator_layout(BT)
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    s = j % STAGES
    phase = (j // STAGES) & 1
    cols: gl.constexpr = gl.SliceLayout(0, acc_t)
    mbarrier.wait(ready.index(s), phase)
    vv = v_bufs.index(s).permute((1, 0)).load(acc_t).to(gl.float32)
    x_op = gl.convert_layout(((vv - X * _chain_row(g_bufs, s, EXP_G_ROW, cols)[None, :])
                              * _chain_row(g_bufs, s, BETA_ROW, cols)[None, :])
                             .to(gl.bfloat16), a_t)
    vn = warpgroup_mma(x_op, t_bufs.index(s).permute((1, 0)),
                       gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False, is_async=True)
    S, d_prev, l_prev = warpgroup_mma_wait(num_outstanding=1, deps=[S_in, d_prev, l_prev])
    if j > 0:
        # the previous update has read its key; the state entering chunk c0 + j
        mbarrier.arrive(k_empty.index((j - 1) % KS), count=1)
        if CKPT_EVERY > 0:
            if (c0 + j) % CKPT_EVERY == 0:
                slab = ((c0 + j) // CKPT_EVERY - 1).to(gl.int64) * gl.num_programs(1) * K * V
                gl.store(_state_tile_t(checkpoints + slab, i_n, i_hv, i_v, HV, K, V, BVr,
                                       acc_k), S)
    if HANDOFF:
        mbarrier.wait(sv_empty.index(s), phase ^ 1)
        st_bufs.index(s).store(S.to(gl.bfloat16))  # h_c for the output warpgroup
    # γ_j S_j: Z_j's operand and the update's accumulator (the rows read late: each is 16
    # registers a thread)
    gam = _max(_chain_row(g_bufs, s, GAMMA_ROW, cols), 0)
    S = S * gam
    # (the last step's Z reads a stale key slot: discarded)
    mbarrier.wait(k_ready.index((j + 1) % KS), ((j + 1) // KS) & 1, pred=j + 1 < n)
    z_op = gl.convert_layout(S.to(gl.bfloat16), a_t)
    Z = warpgroup_mma(z_op, k_bufs.index((j + 1) % KS).permute((1, 0)),
                      gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False, is_async=True)
    vn, x_op = warpgroup_mma_wait(num_outstanding=1, deps=[vn, x_op])
    d = vn * _chain_row(g_bufs, s, DECAY_ROW, cols)[None, :]
    d_op = gl.convert_layout(d.to(gl.bfloat16), a_k)
    Z, z_op = warpgroup_mma_wait(num_outstanding=0, deps=[Z, z_op])
    return S, vn.to(gl.bfloat16), d, d_op, Z, gam


@gluon.jit
def _step_tail(j, n, LO: gl.constexpr, S, vn16, d, d_op, Z, gam, k_bufs, k_ready,
               k_empty, t_bufs, v_bufs, g_bufs, ready, empty, c_bufs, c_empty, st_bufs,
               vn_bufs, sv_ready, sv_empty, c0, i_n, i_hv, i_v, checkpoints,
               HV: gl.constexpr, V: gl.constexpr, CKPT_EVERY: gl.constexpr,
               HANDOFF: gl.constexpr = True):
    """Step j from d_j (S: γ_j S_j): X_{j+1} = Z_j + d_j C_j, then the update
    S_{j+1} = γ_j S_j + d_j K_j
    (LO: with d_j's low half in both), X_{j+1} retired first; V'_j handed to the output,
    the stage released; then, the update still running, step j + 1's head
    (:func:`_step_head`), or for the last step the update retired. Returns what the head
    returns (for the last step S_{j+1} and the rest as given)."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    K: gl.constexpr = k_bufs.type.shape[2]
    STAGES: gl.constexpr = t_bufs.type.shape[0]
    KS: gl.constexpr = k_bufs.type.shape[0]
    CS: gl.constexpr = c_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)
    acc_t: gl.constexpr = accumulator_layout(BT)
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    s = j % STAGES
    c_tile = c_bufs.index(j % CS)
    k_tile = k_bufs.index(j % KS)
    if LO:
        l_op = gl.convert_layout(_low_half(d).to(gl.bfloat16), a_k)
        X = warpgroup_mma(d_op, c_tile, Z, is_async=True)
        X = warpgroup_mma(l_op, c_tile, X, is_async=True)
        S_acc = warpgroup_mma(d_op, k_tile, S, is_async=True)
        S_acc = warpgroup_mma(l_op, k_tile, S_acc, is_async=True)
        X = warpgroup_mma_wait(num_outstanding=2, deps=[X])
    else:
        l_op = d_op
        X = warpgroup_mma(d_op, c_tile, Z, is_async=True)
        S_acc = warpgroup_mma(d_op, k_tile, S, is_async=True)
        X = warpgroup_mma_wait(num_outstanding=1, deps=[X])
    # V'_j for the output; h_c and V' are read by wgmma (the async proxy): fence, every
    # warp, then the arrives
    if HANDOFF:
        vn_bufs.index(s).permute((1, 0)).store(vn16)
    fence_async_shared()
    gl.thread_barrier()
    if HANDOFF:
        mbarrier.arrive(sv_ready.index(s), count=1)
    mbarrier.arrive(empty.index(s), count=1)
    mbarrier.arrive(c_empty.index(j % CS), count=1, pred=j + 1 < n)
    if j + 1 < n:
        S, vn16, d, d_op, Z, gam = _step_head(
            j + 1, n, S_acc, d_op, l_op, X, k_bufs, k_ready, k_empty, t_bufs, v_bufs, g_bufs,
            ready, st_bufs, sv_empty, c0, i_n, i_hv, i_v, checkpoints, HV, V, CKPT_EVERY,
            HANDOFF)
    else:
        S, d_op, l_op = warpgroup_mma_wait(num_outstanding=0, deps=[S_acc, d_op, l_op])
    return S, vn16, d, d_op, Z, gam


@gluon.jit
def _lookahead_chain(k_bufs, k_ready, k_empty, t_bufs, v_bufs, g_bufs, ready, empty, c_bufs,
                     c_ready, c_empty, st_bufs, vn_bufs, sv_ready, sv_empty, h0, ht, T, c0, n,
                     i_n, i_hv, i_v, i_seg, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                     USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr,
                     NS: gl.constexpr, checkpoints, CKPT_EVERY: gl.constexpr,
                     UPDATE_LO: gl.constexpr, LO_ABOVE: gl.constexpr,
                     HANDOFF: gl.constexpr = True, SEG0_END: gl.constexpr = False):
    """The state recurrence with X_{j+1} = Z_j + d_j C_j (module docstring), handing h_c and
    V' to the output warpgroup as gluon_transposed._chain_partition does; CKPT_EVERY > 0:
    the fp32 states entering chunks CKPT_EVERY, 2·CKPT_EVERY, … to checkpoints. The loop is
    rotated (an iteration from d_j to d_{j+1}): Gluon carries no product in flight through a
    loop or a branch, and this way the update of step j runs beside step j + 1's x operand
    and V' product, and every iteration ends with its products retired."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = v_bufs.type.shape[2]
    CS: gl.constexpr = c_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)    # S [BV, K]
    acc_t: gl.constexpr = accumulator_layout(BT)   # X, V' [BV, C]
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    seg = i_seg.to(gl.int64) * gl.num_programs(1) * K * V
    NT = gl.cdiv(T, BT)
    if USE_INITIAL_STATE:
        S = gl.load(_state_tile_t(h0 + seg, i_n, i_hv, i_v, HV, K, V, BVr, acc_k))
    else:
        S = gl.zeros([BVr, K], gl.float32, acc_k)
    if n > 0:
        # X_0 = S_0 K_0ᵀ as the shipped chain forms it, then step 0's head
        mbarrier.wait(k_ready.index(0), 0)
        s_op = gl.convert_layout(S.to(gl.bfloat16), a_t)
        X = warpgroup_mma(s_op, k_bufs.index(0).permute((1, 0)),
                          gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False)
        none = gl.convert_layout(gl.zeros([BVr, BT], gl.bfloat16, acc_t), a_k)
        S, vn16, d, d_op, Z, gam = _step_head(
            0, n, S, none, none, X, k_bufs, k_ready, k_empty, t_bufs, v_bufs, g_bufs, ready,
            st_bufs, sv_empty, c0, i_n, i_hv, i_v, checkpoints, HV, V, CKPT_EVERY, HANDOFF)
        for j in range(n):
            mbarrier.wait(c_ready.index(j % CS), (j // CS) & 1, pred=j + 1 < n)
            if UPDATE_LO:
                if gam > LO_ABOVE:
                    S, vn16, d, d_op, Z, gam = _step_tail(
                        j, n, True, S, vn16, d, d_op, Z, gam, k_bufs, k_ready, k_empty,
                        t_bufs, v_bufs, g_bufs, ready, empty, c_bufs, c_empty, st_bufs,
                        vn_bufs, sv_ready, sv_empty, c0, i_n, i_hv, i_v, checkpoints, HV, V,
                        CKPT_EVERY, HANDOFF)
                else:
                    S, vn16, d, d_op, Z, gam = _step_tail(
                        j, n, False, S, vn16, d, d_op, Z, gam, k_bufs, k_ready,
                        k_empty, t_bufs, v_bufs, g_bufs, ready, empty, c_bufs, c_empty,
                        st_bufs, vn_bufs, sv_ready, sv_empty, c0, i_n, i_hv, i_v,
                        checkpoints, HV, V, CKPT_EVERY, HANDOFF)
            else:
                S, vn16, d, d_op, Z, gam = _step_tail(
                    j, n, False, S, vn16, d, d_op, Z, gam, k_bufs, k_ready, k_empty,
                    t_bufs, v_bufs, g_bufs, ready, empty, c_bufs, c_empty, st_bufs, vn_bufs,
                    sv_ready, sv_empty, c0, i_n, i_hv, i_v, checkpoints, HV, V, CKPT_EVERY,
                    HANDOFF)
        if CKPT_EVERY > 0:
            if ((c0 + n) % CKPT_EVERY == 0) & (c0 + n < NT):
                slab = ((c0 + n) // CKPT_EVERY - 1).to(gl.int64) * gl.num_programs(1) * K * V
                gl.store(_state_tile_t(checkpoints + slab, i_n, i_hv, i_v, HV, K, V, BVr,
                                       acc_k), S)
    if SEG0_END:
        # the state entering segment 1: ht's slab 1 (gluon_transposed's SEG0_END)
        slab1 = gl.num_programs(1).to(gl.int64) * K * V
        gl.store(_state_tile_t(ht + slab1, i_n, i_hv, i_v, HV, K, V, BVr, acc_k), S)
    elif STORE_FINAL_STATE and i_seg == NS - 1:
        gl.store(_state_tile_t(ht, i_n, i_hv, i_v, HV, K, V, BVr, acc_k), S)


@gluon.jit
def forward_lookahead_kernel(q_desc, k_desc, t_desc, v_desc, o_desc, g_desc, o, h0, ht, scale,
                             T, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                             V: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                             STORE_FINAL_STATE: gl.constexpr, NS: gl.constexpr,
                             STAGES: gl.constexpr, checkpoints=None,
                             CKPT_EVERY: gl.constexpr = 0, UPDATE_LO: gl.constexpr = False,
                             LO_ABOVE: gl.constexpr = 0.5, PDL: gl.constexpr = False,
                             OUTPUT: gl.constexpr = True, SEG0_END: gl.constexpr = False):
    """Grid (V / BV, B·HV, NS): the main launch of forward_t (gluon_transposed's
    chunk_state_output_t_kernel with CHAIN_T, OUTPUT, one chain and one output group) over
    segment i_seg from h0's segment slab, with the lookahead chain (module docstring).
    t_desc: T's [C, C] tiles; v_desc: v's [C, BV]; g_desc: the [4, C] chain-row tiles."""
    if PDL:
        gl_wait_for_previous_grid()
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BVr: gl.constexpr = v_desc.block_type.shape[1]
    i_v, i_n, i_hv, i_h = ring_program(H, HV)
    i_seg = gl.program_id(2)
    NT = gl.cdiv(T, BT)
    per_seg = gl.cdiv(NT, NS)
    c0 = gl.minimum(i_seg * per_seg, NT)
    n = gl.minimum(c0 + per_seg, NT) - c0
    q_bufs = ring_buffers(q_desc, STAGES)
    t_bufs = ring_buffers(t_desc, STAGES)
    v_bufs = ring_buffers(v_desc, STAGES)
    g_bufs = ring_buffers(g_desc, STAGES)
    k_bufs = ring_buffers(k_desc, KEY_SLOTS)
    c_bufs = gl.allocate_shared_memory(gl.bfloat16, [C_SLOTS, BT, BT],
                                       gl.NVMMASharedLayout.get_default_for([BT, BT],
                                                                            gl.bfloat16))
    st_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BVr, K],
                                        gl.NVMMASharedLayout.get_default_for([BVr, K],
                                                                             gl.bfloat16))
    vn_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, BVr],
                                        gl.NVMMASharedLayout.get_default_for([BT, BVr],
                                                                             gl.bfloat16))
    o_smem = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
    # the main ring and the key ring: each read by the chain and the output warpgroup
    ready, empty = ring_barriers(STAGES, consumers=2 if OUTPUT else 1)
    k_ready, k_empty = ring_barriers(KEY_SLOTS, consumers=2)
    # the hand-offs: h_c and V' (chain → output), C_j (output → chain)
    sv_ready, sv_empty = ring_barriers(STAGES)
    c_ready, c_empty = ring_barriers(C_SLOTS)
    g_row = g_desc.block_type.shape[0] * (i_n * HV + i_hv)
    if OUTPUT:
        ring = ((q_desc, t_desc, v_desc), (q_bufs, t_bufs, v_bufs),
                (i_h * K, i_hv * BT, i_hv * V + i_v * BVr))
    else:
        ring = ((t_desc, v_desc), (t_bufs, v_bufs), (i_hv * BT, i_hv * V + i_v * BVr))
    gl.warp_specialize([
        (_lookahead_chain, (k_bufs, k_ready, k_empty, t_bufs, v_bufs, g_bufs, ready, empty,
                            c_bufs, c_ready, c_empty, st_bufs, vn_bufs, sv_ready, sv_empty, h0,
                            ht, T, c0, n, i_n, i_hv, i_v, i_seg, HV, K, V, USE_INITIAL_STATE,
                            STORE_FINAL_STATE, NS, checkpoints, CKPT_EVERY, UPDATE_LO,
                            LO_ABOVE, OUTPUT, SEG0_END)),
        (_output_forming_c, (q_bufs, k_bufs, k_ready, k_empty, g_bufs, ready, empty, c_bufs,
                             c_ready, c_empty, st_bufs, vn_bufs, sv_ready, sv_empty, o_smem,
                             o_desc, o, scale, T, c0, n, i_n, i_hv, i_v, HV, V, OUTPUT)),
        (_load_ring_and_keys, (ring[0], ring[1], ring[2], ready, empty, i_n * T + c0 * BT, n,
                               g_desc, g_bufs, g_row, c0 * BT, k_desc, k_bufs, i_h * K, k_ready,
                               k_empty)),
    ], [OUT_WARPS, LOAD_WARPS], [OUT_REGS, LOAD_REGS])
