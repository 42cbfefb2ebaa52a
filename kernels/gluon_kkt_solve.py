"""kkt_solve on NVIDIA GPUs (sm_80 and later) in Gluon: the blocked method of kkt_solve.py with
the register layouts chosen by hand, one warp a chunk-head tile.

Same math and the same products as ``kkt_solve_kernel`` (blocked, chunk 64): the four 16 × 16
diagonal blocks by forward substitution, side by side, then the six coupling blocks
T_ij = −T_ii Σ_m A_im T_mj as 3×TF32 tensor-core products in the same order. What changes is
where every value lives, which plain Triton does not let a kernel say:

- **One memory latency a tile.** The ten blocks of A's lower triangle (10 KB fp32; the upper
  six are never read) go into shared memory with coalesced 16-byte loads, all in flight at
  once. Read from HBM at each substitution row, the rows were 15 dependent misses.
- **Substitution with each column in one thread.** The stacked diagonal inverses are a
  [block, column, row] tile in which a thread holds two whole columns (16 rows × 2, 32
  registers). Row i of the inverse is e_i − Σ_m L_im T_m, so each thread updates its own
  columns with in-register multiply-adds, given row i of L, read whole by each thread from
  shared memory (the eight threads of a block read the same words: a broadcast). No shuffles,
  no masked row extraction; Triton's own layout for the tl kernel spreads rows over lanes, and
  each of its 14 steps pays a masked reduction and a cross-lane sum (1,624 of its 5,352 SASS
  instructions a tile, sm_90a).
- **3×TF32 split where each operand is used.** x = hi + lo with hi its TF32 truncation; a
  product is lo·hi + hi·lo + hi·hi, three mma.sync TF32 instructions (mma_v2, 16 × 8 × 8) on one
  accumulator. Operands come from shared memory straight into the mma operand layouts, and a
  product that feeds the next converts its accumulator by shuffles. ``tl.dot("tf32x3")`` spends
  ~1,750 instructions a tile on its splits; here the whole tile is 1,960 (sm_90a, 108
  registers and no spills as launched at T = 4096, per ncu; the tl kernel 5,352 at 168).
- **Heads fastest in the grid** (see :func:`_program`).

Accuracy is the tl kernel's: the dropped lo·lo and the hardware's truncation of lo stay below
2⁻²⁰ of each product term; measured 6e-8 max abs difference from the tl kernel and ≤ 2.8e-7
max abs error against fp64 at g = 0 (tests/test_kkt_solve.py, H200).

Why one warp a tile: the tiles share nothing, so the lever is tiles in flight per SM, set by
registers (108 × 32 a tile: 16 tiles an SM) and shared memory (10 KB a tile: 17), and mma.sync
works per warp (wgmma would need four warps and a 64-row M, three quarters zeros here).
Measured on the H200 (eval.bench, B=8, T=4096, HV=32, 16,384 tiles, fp32 A in, bf16 T out):
131.7 µs, 72 % of the 4.25 TB/s copy bandwidth over A read whole and T written, against
223 µs for the tl kernel and 673 µs for fla 0.6.0's solve_tril in the same process.

**From the keys** (kkt_solve_from_k_gluon_kernel, what chunk_inverse runs on these GPUs for
16-bit keys): the same solve, with A's ten lower blocks formed on chip by mma_v2 from the
chunk's keys staged in shared memory, so A never goes through HBM. Bit-equal to chunk_kkt +
this kernel on the H200; 247.4 µs at that shape against 306.2 µs for the two launches. It
stays issue-bound on its one warp: 352 mma.sync and the substitution chain a tile in series
(a version with 26 KB of shared memory a tile, 8 tiles an SM, took 264.5 µs; aliasing A's
blocks into the keys' 16 KB, 13 an SM, 247.7). Since then (docs/fused_design.md, sessions
12–14): two value heads a program (SHARED_KEYS), their gates staged (STAGED_GATES) and A's
blocks swizzled (SWIZZLED_A): 195 µs at (8, 4096), the same bits. Since session 25 (ROLES) a
program's work is spread over four one-warp roles on Hopper (kernels/gluon_kkt_roles.py): 184
µs there, and a program's latency halved, which is what a short sequence waits for.
"""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from gdn_fused.kernels import chunk_index
from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.gluon_wu import TF32_DROP, _sum
from gdn_fused.kernels.pdl import gl_launch_dependents, gl_wait_for_previous_grid, pdl_options

BLOCK = gl.constexpr(16)  # diagonal block: the substitution's 15 rows, mma_v2's M
NB = gl.constexpr(4)  # diagonal blocks of a chunk of 64
CHUNK = 64
NUM_WARPS = 1
# kkt_solve_from_k_gluon_kernel's HEADS = 2 (two value heads of one key head a program, K Kᵀ
# formed once): H200, bf16 T, H = 16, HV = 32 (session 11, docs/speed_log.md): 249 → 225 µs
# at (1, 32768) and (8, 4096), 482 → 445 at (32, 2048). With the substitution's row-0 term a
# select (session 12) both heads of a pair have one head a program's bits
# (tests/test_kkt_solve.py, test_gluon_from_k_with_shared_keys)
SHARED_KEYS = True
# kkt_solve_from_k_gluon_kernel's STAGED_GATES: each head's G and β rows of the chunk loaded once
# and staged in shared memory (+0.75 KB a head), instead of loaded from global memory by every
# block's gating (session 13; timed against each other by eval.bench --sweep kkt)
STAGED_GATES = True
# kkt_solve_from_k_gluon's ROLES: where two heads share a program, its work spread over four
# one-warp roles (kernels/gluon_kkt_roles.py, session 25), the same bits. H200, bf16 T, H = 16,
# HV = 32: the inverse alone at (8, 4096) 194 → 184 µs; the fused forward (graph) at (1, 2048)
# 83.8 → 74.8 µs (its 512 programs are under one wave: a program's latency is the time),
# (8, 4096) and (32, 2048) unchanged within noise; slower beside a state pass (the fused
# forward's split inverse: (1, 32768) 764 → 823 µs, (1, 8192) 208 → 225), which therefore
# asks for the one-warp kernel (docs/results/ab_kkt_roles_2026-12-02_s25.log)
ROLES = True

