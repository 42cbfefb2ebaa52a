"""kkt_solve: T = (I + A)⁻¹ for the strictly lower A of each chunk, by blocked recursion.

Method (seed 000, the kkt_solve article; seed 001, Table 2 "blocked"): the chunk of C = 16·NB
rows is cut into an NB×NB grid of 16×16 blocks. The NB diagonal blocks are inverted side by
side by forward substitution (15 dependent steps for all of them together, instead of C − 1
for the whole chunk); the coupling blocks follow from matrix products,

    T_ij = −T_ii · Σ_{j ≤ m < i} A_im T_mj        (i > j),

level by level (i − j = 1, 2, 3), so the dependency depth is 15 + 2·(NB − 1) products. All
arithmetic is fp32; products use an explicit input precision (3×TF32 by default, measured
below; "ieee" for exact fp32 FMA products).

Other methods of the study (seed 001, gdn_fused.inverse has their PyTorch versions):

- ``mxr``: the diagonal blocks by Cayley–Hamilton repeated squaring,
  (I + L)⁻¹ = (I − L)(I + L²)(I + L⁴)(I + L⁸) (exact for 16×16 since L¹⁶ = 0; still accurate at
  that size), then the same block coupling as ``blocked`` (Bunch–Hopcroft merge).
- ``newton_schulz``: X ← X (2I − (I + A) X) on the whole chunk from the paper's X₀ = I/C
  (seed 001, Alg. 3); its residual shrinks like (1 − 1/C)^(2^k), so it needs about
  2·log2(C) + 2 steps (the default) and collapses with fewer — kept to reproduce the paper.

``build_from_k`` (the fused kkt variant): the A blocks are formed on chip from K, β and G
instead of being read from HBM, so A is never written.
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import chunk_index
from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program
from gdn_fused.kernels.chunk_gate import gated_decay

BLOCK = 16  # base block: the smallest tl.dot tile, and 15 substitution steps


@triton.jit
def _load_block(p_base, row_stride, i_t, seqlen, BT: tl.constexpr, ib: tl.constexpr,
                jb: tl.constexpr):
    """16×16 block (ib, jb) of the chunk's A; rows past the sequence end read as 0, and of a
    diagonal block only the strict lower part is read (the Gluon kernel's contract too)."""
    p = tl.make_block_ptr(p_base, (seqlen, BT), (row_stride, 1), (i_t * BT + ib * 16, jb * 16),
                          (16, 16), (1, 0))
    b = tl.load(p, boundary_check=(0,)).to(tl.float32)
    if ib == jb:
        o = tl.arange(0, 16)
        b = tl.where(o[:, None] > o[None, :], b, 0.)
    return b


@triton.jit
def _built_block(k, G, beta, bos, seqlen, i_t, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ib: tl.constexpr,
                 jb: tl.constexpr, DOT_PREC: tl.constexpr):
    """Block (ib, jb) of strictLower(diag(β)(Γ ⊙ K Kᵀ)) formed from K, β and G on chip."""
    p_ki = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                             (i_t * BT + ib * 16, 0), (16, BK), (1, 0))
    p_kj = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, seqlen), (1, H * K),
                             (0, i_t * BT + jb * 16), (BK, 16), (0, 1))
    b_a = tl.dot(tl.load(p_ki, boundary_check=(0, 1)), tl.load(p_kj, boundary_check=(0, 1)),
                 input_precision=DOT_PREC)
    o_r = i_t * BT + ib * 16 + tl.arange(0, 16)
    o_c = i_t * BT + jb * 16 + tl.arange(0, 16)
    m_r, m_c = o_r < seqlen, o_c < seqlen
    b_Gr = tl.load(G + (bos + o_r) * HV + i_hv, mask=m_r, other=0.)
    b_Gc = tl.load(G + (bos + o_c) * HV + i_hv, mask=m_c, other=0.)
    b_beta = tl.load(beta + (bos + o_r) * HV + i_hv, mask=m_r, other=0.).to(tl.float32)
    mask = (o_r[:, None] > o_c[None, :]) & m_r[:, None]
    return b_a * gated_decay(b_Gr, b_Gc, mask) * b_beta[:, None]


@triton.jit
def _store_block(p_base, row_stride, i_t, seqlen, b, BT: tl.constexpr, ib: tl.constexpr,
                 jb: tl.constexpr):
    p = tl.make_block_ptr(p_base, (seqlen, BT), (row_stride, 1), (i_t * BT + ib * 16, jb * 16),
                          (16, 16), (1, 0))
    tl.store(p, b.to(p.dtype.element_ty), boundary_check=(0,))


