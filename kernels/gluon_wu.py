"""Experimental: the chunk-parallel half of the materialized forward — kkt_solve_from_k followed
by recompute_w_u — as one Gluon kernel for Hopper (sm_90a). Not wired into any backend; it is
compile-verified on a CPU (eval.ptxas) and meant to be checked on a GPU against
``recompute_w_u(k, v, G, beta, kkt_solve_from_k(k, G, beta, HV, 64))``.

Per chunk of C = 64 tokens and value head, with G the chunk-cumulated log-decay:

    A = strictLower(diag(β)(Γ ⊙ K Kᵀ)),  Γ_ij = e^{G_i − G_j}     (fp32)
    T = (I + A)⁻¹                                                 (fp32, never leaves the SM)
    W = T diag(β e^G) K,   U = T diag(β) V                        (bf16 products, fp32 sums)

so the kernel reads k, v, G, β once and writes w, u once: neither A nor T goes to HBM (the
Triton pair writes T as fp32 or bf16 and reads it back, plus a launch).

The inverse (seed 000, the kkt_solve article; seed 001, Table 2 "blocked", which is what
kkt_solve.py runs), all in fp32:

- The four 16 × 16 diagonal blocks by forward substitution, side by side, one warp each (the
  wgmma accumulator gives warp w rows 16w..16w+15 anyway): A goes through an fp32 scratch tile
  in shared memory into a stacked [4, 16, 16] register tile, 8 registers a thread.
- The first merge (16 → 32), T_{b,b−1} = −T_bb A_{b,b−1} T_{b−1,b−1} for odd b, in the same
  stacked tile on CUDA cores in exact fp32 (16 rank-1 updates a product; T_{b−1,b−1} comes
  from the neighbouring warp through a small shared buffer). As 64-row wgmmas these two
  products would be 3/4 zeros.
- The second merge (32 → 64) changes only the lower-left 32 × 32 block,
  T_LL = −T_BB (A_LL T_AA): two 64 × 32 × 32 warpgroup MMAs (the wgmma M is 64; the upper 32
  rows are zeros) in 3×TF32. Gluon 3.6 has no tf32x3 for ``warpgroup_mma`` (its pipeline lacks
  Triton's F32DotTC pass, which splits ``tl.dot``'s "tf32x3"), so each operand is split here
  into hi = x rounded to TF32 (exact in TF32) and lo = x − hi (exact in fp32), and a product is
  lo·hi + hi·lo + hi·hi, three TF32 wgmmas (K steps of 8): the first operand from registers,
  the second from shared memory, stored K-major (transposed NVMMA layout), which TF32 wgmma
  requires. The dropped lo·lo and the hardware's truncation of lo leave at most ~2⁻²¹ |x| per
  operand, as kkt_solve's "tf32x3" (measured there: 2.2e-8 max abs change vs exact fp32).
- These are kkt_solve's coupling products in Bunch–Hopcroft order (seed 001 §3.3), not
  Cayley–Hamilton / MXR squaring, which the seed paper shows unstable.

Error: the whole inverse, modelled bit for bit in PyTorch (tests/test_gluon_wu.py), is 2e-8
relative to the fp64 inverse at g = 0 (the least damped A) and 5e-10 at logsigmoid gates, the
same as an fp32 triangular solve (single-pass TF32 in the second merge would give 1e-4). T is
then rounded to bf16 for W and U, as recompute_w_u rounds it, so against the Triton pair the
expected difference is a few bf16 rounding flips of T and the products' summation order:
relative error ~1e-3 or below on w and u.

Why one program per (chunk, value head), no producer warp: every chunk is independent and each
tile is used once, so there is no ring to keep full. The two TMA loads (k, then v) are issued
at the program's start on their own mbarriers, and v arrives while K Kᵀ and the inverse run;
latency between programs is hidden by occupancy — three programs an SM (registers and shared
memory below) — instead of a persistent loop with a TMA producer warp, which would add the
ring's handshake for no reuse. The serial part of a program (14 substitution steps, 32 rank-1
updates) is what the other resident programs overlap. Tensor work a chunk: K Kᵀ, W and U in
bf16 (1.6 M multiply-adds), the two 3×TF32 products (0.4 M): ~0.6 µs of an H200 SM at peak,
against 64 KB of HBM traffic (1.8 µs of an SM's share of the bandwidth), so the kernel should
be memory-bound if the resident programs hide the serial steps; the GPU benchmark
(eval.bench stages) decides.

Shared memory: k and v tiles [64, 128] bf16 (16 KB each; after K Kᵀ each is scaled in place
into the B operand of W and U), an fp32 [64, 64] scratch tile (16 KB: A, then the inverse),
the neighbour buffer [8, 16, 16] fp32 (8 KB, 5 blocks used: a slice starts at a multiple of its
length, so the shifted view is a 1-block slice reinterpreted), the hi and lo B operands
[64, 32] fp32 (8 KB each), two mbarriers: 73,744 B as compiled, three programs in 227 KB.
Registers: one warpgroup, 148 a thread as compiled (no cap, no spills): three programs in an
SM's 64 K. Peak live set: the [64, 128] fp32 W or U accumulator (64) and the bf16 T operand.

Masking: TMA tiles are 2-D over the flattened [B·T] token axis, so the last chunk of a
sequence may read the next sequence's first rows (the last sequence's read as zeros). Those
rows get A rows of 0 (the strict mask includes row < T, as kkt_solve_from_k), β = 0 and G = 0,
so their rows of T are unit rows, their scaled k and v rows are 0, and no valid row of W or U
sees them (T is lower triangular and a valid row only has valid columns below its diagonal);
w and u are stored with a row mask. Γ's exponent is selected by the mask before the exp
(kkt.gated_decay), so strong decays never overflow into inf · 0.

Scope: dense batches (no cu_seqlens), K = V = 128, chunk 64, bf16 k/v, HV a multiple of H.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels.gluon_ring import CHUNK, HEAD_DIM, accumulator_layout, descriptor_layout

# diagonal block: 14 substitution steps, and one warp's 16-row slab of the wgmma accumulator
BLOCK = gl.constexpr(16)
NUM_WARPS = 4  # one warpgroup: the wgmma M = 64 is the chunk
# fp32 bits below TF32's 10-bit mantissa, and half of their range for rounding to nearest
TF32_DROP = gl.constexpr(-8192)  # 0xFFFFE000
TF32_HALF = gl.constexpr(4096)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _sum(x, axis: gl.constexpr):
    """gl.sum without triton.language's jitted combine function, which becomes an interpreted
    function (not callable from Gluon) when TRITON_INTERPRET=1 is set, as in the CPU tests."""
    return gl.reduce(x, axis, _add)


@gluon.jit
def _maximum(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _max(x, axis: gl.constexpr):
    """gl.max without triton.language's jitted combine function (as :func:`_sum`)."""
    return gl.reduce(x, axis, _maximum)


