"""GatedDeltaNet module: forward/backward vs an fp64 functional reference, decode continuity,
left padding, packed sequences, decay finiteness, argument errors (CPU, backend "torch")."""
import math

import pytest
import torch
import torch.nn.functional as F

import gdn_fused.layer as layer_module
from gdn_fused.cache import GatedDeltaNetCache
from gdn_fused.gates import gdn_decay
from gdn_fused.layer import RECURRENT_MAX_TOKENS, GatedDeltaNet
from gdn_fused.ops import resolve_backend
from gdn_fused.reference import LOG_DECAY_MIN
from gdn_fused.reference import recurrent_gated_delta_rule_ref
from gdn_fused.eval.cases import rel_err
from gdn_fused.validation import triton_interpreted

D_MODEL, H, HV, K, V, W = 32, 2, 4, 16, 8, 4


def make_layer(dtype=torch.float64, seed=0, **kw):
    """A small layer with every parameter random (norm weights too) and moderate decays."""
    torch.manual_seed(seed)
    opts = dict(head_k_dim=K, head_v_dim=V, conv_size=W, layer_idx=0, backend="torch",
                chunk_size=16)
    opts.update(kw)
    layer = GatedDeltaNet(D_MODEL, H, HV, **opts)
    with torch.no_grad():
        layer.norm.weight.normal_(1.0, 0.3)
        layer.A_log.normal_(-1.0, 1.0)
        layer.dt_bias.normal_(0.0, 1.0)
        if layer.conv1d is not None:
            layer.conv1d.weight.normal_(0.0, 0.5)
    return layer.to(dtype)


def reference_layer(layer, x, mask=None):
    """The layer written out in fp64 from its parameters: explicit conv taps, explicit L2 norm,
    gdn_fused.reference.recurrent_gated_delta_rule_ref as the core, gated RMSNorm by formula.
    Padding (mask False) is handled by running each row's tokens alone."""
    if mask is not None:
        out = torch.zeros(x.shape[:2] + (layer.d_model,), dtype=torch.float64)
        for b in range(x.shape[0]):
            idx = mask[b].nonzero().squeeze(-1)
            out[b, idx] = reference_layer(layer, x[b:b + 1, idx])[0]
        return out
    p = {n: t.double() for n, t in layer.named_parameters()}
    x = x.double()
    B, T, _ = x.shape
    kd, vd = H * K, HV * V
    gate = vd if layer.use_output_gate else 0
    qkv, z, b, a = (x @ p["in_proj.weight"].T).split([2 * kd + vd, gate, HV, HV], -1)
    if layer.conv1d is not None:
        w = p["conv1d.weight"][:, 0]  # [C, W]
        # y[t] = sum_j w[:, j] · x[t − (W − 1 − j)], zero before the sequence start
        conv = torch.zeros_like(qkv)
        for j in range(W):
            lag = W - 1 - j
            conv[:, lag:] = conv[:, lag:] + w[:, j] * qkv[:, :T - lag]
        qkv = conv
    qkv = qkv * torch.sigmoid(qkv)
    q, k, v = qkv.split([kd, kd, vd], -1)
    q = q.reshape(B, T, H, K)
    k = k.reshape(B, T, H, K)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -torch.exp(p["A_log"]) * F.softplus(a + p["dt_bias"])
    beta = torch.sigmoid(b) * (2.0 if layer.allow_neg_eigval else 1.0)
    o, _ = recurrent_gated_delta_rule_ref(q, k, v.reshape(B, T, HV, V), g, beta)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm.eps) * p["norm.weight"]
    if layer.use_output_gate:
        zz = z.reshape(B, T, HV, V)
        o = o * zz * torch.sigmoid(zz)
    return o.reshape(B, T, vd) @ p["out_proj.weight"].T


VARIANTS = [
    {},
    {"allow_neg_eigval": True},
    {"use_output_gate": False},
    {"use_short_conv": False},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "default")
def test_forward_backward_match_fp64_reference(variant):
    layer = make_layer(**variant)
    x = torch.randn(2, 37, D_MODEL, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = reference_layer(layer, x_ref)
    err = (y - y_ref).abs().max().item()
    print(f"fp64 module vs fp64 reference: max abs diff {err:.2e}")
    assert err < 1e-10
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x] + list(layer.parameters()))
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x_ref] + list(layer.parameters()))
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, gr, gr_ref in zip(names, grads, grads_ref):
        assert rel_err(gr, gr_ref) < 1e-9, name