# the substitution's [block, column, row] tile: rows (dim 2) wholly in registers, 8 lanes × 2
# columns span a block's 16 columns, 4 lanes the 4 blocks
COLUMNS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 16], threads_per_warp=[4, 8, 1],
                                        warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
# coalesced loads of [n, 16, 16] blocks: 16-byte vectors, a 64-byte block row per 4 lanes
LOAD3 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 8, 4],
                                      warps_per_cta=[1, 1, 1], order=[2, 1, 0]))
# A's fp32 blocks in shared memory, [rows, 16] (and [blocks, rows, 16] views of them): rows of
# 64 bytes, whose 16-byte quarters are XOR-swizzled by (row // 2) % 4 (Triton's choice for a
# 32-bit mma operand), so that the eight rows an ldmatrix phase reads fall in eight different
# 16-byte bank groups. Unswizzled, rows r and r + 2 share banks: ncu (H200, session 14) counted
# 16-way conflicts on every operand ldmatrix and 46 % of all shared-load wavefronts excess
SWIZZLED_A = True
# a chunk's 64 gate or β values across the warp's lanes, and in shared memory
ROW_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
ROW = gl.constexpr(gl.BlockedLayout(size_per_thread=[2], threads_per_warp=[32],
                                    warps_per_cta=[1], order=[0]))


@gluon.constexpr_function
def a_staging(rank, swizzled):
    """Shared layout of A's fp32 blocks as a rank-2 [rows, 16] or rank-3 [blocks, rows, 16]
    tile (see :data:`SWIZZLED_A`); the two ranks address the same bytes alike when a block
    has a multiple of 8 rows."""
    order = list(range(rank - 1, -1, -1))
    if swizzled:
        return gl.SwizzledSharedLayout(4, 2, 4, order=order)
    return gl.SwizzledSharedLayout(1, 1, 1, order=order)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                             instr_shape=[16, 8]))
# 32-bit operands: one element per 32 bits
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=1))
# 16-bit operands (the keys of kkt_solve_from_k_gluon): two elements per 32 bits
A16_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B16_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))


@gluon.jit
def _program(T, NBH, cu_seqlens, chunk_indices, HV: gl.constexpr, IS_VARLEN: gl.constexpr):
    """(chunk index in its sequence, value head, first token row (int64), sequence length) of
    this program on a 1-D grid of chunks × NBH (= B·HV) programs, heads fastest: the Gluon
    twin of chunk_index.chunk_head_program and chunk_program (a Gluon kernel cannot call a
    tl.jit function). The programs in flight then cover whole rows of A and T (all heads of
    the same chunks, contiguous in memory) instead of one head's rows 8 KB apart. Measured on
    the H200 (eval.bench --sweep kkt, B=8, T=4096, HV=32): 131.8 µs against 149.4 µs with
    the chunks-fastest grid the tl kernels had then."""
    i_bh, i_t = gl.program_id(0) % NBH, gl.program_id(0) // NBH
    i_b, i_hv = i_bh // HV, i_bh % HV
    if IS_VARLEN:
        i_n = gl.load(chunk_indices + i_t * 2).to(gl.int32)
        i_t = gl.load(chunk_indices + i_t * 2 + 1).to(gl.int32)
        bos = gl.load(cu_seqlens + i_n).to(gl.int64)
        seqlen = (gl.load(cu_seqlens + i_n + 1).to(gl.int64) - bos).to(gl.int32)
    else:
        bos = i_b.to(gl.int64) * T
        seqlen = T
    return i_t, i_hv, bos, seqlen


@gluon.jit
def _split(x):
    """(hi, lo) of a 3×TF32 operand: hi = x with its mantissa truncated to TF32's 10 bits
    (exact in TF32), lo = x − hi (exact in fp32, |lo| < 2⁻¹⁰ |x|). Truncating instead of
    rounding saves an add a split; the dropped lo·lo and the hardware's truncation of lo stay
    below 2⁻²⁰ of each product term."""
    hi = (x.to(gl.int32, bitcast=True) & TF32_DROP).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _mma3(a, b, acc):
    """acc + a·b, fp32-accurate from split operands: lo·hi + hi·lo + hi·hi on tensor cores."""
    acc = mma_v2(a[1], b[0], acc, input_precision="tf32")
    acc = mma_v2(a[0], b[1], acc, input_precision="tf32")
    return mma_v2(a[0], b[0], acc, input_precision="tf32")