@gluon.jit
def _tf32_hi(x):
    """x rounded to the nearest TF32 value (exact in TF32, so a TF32 wgmma reads it exactly)."""
    bits = x.to(gl.int32, bitcast=True)
    return ((bits + TF32_HALF) & TF32_DROP).to(gl.float32, bitcast=True)


@gluon.jit
def _store_split(b, hi_smem, lo_smem):
    """The B operand of a 3×TF32 product: hi = TF32(b) and lo = b − hi into shared memory."""
    b_hi = _tf32_hi(b)
    hi_smem.store(b_hi)
    lo_smem.store(b - b_hi)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _dot_3xtf32(a, hi_smem, lo_smem):
    """a @ b, fp32-accurate, for a [64, K] fp32 in registers and b [K, N] split by _store_split
    (K-major, as TF32 wgmma reads only that): lo·hi + hi·lo + hi·hi, three TF32 wgmmas."""
    N: gl.constexpr = hi_smem.type.shape[1]
    # TF32 wgmma steps K by 8 (accumulator_layout's 16 is for 16-bit operands); the register
    # mapping of the accumulator is the same, so conversions to and from it are free
    acc: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, N, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=1)
    a_hi = _tf32_hi(a)
    a_lo = gl.convert_layout(a - a_hi, a_op)
    a_hi = gl.convert_layout(a_hi, a_op)
    # fp32 operands run as TF32, the default input precision (warpgroup_mma in Triton 3.6 takes
    # no constexpr precision string from jitted code)
    c = warpgroup_mma(a_lo, hi_smem, gl.zeros([a.shape[0], N], gl.float32, acc), use_acc=False)
    c = warpgroup_mma(a_hi, lo_smem, c)
    c = warpgroup_mma(a_hi, hi_smem, c)
    # every warp past its reads of hi/lo before they are overwritten
    gl.thread_barrier()
    return gl.convert_layout(c, a.type.layout)


