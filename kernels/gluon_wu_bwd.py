"""wu_bwd (kernels/wu_bwd.py) and the GVA sum of dK (kernels/group_sum.py) as one persistent,
warp-specialized Gluon kernel for Hopper (sm_90a): the same outputs (dK summed over the value
heads of each key head, dV, dβ, the per-token dg) from the same inputs, two CTAs an SM looping
over (batch row, key head, chunk) groups and in each over the key head's value heads, in each
a producer warp streaming the next item's tiles by TMA into a one-stage ring.

Why: the Triton kernel holds 252 registers a thread, two programs an SM, and runs at one stage
(its pipelined form races, wu_bwd.STAGES), so each program waits for its loads, then computes,
then stores: 1,148 µs at (1, 32768) on the H200 (session 15) against ~450 µs for its HBM
traffic (k, v, dW, dV', dK in and dK, dV out: 16 KB each a chunk and value head, T 8 KB).
Here every tile is a [64, 64] bf16 TMA box (K = V = 128 are two), a stage is 88 KB in two
transactions: v and dV' (released once dV's store has read its staging tile, dV' own slot),
then k, dW, T and dK's partial (released at the item's end). The value heads of a key head run
one after another on the CTA, so their dK is summed in shared memory (a bf16 running sum) and
stored once a key head: group_sum then only sums dQ (half its 194 µs at (1, 32768)). The
item's intermediates take the stage's slots once their tiles are read (dT's halves v's, F and
dg's terms dW's and T's: _compute), so that a CTA holds 13 tiles (104 KB, 107.6 KB with the
scratch) and two fit an SM.

Measured (H200, (1, 32768)). One CTA an SM with two stages (session 16, eval.bench --sweep
bwd): 1,000 µs in a first form (wu_bwd 1,149 in the same run), 921 with an item's gates, β
and dg partials loaded during the item before, **851** with dK's GVA sum (wu_bwd 1,159 and
group_sum of dq and dk 194 in the same run); two compute warpgroups on alternate items (a
stage each, 223 KB, 696 B of spills) took 960, and could not keep the value heads of a key
head in order: removed. (F + Fᵀ) K as one product a key half (Fᵀ read back from shared memory
into registers: 72 instead of 80 wgmma but +211 SASS instructions an item) took 894 against
845 in the same run: removed. Two CTAs an SM, one stage each (session 20,
`ab_bwd_two_ctas_2026-12-01_s20.log`): **706 µs** against 846 for the one-CTA form in the same
run ((8, 4096): 723 against 850); dK, dV, dβ the same bits, dg within 1.4e-7 of it (dg's
reverse cumsums as gluon_ring.gate_bwd_rows' transposed product, a row a token).

The math, per chunk and value head, with M1 = dW Kᵀ, M2 = dV' Vᵀ ([C, C], fp32 from bf16):

    dT   = M1 diag(β e^G) + M2 diag(β)              (= dW (diag(β e^G) K)ᵀ + dU (diag(β) V)ᵀ)
    dV   = diag(β) Tᵀ dV'
    dβ_i = e^{G_i} Σ_j T_ji M1_ji + Σ_j T_ji M2_ji   (k_i·(Tᵀ dW)_i and v_i·(Tᵀ dU)_i as [C, C]
                                                      column sums, not [C, 128] row sums)
    a_i  = β_i e^{G_i} Σ_j T_ji M1_ji               (row terms of ∂L/∂G)
    dA   = strictLower(−Tᵀ dT Tᵀ)                   (kernels/kkt_bwd.py)
    E    = dA ⊙ Γ,  dβ_i += Σ_j E_ij (k_i·k_j),  R = diag(β) (E ⊙ K Kᵀ)
    dK   = dK's partial + diag(β e^G) Tᵀ dW + F K + Fᵀ K,  F = diag(β) E   (then Σ heads)
    dg   = the partials of chunk_bwd_dqkwg + chunk_gate_bwd(a, R)

diag(β) E K + Eᵀ diag(β) K (kkt_bwd.gated_kkt_bwd_keys) is F K + Fᵀ K with one rounding of
F to bf16 (Fᵀ read from shared memory as a transposed operand, as gluon_dqkwg reads Pᵀ).
The inverse's backward runs on the tensor cores in bf16: T is bf16 already (exact), dT and
Tᵀ dT enter as high and low bf16 halves (~2⁻¹⁶ relative, finer than the Triton kernel's tf32);
dg's reverse cumsums are gluon_dqkwg's product with a constant triangular operand
(gluon_ring.gate_bwd_rows). So dK, dβ
and dg are not the Triton kernel's bits (dV, the same product and rounding, came out equal
in every comparison); tests/test_gluon_wu_bwd.py bounds both against the same math in fp64.

Scope: that of gluon_dqkwg (materialized.gluon_tiles_apply: dense batches where no chunk
straddles two sequences, K = V = 128, chunk 64, bf16) with T in bf16 (the forward's and the
backward's default). Math: flash-linear-attention's prepare_wy_repr_bwd
(fla/ops/gated_delta_rule/wy_fast.py), docs/backward.md.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import sm_count
from gdn_fused.kernels.gluon_ring import (CHUNK, HEAD_DIM, LOAD_REGS, LOAD_WARPS,
                                          accumulator_layout, bf16_halves, check_heads,
                                          check_operands, chunk_gates, decay, descriptor_layout,
                                          dg_of_rows, gate_bwd_rows, gate_bwd_stage,
                                          launch_maxnreg, ring_barriers, ring_buffers,
                                          store_bf16_halves, tile_bytes)

TILE = [CHUNK, CHUNK]  # every TMA box: 64 rows, 64 columns of 128 B (K, V = two boxes)
# Two CTAs an SM, each with one stage, as gluon_dqkwg: a second CTA's chain fills the first's
# waits; 13 tiles of 8 KB and the scratch fit the 113 KB a CTA then has
CTAS_PER_SM = 2
STAGES = 1
MAXNREG = launch_maxnreg(CTAS_PER_SM)


@gluon.jit
def _item(u, NBH, H: gl.constexpr, HV: gl.constexpr):
    """(batch row, key head, value head, chunk, r) of this CTA's u-th item: the CTA takes
    (batch row, key head, chunk) groups pid, pid + CTAs, … (batch · key heads fastest, so the
    groups in flight cover whole token rows; NBH = B·H) and in each the HV / H value heads
    r = 0, 1, … of that key head in turn, summing their dK."""
    R: gl.constexpr = HV // H
    gi = gl.program_id(0) + (u // R) * gl.num_programs(0)
    i_bh = gi % NBH
    i_h = i_bh % H
    return i_bh // H, i_h, i_h * R + u % R, gi // NBH, u % R


@gluon.jit
def _num_items(num_groups, H: gl.constexpr, HV: gl.constexpr):
    """This CTA's item count: HV / H for each of its groups."""
    return gl.cdiv(num_groups - gl.program_id(0), gl.num_programs(0)) * (HV // H)


@gluon.jit
def _producer(descs, bufs, bars, num_groups, NBH, T, H: gl.constexpr, HV: gl.constexpr,
              K: gl.constexpr, V: gl.constexpr):
    """One warp: item j's tiles into stage j % STAGES in two transactions, each once the
    compute warpgroup has released it: v and dV' (halves 2s, 2s + 1), then k, dW, dK's
    partial (halves) and T."""
    k_desc, v_desc, dw_desc, du_desc, dk_desc, t_desc = descs
    k_bufs, v_bufs, dw_bufs, du_bufs, dk_bufs, t_bufs = bufs
    ready_early, empty_early, ready_late, empty_late = bars
    BT: gl.constexpr = t_desc.block_type.shape[0]
    BH: gl.constexpr = k_desc.block_type.shape[1]
    STAGES: gl.constexpr = t_bufs.type.shape[0]
    early: gl.constexpr = 2 * tile_bytes((v_desc, du_desc))
    late: gl.constexpr = 2 * tile_bytes((k_desc, dw_desc, dk_desc)) + tile_bytes((t_desc,))
    for j in range(_num_items(num_groups, H, HV)):
        i_b, i_h, i_hv, i_t, _ = _item(j, NBH, H, HV)
        s = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        row = i_b * T + i_t * BT
        kcol = i_h * K
        mbarrier.wait(empty_early.index(s), phase)
        bar = ready_early.index(s)
        mbarrier.expect(bar, early)
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(v_desc, [row, i_hv * V + h * BH], bar,
                                            v_bufs.index(2 * s + h))
            tma.async_copy_global_to_shared(du_desc, [row, i_hv * V + h * BH], bar,
                                            du_bufs.index(2 * s + h))
        mbarrier.wait(empty_late.index(s), phase)
        bar = ready_late.index(s)
        mbarrier.expect(bar, late)
        tma.async_copy_global_to_shared(t_desc, [row, i_hv * BT], bar, t_bufs.index(s))
        for h in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [row, kcol + h * BH], bar,
                                            k_bufs.index(2 * s + h))
            tma.async_copy_global_to_shared(dw_desc, [row, i_hv * K + h * BH], bar,
                                            dw_bufs.index(2 * s + h))
            tma.async_copy_global_to_shared(dk_desc, [row, i_hv * K + h * BH], bar,
                                            dk_bufs.index(2 * s + h))


