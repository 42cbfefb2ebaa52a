"""Backward of W = T diag(β e^G) K and U = T diag(β) V, through T = (I + A)⁻¹ and the gated KKᵀ
A, finishing dK, dV, dβ and the per-token dg of a chunk.

With dW (kernels/chunk_bwd_dqkwg.py) and dU = dV' (kernels/chunk_bwd_state.py):

    dT   = dW (diag(β e^G) K)ᵀ + dU (diag(β) V)ᵀ
    dK  += diag(β e^G) Tᵀ dW,            dV  = diag(β) Tᵀ dU
    dβ_i = e^{G_i} k_i·(Tᵀ dW)_i + v_i·(Tᵀ dU)_i   (+ the part through A)
    ∂L/∂G_i ∋ β_i e^{G_i} k_i·(Tᵀ dW)_i             (a row term; + pair terms through A)

then dA from dT and the gradients through A (kernels/kkt_bwd.py). The gate terms are turned into
the gradient of the per-token g the caller passed (kernels/chunk_gate_bwd.py) and added to the
per-token dg of kernels/chunk_bwd_dqkwg.py summed over its key blocks.
Same math as flash-linear-attention's prepare_wy_repr_bwd (fla/ops/gated_delta_rule/wy_fast.py).
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_bwd_dqkwg import key_block
from gdn_fused.kernels.chunk_gate import chunk_log_decay, decay
from gdn_fused.kernels.chunk_gate_bwd import chunk_gate_bwd
from gdn_fused.kernels.chunk_index import chunk_head_grid, chunk_head_program
from gdn_fused.kernels.kkt_bwd import gated_kkt_bwd_gates, gated_kkt_bwd_keys, kkt_solve_bwd

# Triton 3.6's software pipelining of the first key loop (num_stages ≥ 2) miscompiles on Hopper:
# the K Kᵀ product stays an in-flight wgmma while the same iteration refills its K tile's
# shared-memory slot (cp.async), so K Kᵀ reads partly overwritten tiles. Measured on the H200
# (session 8): K Kᵀ off by 2 % (4 warps) and 11 % (8 warps) relative, different on every run, and
# dβ / dg with it; with one stage K Kᵀ matches torch to 1.4e-7 and every output is bit-identical
# run to run (tests/test_backward.py, GPU). eval/wgmma_hazards.py flags the pattern in the
# TTGIR at 2 and 3 stages and finds it gone at STAGES (tests/test_wgmma_hazards.py, any machine).
STAGES = 1
# Key columns a step of the two key loops; chunk_bwd_dqkwg's key blocks (the NKP partial dg it
# writes) may differ, their partials are summed in a loop of their own
BLOCK_K = 64


@triton.jit
def wu_bwd_kernel(k, v, g, beta, Ai, dw, dv2, dk, dg_part, dv, dbeta, dg, cu_seqlens,
                  chunk_indices, T, s_dgp, NK: tl.constexpr, NKP: tl.constexpr, H: tl.constexpr,
                  HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    i_t, i_hv, i_h, bos, seqlen = chunk_head_program(T, cu_seqlens, chunk_indices, H, HV, BT,
                                                     IS_VARLEN)
    p_T = tl.make_block_ptr(Ai + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                            (i_t * BT, 0), (BT, BT), (1, 0))
    p_b = tl.make_block_ptr(beta + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    b_T = tl.load(p_T, boundary_check=(0,), padding_option="zero").to(tl.float32)
    b_G = chunk_log_decay(g, bos, i_t, seqlen, i_hv, HV, BT)
    b_beta = tl.load(p_b, boundary_check=(0,), padding_option="zero").to(tl.float32)
    o_i = tl.arange(0, BT)
    valid = (i_t * BT + o_i) < seqlen
    strict = (o_i[:, None] > o_i[None, :]) & valid[:, None]
    b_eG = decay(b_G, valid)
    b_bg = b_beta * b_eG
    # products with K or V columns run in the data dtype (tensor cores), accumulating in fp32
    b_Tt = tl.trans(b_T).to(k.dtype.element_ty)
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_a = tl.zeros([BT], dtype=tl.float32)  # row terms of ∂L/∂G (through e^{G_i} in W)
    b_dg = tl.zeros([BT], dtype=tl.float32)  # per-token dg of the earlier kernels
    for i_k in range(NK):
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                                (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dw = tl.make_block_ptr(dw + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                                 (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_dw = tl.load(p_dw, boundary_check=(0, 1), padding_option="zero")
        b_kbg = (b_k.to(tl.float32) * b_bg[:, None]).to(b_k.dtype)
        b_dT += tl.dot(b_dw, tl.trans(b_kbg), input_precision=DOT_PREC)
        b_kTdw = tl.sum(tl.dot(b_Tt, b_dw, input_precision=DOT_PREC) * b_k.to(tl.float32), 1)
        b_db += b_kTdw * b_eG
        b_a += b_kTdw * b_bg
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PREC)
    # the partial dg of chunk_bwd_dqkwg's NKP key blocks (its blocks, not this kernel's)
    for i_p in range(NKP):
        p_dgp = tl.make_block_ptr(dg_part + i_p * s_dgp + bos * HV + i_hv, (seqlen,), (HV,),
                                  (i_t * BT,), (BT,), (0,))
        b_dg += tl.load(p_dgp, boundary_check=(0,), padding_option="zero")
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_du = tl.make_block_ptr(dv2 + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv = tl.make_block_ptr(dv + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero")
        b_du = tl.load(p_du, boundary_check=(0, 1), padding_option="zero")
        b_vb = (b_v.to(tl.float32) * b_beta[:, None]).to(b_v.dtype)
        b_dT += tl.dot(b_du, tl.trans(b_vb), input_precision=DOT_PREC)
        b_Tdu = tl.dot(b_Tt, b_du, input_precision=DOT_PREC)
        tl.store(p_dv, (b_Tdu * b_beta[:, None]).to(p_dv.dtype.element_ty),
                 boundary_check=(0, 1))
        b_db += tl.sum(b_Tdu * b_v.to(tl.float32), 1)
    b_dA = kkt_solve_bwd(b_T, b_dT, strict, DOT_PREC)
    b_E, b_dbA, b_R = gated_kkt_bwd_gates(b_dA, b_kk, b_G, b_beta, strict)
    b_db += b_dbA
    b_dg += chunk_gate_bwd(b_a, b_R, BT)
    for i_k in range(NK):
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                                (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dw = tl.make_block_ptr(dw + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                                 (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        p_dk = tl.make_block_ptr(dk + (bos * HV + i_hv) * K, (seqlen, K), (HV * K, 1),
                                 (i_t * BT, i_k * BK), (BT, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_dw = tl.load(p_dw, boundary_check=(0, 1), padding_option="zero")
        # Tᵀ dW again rather than a [C, K] round trip through HBM from the first pass
        b_dk = tl.load(p_dk, boundary_check=(0, 1), padding_option="zero") \
            + tl.dot(b_Tt, b_dw, input_precision=DOT_PREC) * b_bg[:, None] \
            + gated_kkt_bwd_keys(b_E, b_k, b_beta, DOT_PREC)
        tl.store(p_dk, b_dk.to(p_dk.dtype.element_ty), boundary_check=(0, 1))
    p_db = tl.make_block_ptr(dbeta + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    p_dg = tl.make_block_ptr(dg + bos * HV + i_hv, (seqlen,), (HV,), (i_t * BT,), (BT,), (0,))
    tl.store(p_db, b_db.to(p_db.dtype.element_ty), boundary_check=(0,))
    tl.store(p_dg, b_dg.to(p_dg.dtype.element_ty), boundary_check=(0,))


def wu_bwd(k, v, g, beta, Ai, dw, dv2, dk, dg_part, chunk_size, cu_seqlens=None,
           chunk_indices=None, num_chunks=None, dot_precision="ieee", block_v=None, **launch):
    """Finish the per-value-head gradients of a chunk.

    Args:
        k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (per token), beta: ``[B, T, HV]``;
        Ai: ``[B, T, HV, C]`` T = (I + A)⁻¹ (kernels/kkt_solve.py; fp32 or the data dtype, read
        in fp32); dw: ``[B, T, HV, K]``;
        dv2: like v; dk: ``[B, T, HV, K]`` partial in k's dtype, **completed in place** (the
        sum formed in fp32, rounded once);
        dg_part: ``[NKP, B, T, HV]`` fp32 per-token partial dg of chunk_bwd_dqkwg's NKP key
        blocks (any number; summed here).
    Returns:
        ``(dv like v, dbeta like beta, dg like g)``; a packed buffer's tail past
        cu_seqlens[-1] is exactly 0. ``block_v`` (value columns a loop step) and ``launch``
        (num_warps, num_stages) override the defaults for launch sweeps.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    BK = key_block(K, BLOCK_K)
    alloc = torch.zeros if cu_seqlens is not None else torch.empty
    dv = alloc(v.shape, dtype=v.dtype, device=v.device)
    dbeta = alloc(beta.shape, dtype=beta.dtype, device=v.device)
    dg = alloc(beta.shape, dtype=g.dtype, device=v.device)
    NT = num_chunks if cu_seqlens is not None else triton.cdiv(T, chunk_size)
    # dg_part's key blocks are dg_part.stride(0) apart (B·T·HV)
    launch = {"num_stages": STAGES, **launch}
    direct.launch(
        wu_bwd_kernel, chunk_head_grid(NT, B, HV),
        k, v, g, beta, Ai, dw, dv2, dk, dg_part, dv, dbeta, dg, cu_seqlens, chunk_indices, T,
        dg_part.stride(0), NK=triton.cdiv(K, BK), NKP=dg_part.shape[0], H=H, HV=HV, K=K, V=V,
        BT=chunk_size, BK=BK,
        BV=block_v or min(64, max(16, triton.next_power_of_2(V))),
        IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision, **launch)
    return dv, dbeta, dg
