"""The Triton kkt_solve (each method, each chunk size, fused and unfused) against fp64."""
import pytest
import torch

from gdn_fused import chunk_gated_delta_rule
from gdn_fused.kernels.chunk_gate import chunk_cumsum
from gdn_fused.kernels.kkt import chunk_kkt
from gdn_fused.kernels import kkt_solve as kkt_solve_module
from gdn_fused.kernels.kkt_solve import (SOLVE_METHODS, chunk_inverse, kkt_solve,
                                          kkt_solve_from_k)
from gdn_fused.eval.cases import make_inputs, rel_err, truth

# max abs error bounds vs the fp64 inverse (fp32 output); Newton–Schulz with its default
# 2·log2(C)+2 steps from X₀ = I/C still carries (1 − 1/C)^(2^k) of residual
BOUND = {"blocked": 1e-6, "mxr": 1e-6, "newton_schulz": 1e-4}


def chunk_tiles(X, C):
    """[B, T, HV, C] per-row layout -> list of [n, n] chunk tiles (n < C for a partial chunk)."""
    B, T, HV, _ = X.shape
    return [X[b, s:s + min(C, T - s), h, :min(C, T - s)]
            for b in range(B) for h in range(HV) for s in range(0, T, C)]


def setup(C, gate="normal", T=150):
    q, k, v, g, beta, _ = make_inputs(1, T, 1, 2, 32, 16, gate=gate, chunk_size=C)
    G = chunk_cumsum(g, C)
    return k, G, beta, chunk_kkt(k, G, beta, 2, C)


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("method", ["blocked", "mxr", "newton_schulz"])
def test_methods_against_fp64(C, method):
    k, G, beta, A = setup(C)
    Ai = kkt_solve(A, solve_method=method)
    for a, t in zip(chunk_tiles(A, C), chunk_tiles(Ai, C)):
        ref = torch.linalg.inv(torch.eye(a.shape[0], dtype=torch.float64) + a.double())
        assert (t.double() - ref).abs().max() <= BOUND[method]
    # the fused variant forms A on chip; same result up to fp32 rounding of the products
    Af = kkt_solve_from_k(k, G, beta, 2, C, solve_method=method)
    assert (Af - Ai).abs().max() <= 1e-6


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("method", ["blocked", "mxr"])
def test_prefetched_coupling_blocks_give_the_same_inverse(C, method):
    """prefetch only moves the coupling blocks' loads (a launch-sweep variant): same values."""
    k, G, beta, A = setup(C)
    assert torch.equal(kkt_solve(A, solve_method=method, prefetch=True),
                       kkt_solve(A, solve_method=method, kernel="triton"))
    assert torch.equal(kkt_solve_from_k(k, G, beta, 2, C, solve_method=method, prefetch=True),
                       kkt_solve_from_k(k, G, beta, 2, C, solve_method=method))


@pytest.mark.parametrize("method", ["blocked", "newton_schulz"])
def test_chunk_inverse_either_route(method, monkeypatch):
    """chunk_inverse through HBM (chunk_kkt + kkt_solve) and on chip (kkt_solve_from_k) give
    the same T, and the first is exactly kkt_solve of chunk_kkt's A."""
    k, G, beta, A = setup(64)
    routes = []
    for through_hbm in (True, False):
        monkeypatch.setattr(kkt_solve_module, "A_THROUGH_HBM", through_hbm)
        routes.append(chunk_inverse(k, G, beta, 2, 64, solve_method=method))
    assert torch.equal(routes[0], kkt_solve(A, solve_method=method))
    assert (routes[0] - routes[1]).abs().max() <= 1e-6
    # T far from I (ordinary gates), so agreeing routes have agreed on something
    assert max(t.tril(-1).abs().max() for t in chunk_tiles(routes[0], 64)) > 0.1
    # the measured register cap applies to the blocked method from A at its default warps
    assert kkt_solve_module._register_cap(None, "blocked", None, True) == {"maxnreg": 168}
    assert kkt_solve_module._register_cap(None, "blocked", 2, True) == {}


