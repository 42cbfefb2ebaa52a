"""Gradients of the Triton backends against torch autograd through an fp64 reference, and the
backward kernels' run-to-run bit-identity on the GPU.

The reference runs in float64 on the same (rounded) inputs: the token recurrence
(:func:`gdn_fused.reference.recurrent_gated_delta_rule_ref`) for strong and spiked decay — the
chunked form's autograd gate gradient cancels O(1) terms there and is 3 % off even in fp64 —
and the chunked form (exact to ~1e-15 otherwise, 20× faster under autograd) for the rest.
Error: ‖x − ref‖ / ‖ref‖ per gradient.

CPU: Triton interpreter (conftest), fp32 (bound 1e-4) and fp16 (2e-3: the inputs and the
returned gradients are rounded to fp16, ~3e-4 each). GPU (`gpu` marker): bf16, K = V = 128,
bounds 8e-3 for dq, dk, dv, dh0 and 2e-2 for dg, dbeta.
"""
import pytest
import torch

from gdn_fused import chunk_gated_delta_rule
from gdn_fused.autograd import backward_by_recompute
from gdn_fused.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref
from gdn_fused.eval.cases import make_inputs, rel_err

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")

# (id, B, T, H, HV, K, V, gate, initial state + final-state cotangent, cu_seqlens, chunk)
CASES = [
    ("g-zero", 1, 70, 1, 1, 32, 16, "zero", True, None, 64),
    ("strong-partial", 1, 80, 1, 2, 32, 16, "strong", True, None, 64),
    ("spike-90", 1, 50, 1, 1, 32, 16, "spike", True, None, 16),
    ("batch2-c16", 2, 45, 1, 1, 32, 16, "normal", True, None, 16),
    ("gva2-c32", 1, 70, 1, 2, 32, 32, "normal", True, None, 32),
    ("gva3-k48", 1, 65, 1, 3, 48, 16, "normal", True, None, 64),
    # a packed buffer 10 rows longer than cu_seqlens[-1]: the tail's gradients must be exactly 0
    ("varlen-empty-tail", 1, 110, 1, 2, 32, 16, "normal", True, [0, 20, 20, 85, 100], 64),
    ("no-state", 1, 70, 2, 2, 16, 32, "normal", False, None, 64),
]
CPU_BOUND = {torch.float32: 1e-4, torch.float16: 2e-3}
GPU_BOUND = {"dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


def inputs(case, dtype, device):
    """Leaf tensors (q, k, v, g, beta, h0), cotangents (do, dht) and cu_seqlens of a case."""
    _, B, T, H, HV, K, V, gate, state, cu, C = case
    N = len(cu) - 1 if cu is not None else B
    xs = make_inputs(B, T, H, HV, K, V, dtype, gate, "uniform", state, N, device, chunk_size=C)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, HV, V, generator=gen).to(device, dtype)
    dht = torch.randn(N, HV, K, V, generator=gen).to(device) if state else None
    cu_t = torch.tensor(cu, device=device) if cu is not None else None
    return xs, do, dht, cu_t