@gluon.jit
def _stack(smem, k0: gl.constexpr, n: gl.constexpr, SWIZZLED: gl.constexpr):
    """Blocks k0 .. k0 + n − 1 of a [K · 16, 16] shared tile (laid out as a_staging(2,
    SWIZZLED)) as a [n, 16, 16] view."""
    layout: gl.constexpr = a_staging(3, SWIZZLED)
    return smem.slice(k0 * BLOCK, n * BLOCK, dim=0)._reinterpret(gl.float32, [n, BLOCK, BLOCK],
                                                                 layout)


@gluon.jit
def _load_blocks(a_tile, S, row0, seqlen, k0: gl.constexpr, n: gl.constexpr,
                 diagonal: gl.constexpr):
    """[n, 16, 16] blocks of the chunk's A, coalesced: the diagonal blocks k0 .. k0 + n − 1
    (their strict lower part) or the coupling blocks k0 .. k0 + n − 1 in the order (1, 0),
    (2, 0), (2, 1), (3, 0), (3, 1), (3, 2); rows past the sequence end read as 0."""
    k = k0 + gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, LOAD3)))[:, None, None]
    r = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, LOAD3)))[None, :, None]
    c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, LOAD3)))[None, None, :]
    if diagonal:
        ib = k
        jb = k
    else:
        ib = 1 + (k >= 1).to(gl.int32) + (k >= 3).to(gl.int32)
        jb = k - ib * (ib - 1) // 2
    x = gl.load(a_tile + (ib * BLOCK + r) * S + jb * BLOCK + c,
                mask=row0 + ib * BLOCK + r < seqlen, other=0.).to(gl.float32)
    if diagonal:  # the strict lower part, selected after the load (16-byte loads)
        x = gl.where(c < r, x, 0.)
    return x


@gluon.jit
def _operand(block, layout: gl.constexpr):
    """A [16, 16] shared block loaded in an mma operand layout and split."""
    return _split(block.load(layout))


@gluon.jit
def _store(p_tile, row_stride, row0, seqlen, x, ib: gl.constexpr, jb: gl.constexpr):
    """Block (ib, jb) of the output tile from x [16, 16] (any layout), or the n diagonal
    blocks ib … ib + n − 1 from x [n, 16, 16] (jb = ib)."""
    layout: gl.constexpr = x.type.layout
    if len(x.shape) == 3:
        b = ib + gl.arange(0, x.shape[0],
                           layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
        r = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        rows = b * BLOCK + r[None, :, None]
        p = p_tile + rows * row_stride + b * BLOCK + c[None, None, :]
    else:
        r = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        c = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
        rows = ib * BLOCK + r[:, None]
        p = p_tile + rows * row_stride + (jb * BLOCK + c)[None, :]
    gl.store(p, x.to(p_tile.dtype.element_ty), mask=row0 + rows < seqlen)


@gluon.jit
def _store_diagonal(t_tile, S, row0, seqlen, x, b0: gl.constexpr):
    """Diagonal blocks b0 … b0 + n − 1 of the output tile from x [n, 16, 16] (16-byte rows
    in LOAD3), and the zero blocks to their right."""
    _store(t_tile, S, row0, seqlen, x, b0, b0)
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, gl.SliceLayout(0, LOAD3))
    for ib in gl.static_range(b0, b0 + x.shape[0]):
        for jb in gl.static_range(ib + 1, NB):
            _store(t_tile, S, row0, seqlen, zero, ib, jb)


@gluon.jit
def _as_b(x):
    """A product's result (accumulator layout) as a split B operand."""
    return _split(gl.convert_layout(x, B_OP))


@gluon.jit
def _substitute(l3, layout: gl.constexpr):
    """The inverses of the unit lower-triangular blocks I + L_b of an [n, 16, 16] shared view of
    strictly lower blocks, read a row at a time (unswizzled), as T3[b, j, m] = (I + L_b)⁻¹[m, j]
    in ``layout``, whose threads each hold whole columns j (rows m in registers): row i of the
    inverse is e_i − Σ_m L_im T_m, each thread updating its own columns with in-register
    multiply-adds, given row i of L read whole by each thread (a broadcast)."""
    n: gl.constexpr = l3.shape[0]
    oj = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    om = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]
    T3 = gl.where(oj == om, 1., gl.zeros([n, BLOCK, BLOCK], gl.float32, layout))
    for i in gl.static_range(1, BLOCK):
        # row i of every block, whole in each thread: [n, 1, 16]
        L_i = l3.slice(i, 1, dim=1).load(layout)
        # row 0 of T3 is e₀: its term is selected, not multiplied, so every add of the sum
        # has one product to contract into an fma and each copy of this solve (HEADS = 2
        # has two) compiles to the same rounding (a product of L_i0 · 1 let LLVM order the
        # first add either way: ≤ 1.9e-9 between the heads, session 11)
        terms = gl.where(om == 0, gl.where(oj == 0, L_i, 0.), L_i * T3)
        row = (oj == i).to(gl.float32) - gl.expand_dims(_sum(terms, axis=2), 2)
        T3 = gl.where(om == i, row, T3)
    return T3