def test_newton_schulz_too_few_iterations_is_wrong():
    """The paper's collapse: 2 steps from X₀ = I/C leave most of the residual."""
    k, G, beta, A = setup(64)
    Ai = kkt_solve(A, solve_method="newton_schulz", solve_iters=2)
    ref = kkt_solve(A)
    assert (Ai - ref).abs().max() > 0.1


def test_coupling_sign():
    """L00 = L11 = 0 and only the coupling block L10 nonzero: T10 must be exactly −L10."""
    A = torch.zeros(1, 32, 1, 32)
    A[0, 16:, 0, :16] = torch.randn(16, 16)
    Ai = kkt_solve(A)
    assert torch.equal(Ai[0, 16:, 0, :16], -A[0, 16:, 0, :16])
    assert torch.equal(Ai[0, :16, 0, :16], torch.eye(16))


@pytest.mark.parametrize("gate", ["zero", "strong"])
@pytest.mark.parametrize("method", ["blocked", "mxr"])
def test_hard_gates_against_fp64(gate, method):
    """g = 0 (no decay: the largest off-diagonal entries) and strong decay (entries down to
    e^-4480): relative error on the strictly lower triangle, so near-zero entries still count."""
    k, G, beta, A = setup(64, gate)
    for Ai in (kkt_solve(A, solve_method=method),
               kkt_solve_from_k(k, G, beta, 2, 64, solve_method=method)):
        for a, t in zip(chunk_tiles(A, 64), chunk_tiles(Ai, 64)):
            ref = torch.linalg.inv(torch.eye(a.shape[0], dtype=torch.float64) + a.double())
            assert rel_err(t.tril(-1), ref.tril(-1)) <= 1e-5
            assert torch.equal(t.diagonal(), torch.ones(a.shape[0]))


def test_strong_decay_stays_finite():
    k, G, beta, A = setup(64, gate="strong")
    assert torch.isfinite(kkt_solve_from_k(k, G, beta, 2, 64)).all()


@pytest.mark.parametrize("method", ["mxr", "newton_schulz"])
def test_solve_method_through_the_api(method):
    q, k, v, g, b, h = make_inputs(1, 100, 1, 2, 32, 16, initial_state=True)
    o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h, output_final_state=True,
                                   backend="materialized", solve_method=method)
    o_ref, ht_ref = truth(q, k, v, g, b, h)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(ht, ht_ref) <= 1e-5


def test_bad_solve_method():
    q, k, v, g, b, _ = make_inputs(1, 20, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="solve_method must be one of"):
        chunk_gated_delta_rule(q, k, v, g, b, backend="materialized", solve_method="mch")
    with pytest.raises(ValueError, match="solve_iters"):
        chunk_gated_delta_rule(q, k, v, g, b, backend="torch", solve_iters=-1)


def test_kernel_choice():
    """auto runs the tl kernel off CUDA (the interpreter); an unknown kernel or a method the
    Gluon kernel lacks is refused before any launch."""
    k, G, beta, A = setup(64)
    assert torch.equal(kkt_solve(A), kkt_solve(A, kernel="triton"))
    with pytest.raises(ValueError, match="kernel"):
        kkt_solve(A, kernel="cuda")
    with pytest.raises(ValueError, match="blocked"):
        kkt_solve(A, solve_method="mxr", kernel="gluon")
    with pytest.raises(ValueError, match="num_warps, prefetch: options of the tl kernel"):
        kkt_solve(A, kernel="gluon", num_warps=2, prefetch=True)
    with pytest.raises(ValueError, match="CUDA"):
        kkt_solve(A, kernel="gluon")


