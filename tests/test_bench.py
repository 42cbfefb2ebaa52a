"""eval.bench's command line, its backward-stage chain and its outputs (the timings need a GPU)."""
import argparse
from pathlib import Path

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
    # (12 kernels, the recompute in both forms: the Gluon kernels' rows only where they run)
    assert len(row) == 12 + len(bench.BWD_VARIANTS), sorted(row)


def test_outputs_table_csv_and_plot(tmp_path):
    """write_outputs on made-up rows: one table row per shape with every column (issue 5's
    fused fwd+bwd / fla ratio, the CUDA-graph (device time) ratio and the fwd+bwd graph
    replays included; empty where fla or a replay did not run), the CSV and the PNG."""
    pytest.importorskip("matplotlib")
    from gdn_fused.eval.bench import write_outputs
    rows = [dict(B=1, T=32768, floor_ms=0.272, fla_ms=2.0, materialized_ms=1.3, fused_ms=1.4,
                 fused_tl_ms=4.0, materialized_fwdbwd_ms=6.5, fused_fwdbwd_ms=6.0,
                 fla_graph_ms=1.9, materialized_graph_ms=1.25, fused_graph_ms=0.95,
                 materialized_fwdbwd_graph_ms=5.5, fused_fwdbwd_graph_ms=5.25),
            dict(B=1, T=2048, floor_ms=0.017, materialized_ms=0.3, fused_ms=0.3)]
    write_outputs(tmp_path, rows, None, 4.2e12)
    table = [line for line in (tmp_path / "bench.md").read_text().splitlines()
             if line.startswith("| 1 |")]
    cells = [line.strip("|").split("|") for line in table]
    assert len(cells) == 2 and all(len(c) == 23 for c in cells)
    assert cells[0][16].strip() == "3.000" and cells[1][16].strip() == ""
    assert [c.strip() for c in cells[0][17:]] == ["1.900", "1.250", "0.950", "0.500", "5.500",
                                                  "5.250"]
    assert cells[1][20].strip() == ""  # the device-time ratio needs fla
    assert cells[1][21].strip() == cells[1][22].strip() == ""  # no fwd+bwd graph ran
    assert cells[0][11].strip() == "4.000"  # the plain fused kernel's column
    assert (tmp_path / "bench.csv").read_text().count("\n") == 3
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_host_time_command_line_refuses_bad_shapes_and_no_gpu(capsys, monkeypatch):
    """eval.host_time parses its shapes as eval.bench does and, without CUDA, exits with the
    reason before timing anything."""
    import torch

    from gdn_fused.eval import host_time
    with pytest.raises(SystemExit) as e:
        host_time.main(["--shapes", "0:64"])
    assert e.value.code == 2 and "--shapes" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        host_time.main(["--breakdown"])
    assert e.value.code == 2 and "CUDA" in capsys.readouterr().err


A_FILE = Path(__file__).resolve().parents[1] / "pyproject.toml"  # a file that is no CSV


@pytest.mark.parametrize("module, argv, message", [
    ("determinism", ["--T", "-5", "--cpu"], "--T"),
    ("determinism", ["--warps", "3", "--cpu"], "--warps"),
    ("determinism", [], "CUDA"),
    ("wgmma_hazards", ["--launched"], "CUDA"),
    ("bench_layer", ["--chunk-size", "48"], "--chunk-size"),
    ("bench_layer", ["--reps", "0", "--device", "cpu"], "--reps"),
    ("bench_layer", ["--solve-method", "foo", "--device", "cpu"], "--solve-method"),
    ("bench_layer", [], "CUDA"),
    ("bench_layer", ["--device", "mps"], "--device"),
    # session 23's trial: a typo found only after the CUDA check and a bandwidth measurement,
    # a typo profiled nothing, tracebacks, and the fused backend refused on the CPU only after
    # minutes of the HF fallback's timing
    ("bench", ["--sweep", "fusd"], "--sweep: unknown parts"),
    ("host_time", ["--profile", "fusd"], "--profile: unknown names"),
    ("wgmma_hazards", ["--warps", "3"], "must be a power of two"),
    ("wgmma_hazards", ["--block-v", "8"], "must be >= 16"),
    ("bench_layer", ["--backend", "fused", "--device", "cpu"], "--backend fused on cpu"),
    ("ncu_sass", ["/nonexistent/ncu.csv"], "cannot read"),
    ("ncu_sass", [str(A_FILE)], "holds no ncu source page"),
    ("inverse_accuracy", ["--out", str(A_FILE)], "is a file"),
    ("kernel_times", ["--shapes", "1:x"], "--shapes"),
    ("kernel_times", [], "CUDA"),
])
def test_eval_scripts_refuse_bad_arguments_before_any_work(module, argv, message, capsys,
                                                          monkeypatch):
    """The GPU-side eval scripts exit with argparse's code 2 and the argument (or the missing
    CUDA device) named, before building inputs or models (session 13's new-user trial: these
    were tracebacks, or a 780 M-parameter model built on the CPU before a bad chunk size
    surfaced)."""
    import importlib

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main_ = importlib.import_module(f"gdn_fused.eval.{module}").main
    with pytest.raises(SystemExit) as e:
        main_(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_lm_eval_adapter_without_lm_eval_says_how_to_get_it():
    """Run as a script without lm-evaluation-harness installed, the adapter exits with the
    pip command and no traceback; imported, it raises ModuleNotFoundError with it."""
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm-eval is installed")
    run = [sys.executable, "-m", "gdn_fused.eval.lm_eval_adapter"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "lm-eval[hf]" in r.stderr and "Traceback" not in r.stderr
    # its options stay readable (session 23's trial: --help exited 1 with the message alone)
    r = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--backend" in r.stdout and "lm-eval[hf]" in r.stdout
    with pytest.raises(ModuleNotFoundError, match="lm-eval"):
        importlib.import_module("gdn_fused.eval.lm_eval_adapter")


def test_kernel_timeline_table(capsys):
    """eval.kernel_times prints one row a kernel (long names cut with an ellipsis) and the span
    from the first start to the last end in its heading."""
    from gdn_fused.eval.kernel_times import print_timeline
    print_timeline("fused forward B=1 T=64", [("chunk_cumsum_kernel", 7, 0.0, 21.6),
                                               ("x" * 80, 16, 25.0, 250.5)])
    out = capsys.readouterr().out
    assert "2 kernels, 250.5 µs first start to last end" in out
    assert "| chunk_cumsum_kernel | 7 | 0.0 | 21.6 | 21.6 |" in out
    assert "| " + "x" * 59 + "… | 16 | 25.0 | 250.5 | 225.5 |" in out
