"""kkt_solve from the keys on Hopper with four one-warp roles a program (gl.warp_specialize):
the same products as ``kkt_solve_from_k_gluon_kernel`` with two value heads a program
(HEADS = 2), spread over four warps instead of run by one.

Why: the one-warp kernel is latency-bound. ncu on the H200 (session 14, (8, 4096)): 8 one-warp
programs an SM, 0.30 eligible warps a scheduler, 24 % of issue slots used, each program's 544
mma.sync and its two substitutions one dependent chain. Its products split into independent
parts:

- K Kᵀ's ten 16 × 16 blocks (160 mma.sync, shared by the two heads) are independent: 3, 3, 2
  and 2 blocks a role;
- each head's four diagonal substitutions are independent: two blocks a role (one column of
  one block a thread, where the one-warp kernel's thread holds two columns of one block);
- the coupling blocks of T = (I + A)⁻¹ are independent **by block column**:
  T_ij = −T_ii Σ_{m=j}^{i−1} A_im T_mj reads only column j's blocks above it and the diagonal
  inverses. Column 0 (T10, T20, T30: 9 block products) is one role, columns 1 and 2 (T21, T31,
  T32: 7) another, for each head.

A role's chain is then 3 K Kᵀ blocks, 2 substitutions side by side and at most 9 products,
against 10, 2 × 4 and 2 × 16 for the one warp. Gluon asks the default partition for a multiple
of four warps: those four stage the keys and gate rows, then hand their registers to the roles
(8 warps a program, 4 programs an SM by registers). Four mbarriers order the phases, each used
once: keys staged (one arrive, from the staging partition), A staged (one from each role), and
each head's diagonal inverses written (one from each of its two roles); every arrive follows
its partition's own thread barrier (the partitions' pattern in kernels/gluon_transposed.py).

Every product is the one-warp kernel's (the same mma_v2 calls on the same operands in the same
order, the same 3×TF32 splits, the same substitution per column: gluon_kkt_solve's
``_substitute`` and ``_coupling``), so T has its bits (tests/test_kkt_solve.py). Shared
memory: the keys (16 KB at K = 128), both heads' A blocks (2 × 10 KB, not aliased into the
keys: another role may still read a key row when one stages its block), the gate rows (1.5 KB).
Measured on the H200 (session 25, docs/fused_design.md): 184 µs at (8, 4096) against 194 for
the one-warp kernel; a program's latency halved (25 → 12 µs), which is what a short sequence
waits for (fused forward (1, 2048) 83.8 → 74.8 µs), while an SM holds half the programs.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from gdn_fused.kernels.gluon_kkt_solve import (A16_OP, B16_OP, BLOCK, LOAD3, MMA, NB, ROW_SMEM,
                                               _coupling, _coupling_slot, _gated_block,
                                               _program, _stack, _staged_views, _store_diagonal,
                                               _substitute, a_staging)
from gdn_fused.kernels.pdl import gl_launch_dependents, gl_wait_for_previous_grid

NUM_ROLES = gl.constexpr(4)
# registers: the launch's cap a thread (eight warps: 65,536 / (256 · 64) = 4 programs an SM,
# shared memory would allow 5), and what setmaxnreg gives each role (the four one-warp roles
# share a warpgroup, so one count for all); the staging warpgroup keeps 2 · 64 − 88 = 40.
# ptxas (eval.ptxas): no spills at 88 (K = 128 and 256; 4 B with A unswizzled, an A/B variant,
# not the default); 36 B at 80; 8 B at 96 and 104 (the staging warps, left 32 and 24)
LAUNCH_MAXNREG = 64
ROLE_REGS = gl.constexpr(88)
# the default partition's warps (Gluon's warp_specialize asks a multiple of four): they stage
# the keys and gates, then wait with their registers handed to the roles
STAGE_WARPS = 4
# a chunk's 64 gate or β values over the staging warps' 128 threads (each value loaded and
# stored by two of them: the same value, harmless, and cheaper than a second layout)
ROWS4 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                      warps_per_cta=[STAGE_WARPS], order=[0]))
# two diagonal blocks side by side, one column a thread with its 16 rows in registers
COLUMNS2 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[2, 16, 1],
                                         warps_per_cta=[1, 1, 1], order=[2, 1, 0]))


@gluon.constexpr_function
def _key_rows_layout(ka):
    """The staging warps' coalesced load of [rows, ka] 16-bit keys: 16-byte vectors, consecutive
    lanes along a row (gluon_kkt_solve._key_layouts' load, over STAGE_WARPS warps)."""
    lanes = min(32, ka // 8)
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes, lanes],
                            warps_per_cta=[STAGE_WARPS, 1], order=[1, 0])