def test_bad_input_is_refused_before_any_launch():
    k, G, beta, A = setup(64)
    cu = torch.tensor([0, 100, 150])
    from gdn_fused.kernels.chunk_index import chunk_layout
    _, _, idx = chunk_layout(cu, 1, 64)
    cases = [
        (dict(A=A[0]), ValueError, "B, T, HV, C"),
        (dict(A=A.to(torch.int32)), TypeError, "float"),
        (dict(A=A, output_dtype=torch.int32), TypeError, "output_dtype"),
        (dict(A=A.expand(2, -1, -1, -1), **idx), ValueError, "batch 1"),
        (dict(A=A, cu_seqlens=cu), ValueError, "chunk_indices and num_chunks"),
        (dict(A=A, **dict(idx, num_chunks=idx["num_chunks"] + 1)), ValueError, "num_chunks"),
    ]
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            kkt_solve(**kw)
    with pytest.raises(ValueError, match="batch 1"):
        chunk_layout(cu, 2, 64)


def test_only_the_strict_lower_part_is_read():
    """Junk on and above the diagonal and a strided view of A give the clean A's inverse."""
    k, G, beta, A = setup(64)
    junk = A + torch.triu(torch.full((64, 64), 7.), 0).repeat(3, 1)[:A.shape[1]][None, :, None]
    strided = torch.stack([junk, 0 * junk], -1)[..., 0]  # every other float: not contiguous
    assert not strided.is_contiguous()
    for method in SOLVE_METHODS:  # the tl kernel here (the Gluon one: the gpu test below)
        assert torch.equal(kkt_solve(strided, solve_method=method),
                           kkt_solve(A, solve_method=method))


def test_gluon_kernel_compiles_for_each_case():
    """The Gluon kkt_solve compiles for sm_90 and sm_80 (its lowest), dense and packed, with
    fp32 and bf16 A and output (it runs only on a GPU: the gpu test below checks its values)."""
    from gdn_fused.eval.ptxas import compile_report
    from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_gluon_kernel
    for arch, varlen, a, out in [(90, False, "*fp32", "*bf16"), (90, True, "*bf16", "*fp32"),
                                 (80, False, "*fp32", "*fp32")]:
        sig = {"A": a, "Ai": out, "cu_seqlens": "*i32", "chunk_indices": "*i32", "T": "i32",
               "NBH": "i32"}
        r = compile_report(kkt_solve_gluon_kernel, sig, dict(HV=32, IS_VARLEN=varlen), arch,
                           num_warps=1)
        # 16 products of 16 × 16 × 16 as 3 TF32 mma.sync each of 2 × 2 (n8, k8) steps
        assert r["features"]["mma.sync"] == 192 and r["spill_stores"] == 0, (arch, r)


def _packed_with_empty_sequence(gate, device):
    """A of three packed sequences (lengths 700, 0, 333: partial last chunks, an empty one),
    its packing arguments, the lengths and the (k, G, beta) A is formed from."""
    from gdn_fused.kernels.chunk_index import chunk_layout
    lens = [700, 0, 333]
    cu = torch.tensor([0, 700, 700, 1033], dtype=torch.int32, device=device)
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 4, 12, 128, 128, gate=gate, device=device)
    _, _, idx = chunk_layout(cu, 1, 64)
    G = chunk_cumsum(g, 64, **idx)
    return chunk_kkt(k, G, beta, 12, 64, **idx), idx, lens, (k, G, beta)


