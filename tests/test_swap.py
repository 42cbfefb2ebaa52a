"""Qwen3-Next / Qwen3.5 layer swap: tiny random configs of the real transformers classes, fp32,
CPU, offline. The unswapped model (transformers' torch fallback) is the reference."""
import copy

import pytest
import torch
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

from gdn_fused.layer import GatedDeltaNet
from gdn_fused.models import hf_state_dict, load_swapped, swap_gated_deltanet
from gdn_fused.models.hf_calls import cache_kwarg, output_cache
from gdn_fused.models.swap import QWEN3_5_CLASSES

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
FAMILIES = {
    # 3 linear-attention layers then one full-attention layer in each
    "qwen3_next": (Qwen3NextForCausalLM, lambda: Qwen3NextConfig(**COMMON, **MOE)),
    "qwen3_5": (Qwen3_5ForCausalLM, lambda: Qwen3_5TextConfig(**COMMON)),
    "qwen3_5_moe": (Qwen3_5MoeForCausalLM, lambda: Qwen3_5MoeTextConfig(**COMMON, **MOE)),
}
LOGIT_ATOL = 1e-3  # fp32; measured max abs diff ≈ 2e-5 … 3e-4 for logits of magnitude ~5


def tiny_model(family, seed=0):
    """A real HF model with every weight random at unit-ish scale, so logits spread over O(1)
    and greedy decoding is not a tie-break; decays random in a moderate range."""
    cls, config = FAMILIES[family]
    torch.manual_seed(seed)
    model = cls(config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.normal_(-1.0, 1.0)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.normal_(0.0, 0.3)
    return model


def swapped_copy(model, **kwargs):
    ours = copy.deepcopy(model)
    assert swap_gated_deltanet(ours, backend="torch", chunk_size=16, **kwargs) == 3
    return ours


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    hf = tiny_model(request.param)
    return request.param, hf, swapped_copy(hf)


def test_swap_replaces_every_layer_and_shares_weights(pair):
    _, hf, ours = pair
    for hf_layer, layer in zip(hf.model.layers, ours.model.layers):
        if not hasattr(hf_layer, "linear_attn"):
            continue
        mine, theirs = layer.linear_attn, hf_layer.linear_attn
        assert isinstance(mine, GatedDeltaNet) and mine.layer_idx == theirs.layer_idx
        for name in ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"):
            assert torch.equal(mine.get_parameter(name), theirs.get_parameter(name)), name
    n_hf = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in ours.parameters()) == n_hf
    assert swap_gated_deltanet(ours) == 0  # nothing left to swap


def test_swap_reuses_parameter_objects():
    hf = tiny_model("qwen3_5")
    conv = hf.model.layers[0].linear_attn.conv1d.weight
    swap_gated_deltanet(hf, backend="torch")
    assert hf.model.layers[0].linear_attn.conv1d.weight is conv


def test_in_proj_layout_matches_hf_split(pair):
    """Our fused in_proj rows give exactly HF's q, k, v, z, b, a (Qwen3-Next: after
    fix_query_key_value_ordering's de-interleave)."""
    family, hf, ours = pair
    theirs, mine = hf.model.layers[0].linear_attn, ours.model.layers[0].linear_attn
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        if family == "qwen3_next":  # interleaved per q/k head
            q, k, v, z, b, a = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(x),
                                                                   theirs.in_proj_ba(x))
        else:
            q, k, v = theirs.in_proj_qkv(x).split([theirs.key_dim, theirs.key_dim,
                                                   theirs.value_dim], -1)
            z, b, a = theirs.in_proj_z(x), theirs.in_proj_b(x), theirs.in_proj_a(x)
        expected = torch.cat([t.reshape(2, 5, -1) for t in (q, k, v, z, b, a)], -1)
        assert torch.allclose(mine.in_proj(x), expected, rtol=1e-6, atol=1e-6)


def test_logits_match_hf_fallback(pair):
    family, hf, ours = pair
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 150))  # > 2 chunks of 64 in HF's fallback, 10 of ours
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids).logits
    diff = (got - ref).abs().max().item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{family} fp32 logits: max abs diff {diff:.2e} (max |logit| "
          f"{ref.abs().max().item():.2f}), top-1 agreement {top1:.2%}")
    assert diff < LOGIT_ATOL
    assert top1 == 1.0


def test_greedy_generate_identical(pair):
    _, hf, ours = pair
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 12))
    kw = dict(max_new_tokens=20, do_sample=False, min_new_tokens=20)
    ref = hf.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert ref.shape == (2, 32)
    assert torch.equal(got, ref)
    assert len(set(ref[0, 12:].tolist())) > 3  # a real continuation, not one repeated token


def test_beam_search_identical(pair):
    """Beam search reorders HF's cache (conv and recurrent states) between steps."""
    _, hf, ours = pair
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (2, 10))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=3)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


