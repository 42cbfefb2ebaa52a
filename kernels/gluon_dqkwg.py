"""chunk_bwd_dqkwg (kernels/chunk_bwd_dqkwg.py) as a persistent, warp-specialized Gluon kernel
for Hopper (sm_90a): the same math and outputs, two CTAs an SM looping over the work items
(key block of 64, batch · value head, chunk — chunk_index.grid_position's order, a GVA
group's value heads in turn on one CTA: HEADS_IN_TURN below), in each a producer warp
streaming the next item's tiles by TMA into a one-stage ring.

Why: the Triton kernel holds 255 registers a thread and 96 KB of shared memory, so two programs
an SM, each loading its tiles, then computing, then storing (H200, (1, 32768), session 15:
1,747–1,768 µs; its HBM traffic, h and dh 537 MB each, V', dO, dV', dq, dk, dw 268 MB each, q
and k 134 MB, is ~760 µs at the copy bandwidth). Triton 3.6's pipeliner could not overlap one
item's loads with another's products in the shared memory a program has (persistent Triton
forms: 1,988–4,732 µs, eval/bench.py). Here a stage is 96 KB (h and dh [64, 128], V', dO and
dV' [64, 128], q and k [64, 64]) in two transactions: the first five tiles are released after
the first four products, so the producer refills them while the gate terms run; q and k at the
item's end. One stage, P's tile and one staging tile: 113 KB with the scratch, so two CTAs
share an SM (228 KB, 1 KB reserved a CTA), each at 128 registers a thread at launch.

Measured (H200, (1, 32768)): one CTA an SM with two stages, session 15, **1,427 µs** against
the Triton kernel's 1,750 in the same run. Its compute warpgroup bound, not the loads: one item
took ~5.8 µs against ~3.8 µs of HBM time at the chip's bandwidth share, ~20 % of the tensor
cores' rate (2,597 SASS instructions an item, each product waited for in a chain). Earlier
forms: dg's reverse cumsums as scans, 1,874–1,900 µs; dg as a product through shared memory
after the others, 1,635; two compute warpgroups on alternate items (230 KB) 1,497 in that
form, with a wrong dg in the strong-decay case (4.4e-2) whose cause was not found then — the
stale-register miscompile below would give that symptom. Two CTAs an SM, session 20
(`ab_dqkwg_two_ctas_2026-12-01_s20.log`): **1,177 µs** against 1,425 for the one-CTA form in
the same run ((8, 4096): 1,175 against 1,418); dq, dk, dw the same bits, dg within 4.6e-7 of
it (dg's sum is ordered differently: below). The second CTA's chain fills the first's waits.

Per item the compute warpgroup runs:

    dW = −dV' hᵀ, dQ = dO hᵀ, dK = V' dhᵀ, dM = dO V'ᵀ   in flight together (⟨h, dh⟩
                                meanwhile); dW stored at once (TMA); h, dh, V', dO, dV'
                                released
    Q Kᵀ, the gate terms        as chunk_bwd_dqkwg (kernels/chunk_gate_bwd.py's scheme)
    dQ += P K, dK += Pᵀ Q       P = scale · dM ⊙ Γ (dK's product reads it transposed from
                                shared memory)
    D'ᵀ = L'ᵀ Z'ᵀ               dg's reverse cumsums as one product with Z' staged in q's and
                                k's tiles (gluon_ring.gate_bwd_rows: dg comes out a row a
                                token, where the one-CTA form's column sums took 1 KB of
                                scratch to add across warps); dQ and dK stored (TMA) meanwhile;
                                then q and k released and dg (this key block's partial, fp32)
                                stored.

A miscompile met on the way (session 20, `dbg_dqkwg_dg_rows_2026-12-01_s20.log`): with L'ᵀ a
constant, ptxas set one register of it, the same in every thread, after the first wgmma that
reads it, so each CTA's first item took rows 8–15 of every warp's slab of dg from a stale
register. L'ᵀ is masked by the rows' validity now (not a constant), and eval.ptxas counts
such writes in every kernel's SASS (register_operand_hazards; tests/test_ptxas.py checks this
kernel, its shared memory and its registers).

A GVA group's value heads in turn (HEADS_IN_TURN, session 29): a CTA takes a unit (key block,
batch row, q/k head, chunk) and runs the HV / H items of its value heads one after the other,
so that the q and k tiles it loads again for each are the ones just read (L2), where the
items of one unit used to go to HV / H different CTAs. Its loops also spill less (ptxas: 80
against 128 bytes). Measured: fwd + bwd −2.2 % at (1, 32768) (HEADS_IN_TURN). What did not
pay: dQ summed over the group in the kernel (a bf16 running sum in registers, stored once,
instead of per value head and group_sum's 92 µs pass at (1, 32768)): fwd+bwd 3,892 → 4,073
µs at (1, 32768) and 3,695 → 3,835 at (8, 4096) (H200, graph,
ab_dq_group_sum_2026-12-02_s29.log): the sum's registers, live across a whole item, took the
compute warpgroup to 200 bytes of spills and it ran slower by more than the pass it saved
(in fp32: 376 bytes).

Scope: dense batches where no chunk straddles two sequences (B = 1 or T a multiple of 64: a
TMA tile past a sequence's end reads the next one's rows, which only zero weights would keep
out), K = V = 128, chunk 64, bf16. Math: the chunkwise Gated DeltaNet backward (docs/
backward.md; flash-linear-attention's chunk_bwd_dqkwg for dq, dk, dw).
"""
import os

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
                                          accumulator_layout, check_heads, check_operands,
                                          chunk_gates, decay, descriptor_layout, dg_of_rows,
                                          gate_bwd_rows, gate_bwd_stage, launch_maxnreg,
                                          ring_barriers, ring_buffers, tile_bytes)