@gluon.jit
def _row_inputs(G, beta, dg_part, s_dgp, u, NBH, T, o_t, H: gl.constexpr,
                HV: gl.constexpr, NKP: gl.constexpr):
    """(valid rows, G fp64, β fp32, the sum of dg's NKP partials) of this CTA's u-th item in
    the rows' layout (two values a thread, where the columns' holds sixteen)."""
    BT: gl.constexpr = o_t.shape[0]
    i_b, _, i_hv, i_t, _ = _item(u, NBH, H, HV)
    bos = i_b * T
    valid, b_G, _ = chunk_gates(G, bos, i_t, T, o_t, HV, i_hv)
    offs = (bos + i_t * BT + o_t).to(gl.int64) * HV + i_hv
    b_beta = gl.load(beta + offs, mask=valid, other=0.).to(gl.float32)
    b_dg = gl.zeros_like(b_beta)
    for p in gl.static_range(NKP):
        b_dg += gl.load(dg_part + p * s_dgp + offs, mask=valid, other=0.)
    return valid, b_G, b_beta, b_dg


@gluon.jit
def _split(x, a_op: gl.constexpr):
    """fp32 x as bf16 high and low halves (gluon_ring.bf16_halves) in the operand layout
    ``a_op``."""
    hi, lo = bf16_halves(x)
    return gl.convert_layout(hi, a_op), gl.convert_layout(lo, a_op)


