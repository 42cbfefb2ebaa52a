"""(Session 28, device machine) forward_t alone (direct calls, no route), as CUDA-graph
replays: the shipped chain and the lookahead (kernels/gluon_lookahead.py) in the main launch
(LOOKAHEAD), in segment 0's state pass alone (LOOKAHEAD_STATE_PASS) and in both, two rounds;
o and the final state's relative difference from the shipped chain's.

    PYTHONPATH=$PWD python3 scripts/lookahead_diag.py
"""
import torch
from eval.bench import make_inputs, graph_ms
from eval.cases import rel_err
from gdn_fused.kernels import gluon_lookahead as L, gluon_transposed as gt
from gdn_fused.kernels.chunk_gate import chunk_cumsum, gate_rows_from
from gdn_fused.kernels.kkt_solve import kkt_solve_from_k
VARIANTS = (("shipped", False, False, True), ("main", True, False, True),
            ("state pass", False, True, True), ("both", True, True, True))
for B, T, seg in ((1, 32768, 2), (1, 8192, 2)):
    q, k, v, g, beta, h0 = make_inputs(B, T)
    G = chunk_cumsum(g, 64)
    Ai = kkt_solve_from_k(k, G, beta, 32, 64, torch.bfloat16)
    rows = gate_rows_from(G, [beta], chain_rows=True)
    f = lambda: gt.forward_t(q, k, v, G, beta, Ai, 128 ** -0.5, h0, True, segments=seg,
                             gate_rows=rows)
    res, outs = {}, {}
    for rnd in range(2):
        for name, la, sp, fc in VARIANTS:
            if seg == 1 and sp:
                continue
            L.LOOKAHEAD, L.LOOKAHEAD_STATE_PASS, L.FORM_C = la, sp, fc
            outs[name] = [x.clone() for x in f()]
            torch.cuda.synchronize()
            res.setdefault(name, []).append(round(1e3 * graph_ms(f), 1))
    print((B, T, seg), "graph us", res, flush=True)
    ref = outs["shipped"]
    diff = {n: (f"{rel_err(o[0], ref[0]):.1e}", f"{rel_err(o[1], ref[1]):.1e}")
            for n, o in outs.items()}
    print("   vs shipped (o, state):", diff, flush=True)