BLOCK_K = 64  # key columns an item: wgmma's N for dq, dk, dw (the chunk's 64 for dM, Q Kᵀ)
# Two CTAs an SM, each with one stage: the compute warpgroup's chain of waits binds (one CTA
# an SM ran its items at ~20 % of the tensor cores' rate), so a second CTA's chain fills its
# gaps. Each then fits 113 KB of shared memory (228 KB an SM, 1 KB reserved a CTA) and 128
# registers a thread at launch (the compute warpgroup raises its own to 232 as the producer
# lowers its to LOAD_REGS: setmaxnreg).
CTAS_PER_SM = 2
STAGES = 1
# TMA block of each descriptor: h, dh [BK, V] rows of the [NT·HV·K, V] states; V', dO, dV'
# [C, V]; q, k and the outputs [C, BK]
DESCRIPTOR_BLOCKS = dict(h=[BLOCK_K, HEAD_DIM], dh=[BLOCK_K, HEAD_DIM], v_new=[CHUNK, HEAD_DIM],
                         do=[CHUNK, HEAD_DIM], dv2=[CHUNK, HEAD_DIM], q=[CHUNK, BLOCK_K],
                         k=[CHUNK, BLOCK_K], dq=[CHUNK, BLOCK_K], dk=[CHUNK, BLOCK_K],
                         dw=[CHUNK, BLOCK_K])
MAXNREG = launch_maxnreg(CTAS_PER_SM)
# a unit's value heads in turn on one CTA (module docstring, session 29); False: the items
# spread over the CTAs one value head each, as before (A/B). H200, fused fwd + bwd as a graph,
# the same bits (ab_dqkwg_heads_in_turn_2026-12-02_s29.log): (1, 32768) 3,964 → 3,879 µs,
# (8, 4096) 3,733 → 3,682
HEADS_IN_TURN = os.environ.get("GDN_DQKWG_HEADS_IN_TURN", "1") != "0"


@gluon.jit
def _unit(unit, NBH, UH: gl.constexpr, NK: gl.constexpr):
    """(key block, batch row, head, chunk) of work unit ``unit`` (grid_position's order: key
    blocks fastest, then batch · heads, so the units in flight cover whole token rows); NBH =
    B·UH, UH the q/k heads (a unit the items of a head's GVA group in turn) or the value
    heads (a unit one item)."""
    i_bh = unit // NK % NBH
    return unit % NK, i_bh // UH, i_bh % UH, unit // (NK * NBH)