def test_prefill_then_decode_with_hf_cache(pair):
    """Our layers in HF's own cache: prefill T−k tokens, then k single-token steps and one
    multi-token continuation; logits equal a one-shot forward of all T tokens."""
    family, hf, ours = pair
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 60))
    with torch.no_grad():
        full = ours(ids).logits
        out = ours(ids[:, :40], use_cache=True)
        cache = output_cache(out)
        logits = [out.logits]
        with_cache = {cache_kwarg(ours): cache, "use_cache": True}
        for t in range(40, 45):
            out = ours(ids[:, t:t + 1], **with_cache)
            logits.append(out.logits)
        out = ours(ids[:, 45:], **with_cache)  # 15 tokens at once
        logits.append(out.logits)
        steps = torch.cat(logits, 1)
        # the state lives in HF's cache, fp32 [B, HV, K, V]
        layer = cache.layers[0]
        state = layer.recurrent_states[0]
        assert state.dtype == torch.float32 and state.shape == (2, 4, 16, 8)
        assert layer.conv_states[0].shape == (2, 2 * 2 * 16 + 4 * 8, 4)
        # HF's unswapped layers continue from a cache our layers filled: same layout
        our_cache = output_cache(ours(ids[:, :40], use_cache=True))
        ref_next = hf(ids[:, 40:41], use_cache=True, **{cache_kwarg(hf): our_cache}).logits
    diff = (steps - full).abs().max().item()
    print(f"{family}: one-shot vs prefill+decode logits: max abs diff {diff:.2e}")
    assert diff < LOGIT_ATOL
    assert (logits[1] - ref_next).abs().max().item() < LOGIT_ATOL


def test_left_padded_batch_equals_prompts_alone(pair):
    _, hf, ours = pair
    torch.manual_seed(4)
    lens = (21, 13)
    prompts = [torch.randint(3, VOCAB, (1, n)) for n in lens]
    T = max(lens)
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - p.shape[1]:] = p[0]
        mask[b, T - p.shape[1]:] = 1
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask).logits
        hf_batch = hf(ids, attention_mask=mask).logits
        for b, p in enumerate(prompts):
            alone = ours(p).logits[0]
            n = p.shape[1]
            assert (batch[b, T - n:] - alone).abs().max().item() < LOGIT_ATOL
            assert (batch[b, T - n:] - hf_batch[b, T - n:]).abs().max().item() < LOGIT_ATOL
    gen = ours.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(gen, hf.generate(ids, attention_mask=mask, **kw))
    for b, p in enumerate(prompts):
        assert torch.equal(gen[b, T:], ours.generate(p, **kw)[0, p.shape[1]:])


def test_load_swapped_from_local_checkpoint(tmp_path):
    hf = tiny_model("qwen3_next")
    hf.save_pretrained(tmp_path)
    model = load_swapped(tmp_path, backend="torch", dtype=torch.float32, device="cpu",
                         chunk_size=32)
    layer = model.model.layers[0].linear_attn
    assert isinstance(layer, GatedDeltaNet) and layer.chunk_size == 32 and not model.training
    ids = torch.randint(3, VOCAB, (1, 40))
    with torch.no_grad():
        assert (model(ids).logits - hf(ids).logits).abs().max().item() < LOGIT_ATOL
    with pytest.raises(ValueError, match="directory"):
        load_swapped(tmp_path / "missing")


def test_swapped_model_saves_in_hf_layout(pair, tmp_path):
    """hf_state_dict of a swapped model is the unswapped model's state dict (keys and values):
    save_pretrained with it writes a checkpoint transformers loads as its own, and
    load_swapped swaps again. The model's own state dict keeps our fused in_proj (training
    tools write through it); a checkpoint saved from that, which transformers would load with
    random projections (new-user trial, session 14), is refused by load_swapped."""
    family, hf, ours = pair
    mine, theirs = hf_state_dict(ours), hf.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[key], theirs[key]) for key in theirs)
    assert "model.layers.0.linear_attn.in_proj.weight" in ours.state_dict()
    ids = torch.randint(3, VOCAB, (1, 40))
    ours.save_pretrained(tmp_path / "hf", state_dict=mine)
    cls, _ = FAMILIES[family]
    with torch.no_grad():
        reference = hf(ids).logits
        assert torch.equal(cls.from_pretrained(tmp_path / "hf").eval()(ids).logits, reference)
        again = load_swapped(tmp_path / "hf", backend="torch", dtype=torch.float32,
                             chunk_size=16)
        assert (again(ids).logits - reference).abs().max().item() < LOGIT_ATOL
    ours.save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match="saved from a swapped model"):
        load_swapped(tmp_path / "ours")


def test_swap_rejects_bad_arguments_before_replacing():
    hf = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="chunk_size"):
        swap_gated_deltanet(hf, chunk_size=48)
    with pytest.raises(ValueError, match="backend"):
        swap_gated_deltanet(hf, backend="fla")
    assert not any(isinstance(m, GatedDeltaNet) for m in hf.modules())


