"""Line-level host time of the fused route's call (line_profiler, carried as a wheel in .whl/:
``python3 -m pip download line_profiler ...`` as for fla), after its plain host ms.

    PYTHONPATH=$PWD python3 scripts/host_lines.py
"""
import io

import torch
from line_profiler import LineProfiler

import gdn_fused
from eval.bench import DIM, make_inputs
from eval.host_time import _host_ms
from gdn_fused import autograd, fla_options, ops, validation
from gdn_fused.kernels import (chunk_gate, fused_fwd, gluon_kkt_solve, gluon_transposed,
                               kkt_solve, launch, materialized, replay)

PROFILED = (ops.chunk_gated_delta_rule, autograd.chunk_gated_delta_rule_triton,
            autograd._forward, fused_fwd.fused_fwd, fused_fwd._fused_fwd_impl,
            fused_fwd._warp_specialized_fwd, fused_fwd._route, replay.run,
            materialized.gates_and_inverse, chunk_gate.chunk_cumsum, kkt_solve.chunk_inverse,
            gluon_kkt_solve.kkt_solve_from_k_gluon, gluon_transposed.forward_t,
            gluon_transposed._launch, gluon_transposed.check_state_inputs, launch.launch,
            validation.check_inputs, fla_options.parse_fla_options, ops.resolve_backend,
            fused_fwd._eager, replay.signature, replay._flags, replay.Replay.__call__,
            replay._view, launch.run_compiled, launch._run)


def call(B, T):
    q, k, v, g, beta, h0 = make_inputs(B, T)
    return lambda: gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5,
                                                    initial_state=h0, output_final_state=True,
                                                    backend="fused")


with torch.no_grad():
    for B, T in ((1, 2048), (1, 8192)):
        f = call(B, T)
        f()
        torch.cuda.synchronize()
        print(dict(B=B, T=T, api_host_ms=round(_host_ms(f, repeats=9), 4)), flush=True)
    f = call(1, 2048)
    lp = LineProfiler()
    for fn in PROFILED:
        lp.add_function(fn)
    f()
    torch.cuda.synchronize()
    lp.enable_by_count()
    for _ in range(300):
        f()
    lp.disable_by_count()
    torch.cuda.synchronize()
text = io.StringIO()
lp.print_stats(stream=text, output_unit=1e-6, stripzeros=True)
print(text.getvalue())
