"""The static check for asynchronous wgmma operands refilled before their wait
(eval/wgmma_hazards.py): on synthetic TTGIR, on wu_bwd compiled for sm_90a (any machine), and
on every kernel a GPU forward and backward launch."""
import os
import subprocess
import sys

import pytest

from gdn_fused.eval.wgmma_hazards import refilled_operands

LOOP = """\
    %buf = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared, #smem, mutable>
    %other = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared, #smem, mutable>
    %r:2 = scf.for %i = %c0 to %c2 step %c1 iter_args(%acc = %z, %s = %c0) -> (...) : i32 {
      %view = ttg.memdesc_index %buf[%s] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
      %t = ttg.memdesc_trans %view {order = array<i32: 1, 0>} : !ttg.memdesc<64x64xbf16>
      %d = ttng.warp_group_dot %view, %t, %acc {inputPrecision = 0 : i32, isAsync = true} : x
BETWEEN      %next = ttg.memdesc_index %TARGET[%s] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
      %c = ttg.async_copy_global_to_local %ptrs, %next mask %m other %cst : tensor<64x64x!tt.ptr<bf16>>
      scf.yield %d, %s : tensor<64x64xf32>, i32
    }
"""


def loop(between="", target="buf", asynchronous=True):
    text = LOOP.replace("BETWEEN", between).replace("TARGET", target)
    return text if asynchronous else text.replace(", isAsync = true", "")


def test_flags_a_refill_of_an_in_flight_wgmma_operand():
    assert len(refilled_operands(loop())) == 1
    wait = "      %w = ttng.warp_group_dot_wait %d {pendings = 0 : i32} : tensor<64x64xf32>\n"
    assert refilled_operands(loop(between=wait)) == []
    assert refilled_operands(loop(target="other")) == []
    assert refilled_operands(loop(asynchronous=False)) == []
    # a one-slot buffer's view taken once before the loop (wu_bwd at 2 stages)
    hoisted = loop().replace("    %r:2 = scf.for", "    %pre = ttg.memdesc_index %buf[%c0] : x\n"
                             "    %r:2 = scf.for").replace("ptrs, %next", "ptrs, %pre")
    assert len(refilled_operands(hoisted)) == 1


def test_wu_bwd_is_clean_at_its_stages_and_flagged_when_pipelined():
    """Compiled for sm_90a in a fresh interpreter (kernels defined under TRITON_INTERPRET=1,
    as in this session on a CPU, cannot be compiled). Flagged at 2 and 3 stages, as the H200
    showed (dβ, dg differing run to run: docs/backward.md, "Determinism")."""
    from gdn_fused.kernels.wu_bwd import STAGES
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "gdn_fused.eval.wgmma_hazards", "--stages",
                          str(STAGES), "2", "3"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = [int(line.split(": ")[1].split()[0]) for line in run.stdout.splitlines()
              if line.startswith("wu_bwd num_stages=")]
    assert counts[0] == 0 and counts[1] >= 1 and counts[2] >= 1, run.stdout


@pytest.mark.gpu
def test_no_kernel_launched_refills_an_in_flight_wgmma_operand():
    from gdn_fused.eval.wgmma_hazards import launched_hazards
    counts = launched_hazards()
    print("wgmma hazards per launched kernel:", counts)
    assert len(counts) >= 10 and not any(counts.values()), counts