def test_swap_checks_every_layer_before_replacing_any_and_frees_the_originals(monkeypatch):
    """A bad last layer stops the swap before the first layer is replaced; a good swap leaves
    no reference to the replaced modules (their input projections are freed layer by layer)."""
    import gc
    import weakref
    hf = tiny_model("qwen3_5")
    originals = [m for m in hf.modules() if type(m).__name__ in QWEN3_5_CLASSES]
    assert len(originals) > 1
    originals[-1].out_proj.bias = torch.nn.Parameter(torch.zeros(originals[-1].hidden_size))
    with pytest.raises(ValueError, match="biases"):
        swap_gated_deltanet(hf)
    assert not any(isinstance(m, GatedDeltaNet) for m in hf.modules())
    originals[-1].out_proj.bias = None
    refs = [weakref.ref(m) for m in originals]
    del originals
    import gdn_fused.models.swap as swap_module
    build, alive_at_build = swap_module.gated_deltanet_from_hf, []

    def counting_build(module, *args):
        alive_at_build.append(sum(r() is not None for r in refs))
        return build(module, *args)

    monkeypatch.setattr(swap_module, "gated_deltanet_from_hf", counting_build)
    assert swap_gated_deltanet(hf) == len(refs)
    # building layer i ≥ 1, the i layers before it are already freed (all at once: n each)
    assert alive_at_build == [len(refs) - i for i in range(len(refs))]
    gc.collect()
    assert all(r() is None for r in refs)


def test_swap_passes_solver_options_to_the_chunk_op(monkeypatch):
    import gdn_fused.layer as layer_module

    seen = []
    op = layer_module.chunk_gated_delta_rule

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("backend", "chunk_size", "solve_method",
                                             "solve_iters")})
        return op(*args, **kwargs)

    monkeypatch.setattr(layer_module, "chunk_gated_delta_rule", spy)
    hf = tiny_model("qwen3_5")
    ids = torch.randint(3, VOCAB, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits
        swap_gated_deltanet(hf, backend="torch", chunk_size=32, solve_method="newton_schulz",
                            solve_iters=12)
        got = hf(ids).logits
    assert seen == [{"backend": "torch", "chunk_size": 32, "solve_method": "newton_schulz",
                     "solve_iters": 12}] * 3
    assert (got - ref).abs().max().item() < LOGIT_ATOL


def test_padded_decode_token_in_hf_cache(pair):
    """Our layer called on its own with HF's cache and a single-token step in which one row's
    token is padding: it leaves that row's conv window and recurrent state as the prefill
    left them (the window put back, not shifted by a zero column) and moves the other row's.
    (HF's models pass no mask to linear attention in decode, so through the model a decode
    token is never padding.)"""
    _, _, ours = pair
    torch.manual_seed(6)
    with torch.no_grad():
        cache = output_cache(ours(torch.randint(3, VOCAB, (2, 12)), use_cache=True))
        i = next(i for i, layer in enumerate(ours.model.layers)
                 if hasattr(layer, "linear_attn"))
        layer = ours.model.layers[i].linear_attn
        before = (cache.layers[i].conv_states[0].clone(),
                  cache.layers[i].recurrent_states[0].clone())
        x = torch.randn(2, 1, ours.config.hidden_size)
        layer(x, attention_mask=torch.tensor([[1], [0]]), **{cache_kwarg(ours): cache})
        window, state = cache.layers[i].conv_states[0], cache.layers[i].recurrent_states[0]
        assert torch.equal(window[1], before[0][1]) and torch.equal(state[1], before[1][1])
        assert not torch.equal(window[0], before[0][0])
        assert not torch.equal(state[0], before[1][0])


def test_right_padded_chunked_prefill_in_hf_cache(pair):
    """A right-padded batch prefilled in two chunks through HF's cache (transformers passes
    the mask with a cached continuation): each row's second-chunk logits equal the row run
    alone (review of session 13: a conv that rolled the padding to the front read zeros
    there), and each Gated DeltaNet layer's cached conv window ends at the row's last token,
    as the row alone leaves it (a row ending in the first chunk keeps its window)."""
    _, hf, ours = pair
    torch.manual_seed(5)
    lens, T, c = (24, 19, 12), 24, 16
    ids = torch.randint(3, VOCAB, (3, T))
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
        ids[b, n:] = 0
    with torch.no_grad():
        out = ours(ids[:, :c], attention_mask=mask[:, :c], use_cache=True)
        out2 = ours(ids[:, c:], attention_mask=mask, use_cache=True,
                    **{cache_kwarg(ours): output_cache(out)})
        cache = output_cache(out2)
        for b, n in enumerate(lens):
            alone = ours(ids[b:b + 1, :n], use_cache=True)
            if n > c:
                diff = (out2.logits[b, :n - c] - alone.logits[0, c:n]).abs().max().item()
                assert diff < LOGIT_ATOL, (b, diff)
            for i, layer in enumerate(ours.model.layers):
                if hasattr(layer, "linear_attn"):
                    window = cache.layers[i].conv_states[0][b]
                    alone_window = output_cache(alone).layers[i].conv_states[0][0]
                    assert torch.allclose(window, alone_window, atol=1e-4), (b, i)
