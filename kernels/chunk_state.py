"""The chunk-state recurrence: per sequence and value head, sequential over chunks.

    h_c   = state entering chunk c (stored for the output kernel)
    V'_c  = U_c − W_c h_c                                 ("v_new")
    h_c+1 = e^{G_C} h_c + (diag(e^{G_C − G}) K_c)ᵀ V'_c    (fp32, in registers)

With ``checkpoints`` (the backward's recompute, kernels/chunk_bwd.py) each sequence runs as
segments of ``segment_chunks`` chunks side by side, segment s > 0 starting from the fp32 state
the forward's chain held entering its first chunk (forward_t stores it: kernels/
gluon_transposed.py). A sequence at B·HV = 32 is otherwise 128 programs for 132 SMs, one
sequential pass of all its chunks.
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_gate import decay as gate_decay
from gdn_fused.kernels.chunk_index import load_state_tile, sm_count, state_program

# Chunks between the forward's state checkpoints, and so a segment of the backward's
# recompute: at (1, 32768) 512 chunks become 8 segments, 512 programs of 64 value columns as
# at (8, 4096)
SEGMENT_CHUNKS = 64


@triton.jit
def chunk_state_kernel(k, w, u, G, h, v_new, h0, ht, cu_seqlens, chunk_offsets, T, checkpoints,
                       beta, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                       SEG_CHUNKS: tl.constexpr = 0, CHAIN_T: tl.constexpr = False):
    """Grid (V / BV, N·HV) or, with SEG_CHUNKS > 0, (V / BV, N·HV, segments): segment s runs
    chunks [s·SEG_CHUNKS, (s + 1)·SEG_CHUNKS) from checkpoints[s − 1] ([segments − 1, N, HV,
    K, V] fp32), segment 0 from h0. With CHAIN_T, w is T ([.., HV, BT] rows) and u is v:
    V' = T diag(β) (V − diag(e^G) K h), W and U never formed."""
    i_v, i_n, i_hv, i_h, bos, seqlen, NT, boh, p_state = state_program(
        T, cu_seqlens, chunk_offsets, H, HV, K, V, BT, IS_VARLEN)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    c_lo = 0
    c_hi = NT
    i_s = 0
    last_seg = 0  # the segment holding the sequence's end (0 for an empty sequence)
    if SEG_CHUNKS > 0:
        i_s = tl.program_id(2)
        c_lo = i_s * SEG_CHUNKS
        c_hi = tl.minimum(c_lo + SEG_CHUNKS, NT)
        last_seg = tl.maximum(tl.cdiv(NT, SEG_CHUNKS) - 1, 0)
        if i_s > 0:
            slab = (i_s - 1).to(tl.int64) * tl.num_programs(1) * K * V
            b_h = load_state_tile(checkpoints + slab, p_state, i_v, K, V, BK, BV)
        elif USE_INITIAL_STATE:
            b_h = load_state_tile(h0, p_state, i_v, K, V, BK, BV)
    elif USE_INITIAL_STATE:  # (checkpoints is None here: a branch of its own to compile)
        b_h = load_state_tile(h0, p_state, i_v, K, V, BK, BV)
    o_i = tl.arange(0, BT)
    for i_t in range(c_lo, c_hi):
        p_h = tl.make_block_ptr(h + ((boh + i_t).to(tl.int64) * HV + i_hv) * K * V, (K, V), (V, 1),
                                (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), boundary_check=(0, 1))
        p_u = tl.make_block_ptr(u + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_vn = tl.make_block_ptr(v_new + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (K, seqlen), (1, H * K),
                                (0, i_t * BT), (BK, BT), (0, 1))
        last = tl.minimum((i_t + 1) * BT, seqlen) - 1
        b_G_last = tl.load(G + (bos + last) * HV + i_hv)
        valid = (i_t * BT + o_i) < seqlen
        b_G = tl.load(G + (bos + i_t * BT + o_i) * HV + i_hv, mask=valid, other=0.)
        b_k = tl.load(p_k, boundary_check=(0, 1))
        if CHAIN_T:
            # forward_t's chain form (kernels/gluon_transposed.py): V − diag(e^G) K h rounded
            # after the subtraction, then its product with T
            p_T = tl.make_block_ptr(w + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                                    (i_t * BT, 0), (BT, BT), (1, 0))
            b_T = tl.load(p_T, boundary_check=(0, 1)).to(b_k.dtype)
            b_beta = tl.load(beta + (bos + i_t * BT + o_i) * HV + i_hv, mask=valid,
                             other=0.).to(tl.float32)
            b_kh = tl.dot(tl.trans(b_k), b_h.to(b_k.dtype), input_precision=DOT_PREC)
            b_x = (tl.load(p_u, boundary_check=(0, 1)).to(tl.float32)
                   - b_kh * gate_decay(b_G, valid)[:, None]) * b_beta[:, None]
            b_vn = tl.dot(b_T, b_x.to(b_k.dtype), input_precision=DOT_PREC)
        else:
            p_w = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                                    (i_t * BT, 0), (BT, BK), (1, 0))
            b_w = tl.load(p_w, boundary_check=(0, 1))
            b_vn = tl.load(p_u, boundary_check=(0, 1)).to(tl.float32) - \
                tl.dot(b_w, b_h.to(b_w.dtype), input_precision=DOT_PREC)
        tl.store(p_vn, b_vn.to(p_vn.dtype.element_ty), boundary_check=(0, 1))
        # decay each row to the chunk end; G_C − G_i ≤ 0, so the exp cannot overflow
        b_vn = b_vn * gate_decay(b_G_last - b_G, valid)[:, None]
        b_h = b_h * tl.exp(b_G_last.to(tl.float32)) + \
            tl.dot(b_k, b_vn.to(b_k.dtype), input_precision=DOT_PREC)
    if STORE_FINAL_STATE and i_s == last_seg:
        p_ht = tl.make_block_ptr(ht + p_state, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_ht, b_h, boundary_check=(0, 1))