def grads(fn, xs, do, dht):
    """∂/∂(q, k, v, g, beta, h0) of ⟨o, do⟩ + ⟨final state, dht⟩, with o, ht = fn(*leaves)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in xs]
    o, ht = fn(*leaves)
    loss = (o.double() * do.double()).sum()
    if dht is not None:
        loss = loss + (ht.double() * dht.double()).sum()
    wrt = [x for x in leaves if x is not None]
    got = iter(torch.autograd.grad(loss, wrt))
    return [next(got) if x is not None else None for x in leaves]


def truth_grads(xs, do, dht, cu, l2norm=False, recurrence=True):
    f64 = [x.detach().double() if x is not None else None for x in xs]
    if recurrence:
        return grads(lambda q, k, v, g, b, h: recurrent_gated_delta_rule_ref(
            q, k, v, g, b, None, h, True, cu, l2norm), f64, do, dht)
    return grads(lambda q, k, v, g, b, h: chunk_gated_delta_rule_ref(
        q, k, v, g, b, None, h, True, cu, l2norm), f64, do, dht)


def case_truth(case, xs, do, dht, cu):
    return truth_grads(xs, do, dht, cu, recurrence=case[7] in ("strong", "spike"))


def triton_grads(xs, do, dht, cu, C, backend="materialized", l2norm=False):
    return grads(lambda q, k, v, g, b, h: chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=h, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=l2norm, chunk_size=C, backend=backend), xs, do, dht)


def errors(got, ref):
    return {n: rel_err(a, r) for n, a, r in zip(NAMES, got, ref) if r is not None}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_fp32(case):
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    got = triton_grads(xs, do, dht, cu, case[-1])
    for x, d in zip(xs, got):
        assert x is None or d.dtype == x.dtype
    err = errors(got, case_truth(case, xs, do, dht, cu))
    assert max(err.values()) <= CPU_BOUND[torch.float32], err
    if cu is not None:
        end = case[9][-1]
        for name, d in zip(NAMES[:5], got[:5]):
            assert torch.equal(d[0, end:], torch.zeros_like(d[0, end:])), name


W_U_CASES = [c for c in CASES if c[0] in ("strong-partial", "varlen-empty-tail")]


@pytest.mark.parametrize("case", W_U_CASES, ids=[c[0] for c in W_U_CASES])
def test_backward_fp32_forming_w_and_u(case, monkeypatch):
    """The backward forming W and U (chunk_bwd.CHAIN_T off, GDN_BACKWARD_W_U=1: the A/B form
    of the chain-form default) within the same bound, and within 1e-5 of the default."""
    from gdn_fused.kernels import chunk_bwd
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    chain = triton_grads(xs, do, dht, cu, case[-1])
    monkeypatch.setattr(chunk_bwd, "CHAIN_T", False)
    got = triton_grads(xs, do, dht, cu, case[-1])
    err = errors(got, case_truth(case, xs, do, dht, cu))
    assert max(err.values()) <= CPU_BOUND[torch.float32], err
    assert max(errors(got, chain).values()) <= 1e-5


@pytest.mark.parametrize("module", ["chunk_bwd_dqkwg", "wu_bwd"])
def test_backward_two_key_blocks(monkeypatch, module):
    """K split into two key blocks (16 here) by one kernel while the other takes all of K, with
    two batch rows: chunk_bwd_dqkwg's two partial dg are summed by wu_bwd at the right key
    block and batch row, and wu_bwd's key loop runs over more blocks than there are partials
    (on the GPU, K = 128, both kernels take two blocks of 64; the sweeps' dqkwg block_k = 128
    takes one)."""
    import importlib
    monkeypatch.setattr(importlib.import_module(f"gdn_fused.kernels.{module}"), "BLOCK_K", 16)
    case = ("nk2-b2", 2, 70, 1, 2, 32, 16, "normal", True, None, 64)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    err = errors(triton_grads(xs, do, dht, cu, 64), case_truth(case, xs, do, dht, cu))
    assert max(err.values()) <= CPU_BOUND[torch.float32], err


def test_backward_two_value_blocks(monkeypatch):
    """chunk_bwd_dqkwg's loop over value blocks taking two steps (V past BLOCK_V: 128 on the
    GPU, 16 here), which its launcher runs at one stage: the steps' partial products add up."""
    from gdn_fused.kernels import chunk_bwd_dqkwg
    monkeypatch.setattr(chunk_bwd_dqkwg, "BLOCK_V", 16)
    case = ("nv2", 1, 70, 1, 2, 16, 32, "normal", True, None, 64)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    err = errors(triton_grads(xs, do, dht, cu, 64), case_truth(case, xs, do, dht, cu))
    assert max(err.values()) <= CPU_BOUND[torch.float32], err


def test_dqkwg_q_and_k_loaded_first_changes_nothing():
    """chunk_bwd_dqkwg with the q and k tiles loaded before the value loop (QK_FIRST, an A/B
    launch option): the same outputs to the bit, here under the interpreter."""
    from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
    gen = torch.Generator().manual_seed(3)
    B, T, H, HV, K, V, C = 1, 100, 1, 2, 32, 16, 64
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v_new, do, dv2 = (torch.randn(B, T, HV, V, generator=gen) for _ in range(3))
    h, dh = (torch.randn(2, HV, K, V, generator=gen) for _ in range(2))
    g = -torch.rand(B, T, HV, generator=gen)
    outs = [chunk_bwd_dqkwg(q, k, v_new, h, dh, g, do, dv2, 0.3, C, QK_FIRST=first)
            for first in (False, True)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][0].abs().max() > 0


