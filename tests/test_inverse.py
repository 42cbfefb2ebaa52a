"""gdn_fused.inverse against the fp64 inverse, with bounds that follow each method's stability
class (Sobczyk et al., arXiv:2605.21325, Table 2), plus the kkt_solve article's degenerate
checks (seed 000, §4): beta = 0 gives I, and the coupling path alone gives −L10."""
import pytest
import torch

from gdn_fused.eval.inverse_accuracy import exact_inverse, main, sample_deltanet
from gdn_fused.inverse import BASE_BLOCK, METHODS, invert_unit_lower, refine_inverse

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
LOW = (torch.float32, torch.float16, torch.bfloat16)
# Stable and converged methods stay within a few units of the storage dtype's roundoff on these
# well-conditioned matrices (measured ≤ 3.4u, max over samples, n ≤ 64); 8u leaves margin.
STABLE_U = 8
# MXR without refinement inherits MCH's error on its 16×16 blocks: 2–3 digits lost on
# correlated keys (paper §4.1; measured ≤ 1.8e3 u max abs).
MXR_RAW_U = 4096
SAMPLES = 8
STABLE = [("vcs", None), ("mcs", None), ("blocked", None), ("mbh", None), ("mxr", 1),
          ("newton_schulz", None)]


def _matrices(n, keys, seed=0, **kw):
    return sample_deltanet(SAMPLES, n, keys=keys, generator=torch.Generator().manual_seed(seed),
                           **kw)


def _errors(X, T):
    """(max Frobenius relative error, max abs error) over the samples, in fp64."""
    D = X.double() - T
    frob = (torch.linalg.matrix_norm(D) / torch.linalg.matrix_norm(T)).max().item()
    return frob, D.abs().max().item()


def _run(A64, dtype, method, iters=None):
    A = A64.to(dtype)
    return invert_unit_lower(A, method, iters=iters, compute_dtype=dtype), exact_inverse(A)


@pytest.mark.parametrize("n", [16, 64])
@pytest.mark.parametrize("keys", ["sphere", "orthant"])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("method,iters", STABLE)
def test_stable_methods_match_fp64(method, iters, dtype, keys, n):
    X, T = _run(_matrices(n, keys), dtype, method, iters)
    assert X.dtype == dtype
    bound = STABLE_U * UNIT_ROUNDOFF[dtype]
    frob, max_abs = _errors(X, T)
    assert frob <= bound and max_abs <= bound, (frob, max_abs, bound)


@pytest.mark.parametrize("dtype", LOW)
def test_mxr_without_refinement_loses_digits_on_correlated_keys(dtype):
    u = UNIT_ROUNDOFF[dtype]
    frob, _ = _errors(*_run(_matrices(64, "sphere"), dtype, "mxr"))
    assert frob <= STABLE_U * u
    frob, max_abs = _errors(*_run(_matrices(64, "orthant"), dtype, "mxr"))
    assert STABLE_U * u < max_abs <= MXR_RAW_U * u, (max_abs / u)


@pytest.mark.parametrize("dtype", LOW)
def test_mch_is_accurate_at_16(dtype):
    frob, max_abs = _errors(*_run(_matrices(16, "sphere"), dtype, "mch"))
    bound = STABLE_U * UNIT_ROUNDOFF[dtype]
    assert frob <= bound and max_abs <= bound


@pytest.mark.parametrize("dtype", LOW)
def test_mch_collapses_at_64(dtype):
    """The unstable method has no correct digit at n = 64 on correlated keys (fp16: NaN from
    overflowing powers), while the stable ones stay within 8u (paper §4.1, Fig. 2)."""
    X, T = _run(_matrices(64, "orthant"), dtype, "mch")
    frob, _ = _errors(X, T)
    assert not torch.isfinite(X).all() or frob > 1.0, frob
    if dtype == torch.float16:
        assert not torch.isfinite(X).all()


def test_newton_schulz_from_identity_overflows_like_mch():
    """X₀ = I makes the first Newton–Schulz iterates MCH's partial products: fine on isotropic
    keys, inf/NaN in fp16 on correlated keys, where X₀ = I/n converges."""
    X, T = _run(_matrices(64, "sphere"), torch.float16, "newton_schulz_identity")
    assert _errors(X, T)[0] <= STABLE_U * UNIT_ROUNDOFF[torch.float16]
    X, _ = _run(_matrices(64, "orthant"), torch.float16, "newton_schulz_identity")
    assert not torch.isfinite(X).all()


