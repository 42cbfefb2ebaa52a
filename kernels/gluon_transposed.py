"""The chunk-state recurrence and the chunk output in one warp-specialized Gluon kernel for
Hopper (sm_90a), with the state held *transposed* (Sᵀ, value rows × key columns) so that both
products on the sequential chain take their left operand from registers. The materialized
forward runs it in place of chunk_state + chunk_output where it applies
(``materialized.uses_state_output_kernel``).

Per sequence, value head and block of BV = 64 value columns, over chunks c of C = 64 tokens,
with S the [K, BV] state entering chunk c (h_c of the materialized forward):

    V'ᵀ = Uᵀ − Sᵀ Wᵀ                                                    ("v_new")
    Sᵀ  ← e^{G_C} Sᵀ + V'ᵀ D_{e^{G_C − G}} K                              (fp32)
    O   = scale (D_{e^G} Q h_c + P V'),   P = (Q Kᵀ) ⊙ M,  M_ij = e^{G_i − G_j}, j ≤ i

Why transposed: kernels/gluon_state_output.py keeps S as [K, BV], so W S and Kᵀ V' need S and
V' as the *right* (B) operand, which warpgroup MMA reads only from shared memory: each chunk
stores S and V' to shared, fences, barriers and waits — 3.1 µs a chunk step on the H200 at
B·HV = 32 (docs/fused_design.md, session 3). With Sᵀ [BV, K] both chained products have the
running quantity on the left, and wgmma's A operand may come from registers: the fp32
accumulator is rounded to bf16 and converted in place to the operand layout (FlashAttention-3's
P·V trick; no shared-memory traffic in the PTX). BV = 64 is wgmma's M. Measured on the H200
(state only, ``output=False``): 502 µs at (1, 32768), ~1 µs a chunk step (433 in a first form
whose gate vectors came from the other warpgroup).

Why these roles (gl.warp_specialize), each found by measurement (docs/speed_log.md, sessions 6
and 7):

- the chain (default partition, one warpgroup) does only what S depends on, and after each
  step stores h_c (bf16 Sᵀ) and V' to per-stage shared buffers for the output;
- the output warpgroup forms P from its own Q Kᵀ while the chain runs, then O from h_c and V'
  and stores it (TMA from a staging tile). Issuing the output's products from the chain instead
  lengthened each step from ~0.9 to ~1.9 µs (980 µs at (1, 32768)); one output warpgroup
  878–882 µs holding its ring stage until O's products had run, 946–954 releasing it early.
  Its chunk (three dependent products, the mask, the store) takes longer than the chain's
  step, so two output warpgroups take alternate chunks (``OUT_GROUPS = 2``, each with its own
  ring stage (with 2 stages) and staging tile): 791–796 µs, the default;
- one producer warp streams q, k, w, u and the chunk's gates by TMA into a 2-stage ring
  (``gluon_ring.load_ring``; a third stage measured no faster). The gates come by TMA, not by
  global loads, because the chain's per-step proxy fence (MEMBAR) waits for every outstanding
  load: prefetching G with ``gl.load`` made the state-only pass 433 → 680 µs.

Each consumer of a ring stage releases it (its empty barrier counts one arrival from each:
the chain, the output warpgroup owning the chunk, and with WU the W/U warpgroup); the output
warpgroup does so once its Q Kᵀ has run (Q stays in registers, ``Q_REGS``), not after O.
h_c and V' have their own pair of barriers per stage: sv_ready (the chain wrote them),
sv_empty (the output's products read them). Alone, that early release measured slower
(878 → 946 µs with one output warpgroup, in two consecutive device calls: the hypothesis
that the ring's refill waited for the output was wrong); with two output warpgroups it is
the faster form (796 against 872 µs holding the stage, same run), so it is the default.

Precision: as chunk_state + chunk_output for bf16 (S and V' rounded to bf16 for their products,
fp32 accumulation, P in bf16, the state in fp32): o and the final state are bit-identical to
theirs in the GPU tests. (Carrying S and V' as bf16 hi + lo pairs in the two chained products
was measured: g = 0 at T = 8192 state error 3.9e-3 → 3.0e-3 for 20 % more time — the bf16
rounding of W and U in HBM, not of S, dominates; not kept.)

Scope: dense batches (no cu_seqlens), K = V = 128, chunk 64, bf16 q/k/w/u, HV a multiple of H.
T need not be a multiple of 64: the ring's tiles are 2-D over the flattened [B·T] token axis,
so the last chunk of a sequence may read the next sequence's first rows; those get zero decay
weight (no state change), zero rows of P (and P's columns past T meet only such rows), and a
partial chunk's output is stored with a row mask instead of TMA (whose box would write into
the next sequence). Those rows are multiplied by zero, not selected away, so a non-finite
value there would reach the previous sequence: the materialized forward routes here only
batches where no chunk straddles two sequences. The gates are repacked as [B·HV, T] rows,
zero past T.

Sequence splitting (``segments``; by default for sequences of 256+ chunks at small B·HV, 64+
while a CUDA graph is captured: ``num_segments``, ``min_chunks_to_split``): the state update is
affine in the entering state, so a segment of chunks maps S_in ↦ M S_in + b; a first launch runs
this kernel's state pass alone (``MAP``) over the K + V columns of [M | b] from [I | 0] (M's
columns read no values) for every segment but the last, ``compose_segment_states`` composes the
entering states exactly (fp64, tiny), and the main launch runs all segments side by side. Exact
algebra, as kernels/fused_split.py: heads with g = 0 compose like decaying ones. With two
segments (the default's only split) the first launch is instead the state pass alone over
segment 0 from h0 (``SEG0_END``, session 18: V columns, half the programs, no composition), so
the split gives the unsplit pass's bits.

``forward_t``, the fused backend's forward on Hopper (kernels/fused_fwd.py,
WARP_SPECIALIZED): the forward after kkt_solve_from_k's bf16 inverse T in this one kernel, its
ring holding T, v and the gate rows in place of W and U (with V' on the chain the chain rows,
``CHAIN_GATE_BLOCK``: G and, in fp32, β, e^G, the update's decay, γ and G·log2(e) (the
output's exponents since session 23; G as hi + lo in session 22), written by chunk_cumsum;
with the W/U warpgroup the (G, β) pairs). Since session 18 (``CHAIN_T``, the default
``T_ON_CHAIN``) the chain forms V' itself, by the algebra of the plain fused kernel
(kernels/fused_fwd.py: W is never formed):

    V'ᵀ = (Vᵀ − (Sᵀ Kᵀ) D_{e^G}) D_β Tᵀ

one product more on the chain (Xᵀ Tᵀ, 4 k-steps: Sᵀ Kᵀ replaces Sᵀ Wᵀ), and no W/U
warpgroup, which leaves the registers for two output warpgroups (166 KB of shared memory,
chain 232 registers, 48 B of spill stores and 60 of loads; 96 / 172 with the checkpoint
stores of a training forward, in their branch once every 64 chunks). Measured on the H200
(eval.bench --sweep forward_t, docs/results/sweep_forward_t_chain_2026-12-01_s18.log): a
chunk step unsplit 2.19 → 1.92 µs;
(1, 32768) split 1,060 → 866–871 µs, (8, 4096) 647 → 539–561, (32, 2048) 1,337 →
1,135–1,139. The chain alone steps in 1.21 µs (0.95 reading W and U from HBM, 1.63 beside a
W/U warpgroup): a fourth role lengthened the chain's step by more than its own products, as
every role measured in session 12 did. Its errors: bf16 rounds V − D_{e^G} K S after the
subtraction, where the W/U form rounds W and U before it; against fp64, lower where the
state carries far (at (1, 8192) with g = 0: o 4.54e-3 → 4.00e-3, final state 3.95e-3 →
3.26e-3; logsigmoid decay state 2.84e-3 → 2.28e-3; strong decay state 2.34e-3 → 1.60e-3),
within ±0.35e-3 either way in short cases (at (4, 40) the state 2.00e-3 → 2.34e-3;
docs/fused_design.md, session 18). Since session 21 the state update takes D V' as high and
low halves where a chunk keeps more than half of the state (STATE_UPDATE_LO): g = 0 at
(1, 8192) o 3.47e-3, final state 2.45e-3. Since session 23 the output's mask is 2^{l_i − l_j}
from fp32 rows l = G·log2(e) (ex2.approx.ftz, scale in the exponent): its loop 623 → 382 SASS
instructions a chunk, short enough for one output warpgroup to keep up with the chain
(``CHAIN_OUTPUT_GROUPS = 1``: 160 KB, 168 registers at launch, no spills; fused forward
−0.5 to −2.4 % on the H200, the same bits).

Two chains a program (``TWO_CHAINS``, session 26): where it takes fewer waves of step-times
(:func:`two_chains_pay`: on the H200 (8, 4096), (32, 2048) and B·HV of 67–132, not 133–198,
not the split (1, 32768) or (1, 2048)), the main launch runs both value blocks of a head in
one program: chain 0 the default partition, chain 1 a worker warpgroup (184 registers
each), their own v tiles and hand-off stages, the ring's q, k, T and gate tiles shared, and
one output warpgroup for both (:func:`_output_pair_partition`, 120 registers): P formed once,
both blocks' products in flight together, O stored from each block's V' tile. The chains
alone step 1.73× as fast as one chain a program (forward_t without the output 245 against
424 µs at (8, 4096)); with the output, forward_t 427 → 359–366 µs at (8, 4096), 898–907 →
751–762 at (32, 2048); the same bits as one chain (H200; docs/fused_design.md, session 26).

The W/U form (``WU``, ``forward_t(t_on_chain=False)``, the route from session 10 to 17): a
fourth warpgroup forms each chunk's W and U from T and the ring's k and v (207 KB of shared
memory, four roles at 128 registers a thread before setmaxnreg, chain 232, one output
warpgroup: a fifth role does not fit the registers). H200,
session 10 (eval.bench, in the fused column): 0.90 ms at (8, 4096) and 1.79 at (32, 2048),
against 1.02 and 2.04 for the materialized forward's recompute_w_u and this kernel with two
output warpgroups; 1.34 against 1.28 at (1, 32768), split in two segments, where its map
pass forms W and U too (session 7, unsplit, one output group each: 1,053–1,086 µs against
1,015–1,068). Its state error is the materialized forward's (W, U and V' rounded to bf16 for
the chain's products), not the plain fused kernel's (fp32 T at tf32): bf16 at (1, 8192), 2.5e-3
against 0.8e-3 with logsigmoid decay, 4.0e-3 against 1.5e-3 at g = 0 (tests/test_fused.py).
Experimental, correct on the GPU but not faster, so not routed (docs/speed_log.md, session 7):
``chunk_state_t`` (``STORE_H``):
chunk_state's contract for the backward's recompute, the second warpgroup storing h_c and V'
(132 KB, no spills); bit-identical, but 1,121–1,187 µs against chunk_state's 655, with one
store warpgroup or two on alternate chunks (``_store_h``).
"""
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gdn_fused.kernels import chunk_index
from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.gluon_ring import (CHUNK, HEAD_DIM, LOAD_REGS, LOAD_WARPS,
                                          accumulator_layout, descriptor_layout, load_ring,
                                          ring_barriers, ring_buffers, ring_program)
from gdn_fused.kernels.chunk_gate import gate_rows_from
from gdn_fused.kernels.chunk_index import sm_count
from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS, checkpoint_slabs
from gdn_fused.kernels.gluon_wu import _max, _sum
from gdn_fused.kernels.pdl import gl_wait_for_previous_grid, pdl_options
from gdn_fused.kernels import streams

