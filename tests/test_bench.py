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
