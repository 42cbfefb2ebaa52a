"""A/B of a module flag on the fused forward (device machine): the anchor shapes' fused forward
as a CUDA-graph replay (the kernels alone) and eager, with the flag at each value in turn,
interleaved over three rounds in one process, fla 0.6.0's forward beside it; asserts the
outputs are the same bits under every value (a flag that changes bits is not an A/B). With
--backward: the fused forward + backward (gradients of q, k, v, g, beta and the initial state
for a random cotangent of o and of the final state), its outputs the gradients.

    PYTHONPATH=$PWD python3 scripts/ab_flag.py gdn_fused.kernels.gluon_kkt_solve.ROLES False True
"""
import argparse
import ast
import importlib
import statistics

import torch
import triton

import gdn_fused
from eval.bench import DIM, _shapes, graph_ms, load_fla, make_inputs

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("flag", help="module.NAME, e.g. gdn_fused.kernels.gluon_kkt_solve.ROLES")
p.add_argument("values", nargs="+", help="Python literals, e.g. False True")
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--shapes", type=_shapes, default="anchors",
               help="'anchors' (default) or B:T,B:T,... as eval.bench takes them")
p.add_argument("--bits-may-differ", action="store_true",
               help="report whether the outputs differ instead of asserting they do not (a "
                    "flag that changes the arithmetic: its errors are measured elsewhere)")
p.add_argument("--backward", action="store_true",
               help="time forward + backward and compare the gradients")
args = p.parse_args()
module_name, name = args.flag.rsplit(".", 1)
module = importlib.import_module(module_name)
values = [ast.literal_eval(v) for v in args.values]
fla_chunk, _ = load_fla()

for B, T in args.shapes:
    q, k, v, g, beta, h0 = make_inputs(B, T)

    def forward():
        return gdn_fused.chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5,
                                                initial_state=h0, output_final_state=True,
                                                backend="fused")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    do, dht = torch.randn_like(v), torch.randn_like(h0)

    def forward_backward():
        o, ht = gdn_fused.chunk_gated_delta_rule(*leaves[:5], scale=DIM ** -0.5,
                                                 initial_state=leaves[5],
                                                 output_final_state=True, backend="fused")
        return torch.autograd.grad((o, ht), leaves, (do, dht))
    fused = forward_backward if args.backward else forward
    times = {v: {"graph": [], "eager": []} for v in values}
    outs = {}
    with torch.enable_grad() if args.backward else torch.no_grad():
        for _ in range(args.rounds):
            for value in values:
                setattr(module, name, value)
                outs[value] = [x.clone() for x in fused()]
                times[value]["graph"].append(1e3 * graph_ms(fused))
                times[value]["eager"].append(
                    1e3 * triton.testing.do_bench(fused, return_mode="median"))
        same = all(torch.equal(a, b) for o in outs.values() for a, b in zip(o, outs[values[0]]))
        fla = None
        if fla_chunk is not None:
            fla = 1e3 * graph_ms(lambda: fla_chunk(q, k, v, g, beta, scale=DIM ** -0.5,
                                                   initial_state=h0,
                                                   output_final_state=True))
    setattr(module, name, values[0])
    row = {"B": B, "T": T, "same_bits": same, "fla_graph_us": fla}
    for value in values:
        for kind in ("graph", "eager"):
            us = statistics.median(times[value][kind])
            row[f"{value}_{kind}_us"] = round(us, 1)
            if fla and kind == "graph":
                row[f"{value}_graph_over_fla"] = round(us / fla, 3)
    row["rounds"] = {str(v): [round(x, 1) for x in times[v]["graph"]] for v in values}
    print(row, flush=True)
    assert same or args.bits_may_differ, f"{args.flag} changed the outputs at B={B}, T={T}"
