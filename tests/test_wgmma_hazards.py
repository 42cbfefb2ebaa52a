"""The static check for asynchronous wgmma operands refilled before their wait
(eval/wgmma_hazards.py): on synthetic TTGIR, on the tl kernels compiled for sm_90a (any
machine), on the launch options the package uses, and on every kernel a GPU forward and
backward launch."""
import os
import subprocess
import sys

import pytest
import torch

from gdn_fused.eval.wgmma_hazards import KERNELS, launches, refilled_operands

LOOP = """\
    %buf = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared, #smem, mutable>
    %other = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared, #smem, mutable>
    %r:2 = scf.for %i = %c0 to %c2 step %c1 iter_args(%acc = %z, %s = %c0) -> (...) : i32 {
      %view = ttg.memdesc_index %buf[%s] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
      %t = ttg.memdesc_trans %view {order = array<i32: 1, 0>} : !ttg.memdesc<64x64xbf16>
      %d = ttng.warp_group_dot %a, %t, %acc {inputPrecision = 0 : i32, isAsync = true} : x
      %e = ttng.warp_group_dot %a, %b, %acc {inputPrecision = 0 : i32, isAsync = true} : x
BETWEEN      %next = ttg.memdesc_index %TARGET[%s] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16>
      %c = ttg.async_copy_global_to_local %ptrs, %next mask %m other %cst : tensor<64x64x!tt.ptr<bf16>>
      scf.yield %d, %s : tensor<64x64xf32>, i32
    }
"""  # noqa: E501 (TTGIR lines as Triton prints them)


def loop(between="", target="buf", asynchronous=True):
    text = LOOP.replace("BETWEEN", between).replace("TARGET", target)
    return text if asynchronous else text.replace(", isAsync = true", "")


def wait(pendings):
    return f"      %w = ttng.warp_group_dot_wait %d {{pendings = {pendings} : i32}} : x\n"


def test_flags_a_refill_of_an_in_flight_wgmma_operand():
    # %d reads %buf through a transposed view; %e, issued after it, reads nothing buffered
    assert len(refilled_operands(loop())) == 1
    assert refilled_operands(loop(between=wait(0))) == []
    assert refilled_operands(loop(between=wait(1))) == []  # only %e may still run
    assert len(refilled_operands(loop(between=wait(2)))) == 1  # %d may still run
    assert refilled_operands(loop(target="other")) == []
    assert refilled_operands(loop(asynchronous=False)) == []
    # a one-slot buffer's view taken once before the loop (wu_bwd at 2 stages)
    hoisted = loop().replace("    %r:2 = scf.for", "    %pre = ttg.memdesc_index %buf[%c0] : x\n"
                             "    %r:2 = scf.for").replace("ptrs, %next", "ptrs, %pre")
    assert len(refilled_operands(hoisted)) == 1
    # an operand read through two views (the slot and its transpose) is one hazard
    both = loop().replace("%a, %t, %acc", "%view, %t, %acc")
    assert len(refilled_operands(both)) == 1


def hazard_counts(*args):
    """{line head: hazards} printed by ``python -m gdn_fused.eval.wgmma_hazards *args``, run
    in a fresh interpreter: kernels defined under TRITON_INTERPRET=1, as in this session on a
    CPU, cannot be compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "gdn_fused.eval.wgmma_hazards", *args],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {line.split(":")[0]: int(line.split(": ")[1].split()[0])
            for line in run.stdout.splitlines() if line.endswith("hazards")}


def test_every_tl_kernel_is_clean_as_launched():
    counts = hazard_counts()
    assert len(counts) == sum(len(launches(n)) for n in KERNELS), counts
    assert not any(counts.values()), counts


def test_the_known_races_are_flagged():
    """wu_bwd pipelined (dβ / dg differed run to run on the H200 at 2 and 3 stages) and
    chunk_bwd_dqkwg with two value blocks a program at Triton's 3 stages."""
    wu = hazard_counts("--kernels", "wu_bwd", "--stages", "2", "3")
    assert all(wu.values()) and len(wu) == 2, wu
    dqkwg = hazard_counts("--kernels", "chunk_bwd_dqkwg", "--stages", "3", "--block-v", "64")
    assert all(dqkwg.values()) and len(dqkwg) == 1, dqkwg


class _Launch:
    """Stands in for a jitted kernel: records the constexprs and options of a launch."""

    def __init__(self):
        self.kwargs = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs = kwargs
        return launch


@pytest.mark.parametrize("V", [128, 256])
def test_launchers_use_the_clean_configurations(monkeypatch, V):
    """What the scanned configurations assume of the launchers: wu_bwd at wu_bwd.STAGES,
    chunk_bwd_dqkwg with one value block a program at V ≤ 128 (Triton's 3 stages) and at one
    stage past it."""
    from gdn_fused.kernels import chunk_bwd_dqkwg, wu_bwd
    wu_spy, dqkwg_spy = _Launch(), _Launch()
    monkeypatch.setattr(wu_bwd, "wu_bwd_kernel", wu_spy)
    monkeypatch.setattr(chunk_bwd_dqkwg, "chunk_bwd_dqkwg_kernel", dqkwg_spy)
    B, T, H, HV, K, C = 1, 64, 1, 2, 128, 64
    k, dw, dk = (torch.zeros(B, T, n, K) for n in (H, HV, HV))
    v = torch.zeros(B, T, HV, V)
    g = beta = torch.zeros(B, T, HV)
    NKP = K // chunk_bwd_dqkwg.BLOCK_K  # the partial dg blocks dqkwg writes at this K
    wu_bwd.wu_bwd(k, v, g, beta, torch.zeros(B, T, HV, C), dw, v, dk,
                  torch.zeros(NKP, B, T, HV), C)
    scanned_wu = launches("wu_bwd")[0]
    assert wu_spy.kwargs["num_stages"] == scanned_wu["num_stages"] == 1
    assert wu_spy.kwargs["BK"] == scanned_wu["BK"]
    consts = KERNELS["wu_bwd"][3]
    assert (wu_spy.kwargs["NK"], wu_spy.kwargs["NKP"]) == (consts["NK"], consts["NKP"])
    h = torch.zeros(1, HV, K, V)
    chunk_bwd_dqkwg.chunk_bwd_dqkwg(k, k, v, h, h, g, v, v, 1.0, C)
    scanned = launches("chunk_bwd_dqkwg")[0]
    got = {"num_stages": 3, **dqkwg_spy.kwargs}  # 3: Triton's default, when not named
    if V <= scanned["BV"]:  # one value block: as scanned
        assert {n: got[n] for n in scanned} == scanned
    else:
        assert got["num_stages"] == 1 and got["BV"] == scanned["BV"]


@pytest.mark.gpu
def test_no_kernel_launched_refills_an_in_flight_wgmma_operand():
    from gdn_fused.eval.wgmma_hazards import launched_hazards
    counts = launched_hazards()
    print("wgmma hazards per launched kernel:", counts)
    assert len(counts) >= 10 and not any(counts.values()), counts


@pytest.mark.parametrize("argv", [["--stages", "0"], ["--warps", "0"], ["--block-v", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    """Counts below 1 are argparse errors, not an empty scan that reports 0 hazards."""
    from gdn_fused.eval.wgmma_hazards import main
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "must be >= 1" in capsys.readouterr().err
