"""The reverse state recurrence: gradients of the per-chunk states, sequential over chunks.

Forward, per chunk c with entering state h_c (kernels/chunk_state.py):

    V'_c    = U_c − W_c h_c
    O_c     = scale (diag(e^G) Q_c h_c + M_c V'_c)
    h_{c+1} = e^{G_C} h_c + Kᵀ diag(e^{G_C − G}) V'_c

With dh_c := ∂L/∂h_{c+1} (the gradient of the state *leaving* chunk c; dht for the last chunk)
the chain rule gives, in reverse chunk order,

    dV'_c   = dV'_local,c + diag(e^{G_C − G}) K dh_c          (stored: "dv2")
    dh_{c−1} = e^{G_C} dh_c + scale Qᵀ diag(e^G) dO_c − W_cᵀ dV'_c

and ∂L/∂h0 is the gradient leaving the recurrence. With W = T diag(β e^G) K (the chain form,
CHAIN_T: the backward's default) the last term is computed as Kᵀ (diag(β e^G) (Tᵀ dV'_c)), W
never formed. Every exponent is ≤ 0 (G is a chunk-local
cumsum of log-decays ≤ 0), so nothing overflows under strong decay. The state gradient stays in
fp32 registers; the stored per-chunk dh_c use the dtype of k (like the forward's h).
"""
import torch
import triton
import triton.language as tl

from gdn_fused.kernels import launch as direct
from gdn_fused.kernels.chunk_gate import chunk_log_decay, decay
from gdn_fused.kernels.chunk_index import load_state_tile, state_program
from gdn_fused.kernels.chunk_state import check_chain_form, state_blocks, state_stages


