"""Programmatic dependent launch (kernels/pdl.py): each PDL kernel's first global access comes
after its griddepcontrol.wait (sm_90a PTX, any machine); on a Hopper GPU the fused forward
gives the same bits with PDL on and off, eagerly and replayed from a CUDA graph."""
import os
import re
import subprocess
import sys

import pytest
import torch

from gdn_fused.eval.ptxas import _kernels, compile_for

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper",
                    reason="this Triton has no Gluon Hopper API (triton.experimental.gluon)")

# a global load or store, a TMA copy or an atomic: what must not run before the wait
GLOBAL_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async\.bulk|red\.global|atom\.global"
                           r"|ld\.global\.nc)")


def first_index(pattern, ptx):
    m = re.search(pattern, ptx)
    return m.start() if m else None


def assert_waits_first(ptx, trigger):
    wait = first_index(r"griddepcontrol\.wait", ptx)
    access = first_index(GLOBAL_ACCESS, ptx)
    assert wait is not None and access is not None and wait < access, (wait, access)
    assert (first_index(r"griddepcontrol\.launch_dependents", ptx) is not None) == trigger


@pytest.mark.parametrize("name, trigger", [("kkt_solve gluon (from k)", True),
                                           ("forward transposed gluon, V' on the chain", False)])
def test_gluon_kernels_wait_before_any_global_access(name, trigger):
    """The inverse (wait, then trigger forward_t) and forward_t (wait only); PDL off: neither
    instruction."""
    build, options = _kernels()[name]
    fn, sig, consts = build()
    on = compile_for(fn, sig, {**consts, "PDL": True}, **options, launch_pdl=True)
    assert on.metadata.launch_pdl
    assert_waits_first(on.asm["ptx"], trigger)
    off = compile_for(fn, sig, consts, **options)
    assert "griddepcontrol" not in off.asm["ptx"] and not off.metadata.launch_pdl


_CUMSUM = """
from gdn_fused.eval.ptxas import compile_for
from gdn_fused.kernels.chunk_gate import chunk_cumsum_kernel
sig = {"g": "*fp32", "G": "*fp64", "beta": "*fp32", "rows": "*fp64", "cu_seqlens": "*i32",
       "chunk_indices": "*i32", "T": "i32"}
c = compile_for(chunk_cumsum_kernel, sig, dict(HV=32, BT=64, IS_VARLEN=True, ROWS=4, BH=16,
                                               PDL=True), num_warps=4, launch_pdl=True)
print(c.asm["ptx"])
"""


def test_cumsum_waits_before_any_global_access():
    """chunk_cumsum's kernel (a tl kernel: compiled in a process without the interpreter),
    packed (its chunk indices are loads): wait, then trigger the inverse."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _CUMSUM], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert_waits_first(run.stdout, trigger=True)


def test_no_pdl_options_off_hopper():
    """CPU tensors (and the interpreter) get no launch options: a plain launch."""
    from gdn_fused.kernels.pdl import pdl_options
    assert pdl_options(torch.device("cpu")) == {}


def test_inverse_launched_plainly_when_asked(monkeypatch):
    """kkt_solve_from_k_gluon(pdl=False) (segment 1's inverse under
    fused_fwd.SEGMENT1_INVERSE_PDL = False) launches without PDL where PDL applies; by default
    with it (the launch is caught, nothing runs)."""
    from gdn_fused.kernels import gluon_kkt_solve
    launches = []
    monkeypatch.setattr(gluon_kkt_solve, "pdl_options",
                        lambda device: dict(PDL=True, launch_pdl=True))
    monkeypatch.setattr(gluon_kkt_solve.direct, "launch",
                        lambda kernel, grid, *args, **kw: launches.append(kw))
    k = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    G, beta = torch.zeros(1, 64, 2, dtype=torch.float64), torch.zeros(1, 64, 2)
    for pdl in (True, False):
        gluon_kkt_solve.kkt_solve_from_k_gluon(k, G, beta, 2, torch.bfloat16, pdl=pdl,
                                               roles=False)
    assert [("launch_pdl" in kw, kw.get("PDL", False)) for kw in launches] == \
        [(True, True), (False, False)]


@pytest.mark.gpu
def test_fused_forward_same_bits_with_and_without_pdl(monkeypatch):
    """PDL changes when programs start, not what they compute: o and the final state equal
    bit for bit with PDL on and off, B = 1 (the split route) and B = 2, eager and from a CUDA
    graph (the programmatic edges captured)."""
    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.eval.cases import make_inputs
    from gdn_fused.kernels import pdl
    if not pdl.pdl_applies(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+")
    for B, T in [(1, 4096), (2, 1000)]:
        q, k, v, g, beta, h0 = make_inputs(B, T, 2, 4, 128, 128, torch.bfloat16,
                                           initial_state=True, device="cuda")

        def call():
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, backend="fused")
        results = {}
        for on in (False, True):
            monkeypatch.setattr(pdl, "PDL", on)
            eager = call()
            call()  # compiled and warm before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = call()
            graph.replay()
            torch.cuda.synchronize()
            results[on] = (eager, captured)
        for eager, captured in results.values():
            assert all(torch.equal(a, b) for a, b in zip(eager, captured)), (B, T)
        assert all(torch.equal(a, b) for a, b in zip(results[False][0], results[True][0])), \
            (B, T)
