"""The Gluon reverse state pass (kernels/gluon_bwd_state.py) and chunk_bwd_state on the same
inputs, both against the same recurrence in fp64 (below), on the H200; the whole backward
through it against fp64 autograd is tests/test_backward.py's bf16 GPU cases (those it covers:
B = 1 or T a multiple of 64).
"""
import pytest
import torch

from gdn_fused.eval.cases import make_inputs, rel_err

CASES = [  # (id, B, T, H, HV, gate, dht given, initial state given (dh0 out))
    ("partial-chunk", 1, 1000, 2, 4, "normal", True, True),
    ("gva3-g-zero", 2, 1024, 2, 6, "zero", True, True),
    # (dv2 is dV'_local here: the decay forgets dh within a chunk)
    ("strong-no-states", 1, 2048, 1, 2, "strong", False, False),
    ("dht-only", 1, 640, 1, 2, "normal", True, False),
    ("h0-only", 1, 640, 1, 2, "normal", False, True),
]


def reverse_fp64(q, k, w, G, do, dv_local, scale, dht, C=64):
    """(dh [B·NT, HV, K, V], dv2, dh0) of chunk_bwd_state's recurrence in fp64 from the same
    (rounded) inputs, with no rounding inside."""
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    NT = -(-T // C)
    r = HV // H
    qq, kk = (x.double().repeat_interleave(r, dim=2) for x in (q, k))
    ww, dO, dvl, Gd = (x.double() for x in (w, do, dv_local, G))
    dH = (dht.double() if dht is not None
          else torch.zeros(B, HV, K, V, dtype=torch.float64, device=k.device))
    dh = torch.empty(B, NT, HV, K, V, dtype=torch.float64, device=k.device)
    dv2 = torch.empty_like(dO)
    for c in reversed(range(NT)):
        t = slice(c * C, min(T, (c + 1) * C))
        dh[:, c] = dH
        g = Gd[:, t]                                    # [B, n, HV]
        decay = (g[:, -1:] - g).exp()                   # e^{G_C − G_i}
        dv = dvl[:, t] + torch.einsum("bnhk,bhkv->bnhv", kk[:, t], dH) * decay[..., None]
        dv2[:, t] = dv
        dH = dH * g[:, -1].exp()[..., None, None] \
            + scale * torch.einsum("bnhk,bnhv->bhkv", qq[:, t], dO[:, t] * g.exp()[..., None]) \
            - torch.einsum("bnhk,bnhv->bhkv", ww[:, t], dv)
    return dh.view(B * NT, HV, K, V), dv2, dH


def w_fp64(k, Ai, G, beta, C=64):
    """W = T diag(β e^G) K [B, T, HV, K] per chunk in fp64 from the (rounded) T, k, β and G:
    what the chain form (T in W's place) applies without forming it."""
    B, T, H, K = k.shape
    HV = Ai.shape[2]
    kk = k.double().repeat_interleave(HV // H, dim=2)
    w = torch.empty(B, T, HV, K, dtype=torch.float64, device=k.device)
    for c in range(-(-T // C)):
        t = slice(c * C, min(T, (c + 1) * C))
        n = t.stop - t.start
        d = beta[:, t].double() * G[:, t].double().exp()          # [B, n, HV]
        w[:, t] = torch.einsum("bihj,bjh,bjhk->bihk", Ai[:, t, :, :n].double(), d, kk[:, t])
    return w


def inputs(B, T, H, HV, gate, with_dht, with_h0, chain_t=False):
    """q, k, w (the backward's recomputed W), g, G, gate rows, dO, dV'_local, dht, h0; with
    ``chain_t`` w is T, the rows are G and the chain rows, and W in fp64 and β come last."""
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.kernels.wu import recompute_w_u
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, gate, "uniform",
                                       with_h0, device="cuda")
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(v.shape, generator=gen).to("cuda", torch.bfloat16)
    dht = torch.randn(B, HV, 128, 128, generator=gen).to("cuda") if with_dht else None
    G, rows = chunk_cumsum(g, 64, gate_rows=[beta] if chain_t else [], chain_rows=chain_t)
    Ai = chunk_inverse(k, G, beta, HV, 64, torch.bfloat16)
    dv_local = chunk_bwd_dv_local(q, k, g, do, 128 ** -0.5, 64, dot_precision="tf32")
    if chain_t:
        return q, k, Ai, g, G, rows, do, dv_local, dht, h0, w_fp64(k, Ai, G, beta), beta
    w, _ = recompute_w_u(k, v, G, beta, Ai, dot_precision="tf32")
    return q, k, w, g, G, rows, do, dv_local, dht, h0, w, None


@pytest.mark.gpu
@pytest.mark.parametrize("chain_t", [False, True], ids=["w", "t_for_w"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_fp64_and_chunk_bwd_state(case, chain_t):
    """dh, dv2 (bf16) and dh0 (fp32) within 1.25× chunk_bwd_state's error against the fp64
    recurrence (plus 1e-4) and under 1e-2; the same bits run to run. Both read W, or both T
    in its place (``chain_t``: Wᵀ dV' as Kᵀ diag(β e^G) (Tᵀ dV'), the fp64 recurrence on
    W = T diag(β e^G) K formed in fp64)."""
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
    from gdn_fused.kernels.materialized import gluon_tiles_apply
    _, B, T, H, HV, gate, with_dht, with_h0 = case
    q, k, w, g, G, rows, do, dv_local, dht, h0, w_ref, beta = inputs(
        B, T, H, HV, gate, with_dht, with_h0, chain_t)
    assert gluon_tiles_apply(q, do, 64, None)
    scale = 128 ** -0.5
    ref = reverse_fp64(q, k, w_ref, G, do, dv_local, scale, dht)
    tri = chunk_bwd_state(q, k, w, g, do, dv_local, scale, dht, h0, 64, B,
                          dot_precision="tf32", beta=beta)
    got = chunk_bwd_state_t(q, k, w, rows, do, dv_local, scale, dht, h0, chain_t=chain_t)
    names = ("dh", "dv2", "dh0")
    err_t = {n: rel_err(x, r) for n, x, r in zip(names, tri, ref) if x is not None}
    err_g = {n: rel_err(x, r) for n, x, r in zip(names, got, ref) if x is not None}
    form = "T" if chain_t else "W"
    print(f"bwd state {case[0]} {form} vs fp64: triton "
          + " ".join(f"{n} {e:.1e}" for n, e in err_t.items())
          + " | gluon " + " ".join(f"{n} {e:.1e}" for n, e in err_g.items())
          + f" | gluon vs triton dh {rel_err(got[0], tri[0]):.1e}")
    assert (got[2] is None) == (not with_h0)
    assert all(torch.isfinite(x).all() for x in got if x is not None)
    assert got[0].dtype == k.dtype and got[1].dtype == do.dtype
    for n in err_g:
        assert err_g[n] <= 1.25 * err_t[n] + 1e-4 and err_g[n] <= 1e-2, (n, err_g, err_t)
    again = chunk_bwd_state_t(q, k, w, rows, do, dv_local, scale, dht, h0, chain_t=chain_t)
    assert all(torch.equal(a, b) for a, b in zip(again, got) if a is not None)


@pytest.mark.gpu
def test_backward_routes_to_it_and_back(monkeypatch):
    """The backward takes the Gluon reverse pass where it applies (B = 1, partial chunk; B = 2,
    whole chunks) and chunk_bwd_state where it does not (B = 2 with a partial chunk) or when
    GLUON_BWD_STATE is off."""
    from gdn_fused.kernels import chunk_bwd, gluon_bwd_state
    calls = []
    real = gluon_bwd_state.chunk_bwd_state_t
    monkeypatch.setattr(gluon_bwd_state, "chunk_bwd_state_t",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(chunk_bwd, "GLUON_BWD_STATE", True)
    for B, T, routed in ((1, 200, True), (2, 200, False), (2, 256, True)):
        q, k, v, g, beta, h0 = make_inputs(B, T, 1, 2, 128, 128, torch.bfloat16,
                                           initial_state=True, device="cuda")
        before = len(calls)
        chunk_bwd.chunk_gated_delta_rule_bwd(q, k, v, g, beta, 0.1, h0, torch.randn_like(v),
                                             None, None)
        assert (len(calls) > before) == routed, (B, T)
    monkeypatch.setattr(chunk_bwd, "GLUON_BWD_STATE", False)
    chunk_bwd.chunk_gated_delta_rule_bwd(q, k, v, g, beta, 0.1, h0, torch.randn_like(v), None,
                                         None)
    assert len(calls) == 2


@pytest.mark.gpu
def test_reverse_pass_beside_recompute_same_bits_and_capturable(monkeypatch):
    """Where the Gluon reverse pass leaves half the SMs idle (B·HV = 8 here: 16 programs) the
    fused backward runs it on a side stream beside the recompute of h and v_new: the same
    gradient bits as one after the other, twice in a row without a sync, and replayed from a
    CUDA graph; at B·HV = 3 · 64 (384 programs) it does not fork."""
    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.kernels import chunk_bwd
    forks, streams = [], []
    real_fork, real_reverse = chunk_bwd.side_by_side, chunk_bwd.reverse_states
    monkeypatch.setattr(chunk_bwd, "side_by_side", lambda *a: forks.append(1) or real_fork(*a))
    monkeypatch.setattr(chunk_bwd, "reverse_states", lambda *a: streams.append(
        torch.cuda.current_stream()) or real_reverse(*a))
    # a bf16 h0: the reverse pass's fp32 dh0 is cast back to bf16 on the side stream
    q, k, v, g, beta, h0 = make_inputs(1, 8192, 4, 8, 128, 128, torch.bfloat16,
                                       initial_state=True, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0.bfloat16())]
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    names = ("q", "k", "v", "g", "beta", "h0")

    def grads():
        o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                       output_final_state=True, backend="fused")
        return torch.autograd.grad((o, ht), leaves, (do, dht))
    monkeypatch.setattr(chunk_bwd, "OVERLAP_RECOMPUTE", False)
    serial = grads()
    assert not forks and streams[-1] == torch.cuda.current_stream()
    monkeypatch.setattr(chunk_bwd, "OVERLAP_RECOMPUTE", True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # off the default stream, as before a capture
        runs = [grads() for _ in range(2)]
        assert streams[-1] != torch.cuda.current_stream()
    torch.cuda.current_stream().wait_stream(side)
    assert len(forks) == 2
    for overlapped in runs:
        for name, a, b in zip(names, overlapped, serial):
            assert torch.equal(a, b), name
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grads()
    assert len(forks) == 3
    for x in captured:
        x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(names, captured, serial):
        assert torch.equal(a, b), name
    wide = torch.empty(3, 64, 64, 128, device="cuda")
    assert chunk_bwd.overlaps_recompute(True, q, v) and not chunk_bwd.overlaps_recompute(
        True, q, wide) and not chunk_bwd.overlaps_recompute(False, q, v)


@pytest.mark.parametrize("name, wgmma, maxnreg, shared_kb", [
    ("chunk_bwd_state transposed gluon", 16, 240, 182),
    ("chunk_bwd_state transposed gluon, T for W", 20, 240, 167),
    # both value blocks of a head a program (TWO_CHAINS): two chains of 20 wgmma, 12 warps at
    # 168 registers before setmaxnreg (240 a chain), one dh_c staging tile a chain: 212 KB
    ("chunk_bwd_state transposed gluon, T for W, two chains", 40, 168, 213),
])
def test_reverse_pass_compiles_pipelined_without_spills(name, wgmma, maxnreg, shared_kb):
    """The reverse pass's forms compile for sm_90a (no GPU needed) within one program an SM's
    shared memory, with no spills, no register of a wgmma operand rewritten in flight and
    every wgmma pipelined (ptxas serializes all of a kernel's when one role is short of
    registers for its products in flight)."""
    from gdn_fused.eval.ptxas import (_kernels, compile_for, register_operand_hazards,
                                      report_of, sass)
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    build, options = _kernels()[name]
    compiled = compile_for(*build(), **options)
    r = report_of(compiled, **options)
    assert options["maxnreg"] == maxnreg and r["registers"] <= maxnreg
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert r["features"]["wgmma"] == wgmma and r["features"]["setmaxnreg"] > 0
    assert not r["wgmma_serialized"], r["wgmma_serialized"]
    assert r["shared"] <= shared_kb * 1024
    assert register_operand_hazards(sass(compiled)) == []


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_chains_give_the_one_chain_bits(case):
    """Both value blocks of a head in one program (TWO_CHAINS, chains=2; T for W as the
    backward runs it): dh, dv2 and dh0 the one-chain launch's bits (the same products on the
    same operands; one dh_c staging tile a chain instead of two)."""
    from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
    _, B, T, H, HV, gate, with_dht, with_h0 = case
    q, k, w, g, G, rows, do, dv_local, dht, h0, _, _ = inputs(B, T, H, HV, gate, with_dht,
                                                              with_h0, True)
    one, two = (chunk_bwd_state_t(q, k, w, rows, do, dv_local, 128 ** -0.5, dht, h0,
                                  chain_t=True, chains=c) for c in (1, 2))
    assert all(torch.isfinite(x).all() for x in two if x is not None)
    for name, a, b in zip(("dh", "dv2", "dh0"), two, one):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


def test_bad_operands_raise_before_launch():
    """Wrong shapes or dtypes give a ValueError naming the argument (no GPU needed)."""
    from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
    B, T, H, HV = 1, 100, 1, 2
    bf = dict(dtype=torch.bfloat16)
    args = dict(q=torch.zeros(B, T, H, 128, **bf), k=torch.zeros(B, T, H, 128, **bf),
                w=torch.zeros(B, T, HV, 128, **bf),
                gate_rows=torch.zeros(B * HV, 128, dtype=torch.float64),
                do=torch.zeros(B, T, HV, 128, **bf), dv_local=torch.zeros(B, T, HV, 128, **bf),
                scale=0.1, dht=None, initial_state=None)
    for arg, bad, match in (("gate_rows", torch.zeros(B * HV, 100, dtype=torch.float64),
                             "gate_rows must have shape"),
                            ("w", torch.zeros(B, T, HV, 128), "w must be torch.bfloat16"),
                            ("dht", torch.zeros(B, HV, 128, 64), "dht must have shape")):
        with pytest.raises(ValueError, match=match):
            chunk_bwd_state_t(**dict(args, **{arg: bad}))
    # with T in W's place: W's shape, and one gate row a head, or the (G, β) pairs, where the
    # four chain rows are expected
    with pytest.raises(ValueError, match="Ai must have shape"):
        chunk_bwd_state_t(**args, chain_t=True)
    with pytest.raises(ValueError, match="chains must be None, 1 or 2"):
        chunk_bwd_state_t(**args, chains=3)
    for rows in (1, 2):
        with pytest.raises(ValueError, match="gate_rows must have shape"):
            chunk_bwd_state_t(**dict(args, w=torch.zeros(B, T, HV, 64, **bf),
                                     gate_rows=torch.zeros(B * HV * rows, 128,
                                                           dtype=torch.float64)), chain_t=True)