@triton.jit
def invert_diagonal_blocks(L3, NB: tl.constexpr):
    """Inverse of I + L for NB stacked strictly-lower 16×16 blocks L3 [NB, 16, 16], in parallel.

    Row i of Y = (I + L)⁻¹ − I satisfies Y_i = a + Σ_j a_j Y_j with a = −L_i (forward
    substitution); rows 0 and 1 are already final in Y = −L."""
    ri = tl.arange(0, 16)[None, :, None]
    Y = -L3
    for i in tl.static_range(2, 16):
        a = -tl.sum(tl.where(ri == i, L3, 0.), 1)  # [NB, 16]: row i of each block
        a = a + tl.sum(a[:, :, None] * Y, 1)
        Y = tl.where(ri == i, a[:, None, :], Y)
    eye = (ri == tl.arange(0, 16)[None, None, :]).to(tl.float32)
    return Y + eye


@triton.jit
def double_diagonal_blocks(L3, DOT_PREC: tl.constexpr):
    """(I + L)⁻¹ for stacked 16×16 blocks by recursive doubling (unrolled Bunch–Hopcroft, seed
    001 §3.3): with X the inverse of the b×b diagonal blocks and N the coupling b-blocks inside
    each 2b-block, X ← X − X N X gives the 2b×2b inverses; b = 1, 2, 4, 8. Eight batched
    products replace the 14 dependent row reductions of forward substitution."""
    ri = tl.arange(0, 16)[None, :, None]
    ci = tl.arange(0, 16)[None, None, :]
    X = tl.where(ri == ci, 1., L3 * 0.)  # I, broadcast to the [NB, 16, 16] batch
    for s in tl.static_range(4):
        coupling = ((ri >> (s + 1)) == (ci >> (s + 1))) & ((ri >> s) != (ci >> s))
        N = tl.where(coupling, L3, 0.)
        X = X - tl.dot(X, tl.dot(N, X, input_precision=DOT_PREC), input_precision=DOT_PREC)
    return X


@triton.jit
def square_diagonal_blocks(L3, DOT_PREC: tl.constexpr):
    """(I + L)⁻¹ = (I − L)(I + L²)(I + L⁴)(I + L⁸) for stacked 16×16 blocks (L¹⁶ = 0): MCH."""
    ri = tl.arange(0, 16)[None, :, None]
    eye = (ri == tl.arange(0, 16)[None, None, :]).to(tl.float32)
    X = eye - L3
    P = L3
    for _ in tl.static_range(3):
        P = tl.dot(P, P, input_precision=DOT_PREC)
        X = X + tl.dot(X, P, input_precision=DOT_PREC)
    return X


@triton.jit
def _block_of(X3, b: tl.constexpr, NB: tl.constexpr):
    """Block b of a stacked [NB, 16, 16] tile (a masked sum: Triton has no register slicing)."""
    return tl.sum(tl.where(tl.arange(0, NB)[:, None, None] == b, X3, 0.), 0)


@triton.jit
def _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
             K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ib: tl.constexpr,
             jb: tl.constexpr, BUILD: tl.constexpr, DOT_PREC: tl.constexpr):
    if BUILD:
        b = _built_block(k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, ib, jb,
                         DOT_PREC)
    else:
        b = _load_block(A + (bos * HV + i_hv) * BT, HV * BT, i_t, seqlen, BT, ib, jb)
    return b


@triton.jit
def _newton_schulz(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H: tl.constexpr,
                   HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BUILD: tl.constexpr, NS_ITERS: tl.constexpr, DOT_PREC: tl.constexpr):
    """X ← 2X − X((I + L)X) from X₀ = I/C on the whole chunk."""
    o_i = tl.arange(0, BT)
    if BUILD:
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1), (i_t * BT, 0),
                                (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1))
        o_r = i_t * BT + o_i
        b_G = tl.load(G + (bos + o_r) * HV + i_hv, mask=o_r < seqlen, other=0.)
        b_beta = tl.load(beta + (bos + o_r) * HV + i_hv, mask=o_r < seqlen, other=0.)
        strict = (o_i[:, None] > o_i[None, :]) & (o_r < seqlen)[:, None]
        L = tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC) * \
            gated_decay(b_G, b_G, strict) * b_beta.to(tl.float32)[:, None]
    else:
        p_A = tl.make_block_ptr(A + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                                (i_t * BT, 0), (BT, BT), (1, 0))
        L = tl.load(p_A, boundary_check=(0,)).to(tl.float32)
        L = tl.where(o_i[:, None] > o_i[None, :], L, 0.)  # the strict lower part only
    X = (o_i[:, None] == o_i[None, :]).to(tl.float32) / BT
    for _ in tl.static_range(NS_ITERS):
        AX = X + tl.dot(L, X, input_precision=DOT_PREC)
        X = 2 * X - tl.dot(X, AX, input_precision=DOT_PREC)
    return X


