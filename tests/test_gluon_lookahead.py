"""forward_t's main launch with the lookahead chain (kernels/gluon_lookahead.py, experimental):
its sm_90a compile on any machine; its torch twin's rounding on the CPU; on a Hopper GPU its
o and final state against the twin, the fp64 recurrence and the shipped chain."""
import pytest
import torch

from gdn_fused.eval.cases import rel_err, truth
from gdn_fused.eval.ptxas import _kernels, compile_report

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels import gluon_lookahead, gluon_transposed  # noqa: E402
from tests.test_gluon_state import forward_intermediates  # noqa: E402
from tests.test_gluon_transposed import (_chain_form_in_torch, _hopper,  # noqa: E402
                                         _twin_inputs)


@pytest.mark.parametrize("name, spill", [
    ("forward transposed gluon, lookahead chain (experimental)", 116),
    ("forward transposed gluon, lookahead chain, checkpoints (experimental)", 156),
])
def test_compiles_with_its_products_pipelined(name, spill):
    """sm_90a (Triton 3.6, measured): the chain's V', Z, d C and update products (with the
    low half, in its branch) and the output's C, Q Kᵀ, Q h_c and P V'; every wgmma pipelined
    (ptxas serializes none), no register operand rewritten while a product reads it, one
    program an SM (204 KB of shared memory: the key ring and the C tiles on top of the ring)
    and at most the measured spills (the low-half branch's, outside the common path)."""
    from gdn_fused.eval.ptxas import register_operand_hazards, sass
    build, options = _kernels()[name]
    fn, sig, consts = build()
    from gdn_fused.eval.ptxas import compile_for, report_of
    compiled = compile_for(fn, sig, consts, 90, **options)
    r = report_of(compiled, 90, **options)
    f = r["features"]
    assert f["setmaxnreg"] > 0 and f["wgmma"] == 92 and f["tma"] == 10 and f["mma.sync"] == 0
    assert r["registers"] <= 168 and r["spill_stores"] <= spill
    assert not r["wgmma_serialized"], r["wgmma_serialized"]
    assert register_operand_hazards(sass(compiled)) == []
    assert 200 * 1024 <= r["shared"] <= 227 * 1024


def test_twin_of_the_lookahead_keeps_the_state_bound_at_g_zero():
    """Where nothing decays (g = 0, 8,192 tokens, H = 2, HV = 4) the lookahead's roundings
    (bf16 γ S for Z, bf16 C, the low half in X where the update takes it) leave the final
    state within 2.7e-3 of fp64 (CPU: 2.577e-3; the shipped chain 2.444e-3), and the form is
    not the shipped one (the states differ)."""
    q, k, v, g, beta, h0, G, Ai = _twin_inputs(8192, "zero")
    _, ht_ref = truth(q, k, v, g, beta, h0, scale=128 ** -0.5)
    lo = gluon_transposed.STATE_UPDATE_LO_ABOVE
    _, ht = _chain_form_in_torch(q, k, v, G, beta, Ai, 128 ** -0.5, h0, lo_above=lo,
                                 lookahead=True)
    _, ht_shipped = _chain_form_in_torch(q, k, v, G, beta, Ai, 128 ** -0.5, h0, lo_above=lo)
    assert rel_err(ht, ht_ref) <= 2.7e-3, rel_err(ht, ht_ref)
    assert rel_err(ht, ht_shipped) > 1e-4


