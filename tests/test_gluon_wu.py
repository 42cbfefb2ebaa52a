"""The experimental Gluon w, u kernel: its sm_90a PTX on any machine; its inverse's arithmetic
(forward substitution, two 3×TF32 merges) modelled in PyTorch against the fp64 inverse; and on a
Hopper GPU the same w, u as kkt_solve_from_k + recompute_w_u."""
import pytest
import torch

from gdn_fused.eval.ptxas import _kernels, compile_report
from gdn_fused.eval.cases import make_inputs, rel_err

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels import gluon_wu  # noqa: E402
from gdn_fused.kernels.gluon_ring import accumulator_layout  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def _inverse_kernel(A, T, BT: gl.constexpr):
    """gluon_wu.invert alone, on one [BT, BT] fp32 matrix a program: isolates the inverse when
    the w, u test fails on a GPU."""
    acc: gl.constexpr = accumulator_layout(BT)
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, acc))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, acc))
    offs = gl.program_id(0) * BT * BT + o_r[:, None] * BT + o_c[None, :]
    X = gluon_wu.invert(gl.load(A + offs), gluon_wu.inverse_scratch(BT))
    gl.store(T + offs, X)


def test_compiles_to_a_tma_wgmma_kernel_for_hopper():
    """The signature and launch options are eval.ptxas' entry for this kernel."""
    build, options = _kernels()["w, u gluon (experimental)"]
    r = compile_report(*build(), **options)
    f = r["features"]
    # measured (Triton 3.6): 40 wgmma — K Kᵀ 8 (k-steps of 16), the second merge 2 products
    # × 3 (hi/lo) × 4 TF32 k-steps = 24, W and U 4 each; 2 TMA loads (k, v: each 128-column
    # tile two 64-column boxes, issued by two warps from one instruction); no producer warp,
    # so no setmaxnreg; the first merge is on CUDA cores, so no mma.sync either
    assert f["wgmma"] == 40 and f["tma"] == 2 and f["mbarrier"] > 0
    assert f["setmaxnreg"] == 0 and f["mma.sync"] == 0
    # measured 148 registers, no spills: three programs' 128 threads fit an SM's 64 K
    assert r["registers"] <= 168 and r["spill_stores"] == 0 and r["spill_loads"] == 0
    # k, v [64, 128] bf16 (16 KB each), the fp32 scratch [64, 64] (16 KB), the neighbour
    # buffer (8 KB), the hi/lo B operands [64, 32] fp32 (8 KB each), two mbarriers: 73,744 B,
    # so three programs fit an SM's 227 KB
    assert 72 * 1024 <= r["shared"] <= 227 * 1024 // 3


def test_inverse_kernel_compiles():
    r = compile_report(_inverse_kernel, {"A": "*fp32", "T": "*fp32"}, {"BT": 64}, num_warps=4)
    # the second merge: 2 products × 3 × 4 TF32 k-steps
    assert r["features"]["wgmma"] == 24 and r["spill_stores"] == 0


def test_unsupported_inputs_are_refused():
    f = gluon_wu.wu_gluon
    G = torch.zeros(1, 64, 2, dtype=torch.float64)
    k = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K = V = 128"):
        f(k, k, G, G)
    k = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        f(k.float(), k, G, G)
    with pytest.raises(ValueError, match="bf16"):
        f(k, k.half(), G, G)
    v = torch.zeros(1, 64, 3, 128, dtype=torch.bfloat16)  # 3 value heads over 2 key heads
    G3 = torch.zeros(1, 64, 3)
    with pytest.raises(ValueError, match="do not match"):
        f(k, v, G3, G3)
    with pytest.raises(ValueError, match="do not match"):
        f(k, k, G, torch.zeros(1, 32, 2))


def _tf32(x, nearest):
    """x as TF32 (10 explicit mantissa bits): rounded to nearest like the kernel's hi, or
    truncated like the tensor core's reading of an fp32 operand."""
    bits = x.view(torch.int32)
    if nearest:
        bits = bits + 4096
    return (bits & -8192).view(torch.float32)


def _dot_3xtf32(a, b):
    """The kernel's product: hi = TF32(x), lo = x − hi as read by TF32 hardware, lo·hi + hi·lo
    + hi·hi accumulated in fp32 (modelled by an fp64 sum rounded once)."""
    a_hi, b_hi = _tf32(a, True), _tf32(b, True)
    a_lo, b_lo = _tf32(a - a_hi, False), _tf32(b - b_hi, False)
    d = lambda x, y: x.double() @ y.double()  # noqa: E731
    return (d(a_lo, b_hi) + d(a_hi, b_lo) + d(a_hi, b_hi)).float()


def _block_matmul(X, Y):
    """The kernel's exact-fp32 block products: 16 rank-1 updates in fp32, in order."""
    P = torch.zeros_like(X)
    for m in range(X.shape[-1]):
        P = P + X[..., :, m, None] * Y[..., None, m, :]
    return P