def test_gluon_from_k_compiles_for_each_case():
    """The Gluon kkt_solve from k compiles for sm_90 and sm_80, dense and packed, K = 128 and
    64, bf16 and fp16 keys: the solve's 192 mma.sync plus K Kᵀ's ten 16 × 16 blocks (2 n8 ×
    KA/16 k16 steps each, KA = max(K, 128) staged columns), no spills, one 16 KB shared buffer
    (keys, then A's blocks in their place) and the staged G and β rows; its values: the gpu
    test below."""
    from gdn_fused.eval.ptxas import compile_report
    from gdn_fused.kernels.gluon_kkt_solve import _key_layouts, kkt_solve_from_k_gluon_kernel
    for arch, varlen, K, keys, out in [(90, False, 128, "*bf16", "*bf16"),
                                       (90, True, 64, "*fp16", "*fp32"),
                                       (80, False, 128, "*bf16", "*fp32")]:
        KA, layout, shared = _key_layouts(K)
        sig = {"k": keys, "G": "*fp64", "beta": "*fp32", "Ai": out, "cu_seqlens": "*i32",
               "chunk_indices": "*i32", "T": "i32", "NBH": "i32"}
        r = compile_report(kkt_solve_from_k_gluon_kernel, sig,
                           dict(H=16, HV=32, K=K, KA=KA, KEYS=layout, KEYS_SMEM=shared,
                                IS_VARLEN=varlen), arch, num_warps=1)
        assert r["features"]["mma.sync"] == 192 + 10 * 2 * KA // 16, (arch, K, r)
        # (+ the staged G and β rows: 64 fp64 and 64 fp32)
        assert r["spill_stores"] == 0 and r["shared"] == 64 * KA * 2 + 64 * 12, (arch, K, r)


def test_gluon_from_k_with_shared_keys_compiles():
    """HEADS = 2 (two value heads of a key head a program, SHARED_KEYS): K Kᵀ's ten blocks once
    and the solve's 192 mma.sync twice, no spills, the keys' 16 KB plus the second head's
    10 KB of A and both heads' staged G and β rows (1.5 KB): 28,160 B, 8 programs an SM of
    the H200's 228 KB with its 1 KB a program."""
    from gdn_fused.eval.ptxas import _gluon_kkt_solve_from_k, compile_report
    fn, sig, consts = _gluon_kkt_solve_from_k()  # HEADS = 2, K = 128
    KA = consts["KA"]
    r = compile_report(fn, sig, consts, 90, num_warps=1)
    assert r["features"]["mma.sync"] == 2 * 192 + 10 * 2 * KA // 16, r
    assert r["spill_stores"] == 0, r
    assert r["shared"] == 64 * KA * 2 + 10 * 16 * 16 * 4 + 2 * 64 * 12, r


def test_gluon_from_k_roles_compiles():
    """The four-role form (kernels/gluon_kkt_roles.py) compiles for sm_90a, K = 128 and 256,
    with the one-warp kernel's mma.sync count (the same products), per-role register budgets
    (setmaxnreg), its mbarriers, no spills at its launch cap, and the keys, both heads' A
    (20 KB) and the gate rows (1.5 KB) in shared memory."""
    from gdn_fused.eval.ptxas import _gluon_kkt_roles, compile_report
    from gdn_fused.kernels.gluon_kkt_roles import LAUNCH_MAXNREG, STAGE_WARPS
    from gdn_fused.kernels.gluon_kkt_solve import _key_layouts
    fn, sig, consts = _gluon_kkt_roles()
    for K, swizzled in ((128, True), (128, False), (256, True)):
        KA, _, keys_smem = _key_layouts(K)
        c = dict(consts, K=K, KA=KA, KEYS_SMEM=keys_smem, SWIZZLED=swizzled)
        r = compile_report(fn, sig, c, 90, num_warps=STAGE_WARPS, maxnreg=LAUNCH_MAXNREG)
        assert r["features"]["mma.sync"] == 2 * 192 + 10 * 2 * KA // 16, (K, swizzled, r)
        assert r["features"]["setmaxnreg"] > 0 and r["features"]["mbarrier"] > 0, r
        # (A unswizzled, an A/B variant and not the default, spills 4 B at these caps)
        assert r["spill_stores"] <= (0 if swizzled else 8), (K, swizzled, r)
        assert r["registers"] <= LAUNCH_MAXNREG, (K, swizzled, r)
        # the keys, both heads' A, the gate rows, and the barriers' few bytes
        low = 64 * KA * 2 + 2 * 10 * 16 * 16 * 4 + 2 * 64 * 12
        assert low <= r["shared"] <= low + 1024, (K, swizzled, r)