@gluon.jit
def _diagonal_inverse(L3):
    """(I + L)⁻¹ for the NB stacked strictly lower 16 × 16 blocks L3 [NB, 16, 16], by forward
    substitution: row i of Y = (I + L)⁻¹ − I is a + Σ_j a_j Y_j with a = −L_i; rows 0 and 1
    are already final in Y = −L (kkt_solve.invert_diagonal_blocks)."""
    l3: gl.constexpr = L3.type.layout
    ri = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))[None, :, None]
    ci = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))[None, None, :]
    Y = -L3
    for i in gl.static_range(2, BLOCK):
        a = -_sum(gl.where(ri == i, L3, 0.), axis=1)  # [NB, 16]: row i of each block
        a_j = gl.convert_layout(a, gl.SliceLayout(2, l3))
        a = a + _sum(gl.expand_dims(a_j, 2) * Y, axis=1)
        Y = gl.where(ri == i, gl.expand_dims(a, 1), Y)
    return gl.where(ri == ci, Y + 1., Y)


@gluon.jit
def _block_matmul(X, Y):
    """X @ Y for stacked [NB, 16, 16] fp32 tiles, block by block, on CUDA cores in exact fp32:
    16 rank-1 updates, each a column of X times a row of Y (picked by a masked sum, exact)."""
    l3: gl.constexpr = X.type.layout
    ri = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))[None, :, None]
    ci = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))[None, None, :]
    P = gl.zeros(X.shape, gl.float32, l3)
    for m in gl.static_range(BLOCK):
        x_m = _sum(gl.where(ci == m, X, 0.), axis=2)  # [NB, 16]: column m of each block
        y_m = _sum(gl.where(ri == m, Y, 0.), axis=1)  # [NB, 16]: row m of each block
        P += gl.expand_dims(x_m, 2) * gl.expand_dims(y_m, 1)
    return P


