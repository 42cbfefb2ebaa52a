"""Host ms of the fused call (device machine): session 23's host path (no keyword key, uncached
capability, torch's clamp launch before the kernels) against this one, interleaved in one
process; do_bench eager/graph with fla."""
import torch, triton
from eval.bench import make_inputs, DIM, graph_ms, load_fla
from eval.host_time import _host_ms_ab, _host_ms
import gdn_fused
from gdn_fused.kernels import launch, chunk_index

fla_chunk, _ = load_fla()
cached = chunk_index.capability
def old():
    launch.MEMO_KEYWORDS = False
    chunk_index.capability = lambda d: torch.cuda.get_device_capability(d)
def new():
    launch.MEMO_KEYWORDS = True
    chunk_index.capability = cached
for B, T in ((1, 2048), (1, 8192)):
    q, k, v, g, beta, h0 = make_inputs(B, T)
    api = lambda g: gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0,
                                                     output_final_state=True, backend="fused")
    f = lambda: api(g)
    f_old = lambda: (old(), api(g.clamp(min=-128.)))
    f_new = lambda: (new(), api(g))
    ff = lambda: fla_chunk(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0, output_final_state=True)
    with torch.no_grad():
        o_new = f_new()[1][0].clone(); o_old = f_old()[1][0].clone(); new()
        assert torch.equal(o_new, o_old)
        for rep in range(3):
            a, b = _host_ms_ab(f_old, f_new)
            print(dict(B=B, T=T, host_ms_s23_path=round(a, 4), host_ms_now=round(b, 4)), flush=True)
        for name, fn in (("fused s23 path", f_old), ("fused", f_new), ("fla", ff)):
            new()
            eager = triton.testing.do_bench(fn, return_mode="median")
            print(dict(B=B, T=T, name=name, eager_ms=round(eager, 4), host_ms=round(_host_ms(fn), 4),
                       graph_ms=round(graph_ms(fn), 4)), flush=True)
        new()
