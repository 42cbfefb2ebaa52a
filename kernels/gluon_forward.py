"""Experimental: the whole Gated DeltaNet forward from the Gluon kernels, three launches —

    G = chunk_cumsum(g)                                  kernels/chunk_gate.py (Triton)
    w, u = wu_gluon(k, v, G, beta)                       kernels/gluon_wu.py
    o, final_state = chunk_state_output_gluon(q, k, w, u, G, scale, h0)
                                                         kernels/gluon_state_output.py

— so that one GPU test and one benchmark column show what the Gluon pieces give end to end
before any of them is wired into a backend. Nothing but w and u (bf16, written once, read once)
goes through HBM between the launches: no A, T, h or v_new. Not wired into any backend; no
backward (the Triton backward recomputes what it needs from the inputs anyway).

Scope: the Gluon kernels' — dense batches (no cu_seqlens), K = V = 128, chunk 64, bf16, Hopper.
"""
from gdn_fused.kernels.chunk_gate import chunk_cumsum
from gdn_fused.kernels.gluon_state_output import CHUNK, chunk_state_output_gluon
from gdn_fused.kernels.gluon_wu import wu_gluon


def gluon_forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False):
    """(o [B, T, HV, 128] bf16, final_state [B, HV, 128, 128] fp32 or None).

    q, k [B, T, H, 128] bf16 (L2-normalised by the caller if wanted); v [B, T, HV, 128] bf16;
    g [B, T, HV] per-token natural-log decay (any float dtype); beta [B, T, HV]; scale a float;
    initial_state [B, HV, 128, 128] or None. Raises ValueError for inputs the Gluon kernels do
    not cover (see their wrappers)."""
    G = chunk_cumsum(g, CHUNK)
    w, u = wu_gluon(k, v, G, beta)
    return chunk_state_output_gluon(q, k, w, u, G, scale, initial_state, output_final_state)
