"""Every bad input raises ValueError/TypeError naming the argument, before any kernel runs."""
import numpy as np
import pytest
import torch

from gdn_fused import GatedDeltaNet, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from gdn_fused.validation import triton_interpreted
from gdn_fused.eval.cases import make_inputs


def good():
    q, k, v, g, b, _ = make_inputs(1, 20, 2, 4, 16, 8)
    return dict(q=q, k=k, v=v, g=g, beta=b)


def call(**over):
    backend = over.pop("backend", "torch")
    args = good()
    args.update(over)
    return chunk_gated_delta_rule(**args, backend=backend)


@pytest.mark.parametrize("over,exc,match", [
    (dict(q=torch.randn(2, 20, 2, 16)), ValueError, "q and k"),
    (dict(v=torch.randn(1, 19, 4, 8)), ValueError, "v must be"),
    (dict(g=torch.randn(1, 20, 3)), ValueError, "g must be"),
    (dict(beta=torch.randn(1, 20)), ValueError, "beta must be"),
    (dict(v=torch.randn(1, 20, 3, 8)), ValueError, "multiple of"),
    (dict(v=torch.randn(1, 20, 0, 8), g=torch.randn(1, 20, 0), beta=torch.rand(1, 20, 0)),
     ValueError, r"v\.shape\[2\] \(HV"),
    (dict(q=torch.randn(1, 20, 0, 16), k=torch.randn(1, 20, 0, 16)), ValueError,
     r"q\.shape\[2\] \(H,"),
    (dict(q=torch.randn(1, 20, 2, 300), k=torch.randn(1, 20, 2, 300)), ValueError, "head dims"),
    (dict(v=torch.randn(1, 20, 4, 8, dtype=torch.float64)), TypeError, "share one dtype"),
    (dict(q=torch.ones(1, 20, 2, 16, dtype=torch.int32)), TypeError, "q must be a floating"),
    (dict(q=[1, 2]), TypeError, "q must be a torch.Tensor"),
    (dict(initial_state=torch.zeros(1, 4, 16, 9)), ValueError, "initial_state must be"),
    (dict(cu_seqlens=torch.tensor([[0, 20]])), ValueError, "cu_seqlens must be 1-D"),
    (dict(cu_seqlens=torch.tensor([1, 20])), ValueError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 12, 8, 20])), ValueError, "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0, 21])), ValueError, "exceeds the packed length"),
    (dict(cu_seqlens=torch.tensor([0, 20.])), TypeError, "int32 or int64"),
    (dict(chunk_size=48), ValueError, "chunk_size must be"),
    (dict(backend="flash"), ValueError, "backend must be"),
    (dict(scale="0.1"), TypeError, "scale must be"),
    (dict(scale=True), TypeError, "scale must be"),
    (dict(scale=torch.tensor(0.5)), TypeError, "scale must be a real number"),
    (dict(scale=np.bool_(True)), TypeError, "scale must be a real number"),
    (dict(scale=float("nan")), ValueError, "scale must be finite"),
    (dict(initial_state=torch.zeros(1, 4, 16, 8, device="meta")), ValueError,
     "initial_state must be on"),
    (dict(cu_seqlens=torch.tensor([0, 20], device="meta")), ValueError, "cu_seqlens must be on"),
    (dict(head_first=True), ValueError, "head_first=True is not supported"),
    (dict(q=torch.randn(1, 20, 2, 16, device="meta"), k=torch.randn(1, 20, 2, 16, device="meta"),
          v=torch.randn(1, 20, 4, 8, device="meta"), g=torch.randn(1, 20, 4, device="meta"),
          beta=torch.rand(1, 20, 4, device="meta")), ValueError, "meta device"),
])
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        call(**over)


def test_cu_seqlens_needs_batch_one():
    q, k, v, g, b, _ = make_inputs(2, 20, 2, 4, 16, 8)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.tensor([0, 20]))


@pytest.mark.parametrize("backend", ["materialized", "fused"])
def test_triton_backend_on_cpu_without_interpreter(monkeypatch, backend):
    # Triton decides interpreted vs compiled when a kernel module is imported: import them
    # under the interpreter first, or later tests would get compiled kernels on CPU
    import gdn_fused.kernels.fused_fwd  # noqa: F401
    import gdn_fused.kernels.materialized  # noqa: F401
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        call(backend=backend)


def test_recurrent_bad_backend_and_shapes():
    args = good()
    with pytest.raises(ValueError, match="backend must be"):
        fused_recurrent_gated_delta_rule(**args, backend="materialized")
    args["beta"] = torch.rand(1, 20, 5)
    with pytest.raises(ValueError, match="beta must be"):
        fused_recurrent_gated_delta_rule(**args)