def kernel_inverse(A):
    """The kernel's inverse of I + A (A [..., 64, 64] fp32 strictly lower) in PyTorch: the
    16 × 16 diagonal blocks by fp32 forward substitution; the 32 × 32 diagonal blocks by
    T_{b,b−1} = −T_bb A_{b,b−1} T_{b−1,b−1} in exact fp32; then T_LL = −T_BB (A_LL T_AA) for
    the 32 × 32 halves in 3×TF32."""
    n, b = A.shape[-1], gluon_wu.BLOCK.value
    X = torch.zeros_like(A)
    for s in range(0, n, b):
        L = A[..., s:s + b, s:s + b]
        Y = -L.clone()
        for i in range(2, b):
            Y[..., i, :] = -L[..., i, :] + (-L[..., i, :, None] * Y).sum(-2)
        X[..., s:s + b, s:s + b] = Y + torch.eye(b)
    for s in range(0, n, 2 * b):  # the first merge: exact fp32 on CUDA cores
        lo, hi = slice(s, s + b), slice(s + b, s + 2 * b)
        X[..., hi, lo] = -_block_matmul(X[..., hi, hi],
                                        _block_matmul(A[..., hi, lo], X[..., lo, lo]))
    lo, hi = slice(0, n // 2), slice(n // 2, n)  # the second merge: 3×TF32 wgmma
    X[..., hi, lo] = -_dot_3xtf32(X[..., hi, hi], _dot_3xtf32(A[..., hi, lo], X[..., lo, lo]))
    return X


@pytest.mark.parametrize("gate", ["normal", "zero", "strong"])
def test_inverse_method_is_fp32_accurate(gate):
    """The arithmetic the kernel runs, against the fp64 inverse of the same A (as
    kkt_solve_from_k forms it: strictLower(diag(β)(Γ ⊙ K Kᵀ)), L2-normalised k,
    β ∈ [0, 1])."""
    A, ref = _deltanet_matrices(gate)
    T = kernel_inverse(A)
    # measured 5e-10 (normal), 2e-8 (zero), ~0 (strong: A underflows), as an fp32 triangular
    # solve (6e-10, 2e-8); a single-pass TF32 second merge would give 3e-6 and 1e-4. The bf16
    # rounding of T before W and U is 6e-5 .. 4e-4 on the same matrices.
    assert rel_err(T, ref) <= 1e-6


def _deltanet_matrices(gate, device="cpu"):
    """8 chunks' A = strictLower(diag(β)(Γ ⊙ K Kᵀ)) in fp32, as kkt_solve_from_k forms it
    (L2-normalised k, β ∈ [0, 1]), and the fp64 inverse of I + A."""
    _, k, _, g, beta, _ = make_inputs(8, 64, 1, 1, 128, 128, gate=gate, seed=7)
    G = g.double().cumsum(1)[..., 0]  # [8, 64]: one chunk per sequence
    k = k[:, :, 0].double()
    strict = torch.ones(64, 64).tril(-1).bool()
    diff = torch.where(strict, G[:, :, None] - G[:, None, :], 0.)
    A = torch.where(strict, (k @ k.transpose(1, 2)) * diff.exp(), 0.) * beta[..., 0, None]
    eye = torch.eye(64, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(eye + A, eye.expand(8, 64, 64), upper=False,
                                        unitriangular=True)
    return A.float().to(device), ref


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["normal", "zero", "strong"])
def test_inverse_on_gpu(gate):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA needs sm_90 (Hopper)")
    A, ref = _deltanet_matrices(gate, "cuda")
    T = torch.empty_like(A)
    _inverse_kernel[(A.shape[0],)](A, T, BT=64, num_warps=4)
    torch.cuda.synchronize()
    # the PyTorch model of the same arithmetic: 5e-10 .. 2e-8
    assert rel_err(T, ref) <= 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, HV, gate", [
    (1, 64, 1, 1, "normal"),
    (1, 200, 2, 2, "normal"),  # T not a multiple of 64: the last chunk is partial
    (2, 256, 2, 4, "normal"),  # GVA: two value heads per key head, two sequences
    (2, 200, 1, 2, "normal"),  # partial chunk followed by the next sequence's rows in the tile
    (3, 130, 1, 2, "strong"),  # e^{G_i − G_j} above the diagonal overflows unmasked
    (2, 192, 2, 2, "zero"),    # g = 0 exactly: Γ = 1, the least damped A
])
def test_matches_kkt_solve_and_recompute_w_u(B, T, H, HV, gate):
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt import dot_precision
    from gdn_fused.kernels.kkt_solve import kkt_solve_from_k
    from gdn_fused.kernels.wu import recompute_w_u
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("warpgroup MMA and TMA need sm_90 (Hopper)")
    _, k, v, g, beta, _ = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, gate=gate,
                                      device="cuda", seed=T + HV)
    G = chunk_cumsum(g, 64)
    w, u = gluon_wu.wu_gluon(k, v, G, beta)
    # T stored in bf16 is what recompute_w_u would round it to; and the same kernel variants as
    # the other Gluon tests' inputs, so within gpu_check.sh they come from Triton's cache
    Ai = kkt_solve_from_k(k, G, beta, HV, 64, torch.bfloat16)
    w_ref, u_ref = recompute_w_u(k, v, G, beta, Ai, dot_precision=dot_precision(k.dtype))
    torch.cuda.synchronize()
    assert w.shape == w_ref.shape and u.shape == u_ref.shape and w.dtype == torch.bfloat16
    assert torch.isfinite(w).all() and torch.isfinite(u).all()
    assert rel_err(w, w_ref) <= 1e-2
    assert rel_err(u, u_ref) <= 1e-2