@pytest.mark.parametrize("iters,max_frob", [(6, 1.0), (12, 1e-6)])
def test_newton_schulz_needs_about_2_log_n_iterations(iters, max_frob):
    """From X₀ = I/n, NS-6 is still far off and NS-12 converged at n = 64 (paper Table 4)."""
    frob, _ = _errors(*_run(_matrices(64, "orthant"), torch.float32, "newton_schulz", iters))
    assert (frob > 0.1) if iters == 6 else (frob <= max_frob), frob


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("method", list(METHODS))
def test_beta_zero_gives_identity(method, dtype):
    A = _matrices(32, "sphere", beta=torch.zeros(SAMPLES, 32, dtype=torch.float64))
    X = invert_unit_lower(A.to(dtype), method, compute_dtype=dtype)
    assert torch.equal(X, torch.eye(32, dtype=dtype).expand_as(X))


@pytest.mark.parametrize("n", [32, 64])
@pytest.mark.parametrize("method", list(METHODS))
def test_coupling_block_alone_gives_minus_l10(method, n):
    """L00 = L11 = I and only L10 nonzero: T's lower-left block is exactly −L10 (seed 000, §4),
    isolating the sign of the coupling path."""
    h = n // 2
    L10 = torch.rand(3, h, h, generator=torch.Generator().manual_seed(n)) * 2 - 1
    A = torch.eye(n).repeat(3, 1, 1)
    A[:, h:, :h] = L10
    X = invert_unit_lower(A, method)
    assert torch.equal(X[:, h:, :h], -L10)
    assert torch.equal(X[:, :h, :h], torch.eye(h).expand(3, h, h))
    assert torch.equal(X[:, h:, h:], torch.eye(h).expand(3, h, h))
    assert torch.equal(X[:, :h, h:], torch.zeros(3, h, h))


@pytest.mark.parametrize("keys,head_dim,reached", [("sphere", 128, 0.3), ("orthant", 128, 0.7),
                                                    ("sphere", 2, 0.99)])
def test_entries_stay_in_unit_interval(keys, head_dim, reached):
    """Unit keys and beta ∈ (0,1): every entry of T lies in [−1, 1] (paper §2.2, ref. [15]).
    Low-dimensional keys push entries close to ±1, so the bound is exercised, not met trivially."""
    gen = torch.Generator().manual_seed(3)
    beta = torch.rand(4 * SAMPLES, 64, dtype=torch.float64, generator=gen)
    A = sample_deltanet(4 * SAMPLES, 64, keys=keys, head_dim=head_dim, beta=beta, generator=gen)
    T = exact_inverse(A)
    assert reached < T.tril(-1).abs().max() <= 1.0
    for method, iters in STABLE:
        X = invert_unit_lower(A.float(), method, iters=iters)
        assert X.abs().max() <= 1.0 + 4 * UNIT_ROUNDOFF[torch.float32], method


def test_refinement_squares_the_residual():
    A = _matrices(64, "orthant").float()
    T = exact_inverse(A)
    noise = torch.randn(T.shape, generator=torch.Generator().manual_seed(5), dtype=T.dtype)
    X0 = (T + 1e-4 * noise.tril(-1)).float()
    before = _errors(X0, T)[0]
    after = _errors(refine_inverse(A, X0), T)[0]
    assert after <= 1e-2 * before, (before, after)
    # the `refine` option of invert_unit_lower is the same arithmetic applied to its result
    raw = invert_unit_lower(A.half(), "mxr", compute_dtype=torch.float16)
    wrapped = invert_unit_lower(A.half(), "mxr", refine=1, compute_dtype=torch.float16)
    assert torch.equal(wrapped, refine_inverse(A.half(), raw, compute_dtype=torch.float16))


@pytest.mark.parametrize("n", [20, 48])
@pytest.mark.parametrize("method", list(METHODS))
def test_any_size_and_batch_dims_in_fp64(method, n):
    if method == "blocked" and n % BASE_BLOCK:
        pytest.skip("blocked needs n % 16 == 0 (tested in test_bad_arguments)")
    A = _matrices(n, "sphere").reshape(2, 4, n, n)
    X = invert_unit_lower(A, method)
    assert X.shape == A.shape and X.dtype == torch.float64
    assert (X - exact_inverse(A)).abs().max() <= 1e-13


def test_only_the_strict_lower_triangle_is_read():
    A = _matrices(32, "sphere")
    garbage = A + torch.randn(A.shape, dtype=A.dtype, generator=torch.Generator().manual_seed(7)
                              ).triu()
    for method in METHODS:
        assert torch.equal(invert_unit_lower(garbage, method), invert_unit_lower(A, method))


