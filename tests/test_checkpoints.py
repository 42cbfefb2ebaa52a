"""The backward's recompute split at the forward's state checkpoints (kernels/chunk_state.py).

A forward at small B·HV stores the fp32 state entering every SEGMENT_CHUNKS-th chunk; the
backward's chunk_state then runs each sequence's segments side by side, each from its
checkpoint. Given the states the unsplit pass carries (here: its own h, stored in fp32 for
fp32 data), the split pass must give the same bits, and so must the whole backward. CPU,
Triton interpreter, fp32; chunk 16 and segments of 2 chunks so that short sequences have
several segments.
"""
import pytest
import torch

from gdn_fused.eval.cases import make_inputs, rel_err
from gdn_fused.kernels import chunk_bwd
from gdn_fused.kernels import chunk_state as module
from gdn_fused.kernels.chunk_bwd import chunk_gated_delta_rule_bwd
from gdn_fused.kernels.chunk_gate import chunk_cumsum
from gdn_fused.kernels.chunk_index import chunk_layout
from gdn_fused.kernels.chunk_state import chunk_state
from gdn_fused.kernels.kkt_solve import chunk_inverse
from gdn_fused.kernels.wu import recompute_w_u

C, EVERY = 16, 2
CASES = [  # (id, B, T, H, HV, cu_seqlens); chunks of 16, segments of 2 chunks
    ("dense-partial", 2, 100, 1, 2, None),
    # sequences of 2 chunks (exactly one segment), 0 (empty), 5 and 1 (a partial chunk)
    ("varlen-empty", 1, 100, 1, 3, [0, 20, 20, 85, 100]),
]


def state_pass(case, gate="normal", chain_t=False):
    """Inputs of chunk_state for a case (fp32): (k, W, U, G, h0, None), or with ``chain_t``
    (k, T, v, G, h0, beta), the chain form; and the layout (N, chunk_offsets, idx)."""
    _, B, T, H, HV, cu = case
    N = len(cu) - 1 if cu is not None else B
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 32, 16, torch.float32, gate, "uniform",
                                       True, N, "cpu", chunk_size=C)
    cu_t = torch.tensor(cu) if cu is not None else None
    N, offsets, idx = chunk_layout(cu_t, B, C)
    G = chunk_cumsum(g, C, **idx)
    Ai = chunk_inverse(k, G, beta, HV, C, torch.float32, **idx)
    if chain_t:
        return (k, Ai, v, G, h0, beta), (N, offsets, idx, cu_t)
    w, u = recompute_w_u(k, v, G, beta, Ai, **idx)
    return (k, w, u, G, h0, None), (N, offsets, idx, cu_t)


