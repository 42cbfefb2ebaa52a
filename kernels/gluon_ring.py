"""What the warp-specialized Gluon kernels (gluon_state, gluon_state_output, gluon_transposed,
gluon_dqkwg, gluon_wu_bwd, gluon_bwd_state) share:
the TMA producer, in which one warp streams a chunk's tiles into a ring of shared-memory
stages, a ready/empty mbarrier pair per stage, while the consumer warpgroup works on the
previous chunk; the ring's buffers and barriers; the program's place in the grid; the
consumer's accumulator layout and its state tile; the backward's gate terms (decay,
gate_bwd_stage, gate_bwd_rows, dg_of_rows); fp32 values as bf16 halves (bf16_halves,
store_bf16_halves); operand checks; the tiling (CHUNK, HEAD_DIM).
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma)

# The tiling the Gluon kernels are written for (materialized.gluon_tiles_apply routes only it
# to them): chunks of 64 tokens, key and value heads of 128
CHUNK = 64
HEAD_DIM = 128
LOAD_WARPS = gl.constexpr(1)
LOAD_REGS = gl.constexpr(24)  # the minimum setmaxnreg budget; the producer holds only scalars


def launch_maxnreg(ctas_per_sm: int, threads: int = 256) -> int:
    """Registers a thread at launch for ``ctas_per_sm`` CTAs of ``threads`` threads to share
    an SM's 64 K registers (the default: a compute warpgroup and the producer warp, padded to
    a warpgroup); setmaxnreg then moves them between the roles."""
    return 65536 // (ctas_per_sm * threads)


@gluon.constexpr_function
def tile_bytes(descs):
    """The bytes one chunk's tiles bring: the transaction count its ready barrier waits for."""
    return sum(d.block_type.nbytes for d in descs)


@gluon.jit
def load_ring(descs, bufs, cols, bars, row0, NT, gate_desc=None, gate_bufs=None, gate_row=0,
              gate_col0=0):
    """Chunk i_t < NT of every descriptor in ``descs`` (rows row0 + i_t·BT, column ``cols[i]``)
    into stage i_t % STAGES of ``bufs[i]``, once the consumers have released that stage; with
    ``gate_desc``, also the [1, BT] tile (gate_row, gate_col0 + i_t·BT) of a [rows, T] gate
    tensor (a sequence's gates for one head are a row there, so a chunk's are one TMA box)."""
    ready, empty = bars
    BT: gl.constexpr = descs[0].block_type.shape[0]
    STAGES: gl.constexpr = bufs[0].type.shape[0]
    if gate_desc is None:
        nbytes: gl.constexpr = tile_bytes(descs)
    else:
        nbytes: gl.constexpr = tile_bytes(descs) + gate_desc.block_type.nbytes
    for i_t in range(NT):
        s = i_t % STAGES
        phase = (i_t // STAGES) & 1
        # mbarriers start as if phase 1 completed: the first STAGES waits pass at once
        mbarrier.wait(empty.index(s), phase ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        row = row0 + i_t * BT
        for j in gl.static_range(len(descs)):
            tma.async_copy_global_to_shared(descs[j], [row, cols[j]], bar, bufs[j].index(s))
        if gate_desc is not None:
            tma.async_copy_global_to_shared(gate_desc, [gate_row, gate_col0 + i_t * BT], bar,
                                            gate_bufs.index(s))


@gluon.jit
def ring_program(H: gl.constexpr, HV: gl.constexpr):
    """(i_v, i_n, i_hv, i_h) of a program on the grid (V / BV, B·HV): its value block,
    sequence, value head and the key head that value head reads (HV / H value heads a key
    head)."""
    i_v, i_nh = gl.program_id(0), gl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    return i_v, i_n, i_hv, i_hv // (HV // H)


@gluon.jit
def ring_buffers(desc, STAGES: gl.constexpr):
    """STAGES tiles of ``desc``'s block, in its (TMA) shared layout."""
    return gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)


@gluon.jit
def ring_barriers(STAGES: gl.constexpr, consumers: gl.constexpr = 1):
    """(ready, empty): one mbarrier of each per stage; ready completes on the TMA transaction,
    empty on one arrive from each of the ``consumers`` partitions that read the stage."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=consumers)
    # the inits are generic-proxy writes; the TMA's complete_tx reaches the ready barriers
    # through the async proxy: fence between them (CUDA programming guide, TMA: "make
    # initialized barrier visible in async proxy"); warp_specialize's entry barrier then
    # publishes them to the producer warp
    fence_async_shared()
    return ready, empty


@gluon.constexpr_function
def accumulator_layout(N):
    """One warpgroup's wgmma accumulator: each warp owns 16-row slabs, N columns an
    instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, N, 16])


