"""Chunk-local cumulative log-decay G_i = g_1 + … + g_i, the first materialized kernel.

G is kept in fp64 (8 bytes per token and value head, next to ~1 KB of q, k, v, o): every
decay the chunk uses is a difference G_i − G_j or G_C − G_i, and in fp32 such a difference
loses ulp(|G|) — 1e-3 absolute once a very negative gate has pushed |G| to 1e4, which was a
1e-3 relative error on o. Kernels take the difference in fp64 and exponentiate in fp32.

Also the gate math every kernel shares: chunk_log_decay (G of one chunk, recomputed from g by
the backward kernels), gated_decay (the masked matrix e^{G_i − G_j}) and decay (the masked
vector e^{D})."""
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program, sm_count
from gdn_fused.kernels.pdl import pdl_options
from gdn_fused.reference import LOG_DECAY_MIN

# the op's floor on g (gdn_fused.ops): applied where each kernel loads g, so that an inference
# call needs no clamp launch of its own (its autograd path keeps torch's clamp, whose gradient
# it needs); NaN stays NaN as with torch.clamp
G_MIN = tl.constexpr(LOG_DECAY_MIN)


@triton.jit
def floored(b_g):
    """g floored at LOG_DECAY_MIN (−inf included), NaN kept."""
    return tl.maximum(b_g, G_MIN, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def chunk_log_decay(g, bos, i_t, seqlen, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """G [C] fp64 of chunk i_t: the cumsum of the per-token g (row stride HV, first row bos);
    rows past the sequence end read g = 0, so G stays flat there.

    fp64 because the gate gradient under strong decay is made of e^{G_i − G_j} for neighbouring
    rows: an fp32 cumsum rounds G_i by up to ulp(|G|)/2 (2.4e−4 at |G| = 4480 = 64 · 70), which
    becomes the relative error of e^{G_i − G_j}. From fp64 G the differences are good to
    ~1e−7 relative (decay, gated_decay). C fp64 additions per program cost nothing."""
    o_i = tl.arange(0, BT)
    valid = (i_t * BT + o_i) < seqlen
    b_g = floored(tl.load(g + (bos + i_t * BT + o_i) * HV + i_hv, mask=valid, other=0.))
    return tl.cumsum(b_g.to(tl.float64), axis=0)


@triton.jit
def gated_decay(b_G_row, b_G_col, mask):
    """exp(G_i − G_j) in fp32 where mask holds, else 0. The difference is taken in G's dtype
    (fp64: exact for the chunk's gates) and selected before the exp, so an entry above the
    diagonal (positive exponent) never overflows into inf·0 = NaN."""
    diff = (b_G_row[:, None] - b_G_col[None, :]).to(tl.float32)
    return tl.where(mask, tl.exp(tl.where(mask, diff, 0.)), 0.)


# log2(e) in fp64 (the chain rows' G·log2(e); Python's float is fp64)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def decay(b_D, valid):
    """exp(D) [C] fp32 on valid rows, else 0, for an fp64 exponent D ≤ 0 (G_i itself, or
    G_C − G_i); rows past the end are selected away before the exp."""
    return tl.where(valid, tl.exp(tl.where(valid, b_D, 0.).to(tl.float32)), 0.)


# value heads a program of the cumsum and gate-row kernels, at most: [C, 16] tiles of g, β and G
# read and written as whole 64-byte (fp32) and 128-byte (fp64) row pieces. One head a program
# read and wrote them 4 and 8 bytes a row apart: 36 µs at (1, 32768) and (8, 4096), HV = 32, on
# the H200 (eval.kernel_times, session 27), 21.6 µs with 16 heads (the bytes: ~12 µs). Fewer
# heads a program where that leaves too few programs (gate_heads)
GATE_HEADS = 16


def gate_heads(num_chunks: int, batch: int, num_value_heads: int, device) -> int:
    """Value heads a program of the cumsum: the most, up to GATE_HEADS and to HV's next power
    of two, that leave at least four programs an SM. H200, session 27 (fused forward graph,
    µs, 1 / 16 / 32 heads a program): (1, 32768) 784 / 756 / 753, (8, 4096) 568 / 554 / 545,
    (1, 2048) 74.6 / 78.3 / 79.3 (its 32 chunks: 1,024 programs at one head, 64 at 16)."""
    heads = min(GATE_HEADS, triton.next_power_of_2(num_value_heads))
    while heads > 1 and (num_chunks * batch * triton.cdiv(num_value_heads, heads)
                         < 4 * sm_count(device)):
        heads //= 2
    return heads


@triton.jit
def rows_and_heads(i_t, seqlen, o_h, HV: tl.constexpr, BT: tl.constexpr):
    """[C, BH] mask of chunk i_t's rows before the sequence end and the heads o_h below HV."""
    return ((i_t * BT + tl.arange(0, BT)) < seqlen)[:, None] & (o_h < HV)[None, :]


@triton.jit
def chunk_log_decays(g, bos, i_t, seqlen, o_h, HV: tl.constexpr, BT: tl.constexpr):
    """G [C, BH] fp64 of chunk i_t for the value heads o_h [BH] (those ≥ HV read 0), as
    chunk_log_decay for one."""
    o_i = tl.arange(0, BT)
    valid = rows_and_heads(i_t, seqlen, o_h, HV, BT)
    b_g = floored(tl.load(g + (bos + i_t * BT + o_i[:, None]) * HV + o_h[None, :], mask=valid,
                          other=0.))
    return tl.cumsum(b_g.to(tl.float64), axis=0)


@triton.jit
def store_gate_rows(rows, b_G, beta, i_b, i_t, seqlen, T, o_h, HV: tl.constexpr,
                    BT: tl.constexpr, ROWS: tl.constexpr):
    """Chunk i_t's gate rows of the heads o_h [BH] of batch row i_b (those ≥ HV left alone)
    from their G [C, BH] fp64 (sequence length seqlen, dense batches of T tokens): the layout
    the Gluon state kernels read by TMA (gluon_transposed._gate_rows), zero past the sequence
    end. ROWS 1: G; 2: G, β; 4 (the chain rows of forward_t; a TMA box's rows are a power of
    two): G, then six fp32 rows packed in three fp64 rows — β, e^G, the state update's decay
    e^{G_C − G}, γ = e^{G_C} in each entry (the per-step gate math the chain otherwise redoes
    from G: the same fp64 differences and fp32 exponentials, so the same bits), G·log2(e)
    rounded once to fp32 (the output's exponents (G_i − G_j)·log2(e) as differences of these,
    in base 2, the exponential's own base: fp32 instructions in place of fp64 ones, no
    multiply an entry; error analysis in gluon_transposed._scaled_scores), and a row of zeros
    (the box's last)."""
    NTC = tl.cdiv(T, BT) * BT
    o_i = tl.arange(0, BT)
    valid = rows_and_heads(i_t, seqlen, o_h, HV, BT)
    heads = (o_h < HV)[None, :]   # every row of these heads' chunk is written: zeros past T
    row0 = (i_b * HV + o_h[None, :]).to(tl.int64) * ROWS * NTC
    p_row = rows + row0 + i_t * BT + o_i[:, None]
    tl.store(p_row, tl.where(valid, b_G, 0.), mask=heads)
    if ROWS > 1:
        b_beta = tl.load(beta + (i_b * T + i_t * BT + o_i[:, None]) * HV + o_h[None, :],
                         mask=valid, other=0.)
        if ROWS == 2:
            tl.store(p_row + NTC, b_beta.to(tl.float64), mask=heads)
        else:
            # fp64 row r's entries of chunk i_t are fp32 entries [2·i_t·C, 2·i_t·C + 2C) of
            # that row: two fp32 rows of C a chunk
            p32 = (rows + row0).to(tl.pointer_type(tl.float32), bitcast=True)
            p32 += 2 * i_t * BT + o_i[:, None]
            last = tl.minimum(seqlen - i_t * BT, BT) - 1
            G_last = tl.sum(tl.where(o_i[:, None] == last, b_G, 0.), 0)
            tl.store(p32 + 2 * NTC, b_beta.to(tl.float32), mask=heads)
            tl.store(p32 + 2 * NTC + BT, decay(b_G, valid), mask=heads)
            tl.store(p32 + 4 * NTC, decay(G_last[None, :] - b_G, valid), mask=heads)
            tl.store(p32 + 4 * NTC + BT, tl.zeros([BT, 1], tl.float32) +
                     tl.exp(G_last.to(tl.float32))[None, :], mask=heads)
            L = tl.where(valid, b_G * tl.full([BT, 1], LOG2E, tl.float64), 0.)
            tl.store(p32 + 6 * NTC, L.to(tl.float32), mask=heads)
            tl.store(p32 + 6 * NTC + BT, tl.zeros([BT, 1], tl.float32), mask=heads)


@triton.jit
def gate_program(T, cu_seqlens, chunk_indices, HV: tl.constexpr, BH: tl.constexpr,
                 BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(chunk index in its sequence, batch row, the value heads [BH], first token row, sequence
    length) of a program on chunk_head_grid(NT, B, cdiv(HV, BH)): BH heads a program."""
    NHB: tl.constexpr = (HV + BH - 1) // BH
    # chunk_head_program's value head is the head block here
    i_t, i_hb, _, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, NHB, NHB, BT,
                                                   IS_VARLEN)
    return i_t, bos // T, i_hb * BH + tl.arange(0, BH), bos, seqlen


@triton.jit
def chunk_cumsum_kernel(g, G, beta, rows, cu_seqlens, chunk_indices, T, HV: tl.constexpr,
                        BT: tl.constexpr, IS_VARLEN: tl.constexpr, ROWS: tl.constexpr,
                        BH: tl.constexpr, PDL: tl.constexpr = False):
    """G (and the gate rows) of chunk i_t of BH value heads. PDL (kernels/pdl.py): wait for the
    previous grid first, then let the next one (the inverse) start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    i_t, i_b, o_h, bos, seqlen = gate_program(T, cu_seqlens, chunk_indices, HV, BH, BT,
                                              IS_VARLEN)
    b_G = chunk_log_decays(g, bos, i_t, seqlen, o_h, HV, BT)
    o_i = tl.arange(0, BT)
    tl.store(G + (bos + i_t * BT + o_i[:, None]) * HV + o_h[None, :], b_G,
             mask=rows_and_heads(i_t, seqlen, o_h, HV, BT))
    if ROWS > 0:
        # dense batches only (bos = i_b · T)
        store_gate_rows(rows, b_G, beta, i_b, i_t, seqlen, T, o_h, HV, BT, ROWS)


@triton.jit
def gate_rows_kernel(G, beta, rows, T, HV: tl.constexpr, BT: tl.constexpr,
                     ROWS: tl.constexpr, BH: tl.constexpr):
    """The gate rows of a dense batch from G itself (store_gate_rows)."""
    i_t, i_b, o_h, bos, seqlen = gate_program(T, None, None, HV, BH, BT, False)
    o_i = tl.arange(0, BT)
    b_G = tl.load(G + (bos + i_t * BT + o_i[:, None]) * HV + o_h[None, :],
                  mask=rows_and_heads(i_t, seqlen, o_h, HV, BT), other=0.).to(tl.float64)
    store_gate_rows(rows, b_G, beta, i_b, i_t, seqlen, T, o_h, HV, BT, ROWS)


def _row_count(fn, g, gate_rows, chain_rows):
    """R, the rows a head (1 + len(gate_rows), or 4 for the chain rows), and beta (contiguous
    or None); ValueError for a list other than [] or [beta] with beta shaped as g, and for
    chain_rows without beta."""
    if len(gate_rows) > 1:
        raise ValueError(f"{fn}: gate_rows takes [] or [beta], got {len(gate_rows)} tensors")
    if chain_rows and not gate_rows:
        raise ValueError(f"{fn}: chain_rows needs gate_rows=[beta]")
    # the kernel indexes beta as g's dense [B, T, HV] (HF passes strided slices)
    beta = gate_rows[0].contiguous() if gate_rows else None
    if beta is not None and beta.shape != g.shape:
        raise ValueError(f"{fn}: beta {tuple(beta.shape)} is not g's {tuple(g.shape)}")
    return (4 if chain_rows else 1 + len(gate_rows)), beta


def chunk_cumsum(g, chunk_size, cu_seqlens=None, chunk_indices=None, num_chunks=None,
                 gate_rows=None, chain_rows=False):
    """g [B, T, HV] (any float dtype) -> G [B, T, HV] fp64, cumulated within each chunk.

    gate_rows: None, or a list of the gate tensors after G itself — [] or [beta] ([B, T, HV],
    any float dtype) — whose rows the Gluon state kernels read by TMA
    (kernels/gluon_transposed.py, _gate_rows: [B·HV·R, ⌈T/C⌉·C] fp64, R = 1 + len(gate_rows),
    zero past T; the Gluon kernels read them at chunk_size 64) to write in the same launch;
    chain_rows (with [beta]): R = 4, the rows forward_t's chain reads (store_gate_rows).
    Dense batches only (ValueError with cu_seqlens, or a beta not shaped as g). Returns G, or
    (G, rows) with gate_rows. The rows cost the host a launch's worth of torch ops less than
    _gate_rows (session 11, eval.host_time)."""
    B, T, HV = g.shape
    G = torch.empty(B, T, HV, dtype=torch.float64, device=g.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    R, rows, beta = 0, None, None
    if chain_rows and gate_rows is None:
        raise ValueError("chunk_cumsum: chain_rows needs gate_rows=[beta]")
    if gate_rows is not None:
        if cu_seqlens is not None:
            raise ValueError("chunk_cumsum: gate_rows are laid out for dense batches; got "
                             "cu_seqlens")
        R, beta = _row_count("chunk_cumsum", g, gate_rows, chain_rows)
        rows = G.new_empty(B * HV * R, NT * chunk_size)
    BH = gate_heads(NT, B, HV, g.device)
    direct.launch(chunk_cumsum_kernel, chunk_head_grid(NT, B, triton.cdiv(HV, BH)), g, G, beta,
                  rows, cu_seqlens, chunk_indices, T, HV=HV, BT=chunk_size,
                  IS_VARLEN=cu_seqlens is not None, ROWS=R, BH=BH, **pdl_options(g.device))
    return G if gate_rows is None else (G, rows)


def gate_rows_from(G, gate_rows, chain_rows=False, chunk_size=64):
    """The rows chunk_cumsum(g, chunk_size, gate_rows=gate_rows, chain_rows=chain_rows)
    writes beside G, from G [B, T, HV] itself (any float dtype, read in fp64; dense batches);
    ValueError as there."""
    B, T, HV = G.shape
    R, beta = _row_count("gate_rows_from", G, gate_rows, chain_rows)
    # fp64 whatever G's dtype: store_gate_rows' offsets count 8-byte entries
    rows = G.new_empty(B * HV * R, triton.cdiv(T, chunk_size) * chunk_size,
                       dtype=torch.float64)
    NT = triton.cdiv(T, chunk_size)
    BH = gate_heads(NT, B, HV, G.device)
    direct.launch(gate_rows_kernel, chunk_head_grid(NT, B, triton.cdiv(HV, BH)), G.contiguous(),
                  beta, rows, T, HV=HV, BT=chunk_size, ROWS=R, BH=BH)
    return rows