def checkpoints_of(h, case, N, HV, every=EVERY):
    """[n, N, HV, K, V] fp32: the states entering chunks every, 2·every, … of each sequence,
    read from an unsplit pass's h; NaN where a sequence has no such chunk (never read)."""
    _, B, T, _, _, cu = case
    lens = [cu[i + 1] - cu[i] for i in range(N)] if cu is not None else [T] * B
    chunks = [-(-n // C) for n in lens]
    first = [sum(chunks[:i]) for i in range(N)]
    n = -(-max(chunks) // every) - 1
    out = torch.full((n, N, HV) + tuple(h.shape[2:]), float("nan"))
    for s in range(n):
        for i in range(N):
            if (s + 1) * every < chunks[i]:
                out[s, i] = h[first[i] + (s + 1) * every]
    return out


@pytest.mark.parametrize("chain_t", [False, True], ids=["w_u", "chain_t"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_recompute_equals_the_unsplit_pass(case, chain_t):
    (k, w, u, G, h0, beta), (N, offsets, idx, cu_t) = state_pass(case, chain_t=chain_t)
    kw = dict(cu_seqlens=cu_t, chunk_offsets=offsets, num_chunks=idx["num_chunks"], beta=beta)
    h, v_new, ht = chunk_state(k, w, u, G, h0, True, C, N, **kw)
    ckpt = checkpoints_of(h, case, N, u.shape[2])
    h_s, v_s, ht_s = chunk_state(k, w, u, G, h0, True, C, N, checkpoints=ckpt,
                                 segment_chunks=EVERY, **kw)
    assert ckpt.shape[0] >= 2  # several segments a sequence
    assert torch.equal(h_s, h) and torch.equal(ht_s, ht)
    if chain_t:
        # the chain form computes the W/U form's states (fp32 here: to rounding)
        (k, w, u, G, h0, _), _ = state_pass(case)
        h_wu, v_wu, ht_wu = chunk_state(k, w, u, G, h0, True, C, N, **dict(kw, beta=None))
        assert rel_err(h, h_wu) <= 1e-5 and rel_err(ht, ht_wu) <= 1e-5
    if cu_t is None:
        assert torch.equal(v_s, v_new)
    else:  # rows past cu_seqlens[-1] are never written by either pass
        end = case[5][-1]
        assert torch.equal(v_s[:, :end], v_new[:, :end])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_from_checkpoints_equals_the_backward_without(case, monkeypatch):
    """The whole backward with the forward's checkpoints (segments of EVERY chunks) gives the
    bits it gives without them, in the g = 0 regime too (no decay to forget the state). The
    checkpoints are the states of an unsplit pass in the backward's own form (chunk_bwd.CHAIN_T)."""
    for gate in ("normal", "zero"):
        (k, w, u, G, h0, beta), (N, offsets, idx, cu_t) = state_pass(case, gate,
                                                                     chunk_bwd.CHAIN_T)
        h, _, _ = chunk_state(k, w, u, G, h0, False, C, N, cu_seqlens=cu_t,
                              chunk_offsets=offsets, num_chunks=idx["num_chunks"], beta=beta)
        ckpt = checkpoints_of(h, case, N, u.shape[2])
        _, B, T, H, HV, cu = case
        q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 32, 16, torch.float32, gate,
                                           "uniform", True, N, "cpu", chunk_size=C)
        gen = torch.Generator().manual_seed(2)
        do = torch.randn(B, T, HV, 16, generator=gen)
        dht = torch.randn(N, HV, 32, 16, generator=gen)
        args = (q, k, v, g, beta, 0.2, h0, do, dht, cu_t, C)
        plain = chunk_gated_delta_rule_bwd(*args)
        monkeypatch.setattr(module, "SEGMENT_CHUNKS", EVERY)
        split = chunk_gated_delta_rule_bwd(*args, checkpoints=ckpt)
        monkeypatch.undo()
        for a, b in zip(split, plain):
            assert torch.equal(a, b)


def test_checkpoints_of_another_shape_raise():
    """A wrong shape, dtype, layout or count (7 chunks in segments of 2 need exactly 3: fewer
    would leave chunks uncomputed) and a bad segment length raise before any launch."""
    case = CASES[0]
    (k, w, u, G, h0, _), (N, offsets, idx, _) = state_pass(case)
    good = torch.zeros(3, N, u.shape[2], 32, 16)
    chunk_state(k, w, u, G, h0, False, C, N, checkpoints=good, segment_chunks=EVERY)
    for bad in (good[:, :1], good.double(), good.transpose(3, 4), good[:2], good[:0],
                torch.zeros(4, *good.shape[1:])):
        with pytest.raises(ValueError, match="checkpoints"):
            chunk_state(k, w, u, G, h0, False, C, N, checkpoints=bad, segment_chunks=EVERY)
    for seg in (0, 2.0):
        with pytest.raises(ValueError, match="segment_chunks"):
            chunk_state(k, w, u, G, h0, False, C, N, checkpoints=good[:0].new_zeros(
                3 if seg else 6, *good.shape[1:]), segment_chunks=seg)


def test_chain_form_operands_of_another_shape_raise():
    """In the chain form the state passes read w as T and beta as β: W in T's place, or a β of
    other heads, raises before any launch (both passes)."""
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    case = CASES[0]
    (k, Ai, v, G, h0, beta), (N, offsets, idx, _) = state_pass(case, chain_t=True)
    W = torch.zeros(*v.shape[:3], k.shape[3])
    for w, b in ((W, beta), (Ai, beta[..., :1]), (Ai[:, :-1], beta)):
        with pytest.raises(ValueError, match="with beta"):
            chunk_state(k, w, v, G, h0, False, C, N, beta=b)
        with pytest.raises(ValueError, match="with beta"):
            chunk_bwd_state(k, k, w, G, v, v, 0.1, None, h0, C, N, beta=b)


def test_checkpoint_count_where_the_unsplit_pass_leaves_sms_idle():
    """B·HV = 32 at K = V = 128 is 128 programs for 132 SMs: a checkpoint every 64 chunks; at
    B·HV = 64 (256 programs) none; none for a sequence of 64 chunks or fewer."""
    cpu = torch.device("cpu")  # sm_count: the H200's 132 without a GPU
    assert module.SEGMENT_CHUNKS == 64
    assert module.checkpoint_count(32, 512, 128, 128, cpu) == 7
    assert module.checkpoint_count(32, 513, 128, 128, cpu) == 8
    assert module.checkpoint_count(32, 128, 128, 128, cpu) == 1
    assert module.checkpoint_count(32, 64, 128, 128, cpu) == 0
    assert module.checkpoint_count(64, 512, 128, 128, cpu) == 0
    assert module.new_checkpoints(1, 64 * 64, 32, 128, 128, 64, cpu) is None
    assert module.new_checkpoints(1, 64 * 64 + 1, 32, 128, 128, 64, cpu).shape == (
        1, 1, 32, 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fused", "materialized"])
def test_forward_checkpoints_and_the_backward_from_them_gpu(backend):
    """On the Hopper route (bf16, K = V = 128, B·HV = 4), a training forward of 194 chunks
    (unsplit: under gluon_transposed.MIN_CHUNKS_TO_SPLIT, 256) stores the states entering chunks
    64, 128 and 192: each within the state bound of the fp64 recurrence's state after that many
    tokens. The backward from them is within 1e-3 of the backward that recomputes the unsplit
    pass (H200: ≤ 9e-5): the checkpoints come from a chain with other roundings (the
    materialized forward's W/U form against the backward's chain form, chunk_bwd.CHAIN_T; the
    fused forward's Gluon chain). With the backward in the W/U form (GDN_BACKWARD_W_U=1) the
    materialized forward's checkpoints are its own chain's states, so there the bits must be
    equal."""
    from gdn_fused.eval.cases import truth
    from gdn_fused.kernels.fused_fwd import fused_fwd, uses_warp_specialized
    from gdn_fused.kernels.materialized import materialized_fwd
    T = 3 * 64 * 64 + 100
    q, k, v, g, b, h0 = make_inputs(1, T, 2, 4, 128, 128, torch.bfloat16, initial_state=True,
                                    device="cuda")
    assert uses_warp_specialized(q, v, 64, None)
    forward = fused_fwd if backend == "fused" else materialized_fwd
    o, ht, Ai, ckpt = forward(q, k, v, g, b, 128 ** -0.5, h0, True, None, 64, for_backward=True)
    assert ckpt.shape == (3, 1, 4, 128, 128) and ckpt.dtype == torch.float32
    for j in (1, 2, 3):
        n = 64 * 64 * j
        _, ref = truth(q[:, :n], k[:, :n], v[:, :n], g[:, :n], b[:, :n], h0, scale=128 ** -0.5)
        err = rel_err(ckpt[j - 1], ref)
        print(f"{backend} checkpoint {j}: {err:.2e}")
        assert err <= 3e-3
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(v.shape, generator=gen).to("cuda", torch.bfloat16)
    dht = torch.randn(h0.shape, generator=gen).cuda()
    args = (q, k, v, g, b, 128 ** -0.5, h0, do, dht, None, 64)
    split = chunk_gated_delta_rule_bwd(*args, Ai=Ai, checkpoints=ckpt)
    plain = chunk_gated_delta_rule_bwd(*args, Ai=Ai)
    for name, a, ref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), split, plain):
        err = rel_err(a, ref)
        print(f"{backend} {name} split vs unsplit: {err:.2e}")
        same_chain = backend == "materialized" and not chunk_bwd.CHAIN_T
        assert (err == 0 if same_chain else err <= 1e-3), name


@pytest.mark.gpu
def test_split_forward_checkpoints_gpu():
    """Where the forward itself runs split (segments=2, as from 512 chunks at small B·HV), the
    second segment's chain starts from the state the pass alone over segment 0 reached
    (session 18; until then a composition of segment maps): over 320 chunks (segments of 160)
    all four checkpoints are the unsplit forward's bits."""
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.gluon_transposed import forward_t
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    q, k, v, g, b, h0 = make_inputs(1, 320 * 64, 2, 4, 128, 128, torch.bfloat16,
                                    initial_state=True, device="cuda")
    G = chunk_cumsum(g, 64)
    Ai = chunk_inverse(k, G, b, 4, 64, torch.bfloat16)
    out = {}
    for segments in (1, 2):
        out[segments] = torch.empty(4, 1, 4, 128, 128, device="cuda")
        forward_t(q, k, v, G, b, Ai, 128 ** -0.5, h0, False, segments=segments,
                  checkpoints=out[segments])
    # segment 1 entered from the state pass alone over segment 0 (gluon_transposed.SEG0_END)
    assert torch.equal(out[2], out[1])