@triton.jit
def _coupling_blocks(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     NB: tl.constexpr, BUILD: tl.constexpr, DOT_PREC: tl.constexpr):
    """The below-diagonal 16×16 blocks (A10, A20, A21, A30, A31, A32); zeros past NB."""
    zero = tl.zeros([16, 16], dtype=tl.float32)
    A10, A20, A21, A30, A31, A32 = zero, zero, zero, zero, zero, zero
    if NB >= 2:
        A10 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 1, 0,
                       BUILD, DOT_PREC)
    if NB == 4:
        A20 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 2, 0,
                       BUILD, DOT_PREC)
        A21 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 2, 1,
                       BUILD, DOT_PREC)
        A30 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 3, 0,
                       BUILD, DOT_PREC)
        A31 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 3, 1,
                       BUILD, DOT_PREC)
        A32 = _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, 3, 2,
                       BUILD, DOT_PREC)
    return A10, A20, A21, A30, A31, A32


@triton.jit
def kkt_solve_kernel(A, k, G, beta, Ai, cu_seqlens, chunk_indices, T, H: tl.constexpr,
                     HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     IS_VARLEN: tl.constexpr, BUILD: tl.constexpr, METHOD: tl.constexpr,
                     NS_ITERS: tl.constexpr, DOT_PREC: tl.constexpr, DIAG: tl.constexpr,
                     PREFETCH: tl.constexpr = False):
    i_t, i_hv, i_h, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, H, HV, BT,
                                                     IS_VARLEN)
    t_base = Ai + (bos * HV + i_hv) * BT
    S: tl.constexpr = HV * BT  # row stride of A and T
    if METHOD == "newton_schulz":
        X = _newton_schulz(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, BUILD,
                           NS_ITERS, DOT_PREC)
        p_T = tl.make_block_ptr(t_base, (seqlen, BT), (S, 1), (i_t * BT, 0), (BT, BT), (1, 0))
        tl.store(p_T, X.to(p_T.dtype.element_ty), boundary_check=(0,))
        return
    NB: tl.constexpr = BT // 16
    nb = tl.arange(0, NB)[:, None, None]
    if PREFETCH:
        # every coupling block's load issued before the diagonal inversion, so one memory
        # latency is exposed per tile instead of one per load site (costs registers: the sweep
        # decides, see REGISTER_FOOTPRINT)
        P = _coupling_blocks(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, NB,
                             BUILD, DOT_PREC)
    # the NB diagonal blocks, stacked, so their inversions run side by side
    L3 = tl.zeros([NB, 16, 16], dtype=tl.float32)
    for b in tl.static_range(NB):
        L3 += tl.where(nb == b, _a_block(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K,
                                         BT, BK, b, b, BUILD, DOT_PREC)[None], 0.)
    if METHOD == "mxr":
        T3 = square_diagonal_blocks(L3, DOT_PREC)
    elif DIAG == "doubling":
        T3 = double_diagonal_blocks(L3, DOT_PREC)
    else:
        T3 = invert_diagonal_blocks(L3, NB)
    if not PREFETCH:
        P = _coupling_blocks(A, k, G, beta, bos, seqlen, i_t, i_h, i_hv, H, HV, K, BT, BK, NB,
                             BUILD, DOT_PREC)
    A10, A20, A21, A30, A31, A32 = P
    zero = tl.zeros([16, 16], dtype=tl.float32)
    T00 = _block_of(T3, 0, NB)
    _store_block(t_base, S, i_t, seqlen, T00, BT, 0, 0)
    if NB >= 2:
        T11 = _block_of(T3, 1, NB)
        T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=DOT_PREC), input_precision=DOT_PREC)
        _store_block(t_base, S, i_t, seqlen, zero, BT, 0, 1)
        _store_block(t_base, S, i_t, seqlen, T10, BT, 1, 0)
        _store_block(t_base, S, i_t, seqlen, T11, BT, 1, 1)
    if NB == 4:
        T22 = _block_of(T3, 2, NB)
        T33 = _block_of(T3, 3, NB)
        # first sub-diagonal: independent of each other
        T21 = -tl.dot(T22, tl.dot(A21, T11, input_precision=DOT_PREC), input_precision=DOT_PREC)
        T32 = -tl.dot(T33, tl.dot(A32, T22, input_precision=DOT_PREC), input_precision=DOT_PREC)
        # second and third sub-diagonals reuse the first
        T20 = -tl.dot(T22, tl.dot(A20, T00, input_precision=DOT_PREC)
                      + tl.dot(A21, T10, input_precision=DOT_PREC), input_precision=DOT_PREC)
        T31 = -tl.dot(T33, tl.dot(A31, T11, input_precision=DOT_PREC)
                      + tl.dot(A32, T21, input_precision=DOT_PREC), input_precision=DOT_PREC)
        T30 = -tl.dot(T33, tl.dot(A30, T00, input_precision=DOT_PREC)
                      + tl.dot(A31, T10, input_precision=DOT_PREC)
                      + tl.dot(A32, T20, input_precision=DOT_PREC), input_precision=DOT_PREC)
        for jb in tl.static_range(2, 4):
            _store_block(t_base, S, i_t, seqlen, zero, BT, 0, jb)
            _store_block(t_base, S, i_t, seqlen, zero, BT, 1, jb)
        _store_block(t_base, S, i_t, seqlen, zero, BT, 2, 3)
        _store_block(t_base, S, i_t, seqlen, T20, BT, 2, 0)
        _store_block(t_base, S, i_t, seqlen, T21, BT, 2, 1)
        _store_block(t_base, S, i_t, seqlen, T22, BT, 2, 2)
        _store_block(t_base, S, i_t, seqlen, T30, BT, 3, 0)
        _store_block(t_base, S, i_t, seqlen, T31, BT, 3, 1)
        _store_block(t_base, S, i_t, seqlen, T32, BT, 3, 2)
        _store_block(t_base, S, i_t, seqlen, T33, BT, 3, 3)