@gluon.jit
def _coupling(diag, cpl, t_tile, S, row0, seqlen, COLUMN0: gl.constexpr,
              COLUMNS12: gl.constexpr):
    """The coupling blocks of T = (I + A)⁻¹ in block column 0 (T10, T20, T30: COLUMN0) and in
    block columns 1 and 2 (T21, T32, T31: COLUMNS12), from the diagonal inverses diag (four
    [16, 16] shared views, A's staging layout) and A's coupling blocks cpl (six views in
    _load_blocks' order): T_ij = −T_ii Σ_m A_im T_mj, Bunch–Hopcroft order as
    kkt_solve_kernel (first sub-diagonal, then the second and third reusing it). A block
    column reads no other column's blocks, so kernels/gluon_kkt_roles.py runs the two sets on
    separate warps; with both, the products are issued interleaved as they always were. Every
    operand is loaded (shared memory) and split where it is used, not held: registers per
    thread set the tiles in flight."""
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, MMA)
    if COLUMN0:
        T10 = -_mma3(_operand(diag[1], A_OP), _as_b(_mma3(_operand(cpl[0], A_OP),
                                                    _operand(diag[0], B_OP), zero)), zero)
        _store(t_tile, S, row0, seqlen, T10, 1, 0)
    if COLUMNS12:
        T21 = -_mma3(_operand(diag[2], A_OP), _as_b(_mma3(_operand(cpl[2], A_OP),
                                                    _operand(diag[1], B_OP), zero)), zero)
        _store(t_tile, S, row0, seqlen, T21, 2, 1)
        T32 = -_mma3(_operand(diag[3], A_OP), _as_b(_mma3(_operand(cpl[5], A_OP),
                                                    _operand(diag[2], B_OP), zero)), zero)
        _store(t_tile, S, row0, seqlen, T32, 3, 2)
    if COLUMN0:
        T10_b = _as_b(T10)
        P20 = _mma3(_operand(cpl[1], A_OP), _operand(diag[0], B_OP), zero)
        P20 = _mma3(_operand(cpl[2], A_OP), T10_b, P20)
        T20 = -_mma3(_operand(diag[2], A_OP), _as_b(P20), zero)
        _store(t_tile, S, row0, seqlen, T20, 2, 0)
    if COLUMNS12:
        P31 = _mma3(_operand(cpl[4], A_OP), _operand(diag[1], B_OP), zero)
        P31 = _mma3(_operand(cpl[5], A_OP), _as_b(T21), P31)
        T31 = -_mma3(_operand(diag[3], A_OP), _as_b(P31), zero)
        _store(t_tile, S, row0, seqlen, T31, 3, 1)
    if COLUMN0:
        P30 = _mma3(_operand(cpl[3], A_OP), _operand(diag[0], B_OP), zero)
        P30 = _mma3(_operand(cpl[4], A_OP), T10_b, P30)
        P30 = _mma3(_operand(cpl[5], A_OP), _as_b(T20), P30)
        T30 = -_mma3(_operand(diag[3], A_OP), _as_b(P30), zero)
        _store(t_tile, S, row0, seqlen, T30, 3, 0)


@gluon.jit
def _solve_staged(l3, inv3, diag, cpl, t_tile, S, row0, seqlen):
    """The blocked solve of a tile whose strictly lower A blocks are staged in shared memory:
    l3 the four diagonal ones as an unswizzled [4, 16, 16] view (its rows are read one at a
    time, which a swizzled view cannot slice), inv3 the same bytes in A's staging layout
    (a_staging(3, ·)), which the diagonal inverses overwrite, and diag those four as [16, 16]
    views of that layout (a rank-3 shared view cannot be indexed in Triton 3.6); cpl the six
    coupling ones as [16, 16] views in the order of _load_blocks. Writes T = (I + A)⁻¹ at
    t_tile (row stride S; rows from row0 past seqlen are not written)."""
    # diagonal blocks: the four side by side, each thread two columns of one
    T3 = _substitute(l3, COLUMNS)
    gl.thread_barrier()  # every row of L read before the inverses overwrite it
    # the inverses through shared memory (transposed back to [b, row, column]), where each is
    # read in the operand layouts it enters
    inv3.permute((0, 2, 1)).store(T3)
    gl.thread_barrier()
    # the diagonal blocks and the zero blocks above them go out in 16-byte rows
    _store_diagonal(t_tile, S, row0, seqlen, inv3.load(LOAD3), 0)
    _coupling(diag, cpl, t_tile, S, row0, seqlen, True, True)


@gluon.jit
def _staged_views(l_smem, c_smem, SWIZZLED: gl.constexpr):
    """(inv, diag, cpl) of a head's A staged as kkt_solve_gluon_kernel stages it: l_smem the
    four diagonal blocks stacked (unswizzled, [64, 16]), c_smem the six coupling blocks as
    4 + 2 ([64, 16], [32, 16], a_staging(2, SWIZZLED)). inv: l_smem's bytes in A's staging
    layout, which the diagonal inverses overwrite; diag: its four [16, 16] blocks; cpl: the
    coupling blocks in _load_blocks' order."""
    flat: gl.constexpr = a_staging(2, SWIZZLED)
    inv = l_smem._reinterpret(gl.float32, [NB * BLOCK, BLOCK], flat)
    diag = (inv.slice(0, BLOCK), inv.slice(BLOCK, BLOCK), inv.slice(2 * BLOCK, BLOCK),
            inv.slice(3 * BLOCK, BLOCK))
    cpl = (c_smem[0].slice(0, BLOCK), c_smem[0].slice(BLOCK, BLOCK),
           c_smem[0].slice(2 * BLOCK, BLOCK), c_smem[0].slice(3 * BLOCK, BLOCK),
           c_smem[1].slice(0, BLOCK), c_smem[1].slice(BLOCK, BLOCK))
    return inv, diag, cpl