@gluon.jit
def _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, ib: gl.constexpr,
              jb: gl.constexpr, HV: gl.constexpr):
    """Block (ib, jb) of K Kᵀ, gated for both heads and staged where the solve reads it: the
    diagonal blocks unswizzled in a_heads[h], the coupling ones in c_heads[h]."""
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, MMA)
    rows = k_smem.slice(ib * BLOCK, BLOCK).load(A16_OP)
    kk = mma_v2(rows, k_smem.slice(jb * BLOCK, BLOCK).permute((1, 0)).load(B16_OP), zero)
    for h in gl.static_range(2):
        a = _gated_block(kk, g_rows[h], b_rows[h], row0, seqlen, ib, jb, HV, True)
        if ib == jb:
            a_heads[h].slice(ib * BLOCK, BLOCK).store(a)
        else:
            _coupling_slot(c_heads[h], ib, jb).store(a)


@gluon.jit
def _stage_keys(k, G_tile, beta_tile, row0, seqlen, key_row0, k_smem, g_rows, b_rows, bars,
                H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr):
    """The default partition (four warps): the chunk's keys and both heads' G and β rows
    into shared memory, then one arrive on bars[0]."""
    BT: gl.constexpr = NB * BLOCK
    KA: gl.constexpr = k_smem.shape[1]
    KEYS: gl.constexpr = _key_rows_layout(KA)
    o_g = gl.arange(0, BT, layout=ROWS4)
    in_seq = row0 + o_g < seqlen
    g_rows[0].store(gl.load(G_tile + o_g * HV, mask=in_seq, other=0.))
    g_rows[1].store(gl.load(G_tile + 1 + o_g * HV, mask=in_seq, other=0.))
    b_rows[0].store(gl.load(beta_tile + o_g * HV, mask=in_seq, other=0.))
    b_rows[1].store(gl.load(beta_tile + 1 + o_g * HV, mask=in_seq, other=0.))
    # the keys in slices of 8 K rows (16 registers a thread each: 32 rows at K = 128, 16 at
    # 256), for a partition that hands most of its registers to the roles
    ROWS: gl.constexpr = BT * 64 // KA
    cols = gl.arange(0, KA, layout=gl.SliceLayout(0, KEYS))
    for part in gl.static_range(BT // ROWS):
        r = part * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, KEYS))
        keys = gl.load(k + (key_row0 + r * H)[:, None] * K + cols[None, :],
                       mask=(row0 + r < seqlen)[:, None] & (cols < K)[None, :], other=0.)
        k_smem.slice(part * ROWS, ROWS).store(keys)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(0), count=1)


@gluon.jit
def _role(t_tile, row0, seqlen, k_smem, a_heads, c_heads, g_rows, b_rows, bars,
          HV: gl.constexpr, SWIZZLED: gl.constexpr, ROLE: gl.constexpr):
    """One role's part of the program (module docstring): forms its K Kᵀ blocks for both
    heads, inverts diagonal blocks 2 (ROLE % 2) and 2 (ROLE % 2) + 1 of head ROLE // 2, and
    forms that head's coupling blocks of column 0 (ROLE % 2 = 0) or of columns 1 and 2."""
    BT: gl.constexpr = NB * BLOCK
    S: gl.constexpr = HV * BT
    h: gl.constexpr = ROLE // 2
    c: gl.constexpr = ROLE % 2
    mbarrier.wait(bars.index(0), 0)  # 1. keys and gates staged (_stage_keys)
    # 2. K Kᵀ's blocks, 3 + 3 + 2 + 2, each gated for both heads
    if ROLE == 0:
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 3, 0, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 1, 0, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 0, 0, HV)
    elif ROLE == 1:
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 3, 1, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 2, 0, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 1, 1, HV)
    elif ROLE == 2:
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 3, 2, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 2, 2, HV)
    else:
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 2, 1, HV)
        _kk_block(k_smem, a_heads, c_heads, g_rows, b_rows, row0, seqlen, 3, 3, HV)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(1), count=1)
    mbarrier.wait(bars.index(1), 0)
    # 3. diagonal blocks 2c, 2c + 1 of head h, one column a thread (the one-warp kernel's thread
    #    holds two columns of one block; the same arithmetic a column)
    inv, diag, cpl = _staged_views(a_heads[h], c_heads[h], SWIZZLED)
    T3 = _substitute(_stack(a_heads[h], 2 * c, 2, False), COLUMNS2)
    gl.thread_barrier()  # this role's rows of L read before its inverses overwrite them
    inv3 = _stack(inv, 2 * c, 2, SWIZZLED)
    inv3.permute((0, 2, 1)).store(T3)
    gl.thread_barrier()
    mbarrier.arrive(bars.index(2 + h), count=1)
    t_head = t_tile + h * BT
    _store_diagonal(t_head, S, row0, seqlen, inv3.load(LOAD3), 2 * c)
    mbarrier.wait(bars.index(2 + h), 0)
    # 4. the coupling blocks of column 0, or of columns 1 and 2 (the one-warp kernel's products)
    _coupling(diag, cpl, t_head, S, row0, seqlen, c == 0, c == 1)


