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


def test_log_decay_pairs_gradient():
    """The pairwise log-decay differences' own backward (spanning pairs only) against
    gradcheck, the upper triangle included."""
    from gdn_fused.reference import _LogDecayPairs
    g = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_LogDecayPairs.apply, (g,))


@pytest.mark.parametrize("gate", [-40.0, -70.0])
@pytest.mark.parametrize("mixed", [False, True])
def test_torch_path_gate_gradient_under_strong_decay(gate, mixed):
    """dg of the torch backend token by token against autograd through the fp64 recurrence
    where the gates decay strongly (g = −40 or −70 a token, alone or with every fourth token
    at −0.1), partial last chunk, an initial state and both cotangents: within 1e-8 relative
    at every token. Through plain differences of G a token's true dg (~e^{−40}) came out as
    the rounding of O(1) pair terms that cancel: relative errors of 2 with constant gates and
    1.5e4 at single tokens with mixed ones (new-user trial, session 28)."""
    import torch.nn.functional as F
    from gdn_fused.reference import recurrent_gated_delta_rule_ref
    torch.manual_seed(0)
    T = 70
    q, k = (F.normalize(torch.randn(1, T, 1, 32, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, 2, 32, dtype=torch.float64)
    beta = torch.rand(1, T, 2, dtype=torch.float64)
    h0 = torch.randn(1, 2, 32, 32, dtype=torch.float64)
    g = torch.full((1, T, 2), gate, dtype=torch.float64)
    if mixed:
        g[:, ::4] = -0.1
    grads = []
    for fn in (recurrent_gated_delta_rule_ref,
               lambda *a, **kw: chunk_gated_delta_rule(*a, **kw, backend="torch")):
        gg = g.clone().requires_grad_()
        o, ht = fn(q, k, v, gg, beta, initial_state=h0, output_final_state=True)
        (o.sum() + ht.sum()).backward()
        grads.append(gg.grad)
    ref, got = grads
    assert ((got - ref).abs() / ref.abs()).max() <= 1e-8