def test_backward_reads_the_forward_inverse(monkeypatch):
    """The materialized forward's T reaches the backward (no chunk_inverse there) and gives the
    bits the backward's own recompute gives; after the fused forward, or a forward with another
    inverse method, the backward recomputes T with the blocked inverse (exact gradients)."""
    from gdn_fused.kernels import chunk_bwd
    # GVA, a partial chunk, an initial state, head dims the fused kernel takes
    case = ("gva3-k64", 1, 65, 1, 3, 64, 64, "normal", True, None, 64)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    calls, solve = [], chunk_bwd.chunk_inverse

    def spy(*args, **kwargs):
        calls.append(kwargs.get("solve_method", "blocked"))
        return solve(*args, **kwargs)
    monkeypatch.setattr(chunk_bwd, "chunk_inverse", spy)

    def run(backend="materialized", **kw):
        return grads(lambda q, k, v, g, b, h: chunk_gated_delta_rule(
            q, k, v, g, b, initial_state=h, output_final_state=True, chunk_size=case[-1],
            backend=backend, **kw), xs, do, dht)
    saved = run()
    assert calls == []
    real = chunk_bwd.chunk_gated_delta_rule_bwd
    monkeypatch.setattr(chunk_bwd, "chunk_gated_delta_rule_bwd",
                        lambda *a, Ai=None, **kw: real(*a, **kw))  # drop the saved T
    recomputed = run()
    assert calls == ["blocked"]
    for a, b in zip(saved, recomputed):
        assert torch.equal(a, b)
    monkeypatch.setattr(chunk_bwd, "chunk_gated_delta_rule_bwd", real)
    for backend, kw in (("fused", {}), ("materialized", dict(solve_method="mxr")),
                        ("materialized", dict(solve_method="newton_schulz"))):
        calls.clear()
        run(backend, **kw)
        assert calls == ["blocked"], (backend, kw)


def test_determinism_script_composes_every_kernel():
    """eval.determinism's chain (GPU only in use) on the CPU under the interpreter: each of the
    eight kernels and the extra launch runs twice (a kernel signature changed without this
    caller fails here rather than on the device); the interpreter itself is deterministic."""
    from gdn_fused.eval.determinism import run_twice
    diffs = run_twice(128, [dict(num_warps=8)], "cpu", torch.float32)
    assert len(diffs) == 10 and all(d == 0 for row in diffs.values() for d in row.values())


FP16_CASES = [c for c in CASES if c[0] in ("strong-partial", "gva3-k48")]


@pytest.mark.parametrize("case", FP16_CASES, ids=[c[0] for c in FP16_CASES])
def test_backward_fp16(case):
    xs, do, dht, cu = inputs(case, torch.float16, "cpu")
    err = errors(triton_grads(xs, do, dht, cu, case[-1]), case_truth(case, xs, do, dht, cu))
    if case[7] == "strong":
        # ∂L/∂h0 ∝ e^{G} ≈ e^{-30} and below: under fp16's smallest subnormal (6e-8), so W and
        # e^G·dO flush to 0 in fp16 storage (bf16 and fp32 keep the exponent range)
        err.pop("dh0")
    assert max(err.values()) <= CPU_BOUND[torch.float16], err


def test_strong_decay_gate_gradient_not_cancelled():
    """Every gate in [-70, -69]: the true dg is ~1e-14 while the O(1) pair terms that a
    reverse cumsum of ∂L/∂G would cancel are not; dg must still be relatively exact."""
    case = ("g70", 1, 80, 1, 1, 32, 16, "strong", True, None, 64)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    xs = list(xs)
    xs[3] = -70 + torch.rand(xs[3].shape, generator=torch.Generator().manual_seed(2))
    got, ref = triton_grads(xs, do, dht, cu, 64), truth_grads(xs, do, dht, cu)
    assert ref[3].abs().max() < 1e-12
    assert rel_err(got[3], ref[3]) <= 1e-5