@gluon.jit
def _compute(bufs, bars, sum_tiles, dv_desc, dko_desc, G, beta, dg_part, s_dgp, dbeta, dg,
             num_groups, NBH, T, stage0, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
             V: gl.constexpr, NKP: gl.constexpr):
    """The compute warpgroup: this CTA's items j (stage j % STAGES). The stage's slots carry
    the item's intermediates once their tiles are read: dV in dV''s, dT's bf16 halves in v's,
    F in dW's first half, dg's terms (gluon_ring.gate_bwd_stage) in dW's second and T's.
    sum_tiles: the running sum of dK over the value heads of a key head before the last (bf16
    halves), then the last's sum staged for its stores."""
    k_bufs, v_bufs, dw_bufs, du_bufs, dk_bufs, t_bufs = bufs
    ready_early, empty_early, ready_late, empty_late = bars
    BT: gl.constexpr = t_bufs.type.shape[1]
    BH: gl.constexpr = k_bufs.type.shape[2]
    STAGES: gl.constexpr = t_bufs.type.shape[0]
    gl.static_assert(BT == BH, "one [64, 64] accumulator layout for every product")
    acc: gl.constexpr = accumulator_layout(BT)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    o_t = gl.arange(0, BT, layout=rows)
    o_j = gl.arange(0, BT, layout=cols)
    zero = gl.zeros([BT, BT], gl.float32, acc)
    R: gl.constexpr = HV // H
    n = _num_items(num_groups, H, HV)
    # the gates, β and dg's partials of an item are loaded during the item before (global
    # loads: their latency would otherwise follow a ring wait that found its stage full)
    valid, b_G, b_beta, b_dg = _row_inputs(G, beta, dg_part, s_dgp, 0, NBH, T, o_t, H, HV, NKP)
    for j in range(n):
        i_b, i_h, i_hv, i_t, r = _item(j, NBH, H, HV)
        # (a stage index the compiler cannot fold: see wu_bwd_gluon_kernel's stage0)
        s = j % (STAGES + stage0)
        phase = (j // STAGES) & 1
        bos = i_b * T
        row = bos + i_t * BT
        k0 = k_bufs.index(2 * s)
        k1 = k_bufs.index(2 * s + 1)
        v0 = v_bufs.index(2 * s)
        v1 = v_bufs.index(2 * s + 1)
        dw0 = dw_bufs.index(2 * s)
        dw1 = dw_bufs.index(2 * s + 1)
        du0 = du_bufs.index(2 * s)
        du1 = du_bufs.index(2 * s + 1)
        t_s = t_bufs.index(s)
        t_t = t_s.permute((1, 0))  # Tᵀ as an operand
        mbarrier.wait(ready_early.index(s), phase)
        mbarrier.wait(ready_late.index(s), phase)
        # M1 = dW Kᵀ, M2 = dV' Vᵀ, Y = Tᵀ dV' (two halves of V), in flight together
        M1 = warpgroup_mma(dw0, k0.permute((1, 0)), zero, use_acc=False, is_async=True)
        M1 = warpgroup_mma(dw1, k1.permute((1, 0)), M1, is_async=True)
        M2 = warpgroup_mma(du0, v0.permute((1, 0)), zero, use_acc=False, is_async=True)
        M2 = warpgroup_mma(du1, v1.permute((1, 0)), M2, is_async=True)
        Y0 = warpgroup_mma(t_t, du0, zero, use_acc=False, is_async=True)
        Y1 = warpgroup_mma(t_t, du1, zero, use_acc=False, is_async=True)
        KK = warpgroup_mma(k0, k0.permute((1, 0)), zero, use_acc=False, is_async=True)
        KK = warpgroup_mma(k1, k1.permute((1, 0)), KK, is_async=True)
        b_eG = decay(b_G, valid)
        b_bg = b_beta * b_eG
        M1, M2, Y0, Y1 = warpgroup_mma_wait(2, deps=[M1, M2, Y0, Y1])
        Tf = t_s.load(acc).to(gl.float32)  # T_ji: rows j, columns i
        # the row terms as column sums: Σ_j T_ji M1_ji = k_i·(Tᵀ dW)_i, and with M2 v_i·(Tᵀ dU)_i
        r1 = gl.convert_layout(gl.sum(Tf * M1, 0), rows)
        r2 = gl.convert_layout(gl.sum(Tf * M2, 0), rows)
        b_db = r1 * b_eG + r2
        b_a = r1 * b_bg
        # dV = diag(β) Tᵀ dV', staged in dV''s own slot (every warp past the products' reads)
        gl.thread_barrier()
        du0.store((Y0 * b_beta[:, None]).to(gl.bfloat16))
        du1.store((Y1 * b_beta[:, None]).to(gl.bfloat16))
        # dT (strictly lower, valid rows) as bf16 halves in v's slots (M2 has read them)
        b_bj = gl.convert_layout(b_beta, cols)
        strict = (o_t[:, None] > o_j[None, :]) & valid[:, None]
        dT = gl.where(strict, (M1 * gl.convert_layout(b_eG, cols)[None, :] + M2)
                      * b_bj[None, :], 0.)
        store_bf16_halves(dT, v0, v1)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(dv_desc, [row, i_hv * V], du0)
        tma.async_copy_shared_to_global(dv_desc, [row, i_hv * V + BH], du1)
        # Tᵀ dT, K Kᵀ and Tᵀ dW's halves (for dK; waited for at the end)
        Z = warpgroup_mma(t_t, v0, zero, use_acc=False, is_async=True)
        Z = warpgroup_mma(t_t, v1, Z, is_async=True)
        KK, Z = warpgroup_mma_wait(0, deps=[KK, Z])
        z_hi, z_lo = _split(Z, a_op)
        dA = warpgroup_mma(z_hi, t_t, zero, use_acc=False, is_async=True)
        dA = warpgroup_mma(z_lo, t_t, dA, is_async=True)
        X0 = warpgroup_mma(t_t, dw0, zero, use_acc=False, is_async=True)
        X1 = warpgroup_mma(t_t, dw1, zero, use_acc=False, is_async=True)
        # (a register operand stays live to its wait: gluon_ring.gate_bwd_rows)
        dA, z_hi, z_lo = warpgroup_mma_wait(2, deps=[dA, z_hi, z_lo])
        # v and dV' are done with once dV's stores have read their slots (and with them every
        # store before: sum_tiles' last stores too)
        tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(empty_early.index(s), count=1)
        # dA = strictLower(−Tᵀ dT Tᵀ); E = dA ⊙ Γ; the gates' pair terms R through A
        strict = (o_t[:, None] > o_j[None, :]) & valid[:, None]
        diff = (b_G[:, None] - gl.convert_layout(b_G, cols)[None, :]).to(gl.float32)
        E = gl.where(strict, -dA * gl.exp(gl.where(strict, diff, 0.)), 0.)
        Ekk = E * KK
        b_db += gl.sum(Ekk, 1)
        # F = diag(β) E once in bf16: F from registers and Fᵀ from dW's first slot, dg's terms
        # in dW's second and T's, once Tᵀ dW has read them
        F = (E * b_beta[:, None]).to(gl.bfloat16)
        f_op = gl.convert_layout(F, a_op)
        X0, X1 = warpgroup_mma_wait(0, deps=[X0, X1])
        gl.thread_barrier()
        dw0.store(F)
        gate_bwd_stage(Ekk * b_beta[:, None], b_a, dw1, t_s, o_j)
        fence_async_shared()
        gl.thread_barrier()
        dK0 = X0 * b_bg[:, None] + dk_bufs.index(2 * s).load(acc).to(gl.float32)
        dK0 = warpgroup_mma(f_op, k0, dK0, is_async=True)
        dK0 = warpgroup_mma(dw0.permute((1, 0)), k0, dK0, is_async=True)
        dK1 = X1 * b_bg[:, None] + dk_bufs.index(2 * s + 1).load(acc).to(gl.float32)
        dK1 = warpgroup_mma(f_op, k1, dK1, is_async=True)
        dK1 = warpgroup_mma(dw0.permute((1, 0)), k1, dK1, is_async=True)
        D, lt = gate_bwd_rows(dw1, t_s, o_t, o_j, valid, acc, a_op)
        n_valid, n_G, n_beta, n_dg = _row_inputs(G, beta, dg_part, s_dgp,
                                                 gl.minimum(j + 1, n - 1), NBH, T, o_t, H, HV,
                                                 NKP)
        D, dK0, dK1, f_op, lt = warpgroup_mma_wait(0, deps=[D, dK0, dK1, f_op, lt])
        # k, dW, T and dK's partial are read: every warp past them before the one arrive
        gl.thread_barrier()
        mbarrier.arrive(empty_late.index(s), count=1)
        gl.store(dg + (row + o_t).to(gl.int64) * HV + i_hv,
                 (b_dg + dg_of_rows(D, o_t, o_j)).to(dg.dtype.element_ty), mask=valid)
        gl.store(dbeta + (row + o_t).to(gl.int64) * HV + i_hv,
                 b_db.to(dbeta.dtype.element_ty), mask=valid)
        # dK summed over the key head's value heads: the running sum (bf16) kept in sum_tiles
        # until the last, whose sum is staged there and stored
        if R > 1:
            if r > 0:
                dK0 += sum_tiles.index(0).load(acc).to(gl.float32)
                dK1 += sum_tiles.index(1).load(acc).to(gl.float32)
        gl.thread_barrier()
        sum_tiles.index(0).store(dK0.to(gl.bfloat16))
        sum_tiles.index(1).store(dK1.to(gl.bfloat16))
        if r == R - 1:
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dko_desc, [row, i_h * K], sum_tiles.index(0))
            tma.async_copy_shared_to_global(dko_desc, [row, i_h * K + BH], sum_tiles.index(1))
        valid, b_G, b_beta, b_dg = n_valid, n_G, n_beta, n_dg
    tma.store_wait(0)


