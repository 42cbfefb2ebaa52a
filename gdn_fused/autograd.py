"""autograd for the Triton backends (materialized, fused).

The forward runs the chosen Triton path. The backward recomputes the chunked form in fp32
under torch autograd (:func:`gdn_fused.reference.chunk_gated_delta_rule_ref`) and
differentiates it: exact gradients for q, k, v, g, beta and initial_state on any device, saving
only the inputs (no intermediates). It is the correctness baseline that the Triton backward
kernels are tested against.
"""
from __future__ import annotations

import torch

from gdn_fused.reference import chunk_gated_delta_rule_ref, l2norm


def _forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
             chunk_size, solve_method="blocked", solve_iters=None):
    if backend == "fused":
        from gdn_fused.kernels.fused_fwd import fused_fwd
        return fused_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                         chunk_size)
    from gdn_fused.kernels.materialized import materialized_fwd
    o, ht, _ = materialized_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                cu_seqlens, chunk_size, solve_method=solve_method,
                                solve_iters=solve_iters)
    return o, ht


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens,
                chunk_size, backend, solve_method, solve_iters):
        o, ht = _forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                         cu_seqlens, chunk_size, solve_method, solve_iters)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.chunk_size = scale, chunk_size
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [x.detach().float().requires_grad_(x.requires_grad) if x is not None
                      else None for x in (q, k, v, g, beta, h0)]
            o, ht = chunk_gated_delta_rule_ref(*leaves[:5], ctx.scale, leaves[5], True,
                                               cu_seqlens, False, ctx.chunk_size)
            outs, grads = [o], [do.float()]
            if dht is not None:
                outs.append(ht)
                grads.append(dht.float())
            wrt = [x for x in leaves if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else None
        result = []
        for x, orig in zip(leaves, (q, k, v, g, beta, h0)):
            if x is not None and x.requires_grad:
                d = next(got)
                result.append(torch.zeros_like(orig) if d is None else d.to(orig.dtype))
            else:
                result.append(None)
        dq, dk, dv, dg, dbeta, dh0 = result
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None, None


def chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, use_qk_l2norm_in_kernel, chunk_size, backend,
                                  solve_method="blocked", solve_iters=None):
    """Run a Triton backend on validated inputs; differentiable in every input."""
    if use_qk_l2norm_in_kernel:
        # one rounding policy (gdn_fused.reference.l2norm) in every path; autograd flows through
        q, k = l2norm(q), l2norm(k)
    o, ht = ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, initial_state, scale,
                                              output_final_state, cu_seqlens, chunk_size,
                                              backend, solve_method, solve_iters)
    return o, (ht if output_final_state else None)