@gluon.jit
def _producer(descs, bufs, bars, num_units, NBH, T, NT, H: gl.constexpr, HV: gl.constexpr,
              K: gl.constexpr, V: gl.constexpr, UH: gl.constexpr):
    """One warp: item j's tiles into stage j % STAGES, in two transactions: h, dh, V', dO, dV'
    once the compute warpgroup has released them (after its first products), q and k once it
    has released those (after its last). The first STAGES waits of each pass at once. Items
    come a unit at a time, its value heads in turn (q and k loaded again for each: the stage
    would have to outlive the item to keep them)."""
    h_desc, dh_desc, vn_desc, do_desc, dv_desc, q_desc, k_desc = descs
    ready_big, empty_big, ready_small, empty_small = bars
    BK: gl.constexpr = h_desc.block_type.shape[0]
    BT: gl.constexpr = vn_desc.block_type.shape[0]
    STAGES: gl.constexpr = bufs[0].type.shape[0]
    big: gl.constexpr = tile_bytes((h_desc, dh_desc, vn_desc, do_desc, dv_desc))
    small: gl.constexpr = tile_bytes((q_desc, k_desc))
    GROUP: gl.constexpr = HV // UH
    j = 0
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        i_k, i_b, i_u, i_t = _unit(unit, NBH, UH, K // BK)
        row = i_b * T + i_t * BT
        for g in range(GROUP):
            i_hv = i_u * GROUP + g
            kcol = (i_hv // (HV // H)) * K + i_k * BK
            s = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1
            srow = ((i_b * NT + i_t) * HV + i_hv) * K + i_k * BK
            mbarrier.wait(empty_big.index(s), phase)
            bar = ready_big.index(s)
            mbarrier.expect(bar, big)
            tma.async_copy_global_to_shared(h_desc, [srow, 0], bar, bufs[0].index(s))
            tma.async_copy_global_to_shared(dh_desc, [srow, 0], bar, bufs[1].index(s))
            tma.async_copy_global_to_shared(vn_desc, [row, i_hv * V], bar, bufs[2].index(s))
            tma.async_copy_global_to_shared(do_desc, [row, i_hv * V], bar, bufs[3].index(s))
            tma.async_copy_global_to_shared(dv_desc, [row, i_hv * V], bar, bufs[4].index(s))
            mbarrier.wait(empty_small.index(s), phase)
            bar = ready_small.index(s)
            mbarrier.expect(bar, small)
            tma.async_copy_global_to_shared(q_desc, [row, kcol], bar, bufs[5].index(s))
            tma.async_copy_global_to_shared(k_desc, [row, kcol], bar, bufs[6].index(s))
            j += 1


@gluon.jit
def _compute(bufs, bars, p_tile, o_tile, dq_desc, dk_desc, dw_desc, G, dg, s_dg, scale,
             num_units, NBH, T, stage0, HV: gl.constexpr, K: gl.constexpr, UH: gl.constexpr):
    """The compute warpgroup: this CTA's items j (stage j % STAGES), a unit's value heads in
    turn; p_tile: P, then dQ's staging tile; o_tile: dW's, then dK's staging tile."""
    h_bufs, dh_bufs, vn_bufs, do_bufs, dv_bufs, q_bufs, k_bufs = bufs
    ready_big, empty_big, ready_small, empty_small = bars
    BT: gl.constexpr = vn_bufs.type.shape[1]
    BK: gl.constexpr = q_bufs.type.shape[2]
    STAGES: gl.constexpr = h_bufs.type.shape[0]
    gl.static_assert(BT == BK, "one [64, 64] accumulator layout for dq, dk, dw, dM and Q Kᵀ")
    acc: gl.constexpr = accumulator_layout(BK)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    rows: gl.constexpr = gl.SliceLayout(1, acc)
    cols: gl.constexpr = gl.SliceLayout(0, acc)
    # h and dh read for ⟨h, dh⟩: 16-byte runs of a row a thread
    hl: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    o_t = gl.arange(0, BT, layout=rows)
    o_j = gl.arange(0, BT, layout=cols)
    zero = gl.zeros([BT, BK], gl.float32, acc)
    GROUP: gl.constexpr = HV // UH
    j = 0
    for unit in range(gl.program_id(0), num_units, gl.num_programs(0)):
        i_k, i_b, i_u, i_t = _unit(unit, NBH, UH, K // BK)
        bos = i_b * T
        row = bos + i_t * BT
        for g in range(GROUP):
            i_hv = i_u * GROUP + g
            s = j % (STAGES + stage0)
            phase = (j // STAGES) & 1
            col = i_hv * K + i_k * BK
            # the gates first: their global-load latency overlaps the wait for the stage
            valid, b_G, G_last = chunk_gates(G, bos, i_t, T, o_t, HV, i_hv)
            b_Gj = gl.convert_layout(b_G, cols)
            mbarrier.wait(ready_big.index(s), phase)
            # dW = −dV' hᵀ with the next three products in flight (dW first, then stored, in a
            # serial form: 1,635 against 1,427 µs with dg's product also serial)
            b_dw = warpgroup_mma(dv_bufs.index(s), h_bufs.index(s).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            b_dq = warpgroup_mma(do_bufs.index(s), h_bufs.index(s).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            b_dk = warpgroup_mma(vn_bufs.index(s), dh_bufs.index(s).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            b_dM = warpgroup_mma(do_bufs.index(s), vn_bufs.index(s).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            # ⟨h, dh⟩ over this key block while the products run
            hdh = gl.sum(gl.sum(h_bufs.index(s).load(hl).to(gl.float32)
                                * dh_bufs.index(s).load(hl).to(gl.float32), 1), 0)
            b_dw, b_dq, b_dk, b_dM = warpgroup_mma_wait(0, deps=[b_dw, b_dq, b_dk, b_dM])
            # dW stored at once: the staging tile's last store (the previous item's dK) must have
            # read it (the wait is for that read)
            tma.store_wait(0)
            gl.thread_barrier()
            o_tile.store((-b_dw).to(gl.bfloat16))
            fence_async_shared()
            # h, dh, V', dO, dV' are read: every warp past them (and past dW's staging), then the
            # one arrive lets the producer refill them with the next item while this one's gate
            # terms run
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dw_desc, [row, col], o_tile)
            mbarrier.arrive(empty_big.index(s), count=1)
            mbarrier.wait(ready_small.index(s), phase)
            b_qk = warpgroup_mma(q_bufs.index(s), k_bufs.index(s).permute((1, 0)), zero,
                                 use_acc=False, is_async=True)
            kf = k_bufs.index(s).load(acc).to(gl.float32)
            qf = q_bufs.index(s).load(acc).to(gl.float32)
            last = gl.minimum(BT, T - i_t * BT) - 1
            # through the state leaving the chunk: e^{G_C} ⟨h, dh⟩ (a row term of G_C) and the
            # keys decayed by e^{G_C − G_j} (pair terms (C, j), j < C)
            b_dk = b_dk * decay(G_last - b_G, valid)[:, None]
            b_a = gl.where(o_t == last, hdh * gl.exp(G_last.to(gl.float32)), 0.)
            zk = gl.convert_layout(gl.sum(b_dk * kf, 1), cols)
            b_Z = gl.where((o_t[:, None] == last) & (o_j[None, :] < last), zk[None, :], 0.)
            # through the inter-chunk output term scale·e^{G_i} q_i h: row terms
            b_dq = b_dq * (scale * decay(b_G, valid))[:, None]
            b_a += gl.sum(b_dq * qf, 1)
            # through the intra-chunk output term: pair terms P_ij q_i·k_j below the diagonal
            incl = (o_t[:, None] >= o_j[None, :]) & valid[:, None]
            diff = (b_G[:, None] - b_Gj[None, :]).to(gl.float32)
            b_P = b_dM * scale * gl.where(incl, gl.exp(gl.where(incl, diff, 0.)), 0.)
            b_qk = warpgroup_mma_wait(0, deps=[b_qk])
            b_Z += gl.where(o_t[:, None] > o_j[None, :], b_P * b_qk, 0.)
            p16 = b_P.to(gl.bfloat16)
            p_tile.store(p16)
            fence_async_shared()
            gl.thread_barrier()
            p_op = gl.convert_layout(p16, a_op)
            b_dq = warpgroup_mma(p_op, k_bufs.index(s), b_dq, is_async=True)
            b_dk = warpgroup_mma(p_tile.permute((1, 0)), q_bufs.index(s), b_dk, is_async=True)
            # (a register operand stays live to the wait: gluon_ring.gate_bwd_rows)
            b_dq, b_dk, p_op = warpgroup_mma_wait(0, deps=[b_dq, b_dk, p_op])
            # q, k and P read by every warp: dg's terms into q's and k's tiles (gluon_ring.
            # gate_bwd_rows: dg a row a token, no sum across warps); dW's staging tile free for dK
            # once its store has read it
            gl.thread_barrier()
            gate_bwd_stage(b_Z, b_a, q_bufs.index(s), k_bufs.index(s), o_j)
            tma.store_wait(0)
            fence_async_shared()
            gl.thread_barrier()
            D, lt = gate_bwd_rows(q_bufs.index(s), k_bufs.index(s), o_t, o_j, valid, acc,
                                  a_op)
            # dQ staged in P's tile, dK in dW's, stored while dg's product runs
            p_tile.store(b_dq.to(gl.bfloat16))
            o_tile.store(b_dk.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(dq_desc, [row, col], p_tile)
            tma.async_copy_shared_to_global(dk_desc, [row, col], o_tile)
            D, lt = warpgroup_mma_wait(0, deps=[D, lt])
            # every warp past its reads of q's and k's tiles before the one arrive
            gl.thread_barrier()
            mbarrier.arrive(empty_small.index(s), count=1)
            gl.store(dg + i_k * s_dg + (row + o_t).to(gl.int64) * HV + i_hv,
                     dg_of_rows(D, o_t, o_j), mask=i_t * BT + o_t < T)
            j += 1
    tma.store_wait(0)


@gluon.jit
def chunk_bwd_dqkwg_gluon_kernel(h_desc, dh_desc, vn_desc, do_desc, dv_desc, q_desc, k_desc,
                                 dq_desc, dk_desc, dw_desc, G, dg, s_dg, scale, num_units, NBH,
                                 T, stage0, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                                 V: gl.constexpr, STAGES: gl.constexpr,
                                 UH: gl.constexpr):
    """Grid (CTAs,): each loops over units pid, pid + CTAs, … of num_units (NBH = B·UH), a
    unit's HV / UH value heads in turn (UH: H with HEADS_IN_TURN, else HV).
    stage0 is 0, passed at run time so that the compute warpgroup's stage index j % (STAGES +
    stage0) stays a computation in the item loop: with one stage a constant index lets LLVM
    hoist every operand's address and wgmma descriptor out of it, which spills (eval.ptxas:
    368 against 104 bytes of spill stores)."""
    BT: gl.constexpr = vn_desc.block_type.shape[0]
    BK: gl.constexpr = q_desc.block_type.shape[1]
    descs = (h_desc, dh_desc, vn_desc, do_desc, dv_desc, q_desc, k_desc)
    bufs = (ring_buffers(h_desc, STAGES), ring_buffers(dh_desc, STAGES),
            ring_buffers(vn_desc, STAGES), ring_buffers(do_desc, STAGES),
            ring_buffers(dv_desc, STAGES), ring_buffers(q_desc, STAGES),
            ring_buffers(k_desc, STAGES))
    # P's tile (read transposed by dK's product, then dQ's staging tile) and dW's staging tile
    # (then dK's); dg's terms go into q's and k's tiles: the ring, these two and the scratch
    # take 112.6 KB of the 113 a CTA has at two an SM
    gl.static_assert(BT == BK, "P's tile stages dQ")
    p_tile = gl.allocate_shared_memory(dq_desc.dtype, [BT, BK], dq_desc.layout)
    o_tile = gl.allocate_shared_memory(dq_desc.dtype, [BT, BK], dq_desc.layout)
    ready_big, empty_big = ring_barriers(STAGES)
    ready_small, empty_small = ring_barriers(STAGES)
    bars = (ready_big, empty_big, ready_small, empty_small)
    gl.warp_specialize([
        (_compute, (bufs, bars, p_tile, o_tile, dq_desc, dk_desc, dw_desc, G, dg, s_dg,
                    scale, num_units, NBH, T, stage0, HV, K, UH)),
        (_producer, (descs, bufs, bars, num_units, NBH, T, gl.cdiv(T, BT), H, HV, K, V,
                     UH)),
    ], [LOAD_WARPS], [LOAD_REGS])


def chunk_bwd_dqkwg_gluon(q, k, v_new, h, dh, G, do, dv2, scale):
    """chunk_bwd_dqkwg's outputs where materialized.gluon_tiles_apply(q, do, 64, None) holds
    (an NVIDIA sm_90 GPU, bf16, K = V = 128, chunk 64, a dense batch in which no chunk
    straddles two sequences; the caller checks).

    q, k [B, T, H, 128] bf16; v_new, do, dv2 [B, T, HV, 128] bf16; h, dh [B·NT, HV, 128, 128]
    bf16; G [B, T, HV] fp64 (chunk_cumsum's chunk-local cumsum of g); scale a float.
    CTAS_PER_SM CTAs an SM. Returns (dq, dk, dw [B, T, HV, 128] bf16, dg [2, B, T, HV] fp32:
    per key block of 64, partial), as chunk_bwd_dqkwg with its default key blocks. Raises
    ValueError for other shapes or dtypes."""
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    NT = triton.cdiv(T, CHUNK)
    bf16 = torch.bfloat16
    check_heads("chunk_bwd_dqkwg_gluon", q, do, HEAD_DIM)
    tok = (B, T, HV, V)
    check_operands("chunk_bwd_dqkwg_gluon", [
        ("q", q, q.shape, bf16), ("k", k, q.shape, bf16), ("v_new", v_new, tok, bf16),
        ("h", h, (B * NT, HV, K, V), bf16), ("dh", dh, (B * NT, HV, K, V), bf16),
        ("G", G, (B, T, HV), torch.float64), ("do", do, tok, bf16), ("dv2", dv2, tok, bf16)])
    q, k, v_new, do, dv2, h, dh = (x.contiguous() for x in (q, k, v_new, do, dv2, h, dh))
    dq = torch.empty(B, T, HV, K, dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dw = torch.empty_like(dq)
    NK = K // BLOCK_K
    dg = torch.empty(NK, B, T, HV, dtype=torch.float32, device=q.device)
    views = dict(h=h.view(B * NT * HV * K, V), dh=dh.view(B * NT * HV * K, V),
                 v_new=v_new.view(B * T, HV * V), do=do.view(B * T, HV * V),
                 dv2=dv2.view(B * T, HV * V), q=q.view(B * T, H * K), k=k.view(B * T, H * K),
                 dq=dq.view(B * T, HV * K), dk=dk.view(B * T, HV * K), dw=dw.view(B * T, HV * K))
    descs = [TensorDescriptor.from_tensor(x, DESCRIPTOR_BLOCKS[n],
                                          descriptor_layout(DESCRIPTOR_BLOCKS[n]))
             for n, x in views.items()]
    UH = H if HEADS_IN_TURN else HV
    num_units = NK * B * UH * NT
    grid = (min(num_units, CTAS_PER_SM * sm_count(q.device)),)
    direct.launch(chunk_bwd_dqkwg_gluon_kernel, grid, *descs, G, dg, dg.stride(0),
                  float(scale), num_units, B * UH, T, 0, H=H, HV=HV, K=K, V=V, STAGES=STAGES,
                  UH=UH, num_warps=4, maxnreg=MAXNREG)
    return dq, dk, dw, dg