def test_fp32_and_bf16_forward_backward_within_budget():
    layer64 = make_layer()
    x = torch.randn(2, 45, D_MODEL, dtype=torch.float64)
    y_ref = reference_layer(layer64, x)
    for dtype, budget in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        layer = make_layer(dtype)
        xd = x.to(dtype).requires_grad_(True)
        y = layer(xd)
        assert y.dtype == dtype
        err = rel_err(y, y_ref)
        print(f"{dtype} module vs fp64 reference: relative error {err:.2e}")
        assert err < budget
        y.float().square().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    # fp32 gradients against the fp64 ones
    layer32 = make_layer(torch.float32)
    x32 = x.float().requires_grad_(True)
    layer32(x32).double().square().sum().backward()
    x64 = x.clone().requires_grad_(True)
    layer64(x64).square().sum().backward()
    assert rel_err(x32.grad, x64.grad) < 1e-4
    for (name, p32), p64 in zip(layer32.named_parameters(), layer64.parameters()):
        assert rel_err(p32.grad, p64.grad) < 1e-4, name


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 2e-5)])
def test_prefill_equals_prefill_plus_decode(dtype, tol, monkeypatch):
    """Prefill of T tokens == prefill of T−k, then single-token steps (recurrent op) and
    multi-token continuations (recurrent op for ≤ RECURRENT_MAX_TOKENS, chunk op beyond)."""
    calls = []

    def counting(name):
        op = getattr(layer_module, name)

        def counted(*args, **kwargs):
            calls.append((name, args[0].shape[1]))
            return op(*args, **kwargs)
        return counted

    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        monkeypatch.setattr(layer_module, name, counting(name))
    layer = make_layer(dtype)
    T = 70
    x = torch.randn(2, T, D_MODEL, dtype=dtype)
    pieces = [40, 1, 1, 1, 3, RECURRENT_MAX_TOKENS + 4, 1]
    pieces.append(T - sum(pieces))
    assert sum(pieces) == T and pieces[-1] > 0
    with torch.no_grad():
        full_cache = GatedDeltaNetCache()
        y_full = layer(x, past_key_values=full_cache, use_cache=True)
        cache = GatedDeltaNetCache()
        outs, start = [], 0
        for n in pieces:
            outs.append(layer(x[:, start:start + n], past_key_values=cache, use_cache=True))
            start += n
    y_steps = torch.cat(outs, 1)
    recurrent = "fused_recurrent_gated_delta_rule"
    assert calls[1:] == [("chunk_gated_delta_rule", 40)] + [
        (recurrent if n <= RECURRENT_MAX_TOKENS else "chunk_gated_delta_rule", n)
        for n in pieces[1:]]
    err = (y_steps - y_full).abs().max().item()
    state_err = (cache.recurrent_states[0] - full_cache.recurrent_states[0]).abs().max().item()
    print(f"{dtype}: prefill vs prefill+decode: output {err:.2e}, state {state_err:.2e}")
    assert err < tol * y_full.abs().max().item()
    assert state_err < tol * full_cache.recurrent_states[0].abs().max().item()
    assert cache.recurrent_states[0].dtype == (torch.float64 if dtype == torch.float64
                                               else torch.float32)
    # pre-conv inputs: equal up to GEMM blocking of a 70-row vs a 1-row projection
    assert torch.allclose(cache.conv_states[0], full_cache.conv_states[0], rtol=tol, atol=tol)
    assert cache.conv_states[0].shape == (2, 2 * H * K + HV * V, W)
    # and the cached run agrees with a cache-free run
    with torch.no_grad():
        assert (layer(x) - y_full).abs().max().item() < tol * y_full.abs().max().item()


def test_decode_with_gradients_uses_chunk_op_and_matches():
    """A continuation that needs gradients runs the chunk op from the cached state."""
    layer = make_layer()
    x = torch.randn(1, 30, D_MODEL, dtype=torch.float64)
    cache = GatedDeltaNetCache()
    y1 = layer(x[:, :27], past_key_values=cache)
    y2 = layer(x[:, 27:], past_key_values=cache)
    y = torch.cat([y1, y2], 1)
    assert (y - reference_layer(layer, x)).abs().max().item() < 1e-10
    y2.sum().backward()
    assert layer.A_log.grad is not None and torch.isfinite(layer.A_log.grad).all()


