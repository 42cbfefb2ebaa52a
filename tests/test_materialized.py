"""The materialized Triton path and the decode kernel against the fp64 token recurrence.

CPU: Triton interpreter (conftest), fp32 and fp16 data. GPU (`gpu` marker): bf16, K = V = 128.
"""
import pytest
import torch

from gdn_fused import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from gdn_fused.eval.cases import make_inputs, rel_err, truth
from gdn_fused.kernels import chunk_index

# (id, B, T, H, HV, gate, beta, initial state, cu_seqlens, chunk)
CASES = [
    ("T1", 1, 1, 1, 1, "normal", "uniform", True, None, 64),
    ("T63-gva2", 1, 63, 1, 2, "normal", "uniform", False, None, 64),
    ("T64", 2, 64, 1, 1, "normal", "uniform", True, None, 64),
    ("T65-gva3", 1, 65, 1, 3, "normal", "uniform", True, None, 64),
    ("T75-c32", 1, 75, 2, 2, "normal", "uniform", False, None, 32),
    ("T130-c16", 1, 130, 1, 1, "normal", "uniform", True, None, 16),
    ("varlen-empty", 1, 150, 1, 2, "normal", "uniform", True, [0, 40, 40, 107, 140], 64),
    ("g-zero", 1, 130, 1, 1, "zero", "uniform", True, None, 64),
    ("strong-partial", 1, 100, 1, 2, "strong", "uniform", True, None, 64),
    ("beta-zero", 1, 70, 1, 1, "normal", "zero", True, None, 64),
    ("spike-90", 1, 130, 1, 1, "spike", "uniform", False, None, 64),
]
CPU_BOUND = {torch.float32: 1e-5, torch.float16: 5e-3}
GPU_BOUND = {"o": 1e-2, "state": 5e-3}  # bf16 storage of W, U, h and v_new (fla's policy)


def run_case(case, dtype, device, K, V, backend="materialized", scale_T=1):
    name, B, T, H, HV, gate, beta, h0, cu, C = case
    T = T * scale_T if cu is None else T
    N = len(cu) - 1 if cu is not None else B
    q, k, v, g, b, h = make_inputs(B, T, H, HV, K, V, dtype, gate, beta, h0, N, device,
                                   chunk_size=C)
    cu_t = torch.tensor(cu, device=device) if cu is not None else None
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                   cu_seqlens=cu_t, chunk_size=C, backend=backend)
    o_ref, ht_ref = truth(q, k, v, g, b, h, cu_t)
    return o, ht, o_ref, ht_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_materialized_cpu(case, dtype):
    K, V = (64, 64) if case[0] in ("T64", "g-zero") else (32, 16)
    o, ht, o_ref, ht_ref = run_case(case, dtype, "cpu", K, V)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert rel_err(o, o_ref) <= CPU_BOUND[dtype]
    assert rel_err(ht, ht_ref) <= CPU_BOUND[dtype]


def test_materialized_k_neq_v():
    o, ht, o_ref, ht_ref = run_case(CASES[3], torch.float32, "cpu", 64, 32)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


def test_materialized_several_value_blocks():
    """V = 128 with two batch rows and three value heads: chunk_output's grid has two value
    blocks a (batch, head), so all three indices of its heads-fastest order are exercised."""
    case = ("v128-b2", 2, 130, 1, 3, "normal", "uniform", True, None, 64)
    o, ht, o_ref, ht_ref = run_case(case, torch.float32, "cpu", 32, 128)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


def test_beta_zero_inverse_is_identity():
    """beta = 0 makes A = 0, so kkt_solve must return exactly I (no rounding anywhere)."""
    from gdn_fused.kernels.kkt_solve import kkt_solve
    A = torch.zeros(1, 130, 2, 64)
    Ai = kkt_solve(A)
    eye = torch.eye(64)
    for s in range(0, 130, 64):
        n = min(64, 130 - s)
        assert torch.equal(Ai[0, s:s + n, 1, :n], eye[:n, :n])


