"""kkt_solve: T = (I + A)⁻¹ for the strictly lower A of each chunk, by blocked recursion.

Method (seed 000, the kkt_solve article; seed 001, Table 2 "blocked"): the chunk of C = 16·NB
rows is cut into an NB×NB grid of 16×16 blocks. The NB diagonal blocks are inverted side by
side by forward substitution (15 dependent steps for all of them together, instead of C − 1
for the whole chunk); the coupling blocks follow from matrix products,

    T_ij = −T_ii · Σ_{j ≤ m < i} A_im T_mj        (i > j),

level by level (i − j = 1, 2, 3), so the dependency depth is 15 + 2·(NB − 1) products. All
arithmetic is fp32; products use an explicit input precision (ieee by default).
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels.chunk_index import chunk_program

BLOCK = 16  # base block: the smallest tl.dot tile, and 15 substitution steps


@triton.jit
def _load_block(p_base, row_stride, i_t, seqlen, BT: tl.constexpr, ib: tl.constexpr,
                jb: tl.constexpr):
    """16×16 block (ib, jb) of the chunk's A; rows past the sequence end read as 0."""
    p = tl.make_block_ptr(p_base, (seqlen, BT), (row_stride, 1), (i_t * BT + ib * 16, jb * 16),
                          (16, 16), (1, 0))
    return tl.load(p, boundary_check=(0,)).to(tl.float32)


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
def _block_of(X3, b: tl.constexpr, NB: tl.constexpr):
    """Block b of a stacked [NB, 16, 16] tile (a masked sum: Triton has no register slicing)."""
    return tl.sum(tl.where(tl.arange(0, NB)[:, None, None] == b, X3, 0.), 0)


@triton.jit
def kkt_solve_kernel(A, Ai, cu_seqlens, chunk_indices, T, HV: tl.constexpr, BT: tl.constexpr,
                     IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seqlen = chunk_program(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    a_base = A + (bos * HV + i_hv) * BT
    t_base = Ai + (bos * HV + i_hv) * BT
    NB: tl.constexpr = BT // 16
    nb = tl.arange(0, NB)[:, None, None]
    # the NB diagonal blocks, stacked, so their substitutions run side by side
    L3 = tl.zeros([NB, 16, 16], dtype=tl.float32)
    for b in tl.static_range(NB):
        L3 += tl.where(nb == b, _load_block(a_base, HV * BT, i_t, seqlen, BT, b, b)[None], 0.)
    T3 = invert_diagonal_blocks(L3, NB)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    T00 = _block_of(T3, 0, NB)
    _store_block(t_base, HV * BT, i_t, seqlen, T00, BT, 0, 0)
    if NB >= 2:
        T11 = _block_of(T3, 1, NB)
        A10 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 1, 0)
        T10 = -tl.dot(T11, tl.dot(A10, T00, input_precision=DOT_PREC), input_precision=DOT_PREC)
        _store_block(t_base, HV * BT, i_t, seqlen, zero, BT, 0, 1)
        _store_block(t_base, HV * BT, i_t, seqlen, T10, BT, 1, 0)
        _store_block(t_base, HV * BT, i_t, seqlen, T11, BT, 1, 1)
    if NB == 4:
        T22 = _block_of(T3, 2, NB)
        T33 = _block_of(T3, 3, NB)
        A20 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 2, 0)
        A21 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 2, 1)
        A30 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 3, 0)
        A31 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 3, 1)
        A32 = _load_block(a_base, HV * BT, i_t, seqlen, BT, 3, 2)
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
            _store_block(t_base, HV * BT, i_t, seqlen, zero, BT, 0, jb)
            _store_block(t_base, HV * BT, i_t, seqlen, zero, BT, 1, jb)
        _store_block(t_base, HV * BT, i_t, seqlen, zero, BT, 2, 3)
        _store_block(t_base, HV * BT, i_t, seqlen, T20, BT, 2, 0)
        _store_block(t_base, HV * BT, i_t, seqlen, T21, BT, 2, 1)
        _store_block(t_base, HV * BT, i_t, seqlen, T22, BT, 2, 2)
        _store_block(t_base, HV * BT, i_t, seqlen, T30, BT, 3, 0)
        _store_block(t_base, HV * BT, i_t, seqlen, T31, BT, 3, 1)
        _store_block(t_base, HV * BT, i_t, seqlen, T32, BT, 3, 2)
        _store_block(t_base, HV * BT, i_t, seqlen, T33, BT, 3, 3)


def kkt_solve(A, output_dtype=torch.float32, cu_seqlens=None, chunk_indices=None,
              num_chunks=None, dot_precision="ieee"):
    """(I + A)⁻¹ per chunk. A: [B, T, HV, C] fp32 strictly lower (row t holds its chunk row;
    C in {16, 32, 64}); returns T of the same shape in ``output_dtype`` (fp32 or the input dtype).
    """
    B, T, HV, C = A.shape
    if C not in (16, 32, 64):
        raise ValueError(f"chunk size (A.shape[-1]) must be 16, 32 or 64, got {C}")
    Ai = torch.empty(B, T, HV, C, dtype=output_dtype, device=A.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, C)
    kkt_solve_kernel[(NT, B * HV)](A, Ai, cu_seqlens, chunk_indices, T, HV=HV, BT=C,
                                   IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision)
    return Ai