@gluon.jit
def wu_bwd_gluon_kernel(k_desc, v_desc, dw_desc, du_desc, dk_desc, t_desc, dv_desc, dko_desc,
                        G, beta, dg_part, s_dgp, dbeta, dg, num_groups, NBH, T, stage0,
                        H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                        NKP: gl.constexpr, STAGES: gl.constexpr):
    """Grid (CTAs,): each loops over the (batch row, key head, chunk) groups pid, pid + CTAs,
    … of num_groups (NBH = B·H), a key head's HV / H value heads in turn. stage0 is 0, passed
    at run time as gluon_dqkwg's is (a constant stage index lets LLVM hoist the operands'
    addresses out of the loop, which spills)."""
    BT: gl.constexpr = t_desc.block_type.shape[0]
    descs = (k_desc, v_desc, dw_desc, du_desc, dk_desc, t_desc)
    # k, v, dW, dV' and dK's partial as two [C, 64] halves a stage, T as one tile
    bufs = (ring_buffers(k_desc, 2 * STAGES), ring_buffers(v_desc, 2 * STAGES),
            ring_buffers(dw_desc, 2 * STAGES), ring_buffers(du_desc, 2 * STAGES),
            ring_buffers(dk_desc, 2 * STAGES), ring_buffers(t_desc, STAGES))
    sum_tiles = gl.allocate_shared_memory(t_desc.dtype, [2, BT, BT], t_desc.layout)
    ready_early, empty_early = ring_barriers(STAGES)
    ready_late, empty_late = ring_barriers(STAGES)
    bars = (ready_early, empty_early, ready_late, empty_late)
    gl.warp_specialize([
        (_compute, (bufs, bars, sum_tiles, dv_desc, dko_desc, G, beta, dg_part, s_dgp, dbeta,
                    dg, num_groups, NBH, T, stage0, H, HV, K, V, NKP)),
        (_producer, (descs, bufs, bars, num_groups, NBH, T, H, HV, K, V)),
    ], [LOAD_WARPS], [LOAD_REGS])


