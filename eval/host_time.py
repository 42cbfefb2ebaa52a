"""Host time against device time of one forward call, per backend (GPU machine).

    python -m eval.host_time [--shapes 1:2048,1:8192] [--profile fused]

At short sequences a forward is bound by the host: do_bench's events then time the Python and
launch work of the call, not its kernels. For each shape and backend (fused, materialized, both
again on their Hopper routes where the shape is below the routes' token threshold, and fla 0.6.0
if importable) this prints

- ``api_ms``: do_bench median of the call as users make it;
- ``graph_ms``: do_bench median of a CUDA-graph replay of the same call (no host work: the
  kernels' own time);
- ``host_ms``: wall time per call of 50 calls issued without synchronising (the host's cost
  of a call; when it exceeds graph_ms, the call is host-bound);

and, with --profile, the functions taking the most host time in those calls (cProfile, sorted
by own time), to say where the host time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from unittest import mock

import torch

from .bench import DIM, _shapes, graph_ms, load_fla, make_inputs

CALLS = 50


def _host_ms(fn, calls=CALLS, repeats=5):
    """Wall ms per call of ``calls`` calls issued back to back without synchronising, the best
    of ``repeats`` runs (the host is shared and noisy: ±0.3 ms between runs of one call)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best * 1e3 / calls


def _host_ms_ab(fn_a, fn_b, calls=CALLS, repeats=7):
    """(host ms of fn_a, of fn_b) as :func:`_host_ms`, their runs interleaved so that the
    host's drift (2× between processes, and within one) falls on both alike."""
    a, b = float("inf"), float("inf")
    for _ in range(repeats):
        a = min(a, _host_ms(fn_a, calls, 1))
        b = min(b, _host_ms(fn_b, calls, 1))
    return a, b


def _profile(fn, calls=CALLS, top=25):
    """The ``top`` functions by own host time over ``calls`` calls, as cProfile prints them."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


# the calls --profile may name (calls_for's keys; the "route" ones below the routes' token
# threshold only)
PROFILED_NAMES = frozenset({"fused", "materialized", "fused route", "materialized route", "fla"})


def calls_for(B, T):
    """{name: forward call} for the backends measured at (B, T)."""
    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.kernels import materialized
    q, k, v, g, beta, h0 = make_inputs(B, T)
    calls = {name: (lambda name=name: chunk_gated_delta_rule(
        q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0, output_final_state=True,
        backend=name)) for name in ("fused", "materialized")}
    if B * T < materialized.MIN_TOKENS_STATE_OUTPUT_KERNEL:
        # the Hopper routes below their token threshold: their device time where the host binds
        def routed(name):
            with mock.patch.object(materialized, "MIN_TOKENS_STATE_OUTPUT_KERNEL", 0):
                return calls[name]()
        calls["fused route"] = lambda: routed("fused")
        calls["materialized route"] = lambda: routed("materialized")
    fla_chunk, _ = load_fla()
    if fla_chunk is not None:
        calls["fla"] = lambda: fla_chunk(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0,
                                         output_final_state=True)
    return calls


def _with_grad_mode(fn):
    """fn() with autograd's grad mode on (eval.bench times calls so; the inputs need no grad)."""
    with torch.enable_grad():
        return fn()


def _jit_launches(fn):
    """fn() with kernels/launch.py's direct launches off (every launch through Triton's JIT;
    the switch costs two attribute writes, not a mock.patch, to stay out of the timing)."""
    from gdn_fused.kernels import launch
    was, launch.DIRECT = launch.DIRECT, False
    try:
        return fn()
    finally:
        launch.DIRECT = was


def breakdown(B, T, profile=False):
    """Host ms per call of each piece of the fused backend's Hopper route at (B, T) (forced on
    below its token threshold, restored after), from the API call down to one empty launch."""
    from gdn_fused.kernels import materialized
    with mock.patch.object(materialized, "MIN_TOKENS_STATE_OUTPUT_KERNEL", 0):
        _time_pieces(B, T, profile)


