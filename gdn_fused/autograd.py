"""autograd for the Triton backends (materialized, fused).

The forward runs the chosen Triton path; the backward is the same for both (the fused forward
computes the same chunkwise math): the Triton chunk kernels of
:func:`gdn_fused.kernels.chunk_bwd.chunk_gated_delta_rule_bwd`, which recompute the
intermediates from the inputs. Saved for backward: the kernel inputs (q, k, v, g, beta,
initial_state, cu_seqlens) and, after a materialized forward with the blocked inverse, its
T = (I + A)⁻¹ — what fla saves too (its ``A``): C values a token and value head in the data's
storage dtype (C·2 = 128 B in bf16 at C = 64, 4 KB a token at HV = 32), which spares the
backward its most latency-bound recompute (chunk_inverse: 250 µs of the backward's 5.4 ms at
B = 1, T = 32768, H200, session 9). The backward would compute the same bits (the same kernel
on the same inputs), so the gradients do not change. The fused forward's Hopper route
(kernels/fused_fwd.uses_warp_specialized) computes that same T and passes it too; its
plain-Triton kernel's inverse is fp32, and other methods' inverses are not the blocked one:
after those the backward recomputes T. Where B·HV leaves SMs idle, the Hopper route's
training forward (either backend) also keeps the fp32 state entering every 64th chunk (16 B a
token and value head: 0.5 KB a token at HV = 32, an eighth of T's bytes), so that the
backward's recompute of the per-chunk states runs 64-chunk segments side by side
(kernels/chunk_state.py, docs/backward.md). Most saved inputs are the caller's own tensors; two
can be copies the op made: q and k after ``use_qk_l2norm_in_kernel`` (2·H·K elements a token
in their dtype) and g after the op's clamp at LOG_DECAY_MIN (HV fp32 a token) — what autograd
keeps for those element-wise ops anyway.

:func:`backward_by_recompute` is the slow exact reference: it differentiates the chunked torch
form (:func:`gdn_fused.reference.chunk_gated_delta_rule_ref`) in fp32 under torch autograd.
"""
from __future__ import annotations

import torch
from torch.autograd import forward_ad

from gdn_fused.reference import LOG_DECAY_MIN, chunk_gated_delta_rule_ref, l2norm


def _forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
             chunk_size, solve_method="blocked", solve_iters=None, cu_seqlens_cpu=None,
             for_backward=False):
    """(o, final_state), and with ``for_backward`` (o, final_state, T or None, checkpoints or
    None): the forward's T and state checkpoints where the backward can read them instead of
    recomputing (module docstring)."""
    if backend == "fused":
        from gdn_fused.kernels.fused_fwd import fused_fwd
        return fused_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, for_backward=for_backward)
    from gdn_fused.kernels.materialized import materialized_fwd
    # only the blocked inverse in the default storage dtype is the T the backward computes
    # (and only its states are the ones the backward's recompute continues from)
    keep = for_backward and solve_method == "blocked" and solve_iters is None
    out = materialized_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                           cu_seqlens, chunk_size, solve_method=solve_method,
                           solve_iters=solve_iters, cu_seqlens_cpu=cu_seqlens_cpu,
                           for_backward=keep)
    return (*out, None, None) if for_backward and not keep else out


