"""Chunk bookkeeping shared by the chunk-parallel kernels of the materialized path.

Dense batches use program id (i_t, b·HV + hv) directly. Packed sequences (cu_seqlens) number
their chunks globally: ``chunk_indices[c] = (sequence n, chunk index inside n)`` and
``chunk_offsets[n]`` is the global index of sequence n's first chunk (for per-chunk states).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def prepare_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int, cu_seqlens_cpu=None):
    """Return (chunk_indices int32 [NT, 2], chunk_offsets int32 [N+1], NT) for packed input.

    The chunk count sets the grid size, so the offsets are needed on the host: taken from
    ``cu_seqlens_cpu`` when given, else read from cu_seqlens (one device-to-host copy)."""
    cu = cu_seqlens.cpu() if cu_seqlens_cpu is None else cu_seqlens_cpu
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    nchunks = (lens + chunk_size - 1) // chunk_size
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = nchunks.cumsum(0)
    NT = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(lens)), nchunks)
    local = torch.arange(NT) - offsets[:-1].repeat_interleave(nchunks)
    indices = torch.stack([seq, local], 1).to(torch.int32)
    dev = cu_seqlens.device
    return indices.to(dev), offsets.to(torch.int32).to(dev), NT


def chunk_layout(cu_seqlens, batch: int, chunk_size: int, cu_seqlens_cpu=None):
    """(N, chunk_offsets, idx) for a launch: N sequences, the global index of each sequence's
    first chunk (packed input only, else None), and ``idx`` = the keyword arguments
    (cu_seqlens, chunk_indices, num_chunks) every chunk-parallel launcher takes.
    cu_seqlens_cpu: the offsets already on the host (validation's copy), else they are read."""
    if cu_seqlens is None:
        return batch, None, dict(cu_seqlens=None, chunk_indices=None, num_chunks=None)
    if batch != 1:  # the kernels' grids (chunk_head_grid) count B · HV heads, HV when packed
        raise ValueError(f"packed input (cu_seqlens) must have batch 1, got {batch}")
    chunk_indices, chunk_offsets, NT = prepare_chunk_indices(cu_seqlens, chunk_size,
                                                             cu_seqlens_cpu)
    return (cu_seqlens.numel() - 1, chunk_offsets,
            dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, num_chunks=NT))


def capability(device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability`` of a CUDA ``device`` (a torch.device; without an
    index, the current device), cached per device index: the launchers ask on every call, and
    torch's own query cost ~2.3 µs of host time each (five a fused forward; H200 host,
    session 12's breakdown)."""
    return _capability(_index(device))


def _index(device) -> int:
    """A CUDA torch.device's index (without one, the current device's)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a CUDA device without an index: the current
    one), cached per device index; the H200's 132 where there is no GPU (the interpreter), so
    plans made on CPU match the target card."""
    if device.type == "cuda":
        return _sm_count(_index(device))
    return 132


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def chunk_program(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """Map a chunk program to (sequence n, chunk index in it, first token row, sequence length).

    Rows are counted in the flattened [B·T] token axis; dense batch b starts at row b·T. The
    first row is int64: every address is a row times a row width (HV·V elements and more), which
    passes 2³¹ at half a million tokens with HV = 32, V = 128; one cast here covers them all."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seqlen = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_n = i_b
        bos = i_b.to(tl.int64) * T
        seqlen = T
    return i_n, i_t, bos, seqlen


def chunk_head_grid(num_chunks: int, batch: int, num_value_heads: int, blocks: int = 1):
    """Launch grid of a kernel placed by :func:`grid_position`: one program per column block
    (``blocks`` of them), chunk and (batch, value head), on one axis (its 2³¹ − 1 programs, not
    axes 1 and 2's 65,535)."""
    return (blocks * num_chunks * batch * num_value_heads,)


@triton.jit
def grid_position(T, HV: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                  NB: tl.constexpr = 1):
    """(column block, batch · value head, global chunk index) of a program on the grid of
    :func:`chunk_head_grid` with NB column blocks.

    Column blocks are the fastest index, then heads, so the programs in flight cover whole rows
    of every [B, T, heads, ·] tensor (all heads of the same chunks, contiguous in memory) rather
    than one head's rows a row width apart. Measured on the H200 against the chunks-fastest
    grids before it: kkt_solve 149 → 132 µs (B=8, T=4096, HV=32), recompute_w_u 346 → 298 µs
    and kkt_solve_from_k 475 → 436 µs (B=1, T=32768). Packed input has B = 1."""
    pid = tl.program_id(0)
    if IS_VARLEN:
        NBH = HV
    else:
        NBH = tl.num_programs(0) // (NB * tl.cdiv(T, BT))
    return pid % NB, pid // NB % NBH, pid // (NB * NBH)


@triton.jit
def chunk_head_program(T, cu_seqlens, chunk_indices, H: tl.constexpr, HV: tl.constexpr,
                       BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program (chunk, batch · value head) of a chunk-parallel kernel on the grid of
    :func:`chunk_head_grid` (order: :func:`grid_position`): returns (chunk index in its
    sequence, value head, q/k head it reads (GVA), first token row, sequence length)."""
    _, i_bh, i_t = grid_position(T, HV, BT, IS_VARLEN)
    i_b, i_hv = i_bh // HV, i_bh % HV
    _, i_t, bos, seqlen = chunk_program(i_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    return i_t, i_hv, i_hv // (HV // H), bos, seqlen


@triton.jit
def sequence_program(i_n, T, cu_seqlens, IS_VARLEN: tl.constexpr):
    """First token row (int64, as in chunk_program) and length of sequence i_n (dense: batch
    row i_n)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seqlen = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        seqlen = T
    return bos, seqlen


@triton.jit
def first_chunk(i_n, T, chunk_offsets, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global index of sequence i_n's first chunk in per-chunk buffers (states h, dh)."""
    if IS_VARLEN:
        boh = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        boh = i_n * tl.cdiv(T, BT)
    return boh


@triton.jit
def state_program(T, cu_seqlens, chunk_offsets, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Program (V-block, sequence · value head) of a kernel sequential over chunks: returns
    (i_v, i_n, i_hv, i_h, first row, length, chunk count, first global chunk, state offset)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, seqlen = sequence_program(i_n, T, cu_seqlens, IS_VARLEN)
    boh = first_chunk(i_n, T, chunk_offsets, BT, IS_VARLEN)
    return (i_v, i_n, i_hv, i_hv // (HV // H), bos, seqlen, tl.cdiv(seqlen, BT), boh,
            (i_n * HV + i_hv).to(tl.int64) * K * V)


@triton.jit
def load_state_tile(ptr, p_state, i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr):
    """The [BK, BV] fp32 tile (rows 0.., columns i_v·BV..) of a [K, V] state at ptr + p_state."""
    p = tl.make_block_ptr(ptr + p_state, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
    return tl.load(p, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