def state_blocks(K, V, num_seq_heads, device, min_block_v=32):
    """(BK, BV) for a sequential-over-chunks kernel with one [BK, BV] fp32 state per program.

    BV is at most 64 (32 past K = 128) to keep the state in registers, and is halved to 32
    when the programs, num_seq_heads · cdiv(V, BV), would leave SMs idle. Measured on the H200
    at B = 1, T = 32768, HV = 32, K = V = 128 (eval.bench --sweep, 2026-11-29): BV = 64 (64
    programs) 877 µs, 32 (128 programs) 659 µs, 16 (256 programs) 796 µs — halving again adds
    programs but each pays an N = 16 product and re-reads w and k. The backward's state pass
    (chunk_bwd_state) measured alike on 2026-11-30: BV = 16 1,563 µs, 32 934 µs, 64 1,675 µs.
    ``min_block_v`` is where the halving stops (launch sweeps)."""
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64 if BK <= 128 else 32, max(16, triton.next_power_of_2(V)))
    while BV > min_block_v and num_seq_heads * triton.cdiv(V, BV) < sm_count(device):
        BV //= 2
    return BK, BV


def state_stages(num_programs, device):
    """Software-pipeline stages of a sequential-over-chunks kernel: Triton's 3 while its
    programs fit the SMs in one wave, 2 past that, where the third stage's shared memory (117
    KB against 81 at K = 128) keeps a second program off each SM. H200 (eval.bench --sweep
    launch, 2026-11-30): (8, 4096), 512 programs: chunk_state 454 → 420 µs, chunk_bwd_state
    905 → 836; (1, 32768), 128 programs: 666 → 886 and 940 → 1,262 (so not there). The
    forward's (8, 4096) output was bit-identical with either (eval.bench's Gluon comparison)."""
    return 2 if num_programs > sm_count(device) else 3


def checkpoint_slabs(num_chunks: int, segment_chunks: int = SEGMENT_CHUNKS) -> int:
    """States entering chunks segment_chunks, 2·segment_chunks, … of a sequence of
    ``num_chunks`` chunks: cdiv(num_chunks, segment_chunks) − 1 (0 for one segment or none)."""
    return max(triton.cdiv(num_chunks, segment_chunks) - 1, 0)


def checkpoint_count(num_seq_heads: int, num_chunks: int, K: int, V: int,
                     device: torch.device) -> int:
    """States a forward stores a sequence of ``num_chunks`` chunks for the backward's
    recompute (:func:`checkpoint_slabs`) when the unsplit pass, num_seq_heads · V / BV
    programs (:func:`state_blocks`), leaves SMs idle; else 0 (it fills them already)."""
    _, BV = state_blocks(K, V, num_seq_heads, device)
    if num_seq_heads * triton.cdiv(V, BV) >= sm_count(device):
        return 0
    return checkpoint_slabs(num_chunks)


def new_checkpoints(B: int, T: int, HV: int, K: int, V: int, chunk_size: int,
                    device: torch.device):
    """The [n, B, HV, K, V] fp32 buffer a forward at this shape fills for the backward's
    recompute (n = :func:`checkpoint_count`), or None where there are none."""
    n = checkpoint_count(B * HV, triton.cdiv(T, chunk_size), K, V, device)
    return torch.empty(n, B, HV, K, V, dtype=torch.float32, device=device) if n else None