BV = 64  # value rows of Sᵀ a program: wgmma's M, one warpgroup
NUM_STAGES = 2  # ring depth of q/k/w/u tiles (56 KB a stage)
OUT_WARPS = gl.constexpr(4)  # the output warpgroup: wgmma's M = 64 is the chunk
# its live set: the Q Kᵀ accumulator, then P as a bf16 operand and the [64, 64] output (32 a
# thread each), the fp64 G rows
OUT_REGS = gl.constexpr(128)
# 4 + 4 + 1 warps, padded to 12: 65,536 / (12 · 32) = 170 registers a thread before setmaxnreg
# hands the chain's warpgroup what the other two do not use
MAXNREG = 168
# the W/U warpgroup (experimental, WU): T as a bf16 operand, the [64, 128] W accumulator
WU_WARPS = gl.constexpr(4)
WU_REGS = gl.constexpr(128)
MAXNREG_WU = 128  # 4 + 4 + 1 + 4 warps, padded to 16: 65,536 / (16 · 32)
# with P formed by the W/U warpgroup (P_ON_WU): the output's live set is Q, O and the gates,
# the W/U one's adds Q Kᵀ's accumulator and the mask's fp64 differences
OUT_REGS_P = gl.constexpr(96)
WU_REGS_P = gl.constexpr(160)
# O's TMA staging tiles an output warpgroup. Leaving the O store out took forward_t's step
# 2.19 → 2.00 µs at (1, 32768), but a second tile (each chunk's O then waits only for the
# store two chunks back) measured no faster: forward_t 1,059 vs 1,062 µs at (1, 32768), 637
# vs 621 at (8, 4096), 1,338 vs 1,322 at (32, 2048) (session 12, docs/speed_log.md): the
# store's own work (shared-memory write, fence, barrier) is what costs, not the wait
O_STAGING = gl.constexpr(1)
# output warpgroups taking alternate chunks (OUT_GROUPS) in chunk_state_output_t (W and U
# from HBM: the materialized route), and the launch's register cap then (4 + 4 + 4 + 1 warps,
# padded to 16, as with W/U on chip)
OUTPUT_GROUPS = 2
# forward_t's (V' on the chain): two from session 18, when the output's chunk (~1,300 SASS
# instructions with its fp64 mask) outlasted the chain's step; one since session 23, whose
# output loop (2^x from fp32 rows, 382 instructions) keeps up: the same bits, fused forward
# graph −1.6 % at (8, 4096), −0.5 % at (1, 32768), −1.8 % at (32, 2048), −2.4 % at
# (1, 8192), +0.4 % at (1, 2048) on the H200; 160 KB of shared memory instead of 168, 168
# registers at launch, no spills (32 / 40 B with two)
CHAIN_OUTPUT_GROUPS = 1
# forward_t's V' formed by the chain from T and v (CHAIN_T), no W/U warpgroup (session 18;
# the W/U form is t_on_chain=False)
T_ON_CHAIN = True
# forward_t's main launch with both value blocks of a head in one program (CHAINS = 2: two
# chain warpgroups, one output warpgroup, q, k, T and the gate rows loaded once for both)
# where it takes fewer step-times (:func:`two_chains_pay`). Why: a chain's step is
# latency-bound (session 22's ncu: its warps issue 27–31 % of the time, waiting on their own
# products and conversions), and one program an SM fits (168 registers × 384 threads); a
# second chain in the same program fills the gaps: H200, session 26, forward_t alone, the
# chains without the output 245 µs at (8, 4096) against 424 for one chain a program.
# GDN_TWO_CHAINS=0 keeps one chain a program everywhere (the same bits).
TWO_CHAINS = os.environ.get("GDN_TWO_CHAINS", "1") != "0"
# A two-chain program's chunk step over a one-chain program's, both with the output (H200,
# session 26, forward_t alone, per wave of programs: (8, 4096) 2.83 / 1.67 µs, (32, 2048)
# 2.96 / 1.76 µs; docs/results/diag_two_chains_pair_2026-12-02_s26.log). 0 takes two chains
# wherever they apply (tests, A/B)
TWO_CHAIN_STEP_RATIO = 1.7
MAXNREG_TWO_OUTPUTS = 128
# forward_t with two chains a program (TWO_CHAINS): 4 + 4 + 4 + 1 warps, padded to 16, take 128
# registers a thread at launch; setmaxnreg gives the output warpgroup CHAINS_OUT_REGS, the
# producer LOAD_REGS, chain 1 CHAIN_REGS and chain 0 (the default partition) the rest, 184
# too. eval.ptxas (sm_90a): a chain at 176 spills in its loop (13 loads, 4 stores a step), at
# 184 not; the output (_output_pair_partition) fits 120 with no spill in its loop once Q is
# read from shared memory (Q in registers: ptxas serialized every wgmma, C7512). 213 KB of
# shared memory, O staged in the V' tiles (an O staging tile of one block's first form made
# 226 KB; two would be 234, over the 227 KB an SM gives)
MAXNREG_TWO_CHAINS = 128
CHAIN_WARPS = gl.constexpr(4)
CHAIN_REGS = gl.constexpr(184)
CHAINS_OUT_REGS = gl.constexpr(120)
# the main launch's constexprs chunk_state_output_t's and forward_t's ``variant`` may set
# (launch variants for eval.bench, each measured, docs/speed_log.md): Q in registers with the
# early stage release, the two output groups' registers, O's staging tiles; with W/U on chip,
# P formed by the W/U warpgroup (P_ON_WU: no faster, session 12). Session 13 measured three
# more, bit-identical and no faster, and removed them: O stored from registers (1,059 →
# 1,127 µs at (1, 32768)), the W/U products cued by the chain's S Wᵀ (1,072) and the chain's
# decay vector formed by the W/U warpgroup (1,086; its chain loop 584 → 362 SASS
# instructions a step)
VARIANT_KEYS = frozenset({"Q_REGS", "OUT_REGS_TWO", "O_BUFFERS", "P_ON_WU"})


@gluon.jit
def _gate_row(g_bufs, s, row: gl.constexpr):
    """Row ``row`` of stage s's gate tile as a [C] view: the tile is [1, C] (G), with W and U
    formed on chip [2, C] (G, then β), with V' on the chain [4, C] (G, then the chain rows
    read by :func:`_chain_rows`)."""
    ROWS: gl.constexpr = g_bufs.type.shape[1]
    BT: gl.constexpr = g_bufs.type.shape[2]
    # flat rows are the tile's bytes only while its layout is unswizzled (fp64 [2, C] is)
    gl.static_assert(g_bufs.type.layout.swizzle_byte_width == 0)
    if ROWS == 1:
        g = g_bufs.index(s).reshape([BT])
    else:
        # the unswizzled [ROWS, C] fp64 tiles read as flat rows (a sliced view cannot be
        # reshaped in Triton 3.6, and a rank-2 layout cannot index to rank 1)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        g = g_bufs._reinterpret(gl.float64, [g_bufs.type.shape[0] * ROWS, BT], flat)
        g = g.index(s * ROWS + row)
    return g


# the fp32 rows of a chain-row tile (CHAIN_GATE_BLOCK, as chunk_gate.store_gate_rows writes
# it): its fp64 [4, C] as eight fp32 rows, G's two halves first, zeros last
BETA_ROW, EXP_G_ROW, DECAY_ROW, GAMMA_ROW, LOG2_G_ROW = (gl.constexpr(r) for r in range(2, 7))


@gluon.jit
def _chain_row(g_bufs, s, r: gl.constexpr, layout: gl.constexpr):
    """fp32 row r of stage s's chain-row tile as a [C] vector in ``layout``."""
    ROWS: gl.constexpr = g_bufs.type.shape[1]
    BT: gl.constexpr = g_bufs.type.shape[2]
    gl.static_assert(ROWS == 4 and g_bufs.type.layout.swizzle_byte_width == 0)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    f = g_bufs._reinterpret(gl.float32, [g_bufs.type.shape[0] * ROWS * 2, BT], flat)
    return f.index(s * ROWS * 2 + r).load(layout)


@gluon.jit
def _chain_rows(g_bufs, s, layout: gl.constexpr):
    """(β, e^G, decay, γ) of stage s's chain-row tile: fp32 [C] vectors in ``layout`` (decay
    and e^G 0 past T) and γ = e^{G_C} a scalar (it fills its row: the max is its value)."""
    return (_chain_row(g_bufs, s, BETA_ROW, layout), _chain_row(g_bufs, s, EXP_G_ROW, layout),
            _chain_row(g_bufs, s, DECAY_ROW, layout),
            _max(_chain_row(g_bufs, s, GAMMA_ROW, layout), 0))


@gluon.jit
def _chunk_decay(b_G, i_t, T, o_c):
    """(decay [C], γ) of chunk i_t from its G row b_G: decay_i = e^{G_C − G_i} on rows before
    T, else 0 (G_C − G_i ≤ 0 cannot overflow; rows past T leave the state unchanged), and
    γ = e^{G_C}, G_C picked out exactly (a sum of one term and zeros)."""
    valid = i_t * b_G.type.shape[0] + o_c < T
    G_last = _sum(gl.where(o_c == gl.minimum(T - i_t * b_G.type.shape[0], b_G.type.shape[0])
                           - 1, b_G, 0.), 0)
    decay = gl.where(valid, gl.exp((G_last - b_G).to(gl.float32)), 0.)
    return decay, gl.exp(G_last.to(gl.float32))


@gluon.jit
def _masked_scores(qk, diff, valid, o_t, o_j):
    """P = (Q Kᵀ) ⊙ M in bf16, M_ij = e^{G_i − G_j} for j ≤ i on rows before T, else 0, from
    diff [C, C] fp32 = G_i − G_j. Rows past T are selected away too: their G reads 0, so
    G_i − G_j may be > 0; the exponent is selected before the exp, so strong decay never
    gives inf · 0."""
    incl = (o_t[:, None] >= o_j[None, :]) & valid[:, None]
    return (qk * gl.where(incl, gl.exp(gl.where(incl, diff, 0.)), 0.)).to(gl.bfloat16)