def _forward(monkeypatch, lookahead, *args, **kwargs):
    monkeypatch.setattr(gluon_lookahead, "LOOKAHEAD", lookahead)
    return gluon_transposed.forward_t(*args, t_on_chain=True, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, gate", [
    (1, 200, 1, 3, "strong"),   # GVA 3, partial last chunk, strong decay
    (2, 256, 2, 4, "normal"),   # GVA 2
    (1, 64, 1, 2, "normal"),    # one chunk: no lookahead step
    (1, 8192, 2, 4, "zero"),
    (1, 8192, 2, 4, "normal"),
    (1, 8192, 2, 4, "mixed"),   # per head γ = 1, 0.6, 0.4, 0.1: both sides of LO_ABOVE
    (1, 4130, 1, 3, "mixed"),
])
def test_against_its_torch_twin(B, T, H, HV, gate, monkeypatch):
    """The kernel against the same arithmetic in torch (only summation orders differ): within
    2e-4 where gates decay; at g = 0 and with heads that keep their state as close to fp64 as
    the twin (within 25 %) and the state within issue 4's 3e-3."""
    _hopper()
    q, k, v, g, beta, h0, G, Ai, w, u = forward_intermediates(B, T, H, HV, True, T + HV, gate)
    lo = gluon_transposed.STATE_UPDATE_LO_ABOVE
    o, ht = _forward(monkeypatch, True, q, k, v, G, beta, Ai, 0.125, h0, True, segments=1)
    o_c, ht_c = _chain_form_in_torch(q, k, v, G, beta, Ai, 0.125, h0, lo_above=lo,
                                     lookahead=True)
    torch.cuda.synchronize()
    print(f"\n  lookahead {B, T, H, HV, gate} vs its twin: o {rel_err(o, o_c):.2e} state "
          f"{rel_err(ht, ht_c):.2e}")
    if gate not in ("zero", "mixed"):
        assert rel_err(o, o_c) <= 2e-4 and rel_err(ht, ht_c) <= 2e-4
        return
    o_ref, ht_ref = truth(q, k, v, g, beta, h0, scale=0.125)
    errs = [rel_err(x, r) for x, r in ((o, o_ref), (ht, ht_ref), (o_c, o_ref), (ht_c, ht_ref))]
    print("  vs fp64: kernel o {:.2e} state {:.2e}, twin o {:.2e} state {:.2e}".format(*errs))
    assert errs[0] <= 1.25 * errs[2] and errs[1] <= 1.25 * errs[3]
    assert errs[1] <= 3e-3 and errs[0] <= 5e-3, errs


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, initial_state, gate, segments", [
    (3, 130, 2, 4, False, "normal", 1),  # boxes reading the next sequence's rows
    (4, 40, 1, 1, True, "normal", 1),    # T < 64: every box spans two sequences
    (1, 1000, 2, 6, True, "zero", 1),    # GVA 3, no decay
    (1, 8192, 2, 4, True, "zero", 2),    # the main launch of a split
    (1, 8192, 2, 4, True, "mixed", 2),
    (1, 8192, 2, 4, True, "normal", 3),  # the maps; segments of 43 chunks
    (1, 320, 1, 2, True, "normal", 4),   # 2, 2, 1 and 0 chunks: an empty last segment
    (1, 32768, 16, 32, True, "normal", 2),  # the benchmark's (1, 32768)
])
def test_against_fp64_and_the_shipped_chain(B, T, H, HV, initial_state, gate, segments,
                                            monkeypatch):
    """o ≤ 5e-3 and the final state ≤ 3e-3 from the fp64 recurrence (issue 4's bounds, where
    the shipped chain meets them too), and within 1e-2 of the shipped chain."""
    _hopper()
    q, k, v, g, beta, h0, G, Ai, w, u = forward_intermediates(B, T, H, HV, initial_state,
                                                             T + HV, gate)
    args = (q, k, v, G, beta, Ai, 128 ** -0.5, h0, True)
    o, ht = _forward(monkeypatch, True, *args, segments=segments)
    o_s, ht_s = _forward(monkeypatch, False, *args, segments=segments)
    o_ref, ht_ref = truth(q, k, v, g, beta, h0, scale=128 ** -0.5)
    torch.cuda.synchronize()
    e = [rel_err(o, o_ref), rel_err(ht, ht_ref), rel_err(o_s, o_ref), rel_err(ht_s, ht_ref)]
    print(f"\n  lookahead {B, T, H, HV, gate}, {segments} segments vs fp64: o {e[0]:.2e} state "
          f"{e[1]:.2e}; shipped o {e[2]:.2e} state {e[3]:.2e}")
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_s) <= 1e-2 and rel_err(ht, ht_s) <= 1e-2
    assert e[0] <= max(5e-3, 1.1 * e[2]) and e[1] <= max(3e-3, 1.1 * e[3]), e


@pytest.mark.gpu
def test_checkpoints_are_the_states_it_carries(monkeypatch):
    """A training forward's checkpoints (the states entering every SEGMENT_CHUNKS-th chunk),
    also across a segment boundary: within bf16 rounding of the shipped chain's (the states
    differ by the lookahead's roundings), and the last one followed to the final state by
    the fp64 recurrence from it."""
    from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS, checkpoint_slabs
    _hopper()
    B, T, H, HV = 1, 8192, 2, 4
    q, k, v, g, beta, h0, G, Ai, w, u = forward_intermediates(B, T, H, HV, True, 7, "normal")
    NT = T // 64
    for segments in (1, 2):
        ck = [torch.full((checkpoint_slabs(NT), B, HV, 128, 128), float("nan"),
                         device="cuda") for _ in range(2)]
        args = (q, k, v, G, beta, Ai, 128 ** -0.5, h0, True)
        _forward(monkeypatch, True, *args, segments=segments, checkpoints=ck[0])
        _forward(monkeypatch, False, *args, segments=segments, checkpoints=ck[1])
        torch.cuda.synchronize()
        assert torch.isfinite(ck[0]).all()
        errs = [rel_err(ck[0][i], ck[1][i]) for i in range(ck[0].shape[0])]
        print(f"\n  checkpoints, {segments} segments, vs the shipped chain's: "
              + " ".join(f"{x:.1e}" for x in errs))
        assert max(errs) <= 5e-3
    t0 = SEGMENT_CHUNKS * ck[0].shape[0] * 64
    _, ht_ref = truth(q[:, t0:], k[:, t0:], v[:, t0:], g[:, t0:], beta[:, t0:], ck[0][-1],
                      scale=128 ** -0.5)
    _, ht = _forward(monkeypatch, True, *args, segments=1)
    assert rel_err(ht, ht_ref) <= 3e-3
