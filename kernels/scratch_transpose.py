"""The transpose of a register tile, optionally through global memory.

Triton 3.4 – 3.7.0 on Hopper miscompiles some gated-backward kernels. One pattern fla reports
is a ``tl.trans`` of a tensor that came out of ``tl.dot`` (an MMA-layout tensor, transposed
into a ``#linear`` layout) feeding another ``tl.dot`` (fla-org/flash-linear-attention issue
#640, fixed there by a scratch round trip). Three of our backward kernels use that pattern
(chunk_bwd_dqkwg, chunk_bwd_dv_local, and wu_bwd through kkt_bwd.gated_kkt_bwd_keys). On the
H200 their dg and dbeta differ from run to run (docs/backward.md, "Determinism (open)").

``TRANS_SCRATCH`` routes those transposes through a per-program scratch tile instead: it is
opt-in, for an A/B run (``python -m eval.determinism --scratch``), until the GPU shows which
form is correct and deterministic. The scratch form stores the tile, waits at a CTA barrier,
then loads it transposed. It is exact (no rounding), so both forms agree to the bit under the
interpreter (tests/test_scratch_transpose.py).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def transpose_tile(x, scratch, TRANS_SCRATCH: tl.constexpr):
    """xᵀ of an [R, C] tile: ``tl.trans(x)``, or with TRANS_SCRATCH through this program's
    own R·C elements of ``scratch`` (x's dtype; the launch's 1-D grid indexes the tiles). A
    barrier before the stores too, so a program may transpose in a loop."""
    if TRANS_SCRATCH:
        R: tl.constexpr = x.shape[0]
        C: tl.constexpr = x.shape[1]
        tile = scratch + tl.program_id(0).to(tl.int64) * (R * C)
        o_r = tl.arange(0, R)
        o_c = tl.arange(0, C)
        tl.debug_barrier()  # the previous transpose's loads are done before this one's stores
        tl.store(tile + o_r[:, None] * C + o_c[None, :], x)
        tl.debug_barrier()  # every thread's stores are visible to the block's loads
        return tl.load(tile + o_r[None, :] * C + o_c[:, None])
    else:
        return tl.trans(x)


def scratch_tiles(enabled, grid, rows, cols, dtype, device):
    """The scratch of :func:`transpose_tile` for a 1-D ``grid`` ([programs, rows, cols] in
    ``dtype``), or None when ``enabled`` is False (the kernel then ignores it)."""
    return torch.empty(grid[0], rows, cols, dtype=dtype, device=device) if enabled else None
