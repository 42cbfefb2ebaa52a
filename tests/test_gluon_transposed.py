"""The experimental transposed-state Gluon state + output kernel: its sm_90a PTX on any machine,
and on a Hopper GPU the o and final state of chunk_state + chunk_output and of the fp64
recurrence."""
import pytest
import torch

from gdn_fused.eval.ptxas import _kernels, compile_report
from tests.cases import make_inputs, rel_err, truth

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels import gluon_transposed  # noqa: E402
from tests.test_gluon_state import state_inputs  # noqa: E402


@pytest.mark.parametrize("output, wgmma, tma", [(True, 32, 9), (False, 12, 8)])
def test_compiles_to_a_warp_specialized_kernel_with_register_operands(output, wgmma, tma):
    name = ("state+output transposed gluon" if output else
            "state transposed gluon, no output") + " (experimental)"
    build, options = _kernels()[name]
    r = compile_report(*build(), **options)
    f = r["features"]
    # measured (Triton 3.6): Sᵀ Wᵀ 8 k-steps and V'ᵀ K 4 on the chain; Q Kᵀ and Q h_c 8 each
    # and P V' 4 in the output warpgroup; TMA: q, k, w as two 64-column boxes each, u, the o
    # store; setmaxnreg per role (chain 256, output 120, producer 24)
    assert f["setmaxnreg"] > 0 and f["wgmma"] == wgmma and f["tma"] == tma
    assert f["mbarrier"] > 0 and f["mma.sync"] == 0
    assert r["registers"] <= gluon_transposed.MAXNREG
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0
    # a 2-stage ring of q, k, w (16 KB each) and u (8 KB), h_c and V' (24 KB a stage), the
    # gate vectors, o's staging tile: 174 KB, one program an SM
    assert r["shared"] <= 227 * 1024


def test_unsupported_inputs_are_refused():
    f = gluon_transposed.chunk_state_output_t
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


def _hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA and setmaxnreg need sm_90 (Hopper)")


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, initial_state, gate", [
    (1, 64, 1, 1, False, "normal"),
    (2, 256, 2, 4, True, "normal"),   # GVA: two value heads per key head
    (2, 200, 2, 2, True, "normal"),   # T not a multiple of 64: the last chunk is partial
    (3, 130, 1, 2, False, "strong"),  # e^{G_i − G_j} above the diagonal overflows unmasked
    (2, 1000, 2, 6, True, "zero"),    # GVA 3, no decay, partial last chunk
])
def test_matches_chunk_state_and_output(B, T, H, HV, initial_state, gate):
    from gdn_fused.kernels.chunk_output import chunk_output
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import dot_precision
    _hopper()
    q, k, w, u, G, h0 = state_inputs(B, T, H, HV, initial_state, seed=T + HV, gate=gate)
    scale = 128 ** -0.5
    o, ht = gluon_transposed.chunk_state_output_t(q, k, w, u, G, scale, h0, True)
    prec = dot_precision(k.dtype)
    h, v_new, ht_ref = chunk_state(k, w, u, G, h0, True, 64, B, dot_precision=prec)
    o_ref = chunk_output(q, k, v_new, h, G, scale, 64, dot_precision=prec)
    torch.cuda.synchronize()
    assert o.shape == o_ref.shape and o.dtype == q.dtype and ht.shape == ht_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    print(f"\n  transposed {B, T, H, HV, gate} vs chunk_state+chunk_output: "
          f"o {rel_err(o, o_ref):.2e} state {rel_err(ht, ht_ref):.2e}")
    assert rel_err(o, o_ref) <= 1e-2
    assert rel_err(ht, ht_ref) <= 1e-2
    o_only, none = gluon_transposed.chunk_state_output_t(q, k, w, u, G, scale, h0, False)
    assert none is None and rel_err(o_only, o) == 0.
    # the state-only pass: the same chain, so the same final state to the bit
    _, ht_only = gluon_transposed.chunk_state_output_t(q, k, w, u, G, scale, h0, True,
                                                       output=False)
    assert rel_err(ht_only, ht) == 0.


@pytest.mark.gpu
@pytest.mark.parametrize("gate, T", [("normal", 8192), ("zero", 8192), ("strong", 1000)])
def test_against_fp64(gate, T):
    """Against the fp64 recurrence on the Qwen3-Next head shape, with W and U from the
    materialized kernels (their bf16 rounding included): the materialized path's precision
    (measured 2026-11-30: o 3.3e-3 / 4.5e-3 / 2.9e-3, state 2.6e-3 / 3.9e-3 / 1.6e-3)."""
    _hopper()
    B, H, HV = 1, 2, 4
    seed = T + HV
    q, k, w, u, G, h0 = state_inputs(B, T, H, HV, True, seed=seed, gate=gate)
    qf, kf, v, g, beta, h0f = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16,
                                          initial_state=True, device="cuda", seed=seed,
                                          gate=gate)
    o_ref, ht_ref = truth(qf, kf, v, g, beta, h0f, scale=128 ** -0.5)
    o, ht = gluon_transposed.chunk_state_output_t(q, k, w, u, G, 128 ** -0.5, h0, True)
    print(f"\n  transposed {gate} T={T} vs fp64: o {rel_err(o, o_ref):.2e} "
          f"state {rel_err(ht, ht_ref):.2e}")
    assert rel_err(o, o_ref) <= 5e-3
    assert rel_err(ht, ht_ref) <= 5e-3