@gluon.jit
def inverse_scratch(BT: gl.constexpr):
    """The shared buffers ``invert`` works in (40 KB at BT = 64): an fp32 [BT, BT] scratch tile,
    the neighbour buffer of the first merge and the hi/lo B operands of the second."""
    a_smem = gl.allocate_shared_memory(gl.float32, [BT, BT],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    d_smem = gl.allocate_shared_memory(gl.float32, [2 * (BT // BLOCK), BLOCK, BLOCK],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    # B operands of the TF32 products: K-major, as TF32 wgmma reads only that
    b_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, BT // 2], gl.float32,
                                                                transposed=True)
    hi_smem = gl.allocate_shared_memory(gl.float32, [BT, BT // 2], b_tile)
    lo_smem = gl.allocate_shared_memory(gl.float32, [BT, BT // 2], b_tile)
    return a_smem, d_smem, hi_smem, lo_smem


@gluon.jit
def invert(A, scratch):
    """T = (I + A)⁻¹ of a strictly lower fp32 [64, 64] tile A in the wgmma accumulator layout
    (one warpgroup), returned in the same layout; scratch from ``inverse_scratch``."""
    a_smem, d_smem, hi_smem, lo_smem = scratch
    acc: gl.constexpr = A.type.layout
    BT: gl.constexpr = A.shape[0]
    NB: gl.constexpr = BT // BLOCK
    # A's 16 × 16 blocks as stacked [NB, 16, 16] tiles, one row block a warp, through a
    # row-major fp32 scratch tile: column slice cb of the [NB, 16, 64] view holds block
    # (b, cb) at batch b; the diagonal blocks (cb = b) and the sub-diagonal blocks inside
    # each 32-block (cb = b − 1, b odd) are picked by masked sums
    a_smem.store(A)
    gl.thread_barrier()
    l3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4, 2], threads_per_warp=[1, 4, 8],
                                        warps_per_cta=[NB, 1, 1], order=[2, 1, 0])
    a3 = a_smem._reinterpret(gl.float32, [NB, BLOCK, BT],
                             gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    nb = gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))[:, None, None]
    odd = (nb % 2) == 1
    L3 = gl.zeros([NB, BLOCK, BLOCK], gl.float32, l3)
    S3 = gl.zeros([NB, BLOCK, BLOCK], gl.float32, l3)
    for cb in gl.static_range(NB):
        blk = a3.slice(cb * BLOCK, BLOCK, dim=2).load(l3)
        L3 += gl.where(nb == cb, blk, 0.)
        S3 += gl.where((nb == cb + 1) & odd, blk, 0.)
    T3 = _diagonal_inverse(L3)
    # the first merge (16 → 32) inside the stack, exact fp32: T_{b,b−1} = −T_bb A_{b,b−1}
    # T_{b−1,b−1} for odd b; T_{b−1,b−1} comes from the neighbouring warp through d_smem,
    # shifted by one block (slot 0 is never written: selected away)
    d3: gl.constexpr = d_smem.type.layout
    # (a slice must start at a multiple of its length: the shifted view is a 1-block slice
    # reinterpreted to NB blocks)
    d_smem.slice(1, 1, dim=0)._reinterpret(gl.float32, [NB, BLOCK, BLOCK], d3).store(T3)
    gl.thread_barrier()
    T_prev = gl.where(odd, d_smem.slice(0, NB, dim=0).load(l3), 0.)
    C3 = -_block_matmul(T3, _block_matmul(S3, T_prev))
    # the last merge (32 → 64) changes only the lower-left 32 × 32 block:
    # T_LL = −T_BB (A_LL T_AA), as two 3×TF32 wgmmas of 64 × 32 × 32 (rows 0..31 of both
    # products are zeros: N's rows and X's upper-right block are)
    H: gl.constexpr = BT // 2
    acc_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, H, 16])
    o_h = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_h))
    N = gl.where((o_h >= H)[:, None], a_smem.slice(0, H, dim=1).load(acc_h), 0.)  # A_LL
    gl.thread_barrier()
    for cb in gl.static_range(NB):
        a3.slice(cb * BLOCK, BLOCK, dim=2).store(
            gl.where(nb == cb, T3, gl.where((nb == cb + 1) & odd, C3, 0.)))
    gl.thread_barrier()
    # a_smem holds X, the block diagonal of the two 32 × 32 inverses T_AA and T_BB
    x_aa: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    _store_split(a_smem.slice(0, H, dim=0).slice(0, H, dim=1).load(x_aa),
                 hi_smem.slice(0, H, dim=0), lo_smem.slice(0, H, dim=0))
    P = _dot_3xtf32(N, hi_smem.slice(0, H, dim=0), lo_smem.slice(0, H, dim=0))  # A_LL T_AA
    _store_split(P, hi_smem, lo_smem)
    Q = _dot_3xtf32(a_smem.slice(H, H, dim=1).load(acc_h), hi_smem.slice(H, H, dim=0),
                    lo_smem.slice(H, H, dim=0))  # T_BB (A_LL T_AA), in rows 32..63
    X_left = a_smem.slice(0, H, dim=1)
    T_left = X_left.load(acc_h) - Q
    gl.thread_barrier()
    X_left.store(T_left)
    gl.thread_barrier()
    return a_smem.load(acc)


