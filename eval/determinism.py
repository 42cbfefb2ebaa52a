"""Which backward kernel varies between runs on the same inputs (GPU).

    python -m eval.determinism [--T 8192] [--warps 2 4 8] [--stages 1 2 3] [--cpu]

Runs the backward's chain of kernels (kernels/chunk_bwd.py) once to get every intermediate,
then calls each kernel twice more on those same inputs and prints, per output, the relative
difference between the two calls (0 means bit-identical). wu_bwd completes dk in place, so it
gets a fresh copy each call. ``--warps`` and ``--stages`` repeat chunk_bwd_dqkwg and wu_bwd
at those launch options; on Hopper (materialized.gluon_tiles_apply) the Gluon forms of the
reverse state pass and wu_bwd run twice too (the persistent wu_bwd over several groups an
SM at T = 8192). A kernel that varies run to run without atomics reads memory another
part of it is still writing, which is how Triton 3.6's software pipelining of wu_bwd's key loop
showed (``--stages 2``: dβ and dg differ on every run; wu_bwd.STAGES, docs/backward.md,
"Determinism"). tests/test_backward.py runs this at 4 and 8 warps on the GPU and asserts every
difference is 0. ``--cpu`` runs the same chain
in fp32 under TRITON_INTERPRET=1 (a check of this script; the interpreter is deterministic).
Its inputs and error measure are eval/cases.py's (gdn_fused.eval.cases).
"""
import argparse

import torch

from .cli import positive_int


def _twice(diffs, name, fn, names):
    """fn() twice; records (and prints) each output's relative difference between the calls
    in ``diffs[name]``; returns the first call's outputs."""
    from gdn_fused.eval.cases import rel_err
    first, second = fn(), fn()
    diffs[name] = {n: rel_err(x, y) for n, x, y in zip(names, first, second) if x is not None}
    print(f"{name}: " + str({n: f"{d:.1e}" for n, d in diffs[name].items()}), flush=True)
    return first


def run_twice(T=8192, launches=(), device="cuda", dtype=torch.bfloat16):
    """Every backward kernel twice on the same inputs (B = 1, H = 2, HV = 4, K = V = 128);
    chunk_bwd_dqkwg and wu_bwd also under each dict of launch options in ``launches``
    (num_warps, num_stages). Returns {kernel label: {output: relative difference}}."""
    from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import dot_precision
    from gdn_fused.kernels.kkt_solve import chunk_inverse, default_inverse_dtype
    from gdn_fused.kernels.materialized import gluon_tiles_apply
    from gdn_fused.kernels.wu import recompute_w_u
    from gdn_fused.kernels.wu_bwd import wu_bwd
    from gdn_fused.eval.cases import make_inputs
    B, H, HV = 1, 2, 4
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, dtype, initial_state=True,
                                       device=device, seed=11)
    gen = torch.Generator(device=device).manual_seed(12)
    do = torch.randn(v.shape, generator=gen, device=device).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, device=device)
    scale, C, prec = 128 ** -0.5, 64, dot_precision(q.dtype)
    d = {}
    G = _twice(d, "chunk_cumsum", lambda: (chunk_cumsum(g, C),), ["G"])[0]
    Ai = _twice(d, "chunk_inverse", lambda: (chunk_inverse(k, G, beta, HV, C,
                                                           default_inverse_dtype(q.dtype)),),
                ["T"])[0]
    w, u = _twice(d, "recompute_w_u",
                  lambda: recompute_w_u(k, v, G, beta, Ai, dot_precision=prec), ["w", "u"])
    h, v_new, _ = _twice(d, "chunk_state", lambda: chunk_state(k, w, u, G, h0, False, C, B,
                                                               dot_precision=prec),
                         ["h", "v_new", "ht"])
    dv_local = _twice(d, "chunk_bwd_dv_local", lambda: (chunk_bwd_dv_local(
        q, k, g, do, scale, C, dot_precision=prec),), ["dv_local"])[0]
    dh, dv2, _ = _twice(d, "chunk_bwd_state", lambda: chunk_bwd_state(
        q, k, w, g, do, dv_local, scale, dht, h0, C, B, dot_precision=prec),
        ["dh", "dv2", "dh0"])
    for launch in [{}] + list(launches):
        tag = "".join(f" {a}={b}" for a, b in launch.items())
        dq, dk, dw, dg_part = _twice(d, f"chunk_bwd_dqkwg{tag}", lambda: chunk_bwd_dqkwg(
            q, k, v_new, h, dh, g, do, dv2, scale, C, dot_precision=prec, **launch),
            ["dq", "dk", "dw", "dg_part"])
        def wu(dk_done):  # dk is completed in place: a fresh copy each call
            return (*wu_bwd(k, v, g, beta, Ai, dw, dv2, dk_done, dg_part, C,
                            dot_precision=prec, **launch), dk_done)
        _twice(d, f"wu_bwd{tag}", lambda: wu(dk.clone()), ["dv", "dbeta", "dg", "dk"])
    if gluon_tiles_apply(q, do, C, None):
        from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
        from gdn_fused.kernels.gluon_wu_bwd import wu_bwd_gluon
        _, rows = chunk_cumsum(g, C, gate_rows=[])
        _twice(d, "chunk_bwd_state gluon", lambda: chunk_bwd_state_t(
            q, k, w, rows, do, dv_local, scale, dht, h0), ["dh", "dv2", "dh0"])
        _twice(d, "wu_bwd gluon", lambda: wu_bwd_gluon(
            k, v, G, beta, Ai, dw, dv2, dk, dg_part, g.dtype), ["dk", "dv", "dbeta", "dg"])
    return d


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.determinism", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=positive_int, default=8192)
    p.add_argument("--warps", type=int, nargs="*", default=[],
                   help="also chunk_bwd_dqkwg and wu_bwd at these num_warps")
    p.add_argument("--stages", type=positive_int, nargs="*", default=[],
                   help="also chunk_bwd_dqkwg and wu_bwd at these num_stages")
    p.add_argument("--cpu", action="store_true", help="fp32 under the interpreter")
    args = p.parse_args(argv)
    bad = [w for w in args.warps if w not in (1, 2, 4, 8, 16, 32)]
    if bad:
        p.error(f"--warps must be powers of two up to 32 (Triton's num_warps), got {bad}")
    if not args.cpu and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --cpu: fp32 under the interpreter)")
    if args.cpu:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    launches = [dict(num_warps=w) for w in args.warps] + [dict(num_stages=s)
                                                          for s in args.stages]
    run_twice(args.T, launches, device, dtype)


if __name__ == "__main__":
    main()