def test_roles_only_on_hopper(monkeypatch):
    """The four-role kernel's register budgets are setmaxnreg (sm_90+: an sm_80 compile aborts
    in LLVM), so kkt_solve_from_k_gluon keeps the one-warp kernel on earlier GPUs."""
    from gdn_fused.kernels import chunk_index
    from gdn_fused.kernels.gluon_kkt_solve import uses_roles
    device = torch.device("cuda", 0)
    for cap, want in (((8, 0), False), ((8, 9), False), ((9, 0), True)):
        monkeypatch.setattr(chunk_index, "capability", lambda d, cap=cap: cap)
        assert uses_roles(device, 2, True, True) is want
        assert uses_roles(device, 1, True, True) is False
        assert uses_roles(device, 2, False, True) is False
        assert uses_roles(device, 2, True, False) is False


@pytest.mark.gpu
@pytest.mark.parametrize("gva", [2, 4])
def test_gluon_from_k_with_shared_keys(gva):
    """kkt_solve_from_k_gluon with shared_keys (K Kᵀ formed once for two value heads), with the
    gates staged in shared memory (staged_gates), with both and A's blocks swizzled
    (swizzled), and with those spread over four one-warp roles (roles) gives the bits of one
    head a program reading its gates from global memory with A unswizzled, fp32 and bf16 out,
    for logsigmoid and zero gates, dense with a partial last chunk (B = 2) and packed with an empty sequence.
    (Session 11, before the substitution's row-0 term became a select: the second head of
    each pair differed by ≤ 1.9e-9, an fma contraction the compiler chose differently in its
    copy of the solve; see kkt_solve_from_k_gluon_kernel.)"""
    from gdn_fused.kernels.chunk_index import chunk_layout
    from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_from_k_gluon
    H = 4
    HV = H * gva
    cu = torch.tensor([0, 700, 700, 1033], dtype=torch.int32, device="cuda")
    _, _, packed = chunk_layout(cu, 1, 64)
    for gate in ("normal", "zero"):
        for B, T, idx in ((2, 1000, {}), (1, 1033, packed)):
            _, k, _, g, beta, _ = make_inputs(B, T, H, HV, 128, 128, gate=gate, device="cuda")
            k = k.bfloat16()
            G = chunk_cumsum(g, 64, **idx)
            for dtype in (torch.float32, torch.bfloat16):
                one = kkt_solve_from_k_gluon(k, G, beta, HV, dtype, shared_keys=False,
                                             staged_gates=False, swizzled=False, **idx)
                for shared, staged, swizzled, roles in ((True, False, False, False),
                                                        (False, True, False, False),
                                                        (True, True, True, False),
                                                        (True, True, True, True),
                                                        (True, True, False, True)):
                    two = kkt_solve_from_k_gluon(k, G, beta, HV, dtype, shared_keys=shared,
                                                 staged_gates=staged, swizzled=swizzled,
                                                 roles=roles, **idx)
                    d = (one.float() - two.float()).abs().max().item()
                    assert torch.equal(one, two), (gate, B, T, dtype, shared, staged, swizzled,
                                                   roles, d)


