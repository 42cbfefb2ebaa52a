"""The backward's recompute of h and v_new on the transposed Gluon chain
(kernels/gluon_recompute.py, experimental) against chunk_state on the same inputs, on the H200:
the same bits, unsplit and split at checkpoints (any fp32 states: both kernels start their
segments from the same ones).
"""
import pytest
import torch

from gdn_fused.eval.cases import make_inputs

CASES = [  # (id, B, T, H, HV, gate, initial state, checkpoints)
    ("partial-chunk-h0", 1, 1000, 2, 4, "normal", True, False),
    ("two-batches-g-zero", 2, 1024, 2, 6, "zero", False, False),
    ("checkpoints-partial", 1, 64 * 64 * 2 + 640 + 17, 1, 2, "normal", True, True),
    ("checkpoints-strong", 2, 64 * 64 * 3, 1, 2, "strong", False, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_bits_as_chunk_state(case):
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_state import checkpoint_slabs, chunk_state
    from gdn_fused.kernels.gluon_recompute import chunk_state_seg_t
    from gdn_fused.kernels.kkt_solve import chunk_inverse
    from gdn_fused.kernels.wu import recompute_w_u
    _, B, T, H, HV, gate, with_h0, with_ckpt = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, gate, "uniform",
                                       with_h0, device="cuda")
    G, rows = chunk_cumsum(g, 64, gate_rows=[])
    w, u = recompute_w_u(k, v, G, beta, chunk_inverse(k, G, beta, HV, 64, torch.bfloat16),
                         dot_precision="tf32")
    ckpt = None
    if with_ckpt:
        n = checkpoint_slabs(-(-T // 64))
        assert n >= 2
        gen = torch.Generator().manual_seed(7)
        ckpt = torch.randn(n, B, HV, 128, 128, generator=gen).to("cuda")
    ref = chunk_state(k, w, u, G, h0, False, 64, B, dot_precision="tf32", checkpoints=ckpt)
    got = chunk_state_seg_t(k, w, u, rows, h0, ckpt)
    print(f"recompute {case[0]}: h max diff {(got[0].float() - ref[0].float()).abs().max():.1e}"
          f", v_new {(got[1].float() - ref[1].float()).abs().max():.1e}")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
