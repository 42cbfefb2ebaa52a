"""fla 0.6.0's keyword options of the ops (gdn_fused.fla_options): honoured with fla's meaning,
or refused by name — never silently dropped."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gdn_fused import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from gdn_fused.eval.cases import make_inputs, rel_err

B, T, H, HV, K, V = 1, 70, 2, 4, 16, 8


def raw_inputs(seed=0):
    """q, k, v, raw gate a [B,T,HV], raw beta b, A_log, dt_bias, h0 — all fp32."""
    q, k, v, _, _, h0 = make_inputs(B, T, H, HV, K, V, initial_state=True, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(B, T, HV, generator=gen)
    b = torch.randn(B, T, HV, generator=gen)
    A_log = torch.rand(HV, generator=gen).mul(2).log1p()
    dt_bias = torch.randn(HV, generator=gen)
    return q, k, v, a, b, A_log, dt_bias, h0


def explicit(q, k, v, a, b, A_log, dt_bias, h0, neg_eigval=False, backend="torch", **kw):
    """The same computation with the gates formed outside the op."""
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b) * (2 if neg_eigval else 1)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  backend=backend, **kw)


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_gate_and_beta_sigmoid_in_kernel_equal_the_explicit_gates(neg_eigval):
    q, k, v, a, b, A_log, dt_bias, h0 = raw_inputs()
    o, ht = chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True,
                                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                   use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=neg_eigval, backend="torch")
    o_ref, ht_ref = explicit(q, k, v, a, b, A_log, dt_bias, h0, neg_eigval)
    assert rel_err(o, o_ref) < 1e-6 and rel_err(ht, ht_ref) < 1e-6
    assert rel_err(o, explicit(q, k, v, a, b, A_log, dt_bias * 0, h0, neg_eigval)[0]) > 1e-2


def test_gate_in_kernel_without_dt_bias_means_zero_bias():
    q, k, v, a, b, A_log, _, h0 = raw_inputs()
    o, _ = chunk_gated_delta_rule(q, k, v, a, torch.sigmoid(b), initial_state=h0,
                                  use_gate_in_kernel=True, A_log=A_log, backend="torch")
    o_ref, _ = explicit(q, k, v, a, b, A_log, torch.zeros(HV), h0)
    assert rel_err(o, o_ref) < 1e-6


def test_gradients_reach_the_raw_gates_A_log_and_dt_bias():
    q, k, v, a, b, A_log, dt_bias, h0 = raw_inputs()
    leaves = [x.clone().requires_grad_() for x in (a, b, A_log, dt_bias)]
    o, _ = chunk_gated_delta_rule(q, k, v, leaves[0], leaves[1], initial_state=h0,
                                  use_gate_in_kernel=True, A_log=leaves[2], dt_bias=leaves[3],
                                  use_beta_sigmoid_in_kernel=True, backend="torch")
    grads = torch.autograd.grad(o.square().sum(), leaves)
    ref_leaves = [x.clone().requires_grad_() for x in (a, b, A_log, dt_bias)]
    o_ref, _ = explicit(q, k, v, *ref_leaves, h0)
    ref = torch.autograd.grad(o_ref.square().sum(), ref_leaves)
    for got, want in zip(grads, ref):
        assert want.abs().sum() > 0 and rel_err(got, want) < 1e-5


@pytest.mark.filterwarnings("ignore:`transpose_state_layout` is deprecated")
@pytest.mark.parametrize("name", ["state_v_first", "transpose_state_layout"])
def test_state_v_first_transposes_initial_and_final_state(name):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, K, V, initial_state=True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2),
                                   output_final_state=True, backend="torch", **{name: True})
    o_ref, ht_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, backend="torch")
    assert ht.shape == (B, HV, V, K) and ht.is_contiguous()
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref.transpose(-1, -2))


def test_materialized_and_decode_take_the_options_alike():
    q, k, v, a, b, A_log, dt_bias, h0 = raw_inputs()
    opts = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    h0_vk = h0.transpose(-1, -2).contiguous()
    ref_o, ref_ht = chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0_vk,
                                           output_final_state=True, backend="torch", **opts)
    o, ht = chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0_vk, output_final_state=True,
                                   backend="materialized", **opts)
    assert rel_err(o, ref_o) < 1e-5 and rel_err(ht, ref_ht) < 1e-5
    for backend in ("torch", "triton"):
        o, ht = fused_recurrent_gated_delta_rule(q, k, v, a, beta=b, initial_state=h0_vk,
                                                 output_final_state=True, backend=backend,
                                                 **opts)
        assert rel_err(o, ref_o) < 1e-5 and rel_err(ht, ref_ht) < 1e-5


def test_fla_helper_arguments_are_accepted():
    q, k, v, g, beta, _ = make_inputs(1, T, H, HV, K, V)
    cu = torch.tensor([0, 30, T])
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, cu_seqlens_cpu=cu,
                                  chunk_indices=torch.zeros(3, 2, dtype=torch.long),
                                  cp_context=None, backend="torch")
    assert torch.equal(o, chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                                 backend="torch")[0])


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(output_final_states=True), TypeError, r"unexpected keyword argument\(s\) \['output_final_states'\]"),
    (dict(cp_context=object()), ValueError, "cp_context: context parallelism"),
    (dict(use_gate_in_kernel=True), ValueError, "needs A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError,
     r"A_log must be \[HV\] = \[4\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, dtype=torch.long)), TypeError,
     "needs A_log, a floating .* got torch.int64"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(2)), ValueError,
     "dt_bias must be"),
    (dict(allow_neg_eigval=True), ValueError, "requires use_beta_sigmoid_in_kernel"),
    (dict(state_v_first=True, transpose_state_layout=True), ValueError, "not both"),
    (dict(state_v_first="yes"), TypeError, "state_v_first must be a bool"),
    (dict(use_gate_in_kernel=torch.tensor(True)), TypeError, "use_gate_in_kernel must be a bool"),
    (dict(head_first=True), ValueError, "head_first=True is not supported"),
])
@pytest.mark.parametrize("op", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule])
def test_unsupported_or_inconsistent_options_raise_by_name(op, kwargs, exc, match):
    q, k, v, g, beta, _ = make_inputs(1, 5, H, HV, K, V)
    with pytest.raises(exc, match=match):
        op(q, k, v, g, beta=beta, backend="torch", **kwargs)


def test_positional_order_is_fla_s():
    """fla 0.6.0's positional order: chunk (q, k, v, g, beta, scale, initial_state,
    output_final_state, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
    allow_neg_eigval, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context),
    recurrent (q, k, v, g, gk, gv, beta, ...); beyond it keyword-only, so a positional
    argument past fla's last slot raises instead of binding to one of this package's."""
    q, k, v, g, beta, h0 = make_inputs(1, 5, H, HV, K, V, initial_state=True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, 0.5, h0, True, backend="torch")
    o2, ht2 = fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, 0.5, h0, True,
                                               backend="torch")
    assert rel_err(o2, o) < 1e-5 and rel_err(ht2, ht) < 1e-5
    by_place = chunk_gated_delta_rule(q, k, v, g, beta, 0.5, h0.transpose(-1, -2), True, True,
                                      True, True, True, None, None, None, None,
                                      backend="torch")
    by_name_h0 = chunk_gated_delta_rule(q, k, v, g, beta, 0.5, h0.transpose(-1, -2), True,
                                        backend="torch", use_qk_l2norm_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=True,
                                        allow_neg_eigval=True, state_v_first=True)
    assert torch.equal(by_place[0], by_name_h0[0]) and torch.equal(by_place[1], by_name_h0[1])
    assert rel_err(by_place[0], o) > 1e-2  # the flags did something
    with pytest.raises(ValueError, match="cp_context"):
        chunk_gated_delta_rule(q, k, v, g, beta, 0.5, h0, True, False, False, False, False,
                               None, None, None, object())
    with pytest.raises(TypeError):  # a 17th positional argument: past fla's order
        chunk_gated_delta_rule(q, k, v, g, beta, 0.5, h0, True, False, False, False, False,
                               None, None, None, None, 64)
    # the decode op: fla's order through cu_seqlens (l2norm, the gate flags and A_log,
    # dt_bias, sigmoid beta, negative eigenvalues, the state layout)
    A_log, dt_bias = torch.rand(HV), torch.rand(HV)
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
              dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
              state_v_first=True)
    hv = h0.transpose(-1, -2)
    by_name = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=0.5,
                                               initial_state=hv, output_final_state=True,
                                               backend="torch", **kw)
    by_place = fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, 0.5, hv, True,
                                                *kw.values(), None, backend="torch")
    assert torch.equal(by_place[0], by_name[0]) and torch.equal(by_place[1], by_name[1])
    with pytest.raises(TypeError):  # past fla's order
        fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, 0.5, hv, True,
                                         *kw.values(), None, "torch")
    with pytest.raises(ValueError, match="gk: per-key"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta)  # fla would read beta as gk
    with pytest.raises(ValueError, match="gv: per-key"):
        fused_recurrent_gated_delta_rule(q, k, v, g, gv=beta)


def test_flags_by_truth_value_and_A_log_unread_without_the_gate_flag():
    """As in fla: numpy bools, 0 / 1 and None are flags; A_log and dt_bias passed without
    use_gate_in_kernel are not read (fla code that always passes them keeps working)."""
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, K, V, initial_state=True)
    ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, backend="torch")[0]
    for flags in (dict(use_gate_in_kernel=np.bool_(False), state_v_first=0),
                  dict(use_gate_in_kernel=None, use_beta_sigmoid_in_kernel=False),
                  dict(A_log=torch.zeros(HV), dt_bias=torch.ones(HV))):
        o = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, backend="torch",
                                   **flags)[0]
        assert torch.equal(o, ref)


def test_shape_errors_name_the_culprit_in_the_callers_terms():
    q, k, v, g, beta, h0 = make_inputs(B, 5, H, HV, K, V, initial_state=True)
    # a state in the K-first layout passed with state_v_first: the message speaks of [N,HV,V,K]
    with pytest.raises(ValueError, match=r"\[N, HV, V, K\] = \(1, 4, 8, 16\) "
                                         r"\(state_v_first=True\), got \(1, 4, 16, 8\)"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, state_v_first=True,
                               backend="torch")
    # a g of the wrong width with the gate flag: g is blamed, not a correct A_log
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule(q, k, v, g[..., :1], beta, use_gate_in_kernel=True,
                               A_log=torch.zeros(HV), backend="torch")
    with pytest.raises(ValueError, match="needs g"):
        fused_recurrent_gated_delta_rule(q, k, v, beta=beta, use_gate_in_kernel=True,
                                         A_log=torch.zeros(HV), backend="torch")
    # integer raw gates are refused like integer log-decays
    with pytest.raises(TypeError, match="g must be a floating"):
        chunk_gated_delta_rule(q, k, v, g.long(), beta, use_gate_in_kernel=True,
                               A_log=torch.zeros(HV), backend="torch")


def test_old_state_layout_name_warns_like_fla():
    q, k, v, g, beta, h0 = make_inputs(B, 5, H, HV, K, V, initial_state=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2),
                               transpose_state_layout=True, backend="torch")


@pytest.mark.parametrize("op", [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule])
@pytest.mark.parametrize("name", ["output_final_state", "use_qk_l2norm_in_kernel"])
def test_the_ops_own_flags_refuse_non_bools(op, name):
    """A string's truth value would switch the option on silently ("no" is true)."""
    q, k, v, g, beta, _ = make_inputs(1, 5, H, HV, K, V)
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        op(q, k, v, g, beta=beta, backend="torch", **{name: "no"})


def test_gates_are_computed_only_after_every_check(monkeypatch):
    import gdn_fused.fla_options as fla_options

    def forbidden(*args):
        raise AssertionError("gate computed for input that raises")
    monkeypatch.setattr(fla_options, "gdn_decay", forbidden)
    q, k, v, g, beta, _ = make_inputs(1, 5, H, HV, K, V)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48, use_gate_in_kernel=True,
                               A_log=torch.zeros(HV), backend="torch")