SOLVE_METHODS = ("blocked", "mxr", "newton_schulz")
# Launch choices measured on the H200 (eval.bench --kkt-sweep, B=8, T=4096, HV=32, C=64, fp32 A
# in, bf16 T out; fla solve_tril 673 µs): forward substitution with 1 warp 369 µs, 2 warps 414,
# 4 warps 1011, 8 warps 2352; recursive doubling ("doubling") 1154 / 577 / 655 / 735 µs. One
# warp keeps every row reduction inside a warp (shuffles, no shared-memory barrier) and lets
# more tiles share an SM; doubling pays layout conversions around its eight small products.
# The coupling products then run on tensor cores as 3×TF32 ("tf32x3", a hi/lo split that keeps
# fp32 accuracy): 267 µs (2.5× faster than fla, 36 % of copy bandwidth) with a max abs change of
# 2.2e-8 against exact fp32 products, inside the 1e-6 budget of an fp32 inverse.
DOT_PRECISION = "tf32x3"
# Newton-Schulz keeps three whole 64x64 fp32 matrices (L, X, LX) live: with one warp ptxas
# (sm_90a, K = 128, built from k) spills 73 KB per thread-program, with four 1.5 KB (eight: 1.4
# KB). Its MMLU rows on the H200 ran 2-7x slower than blocked at one warp (NS-6: 130 s vs 18 s).
NUM_WARPS = {"blocked": 1, "mxr": 1, "newton_schulz": 4}
# REGISTER_FOOTPRINT — ptxas -v for sm_90a (compiled on a CPU, 2026-11-29; C = 64, blocked,
# tf32x3), registers per thread / spill bytes per thread:
#   from A (K = 16):          1 warp 255 / 272   2 warps 226 / 0    4 warps 192 / 0
#   built from k (K = 128):   1 warp 255 / 1400  2 warps 255 / 300  4 warps 255 / 164
#   1 warp capped at 128:     from A 128 / 1016, from k 128 / 4484
# (after the coupling blocks became one _coupling_blocks call: from A 255 / 220 at 1 warp,
# 212 / 0 at 2; from k 255 / 1124 and 255 / 428; with prefetch=True from A 255 / 232, from k
# 255 / 1836 — there "prefetch" also moves the blocks' K Kᵀ products forward.)
# A tile's footprint (registers × threads) sets how many tiles an SM holds: 8 at 1 warp, 4 at
# 2, 2 at 4 — the order of the measured times above, so the kernel is bound by tiles in flight
# (latency × occupancy), not by bandwidth. A 128-register cap would double the tiles per SM at
# the price of spills to L1: the sweep (eval.bench --kkt-sweep) times it.