def test_gluon_from_k_refusals():
    """kernel='gluon' from k refuses what the Gluon kernel cannot take, before any launch."""
    k, G, beta, _ = setup(64)
    with pytest.raises(ValueError, match="fp16/bf16 keys"):
        kkt_solve_from_k(k, G, beta, 2, 64, kernel="gluon")  # fp32 keys
    with pytest.raises(ValueError, match="chunk size 64"):
        kkt_solve_from_k(k.half(), G, beta, 2, 32, kernel="gluon")
    with pytest.raises(ValueError, match="k on a CUDA device"):
        kkt_solve_from_k(k.half(), G, beta, 2, 64, kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be one of"):
        kkt_solve_from_k(k, G, beta, 2, 64, kernel="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["normal", "zero", "strong"])
def test_gluon_kernel_against_fp64(gate):
    """The Gluon kkt_solve (GPU only: Gluon has no interpreter) on dense input with a partial
    last chunk and on packed input with an empty sequence, fp32 and bf16 out, against the fp64
    inverse of every tile; and against the tl kernel."""
    q, k, v, g, beta, _ = make_inputs(2, 1000, 4, 12, 128, 128, gate=gate, device="cuda")
    G = chunk_cumsum(g, 64)
    cases = [(chunk_kkt(k, G, beta, 12, 64), {}, None)]
    cases.append(_packed_with_empty_sequence(gate, "cuda")[:3])
    for A, idx, lens in cases:
        Ai = kkt_solve(A, kernel="gluon", **idx)
        assert torch.equal(Ai, kkt_solve(A, **idx))  # auto picks it on this GPU
        tl_Ai = kkt_solve(A, kernel="triton", **idx)
        assert (Ai - tl_Ai).abs().max() <= 1e-6
        bf = kkt_solve(A, torch.bfloat16, kernel="gluon", **idx)
        # rounded to nearest at the store, as .to(bfloat16) rounds
        assert ((bf.float() - Ai).abs() <= Ai.abs() * 2 ** -8 + 1e-38).all()  # + subnormals
        def tiles(X):  # every chunk tile, sequence by sequence when packed
            if lens is None:
                return chunk_tiles(X, 64)
            return [t for s, n in zip([0, 700, 700], lens) for t in chunk_tiles(X[:, s:s + n], 64)]
        tiles_A, tiles_T = tiles(A), tiles(Ai)
        worst = offdiag = 0.
        for a, t in zip(tiles_A, tiles_T):
            ref = torch.linalg.inv(torch.eye(a.shape[0], dtype=torch.float64, device="cuda")
                                   + a.double())
            worst = max(worst, (t.double() - ref).abs().max().item())
            offdiag = max(offdiag, t.tril(-1).abs().max().item())
            assert torch.equal(t.triu(1), torch.zeros_like(t))
        print(f"gluon kkt_solve {gate} {'dense' if lens is None else 'packed'}: max abs {worst:.2e}")
        assert worst <= 1e-6
        # only A's strict lower part is read (dense: chunk rows start at multiples of 64, so
        # row t's junk goes to its chunk's diagonal and above); bf16 A is computed in fp32
        if lens is None:
            junk = A + torch.triu(torch.full((64, 64), float("nan"), device="cuda"), 0).repeat(
                A.shape[1] // 64 + 1, 1)[:A.shape[1]][None, :, None]
            assert torch.equal(kkt_solve(junk, kernel="gluon"), Ai)
        assert torch.equal(kkt_solve(A.bfloat16(), kernel="gluon", **idx),
                           kkt_solve(A.bfloat16().float(), kernel="gluon", **idx))
        # T far from I unless the decay is strong: agreeing with fp64 means something
        assert offdiag > (0 if gate == "strong" else 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["normal", "zero", "strong"])
def test_gluon_from_k_against_fp64(gate):
    """The Gluon kkt_solve from k (A formed on chip from 16-bit keys) on dense input with a
    partial last chunk and GVA 3 (bf16 K = 128, fp16 K = 64) and GVA 2 (fp16 K = 64: two
    heads a program, on Hopper the four-role kernel), and on packed input with an empty
    sequence: against the fp64 inverse of the A that chunk_kkt forms from the same keys, and
    against kkt_solve of that A (the same products, summed in another order). chunk_inverse
    takes it on this GPU."""
    cases = []
    # K = 64: zero-padded to 128
    for K, dtype, HV in [(128, torch.bfloat16, 12), (64, torch.float16, 12),
                         (64, torch.float16, 8)]:
        q, k, v, g, beta, _ = make_inputs(2, 1000, 4, HV, K, 128, gate=gate, device="cuda")
        cases.append(((k.to(dtype), chunk_cumsum(g, 64), beta), {}, None))
    packed = _packed_with_empty_sequence(gate, "cuda")
    cases.append(((packed[3][0].bfloat16(), *packed[3][1:]), packed[1], packed[2]))
    for (kb, Gc, bc), idx, lens in cases:
        HV = bc.shape[-1]
        Af = kkt_solve_from_k(kb, Gc, bc, HV, 64, kernel="gluon", **idx)
        assert torch.equal(Af, kkt_solve_from_k(kb, Gc, bc, HV, 64, **idx))  # auto
        assert torch.equal(Af, chunk_inverse(kb, Gc, bc, HV, 64, **idx))
        A = chunk_kkt(kb, Gc, bc, HV, 64, **idx)
        diff = (Af - kkt_solve(A, **idx)).abs().max().item()
        starts = [0] if lens is None else [0, 700, 700]
        worst = 0.
        for b in range(A.shape[0]):
            for s0, n in zip(starts, lens or [A.shape[1]]):
                for a, t in zip(chunk_tiles(A[b:b + 1, s0:s0 + n], 64),
                                chunk_tiles(Af[b:b + 1, s0:s0 + n], 64)):
                    ref = torch.linalg.inv(torch.eye(a.shape[0], dtype=torch.float64,
                                                     device="cuda") + a.double())
                    worst = max(worst, (t.double() - ref).abs().max().item())
        print(f"gluon kkt_solve from k {gate} {'dense' if lens is None else 'packed'} "
              f"K={kb.shape[-1]} {kb.dtype}: max abs "
              f"{worst:.2e} vs fp64, {diff:.2e} vs from A")
        assert worst <= 1e-5 and diff <= 1e-5


def test_gluon_launchers_refuse_before_launch():
    """Both Gluon launchers exist and refuse what their kernels cannot take before any launch
    (on the CPU too: these checks come first)."""
    from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_from_k_gluon, kkt_solve_gluon
    k, G, beta, A = setup(32)
    with pytest.raises(ValueError, match="chunk size .* must be 64"):
        kkt_solve_gluon(A)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        kkt_solve_from_k_gluon(k, G, beta, 2)
    with pytest.raises(ValueError, match="power of two"):
        kkt_solve_from_k_gluon(k[..., :24].half(), G, beta, 2)


def test_from_k_validates_before_launch():
    """kkt_solve_from_k refuses malformed inputs with an error naming the argument, and takes
    strided keys (made contiguous) with the same result."""
    k, G, beta, _ = setup(64)
    bad = [((k[0], G, beta, 2, 64), ValueError, "k must be"),
           ((k.long(), G, beta, 2, 64), TypeError, "k must be a float"),
           ((k, G, beta, 0, 64), ValueError, "num_value_heads"),
           ((k, G[:, :-1], beta, 2, 64), ValueError, "G must be"),
           ((k, G, beta.long(), 2, 64), TypeError, "beta must be a float"),
           ((k, G, beta, 2, 48), ValueError, "chunk_size")]
    for args, err, msg in bad:
        with pytest.raises(err, match=msg):
            kkt_solve_from_k(*args)
    with pytest.raises(TypeError, match="output_dtype"):
        kkt_solve_from_k(k, G, beta, 2, 64, torch.int32)
    with pytest.raises(ValueError, match="chunk_indices and num_chunks"):
        kkt_solve_from_k(k, G, beta, 2, 64, cu_seqlens=torch.tensor([0, 150]))
    with pytest.raises(ValueError, match="batch 1"):
        kkt_solve_from_k(k.expand(2, -1, -1, -1), G.expand(2, -1, -1), beta.expand(2, -1, -1),
                         2, 64, cu_seqlens=torch.tensor([0, 150]))
    strided = torch.stack([k, 0 * k], -1)[..., 0]
    assert not strided.is_contiguous()
    assert torch.equal(kkt_solve_from_k(strided, G, beta, 2, 64),
                       kkt_solve_from_k(k, G, beta, 2, 64))