def test_low_precision_products_in_fp32_storage():
    """product_dtype=bf16 with fp32 storage: operands rounded to bf16, so the error is bf16-sized,
    not fp32-sized — the knob emulates bf16-input tensor-core GEMMs."""
    A = _matrices(64, "sphere").float()
    T = exact_inverse(A)
    X = invert_unit_lower(A, "mbh", product_dtype=torch.bfloat16)
    assert X.dtype == torch.float32
    frob, _ = _errors(X, T)
    fp32, bf16 = (STABLE_U * UNIT_ROUNDOFF[d] for d in (torch.float32, torch.bfloat16))
    assert fp32 < frob <= bf16


def test_autograd_matches_triangular_solve():
    A = _matrices(32, "orthant").requires_grad_()
    W = torch.randn(A.shape, dtype=A.dtype, generator=torch.Generator().manual_seed(9))
    ref, = torch.autograd.grad((exact_inverse(A.tril(-1) + torch.eye(32, dtype=A.dtype)) * W)
                               .sum(), A)
    for method in METHODS:
        if method in ("mch", "newton_schulz_identity"):
            continue  # unstable on correlated keys even in fp64 (huge intermediate powers)
        got, = torch.autograd.grad((invert_unit_lower(A, method) * W).sum(), A)
        assert (got - ref).abs().max() <= 1e-9, method


def test_methods_table_costs():
    """Depths and product counts of Table 2 (paper) and the article's §2.3 depth table."""
    assert {n: METHODS["blocked"].cost(n)[1] for n in (32, 64, 128)} == {32: 17, 64: 19, 128: 21}
    assert METHODS["vcs"].cost(64) == (0, 63)
    assert METHODS["mcs"].cost(64) == (63, 63)
    assert METHODS["mbh"].cost(64)[0] == 12  # ≈ 2 log₂ n
    assert METHODS["mch"].cost(64)[0] == 10  # 2⌈log₂(n/2)⌉
    assert METHODS["newton_schulz"].cost(64) == (28, 28)  # 2 × (2 log₂ n + 2) iterations
    assert METHODS["newton_schulz"].cost(64, iters=12, refine=1) == (26, 26)
    assert METHODS["mxr"].cost(64, iters=1)[0] == 2 * 3 + 2 + 2 * 2
    assert {m.stability for m in METHODS.values()} == {"stable", "conditionally", "unstable"}
    assert METHODS["mch"].stability == "unstable"


@pytest.mark.parametrize("call,exc,name", [
    (lambda: invert_unit_lower(torch.eye(4)[0]), ValueError, "A"),
    (lambda: invert_unit_lower(torch.zeros(3, 16, 8)), ValueError, "A"),
    (lambda: invert_unit_lower(torch.eye(24)), ValueError, "A.shape"),
    (lambda: invert_unit_lower(torch.eye(16), "lu"), ValueError, "method"),
    (lambda: invert_unit_lower(torch.eye(16), "vcs", iters=2), ValueError, "iters"),
    (lambda: invert_unit_lower(torch.eye(16), "newton_schulz", iters=-1), ValueError, "iters"),
    (lambda: invert_unit_lower(torch.eye(16), refine=-1), ValueError, "refine"),
    (lambda: invert_unit_lower(torch.eye(16), refine=True), ValueError, "refine"),
    (lambda: invert_unit_lower(torch.eye(16), compute_dtype=torch.int32), ValueError,
     "compute_dtype"),
    (lambda: invert_unit_lower(torch.eye(16), product_dtype="fp16"), ValueError, "product_dtype"),
    (lambda: invert_unit_lower(torch.eye(16, dtype=torch.int64)), TypeError, "A"),
    (lambda: invert_unit_lower([[1.0]]), TypeError, "A"),
    (lambda: refine_inverse(torch.eye(16), torch.eye(8)), ValueError, "X"),
    (lambda: refine_inverse(torch.eye(16), torch.eye(16), steps=-2), ValueError, "steps"),
])
def test_bad_arguments(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


@pytest.mark.parametrize("head_dim", ["0", "-4"])
def test_inverse_accuracy_cli_refuses_head_dim_below_one(head_dim, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--head-dim", head_dim, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m eval.inverse_accuracy: error: --head-dim must be ≥ 1" in err
    assert not (tmp_path / "out").exists()