@triton.jit
def chunk_bwd_state_kernel(q, k, w, g, do, dv_local, dh, dv2, dht, dh0, cu_seqlens,
                           chunk_offsets, beta, scale, T, H: tl.constexpr, HV: tl.constexpr,
                           K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, USE_FINAL_STATE_GRAD: tl.constexpr,
                           STORE_INITIAL_STATE_GRAD: tl.constexpr, IS_VARLEN: tl.constexpr,
                           DOT_PREC: tl.constexpr, CHAIN_T: tl.constexpr = False):
    """With CHAIN_T, w is T ([.., HV, BT] rows): Wᵀ dV' as Kᵀ diag(β e^G) (Tᵀ dV')."""
    i_v, i_n, i_hv, i_h, bos, seqlen, NT, boh, p_state = state_program(
        T, cu_seqlens, chunk_offsets, H, HV, K, V, BT, IS_VARLEN)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_FINAL_STATE_GRAD:
        b_dh = load_state_tile(dht, p_state, i_v, K, V, BK, BV)
    o_i = tl.arange(0, BT)
    for i_r in range(NT):
        i_t = NT - 1 - i_r
        p_dh = tl.make_block_ptr(dh + ((boh + i_t).to(tl.int64) * HV + i_hv) * K * V, (K, V), (V, 1),
                                 (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_dh, b_dh.to(p_dh.dtype.element_ty), boundary_check=(0, 1))
        valid = (i_t * BT + o_i) < seqlen
        b_G = chunk_log_decay(g, bos, i_t, seqlen, i_hv, HV, BT)
        b_G_last = tl.sum(tl.where(o_i == tl.minimum(BT, seqlen - i_t * BT) - 1, b_G, 0.))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (seqlen, K), (H * K, 1),
                                (i_t * BT, 0), (BT, BK), (1, 0))
        p_qt = tl.make_block_ptr(q + (bos * H + i_h) * K, (K, seqlen), (1, H * K),
                                 (0, i_t * BT), (BK, BT), (0, 1))
        p_do = tl.make_block_ptr(do + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                 (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dvl = tl.make_block_ptr(dv_local + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                  (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        p_dv2 = tl.make_block_ptr(dv2 + (bos * HV + i_hv) * V, (seqlen, V), (HV * V, 1),
                                  (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_qt = tl.load(p_qt, boundary_check=(0, 1), padding_option="zero")
        b_do = tl.load(p_do, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_dv = tl.load(p_dvl, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        # the state leaving the chunk saw row i decayed by e^{G_C − G_i} ≤ 1
        b_dv += tl.dot(b_k, b_dh.to(b_k.dtype), input_precision=DOT_PREC) \
            * decay(b_G_last - b_G, valid)[:, None]
        tl.store(p_dv2, b_dv.to(p_dv2.dtype.element_ty), boundary_check=(0, 1))
        b_dog = (b_do * (scale * decay(b_G, valid))[:, None]).to(b_qt.dtype)
        if CHAIN_T:
            # W = T diag(β e^G) K never formed: Wᵀ dV' = Kᵀ (diag(β e^G) Tᵀ dV')
            p_T = tl.make_block_ptr(w + (bos * HV + i_hv) * BT, (seqlen, BT), (HV * BT, 1),
                                    (i_t * BT, 0), (BT, BT), (1, 0))
            b_T = tl.load(p_T, boundary_check=(0, 1), padding_option="zero").to(b_k.dtype)
            b_beta = tl.load(beta + (bos + i_t * BT + o_i) * HV + i_hv, mask=valid,
                             other=0.).to(tl.float32)
            b_y = tl.dot(tl.trans(b_T), b_dv.to(b_k.dtype), input_precision=DOT_PREC) \
                * (b_beta * decay(b_G, valid))[:, None]
            b_wdv = tl.dot(tl.trans(b_k), b_y.to(b_k.dtype), input_precision=DOT_PREC)
        else:
            p_wt = tl.make_block_ptr(w + (bos * HV + i_hv) * K, (K, seqlen), (1, HV * K),
                                     (0, i_t * BT), (BK, BT), (0, 1))
            b_wt = tl.load(p_wt, boundary_check=(0, 1), padding_option="zero")
            b_wdv = tl.dot(b_wt, b_dv.to(b_wt.dtype), input_precision=DOT_PREC)
        b_dh = b_dh * tl.exp(b_G_last.to(tl.float32)) \
            + tl.dot(b_qt, b_dog, input_precision=DOT_PREC) - b_wdv
    if STORE_INITIAL_STATE_GRAD:
        p_dh0 = tl.make_block_ptr(dh0 + p_state, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_dh0, b_dh.to(p_dh0.dtype.element_ty), boundary_check=(0, 1))


def chunk_bwd_state(q, k, w, g, do, dv_local, scale, dht, initial_state, chunk_size, num_seqs,
                    cu_seqlens=None, chunk_offsets=None, num_chunks=None, dot_precision="ieee",
                    block_v=None, beta=None, **launch):
    """Reverse recurrence over chunks, one program per (value block, sequence, value head);
    value columns per program from :func:`~gdn_fused.kernels.chunk_state.state_blocks`, or
    ``block_v``; ``launch``: num_warps, num_stages (launch sweeps).

    Args:
        q, k: ``[B, T, H, K]``; w: ``[B, T, HV, K]`` (W of the forward, recomputed) or, with
        ``beta`` ``[B, T, HV]``, the forward's T ``[B, T, HV, C]`` (W = T diag(β e^G) K is
        then never formed: the dh term Wᵀ dV' is Kᵀ diag(β e^G) (Tᵀ dV'));
        g: ``[B, T, HV]`` per-token log-decay; do: ``[B, T, HV, V]``;
        dv_local: ``[B, T, HV, V]`` (kernels/chunk_bwd_dv.py); dht: ``[N, HV, K, V]``
        cotangent of the final state or None;
        initial_state: ``[N, HV, K, V]`` or None (then no dh0 is produced).
    Returns:
        ``(dh [NT_total, HV, K, V] in k's dtype — gradient of the state leaving each chunk,
        dv2 [B, T, HV, V] in do's dtype — the full ∂L/∂V',
        dh0 [N, HV, K, V] in initial_state's dtype or None)``.
    Raises:
        ValueError: with ``beta``, for a w or beta not shaped as T and β of do's heads
        (chunk_state.check_chain_form).
    """
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    NT = num_chunks if cu_seqlens is not None else B * triton.cdiv(T, chunk_size)
    check_chain_form("chunk_bwd_state", w, beta, do, chunk_size)
    dh = k.new_empty(NT, HV, K, V)
    dv2 = torch.zeros_like(do) if cu_seqlens is not None else torch.empty_like(do)
    dh0 = torch.empty_like(initial_state) if initial_state is not None else None
    # [BK, BV] fp32 dh in registers, BV as the forward's state pass (halved down to 32 while
    # SMs would idle): 934 µs at (1, 32768) against 1,563 with the 16 used until 2026-11-30
    BK, BV = state_blocks(K, V, num_seqs * HV, k.device)
    BV = block_v or BV
    grid = (triton.cdiv(V, BV), num_seqs * HV)
    launch = {"num_stages": state_stages(grid[0] * grid[1], k.device), **launch}
    direct.launch(chunk_bwd_state_kernel, grid, q, k, w, g, do, dv_local, dh, dv2, dht, dh0,
                  cu_seqlens, chunk_offsets, beta, scale, T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
                  BK=BK, BV=BV, USE_FINAL_STATE_GRAD=dht is not None,
                  STORE_INITIAL_STATE_GRAD=initial_state is not None,
                  IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision,
                  CHAIN_T=beta is not None, **launch)
    return dh, dv2, dh0
