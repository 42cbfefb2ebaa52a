"""Backward of the gated KKᵀ and of its inverse (device functions, used by kernels/wu_bwd.py).

Forward (kernels/kkt.py, kernels/kkt_solve.py), per chunk:

    A = strictLower(diag(β) (Γ ⊙ K Kᵀ)),  Γ_ij = exp(G_i − G_j),   T = (I + A)⁻¹

Inverse. For T = X⁻¹ a perturbation gives δT = −T δX T, so ⟨dT, δT⟩ = ⟨−Tᵀ dT Tᵀ, δX⟩ and

    dA = strictLower(−Tᵀ dT Tᵀ)

(δX = δA is strictly lower: the unit diagonal and the upper triangle are constants). T is lower
triangular, so only the strictly lower part of dT can matter (δT has a zero diagonal and upper
triangle); that part is selected first so rounding in the discarded entries never leaks in.

Gated KKᵀ. With E = dA ⊙ Γ (strictly lower, masked before the exp) and A_ij = β_i Γ_ij k_i·k_j:

    dK   = diag(β) E K + Eᵀ diag(β) K
    dβ_i = Σ_j E_ij (k_i·k_j)
    R    = dA ⊙ A = diag(β) (E ⊙ K Kᵀ)   — pair terms of G_i − G_j (kernels/chunk_gate_bwd.py)

(∂Γ_ij/∂G_i = Γ_ij, ∂Γ_ij/∂G_j = −Γ_ij). Only differences G_i − G_j ≤ 0 are exponentiated.
"""
import triton
import triton.language as tl

from gdn_fused.kernels.chunk_gate import gated_decay


@triton.jit
def kkt_solve_bwd(b_T, b_dT, strict, DOT_PREC: tl.constexpr):
    """dA = strictLower(−Tᵀ dT Tᵀ) for T = (I + A)⁻¹; b_T, b_dT [C, C] fp32, strict the
    (row-validity-masked) strictly-lower mask. Returns dA [C, C] fp32."""
    b_dT = tl.where(strict, b_dT, 0.)
    b_Tt = tl.trans(b_T)
    b_dA = tl.dot(b_Tt, tl.dot(b_dT, b_Tt, input_precision=DOT_PREC), input_precision=DOT_PREC)
    return tl.where(strict, -b_dA, 0.)


@triton.jit
def gated_kkt_bwd_gates(b_dA, b_kk, b_G, b_beta, strict):
    """Given dA, K Kᵀ [C, C] fp32, G [C] fp64 (chunk_log_decay) and β [C] fp32: returns
    (E = dA ⊙ Γ [C, C], dβ [C], R [C, C]): the write-strength gradient and the gate pair
    terms through A."""
    b_E = b_dA * gated_decay(b_G, b_G, strict)
    b_Ekk = b_E * b_kk
    return b_E, tl.sum(b_Ekk, 1), b_Ekk * b_beta[:, None]


@triton.jit
def gated_kkt_bwd_keys(b_E, b_k, b_beta, DOT_PREC: tl.constexpr):
    """dK through A for one block of key columns: diag(β) E K + Eᵀ diag(β) K.

    b_E [C, C] fp32, b_k [C, BK] in the data dtype, b_beta [C] fp32 -> [C, BK] fp32."""
    b_Ed = b_E.to(b_k.dtype)
    b_kb = (b_k.to(tl.float32) * b_beta[:, None]).to(b_k.dtype)
    return tl.dot(b_Ed, b_k, input_precision=DOT_PREC) * b_beta[:, None] \
        + tl.dot(tl.trans(b_Ed), b_kb, input_precision=DOT_PREC)
