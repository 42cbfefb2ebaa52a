"""Which backward kernel varies between runs on the same inputs (GPU).

    python -m eval.determinism [--T 8192] [--warps 2 4 8] [--scratch] [--cpu]

Runs the backward's chain of kernels (kernels/chunk_bwd.py) once to get every intermediate,
then calls each kernel twice more on those same inputs and prints, per output, the relative
difference between the two calls (0 means bit-identical). wu_bwd completes dk in place, so it
gets a fresh copy each call. ``--warps`` repeats chunk_bwd_dqkwg and wu_bwd at those
num_warps: Triton 3.4–3.7.0 miscompiles some gated backward kernels on Hopper (fla issues
#640 and #984: a transposed MMA-layout operand, num_warps = 4 at a 64-token chunk), and a
config that varies run to run points at such a miscompilation. ``--scratch`` repeats
chunk_bwd_dv_local, chunk_bwd_dqkwg and wu_bwd with their transposes of tl.dot results through
global scratch (kernels/scratch_transpose.py, the workaround). ``--cpu`` runs the same chain
in fp32 under TRITON_INTERPRET=1 (a check of this script; the interpreter is deterministic).
Run it from the repository root: its inputs and error measure are tests/cases.py's.
"""
import argparse

import torch


def _twice(name, fn, names):
    """fn() twice; one line with each output's relative difference between the calls."""
    from tests.cases import rel_err
    first, second = fn(), fn()
    diffs = {n: f"{rel_err(x, y):.1e}" for n, x, y in zip(names, first, second) if x is not None}
    print(f"{name}: {diffs}", flush=True)
    return first


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.determinism", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--warps", type=int, nargs="*", default=[])
    p.add_argument("--scratch", action="store_true",
                   help="also the transposes through global scratch")
    p.add_argument("--cpu", action="store_true", help="fp32 under the interpreter")
    args = p.parse_args(argv)
    if args.cpu:
        import os
        os.environ["TRITON_INTERPRET"] = "1"
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import dot_precision
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.kernels.wu import recompute_w_u
    from gdn_fused.kernels.wu_bwd import wu_bwd
    from tests.cases import make_inputs
    B, T, H, HV = 1, args.T, 2, 4
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, dtype, initial_state=True,
                                       device=device, seed=11)
    gen = torch.Generator(device=device).manual_seed(12)
    do = torch.randn(v.shape, generator=gen, device=device).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, device=device)
    scale, C, prec = 128 ** -0.5, 64, dot_precision(q.dtype)
    G = _twice("chunk_cumsum", lambda: (chunk_cumsum(g, C),), ["G"])[0]
    Ai = _twice("chunk_inverse (fp32 T)",
                lambda: (chunk_inverse(k, G, beta, HV, C, torch.float32),), ["T"])[0]
    w, u = _twice("recompute_w_u", lambda: recompute_w_u(k, v, G, beta, Ai, dot_precision=prec),
                  ["w", "u"])
    h, v_new, _ = _twice("chunk_state", lambda: chunk_state(k, w, u, G, h0, False, C, B,
                                                            dot_precision=prec),
                         ["h", "v_new", "ht"])
    dv_local = _twice("chunk_bwd_dv_local", lambda: (chunk_bwd_dv_local(
        q, k, g, do, scale, C, dot_precision=prec),), ["dv_local"])[0]
    if args.scratch:
        _twice("chunk_bwd_dv_local scratch", lambda: (chunk_bwd_dv_local(
            q, k, g, do, scale, C, dot_precision=prec, transpose_scratch=True),), ["dv_local"])
    dh, dv2, _ = _twice("chunk_bwd_state", lambda: chunk_bwd_state(
        q, k, w, g, do, dv_local, scale, dht, h0, C, B, dot_precision=prec),
        ["dh", "dv2", "dh0"])
    variants = [(None, False)] + [(w, False) for w in args.warps]
    if args.scratch:
        variants.append((None, True))
    for warps, scratch in variants:
        launch = dict(transpose_scratch=scratch)
        if warps is not None:
            launch["num_warps"] = warps
        tag = ("" if warps is None else f" num_warps={warps}") + (" scratch" if scratch else "")
        dq, dk, dw, dg_part = _twice(f"chunk_bwd_dqkwg{tag}", lambda: chunk_bwd_dqkwg(
            q, k, v_new, h, dh, g, do, dv2, scale, C, dot_precision=prec, **launch),
            ["dq", "dk", "dw", "dg_part"])
        def wu(dk_done):  # dk is completed in place: a fresh copy each call
            return (*wu_bwd(k, v, g, beta, Ai, dw, dv2, dk_done, dg_part, C,
                            dot_precision=prec, **launch), dk_done)
        _twice(f"wu_bwd{tag}", lambda: wu(dk.clone()), ["dv", "dbeta", "dg", "dk"])


if __name__ == "__main__":
    main()