@gluon.jit
def _exp2_ftz(x):
    """2^x elementwise by one ``ex2.approx.ftz.f32`` (MUFU.EX2). ``gl.exp2`` lowers to the
    non-flushing form, which ptxas wraps in a range check and two multiplies an entry (FSETP,
    FMUL, MUFU, FMUL) to reach subnormal results; flushed here, 2^x below 2^−126 is 0, and
    +inf above 2^128."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x],
                                     dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _scaled_scores(qk, l_i, l_j, incl):
    """P = scale (Q Kᵀ) ⊙ M in bf16 from the chain rows' l = fp32(G·log2(e)): M_ij =
    2^{l_i − l_j} ≈ e^{G_i − G_j} where incl (j ≤ i on rows before T), else 0, with l_i
    carrying + log2(scale) (scale in the exponent: one add a row, no multiply an entry).
    Above the diagonal 2^{…} may be +inf: the select, after the product, drops it.

    Error: l = G·log2(e)(1 + δ), |δ| ≤ 2^-24, and the two fp32 operations add ≤ 2^-24 of
    their results, so the exponent is off by ≤ ~2^-23 |G_i·log2(e)| where M_ij does not
    underflow (|l_j| ≤ |l_i| there) — relative error of M ≤ 5.4e-4 at g = −70 a token
    (|G| ≤ 4480 in a chunk of 64), ≤ 4e-5 at |g| ≤ 5, under P's own bf16 rounding (2^-9) in
    both; fla's fp32 G has the same order. Measured against the fp64 recurrence (H200,
    session 23): o and the final state equal to 4 digits to those of G·log2(e) as an fp32
    pair (hi + lo, ~1e-7) in every gate regime of eval.cases, at T = 1000 and 2 × 4096."""
    e = _exp2_ftz(l_i[:, None] - l_j[None, :])
    return (qk * gl.where(incl, e, 0.)).to(gl.bfloat16)


@gluon.jit
def _wu_partition(k_bufs, t_bufs, v_bufs, g_bufs, ready, empty, wp_bufs, up_bufs, wu_ready,
                  c0, n, q_bufs, p_bufs, p_ready, sv_empty, T, P_ON_WU: gl.constexpr):
    """Per chunk, W = T D_{βe^G} K and U = T D_β V into stage i_t % STAGES of wp_bufs / up_bufs,
    from the ring's T (bf16 [C, C]), k and v tiles: D scales T's columns in registers (the A
    operand), so k and v enter the products as loaded. (recompute_w_u scales k's and v's rows
    instead: the same products, one bf16 rounding at another place.) P_ON_WU: then the
    chunk's P = (Q Kᵀ) ⊙ M into p_bufs (ready on p_ready) for the output warpgroup, once that
    warpgroup has read the stage's previous P (sv_empty, which it arrives on after its
    products): P does not depend on the state, so the output's chunk, the longest role a
    step, shrinks to its two products after the chain."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    K: gl.constexpr = k_bufs.type.shape[2]
    BVr: gl.constexpr = v_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc_t: gl.constexpr = accumulator_layout(BT)
    acc_k: gl.constexpr = accumulator_layout(K)
    acc_v: gl.constexpr = accumulator_layout(BVr)
    a_w: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    a_u: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_v, k_width=2)
    cols: gl.constexpr = gl.SliceLayout(0, acc_t)
    for j in range(n):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        t = t_bufs.index(s).load(acc_t).to(gl.float32)
        b_G = _gate_row(g_bufs, s, 0).load(cols)
        b_beta = _gate_row(g_bufs, s, 1).load(cols).to(gl.float32)
        # β is 0 past T (the gate rows are zero-padded), so those columns of T drop out
        a = gl.convert_layout((t * (b_beta * gl.exp(b_G.to(gl.float32)))[None, :])
                              .to(gl.bfloat16), a_w)
        b_w = warpgroup_mma(a, k_bufs.index(s), gl.zeros([BT, K], gl.float32, acc_k),
                            use_acc=False)
        wp_bufs.index(s).store(b_w.to(gl.bfloat16))
        a = gl.convert_layout((t * b_beta[None, :]).to(gl.bfloat16), a_u)
        b_u = warpgroup_mma(a, v_bufs.index(s), gl.zeros([BT, BVr], gl.float32, acc_v),
                            use_acc=False)
        up_bufs.index(s).store(b_u.to(gl.bfloat16))
        # W and U are read by the chain's wgmmas (the async proxy): fence, all four warps,
        # then one arrive for them and one for the ring stage (its k, T, v reads are done)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(wu_ready.index(s), count=1)
        if P_ON_WU:
            qk = warpgroup_mma(q_bufs.index(s), k_bufs.index(s).permute((1, 0)),
                               gl.zeros([BT, BT], gl.float32, acc_t), use_acc=False)
            o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, acc_t))
            valid = (c0 + j) * BT + o_t < T
            b_Gi = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(1, acc_t))
            p = _masked_scores(qk, (b_Gi[:, None] - b_G[None, :]).to(gl.float32), valid, o_t,
                               gl.arange(0, BT, layout=gl.SliceLayout(0, acc_t)))
            # chunk j − STAGES's P read by the output warpgroup's products (passes at once the
            # first STAGES times)
            mbarrier.wait(sv_empty.index(s), ((j // STAGES) & 1) ^ 1)
            p_bufs.index(s).store(p)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(p_ready.index(s), count=1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _store_h(st_bufs, vn_bufs, sv_ready, sv_empty, h, v_new, T, c0, n, i_n, i_hv, i_v,
             HV: gl.constexpr, V: gl.constexpr, group: gl.constexpr = 0,
             GROUPS: gl.constexpr = 1):
    """Experimental (STORE_H, the backward's recompute): per chunk, once the chain has put
    h_c (Sᵀ) and V' in shared memory, store them to h [B·NT, HV, K, V] and v_new [B·T, HV, V]
    in chunk_state's layouts (h through a transposed view: rows of K, value columns
    contiguous); with GROUPS store warpgroups, this one takes chunks j ≡ group (mod GROUPS).
    (h_c is read transposed from its [BV, K] tile: 64 scalar 16-bit shared loads a thread a
    chunk. One or two store warpgroups time the same, 1,170 µs at (1, 32768): not this
    role's pace but something it shares with the chain binds — shared-memory bandwidth is the
    suspect; a TMA store of a [K, BV] copy of h_c would remove the loads.)"""
    K: gl.constexpr = st_bufs.type.shape[2]
    BVr: gl.constexpr = st_bufs.type.shape[1]
    BT: gl.constexpr = vn_bufs.type.shape[1]
    STAGES: gl.constexpr = st_bufs.type.shape[0]
    # 8 bf16 (16 bytes) a thread along the value columns: 128-byte rows a warp quarter
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, rows))
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, rows))
    o_v = gl.arange(0, BVr, layout=gl.SliceLayout(0, rows))
    NT = gl.cdiv(T, BT)
    for j in range(group, n, GROUPS):
        i_t = c0 + j
        s = j % STAGES
        mbarrier.wait(sv_ready.index(s), (j // STAGES) & 1)
        p_h = h + ((i_n * NT + i_t).to(gl.int64) * HV + i_hv) * K * V + i_v * BVr
        gl.store(p_h + o_k[:, None] * V + o_v[None, :],
                 st_bufs.index(s).permute((1, 0)).load(rows))
        t = i_t * BT + o_t
        p_v = v_new + ((i_n * T + t).to(gl.int64) * HV + i_hv) * V + i_v * BVr
        gl.store(p_v[:, None] + o_v[None, :], vn_bufs.index(s).load(rows),
                 mask=(t < T)[:, None])
        # every warp past its reads of h_c and V' before the one arrive (it reads no ring
        # stage: the ring has the chain as its one consumer then)
        gl.thread_barrier()
        mbarrier.arrive(sv_empty.index(s), count=1)


@gluon.jit
def _output_partition(q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs, sv_ready,
                      sv_empty, o_smem, o_desc, o, scale, T, c0, n, i_n, i_hv, i_v,
                      HV: gl.constexpr, V: gl.constexpr, STORE_H: gl.constexpr, h,
                      group: gl.constexpr = 0, GROUPS: gl.constexpr = 1,
                      Q_REGS: gl.constexpr = True, p_bufs=None, p_ready=None,
                      P_ON_WU: gl.constexpr = False):
    """Per chunk: P = (Q Kᵀ) ⊙ M and, once the chain has put h_c and V' in shared memory,
    O = scale (D_{e^G} Q h_c + P V') into o; with STORE_H, h_c and V' into h and o instead.

    Q_REGS: the ring stage is released as soon as Q Kᵀ has run, with Q kept in registers (the
    A operand of both its products, 32 registers a thread) and the gates read; else Q is read
    by wgmma from the stage, which is held until O's products have run (the module docstring
    has both forms' times). h_c and V' are released on their own barrier (sv_empty) once O's
    products have read them.

    With GROUPS output warpgroups, this one (``group``) takes chunks j ≡ group (mod GROUPS),
    always the same ring stage(s), and its own staging tiles of o_smem ([GROUPS · n, C, BV]:
    n a group, taken in turn, so that a chunk's O waits only for the TMA store n chunks
    back). P_ON_WU (with Q_REGS): P
    comes from the W/U warpgroup through p_bufs (ready on p_ready) instead of this one's Q Kᵀ;
    the stage is released once Q and the gates are in registers."""
    if STORE_H:
        _store_h(st_bufs, vn_bufs, sv_ready, sv_empty, h, o, T, c0, n, i_n, i_hv, i_v, HV, V,
                 group, GROUPS)
        return
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = vn_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc: gl.constexpr = accumulator_layout(BT)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, acc))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))
    gl.static_assert(STAGES % GROUPS == 0, "a ring stage belongs to one output warpgroup")
    O_BUFS: gl.constexpr = o_smem.type.shape[0] // GROUPS
    bos = i_n * T
    col = i_hv * V + i_v * BVr
    # with the chain rows (V' on the chain): the mask's exponents as differences of fp32
    # G·log2(e) (fp64 differences held 17 % of these warps' stall samples on the H200,
    # session 22), straight into 2^x, with scale in the exponent and in e^G's row: 623 / 682
    # → 433 / 445 SASS instructions in the two output groups' loops (session 23), forward_t
    # within ±1.5 % (the chain binds); 382 in the one loop of CHAIN_OUTPUT_GROUPS = 1
    CHAIN_ROWS: gl.constexpr = g_bufs.type.shape[1] == 4
    log2_scale = gl.log2(scale)
    o_scale = 1.0
    if not CHAIN_ROWS:
        o_scale = scale
    for j in range(group, n, GROUPS):
        i_t = c0 + j
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(ready.index(s), phase)
        valid = i_t * BT + o_t < T
        if CHAIN_ROWS:
            l_i = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(1, acc)) + log2_scale
            l_j = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(0, acc))
            e_G = _chain_row(g_bufs, s, EXP_G_ROW, gl.SliceLayout(1, acc)) * scale
        else:
            b_G = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(1, acc))
            b_Gj = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(0, acc))
            e_G = gl.exp(b_G.to(gl.float32))
        if Q_REGS:
            q_op = q_bufs.index(s).load(a_op)
        else:
            q_op = q_bufs.index(s)
        if P_ON_WU:
            gl.static_assert(Q_REGS, "P from the W/U warpgroup releases the stage early")
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s), count=1)
            mbarrier.wait(p_ready.index(s), phase)
            p = p_bufs.index(s)
        else:
            qk = warpgroup_mma(q_op, k_bufs.index(s).permute((1, 0)),
                               gl.zeros([BT, BT], gl.float32, acc), use_acc=False)
            if Q_REGS:
                # every warp past its reads of the stage (q, k, the gates) before the one
                # arrive
                gl.thread_barrier()
                mbarrier.arrive(empty.index(s), count=1)
            if CHAIN_ROWS:
                # rows past T are row-local (no later row reads them) and stored masked
                p = _scaled_scores(qk, l_i, l_j, o_t[:, None] >= o_j[None, :])
            else:
                p = _masked_scores(qk, (b_G[:, None] - b_Gj[None, :]).to(gl.float32), valid,
                                   o_t, o_j)
            p = gl.convert_layout(p, a_op)
        mbarrier.wait(sv_ready.index(s), phase)
        b_o = warpgroup_mma(q_op, st_bufs.index(s).permute((1, 0)),
                            gl.zeros([BT, BVr], gl.float32, acc), use_acc=False)
        b_o = warpgroup_mma(p, vn_bufs.index(s), b_o * e_G[:, None])
        # (synchronous products: retired here) every warp past them before the one arrive
        gl.thread_barrier()
        mbarrier.arrive(sv_empty.index(s), count=1)
        if not Q_REGS:
            mbarrier.arrive(empty.index(s), count=1)
        out = (b_o * o_scale).to(o_desc.dtype)
        row = bos + i_t * BT
        if (i_t + 1) * BT <= T:
            # the TMA store that last read this staging tile (O_BUFS of this group's chunks
            # back) must be done before it is rewritten; the newer ones may still run
            tile = o_smem.index(group * O_BUFS + (j // GROUPS) % O_BUFS)
            tma.store_wait(O_BUFS - 1)
            tile.store(out)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(o_desc, [row, col], tile)
        else:
            # a partial chunk (a TMA box would write into the next sequence's rows): stored
            # from registers
            o_v = gl.arange(0, BVr, layout=gl.SliceLayout(0, acc))
            gl.store(o + (row + o_t).to(gl.int64)[:, None] * (HV * V) + col + o_v[None, :],
                     out, mask=valid[:, None])
    tma.store_wait(0)


@gluon.jit
def _output_pair_partition(q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs, sv_ready,
                           sv_empty, o_desc, o, scale, T, c0, n, i_n, i_hv,
                           HV: gl.constexpr, V: gl.constexpr):
    """The output of a two-chain program (CHAINS = 2, V' on the chain): per chunk P = (Q Kᵀ)
    ⊙ M once, then O_c = scale (D_{e^G} Q h_c + P V'_c) for both value blocks c, chain c's
    h_c and V' in hand-off stages c·STAGES + s. Why not :func:`_output_partition` a block at
    a time: with two chains stepping side by side its synchronous products and stores bound
    the step (H200, session 26, (8, 4096): forward_t 359–388 µs, the chains alone 245). Here
    both blocks' products are in flight together (Q h_0, Q h_1, then P V'_0, P V'_1 as each
    Q h retires), and each O_c is stored by TMA from V'_c's own tile once P V'_c has read it
    (chain 0's tile released at the end of the chunk once its store has read it, chain 1's
    early in the next chunk, after its own store), so no separate staging tile has to be
    free before a block's O is written. Q is read by wgmma from the ring stage, which
    this warpgroup holds until both Q h products have retired: Q in registers beside both
    accumulators (and P) exceeds the warpgroup's 120 registers, and ptxas then serializes
    every wgmma of the kernel, the chains' included (C7512; also with P from shared memory).
    The arithmetic is the one-block output's: the same bits."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = vn_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc: gl.constexpr = accumulator_layout(BT)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc, k_width=2)
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, acc))
    o_j = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))
    o_v = gl.arange(0, BVr, layout=gl.SliceLayout(0, acc))
    bos = i_n * T
    col = i_hv * V
    log2_scale = gl.log2(scale)
    for j in range(n):
        i_t = c0 + j
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(ready.index(s), phase)
        l_i = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(1, acc)) + log2_scale
        l_j = _chain_row(g_bufs, s, LOG2_G_ROW, gl.SliceLayout(0, acc))
        e_G = _chain_row(g_bufs, s, EXP_G_ROW, gl.SliceLayout(1, acc)) * scale
        q_tile = q_bufs.index(s)
        qk = warpgroup_mma(q_tile, k_bufs.index(s).permute((1, 0)),
                           gl.zeros([BT, BT], gl.float32, acc), use_acc=False)
        # rows past T are row-local (no later row reads them) and stored masked
        p = gl.convert_layout(_scaled_scores(qk, l_i, l_j, o_t[:, None] >= o_j[None, :]), a_op)
        if j > 0:
            # the previous chunk's O_1 store has read V'_1's tile: chain 1 may rewrite it
            tma.store_wait(0)
            mbarrier.arrive(sv_empty.index(STAGES + (j - 1) % STAGES), count=1)
        mbarrier.wait(sv_ready.index(s), phase)
        b_o0 = warpgroup_mma(q_tile, st_bufs.index(s).permute((1, 0)),
                             gl.zeros([BT, BVr], gl.float32, acc), use_acc=False,
                             is_async=True)
        mbarrier.wait(sv_ready.index(STAGES + s), phase)
        b_o1 = warpgroup_mma(q_tile, st_bufs.index(STAGES + s).permute((1, 0)),
                             gl.zeros([BT, BVr], gl.float32, acc), use_acc=False,
                             is_async=True)
        # (the waits name the register operand of the products still in flight, p)
        b_o0 = warpgroup_mma_wait(num_outstanding=1, deps=[b_o0])
        b_o0 = warpgroup_mma(p, vn_bufs.index(s), b_o0 * e_G[:, None], is_async=True)
        b_o1, p = warpgroup_mma_wait(num_outstanding=1, deps=[b_o1, p])
        # both Q h products have read the stage (q, k, the gates read before): every warp
        # past them before the one arrive
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
        b_o1 = warpgroup_mma(p, vn_bufs.index(STAGES + s), b_o1 * e_G[:, None], is_async=True)
        b_o0, p = warpgroup_mma_wait(num_outstanding=1, deps=[b_o0, p])
        _store_o_block(b_o0, vn_bufs.index(s), o_desc, o, bos + i_t * BT, col, i_t, T, o_t, o_v,
                       HV, V)
        b_o1, p = warpgroup_mma_wait(num_outstanding=0, deps=[b_o1, p])
        _store_o_block(b_o1, vn_bufs.index(STAGES + s), o_desc, o, bos + i_t * BT, col + BVr,
                       i_t, T, o_t, o_v, HV, V)
        # block 0's store is older than block 1's: once at most one is pending, V'_0's tile
        # may be rewritten
        tma.store_wait(1)
        mbarrier.arrive(sv_empty.index(s), count=1)
    tma.store_wait(0)


@gluon.jit
def _store_o_block(b_o, tile, o_desc, o, row, col, i_t, T, o_t, o_v, HV: gl.constexpr,
                   V: gl.constexpr):
    """O's [C, BV] block (fp32 accumulator) to o at (row, col): by TMA from ``tile`` (the
    block's V' tile, read by its last product), or from registers for a partial chunk (a
    TMA box would write into the next sequence's rows)."""
    BT: gl.constexpr = o_t.shape[0]
    out = b_o.to(o_desc.dtype)
    # every warp past the product that read the tile before any rewrites it
    gl.thread_barrier()
    if (i_t + 1) * BT <= T:
        tile.store(out)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(o_desc, [row, col], tile)
    else:
        valid = i_t * BT + o_t < T
        gl.store(o + (row + o_t).to(gl.int64)[:, None] * (HV * V) + col + o_v[None, :], out,
                 mask=valid[:, None])


@gluon.jit
def _state_tile_t(ptr, i_n, i_hv, i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                  BVr: gl.constexpr, layout: gl.constexpr):
    """Pointers to value block i_v of the [B, HV, K, V] state, transposed: [BV, K]."""
    o_v = gl.arange(0, BVr, layout=gl.SliceLayout(1, layout))
    o_k = gl.arange(0, K, layout=gl.SliceLayout(0, layout))
    return (ptr + (i_n * HV + i_hv).to(gl.int64) * K * V + i_v * BVr) + \
        (o_k[None, :] * V + o_v[:, None])


@gluon.jit
def _add_low_half(S, d, d_op, k_buf, a_k: gl.constexpr):
    """Adds (d − bf16(d))ᵀ K, the low half of the update's d = D V' ([BV, C] fp32; k_buf the
    chunk's [C, K] keys), to Sᵀ whose product with bf16(d) (register operand d_op) is in
    flight (STATE_UPDATE_LO), and returns Sᵀ once both have retired."""
    # bf16(d) again, in fp32, by an asm the compiler cannot merge with the caller's rounding.
    # Taken from that bf16 tensor, the compiler converts d one element at a time (F2F and
    # PRMT, not F2FP's pairs) before the caller's branch, for both sides: H200, session 21,
    # the branch cost +7.5 % at (1, 32768) where it was never taken; with the asm +0.9 %
    hi = gl.inline_asm_elementwise(
        "{ .reg .b16 t; cvt.rn.bf16.f32 t, $1; cvt.f32.bf16 $0, t; }", "=f,f", [d],
        dtype=gl.float32, is_pure=True, pack=1)
    l_op = gl.convert_layout((d - hi).to(gl.bfloat16), a_k)
    S = warpgroup_mma(l_op, k_buf, S, is_async=True)
    S, d_op, l_op = warpgroup_mma_wait(num_outstanding=0, deps=[S, d_op, l_op])
    return S


@gluon.jit
def _chain_partition(k_bufs, w_bufs, u_bufs, g_bufs, ready, empty, st_bufs, vn_bufs, sv_ready,
                     sv_empty, wu_ready, h0, ht, T, c0, n, i_n, i_hv, i_v, i_seg,
                     HV: gl.constexpr, K: gl.constexpr, SW: gl.constexpr,
                     USE_INITIAL_STATE: gl.constexpr, STORE_FINAL_STATE: gl.constexpr,
                     HANDOFF: gl.constexpr, MAP: gl.constexpr, NS: gl.constexpr,
                     WU: gl.constexpr, checkpoints, CKPT_EVERY: gl.constexpr,
                     CHAIN_T: gl.constexpr = False, SEG0_END: gl.constexpr = False,
                     UPDATE_LO: gl.constexpr = False, LO_ABOVE: gl.constexpr = 0.5,
                     HS0: gl.constexpr = 0):
    """The state recurrence (w_bufs / u_bufs: the ring's W and U tiles, or with WU the W/U
    warpgroup's, ready on wu_ready; with CHAIN_T the ring's T and v tiles, from which the
    chain forms V'ᵀ = (Vᵀ − Sᵀ Kᵀ D_{e^G}) D_β Tᵀ itself); HANDOFF: hand h_c and V' to the
    second warpgroup, through hand-off stages HS0 + s (HS0 = c·STAGES for chain c of two);
    CKPT_EVERY > 0: store the fp32 state entering chunks CKPT_EVERY, 2·CKPT_EVERY, … to
    checkpoints ([cdiv(NT, CKPT_EVERY) − 1, B, HV, K, V]) for the backward's recompute."""
    BT: gl.constexpr = k_bufs.type.shape[1]
    BVr: gl.constexpr = u_bufs.type.shape[2]
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    acc_k: gl.constexpr = accumulator_layout(K)    # Sᵀ [BV, K]
    acc_t: gl.constexpr = accumulator_layout(BT)   # Sᵀ Wᵀ and V'ᵀ [BV, C]
    a_t: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t, k_width=2)
    a_k: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_k, k_width=2)
    # a segment's state slab: [B, HV, K, SW] fp32 per segment (B·HV = grid axis 1)
    seg = i_seg.to(gl.int64) * gl.num_programs(1) * K * SW
    if MAP:
        # the segment map [M | b]: M's columns start from I and see no values (u reads 0)
        o_r = gl.arange(0, BVr, layout=gl.SliceLayout(1, acc_k)) + i_v * BVr
        o_k = gl.arange(0, K, layout=gl.SliceLayout(0, acc_k))
        S = gl.where(o_r[:, None] == o_k[None, :], 1., 0.)
        u_keep = gl.where(i_v * BVr < K, 0., 1.)
    elif USE_INITIAL_STATE:
        S = gl.load(_state_tile_t(h0 + seg, i_n, i_hv, i_v, HV, K, SW, BVr, acc_k))
    else:
        S = gl.zeros([BVr, K], gl.float32, acc_k)
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, acc_t))
    for j in range(n):
        i_t = c0 + j
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(ready.index(s), phase)
        if WU:
            mbarrier.wait(wu_ready.index(s), phase)
        s16 = S.to(gl.bfloat16)
        s_op = gl.convert_layout(s16, a_t)
        if CHAIN_T:
            # Sᵀ Kᵀ: the keys as loaded (their e^G scales the product's columns below)
            X = warpgroup_mma(s_op, k_bufs.index(s).permute((1, 0)),
                              gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False,
                              is_async=True)
        else:
            X = warpgroup_mma(s_op, w_bufs.index(s).permute((1, 0)),
                              gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False,
                              is_async=True)
        if HANDOFF:
            # chunk j − STAGES's h_c and V' read by the second warpgroup (passes at once the
            # first STAGES times, as the ring's empty barriers)
            mbarrier.wait(sv_empty.index(HS0 + s), phase ^ 1)
            st_bufs.index(HS0 + s).store(s16)  # h_c for the output warpgroup, while W S runs
        # the chunk's gates from the ring (no global load: the step's proxy fence would wait
        # for it)
        if CHAIN_T:
            # formed by chunk_cumsum (session 22: from the fp64 G row here they were ~20 % of
            # the step's stall samples on the H200 — fp64 loads, F2F, DADD, MUFU); β is 0
            # past T: those columns drop out of Tᵀ
            b_beta, e_G, decay, gam = _chain_rows(g_bufs, s, gl.SliceLayout(0, acc_t))
        else:
            b_G = _gate_row(g_bufs, s, 0).load(gl.SliceLayout(0, acc_t))
            decay, gam = _chunk_decay(b_G, i_t, T, o_c)
        # register operands stay live (deps) until the products reading them have retired
        X, s_op = warpgroup_mma_wait(num_outstanding=0, deps=[X, s_op])
        # (u read before the wait: ptxas then spills with two output warpgroups and the
        # kernel was slower, 791 → 845 µs; docs/speed_log.md)
        vn = u_bufs.index(s).permute((1, 0)).load(acc_t).to(gl.float32)
        if MAP:
            # (a product, not a select: a non-finite u would reach all of M, where unsplit it
            # stays in its column; non-finite inputs give non-finite outputs either way)
            vn = vn * u_keep
        if CHAIN_T:
            # V − D_{e^G} K S rounded to bf16 after the subtraction (W and U, rounded before
            # it, are never formed), then its product with T
            x_op = gl.convert_layout(((vn - X * e_G[None, :]) * b_beta[None, :])
                                     .to(gl.bfloat16), a_t)
            vn = warpgroup_mma(x_op, w_bufs.index(s).permute((1, 0)),
                               gl.zeros([BVr, BT], gl.float32, acc_t), use_acc=False)
        else:
            vn = vn - X
        d = vn * decay[None, :]
        d16 = d.to(gl.bfloat16)
        d_op = gl.convert_layout(d16, a_k)
        S = warpgroup_mma(d_op, k_bufs.index(s), S * gam, is_async=True)
        if HANDOFF:
            vn_bufs.index(HS0 + s).permute((1, 0)).store(vn.to(gl.bfloat16))  # V', while it runs
        # the low half of D V' too where the chunk keeps more than LO_ABOVE of the state
        # (STATE_UPDATE_LO); each branch waits for its products, so no accumulator in flight
        # leaves one (S_c: the state after the wait). The first product is issued before the
        # branch, as with one product alone, its issue interleaved with d's conversion (the
        # whole update inside each branch issued it after the conversion: +3 % at (1, 32768)
        # where no chunk took the low half, against +0.9 % this way)
        if UPDATE_LO:
            if LO_ABOVE < 0:
                S_c = _add_low_half(S, d, d_op, k_bufs.index(s), a_k)
            elif gam > LO_ABOVE:
                S_c = _add_low_half(S, d, d_op, k_bufs.index(s), a_k)
            else:
                S_c, d_op = warpgroup_mma_wait(num_outstanding=0, deps=[S, d_op])
        else:
            S_c, d_op = warpgroup_mma_wait(num_outstanding=0, deps=[S, d_op])
        S = S_c
        # h_c and V' are read by wgmma (the async proxy): fence, then all four warps, then
        # arrive. (Without a hand-off the fence only orders the generic read of u before the
        # stage's TMA refill, which the empty barrier already does, as CUTLASS's consumer
        # release relies on; kept there as measured.)
        fence_async_shared()
        gl.thread_barrier()
        if HANDOFF:
            mbarrier.arrive(sv_ready.index(HS0 + s), count=1)
        mbarrier.arrive(empty.index(s), count=1)
        if CKPT_EVERY > 0:
            # after the stage's release, so the ring refills while the stores drain; once
            # every CKPT_EVERY chunks (the state entering chunk i_t + 1)
            if ((i_t + 1) % CKPT_EVERY == 0) & (i_t + 1 < gl.cdiv(T, BT)):
                slab = ((i_t + 1) // CKPT_EVERY - 1).to(gl.int64) * gl.num_programs(1) * K * SW
                gl.store(_state_tile_t(checkpoints + slab, i_n, i_hv, i_v, HV, K, SW, BVr,
                                       acc_k), S)
    # the map of every segment it covers, segment 0's end state (SEG0_END: the state entering
    # segment 1, ht's slab 1), or the final state from the last segment
    if MAP:
        gl.store(_state_tile_t(ht + seg, i_n, i_hv, i_v, HV, K, SW, BVr, acc_k), S)
    elif SEG0_END:
        slab1 = gl.num_programs(1).to(gl.int64) * K * SW
        gl.store(_state_tile_t(ht + slab1, i_n, i_hv, i_v, HV, K, SW, BVr, acc_k), S)
    elif STORE_FINAL_STATE and i_seg == NS - 1:
        gl.store(_state_tile_t(ht, i_n, i_hv, i_v, HV, K, SW, BVr, acc_k), S)


@gluon.jit
def chunk_state_output_t_kernel(q_desc, k_desc, w_desc, u_desc, o_desc, g_desc, o, h0, ht,
                                scale, T, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                                V: gl.constexpr, USE_INITIAL_STATE: gl.constexpr,
                                STORE_FINAL_STATE: gl.constexpr, OUTPUT: gl.constexpr,
                                MAP: gl.constexpr, NS: gl.constexpr, STAGES: gl.constexpr,
                                WU: gl.constexpr = False, STORE_H: gl.constexpr = False,
                                h=None, OUT_GROUPS: gl.constexpr = 1,
                                Q_REGS: gl.constexpr = True,
                                OUT_REGS_TWO: gl.constexpr = OUT_REGS,
                                P_ON_WU: gl.constexpr = False,
                                O_BUFFERS: gl.constexpr = O_STAGING,
                                checkpoints=None, CKPT_EVERY: gl.constexpr = 0,
                                CHAIN_T: gl.constexpr = False,
                                SEG0_END: gl.constexpr = False,
                                UPDATE_LO: gl.constexpr = False,
                                LO_ABOVE: gl.constexpr = 0.5, PDL: gl.constexpr = False,
                                CHAINS: gl.constexpr = 1):
    """Grid (SW / BV, B·HV, segments). MAP: the state pass alone over the K + V columns of
    [M | b] from [I | 0] (SW = K + V) for segments 0 … NS − 2, each stored to ht's segment
    slab; else the pass with the output over segment i_seg (SW = V), starting from h0's
    segment slab (the composed entering states when NS > 1). WU (experimental): w_desc and
    u_desc are T's [C, C] and v's [C, BV] tiles and g_desc's tiles [2, C] rows of G and β;
    a fourth warpgroup forms W and U on chip. STORE_H (experimental, with OUTPUT off): the
    second warpgroup stores h_c and V' to h and o (as v_new) in chunk_state's layouts.
    OUT_GROUPS = 2 (with OUTPUT or STORE_H, without WU): two output (or store) warpgroups take
    alternate chunks. P_ON_WU (with WU and OUTPUT): the W/U warpgroup forms each chunk's
    masked scores P for the output warpgroup (8 KB a stage more shared memory). O_BUFFERS:
    TMA staging tiles of O an output warpgroup (8 KB each). CKPT_EVERY > 0 (not with MAP):
    the chain stores the states entering every CKPT_EVERY-th chunk to checkpoints. CHAIN_T
    (not with WU): the ring as with WU (T and v tiles) with the [4, C] chain-row tiles
    (CHAIN_GATE_BLOCK) for its gates, but the chain forms V' from
    them itself (V' = T D_β (V − D_{e^G} K S)) and no warpgroup forms W or U. SEG0_END (with
    NS = 2, grid axis 2 of size 1, neither MAP nor OUTPUT): the state pass alone over
    segment 0 from h0's slab 0, its end state stored to ht's slab 1 (the state entering
    segment 1, as the unsplit pass carries it). UPDATE_LO: the state update takes D V' as
    its bf16 high and low halves (STATE_UPDATE_LO) in the chunks that keep more than
    LO_ABOVE of the state (γ = e^{G_C} > LO_ABOVE; every chunk where LO_ABOVE < 0). PDL
    (kernels/pdl.py): wait for the previous grid (the inverse) before anything else. CHAINS =
    2 (CHAIN_T with the output, one output group, not the maps' or segment 0's state pass;
    V = 2·BV, grid axis 0 of size 1): both value blocks of a head in one program, two chain
    warpgroups sharing the ring's q, k, T and gate tiles (v's two blocks loaded apart) and one
    output warpgroup forming P once for both (``TWO_CHAINS``)."""
    if PDL:
        gl_wait_for_previous_grid()
    gl.static_assert(not (CHAIN_T and WU), "CHAIN_T replaces the W/U warpgroup")
    gl.static_assert(not SEG0_END or (NS == 2 and not MAP and not OUTPUT),
                     "SEG0_END: the state pass alone over segment 0 of two")
    gl.static_assert(CKPT_EVERY == 0 or not MAP, "the maps' launch stores no checkpoints")
    gl.static_assert(OUT_GROUPS == 1 or ((OUTPUT or STORE_H) and not WU),
                     "two output groups need the output or STORE_H")
    gl.static_assert(not (STORE_H and (OUTPUT or MAP)), "STORE_H replaces the output")
    gl.static_assert(CHAINS == 1 or (CHAIN_T and OUTPUT and OUT_GROUPS == 1 and not MAP),
                     "two chains a program: V' on the chain, with the output, one group")
    gl.static_assert(CHAINS == 1 or V == 2 * u_desc.block_type.shape[1],
                     "two chains a program: both value blocks of a head, V = 2·BV")
    BT: gl.constexpr = k_desc.block_type.shape[0]
    BVr: gl.constexpr = u_desc.block_type.shape[1]
    if MAP:
        SW: gl.constexpr = K + V
    else:
        SW: gl.constexpr = V
    i_v, i_n, i_hv, i_h = ring_program(H, HV)
    i_seg = gl.program_id(2)
    # segments are cut on the chunk grid: ceil(chunks / NS) chunks each, the last ones may
    # be shorter or empty
    NT = gl.cdiv(T, BT)
    per_seg = gl.cdiv(NT, NS)
    c0 = gl.minimum(i_seg * per_seg, NT)
    n = gl.minimum(c0 + per_seg, NT) - c0
    if MAP:
        u_col = i_hv * V + gl.maximum(i_v * BVr - K, 0)
    else:
        u_col = i_hv * V + i_v * BVr
    # W's ring column: w's head, or T's (C columns a value head)
    if WU or CHAIN_T:
        w_col = i_hv * BT
    else:
        w_col = i_hv * K
    # the head's first gate row: a box's rows a head (G; G, β; G and the chain rows)
    g_row = g_desc.block_type.shape[0] * (i_n * HV + i_hv)
    k_bufs = ring_buffers(k_desc, STAGES)
    w_bufs = ring_buffers(w_desc, STAGES)
    u_bufs = ring_buffers(u_desc, STAGES)
    g_bufs = ring_buffers(g_desc, STAGES)
    # per stage (and chain): h_c as Sᵀ [BV, K] and V' [C, BV] (bf16) from the chain for the
    # output
    st_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [CHAINS * STAGES, BVr, K],
        gl.NVMMASharedLayout.get_default_for([BVr, K], gl.bfloat16))
    vn_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [CHAINS * STAGES, BT, BVr],
        gl.NVMMASharedLayout.get_default_for([BT, BVr], gl.bfloat16))
    # O's TMA staging tiles: O_BUFFERS an output warpgroup (two chains stage O in their V'
    # tiles)
    if CHAINS == 1:
        o_smem = gl.allocate_shared_memory(o_desc.dtype,
                                           [OUT_GROUPS * O_BUFFERS] + o_desc.block_type.shape,
                                           o_desc.layout)
    # the output warpgroup, when there is one, and the W/U one release each stage too (the
    # stores of STORE_H read no stage)
    # the chain hands h_c and V' over for the output, or (STORE_H) for their stores
    HANDOFF: gl.constexpr = OUTPUT or STORE_H
    ready, empty = ring_barriers(STAGES, consumers=(2 if OUTPUT else 1) + (1 if WU else 0) +
                                 CHAINS - 1)
    # h_c and V' of a stage: written (sv_ready) by the chain, read (sv_empty) by the other
    sv_ready = gl.allocate_shared_memory(gl.int64, [CHAINS * STAGES, 1],
                                         mbarrier.MBarrierLayout())
    sv_empty = gl.allocate_shared_memory(gl.int64, [CHAINS * STAGES, 1],
                                         mbarrier.MBarrierLayout())
    for i in gl.static_range(CHAINS * STAGES):
        mbarrier.init(sv_ready.index(i), count=1)
        mbarrier.init(sv_empty.index(i), count=1)
    # q only for the output (the state pass alone, and the maps, read k, w, u and the gates)
    if OUTPUT:
        q_bufs = ring_buffers(q_desc, STAGES)
        ring = ((q_desc, k_desc, w_desc, u_desc), (q_bufs, k_bufs, w_bufs, u_bufs),
                (i_h * K, i_h * K, w_col, u_col))
    else:
        q_bufs = k_bufs  # the output warpgroup runs no chunk then
        ring = ((k_desc, w_desc, u_desc), (k_bufs, w_bufs, u_bufs), (i_h * K, w_col, u_col))
    # The three calls spell their partitions' arguments out: a tuple kept in a variable turns its
    # constexprs into tensors in Triton 3.6 (the chain's layouts need K, its branches the flags)
    if WU:
        # W and U of each stage, formed by the fourth warpgroup from the ring's T and v
        wp_bufs = gl.allocate_shared_memory(
            gl.bfloat16, [STAGES, BT, K], gl.NVMMASharedLayout.get_default_for([BT, K],
                                                                              gl.bfloat16))
        up_bufs = gl.allocate_shared_memory(
            gl.bfloat16, [STAGES, BT, BVr], gl.NVMMASharedLayout.get_default_for([BT, BVr],
                                                                                gl.bfloat16))
        wu_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(wu_ready.index(i), count=1)
        P_WU: gl.constexpr = P_ON_WU and OUTPUT
        if P_WU:
            # P of each stage, formed by the W/U warpgroup for the output warpgroup
            p_bufs = gl.allocate_shared_memory(
                gl.bfloat16, [STAGES, BT, BT], gl.NVMMASharedLayout.get_default_for(
                    [BT, BT], gl.bfloat16))
            p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1],
                                                mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(p_ready.index(i), count=1)
        else:
            p_bufs = wp_bufs  # unused: the output warpgroup forms P itself
            p_ready = wu_ready
        gl.warp_specialize([
            (_chain_partition, (k_bufs, wp_bufs, up_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                sv_ready, sv_empty, wu_ready, h0, ht, T, c0, n, i_n, i_hv,
                                i_v, i_seg, HV, K, SW, USE_INITIAL_STATE, STORE_FINAL_STATE,
                                HANDOFF, MAP, NS, WU, checkpoints, CKPT_EVERY, CHAIN_T,
                                SEG0_END, UPDATE_LO, LO_ABOVE)),
            (_output_partition, (q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                 sv_ready, sv_empty, o_smem, o_desc, o, scale, T, c0,
                                 n if HANDOFF else 0, i_n, i_hv, i_v, HV, V, STORE_H, h, 0, 1,
                                 Q_REGS, p_bufs, p_ready, P_WU)),
            (load_ring, (ring[0], ring[1], ring[2], (ready, empty), i_n * T + c0 * BT, n,
                         g_desc, g_bufs, g_row, c0 * BT)),
            (_wu_partition, (k_bufs, w_bufs, u_bufs, g_bufs, ready, empty, wp_bufs, up_bufs,
                             wu_ready, c0, n, q_bufs, p_bufs, p_ready, sv_empty, T, P_WU)),
        ], [OUT_WARPS, LOAD_WARPS, WU_WARPS],
            [OUT_REGS_P if P_WU else OUT_REGS, LOAD_REGS,
             WU_REGS_P if P_WU else WU_REGS])
    elif CHAINS == 2:
        # chain 1 (value block 1) a worker warpgroup beside chain 0 (the default partition):
        # the two chains' dependent products interleave on the SM's tensor cores, where one
        # chain leaves them idle most of its step; its v tiles and hand-off stages its own
        u1_bufs = ring_buffers(u_desc, STAGES)
        gl.warp_specialize([
            (_chain_partition, (k_bufs, w_bufs, u_bufs, g_bufs, ready, empty,
                                st_bufs, vn_bufs, sv_ready, sv_empty, sv_ready,
                                h0, ht, T, c0, n, i_n, i_hv, 0, i_seg, HV, K, SW,
                                USE_INITIAL_STATE, STORE_FINAL_STATE, HANDOFF, MAP, NS, WU,
                                checkpoints, CKPT_EVERY, CHAIN_T, SEG0_END, UPDATE_LO,
                                LO_ABOVE, 0)),
            (_output_pair_partition, (q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                      sv_ready, sv_empty, o_desc, o, scale, T, c0, n, i_n,
                                      i_hv, HV, V)),
            (load_ring, ((q_desc, k_desc, w_desc, u_desc, u_desc),
                         (q_bufs, k_bufs, w_bufs, u_bufs, u1_bufs),
                         (i_h * K, i_h * K, w_col, u_col, u_col + BVr), (ready, empty),
                         i_n * T + c0 * BT, n, g_desc, g_bufs, g_row, c0 * BT)),
            (_chain_partition, (k_bufs, w_bufs, u1_bufs, g_bufs, ready, empty,
                                st_bufs, vn_bufs, sv_ready, sv_empty,
                                sv_ready, h0, ht, T, c0, n, i_n, i_hv, 1, i_seg, HV, K, SW,
                                USE_INITIAL_STATE, STORE_FINAL_STATE, HANDOFF, MAP, NS, WU,
                                checkpoints, CKPT_EVERY, CHAIN_T, SEG0_END, UPDATE_LO,
                                LO_ABOVE, STAGES)),
        ], [OUT_WARPS, LOAD_WARPS, CHAIN_WARPS], [CHAINS_OUT_REGS, LOAD_REGS, CHAIN_REGS])
    elif OUT_GROUPS == 2:
        # the output's chunk latency (three dependent products, the mask, the store) is longer
        # than the chain's step: two output warpgroups take alternate chunks
        gl.warp_specialize([
            (_chain_partition, (k_bufs, w_bufs, u_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                sv_ready, sv_empty, sv_ready, h0, ht, T, c0, n, i_n, i_hv,
                                i_v, i_seg, HV, K, SW, USE_INITIAL_STATE, STORE_FINAL_STATE,
                                HANDOFF, MAP, NS, WU, checkpoints, CKPT_EVERY, CHAIN_T,
                                SEG0_END, UPDATE_LO, LO_ABOVE)),
            (_output_partition, (q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                 sv_ready, sv_empty, o_smem, o_desc, o, scale, T, c0,
                                 n, i_n, i_hv, i_v, HV, V, STORE_H, h, 0, 2, Q_REGS, None,
                                 None, False)),
            (_output_partition, (q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                 sv_ready, sv_empty, o_smem, o_desc, o, scale, T, c0,
                                 n, i_n, i_hv, i_v, HV, V, STORE_H, h, 1, 2, Q_REGS, None,
                                 None, False)),
            (load_ring, (ring[0], ring[1], ring[2], (ready, empty), i_n * T + c0 * BT, n,
                         g_desc, g_bufs, g_row, c0 * BT)),
        ], [OUT_WARPS, OUT_WARPS, LOAD_WARPS], [OUT_REGS_TWO, OUT_REGS_TWO, LOAD_REGS])
    else:
        # (sv_ready stands in for the unused wu_ready)
        gl.warp_specialize([
            (_chain_partition, (k_bufs, w_bufs, u_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                sv_ready, sv_empty, sv_ready, h0, ht, T, c0, n, i_n, i_hv,
                                i_v, i_seg, HV, K, SW, USE_INITIAL_STATE, STORE_FINAL_STATE,
                                HANDOFF, MAP, NS, WU, checkpoints, CKPT_EVERY, CHAIN_T,
                                SEG0_END, UPDATE_LO, LO_ABOVE)),
            (_output_partition, (q_bufs, k_bufs, g_bufs, ready, empty, st_bufs, vn_bufs,
                                 sv_ready, sv_empty, o_smem, o_desc, o, scale, T, c0,
                                 n if HANDOFF else 0, i_n, i_hv, i_v, HV, V, STORE_H, h, 0, 1,
                                 Q_REGS, None, None, False)),
            (load_ring, (ring[0], ring[1], ring[2], (ready, empty), i_n * T + c0 * BT, n,
                         g_desc, g_bufs, g_row, c0 * BT)),
        ], [OUT_WARPS, LOAD_WARPS], [OUT_REGS, LOAD_REGS])


