"""Every bad input raises ValueError/TypeError naming the argument, before any kernel runs."""
import pytest
import torch

from gdn_fused import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.cases import make_inputs


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


def test_unknown_kwargs_ignored_and_empty_segment_passes_state():
    args = good()
    h0 = torch.randn(3, 4, 16, 8)
    o, ht = chunk_gated_delta_rule(**args, initial_state=h0, output_final_state=True,
                                   cu_seqlens=torch.tensor([0, 10, 10, 20]), head_first=False,
                                   backend="torch")
    assert torch.equal(ht[1], h0[1])  # the empty segment's state passes through unchanged
