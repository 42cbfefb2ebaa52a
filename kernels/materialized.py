"""The materialized forward: six kernels, intermediates in HBM (the GPU reference and fallback).

    G = chunk_cumsum(g) → T = chunk_inverse(k, G, β) (chunk_kkt + kkt_solve, or kkt_solve_from_k)
      → W, U = recompute_w_u(T)
      → h, V' = chunk_state(W, U) → o = chunk_output(q, k, V', h)

On Hopper, for dense bf16 batches of 2,048+ tokens with K = V = 128 and chunk 64, the last
two run as one Gluon kernel (kernels/gluon_transposed.py) that keeps h and V' on chip: the
same products with the same roundings (unsplit, o and the final state are bit-identical to
theirs in its GPU tests), a third less time at B = 1, T = 32768 (H200, session 7: 796 µs
against 1,180 for the pair); from 512 chunks at small B·HV it cuts each sequence in two
(708 µs there; exact composition of the segment maps, equally close to the fp64 truth but
not bit-identical where heads do not decay).
"""
import os

import torch

from gdn_fused.kernels import chunk_index
from gdn_fused.kernels.chunk_gate import chunk_cumsum
from gdn_fused.kernels.chunk_index import chunk_layout
from gdn_fused.kernels.chunk_output import chunk_output
from gdn_fused.kernels.chunk_state import chunk_state, new_checkpoints
from gdn_fused.kernels.kkt import dot_precision
from gdn_fused.kernels.kkt_solve import chunk_inverse, default_inverse_dtype
from gdn_fused.kernels.wu import recompute_w_u
from gdn_fused.validation import triton_interpreted


def contiguous(*xs):
    """HF passes strided views; the kernels index rows of contiguous [B, T, heads, dim] tensors."""
    return [x if x is None or x.is_contiguous() else x.contiguous() for x in xs]


# The shortest input measured (B·T tokens) on which the Gluon routes (this one and the fused
# backend's, which shares the rule) are the faster on the GPU: H200, (1, 2048), CUDA-graph
# replays (eval.host_time, session 11): the fused route 0.105–0.112 ms and this one
# 0.105–0.110, against 0.134 for the Triton state kernels and 0.271 for the plain fused
# kernel. Sessions 6–10 kept the routes to 8,192+ tokens because eval.bench timed them slower
# at (1, 2048) (0.70 against 0.28 ms): that was host time — the launch of a Gluon kernel and
# the torch ops around it — which session 11 cut (gate rows written by chunk_cumsum, cached
# layouts, no custom-op dispatch in eager mode); the routes' host time per call is now that
# of the Triton kernels within the host's noise (~0.3 ms either way on a quiet host).
MIN_TOKENS_STATE_OUTPUT_KERNEL = 2048


def gluon_tiles_apply(q, v, chunk_size, cu_seqlens):
    """Whether the Gluon kernels that tile the [B·T] token axis by TMA run on these inputs: an
    NVIDIA Hopper GPU (sm_90; not ROCm, whose devices are "cuda" with capabilities 9.x too),
    bf16, K = V = 128, chunk 64, a dense batch where no chunk straddles two sequences (B = 1 or
    T a multiple of 64: the tiles run over the flattened token axis, so a partial last chunk
    reads the next sequence's rows and only multiplies them by zero, which a non-finite value
    there would turn into NaN), compiled mode, and a Triton with Gluon. No device sync."""
    if not q.is_cuda or torch.version.hip is not None or triton_interpreted():
        return False
    if chunk_index.capability(q.device) != (9, 0):
        return False
    B, T = q.shape[0], q.shape[1]
    if (q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or q.shape[3] != 128
            or v.shape[3] != 128 or chunk_size != 64 or cu_seqlens is not None
            or (B > 1 and T % chunk_size)):
        return False
    try:
        from gdn_fused.kernels import gluon_transposed  # noqa: F401  (a Triton with Gluon)
    except ImportError:
        return False
    return True