def test_head_first_false_accepted_and_empty_segment_passes_state():
    args = good()
    h0 = torch.randn(3, 4, 16, 8)
    o, ht = chunk_gated_delta_rule(**args, initial_state=h0, output_final_state=True,
                                   cu_seqlens=torch.tensor([0, 10, 10, 20]), head_first=False,
                                   backend="torch")
    assert torch.equal(ht[1], h0[1])  # the empty segment's state passes through unchanged


@pytest.mark.parametrize("backend", ["materialized", "fused"])
@pytest.mark.parametrize("dtype,match", [(torch.float64, "float64 runs on"),
                                         (torch.bfloat16, "mis-computes bf16")])
def test_triton_backend_dtypes(backend, dtype, match):
    q, k, v, g, b, _ = make_inputs(1, 20, 2, 4, 16, 8, dtype)
    with pytest.raises(TypeError, match=match):
        chunk_gated_delta_rule(q, k, v, g, b, backend=backend)


def test_recurrent_triton_refuses_gradients_and_auto_takes_torch():
    args = good()
    args["q"].requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        fused_recurrent_gated_delta_rule(**args, backend="triton")
    o, _ = fused_recurrent_gated_delta_rule(**args)  # auto: the differentiable recurrence
    o.sum().backward()
    assert args["q"].grad is not None and torch.isfinite(args["q"].grad).all()


@pytest.mark.parametrize("backend", ["torch", "materialized", "fused"])
def test_minus_inf_gate_resets_without_nan(backend):
    """g = −inf (a full reset) acts as the floor −128: the state before it is forgotten."""
    from gdn_fused.ops import resolve_backend
    from gdn_fused.eval.cases import rel_err, truth
    # K = V = 64: a size the fused kernel takes, so "fused" is not materialized again
    q, k, v, g, b, h = make_inputs(1, 80, 1, 2, 64, 64, initial_state=True)
    assert resolve_backend(backend, q, v, 64) == backend
    g[0, 30] = -torch.inf
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                   backend=backend)
    o_ref, ht_ref = truth(q, k, v, g.clamp(min=-1e4), b, h)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "materialized", "fused"])
def test_gate_below_the_floor_gets_no_gradient(backend):
    """Gates below LOG_DECAY_MIN (−inf too) act as the floor, so their gradient is exactly 0
    on every backend (torch's clamp in the autograd path; the kernels floor g again where
    they load it), and the other gates' gradients match the torch backend's."""
    q, k, v, g, b, h = make_inputs(1, 80, 1, 2, 64, 64, initial_state=True)
    g[0, 10, 0], g[0, 30, 1], g[0, 50, 0] = -300., -torch.inf, -128.5
    below = g < -128

    def grads(backend):
        x = g.clone().requires_grad_()
        o, ht = chunk_gated_delta_rule(q, k, v, x, b, initial_state=h, output_final_state=True,
                                       backend=backend)
        (o.square().sum() + ht.sum()).backward()
        return x.grad
    dg = grads(backend)
    assert torch.isfinite(dg).all() and torch.equal(dg[below], torch.zeros_like(dg[below]))
    from gdn_fused.eval.cases import rel_err
    assert rel_err(dg, grads("torch")) <= 1e-4


def test_empty_batch_on_torch_backend():
    q, k, v, g, b, _ = make_inputs(0, 20, 2, 4, 16, 8)
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, output_final_state=True, backend="torch")
    assert o.shape == (0, 20, 4, 8) and ht.shape == (0, 4, 16, 8)


@pytest.mark.parametrize("chunk_size", [64.0, True, torch.tensor(64), np.array(64), np.float64(64)])
def test_chunk_size_must_be_an_int(chunk_size):
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        call(chunk_size=chunk_size)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        GatedDeltaNet(32, 2, head_k_dim=16, head_v_dim=16, chunk_size=chunk_size)


def test_numpy_integer_chunk_size_is_taken_as_int():
    o, _ = call(chunk_size=np.int64(16))
    assert torch.equal(o, call(chunk_size=16)[0])
    layer = GatedDeltaNet(32, 2, head_k_dim=16, head_v_dim=16, chunk_size=np.int32(32))
    assert type(layer.chunk_size) is int and layer.chunk_size == 32


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("ON", True), ("Yes", True),
                                      ("0", False), ("", False), ("false", False),
                                      ("OFF", False), ("no", False)])
def test_triton_interpreted_reads_the_variable_like_triton(monkeypatch, value, on):
    from triton._C.libtriton import getenv_bool
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreted() is on
    assert getenv_bool("TRITON_INTERPRET", False) is on  # Triton 3.6's own reading


