"""The Gluon dq/dk/dw/dg kernel (kernels/gluon_dqkwg.py) against chunk_bwd_dqkwg on the same
inputs (the backward's own intermediates), on the H200; and the whole backward through it
against fp64 autograd is tests/test_backward.py's bf16 GPU cases (those the kernel covers:
B = 1 or T a multiple of 64).
"""
import pytest
import torch

from gdn_fused.eval.cases import make_inputs, rel_err

CASES = [  # (id, B, T, H, HV, gate)
    ("partial-chunk", 1, 1000, 2, 4, "normal"),
    ("no-gva", 1, 2048, 2, 2, "normal"),
    ("gva3-g-zero", 2, 4096, 2, 6, "zero"),
    ("strong", 1, 4096, 1, 2, "strong"),
]


def intermediates(B, T, H, HV, gate):
    """q, k, v_new, h, dh, g, G, do, dv2 of a bf16 backward at K = V = 128 (chunk_bwd's
    sequence of kernels up to dq/dk/dw/dg)."""
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.kernels.wu import recompute_w_u
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, gate, "uniform",
                                       True, device="cuda")
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(v.shape, generator=gen).to("cuda", torch.bfloat16)
    G = chunk_cumsum(g, 64)
    Ai = chunk_inverse(k, G, beta, HV, 64, torch.bfloat16)
    w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision="tf32")
    h, v_new, _ = chunk_state(k, w, u, G, h0, False, 64, B, dot_precision="tf32")
    dv_local = chunk_bwd_dv_local(q, k, g, do, 128 ** -0.5, 64, dot_precision="tf32")
    dh, dv2, _ = chunk_bwd_state(q, k, w, g, do, dv_local, 128 ** -0.5, None, h0, 64, B,
                                 dot_precision="tf32")
    return q, k, v_new, h, dh, g, G, do, dv2


@pytest.mark.gpu
@pytest.mark.parametrize("heads_in_turn", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_chunk_bwd_dqkwg(case, heads_in_turn, monkeypatch):
    """dq, dk, dw (bf16) and each key block's partial dg (fp32) as chunk_bwd_dqkwg computes
    them: dq, dk, dw the same bits (the same products and roundings), dg up to the order of its
    fp32 sums (H200: within 2.6e-6; bound 1e-5), and the same bits run to run; with a GVA
    group's value heads in turn on one CTA (HEADS_IN_TURN) or spread over the CTAs."""
    from gdn_fused.kernels import gluon_dqkwg
    from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
    from gdn_fused.kernels.gluon_dqkwg import chunk_bwd_dqkwg_gluon
    from gdn_fused.kernels.materialized import gluon_tiles_apply
    _, B, T, H, HV, gate = case
    if H == HV and not heads_in_turn:
        pytest.skip("a group of one value head: both orders are one launch")
    monkeypatch.setattr(gluon_dqkwg, "HEADS_IN_TURN", heads_in_turn)
    q, k, v_new, h, dh, g, G, do, dv2 = intermediates(B, T, H, HV, gate)
    assert gluon_tiles_apply(q, do, 64, None)
    ref = chunk_bwd_dqkwg(q, k, v_new, h, dh, g, do, dv2, 128 ** -0.5, 64,
                          dot_precision="tf32")
    got = chunk_bwd_dqkwg_gluon(q, k, v_new, h, dh, G, do, dv2, 128 ** -0.5)
    errs = {n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dw", "dg"), got, ref)}
    print(f"gluon dqkwg {case[0]}: " + " ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert all(torch.isfinite(x).all() for x in got)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3])), errs
    assert errs["dg"] <= 1e-5, errs
    again = chunk_bwd_dqkwg_gluon(q, k, v_new, h, dh, G, do, dv2, 128 ** -0.5)
    assert all(torch.equal(a, b) for a, b in zip(again, got))


@pytest.mark.gpu
def test_backward_routes_to_it_and_back(monkeypatch):
    """chunk_bwd's dq/dk/dw/dg step takes the Gluon kernel where it applies and the Triton one
    where it does not (B = 2 with a partial chunk), and GLUON_DQKWG off keeps the Triton one."""
    from gdn_fused.kernels import chunk_bwd, gluon_dqkwg
    calls = []
    real = gluon_dqkwg.chunk_bwd_dqkwg_gluon
    monkeypatch.setattr(gluon_dqkwg, "chunk_bwd_dqkwg_gluon",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(chunk_bwd, "GLUON_DQKWG", True)
    idx = dict(cu_seqlens=None, chunk_indices=None, num_chunks=None)
    for B, T, routed in ((1, 200, True), (2, 200, False), (2, 256, True)):
        xs = intermediates(B, T, 1, 2, "normal")
        before = len(calls)
        chunk_bwd.dqkwg(*xs, 0.1, 64, None, "tf32", idx)
        assert (len(calls) > before) == routed, (B, T)
    monkeypatch.setattr(chunk_bwd, "GLUON_DQKWG", False)
    chunk_bwd.dqkwg(*xs, 0.1, 64, None, "tf32", idx)
    assert len(calls) == 2


def test_bad_operands_raise_before_launch():
    """Wrong shapes or dtypes give a ValueError naming the argument (no GPU needed)."""
    from gdn_fused.kernels.gluon_dqkwg import chunk_bwd_dqkwg_gluon
    B, T, H, HV = 1, 128, 1, 2
    bf = dict(dtype=torch.bfloat16)
    args = dict(q=torch.zeros(B, T, H, 128, **bf), k=torch.zeros(B, T, H, 128, **bf),
                v_new=torch.zeros(B, T, HV, 128, **bf), h=torch.zeros(2, HV, 128, 128, **bf),
                dh=torch.zeros(2, HV, 128, 128, **bf),
                G=torch.zeros(B, T, HV, dtype=torch.float64), do=torch.zeros(B, T, HV, 128, **bf),
                dv2=torch.zeros(B, T, HV, 128, **bf), scale=0.1)
    for arg, bad, match in (("h", torch.zeros(1, HV, 128, 128, **bf), "h must have shape"),
                            ("dv2", torch.zeros(B, T, HV, 128), "dv2 must be torch.bfloat16"),
                            ("do", torch.zeros(B, T, HV, 64, **bf), "needs K = V = 128")):
        with pytest.raises(ValueError, match=match):
            chunk_bwd_dqkwg_gluon(**dict(args, **{arg: bad}))
