"""The chunked torch form against the fp64 recurrence, and its gradients (gradcheck)."""
import pytest
import torch

from gdn_fused import chunk_gated_delta_rule
from gdn_fused.reference import chunk_gated_delta_rule_ref
from gdn_fused.eval.cases import make_inputs, rel_err, truth
from tests.test_materialized import CASES


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_chunked_torch(case, dtype, bound):
    from tests.test_materialized import run_case
    o, ht, o_ref, ht_ref = run_case(case, dtype, "cpu", 32, 16, backend="torch")
    assert rel_err(o, o_ref) <= bound and rel_err(ht, ht_ref) <= bound


def test_l2norm_in_kernel_matches_prenormalised():
    q, k, v, g, b, _ = make_inputs(1, 70, 2, 4, 16, 8, torch.float64)
    q3, k3 = 3 * q, 0.5 * k
    o1, _ = chunk_gated_delta_rule(q3, k3, v, g, b, use_qk_l2norm_in_kernel=True, backend="torch")
    from gdn_fused.reference import l2norm
    o_ref, _ = truth(l2norm(q3), l2norm(k3), v, g, b)
    assert rel_err(o1, o_ref) <= 1e-12


@pytest.mark.parametrize("gate", ["normal", "zero", "strong"])
def test_gradcheck_torch_path(gate):
    """fp64 gradcheck through the chunked form: q, k, v, g, beta, initial_state and both
    cotangents (o and final state), a partial last chunk and GVA."""
    q, k, v, g, b, h = make_inputs(1, 11, 1, 2, 4, 3, torch.float64, gate=gate,
                                   initial_state=True, chunk_size=8)
    g, b, h = g.double(), b.double(), h.double()
    args = [x.requires_grad_() for x in (q, k, v, g, b, h)]

    def f(q, k, v, g, b, h):
        # chunk 8 < T = 11: two chunks, so the state carried between them is gradchecked too
        return chunk_gated_delta_rule_ref(q, k, v, g, b, 0.7, h, True, None, False, 8)

    assert torch.autograd.gradcheck(f, args, atol=1e-8, rtol=1e-6)