def _time_pieces(B, T, profile):
    import triton
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.kernels import fused_fwd, gluon_transposed
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.validation import check_inputs

    @triton.jit
    def noop(x):
        pass

    q, k, v, g, beta, h0 = make_inputs(B, T)
    scale = DIM ** -0.5
    G = chunk_cumsum(g, 64)
    Ai = chunk_inverse(k, G, beta, v.shape[2], 64, torch.bfloat16)
    x = v.view(B * T, -1)
    HV = v.shape[2]
    G, rows = chunk_cumsum(g, 64, gate_rows=[beta], chain_rows=gluon_transposed.T_ON_CHAIN)
    op_args = (q, k, v, g, beta, scale, h0, True, None, 64, 0, True, 0, 0, 0, None, True)
    fla_chunk, _ = load_fla()
    pieces = {
        "chunk_gated_delta_rule fused": lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
            backend="fused"),
        "chunk_gated_delta_rule materialized": lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
            backend="materialized"),
        "chunk_gated_delta_rule fused, Triton's JIT launches": lambda: _jit_launches(
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                           output_final_state=True, backend="fused")),
        "chunk_gated_delta_rule fused, grad mode on": lambda: _with_grad_mode(
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                           output_final_state=True, backend="fused")),
        "fla": (lambda: fla_chunk(q, k, v, g, beta, scale=scale, initial_state=h0,
                                  output_final_state=True)) if fla_chunk else None,
        "check_inputs": lambda: check_inputs(q, k, v, g, beta, h0, None, "fused", False),
        "fused_fwd (eager)": lambda: fused_fwd.fused_fwd(q, k, v, g, beta, scale, h0, True, None),
        "the custom op": lambda: fused_fwd._fused_fwd_op(*op_args),
        "its implementation": lambda: fused_fwd._fused_fwd_impl(*op_args),
        "_warp_specialized_fwd": lambda: fused_fwd._warp_specialized_fwd(
            q, k, v, g, beta, scale, h0, True, 64),
        "_warp_specialized_fwd, Triton's JIT launches": lambda: _jit_launches(
            lambda: fused_fwd._warp_specialized_fwd(q, k, v, g, beta, scale, h0, True, 64)),
        "chunk_cumsum": lambda: chunk_cumsum(g, 64),
        "chunk_cumsum with gate rows": lambda: chunk_cumsum(
            g, 64, gate_rows=[beta], chain_rows=gluon_transposed.T_ON_CHAIN),
        "gate rows laid out from G": lambda: gluon_transposed._rows_given_or_laid_out(
            "forward_t", None, [G, beta], B, T, HV, chain_rows=gluon_transposed.T_ON_CHAIN),
        "chunk_inverse": lambda: chunk_inverse(k, G, beta, HV, 64, torch.bfloat16),
        "forward_t given the rows": lambda: gluon_transposed.forward_t(
            q, k, v, G, beta, Ai, scale, h0, True, gate_rows=rows),
        "forward_t": lambda: gluon_transposed.forward_t(q, k, v, G, beta, Ai, scale, h0, True),
        "descriptor x6": lambda: [TensorDescriptor.from_tensor(x, [64, 128],
                                                               descriptor_layout([64, 128]))
                                  for _ in range(6)],
        "empty triton launch": lambda: noop[(1,)](x),
        "torch.empty": lambda: torch.empty(16, device="cuda"),
    }
    with torch.no_grad():
        # A/B of the direct launches (kernels/launch.py), interleaved
        for name in ("chunk_gated_delta_rule fused", "_warp_specialized_fwd"):
            jit = f"{name}, Triton's JIT launches"
            pieces[name](), pieces[jit]()
            a, b = _host_ms_ab(pieces[name], pieces[jit])
            print(dict(B=B, T=T, piece=f"{name}: direct launches {a:.4f} ms, JIT launches "
                       f"{b:.4f} ms (interleaved)"), flush=True)
        for name, fn in pieces.items():
            if fn is None:
                continue
            fn()
            print(dict(B=B, T=T, piece=name, host_ms=round(_host_ms(fn), 4)), flush=True)
        if profile:
            for name in ("forward_t", "chunk_inverse"):
                text = io.StringIO()
                prof = cProfile.Profile()
                prof.runcall(lambda: [pieces[name]() for _ in range(CALLS)])
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
                print(name, text.getvalue(), flush=True)


class _Capture:
    """Stands in for a JIT kernel: ``[grid](*args, **kwargs)`` records the launch, runs nothing."""

    def __init__(self):
        self.last = None

    def __getitem__(self, grid):
        # the last launch only: keeping every call's tensors alive would make each call's
        # allocations new cudaMallocs, and time those
        def record(*args, **kwargs):
            self.last = (grid, args, kwargs)
        return record