def test_varlen_tail_past_cu_seqlens_is_zero():
    q, k, v, g, b, _ = make_inputs(1, 90, 1, 1, 32, 16)
    cu = torch.tensor([0, 30, 70])
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, output_final_state=True,
                                   backend="materialized")
    o_ref, ht_ref = truth(q, k, v, g, b, None, cu)
    assert torch.equal(o[0, 70:], torch.zeros_like(o[0, 70:]))
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


@pytest.mark.parametrize("where", ["k", "g"])
@pytest.mark.parametrize("backend", ["torch", "materialized", "fused"])
def test_non_finite_input_spoils_its_chunk_and_nothing_before(backend, where):
    """What chunk_gated_delta_rule's docstring promises for a NaN at token t: o is finite
    before t's chunk and non-finite from its first token on, for a NaN key and a NaN gate
    (the kernels' floor on g keeps NaN, as torch's clamp does; the interpreter's max keeps
    NaN either way, so the GPU test test_gpu_gate_floor_keeps_nan_and_floors_minus_inf
    guards that); the other sequence of the batch stays exact;
    fused_recurrent_gated_delta_rule stays finite up to t − 1."""
    q, k, v, g, b, _ = make_inputs(2, 130, 1, 1, 64, 64)
    o_ref, _ = truth(q, k, v, g, b)
    (k if where == "k" else g)[0, 100] = float("nan")
    o, _ = chunk_gated_delta_rule(q, k, v, g, b, backend=backend)
    assert o[0, :64].isfinite().all() and not o[0, 64:].isfinite().all(dim=-1).any()
    assert rel_err(o[0, :64], o_ref[0, :64]) <= 1e-5 and rel_err(o[1], o_ref[1]) <= 1e-5
    o, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta=b)
    assert o[0, :100].isfinite().all() and not o[0, 100].isfinite().any()


def test_strided_inputs():
    """Hugging Face passes views of a fused projection; the result must not depend on layout."""
    q, k, v, g, b, _ = make_inputs(1, 70, 2, 2, 32, 32)
    qkv = torch.cat([q, k, v], dim=-1)  # [B, T, 2, 96]
    qs, ks, vs = qkv[..., :32], qkv[..., 32:64], qkv[..., 64:]
    assert not qs.is_contiguous()
    o, _ = chunk_gated_delta_rule(qs, ks, vs, g, b, backend="materialized")
    o_ref, _ = truth(q, k, v, g, b)
    assert rel_err(o, o_ref) <= 1e-5


@pytest.mark.parametrize("case", [CASES[i] for i in (0, 2, 3, 6, 7, 8)], ids=lambda c: c[0])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recurrent(case, backend):
    name, B, T, H, HV, gate, beta, h0, cu, C = case
    N = len(cu) - 1 if cu is not None else B
    q, k, v, g, b, h = make_inputs(B, T, H, HV, 32, 16, torch.float32, gate, beta, h0, N)
    cu_t = torch.tensor(cu) if cu is not None else None
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, beta=b, initial_state=h,
                                             output_final_state=True, cu_seqlens=cu_t,
                                             backend=backend)
    o_ref, ht_ref = truth(q, k, v, g, b, h, cu_t)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_materialized_gpu_bf16(case):
    o, ht, o_ref, ht_ref = run_case(case, torch.bfloat16, "cuda", 128, 128, scale_T=8)
    eo, es = rel_err(o, o_ref), rel_err(ht, ht_ref)
    print(f"materialized bf16 {case[0]}: o {eo:.2e} state {es:.2e}")
    assert eo <= GPU_BOUND["o"] and es <= GPU_BOUND["state"]


