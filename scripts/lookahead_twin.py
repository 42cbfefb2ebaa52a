"""Rounding of a planned chain form of forward_t, on the torch twin of its chain (CPU).

The shipped chain forms X_j = K_j bf16(S_j) at each step, after S_j's update. The planned
lookahead (docs/fused_design.md, session 27) forms it from the previous step's terms,

    X_j = γ_{j−1} K_j bf16(S_{j−1}) + C_j bf16(d_{j−1}),   C_j = K_j K_{j−1}ᵀ,

(with the update's low half d − bf16(d) as a second product where the update takes it), so
that the first term can run beside the previous step's V' product (built in session 28, commit
9e5e2cb, and measured slower on the H200: docs/fused_design.md, session 28). This prints the
final state's error against the fp64 recurrence for the shipped twin and for the lookahead
with C_j rounded to bf16 and kept in fp32, at g = 0 over 8,192 tokens (where the state error
binds), at γ = 0.6 a chunk and with normal gates (B = 1, H = 2, HV = 4, K = V = 128, bf16).

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python scripts/lookahead_twin.py
"""
import torch

from eval.cases import rel_err, truth
from gdn_fused.kernels import gluon_transposed
from tests.test_gluon_transposed import _chain_form_in_torch, _twin_inputs

C = 64


def lookahead_state(k, v, G, beta, Ai, h0, lo_above, c_in_bf16):
    """The twin's final state (dense, T a multiple of 64) with X_j formed by the lookahead."""
    H, HV = k.shape[2], v.shape[2]
    bf16 = lambda x: x.to(torch.bfloat16).float()  # noqa: E731 (a bf16 rounding)
    kh = k.repeat_interleave(HV // H, dim=2).float()
    S, previous = h0.float().clone(), None
    for j in range(k.shape[1] // C):
        rows = slice(j * C, (j + 1) * C)
        chunk = lambda x: x[:, rows].transpose(1, 2)  # noqa: E731 [B, HV, C, ·]
        Kc, Vc, Tc = chunk(kh), chunk(v.float()), chunk(Ai.float())
        g = chunk(G.double().unsqueeze(-1))[..., 0]
        b = chunk(beta.float().unsqueeze(-1))[..., 0]
        if previous is None:
            KS = Kc @ bf16(S)
        else:
            K_prev, h_prev, gam_prev, d_prev, low = previous
            Cj = Kc @ K_prev.transpose(-1, -2)
            Cj = bf16(Cj) if c_in_bf16 else Cj
            KS = gam_prev * (Kc @ h_prev) + Cj @ bf16(d_prev)
            if low:
                KS = KS + Cj @ bf16(d_prev - bf16(d_prev))
        X = bf16((Vc - torch.exp(g.float()).unsqueeze(-1) * KS) * b.unsqueeze(-1))
        d = (Tc @ X) * torch.exp((g[..., -1:] - g).float()).unsqueeze(-1)
        gam = torch.exp(g[..., -1:].float()).unsqueeze(-1)
        low = bool((gam > lo_above).all())   # one γ for all heads in these inputs
        h = bf16(S)
        S = gam * S + Kc.transpose(-1, -2) @ bf16(d)
        if low:
            S = S + Kc.transpose(-1, -2) @ bf16(d - bf16(d))
        previous = (Kc, h, gam, d, low)
    return S


def main():
    lo_above = gluon_transposed.STATE_UPDATE_LO_ABOVE
    for T, gate, gamma in ((8192, "zero", None), (8192, "zero", 0.6), (4096, "normal", None)):
        q, k, v, g, beta, h0, G, Ai = _twin_inputs(T, gate, gamma)
        _, ht_ref = truth(q, k, v, g, beta, h0, scale=128 ** -0.5)
        _, ht = _chain_form_in_torch(q, k, v, G, beta, Ai, 128 ** -0.5, h0, lo_above=lo_above)
        c16 = lookahead_state(k, v, G, beta, Ai, h0, lo_above, True)
        c32 = lookahead_state(k, v, G, beta, Ai, h0, lo_above, False)
        print(f"T={T} {gate} γ={gamma}: shipped {rel_err(ht, ht_ref):.3e}  lookahead C bf16 "
              f"{rel_err(c16, ht_ref):.3e}  C fp32 {rel_err(c32, ht_ref):.3e}", flush=True)


if __name__ == "__main__":
    main()
