"""Host ms of the fused call (device machine): session 23's host path (launch keywords keyed one
by one, capability uncached, torch's clamp launch, no replay), session 24's first step (keyword
keys, cached capability, no clamp launch) and today's (with the route's replay,
kernels/replay.py), interleaved in one process; then do_bench eager and graph with fla.

    PYTHONPATH=$PWD python3 scripts/host_ab.py
"""
import torch
import triton

import gdn_fused
from eval.bench import DIM, graph_ms, load_fla, make_inputs
from eval.host_time import _host_ms
from gdn_fused.kernels import chunk_index, launch, replay

fla_chunk, _ = load_fla()
cached = chunk_index.capability


def path(memo, capability, replays):
    launch.MEMO_KEYWORDS = memo
    chunk_index.capability = cached if capability else (
        lambda d: torch.cuda.get_device_capability(d))
    replay.REPLAY = replays


for B, T in ((1, 2048), (1, 8192)):
    q, k, v, g, beta, h0 = make_inputs(B, T)

    def api(g):
        return gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5,
                                                initial_state=h0, output_final_state=True,
                                                backend="fused")
    variants = {"s23": lambda: (path(False, False, False), api(g.clamp(min=-128.)))[1],
                "s24 keys": lambda: (path(True, True, False), api(g))[1],
                "s24 replay": lambda: (path(True, True, True), api(g))[1]}
    with torch.no_grad():
        outs = {name: [x.clone() for x in f()] for name, f in variants.items()}
        outs = {name: [x.clone() for x in f()] for name, f in variants.items()}  # replayed
        assert all(torch.equal(a, b) for o in outs.values() for a, b in zip(o, outs["s23"]))
        for rep in range(3):
            best = {name: float("inf") for name in variants}
            for _ in range(7):
                for name, f in variants.items():
                    best[name] = min(best[name], _host_ms(f, repeats=1))
            print(dict(B=B, T=T, **{f"host_ms {n}": round(x, 4) for n, x in best.items()}),
                  flush=True)
        fns = dict(variants, fla=lambda: fla_chunk(q, k, v, g, beta, scale=DIM ** -0.5,
                                                   initial_state=h0, output_final_state=True))
        for name, fn in fns.items():
            eager = triton.testing.do_bench(fn, return_mode="median")
            print(dict(B=B, T=T, name=name, eager_ms=round(eager, 4),
                       host_ms=round(_host_ms(fn), 4), graph_ms=round(graph_ms(fn), 4)),
                  flush=True)
        path(True, True, True)
