"""Accuracy of the unit-lower-triangular inverse methods on DeltaNet matrices.

Reproduces the accuracy experiment of Sobczyk et al., arXiv:2605.21325 (seed 001, §4.1,
Fig. 2; App. D.2, Fig. 6 for the decay-scaled variant) with :mod:`gdn_fused.inverse`, plus the
numerical checks of the kkt_solve article (seed 000, §2.4 and §4). Run from the repository
root::

    python -m eval.inverse_accuracy [--samples 32] [--out out/inverse_accuracy] [--device cpu]

Matrices (n × n, rows of K are unit vectors of dimension ``--head-dim``):

- family "plain": A = I + strictLower(K Kᵀ)  (paper §4.1: beta = 1, no decay);
- family "decay": A = I + strictLower(D_beta (Γ ⊙ K Kᵀ)), Γ_ij = exp(G_i − G_j),
  G = cumsum(logsigmoid(U(0,1))), beta = sigmoid(U(0,1)) (flash-linear-attention's test
  gates);
- keys "sphere": K uniform on the unit sphere (normalised Gaussians); keys "orthant":
  normalised U(0,1)^d, i.e. positively correlated keys (mean cosine ≈ 0.75), the regime in
  which MCH fails the way the paper reports.

Each A is stored in fp32 / fp16 / bf16; every method runs with that storage dtype and fp32
product accumulation (``compute_dtype`` = storage dtype); errors are against the fp64 inverse
of the stored matrix, so they measure the algorithm, not the rounding of the input: max abs,
max relative over the lower triangle, Frobenius relative, each averaged over the samples (a
NaN in any sample makes the mean NaN, as in the paper's plots).

Writes to ``--out``: ``accuracy.csv`` (every number), ``ns_sweep.csv``, ``checks.csv``,
``results.md`` (markdown tables) and ``accuracy.png`` (Frobenius error vs n).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gdn_fused.inverse import METHODS, invert_unit_lower

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SIZES = (16, 32, 64, 128)
FAMILIES = ("plain", "decay")
KEYS = ("sphere", "orthant")
HEAD_DIM = 128  # Qwen3-Next / Qwen3.5 key head dim, and the article's DK
ARTICLE_SAMPLES = 200  # the article's sample count for cond(A) and the fp16-storage error
NS_SWEEP_ITERS = tuple(range(2, 17, 2))  # the paper's NS-2 … NS-14 (Table 4) and one more
NS_SWEEP_N = 64  # the chunk size of the paper's MMLU runs (SGLang's GDN kernels)


@dataclass(frozen=True)
class Variant:
    """One column of the study: a method of gdn_fused.inverse with its iteration settings."""

    label: str
    method: str
    iters: int | None = None
    refine: int = 0

    def run(self, A, dtype):
        return invert_unit_lower(A, self.method, iters=self.iters, refine=self.refine,
                                 compute_dtype=dtype)


VARIANTS = (
    Variant("vcs", "vcs"),
    Variant("mcs", "mcs"),
    Variant("blocked", "blocked"),
    Variant("mbh", "mbh"),
    Variant("mch", "mch"),
    Variant("mxr", "mxr"),
    Variant("mxr+ir1", "mxr", iters=1),  # paper: "remediated with a single step of IR"
    Variant("ns", "newton_schulz"),
    Variant("ns_identity", "newton_schulz_identity"),
)


def sample_deltanet(samples, n, *, family="plain", keys="sphere", head_dim=HEAD_DIM,
                    beta=None, generator=None, device="cpu"):
    """``[samples, n, n]`` fp64 DeltaNet matrices A = I + strictLower(D_beta (Γ ⊙ K Kᵀ)).

    family "plain": beta = 1 and Γ = 1 unless ``beta`` (``[samples, n]``) is given; "decay":
    beta = sigmoid(U(0,1)) (or ``beta``) and Γ_ij = exp(G_i − G_j) with G the cumulative sum of
    logsigmoid(U(0,1)) gates, masked to i > j before the exp so nothing overflows. keys:
    "sphere" (isotropic unit keys) or "orthant" (normalised U(0,1)^d, positively correlated).
    Raises ValueError for an unknown family or keys."""
    opts = dict(dtype=torch.float64, device=device, generator=generator)
    if keys == "sphere":
        K = torch.randn(samples, n, head_dim, **opts)
    elif keys == "orthant":
        K = torch.rand(samples, n, head_dim, **opts)
    else:
        raise ValueError(f"keys must be one of {KEYS}, got {keys!r}")
    K = F.normalize(K, dim=-1)
    M = K @ K.transpose(-1, -2)
    strict = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)
    if family == "decay":
        G = F.logsigmoid(torch.rand(samples, n, **opts)).cumsum(-1)
        diff = G[:, :, None] - G[:, None, :]
        M = M * torch.exp(torch.where(strict, diff, torch.full_like(diff, -math.inf)))
        if beta is None:
            beta = torch.rand(samples, n, **opts).sigmoid()
    elif family != "plain":
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if beta is not None:
        M = beta[:, :, None] * M
    eye = torch.eye(n, dtype=torch.float64, device=device)
    return eye + torch.where(strict, M, torch.zeros((), dtype=M.dtype, device=device))


def exact_inverse(A):
    """fp64 inverse of the unit lower triangular A (as stored), by triangular solve."""
    A64 = A.to(torch.float64)
    eye = torch.eye(A.shape[-1], dtype=torch.float64, device=A.device).expand_as(A64)
    return torch.linalg.solve_triangular(A64, eye, upper=False, unitriangular=True)


def errors(X, T):
    """Paper §4.1 metrics, each averaged over the leading (sample) dim: (max abs, max rel over
    the lower triangle, Frobenius relative). X is the computed inverse, T the fp64 truth."""
    D = X.to(torch.float64) - T
    max_abs = D.abs().amax(dim=(-1, -2))
    lower = torch.ones_like(T, dtype=torch.bool).tril()
    rel = torch.where(lower, D.abs() / T.abs(), torch.zeros_like(D))  # |T| > 0 on the diagonal
    max_rel = rel.nan_to_num(nan=0.0, posinf=math.inf).amax(dim=(-1, -2))
    # a NaN in X must stay visible: D is NaN there, and 0/0 only arises where X = T = 0
    max_rel = torch.where(D.isnan().any(-1).any(-1), torch.full_like(max_rel, math.nan), max_rel)
    frob = torch.linalg.matrix_norm(D) / torch.linalg.matrix_norm(T)
    return max_abs.mean().item(), max_rel.mean().item(), frob.mean().item()


def run_accuracy(samples, sizes, dtypes, head_dim, device, gen):
    rows = []
    configs = [(f, k, n, d) for f in FAMILIES for k in KEYS for n in sizes for d in dtypes]
    for family, keys, n, dname in tqdm(configs, desc="accuracy", unit="config"):
        A = sample_deltanet(samples, n, family=family, keys=keys, head_dim=head_dim,
                            generator=gen, device=device).to(DTYPES[dname])
        T = exact_inverse(A)
        for v in VARIANTS:
            max_abs, max_rel, frob = errors(v.run(A, DTYPES[dname]), T)
            rows.append(dict(family=family, keys=keys, n=n, dtype=dname, method=v.label,
                             max_abs=max_abs, max_rel=max_rel, frob_rel=frob))
    return rows


def run_ns_sweep(samples, head_dim, device, gen):
    """Frobenius error after k Newton–Schulz iterations (paper Fig. 3 / Table 4's NS-k)."""
    rows = []
    for keys in tqdm(KEYS, desc="ns sweep", unit="keys"):
        A64 = sample_deltanet(samples, NS_SWEEP_N, keys=keys, head_dim=head_dim, generator=gen,
                              device=device)
        for dname in ("fp32", "fp16"):
            A = A64.to(DTYPES[dname])
            T = exact_inverse(A)
            for method in ("newton_schulz", "newton_schulz_identity"):
                for k in NS_SWEEP_ITERS:
                    X = invert_unit_lower(A, method, iters=k, compute_dtype=DTYPES[dname])
                    rows.append(dict(keys=keys, dtype=dname, method=method, iters=k,
                                     frob_rel=errors(X, T)[2]))
    return rows


def run_article_checks(head_dim, device, gen):
    """The kkt_solve article's numbers (seed 000 §2.4 table, §4 table, summary item 11):
    cond₂(A), max |A_ij| below the diagonal, the relative (Frobenius) error of storing T in
    fp16, and the fp64 blocked inverse against an fp64 solve — over 200 samples with
    beta ~ U(0,1). The article used isotropic keys ("sphere"); "orthant" rows show how far
    correlated keys move these numbers."""
    rows = []
    configs = [(k, n) for k in KEYS for n in SIZES]
    for keys, n in tqdm(configs, desc="article checks", unit="config"):
        beta = torch.rand(ARTICLE_SAMPLES, n, dtype=torch.float64, device=device, generator=gen)
        A = sample_deltanet(ARTICLE_SAMPLES, n, keys=keys, head_dim=head_dim, beta=beta,
                            generator=gen, device=device)
        T = exact_inverse(A)
        cond = torch.linalg.cond(A)
        fp16 = (torch.linalg.matrix_norm(T.half().double() - T) / torch.linalg.matrix_norm(T))
        blocked = invert_unit_lower(A, "blocked").sub(T).abs().amax()
        rows.append(dict(keys=keys, n=n, cond_max=cond.max().item(),
                         cond_mean=cond.mean().item(),
                         max_offdiag=A.tril(-1).abs().max().item(),
                         max_abs_T_offdiag=T.tril(-1).abs().max().item(),
                         fp16_store_rel_mean=fp16.mean().item(),
                         fp16_store_rel_max=fp16.max().item(),
                         blocked_fp64_maxabs=blocked.item()))
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _fmt(x):
    return "nan" if math.isnan(x) else ("inf" if math.isinf(x) else f"{x:.1e}")


def methods_table(sizes):
    lines = ["| variant | method | type | stability | "
             + " | ".join(f"products / depth n={n}" for n in sizes) + " |",
             "|---|---|---|---|" + "---|" * len(sizes)]
    for v in VARIANTS:
        spec = METHODS[v.method]
        costs = [spec.cost(n, v.iters, v.refine) for n in sizes]
        lines.append(f"| {v.label} | {v.method} | {spec.kind} | {spec.stability} | "
                     + " | ".join(f"{p} / {d}" for p, d in costs) + " |")
    return lines


def accuracy_tables(rows, sizes, dtypes, metric):
    out = []
    index = {(r["family"], r["keys"], r["n"], r["dtype"], r["method"]): r[metric] for r in rows}
    for family in FAMILIES:
        for keys in KEYS:
            out += ["", f"**{family}, {keys} keys** — {metric}", "",
                    "| method | " + " | ".join(f"{d} n={n}" for d in dtypes for n in sizes) + " |",
                    "|---|" + "---|" * (len(dtypes) * len(sizes))]
            for v in VARIANTS:
                out.append(f"| {v.label} | " + " | ".join(
                    _fmt(index[family, keys, n, d, v.label]) for d in dtypes for n in sizes) + " |")
    return out


def ns_table(rows):
    out = ["| keys | dtype | start | " + " | ".join(f"NS-{k}" for k in NS_SWEEP_ITERS) + " |",
           "|---|---|---|" + "---|" * len(NS_SWEEP_ITERS)]
    for keys in KEYS:
        for dname in ("fp32", "fp16"):
            for method, start in (("newton_schulz", "I/n"), ("newton_schulz_identity", "I")):
                vals = [r["frob_rel"] for r in rows
                        if (r["keys"], r["dtype"], r["method"]) == (keys, dname, method)]
                out.append(f"| {keys} | {dname} | {start} | "
                           + " | ".join(_fmt(x) for x in vals) + " |")
    return out


def checks_table(rows):
    out = ["| keys | n | cond₂(A) max | cond₂(A) mean | max off-diag of A | max off-diag of T "
           "| fp16 T rel err mean | fp16 T rel err max | blocked fp64 max abs err |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['keys']} | {r['n']} | {r['cond_max']:.3f} | {r['cond_mean']:.3f} | "
                   f"{r['max_offdiag']:.3f} | {r['max_abs_T_offdiag']:.3f} | "
                   f"{_fmt(r['fp16_store_rel_mean'])} | {_fmt(r['fp16_store_rel_max'])} | "
                   f"{_fmt(r['blocked_fp64_maxabs'])} |")
    return out


def plot(path, rows, sizes, dtypes):
    """Frobenius relative error vs n, one panel per (dtype, family, keys); non-finite errors
    (fp16 overflow) are drawn as crosses at the top edge."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = 1e3  # errors beyond this are all "wrong"; clip so the panels stay readable
    panels = [(f, k) for f in FAMILIES for k in KEYS]
    fig, axes = plt.subplots(len(dtypes), len(panels), figsize=(4 * len(panels), 3 * len(dtypes)),
                             sharex=True, squeeze=False)
    for i, dname in enumerate(dtypes):
        for j, (family, keys) in enumerate(panels):
            ax = axes[i][j]
            for idx, v in enumerate(VARIANTS):
                ys = [next(r["frob_rel"] for r in rows if (r["family"], r["keys"], r["n"],
                      r["dtype"], r["method"]) == (family, keys, n, dname, v.label))
                      for n in sizes]
                line, = ax.plot(sizes, [min(y, top) if math.isfinite(y) else math.nan
                                        for y in ys], marker="o", ms=3, label=v.label)
                # nudge each variant's crosses sideways so coinciding NaNs stay distinguishable
                bad = [n * 2 ** (0.05 * (idx - len(VARIANTS) / 2))
                       for n, y in zip(sizes, ys) if not math.isfinite(y)]
                ax.plot(bad, [top] * len(bad), "x", color=line.get_color(), ms=8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_ylim(1e-10, top * 3)
            ax.set_title(f"{dname}, {family}, {keys} keys", fontsize=9)
            if j == 0:
                ax.set_ylabel("Frobenius rel. error")
            if i == len(dtypes) - 1:
                ax.set_xlabel("n")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.inverse_accuracy",
                                description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=16,
                   help="matrices per (family, keys, n, dtype) in the main tables; errors are "
                        "averaged over them (default 16; the article checks keep their 200 "
                        "samples at n = 16–128)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="N",
                   help="matrix sizes n of the main tables, multiples of 16 (default: "
                        f"{' '.join(map(str, SIZES))}; the article checks and the "
                        "Newton–Schulz sweep keep theirs)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help=f"storage dtypes of A (default: {' '.join(DTYPES)})")
    p.add_argument("--head-dim", type=int, default=HEAD_DIM,
                   help=f"dimension of the unit key vectors, >= 1 (default {HEAD_DIM})")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the matrices are built and inverted (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out", default=os.path.join("out", "inverse_accuracy"), metavar="DIR",
                   help="directory for accuracy.csv, ns_sweep.csv, checks.csv, results.md and "
                        "accuracy.png, created if missing (default out/inverse_accuracy)")
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be ≥ 1")
    if any(n < 16 or n % 16 for n in args.sizes):
        p.error(f"--sizes must be multiples of 16 (the blocked method's tile), got {args.sizes}")
    if args.head_dim < 1:
        p.error(f"--head-dim must be ≥ 1 (keys are unit vectors), got {args.head_dim}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out: {args.out} is a file; give the directory to write into")
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)

    acc = run_accuracy(args.samples, args.sizes, args.dtypes, args.head_dim, args.device, gen)
    sweep = run_ns_sweep(args.samples, args.head_dim, args.device, gen)
    checks = run_article_checks(args.head_dim, args.device, gen)
    write_csv(os.path.join(args.out, "accuracy.csv"), acc)
    write_csv(os.path.join(args.out, "ns_sweep.csv"), sweep)
    write_csv(os.path.join(args.out, "checks.csv"), checks)
    plot(os.path.join(args.out, "accuracy.png"), acc, args.sizes, args.dtypes)

    md = [f"# Inverse accuracy ({args.samples} samples per cell, head dim {args.head_dim}, "
          f"seed {args.seed}, {args.device})", "", "## Methods", ""]
    md += methods_table(args.sizes)
    md += ["", "## Frobenius relative error (mean over samples)"]
    md += accuracy_tables(acc, args.sizes, args.dtypes, "frob_rel")
    md += ["", "## Max abs error (mean over samples)"]
    md += accuracy_tables(acc, args.sizes, args.dtypes, "max_abs")
    md += ["", "## Max relative error on the lower triangle (mean over samples)"]
    md += accuracy_tables(acc, args.sizes, args.dtypes, "max_rel")
    md += ["", f"## Newton–Schulz sweep, n = {NS_SWEEP_N}, plain family, Frobenius relative "
           "error", ""] + ns_table(sweep)
    md += ["", f"## Article checks ({ARTICLE_SAMPLES} samples, beta ~ U(0,1))",
           ""] + checks_table(checks)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {args.out}/accuracy.csv, ns_sweep.csv, checks.csv, results.md, accuracy.png")


if __name__ == "__main__":
    main()