@gluon.jit
def kkt_solve_from_k_roles_kernel(k, G, beta, Ai, cu_seqlens, chunk_indices, T, NBH,
                                  H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                                  KA: gl.constexpr, KEYS_SMEM: gl.constexpr,
                                  IS_VARLEN: gl.constexpr,
                                  SWIZZLED: gl.constexpr = True, PDL: gl.constexpr = False):
    """kkt_solve_from_k_gluon_kernel with HEADS = 2 and STAGED_GATES, its work spread over
    four one-warp roles (module docstring). Launched with num_warps = STAGE_WARPS (the default
    partition, which stages the keys and gates) and maxnreg = LAUNCH_MAXNREG on the one-warp
    kernel's grid (NBH counts head pairs); KEYS_SMEM: the keys' shared layout
    (gluon_kkt_solve._key_layouts)."""
    if PDL:
        gl_wait_for_previous_grid()
        gl_launch_dependents()
    BT: gl.constexpr = NB * BLOCK
    i_t, i_hv, bos, seqlen = _program(T, NBH, cu_seqlens, chunk_indices, HV // 2, IS_VARLEN)
    i_hv = i_hv * 2
    i_h = i_hv // (HV // H)
    row0 = i_t * BT
    t_tile = Ai + ((bos + row0) * HV + i_hv) * BT
    G_tile = G + (bos + row0) * HV + i_hv
    beta_tile = beta + (bos + row0) * HV + i_hv
    key_row0 = (bos + row0) * H + i_h  # (int64) key row of the chunk's first token
    k_smem = gl.allocate_shared_memory(k.dtype.element_ty, [BT, KA], KEYS_SMEM)
    rows_layout: gl.constexpr = a_staging(2, False)
    flat: gl.constexpr = a_staging(2, SWIZZLED)
    a_heads = (gl.allocate_shared_memory(gl.float32, [NB * BLOCK, BLOCK], rows_layout),
               gl.allocate_shared_memory(gl.float32, [NB * BLOCK, BLOCK], rows_layout))
    c_heads = ((gl.allocate_shared_memory(gl.float32, [4 * BLOCK, BLOCK], flat),
                gl.allocate_shared_memory(gl.float32, [2 * BLOCK, BLOCK], flat)),
               (gl.allocate_shared_memory(gl.float32, [4 * BLOCK, BLOCK], flat),
                gl.allocate_shared_memory(gl.float32, [2 * BLOCK, BLOCK], flat)))
    g_rows = (gl.allocate_shared_memory(G.dtype.element_ty, [BT], ROW_SMEM),
              gl.allocate_shared_memory(G.dtype.element_ty, [BT], ROW_SMEM))
    b_rows = (gl.allocate_shared_memory(beta.dtype.element_ty, [BT], ROW_SMEM),
              gl.allocate_shared_memory(beta.dtype.element_ty, [BT], ROW_SMEM))
    # keys staged (one arrive: the staging partition), A staged (one arrive a role), head 0's
    # and head 1's diagonal inverses written (one arrive from each of its two roles)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=NUM_ROLES)
    mbarrier.init(bars.index(2), count=2)
    mbarrier.init(bars.index(3), count=2)
    gl.warp_specialize([
        (_stage_keys, (k, G_tile, beta_tile, row0, seqlen, key_row0, k_smem, g_rows, b_rows,
                       bars, H, HV, K)),
        (_role, (t_tile, row0, seqlen, k_smem, a_heads, c_heads, g_rows, b_rows, bars, HV,
                 SWIZZLED, 0)),
        (_role, (t_tile, row0, seqlen, k_smem, a_heads, c_heads, g_rows, b_rows, bars, HV,
                 SWIZZLED, 1)),
        (_role, (t_tile, row0, seqlen, k_smem, a_heads, c_heads, g_rows, b_rows, bars, HV,
                 SWIZZLED, 2)),
        (_role, (t_tile, row0, seqlen, k_smem, a_heads, c_heads, g_rows, b_rows, bars, HV,
                 SWIZZLED, 3)),
    ], [1, 1, 1, 1], [ROLE_REGS, ROLE_REGS, ROLE_REGS, ROLE_REGS])