@gluon.jit
def wu_gluon_kernel(k_desc, v_desc, G, beta, w, u, T, H: gl.constexpr, HV: gl.constexpr,
                    K: gl.constexpr, V: gl.constexpr):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    i_t, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    row0 = i_n * T + i_t * BT
    mbarrier.expect(bars.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0, i_h * K], bars.index(0), k_smem)
    mbarrier.expect(bars.index(1), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row0, i_hv * V], bars.index(1), v_smem)

    acc: gl.constexpr = accumulator_layout(BT)
    acc_w: gl.constexpr = accumulator_layout(K)
    scratch = inverse_scratch(BT)

    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, acc))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))
    t = i_t * BT + o_t
    valid = t < T
    p_G = G + (i_n * T).to(gl.int64) * HV + i_hv
    p_b = beta + (i_n * T).to(gl.int64) * HV + i_hv
    b_G = gl.load(p_G + t * HV, mask=valid, other=0.)
    b_Gj = gl.load(p_G + (i_t * BT + o_j) * HV, mask=i_t * BT + o_j < T, other=0.)
    b_beta = gl.load(p_b + t * HV, mask=valid, other=0.).to(gl.float32)

    mbarrier.wait(bars.index(0), 0)
    kk = warpgroup_mma(k_smem, k_smem.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc),
                       use_acc=False)
    # kkt.gated_decay: G_i − G_j in fp64, rounded to fp32 and selected before the exp; rows past
    # T are selected away (their G reads 0, so G_i − G_j may be > 0)
    strict = (o_t[:, None] > o_j[None, :]) & valid[:, None]
    diff = (b_G[:, None] - b_Gj[None, :]).to(gl.float32)
    A = kk * gl.where(strict, gl.exp(gl.where(strict, diff, 0.)), 0.) * b_beta[:, None]
    Ti = invert(A, scratch)

    # the B operands of W and U, scaled in place (K Kᵀ has read k: its wgmma is complete) and
    # rounded to bf16 as recompute_w_u rounds them
    rows_w: gl.constexpr = gl.SliceLayout(1, acc_w)
    k_scale = gl.convert_layout(b_beta * gl.exp(b_G.to(gl.float32)), rows_w)
    kb = (k_smem.load(acc_w).to(gl.float32) * k_scale[:, None]).to(gl.bfloat16)
    mbarrier.wait(bars.index(1), 0)
    vb = v_smem.load(acc_w).to(gl.float32) * gl.convert_layout(b_beta, rows_w)[:, None]
    vb = vb.to(gl.bfloat16)
    gl.thread_barrier()
    k_smem.store(kb)
    v_smem.store(vb)
    fence_async_shared()
    gl.thread_barrier()
    Tb = gl.convert_layout(Ti.to(gl.bfloat16),
                           gl.DotOperandLayout(operand_index=0, parent=acc_w, k_width=2))
    o_r = gl.arange(0, BT, layout=rows_w)
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, acc_w))
    row = ((i_n * T + i_t * BT).to(gl.int64) * HV + i_hv)
    offs = o_r[:, None] * (HV * K) + o_k[None, :]
    mask = (i_t * BT + o_r < T)[:, None]
    b_w = warpgroup_mma(Tb, k_smem, gl.zeros([BT, K], gl.float32, acc_w), use_acc=False)
    gl.store(w + row * K + offs, b_w.to(gl.bfloat16), mask=mask)
    b_u = warpgroup_mma(Tb, v_smem, gl.zeros([BT, V], gl.float32, acc_w), use_acc=False)
    gl.store(u + row * V + offs, b_u.to(gl.bfloat16), mask=mask)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))


# TMA block shape of each descriptor argument: k, v [C, 128]
DESCRIPTOR_BLOCKS = dict(k=[CHUNK, HEAD_DIM], v=[CHUNK, HEAD_DIM])


def wu_gluon(k, v, G, beta):
    """W and U of every chunk straight from k, v, G and β, without A or T in HBM.

    k [B, T, H, 128] bf16 (L2-normalised keys); v [B, T, HV, 128] bf16; G [B, T, HV]
    (natural-log decay cumulated within each chunk of 64; read in fp64); beta [B, T, HV] (read
    in fp32). Returns (w [B, T, HV, 128] bf16, u [B, T, HV, 128] bf16), the values of
    ``recompute_w_u(k, v, G, beta, kkt_solve_from_k(k, G, beta, HV, 64))``. Raises ValueError
    for head dims other than 128, non-bf16 k/v, shapes that do not match or HV not a multiple
    of H. Needs a Hopper GPU (sm_90); dense batches only, chunk size fixed at 64. Math: the
    WY representation of the chunkwise Gated DeltaNet (Yang, Kautz & Hatamizadeh,
    arXiv:2412.06464, §3.3); the inverse as kernels/kkt_solve.py (blocked)."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM or V != HEAD_DIM:
        raise ValueError(f"wu_gluon: needs K = V = {HEAD_DIM}, got K {K}, V {V}")
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise ValueError(f"wu_gluon: k and v must be bf16, got {k.dtype}, {v.dtype}")
    if (HV % H or v.shape[:2] != (B, T) or G.shape != (B, T, HV)
            or beta.shape != (B, T, HV)):
        raise ValueError(f"wu_gluon: shapes k {tuple(k.shape)}, v {tuple(v.shape)}, G "
                         f"{tuple(G.shape)}, beta {tuple(beta.shape)} do not match")
    k, v = k.contiguous(), v.contiguous()
    G = G.to(torch.float64).contiguous()
    beta = beta.to(torch.float32).contiguous()
    w = k.new_empty(B, T, HV, K)
    u = torch.empty_like(v)
    views = dict(k=k.view(B * T, H * K), v=v.view(B * T, HV * V))
    descs = [TensorDescriptor.from_tensor(x, DESCRIPTOR_BLOCKS[n],
                                          descriptor_layout(DESCRIPTOR_BLOCKS[n]))
             for n, x in views.items()]
    grid = (triton.cdiv(T, CHUNK), B * HV)
    wu_gluon_kernel[grid](*descs, G, beta, w, u, T, H=H, HV=HV, K=K, V=V, num_warps=NUM_WARPS)
    return w, u