def _launch_pieces(name, module, attr, call):
    """Host ms of one launcher's pieces: ``call()`` with the kernel ``module.attr`` replaced by
    a recorder (the launcher's own Python: checks, allocations, descriptors), then its last
    recorded launch through Triton's JIT (``fn[grid](...)``: binding, specialization, cache
    key, the globals check, the launch), Triton's generated binder alone, and the compiled
    kernel launched directly (``CompiledKernel[grid](*all_args)``, no binding)."""
    import triton
    fn = getattr(module, attr)
    capture = _Capture()
    with mock.patch.object(module, attr, capture):
        print(dict(piece=f"{name}: its Python, no launch", host_ms=round(_host_ms(call), 4)),
              flush=True)
    grid, args, kwargs = capture.last
    compiled = fn[grid](*args, **kwargs)
    device = triton.runtime.driver.active.get_current_device()
    binder = fn.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    everything = list(bound.values())
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    for piece, f in ((f"{name}: JIT launch", lambda: fn[grid](*args, **kwargs)),
                     (f"{name}: the JIT's binder alone", lambda: binder(*args, **kwargs)),
                     (f"{name}: the compiled kernel launched directly",
                      lambda: compiled[grid3](*everything))):
        print(dict(piece=piece, host_ms=round(_host_ms(f), 4)), flush=True)


def launch_breakdown(B, T):
    """Host ms of the fused route's two Gluon launchers, split as :func:`_launch_pieces`
    does, at (B, T) (the route forced on below its token threshold)."""
    from gdn_fused.kernels import gluon_kkt_solve, gluon_transposed, materialized
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    q, k, v, g, beta, h0 = make_inputs(B, T)
    HV = v.shape[2]
    with torch.no_grad(), mock.patch.object(materialized, "MIN_TOKENS_STATE_OUTPUT_KERNEL", 0):
        G, rows = chunk_cumsum(g, 64, gate_rows=[beta], chain_rows=gluon_transposed.T_ON_CHAIN)
        Ai = chunk_inverse(k, G, beta, HV, 64, torch.bfloat16)
        print(dict(B=B, T=T, piece="get_device_capability", host_ms=round(_host_ms(
            lambda: torch.cuda.get_device_capability(q.device)), 4)), flush=True)
        print(dict(B=B, T=T, piece="check_state_inputs", host_ms=round(_host_ms(
            lambda: gluon_transposed.check_state_inputs(
                "forward_t", q, k, v, G, h0, None,
                (("v", v, 128), ("Ai", Ai, 64)))), 4)), flush=True)
        _launch_pieces("forward_t", gluon_transposed, "chunk_state_output_t_kernel",
                       lambda: gluon_transposed.forward_t(q, k, v, G, beta, Ai, DIM ** -0.5, h0,
                                                          True, gate_rows=rows))
        roles = gluon_kkt_solve.uses_roles(k.device,
                                           gluon_kkt_solve.heads_a_program(k.shape[2], HV),
                                           gluon_kkt_solve.STAGED_GATES)
        from gdn_fused.kernels import gluon_kkt_roles
        module, name = ((gluon_kkt_roles, "kkt_solve_from_k_roles_kernel") if roles
                        else (gluon_kkt_solve, "kkt_solve_from_k_gluon_kernel"))
        _launch_pieces("chunk_inverse", module, name,
                       lambda: chunk_inverse(k, G, beta, HV, 64, torch.bfloat16))


def main(argv=None):
    import triton
    p = argparse.ArgumentParser(prog="python -m eval.host_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1:2048,1:8192", type=_shapes,
                   help="B:T,B:T,... (default 1:2048,1:8192)")
    p.add_argument("--profile", default="", metavar="NAMES",
                   help="comma-separated backends (fused, materialized, fla) to profile with "
                        "cProfile at each shape")
    p.add_argument("--breakdown", action="store_true",
                   help="instead: host time of each piece of the fused Hopper route at --shapes")
    args = p.parse_args(argv)
    profiled = {x for x in args.profile.split(",") if x}
    unknown = profiled - PROFILED_NAMES
    if unknown:
        p.error(f"--profile: unknown names {sorted(unknown)}; choose from "
                f"{sorted(PROFILED_NAMES)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    if args.breakdown:
        for B, T in args.shapes:
            breakdown(B, T, "fused" in profiled)
            launch_breakdown(B, T)
        return
    for B, T in args.shapes:
        for name, fn in calls_for(B, T).items():
            with torch.no_grad():
                fn()
                api = triton.testing.do_bench(fn, return_mode="median")
                row = dict(B=B, T=T, backend=name, api_ms=round(api, 4),
                           host_ms=round(_host_ms(fn), 4))
                graph = graph_ms(fn)
                row["graph_ms"] = None if graph is None else round(graph, 4)
                print(row, flush=True)
                if name in profiled:
                    print(_profile(fn), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