@pytest.mark.gpu
def test_materialized_gpu_bf16_qwen_layer():
    """A Qwen3-Next layer: H = 16, HV = 32, K = V = 128, T = 8192."""
    q, k, v, g, b, h = make_inputs(1, 8192, 16, 32, 128, 128, torch.bfloat16,
                                   initial_state=True, device="cuda")
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                   backend="materialized")
    o_ref, ht_ref = truth(q, k, v, g, b, h)
    eo, es = rel_err(o, o_ref), rel_err(ht, ht_ref)
    print(f"materialized bf16 qwen-layer T=8192: o {eo:.2e} state {es:.2e}")
    assert eo <= GPU_BOUND["o"] and es <= GPU_BOUND["state"]


@pytest.mark.parametrize("backend", ["torch", "materialized", "fused"])
def test_very_negative_gates_mixed_with_ordinary_ones(backend):
    """g = −1e4 at every third token: the chunk's cumulative G reaches −2700 (after the −128
    floor), so an fp32 G_i − G_j would lose ~2e-4; G is cumulated in fp64."""
    q, k, v, g, b, h = make_inputs(1, 200, 1, 2, 64, 64, initial_state=True)
    g[0, ::3] = -1e4
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                   backend=backend)
    o_ref, ht_ref = truth(q, k, v, g, b, h)
    assert rel_err(o, o_ref) <= 1e-6 and rel_err(ht, ht_ref) <= 1e-6


def test_state_output_kernel_is_chosen_only_where_it_applies(monkeypatch):
    """The routing rule of the materialized forward's Gluon state + output kernel, on stand-in
    tensors (the kernel itself is tested on the GPU in tests/test_gluon_transposed.py)."""
    from types import SimpleNamespace

    from gdn_fused.kernels import materialized
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GDN_STATE_OUTPUT_KERNEL", raising=False)
    capability = [(9, 0)]
    monkeypatch.setattr(chunk_index, "capability", lambda device: capability[0])

    def x(B=1, T=8192, dim=128, dtype=torch.bfloat16, cuda=True):
        return SimpleNamespace(is_cuda=cuda, device="cuda", dtype=dtype, shape=(B, T, 16, dim))

    use = materialized.uses_state_output_kernel
    assert use(x(), x(), 64, None)
    assert use(x(B=4, T=2048), x(B=4, T=2048), 64, None)
    assert use(x(T=8200), x(T=8200), 64, None)  # one sequence: nothing past its partial chunk
    assert not use(x(B=4, T=2050), x(B=4, T=2050), 64, None)  # a chunk would straddle two
    assert use(x(T=2048), x(T=2048), 64, None)
    assert not use(x(T=1024), x(T=1024), 64, None)  # shorter than measured: the Triton kernels
    assert not use(x(), x(), 64, torch.tensor([0, 8192]))  # packed: not supported
    assert not use(x(), x(), 32, None)
    assert not use(x(dim=64), x(dim=64), 64, None)
    assert not use(x(dtype=torch.float16), x(dtype=torch.float16), 64, None)
    assert not use(x(cuda=False), x(cuda=False), 64, None)
    monkeypatch.setenv("GDN_STATE_OUTPUT_KERNEL", "0")
    assert not use(x(), x(), 64, None)
    # the tiling conditions alone (the backward's Gluon dq/dk/dw/dg kernel): no token floor,
    # and the forward's A/B switch does not turn them off
    tiles = materialized.gluon_tiles_apply
    assert tiles(x(T=1024), x(T=1024), 64, None) and tiles(x(), x(), 64, None)
    assert not tiles(x(B=4, T=2050), x(B=4, T=2050), 64, None)
    monkeypatch.delenv("GDN_STATE_OUTPUT_KERNEL")
    capability[0] = (10, 0)  # sm_100: wgmma and this kernel's setmaxnreg split are sm_90a
    assert not use(x(), x(), 64, None)
    capability[0] = (9, 0)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm reports 9.x for MI200/MI300
    assert not use(x(), x(), 64, None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not use(x(), x(), 64, None)
