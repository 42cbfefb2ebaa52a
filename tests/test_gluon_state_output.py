"""The experimental fused Gluon state + output kernel: its sm_90a PTX on any machine, and on a
Hopper GPU the same o and final state as kernels/chunk_state.py + kernels/chunk_output.py."""
import pytest
import torch

from gdn_fused.eval.ptxas import _kernels, compile_report
from gdn_fused.eval.cases import rel_err
from gdn_fused.kernels import chunk_index

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels import gluon_state_output  # noqa: E402
from tests.test_gluon_state import state_inputs  # noqa: E402


def test_compiles_to_a_warp_specialized_tma_wgmma_kernel_for_hopper():
    """The signature and launch options are eval.ptxas' entry for this kernel."""
    build, options = _kernels()["chunk_state+output gluon (experimental)"]
    r = compile_report(*build(), **options)
    f = r["features"]
    # measured (Triton 3.6): 36 wgmma (Q Kᵀ, W S, Q S: 8 k-steps each; P V': 4; Kᵀ V'_decayed:
    # 2 M-halves × 4), 7 TMA loads (q, k, w as two 64-column boxes each, u) and no TMA store,
    # setmaxnreg 24 / 232 per role
    assert f["setmaxnreg"] > 0 and f["wgmma"] == 36 and f["tma"] == 7 and f["mbarrier"] > 0
    assert f["mma.sync"] == 0
    assert options["maxnreg"] == gluon_state_output.MAXNREG
    assert r["registers"] <= gluon_state_output.MAXNREG
    # measured 4 bytes stored / 8 loaded: one value the consumer keeps across the chunk loop,
    # stored once before it and loaded once after (SASS), nothing in the loop
    assert r["spill_stores"] <= 8 and r["spill_loads"] <= 8
    # a 2-stage ring of q, k, w (16 KB each) and u (8 KB), S and two V' tiles in bf16, four
    # mbarriers: 144 KB, one program an SM
    assert 144 * 1024 <= r["shared"] <= 227 * 1024


def assert_refuses_bad_shapes(f):
    """The input checks a state + output launcher f(q, k, w, u, G, scale, h0, final) makes
    before any launch (this kernel's and kernels/gluon_transposed.py's)."""
    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    G = torch.zeros(1, 64, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="K = V = 128"):
        f(q, q, q, q, G, 1., None, False)
    q = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        f(q.float(), q, q, q, G, 1., None, False)
    w = torch.zeros(1, 64, 3, 128, dtype=torch.bfloat16)  # 3 value heads over 2 key heads
    with pytest.raises(ValueError, match="do not match"):
        f(q, q, w, w, torch.zeros(1, 64, 3), 1., None, False)
    with pytest.raises(ValueError, match="initial_state"):
        f(q, q, q, q, G, 1., torch.zeros(1, 2, 128, 64), False)


def test_unsupported_inputs_are_refused(monkeypatch):
    # past the device check (gluon_transposed.check_state_inputs), as on a Hopper GPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(chunk_index, "capability", lambda device: (9, 0))
    assert_refuses_bad_shapes(gluon_state_output.chunk_state_output_gluon)


def assert_like_triton_state_output(o, ht, q, k, w, u, G, scale, h0):
    """(o, final state) of chunk_state + chunk_output on the same inputs, after checking that
    o and ht have their shapes and dtype and are finite."""
    from gdn_fused.kernels.chunk_output import chunk_output
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import dot_precision
    prec = dot_precision(k.dtype)
    h, v_new, ht_ref = chunk_state(k, w, u, G, h0, True, 64, q.shape[0], dot_precision=prec)
    o_ref = chunk_output(q, k, v_new, h, G, scale, 64, dot_precision=prec)
    torch.cuda.synchronize()
    assert o.shape == o_ref.shape and o.dtype == q.dtype and ht.shape == ht_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    return o_ref, ht_ref


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, initial_state, gate", [
    (1, 64, 1, 1, False, "normal"),
    (2, 256, 2, 4, True, "normal"),   # GVA: two value heads per key head
    (2, 200, 2, 2, True, "normal"),   # T not a multiple of 64: the last chunk is partial
    (3, 130, 1, 2, False, "strong"),  # e^{G_i − G_j} above the diagonal overflows unmasked
    (1, 1024, 4, 8, True, "normal"),
])
def test_matches_chunk_state_and_output(B, T, H, HV, initial_state, gate):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA and setmaxnreg need sm_90 (Hopper)")
    q, k, w, u, G, h0 = state_inputs(B, T, H, HV, initial_state, seed=T + HV, gate=gate)
    scale = 128 ** -0.5
    o, ht = gluon_state_output.chunk_state_output_gluon(q, k, w, u, G, scale, h0, True)
    o_ref, ht_ref = assert_like_triton_state_output(o, ht, q, k, w, u, G, scale, h0)
    assert rel_err(o, o_ref) <= 1e-2
    assert rel_err(ht, ht_ref) <= 1e-2
    o_only, none = gluon_state_output.chunk_state_output_gluon(q, k, w, u, G, scale, h0, False)
    assert none is None and rel_err(o_only, o) <= 1e-3
