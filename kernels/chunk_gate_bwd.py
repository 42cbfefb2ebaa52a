"""Backward of the chunk-local cumsum G_i = g_1 + … + g_i: per-token dg without cancellation.

Every way the loss depends on G inside a chunk is one of two kinds:

- row terms, through a single e^{G_i} (≤ 1): contributions a_i to ∂L/∂G_i;
- pair terms, through a difference G_i − G_j with i > j (Γ_ij = e^{G_i − G_j} in the output, in
  A, and e^{G_C − G_j} in the state update): contributions Z_ij, with ∂L/∂G_i += Z_ij and
  ∂L/∂G_j −= Z_ij.

Since G_i = Σ_{t≤i} g_t, dg_t = Σ_{i≥t} ∂L/∂G_i, and a pair (i, j) survives in dg_t only when it
straddles t (j < t ≤ i); otherwise its +Z_ij and −Z_ij cancel. The common route (accumulate
∂L/∂G_i = a_i + Σ_j Z_ij − Σ_j Z_ji, then reverse-cumsum; flash-linear-attention's) forms those
cancelling pairs in floating point: under strong decay (g ∈ [−70, −30]) the true dg is ~1e−14
while the diagonal pairs (i = j, Γ = 1) and the end-of-chunk pairs are O(1), so the rounding of
the cancellation swamps the result (measured: 3 % error even in fp64, 10⁷× in fp32). Here

    dg_t = Σ_{i≥t} a_i + Σ_{j<t} Σ_{i≥t} Z_ij

with exactly-cancelling terms never formed: the diagonal is excluded from Z, and the straddling
sum is a reverse cumsum over rows followed by a masked sum over columns (O(C²), no
subtraction). The result is accurate relative to the terms that actually reach dg_t.
"""
import triton
import triton.language as tl


@triton.jit
def chunk_gate_bwd(b_a, b_Z, BT: tl.constexpr):
    """Per-token dg [C] fp32 of one chunk from row terms b_a [C] and strictly-lower pair terms
    b_Z [C, C] (fp32; entries on or above the diagonal must be 0)."""
    o_i = tl.arange(0, BT)
    b_Y = tl.cumsum(b_Z, axis=0, reverse=True)  # Y_tj = Σ_{i≥t} Z_ij
    return tl.cumsum(b_a, axis=0, reverse=True) \
        + tl.sum(tl.where(o_i[None, :] < o_i[:, None], b_Y, 0.), 1)