@gluon.jit
def state_tile(ptr, i_n, i_hv, i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
               BV: gl.constexpr, layout: gl.constexpr):
    """Pointers to value block i_v ([K, BV]) of the [B, HV, K, V] state of sequence i_n, value
    head i_hv. Build it where it is used, not once for the loop's two ends: a [K, BV] tile of
    64-bit pointers kept live across the chunk loop takes 2·K·BV / 128 registers a thread."""
    o_k = gl.arange(0, K, layout=gl.SliceLayout(1, layout))
    o_v = gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
    return (ptr + (i_n * HV + i_hv).to(gl.int64) * K * V + i_v * BV) + \
        (o_k[:, None] * V + o_v[None, :])


@gluon.jit
def chunk_gates(G, bos, i_t, T, o_t, HV: gl.constexpr, i_hv):
    """(valid rows, G of the chunk's rows (0 past T), G of its last valid row) for chunk i_t of
    the sequence starting at token ``bos``; G is [B·T, HV] fp64. Loaded at the top of a chunk
    step, so their latency overlaps the step's shared-memory stores and waits."""
    BT: gl.constexpr = o_t.shape[0]
    t = i_t * BT + o_t
    valid = t < T
    b_G = gl.load(G + (bos + t).to(gl.int64) * HV + i_hv, mask=valid, other=0.)
    G_last = gl.load(G + (bos + gl.minimum((i_t + 1) * BT, T) - 1).to(gl.int64) * HV + i_hv)
    return valid, b_G, G_last


@gluon.jit
def decay(D, valid):
    """exp(D) fp32 on valid rows, else 0, for an fp64 exponent D ≤ 0 (chunk_gate.decay)."""
    return gl.where(valid, gl.exp(gl.where(valid, D, 0.).to(gl.float32)), 0.)


@gluon.jit
def bf16_halves(x):
    """fp32 x as bf16 high and low halves, hi + lo within ~2⁻¹⁶ of x (relative): a product
    taking both in turn is as accurate as a tf32 one, and finer."""
    hi = x.to(gl.bfloat16)
    return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def store_bf16_halves(x, hi_tile, lo_tile):
    """:func:`bf16_halves` of x into two shared-memory tiles (the caller fences and
    synchronizes before a product reads them)."""
    hi, lo = bf16_halves(x)
    hi_tile.store(hi)
    lo_tile.store(lo)


@gluon.jit
def gate_bwd_stage(b_Z, b_a, hi_tile, lo_tile, o_j):
    """The per-token dg from row terms a and strictly-lower pair terms Z without forming
    cancelling pairs (kernels/chunk_gate_bwd.py) is dg_t = Σ_{i≥t} a_i + Σ_{i≥t} Σ_{j<t} Z_ij:
    chunk_gate_bwd's reverse cumsums, here one product (:func:`gate_bwd_rows`) and a masked sum
    (:func:`dg_of_rows`). This stores the product's data operand: Z' = Z with a in its last
    column (a column Z, strictly lower, leaves zero) into two [C, C] tiles as its bf16 high and
    low halves (~2⁻¹⁷ relative). The caller fences and synchronizes the warpgroup before the
    product reads them."""
    C: gl.constexpr = b_Z.type.shape[1]
    store_bf16_halves(b_Z + gl.where(o_j[None, :] == C - 1, b_a[:, None], 0.), hi_tile, lo_tile)