def backward_by_recompute(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens,
                          chunk_size, needs=(True,) * 6):
    """Reference gradients: torch autograd through the chunked form recomputed in fp32.

    Same arguments as :func:`gdn_fused.kernels.chunk_bwd.chunk_gated_delta_rule_bwd` up to
    chunk_size (plus ``needs``: which of q, k, v, g, beta, initial_state want a gradient); returns
    ``(dq, dk, dv, dg, dbeta, dh0)`` in the inputs' dtypes, None where not needed. Exact but
    slow (a Python loop over chunks); for tests and as a fallback to compare against."""
    inputs = (q, k, v, g, beta, initial_state)
    with torch.enable_grad():
        leaves = [x.detach().float().requires_grad_(need) if x is not None else None
                  for x, need in zip(inputs, needs)]
        o, ht = chunk_gated_delta_rule_ref(*leaves[:5], scale, leaves[5], True, cu_seqlens,
                                           False, chunk_size)
        outs, grads = [o], [do.float()]
        if dht is not None:
            outs.append(ht)
            grads.append(dht.float())
        wrt = [x for x in leaves if x is not None and x.requires_grad]
        got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else None
    result = []
    for x, orig in zip(leaves, inputs):
        if x is not None and x.requires_grad:
            d = next(got)
            result.append(torch.zeros_like(orig) if d is None else d.to(orig.dtype))
        else:
            result.append(None)
    return tuple(result)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
                chunk_size, backend, solve_method, solve_iters, cu_seqlens_cpu):
        o, ht, Ai, checkpoints = _forward(backend, q, k, v, g, beta, scale, initial_state,
                                          output_final_state, cu_seqlens, chunk_size,
                                          solve_method, solve_iters, cu_seqlens_cpu,
                                          for_backward=True)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, Ai, checkpoints)
        # the host copy of the offsets: the backward sizes its grids without a device read
        ctx.scale, ctx.chunk_size, ctx.cu_seqlens_cpu = scale, chunk_size, cu_seqlens_cpu
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        from gdn_fused.kernels.chunk_bwd import chunk_gated_delta_rule_bwd
        q, k, v, g, beta, h0, cu_seqlens, Ai, checkpoints = ctx.saved_tensors
        with torch.no_grad():
            grads = chunk_gated_delta_rule_bwd(q, k, v, g, beta, ctx.scale, h0, do, dht,
                                               cu_seqlens, ctx.chunk_size, ctx.cu_seqlens_cpu,
                                               Ai=Ai, checkpoints=checkpoints)
        grads = [d if need else None for d, need in zip(grads, ctx.needs_input_grad[:6])]
        return (*_first_order_only(grads), None, None, None, None, None, None, None, None)


class _FirstOrderOnly(torch.autograd.Function):
    """The Triton backward's gradients, passed through; differentiating them raises."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(d.view_as(d) for d in grads)

    @staticmethod
    def backward(ctx, *unused):
        raise RuntimeError(
            "chunk_gated_delta_rule: the materialized and fused backends' backward is "
            "first-order only (Triton kernels); differentiating their gradients (a gradient "
            "penalty, create_graph=True) needs backend='torch'")


def _first_order_only(grads):
    """``grads`` as they are, or, when the backward runs with create_graph=True (grad mode
    on), behind a node whose backward raises. torch's @once_differentiable attaches such a
    node only where an incoming gradient requires grad, so a loss linear in o (a gradient
    penalty on (o · W).sum()) dropped the penalty's terms silently (new-user trial, session
    28); here every gradient of a first-order-only backward carries it."""
    if not torch.is_grad_enabled():
        return grads
    kept = [i for i, d in enumerate(grads) if d is not None]
    if not kept:
        return grads
    out = _FirstOrderOnly.apply(*(grads[i].detach().requires_grad_() for i in kept))
    out = out if isinstance(out, tuple) else (out,)
    grads = list(grads)
    for i, d in zip(kept, out):
        grads[i] = d
    return grads


def chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, use_qk_l2norm_in_kernel, chunk_size, backend,
                                  solve_method="blocked", solve_iters=None, cu_seqlens_cpu=None):
    """Run a Triton backend on validated inputs; differentiable in every input.

    solve_method, solve_iters choose the forward's kkt_solve method (the inverse study); the
    backward always uses T from the stable blocked inverse (the forward's own when it ran that
    one, else recomputed), so the gradients are those of the exact function, whichever inverse
    the forward used. cu_seqlens_cpu: the validated
    offsets on the host, reused by the forward's and the backward's launchers."""
    if use_qk_l2norm_in_kernel:
        # one rounding policy (gdn_fused.reference.l2norm) in every path; autograd flows through
        q, k = l2norm(q), l2norm(k)
    inputs = (q, k, v, g, beta, initial_state)
    needs_graph = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in inputs)
    # forward-mode AD (dual tensors do not set requires_grad) must meet the Function, which
    # raises that it has no jvp, rather than lose the tangent
    if needs_graph or forward_ad._current_level >= 0:
        # g floored by torch, whose clamp gives the gradient 0 below LOG_DECAY_MIN (the kernels
        # floor it again where they load it: a no-op then)
        g = g.clamp(min=LOG_DECAY_MIN)
        o, ht = ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, scale,
                                                  output_final_state, cu_seqlens, chunk_size,
                                                  backend, solve_method, solve_iters,
                                                  cu_seqlens_cpu)
    else:
        # inference: no graph to record, so no autograd.Function (~30 µs of host time a call,
        # which short prompts pay in full) and no clamp launch: every kernel reading g floors
        # it at LOG_DECAY_MIN as it loads it (kernels/chunk_gate.floored)
        o, ht = _forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                         cu_seqlens, chunk_size, solve_method, solve_iters, cu_seqlens_cpu)
    return o, (ht if output_final_state else None)
