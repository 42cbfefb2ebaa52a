"""The experimental Gluon chunk-state kernel: its sm_90a PTX on any machine, and on a Hopper GPU
the same h, v_new and final state as kernels/chunk_state.py."""
import pytest
import torch

from gdn_fused.eval.ptxas import _kernels, compile_report
from gdn_fused.eval.cases import make_inputs, rel_err

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels import gluon_state  # noqa: E402


def test_compiles_to_a_warp_specialized_tma_wgmma_kernel_for_hopper():
    """gluon.jit never interprets, so TRITON_INTERPRET=1 in the session does not matter here;
    the signature and launch options are eval.ptxas' entry for this kernel."""
    build, options = _kernels()["chunk_state gluon (experimental)"]
    r = compile_report(*build(), **options)
    f = r["features"]
    # measured (Triton 3.6): 16 wgmma (W S: 8 k-steps; Kᵀ V': 2 M-halves × 4 k-steps), 6 TMA
    # (k and w as two 64-column boxes each, u, the h store), setmaxnreg 24 / 232 per role
    assert f["setmaxnreg"] > 0 and f["wgmma"] == 16 and f["tma"] == 6 and f["mbarrier"] > 0
    assert f["mma.sync"] == 0
    assert options["maxnreg"] == gluon_state.MAXNREG and r["registers"] <= gluon_state.MAXNREG
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0
    # a 2-stage ring of k, w (16 KB each) and u (8 KB), S and V' in bf16, four mbarriers:
    # 104 KB, so two programs fit an SM's 227 KB
    assert r["shared"] <= 227 * 1024 // 2


def test_unsupported_inputs_are_refused():
    k = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    w = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    G = torch.zeros(1, 64, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_state.chunk_state_gluon(k, w, w, G, None, False)
    k, w = (torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(ValueError, match="cu_seqlens"):
        gluon_state.chunk_state_gluon(k, w, w, G, None, False,
                                      cu_seqlens=torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="bf16"):
        gluon_state.chunk_state_gluon(k.float(), w, w, G, None, False)


def forward_intermediates(B, T, H, HV, initial_state, seed, gate="normal"):
    """q, k, v, g, beta, h0 (bf16, K = V = 128) and G, T = (I + A)⁻¹ (bf16), W, U as the
    materialized forward makes them."""
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt import dot_precision
    from gdn_fused.kernels.kkt_solve import kkt_solve_from_k
    from gdn_fused.kernels.wu import recompute_w_u
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16,
                                       initial_state=initial_state, device="cuda", seed=seed,
                                       gate=gate)
    G = chunk_cumsum(g, 64)
    Ai = kkt_solve_from_k(k, G, beta, HV, 64, torch.bfloat16)
    w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision=dot_precision(k.dtype))
    return q, k, v, g, beta, h0, G, Ai, w, u


def state_inputs(B, T, H, HV, initial_state, seed, gate="normal"):
    """q, k, w, u, G, h0 as the materialized forward makes them (bf16, K = V = 128)."""
    q, k, _, _, _, h0, G, _, w, u = forward_intermediates(B, T, H, HV, initial_state, seed, gate)
    return q, k, w, u, G, h0


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, initial_state", [
    (1, 64, 1, 1, False),
    (2, 256, 2, 4, True),   # GVA: two value heads per key head
    (2, 200, 2, 2, True),   # T not a multiple of 64: the last chunk is partial
    (1, 1024, 4, 8, False),
])
def test_matches_chunk_state(B, T, H, HV, initial_state):
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import dot_precision
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA and setmaxnreg need sm_90 (Hopper)")
    _, k, w, u, G, h0 = state_inputs(B, T, H, HV, initial_state, seed=T + HV)
    h, v_new, ht = gluon_state.chunk_state_gluon(k, w, u, G, h0, True)
    h_ref, v_ref, ht_ref = chunk_state(k, w, u, G, h0, True, 64, B,
                                       dot_precision=dot_precision(k.dtype))
    torch.cuda.synchronize()
    assert h.shape == h_ref.shape and v_new.shape == v_ref.shape and ht.shape == ht_ref.shape
    assert rel_err(h, h_ref) <= 1e-2
    assert rel_err(v_new, v_ref) <= 1e-2
    assert rel_err(ht, ht_ref) <= 1e-2