@gluon.jit
def kkt_solve_gluon_kernel(A, Ai, cu_seqlens, chunk_indices, T, NBH, HV: gl.constexpr,
                           IS_VARLEN: gl.constexpr, SWIZZLED: gl.constexpr = SWIZZLED_A):
    BT: gl.constexpr = NB * BLOCK
    flat: gl.constexpr = a_staging(2, SWIZZLED)
    rows: gl.constexpr = a_staging(2, False)
    i_t, i_hv, bos, seqlen = _program(T, NBH, cu_seqlens, chunk_indices, HV, IS_VARLEN)
    S: gl.constexpr = HV * BT  # row stride of A and T
    row0 = i_t * BT
    # the tile's first row in int64 (bos is): row0 · S alone passes 2³¹ past 2²⁰ tokens at HV = 32
    a_tile = A + ((bos + row0) * HV + i_hv) * BT
    t_tile = Ai + ((bos + row0) * HV + i_hv) * BT

    # the ten blocks of A's lower triangle into shared memory first, all loads in flight at
    # once: one memory latency a tile instead of one per substitution row and product
    l_smem = gl.allocate_shared_memory(gl.float32, [NB * BLOCK, BLOCK], rows)
    # (the six coupling blocks as 4 + 2: shared tiles have power-of-two shapes)
    c_smem = (gl.allocate_shared_memory(gl.float32, [4 * BLOCK, BLOCK], flat),
              gl.allocate_shared_memory(gl.float32, [2 * BLOCK, BLOCK], flat))
    lower = _load_blocks(a_tile, S, row0, seqlen, 0, NB, True)
    first = _load_blocks(a_tile, S, row0, seqlen, 0, 4, False)
    rest = _load_blocks(a_tile, S, row0, seqlen, 4, 2, False)
    _stack(l_smem, 0, NB, False).store(lower)
    _stack(c_smem[0], 0, 4, SWIZZLED).store(first)
    _stack(c_smem[1], 0, 2, SWIZZLED).store(rest)
    gl.thread_barrier()
    inv, diag, cpl = _staged_views(l_smem, c_smem, SWIZZLED)
    _solve_staged(_stack(l_smem, 0, NB, False), _stack(inv, 0, NB, SWIZZLED), diag, cpl, t_tile,
                  S, row0, seqlen)


@gluon.jit
def _gated_block(acc, g_row, b_row, row0, seqlen, ib: gl.constexpr, jb: gl.constexpr,
                 HV: gl.constexpr, STAGED: gl.constexpr):
    """Block (ib, jb) of A = strictLower(diag(β)(Γ ⊙ K Kᵀ)) from its K Kᵀ block acc (MMA
    layout) and the head's G and β rows: STAGED, g_row and b_row are [64] in shared memory (0
    past the sequence end); else pointers to the head's chunk in G and β (row stride HV).
    chunk_kkt's arithmetic (the G difference in G's dtype, fp64, then exp in fp32), 0 on and
    above the diagonal and on rows past the sequence end."""
    ri = ib * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
    cj = jb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, MMA))
    valid = row0 + ri < seqlen
    if STAGED:
        G_i = g_row.slice(ib * BLOCK, BLOCK).load(gl.SliceLayout(1, MMA))
        G_j = g_row.slice(jb * BLOCK, BLOCK).load(gl.SliceLayout(0, MMA))
        b_i = b_row.slice(ib * BLOCK, BLOCK).load(gl.SliceLayout(1, MMA)).to(gl.float32)
    else:
        G_i = gl.load(g_row + ri * HV, mask=valid, other=0.)
        G_j = gl.load(g_row + cj * HV, mask=row0 + cj < seqlen, other=0.)
        b_i = gl.load(b_row + ri * HV, mask=valid, other=0.).to(gl.float32)
    mask = (ri[:, None] > cj[None, :]) & valid[:, None]
    diff = (G_i[:, None] - G_j[None, :]).to(gl.float32)
    return gl.where(mask, acc * gl.exp(gl.where(mask, diff, 0.)) * b_i[:, None], 0.)


