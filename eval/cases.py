"""Inputs for the hard regimes every path is tested in, and the error measure.

Gates: "normal" g = logsigmoid(N(0,1)); "zero" g = 0 exactly; "strong" g ~ U[-70, -30]
(decay to exp(-4480) within a chunk); "spike" g = -90 at each chunk's first token, 0 elsewhere;
"mixed" each value head's g constant, ln(γ)/chunk_size with γ, its decay over a chunk, cycling
through 1, 0.6, 0.4, 0.1 across the heads (heads that keep their state beside heads that
forget it: the chunk-wise choices of gluon_transposed.STATE_UPDATE_LO_ABOVE; γ is per
chunk_size tokens, the kernels' chunk of 64 by default).
"""

import torch
import torch.nn.functional as F

# "mixed": each value head's decay over a chunk, γ = e^{G_C}, cycling across the heads
MIXED_GAMMAS = (1., 0.6, 0.4, 0.1)


def make_inputs(B, T, H, HV, K, V, dtype=torch.float32, gate="normal", beta="uniform",
                initial_state=False, num_seqs=None, device="cpu", seed=0, chunk_size=64):
    """Random q, k (L2-normalised), v, g, beta [, h0] in the package layout.

    q, k, v in ``dtype``; g, beta fp32; h0 [num_seqs or B, HV, K, V] fp32 or None."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    if gate == "normal":
        g = F.logsigmoid(torch.randn(B, T, HV, generator=gen))
    elif gate == "zero":
        g = torch.zeros(B, T, HV)
    elif gate == "strong":
        g = -30 - 40 * torch.rand(B, T, HV, generator=gen)
    elif gate == "spike":
        g = torch.zeros(B, T, HV)
        g[:, ::chunk_size] = -90.
    elif gate == "mixed":
        gammas = torch.tensor(MIXED_GAMMAS).repeat(HV)[:HV]
        g = (gammas.log() / chunk_size).expand(B, T, HV).clone()
    else:
        raise ValueError(gate)
    b = torch.zeros(B, T, HV) if beta == "zero" else torch.rand(B, T, HV, generator=gen)
    h0 = None
    if initial_state:
        h0 = torch.randn(num_seqs or B, HV, K, V, generator=gen)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            g.to(**to), b.to(**to), None if h0 is None else h0.to(**to))


def rel_err(x, ref):
    """‖x − ref‖ / ‖ref‖ in fp64 (Frobenius); 0 when both are 0."""
    x, ref = x.double().cpu(), ref.double().cpu()
    den = ref.norm()
    return float((x - ref).norm() / den) if den > 0 else float((x - ref).norm())


def truth(q, k, v, g, beta, h0=None, cu_seqlens=None, scale=None):
    """The fp64 token-by-token recurrence on the same inputs, on their device."""
    from gdn_fused.reference import recurrent_gated_delta_rule_ref
    f64 = lambda x: None if x is None else x.detach().double()  # noqa: E731
    return recurrent_gated_delta_rule_ref(f64(q), f64(k), f64(v), f64(g), f64(beta), scale,
                                          f64(h0), True, cu_seqlens)
