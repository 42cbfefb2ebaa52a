"""The experimental three-launch Gluon forward (kernels/gluon_forward.py) against the fp64
token recurrence and the materialized backend, on a Hopper GPU; on any machine, that it
refuses what its kernels do not cover before launching anything."""
import pytest
import torch

from gdn_fused.eval.cases import make_inputs, rel_err, truth

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")
from gdn_fused.kernels.gluon_forward import gluon_forward  # noqa: E402


def test_unsupported_head_dims_are_refused_before_any_launch():
    q, k, v, g, beta, _ = make_inputs(1, 64, 2, 4, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="K = V = 128"):
        gluon_forward(q, k, v, g, beta, 0.125)


hopper = pytest.mark.skipif(not torch.cuda.is_available()
                            or torch.cuda.get_device_capability()[0] != 9,
                            reason="the Gluon kernels are sm_90a only")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("B,T,H,HV,gate,h0", [
    (1, 64, 2, 2, "normal", False),
    (1, 200, 2, 4, "normal", True),     # partial last chunk, GVA 2, initial state
    (2, 1024, 2, 6, "strong", True),    # GVA 3, gates −30…−70 a token
    # g = 0 exactly (no decay): measured on the H200 (2026-11-29) final state 3.51e-3 against
    # the 3e-3 bound, exactly materialized's figure — both round w, u and h to bf16 in HBM
    pytest.param(1, 300, 1, 2, "zero", False, marks=pytest.mark.xfail(
        strict=True, reason="final state 3.5e-3 at g = 0, as materialized (bf16 w, u, h)")),
])
def test_gluon_forward_matches_the_recurrence_and_materialized(B, T, H, HV, gate, h0):
    from gdn_fused import chunk_gated_delta_rule
    q, k, v, g, beta, s0 = make_inputs(B, T, H, HV, 128, 128, torch.bfloat16, gate=gate,
                                       initial_state=h0, device="cuda")
    scale = 128 ** -0.5
    o, ht = gluon_forward(q, k, v, g, beta, scale, s0, True)
    o_ref, ht_ref = truth(q, k, v, g, beta, s0, scale=scale)
    o_mat, ht_mat = chunk_gated_delta_rule(q, k, v, g, beta, scale, s0, True,
                                           backend="materialized")
    errs = dict(o=rel_err(o, o_ref), state=rel_err(ht, ht_ref),
                o_materialized=rel_err(o_mat, o_ref), state_materialized=rel_err(ht_mat, ht_ref))
    print(f"gluon forward B={B} T={T} H={H} HV={HV} gate={gate}:",
          {n: f"{e:.2e}" for n, e in errs.items()})
    # the fused-forward issue's bf16 bounds, and no worse than materialized by more than 1.5×
    assert errs["o"] <= 5e-3 and errs["state"] <= 3e-3
    assert errs["o"] <= 1.5 * errs["o_materialized"] + 1e-4
    assert errs["state"] <= 1.5 * errs["state_materialized"] + 1e-4