def wu_bwd_gluon(k, v, G, beta, Ai, dw, dv2, dk, dg_part, dg_dtype=torch.float32):
    """wu_bwd's outputs, with dK summed over the value heads of each key head (what wu_bwd and
    then group_sum give), where materialized.gluon_tiles_apply(k, v, 64, None) holds and T is
    bf16 (the caller checks).

    k [B, T, H, 128] bf16; v, dv2 (dV') [B, T, HV, 128] bf16; G [B, T, HV] fp64 (chunk_cumsum's
    chunk-local cumsum of g); beta [B, T, HV] (any float dtype); Ai [B, T, HV, 64] bf16 (T);
    dw [B, T, HV, 128] bf16; dk [B, T, HV, 128] bf16 partial (read, not written);
    dg_part [NKP, B, T, HV] fp32 per-key-block partial dg (summed here). CTAS_PER_SM CTAs an
    SM.
    Returns (dk [B, T, H, 128] bf16: the completed dK summed over each key head's HV / H value
    heads, dv like v, dbeta like beta, dg [B, T, HV] in ``dg_dtype``). The running sum is
    rounded to bf16 after each value head but the last (group_sum rounds every head's dK
    before its fp32 sum). Raises ValueError for other shapes or dtypes."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    C = CHUNK
    bf16 = torch.bfloat16
    check_heads("wu_bwd_gluon", k, v, HEAD_DIM)
    tok = (B, T, HV)
    check_operands("wu_bwd_gluon", [
        ("k", k, (B, T, H, K), bf16), ("v", v, tok + (V,), bf16), ("G", G, tok, torch.float64),
        ("beta", beta, tok, None), ("Ai", Ai, tok + (C,), bf16), ("dw", dw, tok + (K,), bf16),
        ("dv2", dv2, tok + (V,), bf16), ("dk", dk, tok + (K,), bf16),
        ("dg_part", dg_part, (dg_part.shape[0],) + tok, torch.float32)])
    k, dk, G = k.contiguous(), dk.contiguous(), G.contiguous()
    v, dw, dv2, Ai, beta, dg_part = (x.contiguous() for x in (v, dw, dv2, Ai, beta, dg_part))
    dk_sum = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg = torch.empty(beta.shape, dtype=dg_dtype, device=v.device)
    layout = descriptor_layout(TILE)
    views = (k.view(B * T, H * K), v.view(B * T, HV * V), dw.view(B * T, HV * K),
             dv2.view(B * T, HV * V), dk.view(B * T, HV * K), Ai.view(B * T, HV * C),
             dv.view(B * T, HV * V), dk_sum.view(B * T, H * K))
    descs = [TensorDescriptor.from_tensor(x, TILE, layout) for x in views]
    num_groups = B * H * triton.cdiv(T, CHUNK)
    grid = (min(num_groups, CTAS_PER_SM * sm_count(v.device)),)
    direct.launch(wu_bwd_gluon_kernel, grid, *descs, G, beta, dg_part, dg_part.stride(0), dbeta,
                  dg, num_groups, B * H, T, 0, H=H, HV=HV, K=K, V=V, NKP=dg_part.shape[0],
                  STAGES=STAGES, num_warps=4, maxnreg=MAXNREG)
    return dk_sum, dv, dbeta, dg
