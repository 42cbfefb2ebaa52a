"""Inverses of unit lower triangular matrices: the method family behind ``T = A⁻¹`` (kkt_solve).

In chunkwise Gated DeltaNet every chunk of C tokens needs ``T = A⁻¹`` for
``A = I + strictLower(D_beta (Γ ⊙ K Kᵀ))`` (design card, §Chunkwise form). This module holds
the methods studied by Sobczyk et al., *Fast and Stable Triangular Inversion for Delta-Rule
Linear Transformers*, arXiv:2605.21325 (seed 001; Table 2 lists them, §3 gives the
algorithms), plus the blocked recursion of the Qwen ``kkt_solve`` kernel (seed 000, §2.2).

Public API:

- :func:`invert_unit_lower` — one entry point for every method.
- :func:`refine_inverse` — iterative refinement of a given inverse (paper §3.6, Alg. 6).
- :data:`METHODS` — per method: matrix products, dependency depth, stability class.

Precision model (paper §4.1): every matrix the algorithm keeps between steps is stored in
``compute_dtype``; every product reads its operands rounded to ``product_dtype`` and
accumulates in float32 (float64 when ``compute_dtype`` is float64), like a tensor-core GEMM
whose accumulator may be initialised with a stored matrix; the result is rounded back to
``compute_dtype``. With ``compute_dtype=float16`` this reproduces the paper's "fp16 inputs,
fp32 products" setting, including fp16 overflow to inf/NaN of the unstable method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

BASE_BLOCK = 16  # diagonal block of "blocked"/"mxr": one 16×16 MMA tile (seed 000, §2.2)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Arith:
    """Rounding rules of one inversion: storage dtype, product operand dtype, accumulator."""

    def __init__(self, compute_dtype: torch.dtype, product_dtype: torch.dtype):
        self.cd = compute_dtype
        self.pd = product_dtype
        self.acc = torch.float64 if compute_dtype == torch.float64 else torch.float32

    def mm(self, a, b, c=None, negate=False):
        """round(c ± a·b): operands rounded to pd, products and the addition of c in acc."""
        p = a.to(self.pd).to(self.acc) @ b.to(self.pd).to(self.acc)
        if negate:
            p = -p
        if c is not None:
            p = c.to(self.acc) + p
        return p.to(self.cd)

    def eye(self, n, like):
        return torch.eye(n, dtype=self.cd, device=like.device).expand_as(like)


# ---------------------------------------------------------------------------------------------
# Block helpers. Block sizes are powers of two times BASE_BLOCK (or n itself); the diagonal
# blocks are handled as a batch [..., nb, b, b] so base cases run as one batched computation.

def _diag_blocks(M, b):
    """[..., n, n] -> [..., n//b, b, b], the b×b diagonal blocks."""
    nb = M.shape[-1] // b
    blocks = M.reshape(*M.shape[:-2], nb, b, nb, b).diagonal(dim1=-4, dim2=-2)  # [..., b, b, nb]
    return blocks.movedim(-1, -3)


def _block_diag(blocks):
    """[..., nb, b, b] -> [..., nb·b, nb·b] with zeros off the diagonal blocks."""
    nb, b = blocks.shape[-3], blocks.shape[-1]
    out = blocks.new_zeros(*blocks.shape[:-3], nb * b, nb * b)
    for i in range(nb):
        out[..., i * b:(i + 1) * b, i * b:(i + 1) * b] = blocks[..., i, :, :]
    return out


def _parity_masks(n, b, device):
    """Boolean [n, n] masks of the even and odd b×b diagonal blocks (paper App. C.3, D_e/D_o)."""
    blk = torch.arange(n, device=device) // b
    same = blk[:, None] == blk[None, :]
    even = (blk % 2 == 0)[:, None]
    return same & even, same & ~even


def _pad_pow2(L, b0):
    """Pad L with zero rows and columns to n' = b0·2^k ≥ n.

    diag(A, I)⁻¹ = diag(A⁻¹, I), so the top-left n×n block of the padded inverse is A⁻¹; this
    lets the halving recursion take any n."""
    n = L.shape[-1]
    pad = b0 * 2 ** math.ceil(math.log2(max(n / b0, 1))) - n
    return torch.nn.functional.pad(L, (0, pad, 0, pad)) if pad else L


# ---------------------------------------------------------------------------------------------
# The methods. Each takes the strictly lower part L of A = I + L (already rounded to ar.cd) and
# returns A⁻¹ in ar.cd.

def _forward_substitution(L, ar):
    """Row-wise forward substitution, X[k,:] = e_kᵀ − L[k,:k] X[:k,:] (seed 000, §2.1).

    n − 1 dependent steps; each row is one fp32-accumulated dot product per column, rounded
    once. X grows by concatenation (no in-place writes) so autograd can differentiate it."""
    n = L.shape[-1]
    eye = ar.eye(n, L)
    X = eye[..., 0:1, :]
    for k in range(1, n):
        row = ar.mm(L[..., k:k + 1, :k], X, c=eye[..., k:k + 1, :], negate=True)
        X = torch.cat([X, row], dim=-2)
    return X


def _column_sweep(L, ar):
    """Matrix column sweep (paper §3.1, MCS): X ← (I − l_k e_kᵀ) X for k = 0 … n−2.

    A = Π_k (I + l_k e_kᵀ) with l_k the k-th column of L, so A⁻¹ is the product of the
    elementary inverses in reverse order. Each step is written as the rank-1 update
    X − l_k X[k,:]; that is the same arithmetic as the n×n product (every entry receives one
    product, fp32-accumulated, then is rounded), without multiplying by n² − n zeros."""
    n = L.shape[-1]
    X = ar.eye(n, L)
    for k in range(n - 1):
        X = ar.mm(L[..., :, k:k + 1], X[..., k:k + 1, :], c=X, negate=True)
    return X


def _repeated_squaring(L, ar):
    """Cayley–Hamilton by repeated squaring (paper §3.2, Alg. 5, MCH).

    (I + L)⁻¹ = Σ_{j<n} (−L)^j = (I − L) Π_{i≥1} (I + L^(2^i)) since L^n = 0;
    Y ← Y², X ← X + X·Y for ⌈log₂ n⌉ − 1 rounds. Unstable: the partial sums and powers can
    be huge even though A⁻¹ has entries in [−1, 1] (paper §4.1, App. C.5)."""
    n = L.shape[-1]
    X = ar.eye(n, L) - L  # exact: disjoint supports
    Y = L
    for _ in range(_squarings(n)):
        Y = ar.mm(Y, Y)
        X = ar.mm(X, Y, c=X)
    return X


def _squarings(n):
    return max(math.ceil(math.log2(n)) - 1, 0) if n > 1 else 0


def _bunch_hopcroft(L, X, b0, ar):
    """Unrolled Bunch–Hopcroft recursion (paper §3.3, Alg. 4 and App. C.3); n/b0 a power of 2.

    X holds the inverses of the b0×b0 diagonal blocks of A = I + L. For b = b0, 2b0, …, n/2:
    X ← D_e + D_o − D_o·L·D_e with D_e / D_o the even / odd b×b diagonal blocks of X, which
    completes [[T00, 0], [−T11 L10 T00, T11]] for every pair of blocks at once. Entries the
    product leaves outside the new 2b×2b blocks are dropped by the next level's selection."""
    n = L.shape[-1]
    zero = torch.zeros((), dtype=X.dtype, device=X.device)
    b = b0
    while b < n:
        even, odd = _parity_masks(n, b, L.device)
        De, Do = torch.where(even, X, zero), torch.where(odd, X, zero)
        X = ar.mm(ar.mm(Do, L), De, c=De + Do, negate=True)  # D_e + D_o is exact: disjoint
        b *= 2
    return X


def _halving(L, b0, invert_blocks, ar):
    """Invert the b0×b0 diagonal blocks of A = I + L as one batch with ``invert_blocks``, then
    couple them by Bunch–Hopcroft; pads to b0·2^k and crops back."""
    n = L.shape[-1]
    Lp = _pad_pow2(L, b0)
    X0 = _block_diag(invert_blocks(_diag_blocks(Lp, b0)))
    return _bunch_hopcroft(Lp, X0, b0, ar)[..., :n, :n]


def _blocked(L, ar):
    """Blocked recursion of kkt_solve (seed 000, §2.2): 16×16 diagonal blocks by forward
    substitution, all in parallel, then per level the coupling blocks −T11·L10·T00 by two
    products. Bottom-up this is Bunch–Hopcroft started from the forward-substitution blocks."""
    return _halving(L, BASE_BLOCK, lambda D: _forward_substitution(D, ar), ar)


def _mbh(L, ar):
    """MBH (paper Alg. 4) from 1×1 blocks, whose inverses are 1."""
    return _halving(L, 1, lambda D: torch.ones_like(D), ar)


def _mixed(L, ar, refine_blocks):
    """MXR (paper §3.4, Alg. 2): MCH on the 16×16 diagonal blocks (where it is still accurate),
    ``refine_blocks`` refinement steps on those block inverses (Alg. 2's r), then MBH."""
    def blocks(D):
        return _refine(D, _repeated_squaring(D, ar), refine_blocks, ar)
    return _halving(L, min(BASE_BLOCK, L.shape[-1]), blocks, ar)


def _newton_schulz(L, ar, iters, x0_scale):
    """Newton–Schulz (paper §3.5, Alg. 3): X ← 2X − X(AX) from X₀ = x0_scale·I.

    The residual obeys R_{k+1} = R_k², R_k = I − A X_k. From X₀ = I/n (the paper's
    I/n^{O(1)}, Prop. 3.2) every iterate stays bounded and ≈ 2 log₂ n steps converge. From
    X₀ = I, R_k = (−L)^(2^k) and X_k is exactly MCH's partial product: exact after ⌈log₂ n⌉
    steps in exact arithmetic, but with MCH's huge intermediates (fp16 overflow)."""
    n = L.shape[-1]
    eye = ar.eye(n, L)
    A = eye + L  # the stored input matrix; exact: disjoint supports
    X = eye * x0_scale
    for _ in range(iters):
        Y = ar.mm(A, X)
        X = ar.mm(X, Y, c=2 * X, negate=True)  # 2X is exact in binary floating point
    return X


def _refine(L, X, steps, ar):
    """Iterative refinement (paper §3.6, Alg. 6): R ← I − X A, X ← X + R X, ``steps`` times."""
    n = L.shape[-1]
    eye = ar.eye(n, L)
    A = eye + L
    for _ in range(steps):
        R = ar.mm(X, A, c=eye, negate=True)
        X = ar.mm(R, X, c=X)
    return X


# ---------------------------------------------------------------------------------------------
# The table and the public functions.

def _log2(x):
    return math.ceil(math.log2(x)) if x > 1 else 0


@dataclass(frozen=True)
class Method:
    """One inversion method and its costs (paper Table 2; seed 000 §2.3 for "blocked").

    ``products(n, iters)``: matrix products, counted as the paper does (one n×n product per
    GEMM call on the whole matrix; "vcs" uses vector operations only). ``depth(n, iters)``:
    dependent steps on the critical path, a product or one substitution row counting 1, with
    independent products overlapped (paper App. D.1). ``stability``: "stable" (forward error
    ≤ c·n^a·κ(A)^f·u with f constant, Def. 2.1 / Lem. 3.1), "conditionally" (log-stable, f
    growing like log n, or stable only as conjectured and once converged: accurate on
    well-conditioned A, which DeltaNet matrices are, Cor. 2.1), "unstable" (no such bound,
    App. C.5). ``kind``: "direct" or "iterative" (Table 2's Type column)."""

    kind: str
    stability: str
    products: Callable[[int, int | None], int]
    depth: Callable[[int, int | None], int]
    default_iters: Callable[[int], int] | None
    source: str
    fn: Callable

    def cost(self, n: int, iters: int | None = None, refine: int = 0) -> tuple[int, int]:
        """(matrix products, dependency depth) for an n×n inverse plus ``refine`` IR steps."""
        if iters is None and self.default_iters is not None:
            iters = self.default_iters(n)
        return self.products(n, iters) + 2 * refine, self.depth(n, iters) + 2 * refine


def _ns_default_iters(n):
    # The paper's "N_iter ≈ 2 log n" (§3.5) plus 2: from X₀ = I/n the identity part of the
    # residual decays like exp(−2^k / n), and 2⌈log₂ n⌉ alone leaves a 3e-5 error at n = 16
    # (fp64, correlated keys; measured); two more reach fp32 accuracy at every n ≤ 128.
    return 2 * _log2(n) + 2


METHODS: dict[str, Method] = {
    "vcs": Method(
        "direct", "stable", lambda n, it: 0, lambda n, it: n - 1, None,
        "row-wise forward substitution; paper Table 2 VCS, Lem. 3.1; seed 000 §2.1",
        lambda L, ar, it: _forward_substitution(L, ar)),
    "mcs": Method(
        "direct", "stable", lambda n, it: n - 1, lambda n, it: n - 1, None,
        "matrix column sweep; paper §3.1, Alg. 1, Lem. 3.1",
        lambda L, ar, it: _column_sweep(L, ar)),
    "blocked": Method(
        "direct", "stable",
        lambda n, it: 2 * _log2(n // BASE_BLOCK),
        lambda n, it: BASE_BLOCK - 1 + 2 * _log2(n // BASE_BLOCK), None,
        "kkt_solve blocked recursion, 16×16 forward substitution + coupling GEMMs; seed 000 "
        "§2.2–2.3 (depth 15 + 2 per level). Stable bases (Lem. 3.1) and ≤ 3 Bunch–Hopcroft "
        "levels for n ≤ 128, so MBH's log n factor stays a small constant",
        lambda L, ar, it: _blocked(L, ar)),
    "mbh": Method(
        "direct", "conditionally", lambda n, it: 2 * _log2(n), lambda n, it: 2 * _log2(n), None,
        "unrolled Bunch–Hopcroft, log-stable; paper §3.3, Alg. 4, App. C.3",
        lambda L, ar, it: _mbh(L, ar)),
    "mch": Method(
        "direct", "unstable",
        lambda n, it: 2 * _squarings(n), lambda n, it: _squarings(n) + 1, None,
        "Cayley–Hamilton by repeated squaring; paper §3.2, Alg. 5, App. C.5 (unstable)",
        lambda L, ar, it: _repeated_squaring(L, ar)),
    "mxr": Method(
        "direct", "conditionally",
        lambda n, it: 2 * _squarings(min(BASE_BLOCK, n)) + 2 * it + 2 * _log2(n / BASE_BLOCK),
        lambda n, it: _squarings(min(BASE_BLOCK, n)) + 1 + 2 * it + 2 * _log2(n / BASE_BLOCK),
        lambda n: 0,
        "mixed recursion: MCH on 16×16 blocks, `iters` IR steps on them, then MBH; paper §3.4, "
        "Alg. 2",
        lambda L, ar, it: _mixed(L, ar, it)),
    "newton_schulz": Method(
        "iterative", "conditionally", lambda n, it: 2 * it, lambda n, it: 2 * it,
        _ns_default_iters,
        "Newton–Schulz from the paper's X₀ = I/n (Prop. 3.2), stable as conjectured in §3.5 "
        "once converged; the NS-k of Table 4",
        lambda L, ar, it: _newton_schulz(L, ar, it, 1.0 / L.shape[-1])),
    "newton_schulz_identity": Method(
        "iterative", "unstable", lambda n, it: 2 * it, lambda n, it: 2 * it,
        _ns_default_iters,
        "Newton–Schulz from X₀ = I = diag(A⁻¹): its iterates are MCH's partial products "
        "(overflow in fp16 for correlated keys); kept for the study",
        lambda L, ar, it: _newton_schulz(L, ar, it, 1.0)),
}


def _resolve_dtypes(A, compute_dtype, product_dtype):
    cd = torch.promote_types(A.dtype, torch.float32) if compute_dtype is None else compute_dtype
    pd = cd if product_dtype is None else product_dtype
    for name, dt in (("compute_dtype", cd), ("product_dtype", pd)):
        if dt not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {dt!r}")
    return _Arith(cd, pd)


def _check_matrix(name, A):
    if not isinstance(A, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(A).__name__}")
    if A.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16/bf16/fp32/fp64), got {A.dtype}")
    if A.dim() < 2 or A.shape[-1] != A.shape[-2] or A.shape[-1] < 1:
        raise ValueError(f"{name} must be [..., n, n] with n ≥ 1, got shape {tuple(A.shape)}")


def _check_count(name, x):
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(f"{name} must be an int ≥ 0, got {x!r}")


def invert_unit_lower(A: torch.Tensor, method: str = "blocked", *, iters: int | None = None,
                      refine: int = 0, compute_dtype: torch.dtype | None = None,
                      product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of the unit lower triangular matrix ``A`` by one of :data:`METHODS`.

    Sources: Sobczyk et al., arXiv:2605.21325 (seed 001), Table 2 and §3 for "vcs", "mcs",
    "mbh", "mch", "mxr", "newton_schulz*" and refinement; the Qwen kkt_solve article (seed 000,
    §2.2) for "blocked". Differentiable by autograd (no in-place updates of tracked tensors).

    Args:
        A: ``[..., n, n]`` fp16/bf16/fp32/fp64, any device, batched over leading dims. Only the
            strictly lower triangle is read: the unit diagonal is implied and the upper triangle
            ignored (the LAPACK ``trtri`` convention for ``diag='U'``).
        method: a key of :data:`METHODS`: "vcs", "mcs", "blocked" (default; needs n % 16 == 0),
            "mbh", "mch" (unstable: on correlated keys wrong beyond n = 16, even in fp32 from
            n = 64; kept for the study), "mxr", "newton_schulz" (X₀ = I/n, the paper's start),
            "newton_schulz_identity" (X₀ = I; overflows like MCH; kept for the study).
        iters: Newton–Schulz: the number of iterations (default 2⌈log₂ n⌉ + 2, e.g. 14 at
            n = 64). "mxr": refinement steps on the 16×16 block inverses before the
            recursion (the paper's r in Alg. 2; default 0). Must stay None for the other
            methods.
        refine: iterative-refinement steps (:func:`refine_inverse`) applied to the result;
            works with every method. Default 0.
        compute_dtype: the dtype every matrix kept between steps, and the result, is rounded
            to. Default ``promote_types(A.dtype, float32)`` (the package's precision policy:
            the inverse in fp32). Pass fp16/bf16 to emulate the paper's low-precision runs.
        product_dtype: the dtype the operands of every product are rounded to; the products
            accumulate in fp32 (fp64 when compute_dtype is fp64). Default compute_dtype;
            compute fp32 with product bf16 emulates a bf16-input tensor-core GEMM.

    Returns:
        ``[..., n, n]`` in compute_dtype: A⁻¹, unit lower triangular. The unstable method can
        return inf/NaN in fp16 (overflow of its intermediate powers), as in the paper.

    Raises:
        TypeError: A is not a floating torch.Tensor.
        ValueError: A not square / empty; unknown method; "blocked" with n not a multiple of 16;
            iters given to a direct method or negative; refine negative; a dtype argument that
            is not a floating dtype.
    """
    _check_matrix("A", A)
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    n = A.shape[-1]
    if method == "blocked" and n % BASE_BLOCK:
        raise ValueError(f"method='blocked' needs n (A.shape[-1]) to be a multiple of "
                         f"{BASE_BLOCK}, got n={n}; use 'vcs', 'mbh' or 'mxr' for other sizes")
    spec = METHODS[method]
    if spec.default_iters is None:
        if iters is not None:
            raise ValueError(f"iters must be None for method={method!r} (a direct method without "
                             f"refinement steps), got {iters!r}")
    else:
        iters = spec.default_iters(n) if iters is None else iters
        _check_count("iters", iters)
    _check_count("refine", refine)
    ar = _resolve_dtypes(A, compute_dtype, product_dtype)
    L = A.tril(-1).to(ar.cd)
    return _refine(L, spec.fn(L, ar, iters), refine, ar)


def refine_inverse(A: torch.Tensor, X: torch.Tensor, steps: int = 1, *,
                   compute_dtype: torch.dtype | None = None,
                   product_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Improve an approximate inverse X of the unit lower triangular A by iterative refinement.

    Paper §3.6, Alg. 6 (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002):
    ``R = I − X A`` (one product accumulated onto I), ``X ← X + R X``; each step squares the
    residual, so a stable X gains digits until the working precision limits it.

    Args:
        A: ``[..., n, n]`` float tensor; as in :func:`invert_unit_lower`, only its strictly
            lower triangle is read.
        X: ``[..., n, n]`` float tensor, the approximate inverse, same shape and device as A.
        steps: number of refinement steps, an int ≥ 0.
        compute_dtype, product_dtype: as in :func:`invert_unit_lower` (compute_dtype defaults to
            ``promote_types(A.dtype, float32)``).

    Returns:
        ``[..., n, n]`` in compute_dtype.

    Raises:
        TypeError: A or X not a floating torch.Tensor.
        ValueError: bad shapes (A not square, X not shaped like A), steps < 0, bad dtypes.
    """
    _check_matrix("A", A)
    _check_matrix("X", X)
    if X.shape != A.shape:
        raise ValueError(f"X must have A's shape {tuple(A.shape)}, got {tuple(X.shape)}")
    _check_count("steps", steps)
    ar = _resolve_dtypes(A, compute_dtype, product_dtype)
    return _refine(A.tril(-1).to(ar.cd), X.to(ar.cd), steps, ar)