@gluon.jit
def _coupling_slot(c_smem, ib: gl.constexpr, jb: gl.constexpr):
    """Coupling block (ib, jb) of A in the (4 + 2)-block staging of kkt_solve_gluon_kernel,
    whose order is _load_blocks': (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)."""
    c: gl.constexpr = ib * (ib - 1) // 2 + jb
    return c_smem[c // 4].slice((c % 4) * BLOCK, BLOCK)


@gluon.jit
def _staged(x):
    """x (a head's chunk of G or β, [64]) in shared memory."""
    row = gl.allocate_shared_memory(x.dtype, [x.shape[0]], ROW_SMEM)
    row.store(x)
    return row


@gluon.jit
def kkt_solve_from_k_gluon_kernel(k, G, beta, Ai, cu_seqlens, chunk_indices, T, NBH,
                                  H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                                  KA: gl.constexpr, KEYS: gl.constexpr,
                                  KEYS_SMEM: gl.constexpr, IS_VARLEN: gl.constexpr,
                                  HEADS: gl.constexpr = 1, STAGED_GATES: gl.constexpr = True,
                                  SWIZZLED: gl.constexpr = SWIZZLED_A, PDL: gl.constexpr = False):
    """kkt_solve_gluon_kernel with A formed on chip: the chunk's keys [64, K] (16-bit) go into
    shared memory once, each of the ten lower 16 × 16 blocks of K Kᵀ is one mma_v2 product
    (bf16/fp16 in, fp32 accumulate, as chunk_kkt's tl.dot), gated and scaled as chunk_kkt
    does, and staged for the solve **in the keys' own shared memory**: the fp32 blocks of
    block row ib (ib + 1 KB) overwrite key rows 16ib … 16ib + 15 (32·KA bytes ≥ 4 KB), whose
    last reader is that block row when the rows are taken in descending order and each row's
    diagonal block first. One buffer of 64·KA 16-bit values a tile (16 KB up to K = 128)
    instead of 16 + 10 KB: shared memory bounds the tiles an SM holds (H200, (1, 32768):
    264.5 µs with separate buffers, 8 tiles an SM; 247.7 µs aliased). KA = max(K, 128) key
    columns are staged (those past K as zeros), so that a block row always has room. KEYS:
    the coalesced layout of the key load; KEYS_SMEM: their shared layout
    (:func:`_key_layouts`). HEADS = 2 (:data:`SHARED_KEYS`, the default where HV / H is
    even): a program solves two adjacent value heads of one key head (NBH counts head pairs),
    each K Kᵀ block formed once and gated for both; the second head's A goes to its own 10 KB
    (as kkt_solve_gluon_kernel stages it), so 26 KB for two heads instead of 32, and 160 of a
    tile's 352 mma_v2 are shared: −10 % of the kernel's time on the H200 (session 11). Both
    heads have one head a program's bits (tests/test_kkt_solve.py) since the substitution
    selects its row-0 term instead of multiplying it by T3's exact e₀ row (session 12): with
    the product, LLVM's SLP vectorizer ordered the first add of the second head's copy the
    other way and ptxas fused the other product into the fma — round(L_i0 + round(L_i1 T_10))
    against round(L_i1 T_10 + L_i0), ≤ 1.9e-9 apart (PTX of both, session 11). STAGED_GATES
    (:data:`STAGED_GATES`): each head's G and β rows go to shared memory once (0.75 KB a head
    with fp64 G and fp32 β: 17,152 B a program for one head, 28,160 B for two, still 8 an SM
    of the H200's 228 KB at 1 KB reserved a program), where every block's gating reads them
    (session 13: 229 → 216 µs at (8, 4096), the same bits). PDL (kernels/pdl.py): wait for
    the previous grid (the cumsum) first, then let the next one (forward_t) start."""
    if PDL:
        gl_wait_for_previous_grid()
        gl_launch_dependents()
    BT: gl.constexpr = NB * BLOCK
    i_t, i_hv, bos, seqlen = _program(T, NBH, cu_seqlens, chunk_indices, HV // HEADS,
                                      IS_VARLEN)
    i_hv = i_hv * HEADS
    i_h = i_hv // (HV // H)
    S: gl.constexpr = HV * BT
    row0 = i_t * BT
    t_tile = Ai + ((bos + row0) * HV + i_hv) * BT
    G_tile = G + (bos + row0) * HV + i_hv
    beta_tile = beta + (bos + row0) * HV + i_hv

    r = gl.arange(0, BT, layout=gl.SliceLayout(1, KEYS))
    c = gl.arange(0, KA, layout=gl.SliceLayout(0, KEYS))
    keys = gl.load(k + ((bos + row0 + r) * H + i_h)[:, None] * K + c[None, :],
                   mask=(row0 + r < seqlen)[:, None] & (c < K)[None, :], other=0.)
    if STAGED_GATES:
        # each head's G and β rows, loaded once beside the keys (in flight together) and
        # staged in shared memory, where every block's gating reads them (loaded there from
        # global memory, they are 30 small loads a head behind barriers and products); rows
        # past the sequence end stage as 0, as those loads read them
        o_g = gl.arange(0, BT, layout=ROW)
        in_seq = row0 + o_g < seqlen
        g_x = gl.load(G_tile + o_g * HV, mask=in_seq, other=0.)
        b_x = gl.load(beta_tile + o_g * HV, mask=in_seq, other=0.)
        if HEADS == 2:
            g_x1 = gl.load(G_tile + 1 + o_g * HV, mask=in_seq, other=0.)
            b_x1 = gl.load(beta_tile + 1 + o_g * HV, mask=in_seq, other=0.)
    k_smem = gl.allocate_shared_memory(k.dtype.element_ty, [BT, KA], KEYS_SMEM)
    k_smem.store(keys)
    if STAGED_GATES:
        g0 = _staged(g_x)
        b0 = _staged(b_x)
        g1 = g0
        b1 = b0
        if HEADS == 2:
            g1 = _staged(g_x1)
            b1 = _staged(b_x1)
    else:
        g0 = G_tile
        b0 = beta_tile
        g1 = G_tile + 1
        b1 = beta_tile + 1
    # fp32 rows [ib·R, (ib + 1)·R) of the same bytes: block row ib's staging area, slot 0
    # (16 rows) its diagonal block, slot jb + 1 the block (ib, jb)
    R: gl.constexpr = KA // 2
    flat: gl.constexpr = a_staging(2, SWIZZLED)
    rows_layout: gl.constexpr = a_staging(2, False)
    stage = k_smem._reinterpret(gl.float32, [NB * R, BLOCK], flat)
    # the diagonal blocks of A unswizzled (the substitution reads them a row at a time)
    stage_rows = k_smem._reinterpret(gl.float32, [NB * R, BLOCK], rows_layout)
    if HEADS == 2:
        # the second head's A blocks, staged as kkt_solve_gluon_kernel stages them: the four
        # diagonal ones stacked, the six coupling ones in _load_blocks' order (4 + 2)
        l1_smem = gl.allocate_shared_memory(gl.float32, [NB * BLOCK, BLOCK], rows_layout)
        c1_smem = (gl.allocate_shared_memory(gl.float32, [4 * BLOCK, BLOCK], flat),
                   gl.allocate_shared_memory(gl.float32, [2 * BLOCK, BLOCK], flat))
    gl.thread_barrier()
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, MMA)
    for ib in gl.static_range(NB - 1, -1, -1):
        keys_ib = k_smem.slice(ib * BLOCK, BLOCK)
        rows = keys_ib.load(A16_OP)
        kk = mma_v2(rows, keys_ib.permute((1, 0)).load(B16_OP), zero)
        a = _gated_block(kk, g0, b0, row0, seqlen, ib, ib, HV, STAGED_GATES)
        if HEADS == 2:
            l1_smem.slice(ib * BLOCK, BLOCK).store(
                _gated_block(kk, g1, b1, row0, seqlen, ib, ib, HV, STAGED_GATES))
        gl.thread_barrier()  # key rows 16ib … read by every thread: free for A's blocks now
        stage_rows.slice(ib * R, BLOCK).store(a)
        for jb in gl.static_range(ib):  # key rows above 16ib: not overwritten yet
            cols = k_smem.slice(jb * BLOCK, BLOCK).permute((1, 0)).load(B16_OP)
            kk = mma_v2(rows, cols, zero)
            a = _gated_block(kk, g0, b0, row0, seqlen, ib, jb, HV, STAGED_GATES)
            stage.slice(ib * R + (jb + 1) * BLOCK, BLOCK).store(a)
            if HEADS == 2:
                _coupling_slot(c1_smem, ib, jb).store(
                    _gated_block(kk, g1, b1, row0, seqlen, ib, jb, HV, STAGED_GATES))
    gl.thread_barrier()
    cpl = (stage.slice(R + BLOCK, BLOCK), stage.slice(2 * R + BLOCK, BLOCK),
           stage.slice(2 * R + 2 * BLOCK, BLOCK), stage.slice(3 * R + BLOCK, BLOCK),
           stage.slice(3 * R + 2 * BLOCK, BLOCK), stage.slice(3 * R + 3 * BLOCK, BLOCK))
    diag = (stage.slice(0, BLOCK), stage.slice(R, BLOCK), stage.slice(2 * R, BLOCK),
            stage.slice(3 * R, BLOCK))
    l3 = k_smem._reinterpret(gl.float32, [NB, R, BLOCK], a_staging(3, False))
    inv3 = k_smem._reinterpret(gl.float32, [NB, R, BLOCK], a_staging(3, SWIZZLED))
    _solve_staged(l3.slice(0, BLOCK, dim=1), inv3.slice(0, BLOCK, dim=1), diag, cpl, t_tile, S,
                  row0, seqlen)
    if HEADS == 2:
        inv1, diag, cpl = _staged_views(l1_smem, c1_smem, SWIZZLED)
        _solve_staged(_stack(l1_smem, 0, NB, False), _stack(inv1, 0, NB, SWIZZLED), diag, cpl,
                      t_tile + BT, S, row0, seqlen)