def test_l2norm_in_kernel_gradient_flows_through_norm():
    case = ("l2", 1, 70, 1, 2, 32, 16, "normal", True, None, 64)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    xs = list(xs)
    gen = torch.Generator().manual_seed(3)
    xs[0] = 3 * torch.randn(xs[0].shape, generator=gen)  # far from unit norm: the norm matters
    xs[1] = 0.5 * torch.randn(xs[1].shape, generator=gen)
    err = errors(triton_grads(xs, do, dht, cu, 64, l2norm=True),
                 truth_grads(xs, do, dht, cu, l2norm=True, recurrence=False))
    assert max(err.values()) <= 1e-4, err


def test_gradient_of_one_input_without_final_state():
    """Only v requires a gradient and the final state is not returned (dht is None)."""
    xs, do, dht, cu = inputs(CASES[4], torch.float32, "cpu")
    q, k, v, g, b, h = [x.detach().clone() for x in xs]
    v.requires_grad_()
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, chunk_size=32,
                                   backend="materialized")
    (o.double() * do.double()).sum().backward()
    ref = truth_grads(xs, do, None, cu, recurrence=False)[2]
    assert ht is None and rel_err(v.grad, ref) <= 1e-4


@pytest.mark.parametrize("backend", ["materialized", "fused"])
@pytest.mark.parametrize("loss", ["quadratic", "linear"])
def test_second_order_gradients_raise(backend, loss):
    """The Triton backends' backward is first-order only: differentiating its gradients
    raises (it returned them without a graph before, so a gradient penalty came out silently
    wrong: new-user trial, session 14), also where the loss is linear in o, whose incoming
    gradient needs no graph (torch's @once_differentiable let that case drop the penalty's
    terms silently: new-user trial, session 28); first-order gradients under
    create_graph=True still come out; the torch backend differentiates twice, and a
    gradient penalty through it moves k's gradient (so the raise is not about a zero term)."""
    xs, do, dht, cu = inputs(CASES[4], torch.float32, "cpu")
    q, k, v, g, b, h = [x.detach().clone() for x in xs]
    v.requires_grad_()
    k.requires_grad_()
    for be in (backend, "torch"):
        o, _ = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, chunk_size=32, backend=be)
        main = (o * do).sum() + (o.pow(2).sum() if loss == "quadratic" else 0)
        (gv,) = torch.autograd.grad(main, v, create_graph=True)
        if be == "torch":
            # (o is linear in v: with a linear loss gv does not depend on v, only on k)
            ggv, gk_penalty = torch.autograd.grad(gv.pow(2).sum(), (v, k), allow_unused=True)
            assert gk_penalty.abs().sum() > 0
            assert loss == "linear" or ggv.abs().sum() > 0
        else:
            first = gv.detach().clone()
            assert gv.requires_grad
            with pytest.raises(RuntimeError, match="first-order only"):
                gv.pow(2).sum().backward()
    assert rel_err(first, gv.detach()) <= 1e-4  # the same first-order gradient either way


def test_fused_forward_shares_the_backward():
    """backend="fused" (its own forward kernel; K, V in {64, 128}) with the same backward."""
    case = ("fused", 1, 40, 1, 2, 64, 64, "normal", True, [0, 13, 13, 40], 16)
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    err = errors(triton_grads(xs, do, dht, cu, case[-1], backend="fused"),
                 case_truth(case, xs, do, dht, cu))
    assert max(err.values()) <= 1e-4, err


def test_backward_by_recompute_matches():
    """The torch-autograd reference backward and the Triton kernels agree (both vs truth)."""
    case = CASES[3]
    xs, do, dht, cu = inputs(case, torch.float32, "cpu")
    scale = xs[0].shape[-1] ** -0.5
    ref = truth_grads(xs, do, dht, cu, recurrence=False)
    slow = backward_by_recompute(*xs[:5], scale, xs[5], do, dht, cu, case[-1])
    assert max(errors(slow, ref).values()) <= 1e-4
    assert max(errors(triton_grads(xs, do, dht, cu, case[-1]), slow).values()) <= 1e-4


