"""Line-level host time of the fused route's call (line_profiler, carried as a wheel in
.whl/: python3 -m pip download line_profiler ... as for fla), and plain host ms."""
import sys, time, io
import torch
from line_profiler import LineProfiler
from eval.bench import make_inputs, DIM
from eval.host_time import _host_ms
import gdn_fused
from gdn_fused import ops, autograd, validation, fla_options
from gdn_fused.kernels import fused_fwd, gluon_transposed, chunk_gate, kkt_solve, gluon_kkt_solve, materialized, launch, pdl

shapes = [(1, 2048), (1, 8192)]
for B, T in shapes:
    q, k, v, g, beta, h0 = make_inputs(B, T)
    f = lambda: gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0,
                                                 output_final_state=True, backend="fused")
    with torch.no_grad():
        f(); torch.cuda.synchronize()
        print(dict(B=B, T=T, api_host_ms=round(_host_ms(f, repeats=9), 4)), flush=True)
q, k, v, g, beta, h0 = make_inputs(1, 2048)
f = lambda: gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0,
                                             output_final_state=True, backend="fused")
lp = LineProfiler()
for fn in (ops.chunk_gated_delta_rule, autograd.chunk_gated_delta_rule_triton, autograd._forward,
           fused_fwd.fused_fwd, fused_fwd._fused_fwd_impl, fused_fwd._warp_specialized_fwd,
           materialized.gates_and_inverse, chunk_gate.chunk_cumsum, kkt_solve.chunk_inverse,
           gluon_kkt_solve.kkt_solve_from_k_gluon, gluon_transposed.forward_t, gluon_transposed._launch,
           gluon_transposed.check_state_inputs, launch.launch, validation.check_inputs,
           fla_options.parse_fla_options, ops.resolve_backend, fused_fwd._eager):
    lp.add_function(fn)
with torch.no_grad():
    f(); torch.cuda.synchronize()
    lp.enable_by_count()
    for _ in range(300):
        f()
    lp.disable_by_count()
    torch.cuda.synchronize()
s = io.StringIO()
lp.print_stats(stream=s, output_unit=1e-6, stripzeros=True)
print(s.getvalue())