# TMA block shape of each descriptor argument: q, k, w [C, K]; u and o [C, BV]
DESCRIPTOR_BLOCKS = dict(q=[CHUNK, HEAD_DIM], k=[CHUNK, HEAD_DIM], w=[CHUNK, HEAD_DIM],
                         u=[CHUNK, BV], o=[CHUNK, BV], g=[1, CHUNK])
GATE_LAYOUT = gl.NVMMASharedLayout.get_default_for([1, CHUNK], gl.float64)
# with W and U on chip: the gate tensor's rows come in pairs (G, β), one [2, C] box a chunk
WU_GATE_BLOCK = [2, CHUNK]
WU_GATE_LAYOUT = gl.NVMMASharedLayout.get_default_for(WU_GATE_BLOCK, gl.float64)
# with V' on the chain: G and the chain rows (chunk_gate.store_gate_rows, ROWS = 4)
CHAIN_GATE_BLOCK = [4, CHUNK]
CHAIN_GATE_LAYOUT = gl.NVMMASharedLayout.get_default_for(CHAIN_GATE_BLOCK, gl.float64)


# Chunks a sequence needs before it is cut in two. H200, B = 1, HV = 32 (eval logs
# bench_split_2026-11-30_s6): 512 chunks 869 → 777 µs with two segments; 128 chunks 226 →
# 390 µs with the maps (the map launch, the composition's launches and the second launch's
# host time cost more than half the steps save). Since session 18 two segments need no maps
# (SEG0_END), and since session 19 segment 1's inverse runs beside segment 0's state pass
# (fused_fwd.SPLIT_INVERSE). Session 19, the fused forward (bench_split_threshold_ and
# host_time_split_2026-12-01_s19): at 128 chunks ((1, 8192)) split 262 µs against 312 as a
# CUDA-graph replay, but eager 525 against 315: the split call's five launches cost the host
# ~0.5 ms; at 256 chunks ((1, 16384)) split 499 against 603 (graph) and 524 against 606 eager.
# So 256 chunks for eager calls, and fewer while a CUDA graph is captured (its replays have no
# host time): 128 from session 19, 64 since session 29 (ab_split_captured_threshold_2026-12-02_
# s29.log, graph, the same bits): 64 chunks ((1, 4096)) 134.5 → 121.9 µs split, but 32 chunks
# ((1, 2048)) 75.3 → 82.7 (there the inverse and the two passes' ramps outweigh 16 steps).
MIN_CHUNKS_TO_SPLIT = 256
MIN_CHUNKS_TO_SPLIT_CAPTURED = 64
# The chain's state update Sᵀ ← e^{G_C} Sᵀ + (D V')ᵀ K with D V' as its bf16 high and low
# halves (two products, not one) in the chunks that keep more than STATE_UPDATE_LO_ABOVE of
# the state (γ = e^{G_C}). That rounding of D V' is what binds the final state's error where
# little decays: at g = 0 over 8,192 tokens (H = 2, HV = 4) the state is 3.26e-3 from fp64
# with one product, 2.45e-3 with both (H200; issue 4's bound is 3e-3; o 4.00e-3 → 3.47e-3),
# as tests/test_gluon_transposed.py's torch twin of the chain form predicts
# (`chain_roundings_2026-12-01_s20.log`, `twin_update_lo_2026-12-01_s21.log`; over 32,768
# tokens the twin gives 3.28e-3 → 2.44e-3, `update_lo_twin_t32768_`). In every chunk the low
# half costs 9–18 % of the forward against one product (H200, session 21, graph: 0.972 →
# 1.095 ms at (1, 32768)):
# its product is 512 tensor-core cycles on the chain's critical path. Why only where γ > 1/2:
# the rounding error of chunk c's D V' reaches the final state through the later chunks'
# transitions, each of norm ≤ γ_j (exact arithmetic, ‖k‖ = 1, 0 ≤ β ≤ 2: I − βkkᵀ is a
# contraction). With the low half where γ > 1/2, only the roundings of chunks with γ ≤ 1/2
# are left, and each later such chunk damps them by ≤ 1/2: their total is at most twice the
# largest one, instead of growing with the number of chunks. (The other roundings, of h_c, X
# and the low half itself, are not bounded by this.) Measured, the twin at constant γ
# (`update_lo_threshold_2026-12-01_s21.log`), one product: state 3.27e-3 at γ = 1, 2.94e-3 at
# 0.9, 2.58e-3 at 0.5, 2.44e-3 at 0.2; with the rule ≤ 2.58e-3 at those eight γ. A head whose
# mean |g| a token is above ln 2 / 64 ≈ 0.0108 pays the branch only (+0–1.3 % where no chunk
# takes it: `bench_final_fwd_2026-12-01_s21`); one that barely decays pays the product, and
# one such head makes the whole launch pay (its slowest program sets the time).
# GDN_STATE_UPDATE_LO=0 leaves it out everywhere (A/B timing). The backward's recompute
# (Triton chunk_state) keeps one product, from checkpoints the forward stored with it.
STATE_UPDATE_LO = os.environ.get("GDN_STATE_UPDATE_LO", "1") == "1"
# (< 0: the low half in every chunk)
STATE_UPDATE_LO_ABOVE = 0.5
# Two segments: the state entering segment 1 from the state pass alone over segment 0 from h0
# (SEG0_END: V columns, the unsplit bits, no composition) instead of [M | b] from [I | 0]
# and the fp64 composition (session 18; False: the maps, for A/B timing)
SEGMENT0_FROM_H0 = True