GPU_CASES = [
    ("dense", 2, 300, 2, 4, 128, 128, "normal", True, None, 64),
    ("gva3-partial", 1, 200, 1, 3, 128, 128, "normal", True, None, 64),
    ("strong", 1, 200, 1, 2, 128, 128, "strong", True, None, 64),
    ("g-zero", 1, 200, 1, 2, 128, 128, "zero", True, None, 64),
    ("varlen-empty", 1, 400, 2, 2, 128, 128, "normal", True, [0, 130, 130, 317, 380], 64),
    # long enough for the Hopper routes (the Gluon state + output kernel; the fused backend's
    # forward_t, whose T and state checkpoint the backward then reads)
    ("dense-8192", 1, 8192, 2, 4, 128, 128, "normal", True, None, 64),
    # the same with g = 0, where the state carries everything: B·HV = 4 and 128 chunks, so the
    # forward stores the state entering chunk 64 and the backward's recompute starts there
    ("g-zero-8192", 1, 8192, 2, 4, 128, 128, "zero", True, None, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["materialized", "fused"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_backward_bf16_gpu(case, backend):
    xs, do, dht, cu = inputs(case, torch.bfloat16, "cuda")
    got = triton_grads(xs, do, dht, cu, case[-1], backend)
    err = errors(got, case_truth(case, xs, do, dht, cu))
    print(f"backward bf16 {backend} {case[0]}: " + " ".join(f"{n} {e:.1e}" for n, e in err.items()))
    assert all(err[n] <= GPU_BOUND[n] for n in err), err
    if cu is not None:
        end = case[9][-1]
        assert all(torch.equal(d[0, end:], torch.zeros_like(d[0, end:])) for d in got[:5])


@pytest.mark.gpu
def test_state_passes_equal_at_each_pipeline_depth():
    """Past one wave of programs the forward and reverse state passes run 2 software-pipeline
    stages instead of Triton's 3 (chunk_state.state_stages); the results are the same bits
    (the GPU's gradient tests run shapes of under one wave, at 3)."""
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_state import chunk_state, state_stages
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.kernels.wu import recompute_w_u
    B, T, H, HV = 8, 1024, 16, 32
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, dtype=torch.bfloat16,
                                       initial_state=True, device="cuda")
    G = chunk_cumsum(g, 64)
    w, u = recompute_w_u(k, v, G, beta, chunk_inverse(k, G, beta, HV, 64), dot_precision="tf32")
    assert state_stages(B * HV * 2, k.device) == 2  # 512 programs at 64 value columns
    fwd = [chunk_state(k, w, u, G, h0, True, 64, B, dot_precision="tf32", num_stages=s)
           for s in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(*fwd))
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    dv_local = chunk_bwd_dv_local(q, k, g, do, 128 ** -0.5, 64, dot_precision="tf32")
    bwd = [chunk_bwd_state(q, k, w, g, do, dv_local, 128 ** -0.5, dht, h0, 64, B,
                           dot_precision="tf32", num_stages=s) for s in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(*bwd))
    assert fwd[0][0].abs().max() > 0 and bwd[0][0].abs().max() > 0


@pytest.mark.gpu
def test_backward_kernels_bit_identical_run_to_run():
    """Every backward kernel twice on the same inputs (on Hopper the Gluon reverse state pass
    and wu_bwd too), chunk_bwd_dqkwg and wu_bwd also at 8 warps: equal to the bit (no atomics anywhere, so a difference means a kernel reads memory
    that is still being written). T = 8192: 512 programs a chunk-parallel kernel, several waves
    of the 132 SMs, where the race of docs/backward.md ("Determinism") showed. Positive control
    on the Triton it was measured on (3.6.0): wu_bwd pipelined at 3 stages and 8 warps must
    differ (dβ 4e-3 and dg 7e-3 apart on every H200 run of session 8), or this test could not
    see the race."""
    import triton

    from gdn_fused.eval.determinism import run_twice
    control = [dict(num_warps=8, num_stages=3)] if triton.__version__ == "3.6.0" else []
    diffs = run_twice(T=8192, launches=[dict(num_warps=8)] + control)
    if control:
        raced = diffs.pop("wu_bwd num_warps=8 num_stages=3")
        diffs.pop("chunk_bwd_dqkwg num_warps=8 num_stages=3")
        assert raced["dbeta"] > 0 and raced["dg"] > 0, raced
    # + the Gluon reverse state pass and wu_bwd on Hopper (materialized.gluon_tiles_apply)
    from gdn_fused.kernels.materialized import gluon_tiles_apply
    x = torch.empty(1, 64, 1, 128, dtype=torch.bfloat16, device="cuda")
    assert len(diffs) == (12 if gluon_tiles_apply(x, x, 64, None) else 10), sorted(diffs)
    assert all(d == 0 for row in diffs.values() for d in row.values()), diffs