# Register cap of the blocked method read from A at one warp, measured on the H200 (eval.bench
# --sweep, B=8, T=4096, 2026-11-29, fla solve_tril 674 µs in the same run): uncapped (255)
# 244 µs, 168: 222 µs, 128: 299 µs (spills). 168 fits 12 tiles an SM instead of 8 at ~no spill
# cost. Built from k the cap is not yet measured (that variant spills 1.1 KB uncapped).
MAXNREG_FROM_A = 168


def _register_cap(maxnreg, solve_method="blocked", num_warps=None, from_a=False):
    """Launch option for ptxas' register cap: ``maxnreg`` if given (255 = uncapped), else the
    measured default of the blocked method from A at its default warp count."""
    if maxnreg is None and from_a and solve_method == "blocked" and num_warps is None:
        maxnreg = MAXNREG_FROM_A
    return {} if maxnreg is None else {"maxnreg": maxnreg}


def _solve_args(solve_method, solve_iters, C):
    if solve_method not in SOLVE_METHODS:
        raise ValueError(f"solve_method must be one of {SOLVE_METHODS}, got {solve_method!r}")
    if solve_method != "newton_schulz":
        if solve_iters is not None:
            raise ValueError(f"solve_iters is only for newton_schulz, got {solve_iters!r}")
        return 0
    # the paper's count for X₀ = I/C (gdn_fused.inverse uses the same default)
    iters = 2 * (C.bit_length() - 1) + 2 if solve_iters is None else solve_iters
    if not isinstance(iters, int) or iters < 0:
        raise ValueError(f"solve_iters must be a non-negative int, got {solve_iters!r}")
    return iters


# Which kernel runs kkt_solve's default (blocked, chunk 64, default launch) on a CUDA GPU of
# sm_80 or later: the Gluon one (kernels/gluon_kkt_solve.py, explicit register layouts; H200,
# B=8, T=4096, HV=32: 132 µs against this file's tl kernel's 223) or the tl one below, which
# is also the interpreter's and every other case's.
KERNELS = ("auto", "triton", "gluon")