def uses_state_output_kernel(q, v, chunk_size, cu_seqlens):
    """Whether the forward runs chunk_state + chunk_output as the one Gluon kernel of
    kernels/gluon_transposed.py: where :func:`gluon_tiles_apply`, for at least
    MIN_TOKENS_STATE_OUTPUT_KERNEL tokens, and GDN_STATE_OUTPUT_KERNEL not set to 0 (A/B
    timing)."""
    return (os.environ.get("GDN_STATE_OUTPUT_KERNEL") != "0"
            and q.shape[0] * q.shape[1] >= MIN_TOKENS_STATE_OUTPUT_KERNEL
            and gluon_tiles_apply(q, v, chunk_size, cu_seqlens))


def gates_and_inverse(k, g, beta, HV, chunk_size, dtype, idx, gate_rows=None,
                      solve_method="blocked", solve_iters=None, chain_rows=False):
    """(G, T, rows): the chunk-cumulated log-decay [B, T, HV] fp64 (chunk_cumsum), T =
    (I + A)⁻¹ [B, T, HV, C] in ``dtype`` (chunk_inverse, ``solve_method``), and with
    ``gate_rows`` (chunk_cumsum's argument: [] or [beta], with ``chain_rows``) the rows the
    Gluon kernels read, written by the cumsum's launch, else None. k, g, beta contiguous;
    idx: chunk_layout's."""
    out = chunk_cumsum(g, chunk_size, gate_rows=gate_rows, chain_rows=chain_rows, **idx)
    G, rows = out if gate_rows is not None else (out, None)
    Ai = chunk_inverse(k, G, beta, HV, chunk_size, dtype, solve_method=solve_method,
                       solve_iters=solve_iters, **idx)
    return G, Ai, rows


def materialized_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     chunk_size=64, inverse_dtype=None, solve_method="blocked",
                     solve_iters=None, cu_seqlens_cpu=None, for_backward=False):
    """Validated inputs (see gdn_fused.ops) -> (o, final_state), or with ``for_backward``
    (o, final_state, T, checkpoints), what the backward reads instead of recomputing
    (gdn_fused.autograd): T = (I + A)⁻¹ of every chunk, [B, T, HV, C] in ``inverse_dtype``, and
    on the Gluon route the states entering every chunk_state.SEGMENT_CHUNKS-th chunk, [n, B,
    HV, K, V] fp32 where B·HV leaves SMs idle (chunk_state.new_checkpoints), else None.

    inverse_dtype: storage dtype of T (default: fp32 for fp32 data, else the input dtype).
    solve_method, solve_iters: the kkt_solve method (kernels/kkt_solve.py). cu_seqlens_cpu:
    the offsets on the host, if the caller has them (saves a device read)."""
    q, k, v, g, beta, initial_state, cu_seqlens = contiguous(q, k, v, g, beta, initial_state,
                                                             cu_seqlens)
    HV = v.shape[2]
    prec = dot_precision(q.dtype)
    N, chunk_offsets, idx = chunk_layout(cu_seqlens, q.shape[0], chunk_size, cu_seqlens_cpu)
    # the Gluon state + output kernel reads G again as TMA rows, written by the cumsum's launch
    state_output = uses_state_output_kernel(q, v, chunk_size, cu_seqlens)
    G, Ai, rows = gates_and_inverse(k, g, beta, HV, chunk_size,
                                    inverse_dtype or default_inverse_dtype(q.dtype), idx,
                                    gate_rows=[] if state_output else None,
                                    solve_method=solve_method, solve_iters=solve_iters)
    w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision=prec, **idx)
    if state_output:
        from gdn_fused.kernels.gluon_transposed import chunk_state_output_t
        B, T, HV, V = v.shape
        checkpoints = new_checkpoints(B, T, HV, k.shape[3], V, chunk_size, q.device) \
            if for_backward else None
        o, ht = chunk_state_output_t(q, k, w, u, G, scale, initial_state, output_final_state,
                                     gate_rows=rows, checkpoints=checkpoints)
        return (o, ht, Ai, checkpoints) if for_backward else (o, ht)
    h, v_new, ht = chunk_state(k, w, u, G, initial_state, output_final_state, chunk_size, N,
                               cu_seqlens=cu_seqlens, chunk_offsets=chunk_offsets,
                               num_chunks=idx["num_chunks"], dot_precision=prec)
    o = chunk_output(q, k, v_new, h, G, scale, chunk_size, chunk_offsets=chunk_offsets,
                     dot_precision=prec, **idx)
    return (o, ht, Ai, None) if for_backward else (o, ht)