def min_chunks_to_split(device):
    """MIN_CHUNKS_TO_SPLIT, or MIN_CHUNKS_TO_SPLIT_CAPTURED while a CUDA graph is being
    captured on the current stream (the split costs the host, not a replay; ``device``: the
    inputs', only whether it is a GPU). Between the two thresholds the capture runs kernels
    an eager warm-up did not (segment 0's pass, the two-segment launch, the split inverse):
    Triton compiles and loads them inside the capture, which the H200's CUDA 13 stack allows
    (tests/test_fused.py, test_fused_gpu_route_cuda_graph, the first GPU test of its
    process in session 19's runs)."""
    captured = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return MIN_CHUNKS_TO_SPLIT_CAPTURED if captured else MIN_CHUNKS_TO_SPLIT


def num_segments(num_seq_heads, num_chunks, sms, min_chunks=None):
    """Segments a sequence is cut into (1 or 2): 2 when the main pass over two segments fits
    one wave of programs (one an SM: their shared memory), for sequences of ``min_chunks``
    chunks or more (None: MIN_CHUNKS_TO_SPLIT; callers pass :func:`min_chunks_to_split`). At
    B·HV = 32 that is 128 programs for 132 SMs; a third segment would need a second wave of
    maps ([M | b], (K + V) / BV programs a head and segment)."""
    fits = num_seq_heads * (2 * HEAD_DIM // BV) <= sms
    min_chunks = MIN_CHUNKS_TO_SPLIT if min_chunks is None else min_chunks
    return 2 if fits and num_chunks >= min_chunks else 1


def _segment_count(B, NT, HV, device, segments=None):
    """The segments _launch cuts each sequence of NT chunks into: ``segments`` if given, else
    :func:`num_segments` at this call's threshold; at most one a chunk."""
    return min(segments or num_segments(B * HV, NT, sm_count(device),
                                        min_chunks_to_split(device)), NT)


def _segment0_pass(NS):
    """Whether a launch of NS segments first runs segment 0's state pass alone (SEG0_END)."""
    return NS == 2 and SEGMENT0_FROM_H0


def segment0_chunks(B, T, HV, device, segments=None):
    """Chunks of segment 0 where forward_t (``segments`` as its argument) runs segment 0's
    state pass alone before the main launch (two segments and SEGMENT0_FROM_H0), else 0: the
    chunks whose T that pass reads."""
    NT = triton.cdiv(T, CHUNK)
    return triton.cdiv(NT, 2) if _segment0_pass(_segment_count(B, NT, HV, device, segments)) \
        else 0


def compose_segment_states(maps, h0, B, HV):
    """The state entering each segment: h_init[0] = h0 (or 0), h_init[s] = M_{s−1} h_init[s−1]
    + b_{s−1} with maps[s] = [M_s | b_s] ([NS − 1, B, HV, K, K + V] fp32). Composed in fp64
    (TF32, if the caller enabled it for matmuls, would round the carried state) and returned
    as [NS, B, HV, K, V] fp32. Exact algebra, not a truncation: heads with g = 0 compose as
    exactly as decaying ones (kernels/fused_split.py, the same scheme)."""
    NS, K = maps.shape[0] + 1, maps.shape[3]
    V = maps.shape[4] - K
    h = maps.new_zeros(NS, B * HV, K, V, dtype=torch.float64)
    if h0 is not None:
        h[0] = h0.reshape(B * HV, K, V)
    m = maps.to(torch.float64).view(NS - 1, B * HV, K, K + V)
    for s in range(1, NS):
        h[s] = torch.baddbmm(m[s - 1, :, :, K:], m[s - 1, :, :, :K], h[s - 1])
    return h.view(NS, B, HV, K, V).float()


def check_state_inputs(name, q, k, v, G, initial_state, segments, tiles):
    """The input checks of the state + output launchers (here and gluon_state_output), before
    any launch: ValueError naming the argument. ``tiles``: (name, tensor, last dim) of the
    per-value-head bf16 inputs, [B, T, HV, last] each."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if (not q.is_cuda or torch.version.hip is not None
            or chunk_index.capability(q.device) != (9, 0)):
        raise ValueError(f"{name}: needs an NVIDIA sm_90 (Hopper) GPU, got q on {q.device}")
    if T == 0:
        raise ValueError(f"{name}: T = 0 (an empty sequence has nothing to tile)")
    if K != HEAD_DIM or V != HEAD_DIM or k.shape[3] != K:
        raise ValueError(f"{name}: needs K = V = {HEAD_DIM}, got q {K}, k {k.shape[3]}, "
                         f"values {V}")
    for n, x, last in tiles:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{name}: {n} must be bf16, got {x.dtype}")
        if x.shape != (B, T, HV, last):
            raise ValueError(f"{name}: shapes do not match: {n} {tuple(x.shape)} is not "
                             f"{(B, T, HV, last)}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError(f"{name}: q and k must be bf16, got {q.dtype}, {k.dtype}")
    if HV % H or k.shape != q.shape or G.shape != (B, T, HV):
        raise ValueError(f"{name}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, G "
                         f"{tuple(G.shape)} do not match (HV = {HV} value heads need a multiple "
                         f"of H = {H} key heads)")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(f"{name}: initial_state {tuple(initial_state.shape)} is not "
                         f"{(B, HV, K, V)}")
    if segments is not None and (not isinstance(segments, int) or segments < 1):
        raise ValueError(f"{name}: segments must be a positive int, got {segments!r}")


def _check_variant(name, variant):
    """ValueError unless variant is None or a dict whose keys are among VARIANT_KEYS."""
    if variant is not None and not set(variant) <= VARIANT_KEYS:
        raise ValueError(f"{name}: variant keys must be among {sorted(VARIANT_KEYS)}, got "
                         f"{sorted(variant)}")


def _check_groups(name, arg, groups, num_stages):
    """ValueError unless ``groups`` (the value of argument ``arg``) is the int 1 or 2 and
    divides num_stages (each output or store warpgroup owns whole ring stages)."""
    if type(groups) is not int or groups not in (1, 2) or num_stages % groups:
        raise ValueError(f"{name}: {arg} must be the int 1 or 2 and divide "
                         f"num_stages={num_stages}, got {groups!r}")


def _rows_given_or_laid_out(name, gate_rows, gates, B, T, HV, chain_rows=False):
    """The gate rows a launch reads: the caller's (chunk_cumsum's, checked: a wrong row count
    or dtype would make the TMA read the wrong rows, so ValueError) or, for None, laid out
    here from ``gates`` by :func:`_gate_rows` (chain_rows: G, β as
    chunk_gate.gate_rows_from writes them for the chain, four rows a head)."""
    R = 4 if chain_rows else len(gates)
    if gate_rows is None:
        if chain_rows:
            return gate_rows_from(gates[0], gates[1:], chain_rows=True)
        return _gate_rows(gates, B, T, HV)
    shape = (B * HV * R, triton.cdiv(T, CHUNK) * CHUNK)
    if gate_rows.dtype != torch.float64 or tuple(gate_rows.shape) != shape:
        what = "chain_rows=True" if chain_rows else f"{R} row(s) a head"
        raise ValueError(f"{name}: gate_rows must be {shape} fp64 (as chunk_cumsum writes "
                         f"them, {what}), got {tuple(gate_rows.shape)} {gate_rows.dtype}")
    return gate_rows


def _gate_rows(rows, B, T, HV):
    """[B·HV·R, NT·C] fp64 from R gate tensors [B, T, HV] (sequence-major, then head, then
    the R rows): a chunk's gates are one TMA box, zero past T, and the row stride is whole
    chunks (TMA needs 16-byte multiples)."""
    NT = triton.cdiv(T, CHUNK)
    out = rows[0].new_zeros(B, HV, len(rows), NT * CHUNK, dtype=torch.float64)
    for r, x in enumerate(rows):
        out[:, :, r, :T] = x.permute(0, 2, 1)
    return out.view(B * HV * len(rows), NT * CHUNK)


def two_chains_pay(programs: int, sms: int, ratio: float = None) -> bool:
    """Whether ``programs`` two-chain programs (both value blocks of a head each) finish in
    fewer step-times than 2 · programs one-chain ones on ``sms`` SMs, one program an SM at a
    time: every wave of programs runs all its chunks, so the cost is waves × step, with the
    two-chain step ``ratio`` (default TWO_CHAIN_STEP_RATIO) one-chain steps. On the H200 (132
    SMs): 64 programs (the split (1, 32768)) one chain; 66 < P ≤ 132 two (two waves of
    one-chain programs against one); 132 < P ≤ 198 one (three against two × 1.7); (8, 4096)
    and (32, 2048) two."""
    ratio = TWO_CHAIN_STEP_RATIO if ratio is None else ratio
    return ratio * triton.cdiv(programs, sms) < triton.cdiv(2 * programs, sms)


def launch_maxnreg(wu_warpgroup: bool, output_groups: int, chains: int = 1) -> int:
    """The register cap a launch of chunk_state_output_t_kernel takes: with two chains a
    program MAXNREG_TWO_CHAINS, with the W/U warpgroup MAXNREG_WU, with two output warpgroups
    MAXNREG_TWO_OUTPUTS, else MAXNREG (eval.ptxas compiles with the same)."""
    if chains == 2:
        return MAXNREG_TWO_CHAINS
    if wu_warpgroup:
        return MAXNREG_WU
    return MAXNREG_TWO_OUTPUTS if output_groups == 2 else MAXNREG


def _launch(q, k, w_tiles, u_tiles, gate_rows, scale, initial_state, output_final_state,
            output, num_stages, segments, wu, h=None, output_groups=1, variant=None,
            checkpoints=None, t_on_chain=False, beside_seg0_end=None):
    """Descriptors, then (when split) the map launch and the composition, then the main
    launch; w_tiles / u_tiles: W and U, or with ``wu`` T and v (V' then formed by the W/U
    warpgroup, or with ``t_on_chain`` by the chain); with ``h`` (STORE_H) the main launch
    stores h_c into it and V' into the returned "o"; with ``checkpoints`` the chain stores
    the states entering every SEGMENT_CHUNKS-th chunk there. ``beside_seg0_end``: a
    callable completing w_tiles past segment 0 (forward_t), run on the current stream
    beside segment 0's state pass (high-priority side stream) where there is one
    (:func:`segment0_chunks`), else first."""
    B, T, H, K = q.shape
    HV, V = u_tiles.shape[2], u_tiles.shape[3]
    q, k, w_tiles, u_tiles = (x.contiguous() for x in (q, k, w_tiles, u_tiles))
    NT = triton.cdiv(T, CHUNK)
    o = torch.empty_like(u_tiles, dtype=q.dtype)
    ht = q.new_empty(B, HV, K, V, dtype=torch.float32) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    W = w_tiles.shape[3]
    blocks = dict(DESCRIPTOR_BLOCKS, w=[CHUNK, W])
    views = dict(q=q.view(B * T, H * K), k=k.view(B * T, H * K),
                 w=w_tiles.view(B * T, HV * W), u=u_tiles.view(B * T, HV * V),
                 o=o.view(B * T, HV * V))
    descs = [TensorDescriptor.from_tensor(x, blocks[n], descriptor_layout(blocks[n]))
             for n, x in views.items()]
    chain_t = wu and t_on_chain
    gate_block, gate_layout = ((CHAIN_GATE_BLOCK, CHAIN_GATE_LAYOUT) if chain_t else
                               (WU_GATE_BLOCK, WU_GATE_LAYOUT) if wu else
                               (DESCRIPTOR_BLOCKS["g"], GATE_LAYOUT))
    descs.append(TensorDescriptor.from_tensor(gate_rows, gate_block, gate_layout))
    NS = _segment_count(B, NT, HV, q.device, segments)
    consts = dict(H=H, HV=HV, K=K, V=V, NS=NS, STAGES=num_stages, num_warps=4,
                  **pdl_options(q.device),
                  WU=wu and not chain_t, CHAIN_T=chain_t,
                  # (the fused forward's form only: the W/U forms stay the bits of the Triton
                  # state pass they stand in for)
                  UPDATE_LO=STATE_UPDATE_LO and chain_t, LO_ABOVE=STATE_UPDATE_LO_ABOVE)
    cap = launch_maxnreg(wu and not chain_t, 1)  # the passes without the output
    if beside_seg0_end is not None and not _segment0_pass(NS):
        beside_seg0_end()
    if _segment0_pass(NS):
        # the state entering segment 1: the state pass alone over segment 0 from h0 (V
        # columns), the bits the unsplit pass carries there (slab 0 holds h0 or zeros)
        h_in = q.new_empty(2, B, HV, K, V, dtype=torch.float32)
        if h0 is not None:
            h_in[0].copy_(h0)
        else:
            h_in[0].zero_()

        def seg0_end():
            direct.launch(chunk_state_output_t_kernel, (V // BV, B * HV, 1), *descs, o, h_in,
                          h_in, float(scale), T, USE_INITIAL_STATE=True,
                          STORE_FINAL_STATE=False, OUTPUT=False, MAP=False, SEG0_END=True,
                          maxnreg=cap, **consts)
        if beside_seg0_end is None:
            seg0_end()
        else:
            # its B·HV·V / BV programs leave SMs idle (num_segments): what completes the
            # later segment's tiles fills them
            streams.side_by_side(seg0_end, beside_seg0_end, q.device)
        h0 = h_in
    elif NS > 1:
        # the maps [M | b] of segments 0 … NS − 2 (the only HBM besides o and the state)
        maps = q.new_empty(NS - 1, B, HV, K, K + V, dtype=torch.float32)
        direct.launch(chunk_state_output_t_kernel, ((K + V) // BV, B * HV, NS - 1),
                      *descs, o, None, maps, float(scale), T, USE_INITIAL_STATE=False,
                      STORE_FINAL_STATE=True, OUTPUT=False, MAP=True, maxnreg=cap, **consts)
        h0 = compose_segment_states(maps, h0, B, HV)
    # (launch variants are the one-chain output's constexprs: a variant keeps one chain)
    chains = 2 if (TWO_CHAINS and chain_t and output and output_groups == 1 and h is None
                   and not variant and V == 2 * BV
                   and two_chains_pay(B * HV * NS, sm_count(q.device))) else 1
    direct.launch(chunk_state_output_t_kernel, (V // (BV * chains), B * HV, NS),
                  *descs, o, h0, ht, float(scale), T, USE_INITIAL_STATE=h0 is not None,
                  STORE_FINAL_STATE=output_final_state, OUTPUT=output, MAP=False,
                  STORE_H=h is not None, h=h, OUT_GROUPS=output_groups, **(variant or {}),
                  checkpoints=checkpoints,
                  CKPT_EVERY=SEGMENT_CHUNKS if checkpoints is not None else 0,
                  CHAINS=chains,
                  maxnreg=launch_maxnreg(wu and not chain_t, output_groups, chains), **consts)
    return (o if output or h is not None else None), ht


def _check_checkpoints(name, checkpoints, B, T, HV):
    """ValueError unless ``checkpoints`` is None or the contiguous fp32 [checkpoint_slabs(NT),
    B, HV, 128, 128] tensor the chain fills; returns it, or None for an empty one (a sequence
    of SEGMENT_CHUNKS chunks or fewer has no checkpoint)."""
    shape = (checkpoint_slabs(triton.cdiv(T, CHUNK)), B, HV, HEAD_DIM, HEAD_DIM)
    if checkpoints is None:
        return None
    if tuple(checkpoints.shape) != shape or not (checkpoints.dtype == torch.float32
                                                 and checkpoints.is_contiguous()):
        raise ValueError(f"{name}: checkpoints must be contiguous fp32 {shape}, got "
                         f"{checkpoints.dtype} {tuple(checkpoints.shape)}")
    return checkpoints if checkpoints.numel() else None


def chunk_state_output_t(q, k, w, u, G, scale, initial_state, output_final_state,
                         output=True, num_stages=NUM_STAGES, segments=None,
                         output_groups=OUTPUT_GROUPS, variant=None, gate_rows=None,
                         checkpoints=None):
    """chunk_state + chunk_output of the materialized forward without h or v_new in HBM.

    q, k [B, T, H, 128] bf16; w, u [B, T, HV, 128] bf16 (recompute_w_u); G [B, T, HV]
    (natural-log decay cumulated within each chunk of 64; read in fp64); scale a float;
    initial_state [B, HV, 128, 128] (read in fp32) or None; output=False runs the state pass
    alone (o is then None); num_stages: the ring's depth (3 fits shared memory only without
    the output); segments: cut each sequence into this many segments run side by side, their
    entering states composed exactly from each segment's affine map (two segments: segment
    1's from the state pass alone over segment 0, the unsplit bits; default
    :func:`num_segments`: 2 for sequences of 256+ chunks (64+ captured) when B·HV is small
    enough to leave half the SMs idle; at most one segment a chunk); output_groups: 1 or 2
    output warpgroups (alternate chunks; 2 needs num_stages even; ignored with output=False);
    variant: a dict of the main launch's constexprs among VARIANT_KEYS (launch variants for
    eval.bench);
    gate_rows: G's rows as chunk_cumsum(..., gate_rows=[]) writes them, or None to lay them out
    here (:func:`_gate_rows`); checkpoints: None, or a contiguous fp32 [cdiv(NT,
    SEGMENT_CHUNKS) − 1, B, HV, 128, 128] tensor the chain fills with the states entering
    chunks SEGMENT_CHUNKS, 2·SEGMENT_CHUNKS, … (kernels/chunk_state.py: the backward's
    recompute starts its segments there). Returns
    (o [B, T, HV, 128] bf16 or None, final state [B, HV, 128, 128] fp32 or None). Raises
    ValueError for tensors not on an NVIDIA sm_90 GPU, T = 0, head dims other than 128,
    non-bf16 q/k/w/u, shapes that do not match, HV not a multiple of H, output_groups other
    than 1 or 2 (or not dividing num_stages) and variant keys outside VARIANT_KEYS. Dense
    batches only (the chunk size is 64); with B > 1 and T not a multiple of 64, a non-finite
    value in a sequence's first rows reaches the previous sequence (see the module docstring).
    Math: the chunkwise Gated DeltaNet forward (Yang, Kautz & Hatamizadeh, arXiv:2412.06464,
    §3.3)."""
    check_state_inputs("chunk_state_output_t", q, k, u, G, initial_state, segments,
                       (("w", w, HEAD_DIM), ("u", u, HEAD_DIM)))
    B, T, HV = G.shape
    groups = output_groups if output else 1  # the state pass alone has no output warpgroup
    _check_groups("chunk_state_output_t", "output_groups", groups, num_stages)
    _check_variant("chunk_state_output_t", variant)
    gate_rows = _rows_given_or_laid_out("chunk_state_output_t", gate_rows, [G], B, T, HV)
    checkpoints = _check_checkpoints("chunk_state_output_t", checkpoints, B, T, HV)
    return _launch(q, k, w, u, gate_rows, scale, initial_state,
                   output_final_state, output, num_stages, segments, False,
                   output_groups=groups, variant=variant, checkpoints=checkpoints)


def forward_t(q, k, v, G, beta, Ai, scale, initial_state, output_final_state, segments=None,
              gate_rows=None, variant=None, checkpoints=None, t_on_chain=None,
              beside_seg0_end=None):
    """The forward after the inverse in one kernel, the fused backend's forward on Hopper
    (kernels/fused_fwd.py; timings and precision in the module docstring): W and U are not
    read from recompute_w_u; the chain forms V' from T, v and k (``CHAIN_T``, the default) or
    a fourth warpgroup forms W and U on chip (``WU``, ``t_on_chain=False``).

    q, k [B, T, H, 128] bf16; v [B, T, HV, 128] bf16; G [B, T, HV] (natural-log decay
    cumulated within each chunk of 64); beta [B, T, HV]; Ai [B, T, HV, 64] bf16, T = (I + A)⁻¹
    of each chunk as kkt_solve_from_k returns it; gate_rows: the gate rows as
    chunk_cumsum(..., gate_rows=[beta], chain_rows=True) writes them for V' on the chain
    (``chain_rows=False``, the (G, β) pairs, for ``t_on_chain=False``), or None to lay them
    out here;
    checkpoints: as :func:`chunk_state_output_t`'s; t_on_chain: V' formed by the chain
    from T and v with :data:`CHAIN_OUTPUT_GROUPS` output warpgroups (``CHAIN_T``) instead of
    W and U by a fourth warpgroup (None: ``T_ON_CHAIN``); beside_seg0_end: None, or a
    callable that writes Ai's rows past :func:`segment0_chunks`' chunks (the caller filled
    those before): run beside segment 0's state pass alone, which reads only segment 0's T,
    on the SMs it leaves idle (first where there is no such pass); the rest (variant too:
    launch variants such as P_ON_WU, of the W/U form) as :func:`chunk_state_output_t`.
    Returns (o [B, T, HV, 128] bf16, final state fp32 or None); raises ValueError as
    chunk_state_output_t does (naming v and Ai), for checkpoints of another shape and for
    P_ON_WU without the W/U form, and for a non-contiguous Ai with beside_seg0_end."""
    check_state_inputs("forward_t", q, k, v, G, initial_state, segments,
                       (("v", v, HEAD_DIM), ("Ai", Ai, CHUNK)))
    if beta.shape != G.shape:
        raise ValueError(f"forward_t: beta {tuple(beta.shape)} is not {tuple(G.shape)}")
    if beside_seg0_end is not None and not Ai.is_contiguous():
        # the launch reads a contiguous copy, which the callback's writes would not reach
        raise ValueError("forward_t: Ai must be contiguous when beside_seg0_end completes it")
    _check_variant("forward_t", variant)
    t_on_chain = T_ON_CHAIN if t_on_chain is None else t_on_chain
    if t_on_chain and (variant or {}).get("P_ON_WU"):
        raise ValueError("forward_t: variant P_ON_WU needs the W/U warpgroup (t_on_chain="
                         "False); with V' on the chain the output warpgroups form P")
    B, T, HV = G.shape
    gate_rows = _rows_given_or_laid_out("forward_t", gate_rows, [G, beta], B, T, HV,
                                        chain_rows=t_on_chain)
    checkpoints = _check_checkpoints("forward_t", checkpoints, B, T, HV)
    return _launch(q, k, Ai, v, gate_rows, scale, initial_state,
                   output_final_state, True, NUM_STAGES, segments, True, variant=variant,
                   checkpoints=checkpoints, t_on_chain=t_on_chain,
                   output_groups=CHAIN_OUTPUT_GROUPS if t_on_chain else 1,
                   beside_seg0_end=beside_seg0_end)


def chunk_state_t(k, w, u, G, initial_state, output_final_state, segments=1, store_groups=2):
    """Experimental: chunk_state's contract (the backward's recompute of h and v_new) on this
    kernel's chain, one or two store warpgroups (on alternate chunks) storing h_c and V'
    (STORE_H); bit-identical to chunk_state unsplit on the H200, but slower (module
    docstring), so the backward does not route to it (chunk_bwd.RECOMPUTE_ON_TRANSPOSED_CHAIN).

    k [B, T, H, 128] bf16; w, u [B, T, HV, 128] bf16; G [B, T, HV]; initial_state
    [B, HV, 128, 128] or None; segments: 1 by default, the bit-identical run (None picks as
    :func:`num_segments`; split, h differs from chunk_state's by ~3e-3 at g = 0, equally
    close to fp64); store_groups: warpgroups storing h and v_new on alternate chunks (1 or
    2). Returns (h [B·NT, HV, 128, 128] bf16, v_new like u, final state fp32 or None); raises
    ValueError as chunk_state_output_t does, and for other store_groups."""
    check_state_inputs("chunk_state_t", k, k, u, G, initial_state, segments,
                       (("w", w, HEAD_DIM), ("u", u, HEAD_DIM)))
    _check_groups("chunk_state_t", "store_groups", store_groups, NUM_STAGES)
    B, T, HV = G.shape
    h = k.new_empty(B * triton.cdiv(T, CHUNK), HV, HEAD_DIM, HEAD_DIM)
    v_new, ht = _launch(k, k, w, u, _gate_rows([G], B, T, HV), 1., initial_state,
                        output_final_state, False, NUM_STAGES, segments, False, h=h,
                        output_groups=store_groups)
    return h, v_new, ht