def kkt_solve_gluon(A, output_dtype=torch.float32, cu_seqlens=None, chunk_indices=None,
                    num_chunks=None, maxnreg=None):
    """(I + A)⁻¹ per chunk of 64 on a CUDA GPU (sm_80 or later): A [B, T, HV, 64] (fp32, or
    any float dtype, computed in fp32), strictly lower (only its strict lower part is read);
    returns T [B, T, HV, 64] in ``output_dtype``. Inputs as checked by kkt_solve (call that);
    raises ValueError here for a chunk size other than 64. Packed sequences as kkt_solve
    (cu_seqlens, chunk_indices, num_chunks).
    Same values as ``kkt_solve(A, output_dtype)`` up to fp32 rounding order (the tests bound
    both against fp64). maxnreg: ptxas' register cap per thread (launch sweeps)."""
    B, T, HV, C = A.shape
    if C != CHUNK:
        raise ValueError(f"kkt_solve_gluon: chunk size (A.shape[-1]) must be {CHUNK}, got {C}")
    Ai = torch.empty(B, T, HV, C, dtype=output_dtype, device=A.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, C)
    direct.launch(kkt_solve_gluon_kernel, (NT * B * HV,), A, Ai, cu_seqlens, chunk_indices, T,
                  B * HV, HV=HV, IS_VARLEN=cu_seqlens is not None, num_warps=NUM_WARPS,
                  **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return Ai


@functools.cache  # layout objects are Python work a launch; one set a width
def _key_layouts(K):
    """(KA, KEYS, KEYS_SMEM) of kkt_solve_from_k_gluon_kernel for K key columns of 16 bits:
    the staged width max(K, 128), loads
    of 16-byte vectors with consecutive lanes along a row, and the shared tile swizzled as
    Triton swizzles mma_v2 operands (8-element vectors, 128-byte phases), so ldmatrix reads it
    without bank conflicts."""
    K = max(K, 128)
    vec = 8
    lanes_k = min(32, K // vec)
    keys = gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // lanes_k, lanes_k],
                            warps_per_cta=[NUM_WARPS, 1], order=[1, 0])
    # rows of at least 256 bytes: one row a 128-byte phase, eight phases
    smem = gl.SwizzledSharedLayout(vec, 1, 8, order=[1, 0])
    return K, keys, smem


def heads_a_program(H, HV, shared_keys=None):
    """Value heads a program of kkt_solve_from_k_gluon solves: 2 where ``shared_keys`` (None:
    :data:`SHARED_KEYS`) and HV / H is even (two value heads of one key head), else 1."""
    shared = SHARED_KEYS if shared_keys is None else shared_keys
    return 2 if shared and (HV // H) % 2 == 0 else 1


def uses_roles(device, heads, staged_gates, roles=None):
    """Whether kkt_solve_from_k_gluon launches the four-role kernel (kernels/gluon_kkt_roles.py):
    two value heads a program (``heads``), their gates staged, ``roles`` (None:
    :data:`ROLES`), and an sm_90+ GPU (its per-role register budgets are setmaxnreg, which
    earlier GPUs lack)."""
    return (heads == 2 and staged_gates and (ROLES if roles is None else bool(roles))
            and chunk_index.capability(device) >= (9, 0))


def kkt_solve_from_k_gluon(k, G, beta, num_value_heads, output_dtype=torch.float32,
                           cu_seqlens=None, chunk_indices=None, num_chunks=None, maxnreg=None,
                           shared_keys=None, staged_gates=None, swizzled=None, out=None,
                           roles=None, pdl=True):
    """T = (I + strictLower(diag(β)(Γ ⊙ K Kᵀ)))⁻¹ per chunk of 64 on a CUDA GPU (sm_80 or
    later), A formed on chip and never written: k [B, T, H, K] fp16/bf16 with K a power of two
    in [16, 256], G [B, T, HV] chunk-cumulated (fp64 from chunk_cumsum), beta [B, T, HV]; returns
    T [B, T, HV, 64] in ``output_dtype``. The same values as kkt_solve(chunk_kkt(k, G, beta))
    up to fp32 rounding order (tests/test_kkt_solve.py). Inputs as checked by
    kkt_solve.kkt_solve_from_k (call that); raises ValueError here for other key dtypes or
    widths. Packed sequences as kkt_solve_gluon; maxnreg: ptxas' register cap (launch
    sweeps); shared_keys: solve two value heads of a key head a program where HV / H is even
    (None: :data:`SHARED_KEYS`; the same bits either way, measured on the H200);
    staged_gates: G and β staged in shared memory once a chunk (None: :data:`STAGED_GATES`;
    the same values either way); swizzled: A's staged blocks swizzled (None:
    :data:`SWIZZLED_A`; the same values either way); roles: on sm_90+, where two heads share
    a program and the gates are staged, spread its work over four one-warp roles
    (kernels/gluon_kkt_roles.py, at its own register caps, so maxnreg does not apply; None:
    :data:`ROLES`; the same bits, :func:`uses_roles`); out: a contiguous [B, T, HV, 64] tensor
    of ``output_dtype`` to write T into (a view of a longer sequence's T: the fused forward
    solves its two segments' chunks in two launches), or None for a new one; pdl: False
    launches it plainly where programmatic dependent launch would apply (kernels/pdl.py)."""
    B, T, H, K = k.shape
    if k.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"kkt_solve_from_k_gluon: k must be fp16 or bf16, got {k.dtype}")
    if K < 16 or K > 256 or K & (K - 1):
        raise ValueError(f"kkt_solve_from_k_gluon: K must be a power of two in [16, 256], "
                         f"got {K}")
    HV = num_value_heads
    if out is not None and (tuple(out.shape) != (B, T, HV, CHUNK) or out.dtype != output_dtype
                            or not out.is_contiguous() or out.device != k.device):
        raise ValueError(f"kkt_solve_from_k_gluon: out must be a contiguous {output_dtype} "
                         f"{(B, T, HV, CHUNK)} on {k.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    Ai = out if out is not None else torch.empty(B, T, HV, CHUNK, dtype=output_dtype,
                                                 device=k.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, CHUNK)
    KA, keys, keys_smem = _key_layouts(K)
    heads = heads_a_program(H, HV, shared_keys)
    staged = STAGED_GATES if staged_gates is None else bool(staged_gates)
    swizzled = SWIZZLED_A if swizzled is None else bool(swizzled)
    if uses_roles(k.device, heads, staged, roles):
        from gdn_fused.kernels import gluon_kkt_roles
        direct.launch(
            gluon_kkt_roles.kkt_solve_from_k_roles_kernel, (NT * B * HV // 2,),
            k, G, beta, Ai, cu_seqlens, chunk_indices, T, B * HV // 2, H=H, HV=HV, K=K, KA=KA,
            KEYS_SMEM=keys_smem, IS_VARLEN=cu_seqlens is not None, SWIZZLED=swizzled,
            num_warps=gluon_kkt_roles.STAGE_WARPS, maxnreg=gluon_kkt_roles.LAUNCH_MAXNREG,
            **(pdl_options(k.device) if pdl else {}))
        return Ai
    direct.launch(
        kkt_solve_from_k_gluon_kernel, (NT * B * HV // heads,),
        k, G, beta, Ai, cu_seqlens, chunk_indices, T, B * HV // heads, H=H, HV=HV, K=K, KA=KA,
        KEYS=keys, KEYS_SMEM=keys_smem, IS_VARLEN=cu_seqlens is not None, HEADS=heads,
        STAGED_GATES=staged, SWIZZLED=swizzled,
        num_warps=NUM_WARPS, **({} if maxnreg is None else {"maxnreg": maxnreg}),
        **(pdl_options(k.device) if pdl else {}))
    return Ai
