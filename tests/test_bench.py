"""eval.bench's command line (the benchmark itself needs a GPU)."""
import argparse

import pytest

from gdn_fused.eval.bench import ANCHOR_SHAPES, _shapes, main


def test_shapes_parse_anchors_and_pairs():
    assert _shapes("anchors") == ANCHOR_SHAPES
    assert _shapes("1:2048,8:4096") == [(1, 2048), (8, 4096)]
    for bad in ("1:2:3", "1:x", "0:64", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="B:T"):
            _shapes(bad)


def test_bad_shapes_exit_2_before_the_cuda_check(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--shapes", "1:2:3"])
    assert e.value.code == 2 and "--shapes" in capsys.readouterr().err


def test_backward_stage_timing_composes_every_kernel(monkeypatch):
    """eval.bench's backward stage timing (GPU only in use) composed on the CPU under the
    interpreter, do_bench stubbed to one call: every stage and every launch variant runs (a
    row that raised is missing), so a kernel signature changed without its bench caller fails
    here rather than on the device."""
    import triton
    import torch

    from gdn_fused.eval import bench
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, return_mode=None: (fn(), 1.0)[1])
    row = bench.bench_bwd_stages(1, 64, device="cpu", dtype=torch.float16)
    assert len(row) == 10 + len(bench.BWD_VARIANTS), sorted(row)