def _padded_prefill_and_decode(layer, x, mask, steps):
    """A masked prefill of x into a fresh cache, then one decode call a column of steps (the
    mask grown by a token each, as Hugging Face passes it): (prefill output, recurrent and
    conv state after the prefill, decode outputs)."""
    cache = GatedDeltaNetCache()
    y = layer(x, attention_mask=mask, past_key_values=cache)
    state = cache.recurrent_states[0].clone()
    conv_state = cache.conv_states[0].clone()
    ones = torch.ones(x.shape[0], steps.shape[1], dtype=mask.dtype)
    y_dec = [layer(steps[:, i:i + 1], attention_mask=torch.cat([mask, ones[:, :i + 1]], 1),
                   past_key_values=cache) for i in range(steps.shape[1])]
    return y, state, conv_state, y_dec


def test_right_padding_continues_like_the_row_alone():
    """Right-padded prompts with a cache (a row ending early, one without tokens) == the rows
    run alone: output, recurrent and conv state, and the decode steps that follow (the conv
    cache keeps each row's last tokens, not its padding; session 13's new-user trial found
    the decode of such a row off by 160 %)."""
    layer = make_layer()
    lens, T = (23, 9, 0), 23
    x = torch.randn(3, T, D_MODEL, dtype=torch.float64) * 5
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
    steps = torch.randn(3, 3, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        y, state, conv_state, y_dec = _padded_prefill_and_decode(layer, x, mask, steps)
        for b, n in enumerate(lens):
            alone_cache = GatedDeltaNetCache()
            y_alone = layer(x[b:b + 1, :n], past_key_values=alone_cache)
            assert (y[b, n:] == 0).all()
            if n:
                assert (y[b, :n] - y_alone[0]).abs().max().item() < 1e-11
                assert (state[b] - alone_cache.recurrent_states[0][0]).abs().max() < 1e-11
                assert torch.allclose(conv_state[b], alone_cache.conv_states[0][0],
                                      rtol=1e-13, atol=1e-13)
            else:  # no tokens: nothing cached for the row (a zero state, a zero window)
                assert (state[b] == 0).all() and (conv_state[b] == 0).all()
            for i in range(3):
                y_alone_dec = layer(steps[b:b + 1, i:i + 1], past_key_values=alone_cache)
                assert (y_dec[i][b] - y_alone_dec[0]).abs().max().item() < 1e-11, (b, i)


def test_right_padded_continuation_continues_like_the_row_alone():
    """A cached call, then a right-padded continuation (rows with ≥ W, < W and no tokens in
    it), then decode: each row equals its tokens run alone in the same calls. The
    continuation's own outputs see the cached context (review of session 13: rolling the
    padding to the front had put zeros between them), and the cached window ends at each
    row's last token (the previous window for the row without tokens)."""
    layer = make_layer()
    lens, T1, T2 = (8, 5, 2, 0), 10, 8
    B = len(lens)
    x1 = torch.randn(B, T1, D_MODEL, dtype=torch.float64)
    x2 = torch.randn(B, T2, D_MODEL, dtype=torch.float64)
    steps = torch.randn(B, 2, D_MODEL, dtype=torch.float64)
    mask = torch.ones(B, T1 + T2, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, T1 + n:] = 0
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(x1, past_key_values=cache)
        y2 = layer(x2, attention_mask=mask, past_key_values=cache)
        conv_state = cache.conv_states[0].clone()
        y_dec = [layer(steps[:, i:i + 1], past_key_values=cache) for i in range(2)]
        for b, n in enumerate(lens):
            alone = GatedDeltaNetCache()
            layer(x1[b:b + 1], past_key_values=alone)
            y_alone = layer(x2[b:b + 1, :n], past_key_values=alone)
            assert torch.allclose(y2[b, :n], y_alone[0], rtol=0, atol=1e-11), b
            assert (y2[b, n:] == 0).all()
            assert torch.allclose(conv_state[b], alone.conv_states[0][0], rtol=1e-13,
                                  atol=1e-13), b
            for i in range(2):
                y_alone_dec = layer(steps[b:b + 1, i:i + 1], past_key_values=alone)
                assert (y_dec[i][b] - y_alone_dec[0]).abs().max().item() < 1e-11, (b, i)


def test_padded_decode_token_leaves_the_row_as_it_was():
    """A single-token step in which one row's token is padding (mask 0), then plain decode:
    that row equals its tokens run alone, without the padded step, and the other row is
    untouched (the new-user trial of session 21 found the padded step had appended a zero
    column to the row's conv window: decode off by 107 %)."""
    layer = make_layer()
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    steps = torch.randn(2, 3, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(x, past_key_values=cache)
        y = [layer(steps[:, :1], attention_mask=torch.tensor([[1], [0]]), past_key_values=cache)]
        y += [layer(steps[:, i:i + 1], past_key_values=cache) for i in (1, 2)]
        assert (y[0][1] == 0).all()
        for b, cols in ((0, (0, 1, 2)), (1, (1, 2))):
            alone = GatedDeltaNetCache()
            layer(x[b:b + 1], past_key_values=alone)
            for i in cols:
                y_alone = layer(steps[b:b + 1, i:i + 1], past_key_values=alone)
                assert (y[i][b] - y_alone[0]).abs().max().item() < 1e-11, (b, i)


def test_padding_inside_a_row_is_taken_out_of_the_conv():
    """Padding anywhere in a row: a left-padded continuation of a cache (batched follow-up
    turns), and padding in the middle of a prompt, each equal to the row's tokens run alone,
    and so do the decode steps after them. The conv used to read the padding's zeros where
    the cached context or the row's earlier tokens belong (0.3–1.3 off: new-user trial,
    session 14; Hugging Face's layer is off there too)."""
    layer = make_layer()
    x = torch.randn(3, 12, D_MODEL, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1],
                         [1, 1, 0, 1, 0, 1, 1, 0, 0, 1, 0, 1],
                         [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1]])
    step = torch.randn(3, 1, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        whole = layer(x, attention_mask=mask)
        cache = GatedDeltaNetCache()
        layer(x[:, :5], attention_mask=mask[:, :5], past_key_values=cache)
        rest = layer(x[:, 5:], attention_mask=mask, past_key_values=cache)
        window = cache.conv_states[0]  # a copy, not a view keeping the call's whole input
        assert window.untyped_storage().nbytes() == window.numel() * window.element_size()
        after = layer(step, past_key_values=cache)
        for b in range(3):
            keep = mask[b].bool()
            alone_cache = GatedDeltaNetCache()
            alone = layer(x[b:b + 1, keep], past_key_values=alone_cache)[0]
            assert (whole[b, keep] - alone).abs().max().item() < 1e-11, b
            assert (whole[b, ~keep] == 0).all()
            assert (rest[b, keep[5:]] - alone[keep[:5].sum():]).abs().max().item() < 1e-11, b
            assert (after[b] - layer(step[b:b + 1], past_key_values=alone_cache)[0]
                    ).abs().max().item() < 1e-11, b


def test_left_padding_does_not_leak():
    """Two left-padded prompts (random junk in the padding) == the prompts run alone, in the
    output, in the cached states, and in the decode steps that follow."""
    layer = make_layer()
    lens, T = (23, 9), 23
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64) * 5
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, T - n:] = 1
    steps = torch.randn(2, 3, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        y, state, conv_state, y_dec = _padded_prefill_and_decode(layer, x, mask, steps)
        for b, n in enumerate(lens):
            alone_cache = GatedDeltaNetCache()
            y_alone = layer(x[b:b + 1, T - n:], past_key_values=alone_cache)
            assert (y[b, T - n:] - y_alone[0]).abs().max().item() < 1e-11
            assert (y[b, :T - n] == 0).all()
            assert (state[b] - alone_cache.recurrent_states[0][0]).abs().max() < 1e-11
            assert torch.allclose(conv_state[b], alone_cache.conv_states[0][0], rtol=1e-13,
                                  atol=1e-13)
            for i in range(3):
                y_alone_dec = layer(steps[b:b + 1, i:i + 1], past_key_values=alone_cache)
                assert (y_dec[i][b] - y_alone_dec[0]).abs().max().item() < 1e-11
    # an all-ones mask and a longer mask (HF passes the trailing columns) change nothing
    y_ref = reference_layer(layer, x, mask.bool())
    assert (y - y_ref).abs().max().item() < 1e-10
    wide = torch.cat([torch.zeros(2, 5, dtype=torch.long), mask], 1)
    assert torch.equal(layer(x, attention_mask=wide), layer(x, attention_mask=mask))
    assert torch.equal(layer(x, attention_mask=torch.ones(2, T, dtype=torch.bool)), layer(x))


@pytest.mark.parametrize("backend", ["torch", "materialized"])
def test_non_finite_padding_does_not_reach_tokens(backend):
    """Whatever the padded positions hold (NaN, inf, or fp16 values whose projection
    overflows), the tokens' outputs are those of zeros there, left and right padding. The
    mask used to multiply the projection (inf · 0 = NaN, carried into tokens by the conv and
    by the chunk products: new-user trial, session 14)."""
    interpreted = triton_interpreted()
    if backend != "torch" and not torch.cuda.is_available() and not interpreted:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    # (the interpreter takes CPU tensors, also on a machine with a GPU)
    device = "cuda" if backend != "torch" and torch.cuda.is_available() and not interpreted \
        else "cpu"
    layer = make_layer(torch.float16, backend=backend, chunk_size=64).to(device)
    T = 40
    x = torch.randn(2, T, D_MODEL, device=device).half()
    for pad in (slice(30, T), slice(0, 7)):  # right, left
        mask = torch.ones(2, T, dtype=torch.long, device=device)
        mask[0, pad] = 0
        with torch.no_grad():
            clean = x.clone()
            clean[0, pad] = 0
            ref = layer(clean, attention_mask=mask)
            assert ref.isfinite().all()
            for junk in (6e4, float("nan"), float("inf")):
                dirty = x.clone()
                dirty[0, pad] = junk
                y = layer(dirty, attention_mask=mask)
                assert torch.equal(y, ref), (pad, junk)


def test_packed_sequences_match_separate_runs():
    layer = make_layer()
    cu = torch.tensor([0, 7, 7, 29, 40], dtype=torch.int32)
    x = torch.randn(1, 40, D_MODEL, dtype=torch.float64)
    y = layer(x, cu_seqlens=cu)
    y_hf = layer(x, cu_seq_lens_q=cu.long())  # Hugging Face's keyword
    assert torch.equal(y, y_hf)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            assert (y[:, s:e] - layer(x[:, s:e])).abs().max().item() < 1e-11
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(x, cu_seqlens=cu, past_key_values=GatedDeltaNetCache())


@pytest.mark.parametrize("cu,exc,match", [
    ([0, 20], TypeError, "cu_seqlens must be a torch.Tensor"),
    (torch.tensor([0, 20.]), TypeError, "cu_seqlens must be int32 or int64"),
    (torch.tensor([0, 12, 8, 20]), ValueError, "cu_seqlens must be non-decreasing"),
])
def test_packed_sequences_bad_cu_seqlens_raise_the_ops_error_first(cu, exc, match):
    x = torch.randn(1, 20, D_MODEL, dtype=torch.float64)
    for key in ("cu_seqlens", "cu_seq_lens_q"):
        with pytest.raises(exc, match=match):
            make_layer()(x, **{key: cu})


EXTREMES = [-3e38, -1e4, -150.0, -20.0, 0.0, 20.0, 89.0, 1e4, 3e38]


def test_decay_finite_for_extreme_inputs():
    A_log = torch.tensor(EXTREMES, requires_grad=True)
    dt_bias = torch.tensor(EXTREMES, requires_grad=True)
    a = torch.tensor(EXTREMES)[:, None, None].expand(len(EXTREMES), 4, len(EXTREMES)).clone()
    a = a.reshape(-1, len(EXTREMES)).requires_grad_(True)
    # every combination of A_log (last dim, broadcast), a and dt_bias
    g = torch.stack([gdn_decay(A_log, a, dt_bias.roll(s)) for s in range(len(EXTREMES))])
    assert torch.isfinite(g).all()
    assert (g <= 0).all() and (g >= LOG_DECAY_MIN).all()
    g.sum().backward()
    for t in (A_log, dt_bias, a):
        assert torch.isfinite(t.grad).all()
    # in fp16 / bf16 inputs as well (computed in fp32)
    for dtype in (torch.float16, torch.bfloat16):
        big = torch.finfo(dtype).max
        vals = torch.tensor([-big, -1e3, 0.0, 1e3, big], dtype=dtype)
        gg = gdn_decay(vals[:, None], vals[None, :], vals[:, None])
        assert gg.dtype == torch.float32 and torch.isfinite(gg).all()


def test_decay_matches_plain_formula_in_normal_range():
    A_log = torch.randn(8) * 2
    dt_bias = torch.randn(8)
    a = torch.randn(5, 8) * 4
    plain = -A_log.exp() * F.softplus(a + dt_bias)
    # bitwise equal to Hugging Face's formula; only decays past LOG_DECAY_MIN are clamped
    assert torch.equal(gdn_decay(A_log, a, dt_bias), plain.clamp(min=LOG_DECAY_MIN))
    assert (plain > LOG_DECAY_MIN).float().mean() > 0.9


def test_module_finite_with_extreme_decay_parameters():
    layer = make_layer(torch.float32)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([1e4, -1e4, 3e38, 0.0]))
        layer.dt_bias.copy_(torch.tensor([3e38, -3e38, -3e38, 3e38]))
    x = torch.randn(2, 20, D_MODEL, requires_grad=True)
    y = layer(x)
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs,name", [
    ({"d_model": 0}, "d_model"),
    ({"num_heads": 3, "num_v_heads": 4}, "num_v_heads"),
    ({"num_v_heads": 0}, "num_v_heads"),
    ({"head_k_dim": 512}, "head_k_dim"),
    ({"head_v_dim": 1.5}, "head_v_dim"),
    ({"conv_size": 0}, "conv_size"),
    ({"use_short_conv": 1}, "use_short_conv"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"norm_eps": float("inf")}, "norm_eps"),  # accepted before session 13: outputs all 0
    ({"dtype": torch.int32}, "dtype"),
    ({"layer_idx": -1}, "layer_idx"),
    ({"backend": "cuda"}, "backend"),
    ({"chunk_size": 48}, "chunk_size"),
    ({"solve_method": "lu"}, "solve_method"),
    ({"solve_iters": -1}, "solve_iters"),
])
def test_constructor_rejects_bad_arguments(kwargs, name):
    args = {"d_model": 32, "num_heads": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        GatedDeltaNet(**args)


def test_forward_rejects_bad_inputs():
    layer = make_layer()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    with pytest.raises(ValueError, match="use_cache"):
        layer(x, use_cache=True)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[..., :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(2, 1, 5, 5))
    with pytest.raises(TypeError, match="attention_mask"):
        layer(x, attention_mask=[[1] * 5] * 2)
    with pytest.raises(TypeError, match="hidden_states"):
        layer(x.tolist())
    with pytest.raises(TypeError, match="hidden_states must have the layer's dtype "
                                        "torch.float64"):
        layer(x.float())
    with pytest.raises(TypeError, match="past_key_values"):
        layer(x, past_key_values=object())
    with pytest.raises(ValueError, match="layer_idx"):
        make_layer(layer_idx=None)(x, past_key_values=GatedDeltaNetCache())
    cache = GatedDeltaNetCache()
    layer(x, past_key_values=cache)
    with pytest.raises(ValueError, match="batch size"):
        layer(x[:1], past_key_values=cache)
    with pytest.raises(ValueError, match="once"):
        layer(x, past_key_values=cache, cache=GatedDeltaNetCache())


def test_other_input_dtype_runs_under_autocast_only():
    layer = GatedDeltaNet(32, 2, head_k_dim=16, head_v_dim=16, backend="torch")
    x = torch.randn(1, 20, 32, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="hidden_states must have the layer's dtype"):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(layer(x)).all()


def test_standalone_init_is_sane():
    """A freshly constructed layer: decays in the Mamba-2 range, finite output of unit scale."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, head_k_dim=16, head_v_dim=16, backend="torch")
    A = layer.A_log.exp()
    dt = F.softplus(layer.dt_bias)
    assert (A >= 1 - 1e-5).all() and (A <= 16 + 1e-4).all()
    assert (dt >= 1e-3 * (1 - 1e-4)).all() and (dt <= 0.1 * (1 + 1e-4)).all()
    y = layer(torch.randn(2, 50, 64))
    assert torch.isfinite(y).all() and 1e-3 < y.std().item() < 10
    assert math.isclose(layer.norm.eps, 1e-6)


def test_reset_parameters_after_a_meta_build():
    """Built on the meta device and moved with to_empty, the memory holds no values;
    reset_parameters draws them as the constructor does (the decay in its init ranges, the
    norm's ones), so the output is that of a freshly constructed layer's kind."""
    with torch.device("meta"):
        layer = GatedDeltaNet(64, 2, 4, head_k_dim=16, head_v_dim=16, backend="torch")
    layer = layer.to_empty(device="cpu")
    for p in layer.parameters():
        p.data.fill_(3.3e31)  # what to_empty's memory may hold
    torch.manual_seed(0)
    layer.reset_parameters()
    A, dt = layer.A_log.exp(), F.softplus(layer.dt_bias)
    assert (A >= 1 - 1e-5).all() and (A <= 16 + 1e-4).all()
    assert (dt >= 1e-3 * (1 - 1e-4)).all() and (dt <= 0.1 * (1 + 1e-4)).all()
    assert torch.equal(layer.norm.weight, torch.ones_like(layer.norm.weight))
    assert all(p.abs().max() < 10 for p in layer.parameters())
    y = layer(torch.randn(2, 50, 64))
    assert torch.isfinite(y).all() and 1e-3 < y.std().item() < 10


def test_cache_detach_between_truncated_backprop_steps():
    """Chunks of a stream through one cache, a backward each (truncated backpropagation
    through time): the second backward reaches into the first step's freed graph unless the
    cache is detached between them; detached, each step's gradient is that of the step run
    from the stored state as a constant."""
    layer = make_layer(torch.float64)
    x = torch.randn(2, 30, layer.d_model, dtype=torch.float64)
    cache = GatedDeltaNetCache()
    layer(x[:, :15], past_key_values=cache).square().sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        layer(x[:, 15:], past_key_values=cache).square().sum().backward()
    cache = GatedDeltaNetCache()
    layer(x[:, :15], past_key_values=cache).square().sum().backward()
    assert cache.detach_() is cache
    assert not any(t.requires_grad for d in (cache.conv_states, cache.recurrent_states)
                   for t in d.values())
    frozen = {n: {i: t.clone() for i, t in d.items()}
              for n, d in (("conv", cache.conv_states), ("rec", cache.recurrent_states))}
    layer.zero_grad()
    layer(x[:, 15:], past_key_values=cache).square().sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    again = GatedDeltaNetCache()
    again.conv_states, again.recurrent_states = frozen["conv"], frozen["rec"]
    layer.zero_grad()
    layer(x[:, 15:], past_key_values=again).square().sum().backward()
    assert all(torch.allclose(a, p.grad, rtol=1e-12, atol=0) for a, p in
               zip(got, layer.parameters()))


@pytest.mark.parametrize("backend", ["materialized", "fused"])
def test_triton_backends_match_torch_backend(backend):
    """Prefill, a decode step (Triton recurrent kernel) and a continuation through the Triton
    chunk path equal the torch backend (on CPU the kernels run under TRITON_INTERPRET=1, which
    tests/conftest.py sets)."""
    if not torch.cuda.is_available() and not triton_interpreted():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    # (the interpreter takes CPU tensors, also on a machine with a GPU)
    device = "cuda" if torch.cuda.is_available() and not triton_interpreted() else "cpu"
    # head dims 64: sizes the fused kernel takes, so "fused" is not materialized again
    dims = dict(head_k_dim=64, head_v_dim=64)
    ref = make_layer(torch.float32, backend="torch", **dims).to(device)
    tri = make_layer(torch.float32, backend=backend, **dims).to(device)
    assert resolve_backend(backend, torch.zeros(1, 1, 1, 64, device=device),
                           torch.zeros(1, 1, 1, 64, device=device), 16) == backend
    x = torch.randn(2, 38, D_MODEL, device=device)
    caches = GatedDeltaNetCache(), GatedDeltaNetCache()
    with torch.no_grad():
        for s, e in ((0, 20), (20, 21), (21, 38)):
            a, b = (layer(x[:, s:e], past_key_values=c) for layer, c in zip((ref, tri), caches))
            assert (a - b).abs().max().item() < 1e-5 * a.abs().max().item(), (s, e)
    assert (caches[0].recurrent_states[0] - caches[1].recurrent_states[0]).abs().max() < 1e-5


def test_empty_sequence_leaves_the_cache_alone():
    layer = make_layer()
    cache = GatedDeltaNetCache()
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    layer(x, past_key_values=cache, use_cache=True)
    conv, state = cache.conv_states[0].clone(), cache.recurrent_states[0].clone()
    y = layer(x[:, :0], past_key_values=cache, use_cache=True)
    assert y.shape == (2, 0, D_MODEL)
    assert torch.equal(cache.conv_states[0], conv) and torch.equal(cache.recurrent_states[0], state)
