"""PyTorch references for Gated DeltaNet: the token-by-token recurrence and the chunked form.

Both take already-validated tensors in the package layout (see :mod:`gdn_fused.ops`):
q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``, initial_state
``[N, HV, K, V]`` or None, cu_seqlens ``[N+1]`` (then B == 1) or None. They compute in the
dtype of ``v`` promoted with float32 — pass float64 tensors to get the truth every test in the
project compares against — and return ``(o, final_state)`` with o in that compute dtype.

Math (Yang, Kautz & Hatamizadeh, *Gated Delta Networks*, arXiv:2412.06464, eq. 10 and §3.3)::

    S_t = exp(g_t) (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ
    o_t = scale · S_tᵀ q_t

with S_t of shape [K, V] per value head; value head j reads q/k head j // (HV // H).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # flash-linear-attention's and transformers' l2norm epsilon
# Floor of a per-token log-decay: e^-128 is 0 in fp32 (and bf16), so a lower g (−1e4, −inf)
# decays exactly as much in those formats, while keeping the chunk's cumulative G small enough
# that G_i − G_j keeps its precision and −inf − (−inf) never makes a NaN.
LOG_DECAY_MIN = -128.0


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x²) + eps) over the last dim, computed in float32 (or float64) and cast back.

    The one rounding policy for the L2 norm in every path (kernels use the same formula)."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _segments(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int):
    """(batch index, start, end) for each sequence: rows of the batch, or packed segments."""
    if cu_seqlens is None:
        return [(b, 0, seqlen) for b in range(batch)]
    cu = cu_seqlens.tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    dtype = torch.promote_types(v.dtype, torch.float32)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    group = v.shape[2] // q.shape[2]
    # GVA: value head j reads q/k head j // group
    q = q.to(dtype).repeat_interleave(group, dim=2)
    k = k.to(dtype).repeat_interleave(group, dim=2)
    segs = _segments(cu_seqlens, q.shape[0], q.shape[1])
    N, HV, K, V = len(segs), v.shape[2], k.shape[-1], v.shape[-1]
    if initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=dtype, device=v.device)
    else:
        h0 = initial_state.to(dtype)
    if scale is None:
        scale = K ** -0.5
    return q, k, v.to(dtype), g.to(dtype), beta.to(dtype), scale, h0, segs


def recurrent_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None,
                                   output_final_state=True, cu_seqlens=None,
                                   use_qk_l2norm_in_kernel=False):
    """Token-by-token recurrence (the truth, in float64). Shapes as in the module docstring.

    Returns ``(o [B,T,HV,V], final_state [N,HV,K,V] or None)`` in the compute dtype."""
    q, k, v, g, beta, scale, h0, segs = _prepare(q, k, v, g, beta, scale, initial_state,
                                                 cu_seqlens, use_qk_l2norm_in_kernel)
    o = torch.zeros_like(v)
    ht = torch.empty_like(h0)
    for n, (b, bos, eos) in enumerate(segs):
        S = h0[n].clone()  # [HV, K, V]
        for t in range(bos, eos):
            kt, vt, bt = k[b, t], v[b, t], beta[b, t]  # [HV,K], [HV,V], [HV]
            S = S * torch.exp(g[b, t])[:, None, None]
            # delta rule: S += beta k (v - Sᵀk)ᵀ  ==  (I - beta k kᵀ) S + beta k vᵀ
            err = vt - torch.einsum("hkv,hk->hv", S, kt)
            S = S + bt[:, None, None] * kt[:, :, None] * err[:, None, :]
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
        ht[n] = S
    return o, (ht if output_final_state else None)


def _apply_inverse(A, kb, vb, solve_method, solve_iters):
    """(T kb, T vb) for T = A⁻¹: triangular solves, or an explicit inverse by ``solve_method``."""
    if solve_method is None:
        solve = lambda x: torch.linalg.solve_triangular(A, x, upper=False,  # noqa: E731
                                                        unitriangular=True)
        return solve(kb), solve(vb)
    from gdn_fused.inverse import invert_unit_lower
    T = invert_unit_lower(A, solve_method, iters=solve_iters).to(A.dtype)
    return T @ kb, T @ vb


class _LogDecayPairs(torch.autograd.Function):
    """D_ij = G_i − G_j, G the cumulative sum of g [..., C] over its last dim, whose backward
    forms dg_t = Σ_{j < t ≤ i} dD_ij − Σ_{i < t ≤ j} dD_ij from the pairs that span token t
    alone (the Triton backward's gate gradient, kernels/chunk_gate_bwd.py, in torch): the
    chain rule through G would add every pair at both its ends and let the reverse cumsum
    cancel them, leaving rounding of O(1) terms where dg is ~e^{−40}."""

    @staticmethod
    def forward(ctx, g):
        G = g.cumsum(-1)
        return G[..., :, None] - G[..., None, :]

    @staticmethod
    def backward(ctx, dD):
        def spanning(X):
            # Σ_{i ≥ t} Σ_{j < t} X_ij for each t (0 for t = 0)
            R = X.flip(-2).cumsum(-2).flip(-2).cumsum(-1)
            t = torch.arange(1, X.shape[-1], device=X.device)
            return torch.cat([torch.zeros_like(R[..., :1, 0]), R[..., t, t - 1]], -1)
        return spanning(dD) - spanning(dD.transpose(-1, -2))


def chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=True, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, chunk_size=64, solve_method=None,
                               solve_iters=None):
    """Chunked form (design card §Chunkwise form) in PyTorch: the CPU production path.

    Differentiable through torch autograd. Per chunk of ``chunk_size`` tokens with cumulative
    log-decay G: A = I + strictLower(D_beta (Γ ⊙ K Kᵀ)), T = A⁻¹ (triangular solve),
    W = T D_beta D_exp(G) K, U = T D_beta V, V' = U − W S₀,
    O = scale (D_exp(G) Q S₀ + lowerIncl(Γ ⊙ Q Kᵀ) V'), S ← exp(G_C) S₀ + (D_exp(G_C−G) K)ᵀ V'.
    Γ_ij = exp(G_i − G_j) is formed from differences only and masked before the exp, so strong
    decay never overflows. Returns ``(o, final_state)`` like the recurrence.

    solve_method None applies T by exact triangular solves; a method name forms T explicitly
    with :func:`gdn_fused.inverse.invert_unit_lower` (``solve_iters`` its iteration count), to
    study how each inverse propagates to the output."""
    q, k, v, g, beta, scale, h0, segs = _prepare(q, k, v, g, beta, scale, initial_state,
                                                 cu_seqlens, use_qk_l2norm_in_kernel)
    C = chunk_size
    dtype, dev = v.dtype, v.device
    eye = torch.eye(C, dtype=dtype, device=dev)
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(segs):
        S = h0[n]  # [HV, K, V]
        L = eos - bos
        pad = (-L) % C
        # [HV, NT, C, ...]; padded rows have k = v = beta = g = 0: they neither write nor decay
        def chunks(x):
            x = x[b, bos:eos].transpose(0, 1)  # [HV, L, ...]
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
            return x.reshape(x.shape[0], -1, C, *x.shape[2:])
        qc, kc, vc = chunks(q), chunks(k), chunks(v)
        gc = chunks(g.unsqueeze(-1)).squeeze(-1)
        bc = chunks(beta.unsqueeze(-1)).squeeze(-1)
        # G and its differences in fp64, exponentials in the compute dtype (as the kernels):
        # a difference of fp32 prefix sums would lose ulp(|G|) after a very negative gate
        g64 = gc.to(torch.float64)
        G64 = g64.cumsum(-1)  # [HV, NT, C]
        G = G64.to(dtype)
        # G_i − G_j with a gradient in g that sums only the pairs spanning each token
        # (_LogDecayPairs), and Γ's diagonal a constant 1: as plain differences of G, a pair
        # sends +x and −x to G_i and G_j, which dg's reverse cumsum cancels only to an ulp of
        # x where the true dg is ~e^{−40} (strong decay: new-user trial, session 28)
        diff = _LogDecayPairs.apply(g64).to(dtype)
        gamma_strict = torch.exp(torch.where(strict, diff, torch.full_like(diff, -torch.inf)))
        gamma_incl = gamma_strict + eye
        A = eye + bc[..., :, None] * gamma_strict * (kc @ kc.transpose(-1, -2))
        W, U = _apply_inverse(A, (bc * G.exp())[..., None] * kc, bc[..., None] * vc,
                              solve_method, solve_iters)
        attn = gamma_incl * (qc @ kc.transpose(-1, -2))
        # exp(G_C − G_i) ≤ 1 from the suffix sums Σ_{t>i} g_t, for the same reason: the last
        # row's factor is then a constant 1 (as are the padded rows' of a partial chunk),
        # not exp(G_C − G_C)
        after = torch.cat([g64[..., 1:].flip(-1).cumsum(-1).flip(-1),
                           torch.zeros_like(g64[..., :1])], -1)
        decay_out = after.to(dtype).exp()
        o_chunks = []
        for c in range(G.shape[1]):
            v_new = U[:, c] - W[:, c] @ S
            o_chunks.append(scale * (G[:, c].exp()[..., None] * (qc[:, c] @ S)
                                     + attn[:, c] @ v_new))
            S = G[:, c, -1].exp()[:, None, None] * S + \
                (decay_out[:, c, :, None] * kc[:, c]).transpose(-1, -2) @ v_new
        if o_chunks:
            o_seq = torch.stack(o_chunks, 1).reshape(v.shape[2], -1, v.shape[-1])[:, :L]
        else:
            o_seq = v.new_zeros(v.shape[2], 0, v.shape[-1])
        outs.append((b, bos, eos, o_seq.transpose(0, 1)))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack([x[3] for x in outs], 0) if outs else torch.zeros_like(v)
    else:
        pieces = [x[3] for x in outs]
        tail = v.shape[1] - (segs[-1][2] if segs else 0)
        pieces.append(v.new_zeros(tail, v.shape[2], v.shape[-1]))
        o = torch.cat(pieces, 0).unsqueeze(0)
    if not output_final_state:
        return o, None
    return o, (torch.stack(finals, 0) if finals else h0)