def _use_gluon(kernel, x, solve_method, tl_options, maxnreg, chunk_size, name="A"):
    """Whether kkt_solve runs the Gluon kernel on x = A (or kkt_solve_from_k on x = k);
    tl_options: the tl kernel's launch options that were changed from their defaults (by
    name); maxnreg applies to either kernel, and with kernel="auto" it keeps the tl one (its
    register-cap sweep). Raises ValueError for an unknown kernel and for a Gluon request it
    cannot honour."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "gluon":
        if solve_method != "blocked":
            raise ValueError(f"the Gluon kkt_solve runs the blocked method, got {solve_method!r}")
        if tl_options:
            raise ValueError(f"{', '.join(tl_options)}: options of the tl kernel, not of the "
                             "Gluon one (kernel='gluon')")
        if chunk_size != 64:
            raise ValueError(f"kernel='gluon' needs chunk size 64, got {chunk_size}")
        if not x.is_cuda:
            raise ValueError(f"kernel='gluon' needs {name} on a CUDA device, got {x.device}")
        if not _gluon_device(x.device):
            raise ValueError(f"kernel='gluon' needs an NVIDIA GPU of sm_80 or later, got "
                             f"{torch.cuda.get_device_name(x.device)}")
    if kernel != "auto":
        return kernel == "gluon"
    return (x.is_cuda and chunk_size == 64 and solve_method == "blocked"
            and not tl_options and maxnreg is None and _gluon_device(x.device))


def _tl_options(dot_precision, num_warps, diag, prefetch):
    """Names of the tl kernel's launch options changed from their defaults (the Gluon kernels
    take none of them)."""
    return [name for name, changed in (("dot_precision", dot_precision != DOT_PRECISION),
                                       ("num_warps", num_warps is not None),
                                       ("diag", diag != "substitution"),
                                       ("prefetch", bool(prefetch))) if changed]


def _gluon_device(device):
    """An NVIDIA GPU (not ROCm, whose devices are "cuda" too) of sm_80 or later: mma.sync."""
    return torch.version.hip is None and chunk_index.capability(device) >= (8, 0)


def _check_a(A, output_dtype, cu_seqlens, chunk_indices, num_chunks):
    """kkt_solve's input checks, before any launch (ValueError / TypeError naming the
    argument)."""
    if not isinstance(A, torch.Tensor) or A.dim() != 4:
        raise ValueError(f"A must be a [B, T, HV, C] tensor, got {getattr(A, 'shape', A)!r}")
    if not A.is_floating_point():
        raise TypeError(f"A must be a float tensor, got {A.dtype}")
    _check_output_dtype(output_dtype)
    if A.shape[-1] not in (16, 32, 64):
        raise ValueError(f"chunk size (A.shape[-1]) must be 16, 32 or 64, got {A.shape[-1]}")
    _check_packed("A", A.shape[0], cu_seqlens, chunk_indices, num_chunks)


def _check_keys(k, G, beta, num_value_heads, chunk_size, output_dtype, cu_seqlens,
                chunk_indices, num_chunks):
    """kkt_solve_from_k's input checks, before any launch (ValueError / TypeError naming the
    argument)."""
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        raise ValueError(f"k must be a [B, T, H, K] tensor, got {getattr(k, 'shape', k)!r}")
    if not k.is_floating_point():
        raise TypeError(f"k must be a float tensor, got {k.dtype}")
    B, T, H, _ = k.shape
    if not isinstance(num_value_heads, int) or num_value_heads < 1 or num_value_heads % H:
        raise ValueError(f"num_value_heads must be a positive multiple of H = {H}, got "
                         f"{num_value_heads!r}")
    for name, x in (("G", G), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, T, num_value_heads):
            raise ValueError(f"{name} must be [B, T, HV] = [{B}, {T}, {num_value_heads}], got "
                             f"{getattr(x, 'shape', x)!r}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {x.dtype}")
        if x.device != k.device:
            raise ValueError(f"{name} is on {x.device}, k on {k.device}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size!r}")
    _check_output_dtype(output_dtype)
    _check_packed("k", B, cu_seqlens, chunk_indices, num_chunks)


def _check_output_dtype(output_dtype):
    if output_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"output_dtype must be float32, float16 or bfloat16, got {output_dtype}")


def _check_packed(name, batch, cu_seqlens, chunk_indices, num_chunks):
    """Packed input (cu_seqlens) needs batch 1 and its chunk indices (chunk_index.chunk_layout):
    the 1-D grids count HV heads when packed."""
    if cu_seqlens is None:
        return
    if batch != 1:
        raise ValueError(f"packed input (cu_seqlens) must have batch 1, got {name}.shape[0] = "
                         f"{batch}")
    if chunk_indices is None or num_chunks is None:
        raise ValueError("packed input needs chunk_indices and num_chunks "
                         "(chunk_index.chunk_layout)")
    if tuple(chunk_indices.shape) != (num_chunks, 2):
        raise ValueError(f"chunk_indices must be [num_chunks, 2] = [{num_chunks}, 2], got "
                         f"{tuple(chunk_indices.shape)}")


def kkt_solve(A, output_dtype=torch.float32, cu_seqlens=None, chunk_indices=None,
              num_chunks=None, dot_precision=DOT_PRECISION, solve_method="blocked", solve_iters=None,
              num_warps=None, diag="substitution", maxnreg=None, prefetch=False, kernel="auto"):
    """(I + A)⁻¹ per chunk. A: [B, T, HV, C] strictly lower, fp32 (any float dtype is computed in
    fp32; row t holds its chunk row; C in {16, 32, 64}); returns T of the same shape in
    ``output_dtype`` (fp32, fp16 or bf16).

    solve_method: "blocked" (default), "mxr" or "newton_schulz" (``solve_iters`` steps, default
    2·log2(C) + 2). num_warps: default NUM_WARPS[solve_method]; maxnreg: a register cap per
    thread for ptxas (default MAXNREG_FROM_A for blocked at its default warps) and prefetch:
    load the coupling blocks before the diagonal inversion
    (launch sweeps only, see REGISTER_FOOTPRINT). kernel: "auto" (the Gluon kernel where the
    case allows: NVIDIA sm_80+, blocked, C = 64, default dot precision and launch), "triton"
    (the tl kernel) or "gluon" (C = 64, blocked; maxnreg applies). Only the strict lower part
    of A is read. Source: seed 000 (the kkt_solve article), seed 001 Table 2. Raises ValueError
    for another shape, chunk size, method or kernel, packed input of batch > 1 or without its
    chunk indices (chunk_index.chunk_layout), TypeError for non-float A or output dtype."""
    _check_a(A, output_dtype, cu_seqlens, chunk_indices, num_chunks)
    A = A.contiguous()
    B, T, HV, C = A.shape
    iters = _solve_args(solve_method, solve_iters, C)
    tl_options = _tl_options(dot_precision, num_warps, diag, prefetch)
    if _use_gluon(kernel, A, solve_method, tl_options, maxnreg, C):
        from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_gluon
        return kkt_solve_gluon(A, output_dtype, cu_seqlens, chunk_indices, num_chunks, maxnreg)
    Ai = torch.empty(B, T, HV, C, dtype=output_dtype, device=A.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, C)
    direct.launch(
        kkt_solve_kernel, chunk_head_grid(NT, B, HV),
        A, None, None, None, Ai, cu_seqlens, chunk_indices, T, H=1, HV=HV, K=16, BT=C, BK=16,
        IS_VARLEN=cu_seqlens is not None, BUILD=False, METHOD=solve_method, NS_ITERS=iters,
        DOT_PREC=dot_precision, DIAG=diag, PREFETCH=prefetch,
        num_warps=num_warps or NUM_WARPS[solve_method],
        **_register_cap(maxnreg, solve_method, num_warps, True))
    return Ai


def _use_gluon_from_k(kernel, k, chunk_size, solve_method, tl_options, maxnreg):
    """Whether kkt_solve_from_k runs the Gluon kernel (kernel as in kkt_solve; the Gluon one
    also needs 16-bit keys and K a power of two in [16, 256]). Raises ValueError as
    _use_gluon."""
    K = k.shape[-1]
    keys_fit = k.dtype in (torch.float16, torch.bfloat16) and 16 <= K <= 256 and not K & (K - 1)
    if kernel == "gluon" and not keys_fit:
        raise ValueError(f"kernel='gluon' from k needs fp16/bf16 keys with K a power of two in "
                         f"[16, 256], got {k.dtype}, K = {K}")
    return (_use_gluon(kernel, k, solve_method, tl_options, maxnreg, chunk_size, "k")
            and keys_fit)


def kkt_solve_from_k(k, G, beta, num_value_heads, chunk_size, output_dtype=torch.float32,
                     cu_seqlens=None, chunk_indices=None, num_chunks=None,
                     dot_precision=DOT_PRECISION,
                     solve_method="blocked", solve_iters=None, num_warps=None,
                     diag="substitution", maxnreg=None, prefetch=False, kernel="auto"):
    """The fused kkt variant: T = (I + strictLower(diag(β)(Γ ⊙ K Kᵀ)))⁻¹ built from k [B,T,H,K],
    G (chunk-cumulated, fp64) and beta [B,T,HV] on chip, without writing A to HBM.

    Returns T [B, T, HV, chunk_size] in ``output_dtype``; equals kkt_solve(chunk_kkt(...)) up to
    fp32 rounding order. kernel: "auto" (the Gluon kernel of kernels/gluon_kkt_solve.py where
    the case allows: NVIDIA sm_80+, fp16/bf16 keys, K a power of two in [16, 256], chunk 64,
    blocked, default launch), "triton" (the tl kernel below, which spills: see
    A_THROUGH_HBM) or "gluon". Raises ValueError as kkt_solve for a method or kernel the case
    cannot take, and ValueError / TypeError before any launch for inputs of the wrong shape,
    dtype or device, and packed input of batch > 1 or without its chunk indices. G is the
    natural-log cumulative decay within each chunk (chunk_gate.chunk_cumsum), beta any float
    dtype. Source: the gated A of Yang, Kautz & Hatamizadeh (arXiv:2412.06464, §3.3) and the
    inverse methods of seed 000 / seed 001 Table 2, as :func:`kkt_solve`."""
    _check_keys(k, G, beta, num_value_heads, chunk_size, output_dtype, cu_seqlens,
                chunk_indices, num_chunks)
    k, G, beta = k.contiguous(), G.contiguous(), beta.contiguous()  # rows indexed as packed
    B, T, H, K = k.shape
    HV, C = num_value_heads, chunk_size
    iters = _solve_args(solve_method, solve_iters, C)
    tl_options = _tl_options(dot_precision, num_warps, diag, prefetch)
    if _use_gluon_from_k(kernel, k, C, solve_method, tl_options, maxnreg):
        from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_from_k_gluon
        return kkt_solve_from_k_gluon(k, G, beta, HV, output_dtype, cu_seqlens, chunk_indices,
                                      num_chunks, maxnreg)
    Ai = torch.empty(B, T, HV, C, dtype=output_dtype, device=k.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, C)
    direct.launch(
        kkt_solve_kernel, chunk_head_grid(NT, B, HV),
        None, k, G, beta, Ai, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, BT=C,
        BK=max(16, triton.next_power_of_2(K)), IS_VARLEN=cu_seqlens is not None, BUILD=True,
        METHOD=solve_method, NS_ITERS=iters, DOT_PREC=dot_precision, DIAG=diag,
        PREFETCH=prefetch, num_warps=num_warps or NUM_WARPS[solve_method],
        **_register_cap(maxnreg))
    return Ai


# How the forward and backward get every chunk's T (chunk_inverse) when the Gluon kernel from
# k cannot run (interpreter, fp32 keys, other chunk sizes and methods, non-NVIDIA): A formed by
# chunk_kkt and inverted from HBM by kkt_solve, or A's blocks formed inside the one-warp tl
# kkt_solve_from_k (A never written). One tl warp cannot hold a chunk's keys (64×128 bf16 would
# be 128 registers a thread), so from k it reloads a 16×128 key tile pair for each of the 10
# blocks and spills 1.1 KB; chunk_kkt forms K Kᵀ with one 4-warp product, and the A round trip
# costs 8 B × C per token and value head (~130 µs at B=8, T=4096, HV=32 on 4.2 TB/s). H200,
# (1, 32768): tl from k 435 µs; chunk_kkt 178 + kkt_solve 128 µs. The Gluon kernel from k
# stages the keys in shared memory instead, so it takes the GPU default (kernel="auto").
A_THROUGH_HBM = True


def default_inverse_dtype(dtype: torch.dtype) -> torch.dtype:
    """T's storage dtype for data in ``dtype``, in the materialized forward and in the backward's
    recompute alike (so that the backward recomputes the W and U a default materialized forward
    computed; the fused kernel keeps its T in fp32 on chip): fp32 for fp32 data, else the data
    dtype, which is what the W/U products read it in (fla stores its A so too)."""
    return torch.float32 if dtype == torch.float32 else dtype


def chunk_inverse(k, G, beta, num_value_heads, chunk_size, output_dtype=torch.float32,
                  cu_seqlens=None, chunk_indices=None, num_chunks=None,
                  solve_method="blocked", solve_iters=None):
    """T = (I + strictLower(diag(β)(Γ ⊙ K Kᵀ)))⁻¹ [B, T, HV, C] of every chunk from k [B,T,H,K],
    G [B,T,HV] (chunk-cumulated, fp64) and beta [B,T,HV] — the entry point of the materialized
    forward, the fused kernel's precomputed inverse and the backward's recompute. Runs the Gluon
    kkt_solve_from_k where it can (A never in HBM), else chunk_kkt + kkt_solve or the tl
    kkt_solve_from_k as A_THROUGH_HBM says (same T up to rounding: tests/test_kkt_solve.py);
    arguments as :func:`kkt_solve_from_k`."""
    if A_THROUGH_HBM and not _use_gluon_from_k("auto", k, chunk_size, solve_method, [], None):
        # kkt_solve_from_k checks its inputs itself; this route must check them first (chunk_kkt
        # trusts its caller, and kkt_solve sees only A)
        _check_keys(k, G, beta, num_value_heads, chunk_size, output_dtype, cu_seqlens,
                    chunk_indices, num_chunks)
        from gdn_fused.kernels.kkt import chunk_kkt
        A = chunk_kkt(k, G, beta, num_value_heads, chunk_size, cu_seqlens, chunk_indices,
                      num_chunks)
        return kkt_solve(A, output_dtype, cu_seqlens, chunk_indices, num_chunks,
                         solve_method=solve_method, solve_iters=solve_iters)
    return kkt_solve_from_k(k, G, beta, num_value_heads, chunk_size, output_dtype, cu_seqlens,
                            chunk_indices, num_chunks, solve_method=solve_method,
                            solve_iters=solve_iters)