@pytest.mark.parametrize("backend", ["torch", "materialized", "fused"])
@pytest.mark.parametrize("T", [20, 0])
@pytest.mark.parametrize("method,iters,exc,match", [
    ("blocked", 2, ValueError, "solve_iters must be None"),
    ("mxr", 1, ValueError, "solve_iters must be None"),
    ("newton_schulz", 0, ValueError, "solve_iters must be a positive int"),
    ("newton_schulz", -1, ValueError, "solve_iters must be a positive int"),
    ("newton_schulz", True, TypeError, "solve_iters must be an int"),
    ("newton_schulz", 2.0, TypeError, "solve_iters must be an int"),
])
def test_solve_iters_same_rules_on_every_backend(backend, T, method, iters, exc, match):
    args = {name: x[:, :T] for name, x in good().items()}
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule(**args, backend=backend, solve_method=method, solve_iters=iters)
    with pytest.raises(exc, match=match):
        GatedDeltaNet(32, 2, head_k_dim=16, head_v_dim=16, backend=backend,
                      solve_method=method, solve_iters=iters)


def test_solve_iters_numpy_integer_is_taken_as_int():
    o, _ = call(solve_method="newton_schulz", solve_iters=np.int64(3))
    assert torch.equal(o, call(solve_method="newton_schulz", solve_iters=3)[0])


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float16(0.5), np.float64(0.5)])
def test_numpy_real_scale_is_taken_as_float(scale):
    assert torch.equal(call(scale=scale)[0], call(scale=0.5)[0])
    o, _ = fused_recurrent_gated_delta_rule(**good(), scale=scale, backend="torch")
    assert torch.equal(o, fused_recurrent_gated_delta_rule(**good(), scale=0.5,
                                                           backend="torch")[0])


def test_errors_name_the_backend_the_caller_asked_for(monkeypatch):
    """fused falls back to materialized for inputs it does not take; a refusal of the input
    must still speak of backend='fused', not of the fallback; what auto chose is said to be
    auto's choice."""
    q, k, v, g, b, _ = make_inputs(1, 20, 2, 4, 16, 8, torch.float64)
    with pytest.raises(TypeError, match="backend='fused'"):
        chunk_gated_delta_rule(q, k, v, g, b, backend="fused")
    with pytest.raises(ValueError, match="on backend 'fused'"):
        chunk_gated_delta_rule(**good(), backend="fused", solve_method="mch")
    # auto's choice (materialized on CUDA; stood in for here) is named as auto's
    monkeypatch.setattr("gdn_fused.ops.resolve_backend", lambda *args: "materialized")
    with pytest.raises(ValueError, match="'materialized' \\(chosen by backend='auto'"):
        chunk_gated_delta_rule(**good(), solve_method="mch")


@pytest.mark.parametrize("backend", ["materialized", "fused"])
@pytest.mark.parametrize("given", [False, True])
def test_packed_offsets_read_once_per_forward_and_backward(backend, given, monkeypatch):
    """A packed call reads cu_seqlens to the host once for validation, forward and backward
    together; fla's cu_seqlens_cpu is not read (a wrong one changes nothing)."""
    if not triton_interpreted():
        pytest.skip("Triton backends on CPU need TRITON_INTERPRET=1")
    q, k, v, g, b, h = make_inputs(1, 90, 1, 2, 64, 64, initial_state=True, num_seqs=3)
    cu = torch.tensor([0, 30, 30, 90])
    leaves = [x.requires_grad_() for x in (q, k, v, g, b)]
    reads, cpu = [], torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        if self.data_ptr() == cu.data_ptr():
            reads.append(1)
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    extra = dict(cu_seqlens_cpu=torch.tensor([0, 60, 90])) if given else {}  # disagrees
    o, _ = chunk_gated_delta_rule(*leaves, initial_state=h, cu_seqlens=cu, backend=backend,
                                  **extra)
    grads = torch.autograd.grad(o.sum(), leaves)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    assert len(reads) == 1
    o_ref, _ = chunk_gated_delta_rule(*leaves, initial_state=h, cu_seqlens=cu, backend=backend)
    assert torch.equal(o, o_ref)
    for d, d_ref in zip(grads, torch.autograd.grad(o_ref.sum(), leaves)):
        assert torch.equal(d, d_ref)


@pytest.mark.parametrize("backend", ["materialized", "fused"])
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(backend):
    """Dual tensors do not set requires_grad: the op must still meet autograd.Function (which
    has no jvp and says so) rather than return o without a tangent."""
    if not triton_interpreted():
        pytest.skip("Triton backends on CPU need TRITON_INTERPRET=1")
    import torch.autograd.forward_ad as fwAD
    q, k, v, g, b, h = make_inputs(1, 20, 1, 1, 16, 16, initial_state=True)
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="jvp"):
            chunk_gated_delta_rule(q, k, fwAD.make_dual(v, torch.randn_like(v)), g, b,
                                   initial_state=h, backend=backend)