def check_chain_form(name, w, beta, values, chunk_size):
    """ValueError unless, in the chain form (``beta`` given), w is the forward's T [B, T, HV,
    chunk_size] and beta [B, T, HV] matching ``values`` [B, T, HV, V] (the state passes would
    read other rows as T and β); W's shape [B, T, HV, K] is the caller's to match otherwise."""
    if beta is None:
        return
    lead = tuple(values.shape[:3])
    if tuple(beta.shape) != lead or tuple(w.shape) != lead + (chunk_size,):
        raise ValueError(f"{name}: with beta, w must be T {lead + (chunk_size,)} and beta "
                         f"{lead}, got w {tuple(w.shape)} and beta {tuple(beta.shape)}")


def chunk_state(k, w, u, G, initial_state, output_final_state, chunk_size, num_seqs,
                cu_seqlens=None, chunk_offsets=None, num_chunks=None, dot_precision="ieee",
                block_v=None, checkpoints=None, segment_chunks=None, beta=None, **launch):
    """Returns (h [NT_total, HV, K, V] in k's dtype, v_new like u, final_state fp32 or None).

    w, u: W and U ([B, T, HV, K], [B, T, HV, V]: recompute_w_u), V'_c = U_c − W_c h_c; or,
    with ``beta`` ([B, T, HV]), T ([B, T, HV, C], the inverse) and v, V'_c = T_c diag(β)
    (V_c − diag(e^G) K_c h_c), the chain form of forward_t (kernels/gluon_transposed.py):
    the backward's recompute then needs no W and U (the same math; bf16 rounds the difference
    instead of W and U).

    checkpoints: ``[S − 1, N, HV, K, V]`` fp32, the states entering chunks segment_chunks,
    2·segment_chunks, … of every sequence (default :data:`SEGMENT_CHUNKS`), or None: with them
    the S segments of each sequence run side by side, each from its checkpoint (segment 0
    from initial_state). Dense input needs exactly cdiv(chunks, segment_chunks) − 1 of them;
    packed input as many as its longest sequence needs (not checked: the lengths are on the
    device; a shorter sequence ignores its later ones). ValueError for another shape, dtype
    or device, a count that does not fit, or a segment_chunks that is not a positive int;
    with ``beta``, for a w or beta not shaped as T and β of u's heads (:func:`check_chain_form`).
    block_v: value columns per program, overriding :func:`state_blocks`; launch: num_warps,
    num_stages (launch sweeps)."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    NT = num_chunks if cu_seqlens is not None else B * triton.cdiv(T, chunk_size)
    check_chain_form("chunk_state", w, beta, u, chunk_size)
    h = k.new_empty(NT, HV, K, V)
    v_new = torch.empty_like(u)
    ht = k.new_empty(num_seqs, HV, K, V, dtype=torch.float32) if output_final_state else None
    segments = 1 if checkpoints is None else checkpoints.shape[0] + 1
    if checkpoints is not None:
        segment_chunks = SEGMENT_CHUNKS if segment_chunks is None else segment_chunks
        if type(segment_chunks) is not int or segment_chunks < 1:
            raise ValueError(f"chunk_state: segment_chunks must be a positive int, got "
                             f"{segment_chunks!r}")
        # dense: exactly the count the sequences need (fewer would leave chunks uncomputed);
        # packed: at least one slab (the longest sequence's count is on the device)
        need = (checkpoint_slabs(triton.cdiv(T, chunk_size), segment_chunks)
                if cu_seqlens is None else None)
        if (checkpoints.dtype != torch.float32 or tuple(checkpoints.shape[1:]) !=
                (num_seqs, HV, K, V) or not checkpoints.is_contiguous()
                or checkpoints.device != k.device or checkpoints.shape[0] < 1
                or need not in (None, checkpoints.shape[0])):
            raise ValueError(f"chunk_state: checkpoints must be contiguous fp32 "
                             f"[{need if need is not None else 'S - 1'}, {num_seqs}, {HV}, "
                             f"{K}, {V}] on {k.device} (segments of {segment_chunks} "
                             f"chunks), got {checkpoints.dtype} {tuple(checkpoints.shape)} on "
                             f"{checkpoints.device}")
    # the segments are programs too: BV as for that many sequences
    BK, BV = state_blocks(K, V, num_seqs * HV * segments, k.device)
    BV = block_v or BV
    grid = (triton.cdiv(V, BV), num_seqs * HV, segments)
    launch = {"num_stages": state_stages(grid[0] * grid[1] * grid[2], k.device), **launch}
    direct.launch(chunk_state_kernel, grid, k, w, u, G, h, v_new, initial_state, ht, cu_seqlens,
                  chunk_offsets, T, checkpoints, beta, H=H, HV=HV, K=K, V=V, BT=chunk_size,
                  BK=BK,
                  BV=BV, USE_INITIAL_STATE=initial_state is not None,
                  STORE_FINAL_STATE=output_final_state,
                  IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision,
                  SEG_CHUNKS=0 if checkpoints is None else segment_chunks,
                  CHAIN_T=beta is not None, **launch)
    return h, v_new, ht