@gluon.jit
def gate_bwd_rows(hi_tile, lo_tile, o_t, o_j, valid, acc: gl.constexpr, a_op: gl.constexpr):
    """D'ᵀ = L'ᵀ Z'ᵀ, D'_it = Σ_{j<t} Z_ij + a_i, with Z' from :func:`gate_bwd_stage`'s tiles
    (read transposed) and the constant L'_jt = [j < t] or j = C − 1 (the column that carries
    a; rows past the sequence's end ``valid`` zero) from registers, issued asynchronously.
    Returns (D'ᵀ, L'ᵀ): the wait names L'ᵀ among its deps, so that the compiler keeps the
    registers of a wgmma operand in flight. Then dg_t = Σ_{i≥t} D'ᵀ_ti (:func:`dg_of_rows`), a
    sum within each warp's rows: dg comes out a row a token. The earlier form (Z from registers
    times a constant tile L in shared memory, sessions 15–19) gave D untransposed, whose column
    sums add across the warpgroup's four warps through 1 KB of shared-memory scratch, which two
    CTAs an SM could not spare (gluon_dqkwg). Its measured forms in gluon_dqkwg (H200, (1,
    32768)): two reverse scans in a blocked layout (Triton 3.6 scans no wgmma layout), 1,900
    µs; Z through shared memory and the product after the P products, 1,635; the product
    beside them, 1,427. dg within 2.2e-6 of chunk_bwd_dqkwg's in each."""
    C: gl.constexpr = o_t.shape[0]
    # zero on rows past the sequence's end (whose dg is not stored), which also keeps L'ᵀ from
    # being a constant: with it one, ptxas rematerialized a register of it that is the same in
    # every thread (two bf16 ones) after the first wgmma that reads it (H200, session 20: the
    # first item of a CTA took rows 8–15 of each warp's slab from a stale register)
    lt = gl.where(((o_j[None, :] < o_t[:, None]) | (o_j[None, :] == C - 1)) & valid[:, None],
                  1., 0.)
    lt = gl.convert_layout(lt.to(gl.bfloat16), a_op)
    D = warpgroup_mma(lt, hi_tile.permute((1, 0)), gl.zeros([C, C], gl.float32, acc),
                      use_acc=False, is_async=True)
    return warpgroup_mma(lt, lo_tile.permute((1, 0)), D, is_async=True), lt


@gluon.jit
def dg_of_rows(Dt, o_t, o_j):
    """dg_t = Σ_{i≥t} D'ᵀ_ti [C] (rows' layout) from :func:`gate_bwd_rows`'s D'ᵀ."""
    return gl.sum(gl.where(o_j[None, :] >= o_t[:, None], Dt, 0.), 1)


@gluon.jit
def initial_state(h0, i_n, i_hv, i_v, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                  BV: gl.constexpr, layout: gl.constexpr, USE_INITIAL_STATE: gl.constexpr):
    """The consumer's fp32 state tile before the first chunk: h0's block, or zeros."""
    if USE_INITIAL_STATE:
        S = gl.load(state_tile(h0, i_n, i_hv, i_v, HV, K, V, BV, layout))
    else:
        S = gl.zeros([K, BV], gl.float32, layout)
    return S


def descriptor_layout(block):
    """The shared layout of a bf16 TMA tile: the widest swizzle (128 B for 64+ columns), which
    is also what warpgroup MMA reads without bank conflicts. Built once a block shape
    (:func:`_descriptor_layout`): a launch makes up to six of these a call, and building one
    is Python work the host pays at every short forward."""
    return _descriptor_layout(tuple(block))


@functools.cache
def _descriptor_layout(block):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def check_heads(name, keys, values, head_dim=128):
    """ValueError unless ``keys`` [B, T, H, K] and ``values`` [B, T, HV, V] have K = V =
    ``head_dim`` (the Gluon kernels' tiles) and HV a multiple of H (GVA)."""
    H, K = keys.shape[2], keys.shape[3]
    HV, V = values.shape[2], values.shape[3]
    if K != head_dim or V != head_dim or HV % H:
        raise ValueError(f"{name}: needs K = V = {head_dim} and HV a multiple of H, got keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}")


def check_operands(name, specs):
    """ValueError naming the argument unless each (argument, tensor, shape, dtype) of ``specs``
    matches (a None dtype accepts any floating dtype; a None tensor is skipped): a Gluon
    kernel's TMA descriptors would otherwise read a wrong shape or dtype as valid tiles."""
    for arg, x, shape, dtype in specs:
        if x is None:
            continue
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: {arg} must have shape {tuple(shape)}, got "
                             f"{tuple(x.shape)}")
        if dtype is None and not x.is_floating_point():
            raise ValueError(f"{name}: {arg} must be a floating tensor, got {x.dtype}")
        if dtype is not None and x.dtype != dtype:
            raise ValueError(f"{name}: {arg} must be {dtype}, got {x.dtype}")

