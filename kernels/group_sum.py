"""The gradient of a q/k head shared by a GVA group: the sum of its value heads' partials, formed
in fp32 and rounded once to the data dtype, in one pass.

The backward's dq and dk come out per value head ([B, T, HV, K] in the data dtype, as fla's do;
fp32 before session 9); q and k have H = HV / group heads, value head hv reading head hv //
group, so dq[:, :, h] is the sum over hv = h·group … h·group + group − 1. With the fp32 partials
of sessions 5–8, torch's ``x.view(B, T, H, group, K).sum(3).to(dtype)`` took two passes with an
fp32 intermediate (per token: read 4·HV·K bytes, write 4·H·K, read them back, write 2·H·K); this
kernel reads the partials once and writes the result once. The sum runs in fp32 over the group
in order, then rounds once (torch's sum of the fp32 partials to the bit at group 2; at larger
groups torch may add in another order).
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct

ROWS = 32  # (token, head) rows a program


@triton.jit
def group_sum_kernel(x, y, N, GROUP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                     BR: tl.constexpr):
    """y [N, K] = Σ_j x [N, GROUP, K][:, j] summed in fp32 (x, y any float dtypes), BR rows a
    program; offsets in int64: B·T·HV·K passes 2³¹ at (16, 32768) with HV = 32, K = 128."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.static_range(GROUP):
        acc += tl.load(x + (rows[:, None] * GROUP + j) * K + cols[None, :], mask=mask,
                       other=0.).to(tl.float32)
    tl.store(y + rows[:, None] * K + cols[None, :], acc.to(y.dtype.element_ty), mask=mask)


def group_sum(x, num_heads, dtype):
    """x ``[B, T, HV, K]`` (any float dtype), contiguous, HV a multiple of ``num_heads`` (H) ->
    ``[B, T, H, K]`` in ``dtype``: head h the sum of value heads h·(HV/H) … (h+1)·(HV/H) − 1,
    formed in fp32. x itself when HV = H and x is already in ``dtype`` (nothing to sum).
    Raises ValueError for a non-contiguous x or HV not a multiple of H (the kernel indexes x
    as contiguous [B·T·H, HV/H, K])."""
    B, T, HV, K = x.shape
    if not x.is_contiguous():
        raise ValueError(f"group_sum: x must be contiguous, got strides {x.stride()}")
    if HV % num_heads:
        raise ValueError(f"group_sum: x's {HV} heads are not a multiple of num_heads="
                         f"{num_heads}")
    if HV == num_heads and x.dtype == dtype:
        return x
    y = torch.empty(B, T, num_heads, K, dtype=dtype, device=x.device)
    N = B * T * num_heads
    direct.launch(group_sum_kernel, (triton.cdiv(N, ROWS),), x, y, N, GROUP=HV // num_heads,
                  K=K, BK=triton.next_power_of_2(K), BR=ROWS)
    return y
