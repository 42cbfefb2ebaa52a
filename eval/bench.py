"""Speed of the Gated DeltaNet paths beside flash-linear-attention, in one process on one GPU.

    python -m eval.bench [--out out/bench] [--shapes anchors] [--no-backward]
    python -m eval.bench --sweep [fused,kkt,bwd,stages]     # launch variants, printed

Times (``triton.testing.do_bench``, median) on the inputs of the project's anchor measurements
(fla 0.6.0 and FlashQLA on the same machine) — q, k
L2-normalised, v ~ N(0,1), g = logsigmoid(N(0,1)), beta ~ U(0,1), initial state 0.1·N(0,1),
output_final_state=True, bf16, K = V = 128 — for:

- forward: our ``fused`` and ``materialized`` backends and fla 0.6.0 (if importable, forced onto
  its own Triton path with FLA_FLASH_QLA=0), with the ratio to fla and the fraction of the
  roofline floor (max of HBM bytes at the measured copy bandwidth and bf16 tensor-core FLOPs);
- forward + backward of our backends (fla's gated backward refuses on Triton 3.6 / Hopper);
- kkt_solve alone (fp32 A in, bf16 T out) beside fla's ``solve_tril`` on the same A, with
  bytes moved and the fraction of the measured copy bandwidth.

Writes ``bench.md`` (tables), ``bench.csv`` and ``bench.png`` into --out.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import os
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ANCHOR_SHAPES = [(1, 32768), (8, 4096), (1, 8192), (1, 2048), (32, 2048)]  # (B, T)
H, HV, DIM, CHUNK = 16, 32, 128, 64
TENSOR_CORE_FLOPS = 706e12  # measured dense bf16 matmul on the H200 (anchors.md)


def make_inputs(B, T, device="cuda", dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, DIM, device=device), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, DIM, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, DIM, device=device, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, device=device))
    beta = torch.rand(B, T, HV, device=device)
    h0 = 0.1 * torch.randn(B, HV, DIM, DIM, device=device)
    return q, k, v, g, beta, h0


def copy_bandwidth():
    """Device-to-device copy, bytes read + written per second."""
    import triton
    x = torch.empty(1 << 28, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def roofline_floor_ms(B, T, bandwidth):
    """Lower bound of one forward: HBM bytes at copy bandwidth vs bf16 tensor-core FLOPs."""
    tokens = B * T
    bytes_ = tokens * (2 * H * DIM * 2 + 2 * HV * DIM * 2 + 2 * HV * 4) + 2 * B * HV * DIM * DIM * 4
    macs = tokens * HV * (CHUNK * (3 * DIM + 2 * DIM) + 3 * DIM * DIM + CHUNK * CHUNK // 3)
    return max(bytes_ / bandwidth, 2 * macs / TENSOR_CORE_FLOPS) * 1e3


def load_fla():
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.utils.solve_tril import solve_tril
        return fla_chunk, solve_tril
    except Exception as e:  # fla is a baseline, never a dependency
        print(f"fla not importable ({e!r}): its columns stay empty")
        return None, None


def graphed(fn):
    """fn captured into a CUDA graph: its replay. Warmed up on a side stream first (no compile
    inside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_ms(fn):
    """do_bench median of a CUDA-graph replay of fn (:func:`graphed`): the kernels' own time,
    without the host work that binds short calls (eval.host_time); None, with the reason
    printed, if fn cannot be captured."""
    import triton
    try:
        return triton.testing.do_bench(graphed(fn), return_mode="median")
    except Exception as e:  # a baseline that cannot be captured keeps its other numbers
        print(f"  capture failed: {e!r}", flush=True)
        return None


def rel_diff(x, ref):
    """‖x − ref‖ / ‖ref‖ in fp32 (Frobenius; the difference taken in fp32, not in x's dtype):
    how far a kernel's output is from another's."""
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_forward(shapes, bandwidth, fla_chunk, backward, backward_graph=False):
    import triton
    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.kernels import chunk_bwd, fused_fwd, pdl
    from gdn_fused.kernels.chunk_index import sm_count
    from gdn_fused.kernels.materialized import uses_state_output_kernel
    from gdn_fused.ops import resolve_backend
    gluon = _gluon_kernel("gluon_forward", "gluon_forward", "GDN_BENCH_SKIP_GLUON_FORWARD")
    rows = []
    for B, T in shapes:
        q, k, v, g, beta, h0 = make_inputs(B, T)
        row = dict(B=B, T=T, floor_ms=roofline_floor_ms(B, T, bandwidth))

        def call(backend, gates=g):
            return lambda: chunk_gated_delta_rule(q, k, v, gates, beta, initial_state=h0,
                                                  output_final_state=True, backend=backend)

        def forward_ms(backend, gates=g):
            return triton.testing.do_bench(call(backend, gates), return_mode="median")

        def fused_with(label, *patches, gates=g):
            """fused_<label>_ms and _graph_ms: the fused forward with each (module, name,
            value) of ``patches`` set for the timing (an A/B in the same run), then restored;
            ``gates`` in place of g."""
            with contextlib.ExitStack() as stack:
                for module, attr, value in patches:
                    stack.enter_context(mock.patch.object(module, attr, value))
                row[f"fused_{label}_ms"] = forward_ms("fused", gates)
                row[f"fused_{label}_graph_ms"] = graph_ms(call("fused", gates))
        if fused_fwd.uses_warp_specialized(q, v, CHUNK, None):
            from gdn_fused.kernels import gluon_transposed
        for name in ("fused", "materialized"):
            if name == "fused" and resolve_backend("fused", q, v, CHUNK) != "fused":
                continue
            row[f"{name}_ms"] = forward_ms(name)
            row[f"{name}_graph_ms"] = graph_ms(call(name))
            if name == "fused" and fused_fwd.uses_warp_specialized(q, v, CHUNK, None) and \
                    gluon_transposed.num_segments(B * v.shape[2], 10 ** 9,
                                                  sm_count(q.device)) == 2:
                # A/B in the same run where B·HV admits two segments: never split and always
                # split (gluon_transposed.MIN_CHUNKS_TO_SPLIT), against the default
                for label, threshold in (("unsplit", 10 ** 9), ("split", 1)):
                    fused_with(label, (gluon_transposed, "MIN_CHUNKS_TO_SPLIT", threshold),
                               (gluon_transposed, "MIN_CHUNKS_TO_SPLIT_CAPTURED", threshold))
            if name == "fused" and fused_fwd.uses_warp_specialized(q, v, CHUNK, None) and \
                    gluon_transposed.STATE_UPDATE_LO:
                # A/B in the same run: the chain's state update with D V' as one bf16 product
                # everywhere, and as its high and low halves in every chunk (what a head that
                # keeps its state, γ > STATE_UPDATE_LO_ABOVE, costs; these inputs' chunks
                # forget theirs, so the default takes one product)
                fused_with("hi_only", (gluon_transposed, "STATE_UPDATE_LO", False))
                fused_with("lo_every_chunk", (gluon_transposed, "STATE_UPDATE_LO_ABOVE", -1.0))
                # and the default where every chunk takes the low half through its branch
                # (g = 0: γ = 1; the time only, these gates' outputs are not compared)
                fused_with("g_zero", gates=torch.zeros_like(g))
            if name == "fused" and fused_fwd.uses_warp_specialized(q, v, CHUNK, None):
                # A/B in the same run: forward_t with two output warpgroups on alternate chunks
                # (session 18 to 22's form) against one (gluon_transposed.CHAIN_OUTPUT_GROUPS)
                fused_with("two_output_groups", (gluon_transposed, "CHAIN_OUTPUT_GROUPS", 2))
            if name == "fused" and pdl.pdl_applies(q.device):
                # A/B in the same run: every launch plain, no programmatic dependent launch
                # between cumsum, the inverse and forward_t (kernels/pdl.py)
                fused_with("no_pdl", (pdl, "PDL", False))
            if (name == "fused" and fused_fwd.uses_warp_specialized(q, v, CHUNK, None)
                    and fused_fwd.inverse_cut(B, T, v.shape[2], q.device, CHUNK)):
                # A/B in the same run: the whole inverse before forward_t instead of segment
                # 1's beside segment 0's state pass (kernels/fused_fwd.py, SPLIT_INVERSE)
                fused_with("whole_inverse", (fused_fwd, "SPLIT_INVERSE", False))
            if backward:
                leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
                do = torch.randn_like(v)

                def fwd_bwd():
                    o, _ = chunk_gated_delta_rule(*leaves, initial_state=h0,
                                                  output_final_state=True, backend=name)
                    torch.autograd.grad(o, leaves, do)
                row[f"{name}_fwdbwd_ms"] = triton.testing.do_bench(fwd_bwd, return_mode="median")
                if name == "fused" and chunk_bwd.overlaps_recompute(
                        chunk_bwd.uses_gluon_bwd_state(q, v, CHUNK, None), q, v):
                    # A/B in the same run: the reverse state pass and the recompute one after
                    # the other instead of side by side (kernels/chunk_bwd.py)
                    with mock.patch.object(chunk_bwd, "OVERLAP_RECOMPUTE", False):
                        row["fused_fwdbwd_serial_ms"] = triton.testing.do_bench(
                            fwd_bwd, return_mode="median")
                if backward_graph:
                    # the same under a CUDA-graph replay: whether a short row's fwd+bwd is
                    # bound by the host (about twenty launches) or by the kernels (opt-in: it
                    # adds a capture a row)
                    row[f"{name}_fwdbwd_graph_ms"] = graph_ms(fwd_bwd)
                if name == "fused" and chunk_bwd.CHAIN_T:
                    # A/B in the same run: the backward forming W and U (recompute_w_u) instead
                    # of its chain form (kernels/chunk_bwd.py, CHAIN_T)
                    with mock.patch.object(chunk_bwd, "CHAIN_T", False):
                        row["fused_fwdbwd_w_u_ms"] = triton.testing.do_bench(
                            fwd_bwd, return_mode="median")
                        if backward_graph:
                            row["fused_fwdbwd_w_u_graph_ms"] = graph_ms(fwd_bwd)
        if uses_state_output_kernel(q, v, CHUNK, None):
            # A/B in the same run: the materialized forward with chunk_state + chunk_output in
            # place of its Gluon state + output kernel
            with mock.patch.dict(os.environ, GDN_STATE_OUTPUT_KERNEL="0"):
                row["materialized_tl_ms"] = forward_ms("materialized")
        if "fused_ms" in row and fused_fwd.uses_warp_specialized(q, v, CHUNK, None):
            # the same A/B for the fused backend: its plain-Triton kernel in place of the
            # warp-specialized route (kernels/fused_fwd.py, WARP_SPECIALIZED)
            with mock.patch.object(fused_fwd, "WARP_SPECIALIZED", False):
                row["fused_tl_ms"] = forward_ms("fused")
        if gluon is not None:
            # the experimental three-launch Gluon forward (kernels/gluon_forward.py), forward only
            try:
                o_g, _ = gluon(q, k, v, g, beta, DIM ** -0.5, h0, True)
                o_m, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                backend="materialized")
                row["gluon_rel_diff_vs_materialized"] = rel_diff(o_g, o_m)
                row["gluon_ms"] = triton.testing.do_bench(
                    lambda: gluon(q, k, v, g, beta, DIM ** -0.5, h0, True),
                    return_mode="median")
            except Exception as e:  # experimental: report, keep the other numbers
                print(f"gluon_forward failed at B={B}, T={T}: {e!r}", flush=True)
        if fla_chunk is not None:
            fn = lambda: fla_chunk(q, k, v, g, beta, initial_state=h0,  # noqa: E731
                                   output_final_state=True)
            row["fla_ms"] = triton.testing.do_bench(fn, return_mode="median")
            row["fla_graph_ms"] = graph_ms(fn)
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def bench_kkt_solve(bandwidth, solve_tril, B=8, T=4096):
    """kkt_solve on B·T/64·HV = 16384 chunk-head tiles: fp32 A in, bf16 T out."""
    import triton
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt import chunk_kkt
    from gdn_fused.kernels.kkt_solve import kkt_solve, kkt_solve_from_k
    q, k, v, g, beta, _ = make_inputs(B, T)
    A = chunk_kkt(k, chunk_cumsum(g, CHUNK), beta, HV, CHUNK)
    ref = torch.linalg.inv(torch.eye(CHUNK, device="cuda", dtype=torch.float64) + A.double()
                           .reshape(B, T // CHUNK, CHUNK, HV, CHUNK).permute(0, 1, 3, 2, 4))
    ours32 = kkt_solve(A, torch.float32).reshape(B, T // CHUNK, CHUNK, HV, CHUNK).permute(0, 1, 3, 2, 4)
    err = (ours32.double() - ref).abs().max().item()
    row = dict(tiles=B * T // CHUNK * HV, max_abs_err_fp32=err)
    # bytes: what the kernel must move (the strict lower triangle of A could be skipped, but
    # the fla comparison counts all of A like anchors.md): A fp32 read + T bf16 written
    bytes_ = A.numel() * 4 + A.numel() * 2
    row["bytes_MB"] = bytes_ / 1e6
    row["floor_us"] = bytes_ / bandwidth * 1e6
    ms = triton.testing.do_bench(lambda: kkt_solve(A, torch.bfloat16), return_mode="median")
    row["ours_us"] = ms * 1e3
    # the tl kernel beside the default (the Gluon one on this GPU: kkt_solve's kernel="auto")
    row["tl_us"] = 1e3 * triton.testing.do_bench(
        lambda: kkt_solve(A, torch.bfloat16, kernel="triton"), return_mode="median")
    row["ours_frac_bw"] = row["floor_us"] / row["ours_us"]
    # the forward's route from the keys (chunk_inverse): chunk_kkt + kkt_solve against the
    # Gluon kernel that forms A on chip (kkt_solve_from_k; A never in HBM)
    G = chunk_cumsum(g, CHUNK)
    row["kkt_plus_solve_us"] = 1e3 * triton.testing.do_bench(
        lambda: kkt_solve(chunk_kkt(k, G, beta, HV, CHUNK), torch.bfloat16), return_mode="median")
    row["from_k_us"] = 1e3 * triton.testing.do_bench(
        lambda: kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16), return_mode="median")
    if solve_tril is not None:
        ms = triton.testing.do_bench(lambda: solve_tril(A, output_dtype=torch.bfloat16),
                                     return_mode="median")
        row["fla_us"] = ms * 1e3
        row["ratio_vs_fla"] = row["ours_us"] / row["fla_us"]
        fla32 = solve_tril(A, output_dtype=torch.float32).reshape(B, T // CHUNK, CHUNK, HV, CHUNK)
        row["fla_max_abs_err_fp32"] = (fla32.permute(0, 1, 3, 2, 4).double() - ref).abs().max().item()
    print(row, flush=True)
    return row


def bench_stages(B=1, T=32768):
    """Time of each materialized kernel at one shape: where the forward's time goes."""
    import triton
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_output import chunk_output
    from gdn_fused.kernels.chunk_state import chunk_state
    from gdn_fused.kernels.kkt import chunk_kkt
    from gdn_fused.kernels.kkt_solve import kkt_solve, kkt_solve_from_k
    from gdn_fused.kernels.wu import recompute_w_u
    q, k, v, g, beta, h0 = make_inputs(B, T)
    prec = "tf32"
    G = chunk_cumsum(g, CHUNK)
    Ai = kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16)
    w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision=prec)
    h, v_new, _ = chunk_state(k, w, u, G, h0, True, CHUNK, B, dot_precision=prec)
    stages = {
        "chunk_cumsum": lambda: chunk_cumsum(g, CHUNK),
        # chunk_inverse's route on this GPU (the Gluon kernel from k), then the tl one and
        # the route through HBM (kernels/kkt_solve.py A_THROUGH_HBM)
        "kkt_solve_from_k": lambda: kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16),
        "kkt_solve_from_k tl": lambda: kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16,
                                                        kernel="triton"),
        "chunk_kkt": lambda: chunk_kkt(k, G, beta, HV, CHUNK),
        "chunk_kkt + kkt_solve": lambda: kkt_solve(chunk_kkt(k, G, beta, HV, CHUNK),
                                                   torch.bfloat16),
        "recompute_w_u": lambda: recompute_w_u(k, v, G, beta, Ai, dot_precision=prec),
        "chunk_state": lambda: chunk_state(k, w, u, G, h0, True, CHUNK, B, dot_precision=prec),
        "chunk_output": lambda: chunk_output(q, k, v_new, h, G, 0.1, CHUNK, dot_precision=prec),
    }
    for bv in (16, 32, 64):  # state_blocks picks 32 here (measured 2026-11-29: 796/659/877)
        stages[f"chunk_state BV={bv}"] = lambda bv=bv: chunk_state(
            k, w, u, G, h0, True, CHUNK, B, dot_precision=prec, block_v=bv)
    gluon = _gluon_kernel("gluon_state", "chunk_state_gluon", "GDN_BENCH_SKIP_GLUON")
    if gluon is not None:
        # the experimental warp-specialized state pass (kernels/gluon_state.py), same inputs;
        # predicted ~0.7 µs per chunk step against chunk_state's 1.65 (docs/fused_design.md)
        try:
            h_g, v_new_g, _ = gluon(k, w, u, G, h0, True)
            print("chunk_state_gluon rel err vs chunk_state: h "
                  f"{rel_diff(h_g, h):.2e}, v_new "
                  f"{rel_diff(v_new_g, v_new):.2e}",
                  flush=True)
            stages["chunk_state_gluon"] = lambda: gluon(k, w, u, G, h0, True)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"chunk_state_gluon failed: {e!r}", flush=True)
    fused_out = _gluon_kernel("gluon_state_output", "chunk_state_output_gluon",
                              "GDN_BENCH_SKIP_GLUON_OUTPUT")
    # the Triton pair the Gluon state + output kernels below replace, and its o
    o_ref = chunk_output(q, k, v_new, h, G, 0.1, CHUNK, dot_precision=prec)
    stages["chunk_state + chunk_output"] = lambda: chunk_output(
        q, k, chunk_state(k, w, u, G, h0, True, CHUNK, B, dot_precision=prec)[1],
        h, G, 0.1, CHUNK, dot_precision=prec)
    if fused_out is not None:
        # the experimental state pass + output in one Gluon kernel (kernels/
        # gluon_state_output.py): o without writing h; compare with chunk_state + chunk_output
        try:
            o_g, _ = fused_out(q, k, w, u, G, 0.1, h0, True)
            print("chunk_state_output_gluon rel err vs chunk_state + chunk_output: o "
                  f"{rel_diff(o_g, o_ref):.2e}",
                  flush=True)
            stages["chunk_state_output_gluon"] = lambda: fused_out(q, k, w, u, G, 0.1, h0, True)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"chunk_state_output_gluon failed: {e!r}", flush=True)
    transposed = _gluon_kernel("gluon_transposed", "chunk_state_output_t",
                               "GDN_BENCH_SKIP_GLUON_T")
    if transposed is not None:
        # the transposed-state kernel the materialized forward runs on Hopper
        # (kernels/gluon_transposed.py; 796 µs here on 2026-11-30 (s7) against 1,180 for
        # chunk_state + chunk_output), unsplit and cut into two segments
        try:
            o_t, _ = transposed(q, k, w, u, G, 0.1, h0, True, segments=1)
            print("chunk_state_output_t rel err vs chunk_state + chunk_output: o "
                  f"{rel_diff(o_t, o_ref):.2e}",
                  flush=True)
            stages["chunk_state_output_t"] = lambda: transposed(q, k, w, u, G, 0.1, h0, True,
                                                                segments=1)
            stages["chunk_state_output_t 2 segments"] = lambda: transposed(
                q, k, w, u, G, 0.1, h0, True, segments=2)
            stages["chunk_state_output_t 1 output group"] = lambda: transposed(
                q, k, w, u, G, 0.1, h0, True, segments=1, output_groups=1)
            # launch variants of the two output warpgroups: Q read by wgmma from the ring
            # (the stage held until O's products have run) and their register budget
            for name, variant in (("q from shared", dict(Q_REGS=False)),
                                  ("q from shared, 120 output registers",
                                   dict(Q_REGS=False, OUT_REGS_TWO=120))):
                o_v, _ = transposed(q, k, w, u, G, 0.1, h0, True, segments=1, variant=variant)
                print(f"chunk_state_output_t {name}: rel diff from the default o "
                      f"{rel_diff(o_v, o_t):.2e}",
                      flush=True)
                stages[f"chunk_state_output_t {name}"] = (
                    lambda variant=variant: transposed(q, k, w, u, G, 0.1, h0, True,
                                                       segments=1, variant=variant))
            stages["chunk_state_output_t state only"] = lambda: transposed(
                q, k, w, u, G, 0.1, h0, True, output=False, segments=1)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"chunk_state_output_t failed: {e!r}", flush=True)
    forward_t = _gluon_kernel("gluon_transposed", "forward_t",
                              "GDN_BENCH_SKIP_GLUON_T_EXPERIMENTAL")
    state_t = _gluon_kernel("gluon_transposed", "chunk_state_t",
                            "GDN_BENCH_SKIP_GLUON_T_EXPERIMENTAL")
    if state_t is not None:
        # experimental: chunk_state's contract (the backward's recompute) on the transposed
        # chain; 1,121–1,187 µs here with one store warpgroup against chunk_state's 655
        # (session 7), two store warpgroups on alternate chunks by default
        try:
            h_t, v_new_t, _ = state_t(k, w, u, G, h0, True, segments=1)
            print("chunk_state_t rel diff vs chunk_state: h "
                  f"{rel_diff(h_t, h):.2e}, v_new "
                  f"{rel_diff(v_new_t, v_new):.2e}",
                  flush=True)
            stages["chunk_state_t"] = lambda: state_t(k, w, u, G, h0, True, segments=1)
            stages["chunk_state_t 1 store group"] = lambda: state_t(k, w, u, G, h0, True,
                                                                    segments=1, store_groups=1)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"chunk_state_t failed: {e!r}", flush=True)
    if forward_t is not None and transposed is not None:
        # the fused backend's Hopper route (V' formed on the chain from T and v; its W/U
        # warpgroup form too) beside recompute_w_u + the kernel above, split as the route
        # splits (num_segments) and unsplit
        try:
            o_f, _ = forward_t(q, k, v, G, beta, Ai, 0.1, h0, True)
            print("forward_t rel diff vs recompute_w_u + chunk_state + chunk_output: o "
                  f"{rel_diff(o_f, o_ref):.2e}",
                  flush=True)
            stages["recompute_w_u + chunk_state_output_t"] = lambda: transposed(
                q, k, *recompute_w_u(k, v, G, beta, Ai, dot_precision=prec), G, 0.1, h0, True)
            stages["forward_t (V' on the chain)"] = lambda: forward_t(q, k, v, G, beta, Ai,
                                                                      0.1, h0, True)
            stages["forward_t (W/U warpgroup)"] = lambda: forward_t(
                q, k, v, G, beta, Ai, 0.1, h0, True, t_on_chain=False)
            stages["forward_t 1 segment"] = lambda: forward_t(q, k, v, G, beta, Ai, 0.1, h0,
                                                              True, segments=1)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"forward_t failed: {e!r}", flush=True)
    wu = _gluon_kernel("gluon_wu", "wu_gluon", "GDN_BENCH_SKIP_GLUON_WU")
    if wu is not None:
        # the experimental chunk-parallel half in one Gluon kernel (kernels/gluon_wu.py): w, u
        # without T in HBM; compare with kkt_solve_from_k + recompute_w_u
        try:
            w_g, u_g = wu(k, v, G, beta)
            print("wu_gluon rel err vs kkt_solve_from_k + recompute_w_u: w "
                  f"{rel_diff(w_g, w):.2e}, u "
                  f"{rel_diff(u_g, u):.2e}", flush=True)
            stages["kkt_solve_from_k + recompute_w_u"] = lambda: recompute_w_u(
                k, v, G, beta, kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16),
                dot_precision=prec)
            stages["wu_gluon"] = lambda: wu(k, v, G, beta)
        except Exception as e:  # experimental: report, keep the other numbers
            print(f"wu_gluon failed: {e!r}", flush=True)
    row = {}
    for name, fn in stages.items():
        try:
            row[name] = 1e3 * triton.testing.do_bench(fn, return_mode="median")
        except Exception as e:  # an experimental stage must not cost the other numbers
            print(f"{name} failed: {e!r}", flush=True)
    print(f"materialized stages at B={B}, T={T}, µs:", {k: round(v, 1) for k, v in row.items()},
          flush=True)
    return row


# Launch variants timed beside the defaults: (stage, options). The defaults of session 5 were
# measured on the H200 on 2026-11-30 at (1, 32768) (dqkwg then took 64 value columns a step; since
# session 8 it takes 128 in one, 1,986 µs: chunk_bwd_dqkwg.BLOCK_V): chunk_bwd_state BV 16 / 32 /
# 64 1,563 / 934 / 1,675 µs (32 taken); chunk_bwd_dqkwg 1,836 µs and wu_bwd 1,352 µs at 4 warps,
# 64 value columns a step and Triton's stages, against 8 warps 2,809 / 2,278, 32 columns 1,876 /
# 1,341, one stage 2,059 / 1,359, three stages 1,835 / 1,362. wu_bwd's pipelined stages read
# refilled tiles (wu_bwd.STAGES: one stage since session 8); at 8 warps it took 2,353 µs.
# Register caps (eval.ptxas, sm_90a): both kernels hold 255 registers at 4 warps (2 programs an
# SM); capped at 168 (3 an SM) wu_bwd spills 368 B and chunk_bwd_dqkwg 964 B, and the spills
# cost more than the occupancy gains (H200, session 8, (1, 32768): wu_bwd 1,354 → 1,474 µs,
# dqkwg 1,836 → 2,823; dqkwg at one stage 2,056). More programs an SM must come from fewer
# live accumulators (splitting dqkwg), not from a cap. The rows with wu_bwd at Triton's 3
# stages and dqkwg at 64 value columns and 3 stages time the miscompiled pipelines, for what
# the pipelining would be worth (chunk_bwd_dqkwg.BLOCK_V, wu_bwd.STAGES); dqkwg at 64 columns
# alone runs one stage (its launcher's rule past one value block).
# Session 9 (dq / dk partials in bf16): dqkwg 1,820 µs with q, k loaded after the value loop;
# all 128 key columns a program in 8 warps, two value steps of 64 at one stage 1,993; the same
# with one step of 128 (spills) 2,519; the racing pipelined form (64 value columns, 3 stages)
# 1,642; q and k loaded before the loop (QK_FIRST, the default since) 1,767 against 1,851.
# Session 15: a persistent dqkwg (programs looping over the (key block, chunk, head) items,
# the loop pipelined so the next item's loads overlap this one's products; no wgmma hazard)
# took 1,988 µs at one stage, 2 an SM (the default 1,747 in the same run), 2,830 at 2
# stages (1 an SM: 164 KB; Triton 3.6 issued the next item's copies after this item's stores
# and waited for them at the loop's top), and 4,145 / 4,732 at 3 stages with 32 key columns
# at 4 / 8 warps (the only form whose copies stay in flight: 213 KB, one an SM; 64 key columns
# need 256 KB). Removed. The Gluon form (kernels/gluon_dqkwg.py) took 1,427 µs in the run where
# the Triton kernel took 1,750 ("chunk_bwd_dqkwg gluon" row; its earlier forms in its docstring);
# at two CTAs an SM (session 20) 1,177 against 1,425 for the one-CTA form in the same run.
BWD_VARIANTS = [("chunk_bwd_state", dict(block_v=bv)) for bv in (16, 64)] + [
    ("wu_bwd", dict(num_stages=3)), ("chunk_bwd_dqkwg", dict(block_k=128, block_v=64)),
    ("chunk_bwd_dqkwg", dict(block_v=64, num_stages=3)),
    ("chunk_bwd_dqkwg", dict(QK_FIRST=True)), ("chunk_bwd_dqkwg", dict(QK_FIRST=False))] + [
    # the recompute split at the checkpoints: 1,024 programs of 32 value columns instead of
    # 512 of 64 (state_blocks' choice for 256 sequence-heads), or 3 stages (one an SM). H200,
    # session 15: 421 µs (unsplit 659), 32 columns 559, 3 stages 441
    ("chunk_state (checkpoints)", dict(block_v=32)),
    ("chunk_state (checkpoints)", dict(num_stages=3))]
# Shared memory and registers (eval.ptxas, sm_90a, K = V = 128): chunk_state's three stages
# take 117 KB (one program an SM: 8 warps an SM at B·HV ≥ 132), two 81 KB; chunk_output holds
# 150 registers at 4 warps (3 programs an SM), chunk_bwd_dqkwg 255 at 4 warps with 105 KB of
# stages (2 an SM; 80 KB with one value block since session 8, which alone keeps it at 2 an
# SM), wu_bwd 255 with spills at 3 stages (one stage since session 8: 252, no spills, with the
# bf16 partials of session 9). dqkwg's variants: block_v = 32 runs one stage (its launcher's
# rule past one value block), num_stages = 2 has one value block to pipeline.
LAUNCH_VARIANTS = (
    [("chunk_state", dict(block_v=bv, num_stages=st)) for bv in (32, 64) for st in (1, 2)]
    + [("chunk_output", dict(num_warps=8)), ("chunk_output", dict(num_stages=1))]
    + [("chunk_bwd_state", dict(num_stages=st)) for st in (1, 2)]
    + [("chunk_bwd_dqkwg", kw) for kw in (dict(block_k=32), dict(block_k=32, block_v=32),
                                          dict(num_stages=2))]
    + [("wu_bwd", dict(num_warps=8)), ("recompute_w_u", dict(num_warps=4))])


def bench_bwd_stages(B=1, T=32768, variants=BWD_VARIANTS, device="cuda", dtype=torch.bfloat16):
    """Time of each backward kernel at one shape (kernels/chunk_bwd.py's sequence: the forward
    recompute, then dv_local, the reverse state pass, dq/dk/dw/dg, wu_bwd) and of the forward's
    chunk_output, with the defaults and with each (stage, launch options) of ``variants``.
    ``device``, ``dtype``: the inputs' (a CPU test runs the composition under the interpreter
    with do_bench stubbed)."""
    import triton
    from gdn_fused.kernels.streams import side_by_side
    from gdn_fused.kernels.chunk_bwd_dqkwg import chunk_bwd_dqkwg
    from gdn_fused.kernels.chunk_bwd_dv import chunk_bwd_dv_local
    from gdn_fused.kernels.chunk_bwd_state import chunk_bwd_state
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.chunk_index import chunk_layout
    from gdn_fused.kernels.chunk_output import chunk_output
    from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS, chunk_state, new_checkpoints
    from gdn_fused.kernels.group_sum import group_sum
    from gdn_fused.kernels.kkt import dot_precision
    from gdn_fused.kernels.kkt_solve import chunk_inverse, default_inverse_dtype
    from gdn_fused.kernels.materialized import gluon_tiles_apply
    from gdn_fused.kernels.wu import recompute_w_u
    from gdn_fused.kernels.wu_bwd import wu_bwd
    q, k, v, g, beta, h0 = make_inputs(B, T, device, dtype)
    do, dht, scale = torch.randn_like(v), torch.randn_like(h0), DIM ** -0.5
    prec = dot_precision(q.dtype)
    N, offsets, idx = chunk_layout(None, B, CHUNK)
    G = chunk_cumsum(g, CHUNK, **idx)
    Ai = chunk_inverse(k, G, beta, HV, CHUNK, default_inverse_dtype(q.dtype), **idx)
    w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision=prec, **idx)
    h, v_new, _ = chunk_state(k, w, u, G, h0, False, CHUNK, N, chunk_offsets=offsets,
                              num_chunks=idx["num_chunks"], dot_precision=prec)
    dv_local = chunk_bwd_dv_local(q, k, g, do, scale, CHUNK, dot_precision=prec, **idx)
    dh, dv2, _ = chunk_bwd_state(q, k, w, g, do, dv_local, scale, dht, h0, CHUNK, N,
                                 chunk_offsets=offsets, num_chunks=idx["num_chunks"],
                                 dot_precision=prec)
    dq, dk, dw, dg_part = chunk_bwd_dqkwg(q, k, v_new, h, dh, g, do, dv2, scale, CHUNK,
                                          chunk_offsets=offsets, dot_precision=prec, **idx)
    checkpoints = new_checkpoints(B, T, HV, DIM, DIM, CHUNK, q.device)
    if checkpoints is not None:
        NT = triton.cdiv(T, CHUNK)
        for s in range(checkpoints.shape[0]):
            checkpoints[s] = h.view(B, NT, HV, DIM, DIM)[:, (s + 1) * SEGMENT_CHUNKS]
    kernels = {
        "chunk_inverse": lambda **kw: chunk_inverse(
            k, G, beta, HV, CHUNK, default_inverse_dtype(q.dtype), **idx, **kw),
        "recompute_w_u": lambda **kw: recompute_w_u(k, v, G, beta, Ai, dot_precision=prec,
                                                    **idx, **kw),
        "chunk_state": lambda **kw: chunk_state(k, w, u, G, h0, False, CHUNK, N,
                                                chunk_offsets=offsets,
                                                num_chunks=idx["num_chunks"],
                                                dot_precision=prec, **kw),
        # split at a training forward's checkpoints where it stores them (B·HV small; else the
        # unsplit pass again): the states entering every SEGMENT_CHUNKS-th chunk, read here off
        # the bf16 h (a timing row: the values do not change the work)
        "chunk_state (checkpoints)": lambda **kw: chunk_state(
            k, w, u, G, h0, False, CHUNK, N, chunk_offsets=offsets,
            num_chunks=idx["num_chunks"], dot_precision=prec, checkpoints=checkpoints, **kw),
        # the chain form the backward runs (chunk_bwd.CHAIN_T): T and v in W's and U's places
        "chunk_state (checkpoints, T and v)": lambda **kw: chunk_state(
            k, Ai, v, G, h0, False, CHUNK, N, chunk_offsets=offsets,
            num_chunks=idx["num_chunks"], dot_precision=prec, checkpoints=checkpoints,
            beta=beta, **kw),
        "chunk_output": lambda **kw: chunk_output(q, k, v_new, h, G, scale, CHUNK,
                                                  chunk_offsets=offsets, dot_precision=prec,
                                                  **idx, **kw),
        "chunk_bwd_dv_local": lambda **kw: chunk_bwd_dv_local(q, k, g, do, scale, CHUNK,
                                                              dot_precision=prec, **idx, **kw),
        "chunk_bwd_state": lambda **kw: chunk_bwd_state(
            q, k, w, g, do, dv_local, scale, dht, h0, CHUNK, N, chunk_offsets=offsets,
            num_chunks=idx["num_chunks"], dot_precision=prec, **kw),
        # the transposed Gluon chain (kernels/gluon_bwd_state.py; GPU only)
        "chunk_bwd_state transposed gluon": lambda: chunk_bwd_state_t(
            q, k, w, gate_rows, do, dv_local, scale, dht, h0),
        # the Gluon reverse pass and the recompute at the checkpoints, one after the other
        # and on two streams (streams.side_by_side, where the reverse pass leaves SMs idle)
        "bwd state gluon, then chunk_state (checkpoints)": lambda: (
            kernels["chunk_bwd_state transposed gluon"](),
            kernels["chunk_state (checkpoints)"]()),
        "bwd state gluon beside chunk_state (checkpoints)": lambda: side_by_side(
            kernels["chunk_bwd_state transposed gluon"], kernels["chunk_state (checkpoints)"],
            q.device),
        # the same pair in the chain form (T for W; T and v for W and U)
        "chunk_bwd_state transposed gluon, T for W": lambda: chunk_bwd_state_t(
            q, k, Ai, beta_rows, do, dv_local, scale, dht, h0, chain_t=True),
        "bwd state gluon beside chunk_state (checkpoints), T for W": lambda: side_by_side(
            kernels["chunk_bwd_state transposed gluon, T for W"],
            kernels["chunk_state (checkpoints, T and v)"], q.device),
        # with both value blocks of a head a program (gluon_bwd_state.TWO_CHAINS, off so far)
        "chunk_bwd_state transposed gluon, T for W, two chains": lambda: chunk_bwd_state_t(
            q, k, Ai, beta_rows, do, dv_local, scale, dht, h0, chain_t=True, chains=2),
        "bwd state gluon beside chunk_state (checkpoints), T for W, two chains": lambda:
            side_by_side(kernels["chunk_bwd_state transposed gluon, T for W, two chains"],
                         kernels["chunk_state (checkpoints, T and v)"], q.device),
        "chunk_bwd_dqkwg": lambda **kw: chunk_bwd_dqkwg(
            q, k, v_new, h, dh, g, do, dv2, scale, CHUNK, chunk_offsets=offsets,
            dot_precision=prec, **idx, **kw),
        # the persistent warp-specialized Gluon form (kernels/gluon_dqkwg.py; GPU only)
        "chunk_bwd_dqkwg gluon": lambda **kw: chunk_bwd_dqkwg_gluon(
            q, k, v_new, h, dh, G, do, dv2, scale, **kw),
        "wu_bwd": lambda **kw: wu_bwd(k, v, g, beta, Ai, dw, dv2, dk, dg_part, CHUNK,
                                      dot_precision=prec, **idx, **kw),
        # the persistent warp-specialized Gluon form (kernels/gluon_wu_bwd.py; GPU only)
        "wu_bwd gluon": lambda **kw: wu_bwd_gluon(k, v, G, beta, Ai, dw, dv2, dk, dg_part,
                                                  g.dtype, **kw),
        # the GVA sums of dq and dk, and torch's expression they replaced (session 8; two passes
        # over fp32 partials then, one over the bf16 partials of session 9)
        "group_sum dq+dk": lambda: (group_sum(dq, H, q.dtype), group_sum(dk, H, k.dtype)),
        "group_sum dq+dk (torch)": lambda: tuple(
            x.view(B, T, H, HV // H, DIM).sum(3).to(q.dtype) for x in (dq, dk)),
    }
    if not gluon_tiles_apply(q, do, CHUNK, None) or Ai.dtype != torch.bfloat16:
        for name in ("chunk_bwd_dqkwg gluon", "wu_bwd gluon", "chunk_bwd_state transposed gluon",
                     "bwd state gluon, then chunk_state (checkpoints)",
                     "bwd state gluon beside chunk_state (checkpoints)",
                     "chunk_bwd_state transposed gluon, T for W",
                     "bwd state gluon beside chunk_state (checkpoints), T for W",
                     "chunk_bwd_state transposed gluon, T for W, two chains",
                     "bwd state gluon beside chunk_state (checkpoints), T for W, two chains"):
            del kernels[name]
    else:
        from gdn_fused.kernels.gluon_dqkwg import chunk_bwd_dqkwg_gluon
        from gdn_fused.kernels.gluon_wu_bwd import wu_bwd_gluon
        from gdn_fused.kernels.gluon_bwd_state import chunk_bwd_state_t
        _, gate_rows = chunk_cumsum(g, CHUNK, gate_rows=[])
        _, beta_rows = chunk_cumsum(g, CHUNK, gate_rows=[beta], chain_rows=True)
        got = chunk_bwd_state_t(q, k, w, gate_rows, do, dv_local, scale, dht, h0)
        print("bwd state gluon vs triton (dh, dv2), rel:",
              [f"{rel_diff(a, b):.2e}" for a, b in zip(got[:2], (dh, dv2))], flush=True)
        got = chunk_bwd_state_t(q, k, Ai, beta_rows, do, dv_local, scale, dht, h0,
                                chain_t=True)
        print("bwd state gluon, T for W, vs triton with W (dh, dv2), rel:",
              [f"{rel_diff(a, b):.2e}" for a, b in zip(got[:2], (dh, dv2))], flush=True)
        two = chunk_bwd_state_t(q, k, Ai, beta_rows, do, dv_local, scale, dht, h0,
                                chain_t=True, chains=2)
        print("bwd state gluon, T for W, two chains a program: the one-chain bits:",
              all(torch.equal(a, b) for a, b in zip(two, got) if a is not None), flush=True)
        got = chunk_state(k, Ai, v, G, h0, False, CHUNK, N, chunk_offsets=offsets,
                          num_chunks=idx["num_chunks"], dot_precision=prec, beta=beta)
        print("chunk_state, T and v, vs W and U (h, v_new), rel:",
              [f"{rel_diff(a, b):.2e}" for a, b in zip(got[:2], (h, v_new))], flush=True)
        # their outputs against the Triton kernels', printed with the times (wu_bwd completes
        # its dk in place, from a copy; the Gluon one sums it over value heads, as group_sum)
        got = chunk_bwd_dqkwg_gluon(q, k, v_new, h, dh, G, do, dv2, scale)
        print("dqkwg gluon vs triton, rel:", [f"{rel_diff(a, b):.2e}" for a, b in
                                             zip(got, (dq, dk, dw, dg_part))], flush=True)
        dk_t = dk.clone()
        ref = wu_bwd(k, v, g, beta, Ai, dw, dv2, dk_t, dg_part, CHUNK, dot_precision=prec,
                     **idx)
        got = wu_bwd_gluon(k, v, G, beta, Ai, dw, dv2, dk, dg_part, g.dtype)
        print("wu_bwd gluon vs triton + group_sum (dk, dv, dbeta, dg), rel:",
              [f"{rel_diff(a, b):.2e}" for a, b in
               zip(got, (group_sum(dk_t, H, k.dtype),) + ref)], flush=True)
    stages = [(name, {}) for name in kernels] + list(variants)
    row = {}
    for name, kw in stages:
        label = name + "".join(f" {a}={b}" for a, b in kw.items())
        try:
            row[label] = 1e3 * triton.testing.do_bench(lambda: kernels[name](**kw),
                                                       return_mode="median")
        except Exception as e:  # a launch variant that does not compile costs only its row
            print(f"{label} failed: {e!r}", flush=True)
    print(f"backward stages at B={B}, T={T}, µs:", {k: round(v, 1) for k, v in row.items()},
          flush=True)
    return row


def sweep_launch(shapes):
    """LAUNCH_VARIANTS of the state passes and the chunk-parallel kernels at each shape."""
    return [bench_bwd_stages(B, T, LAUNCH_VARIANTS) for B, T in shapes]


def sweep_forward_t(shapes):
    """forward_t (the fused backend's kernel after the inverse) at each shape: by default (V'
    formed on the chain, gluon_transposed.CHAIN_OUTPUT_GROUPS output warpgroups), in its
    W/U-warpgroup form with and without P formed there (P_ON_WU), with two staging tiles for
    O (O_BUFFERS = 2), with one and with two chains a program (gluon_transposed.TWO_CHAINS,
    forced either way) and by default again (the first timing of a shape ran 5–10 % slow in
    session 13's run), split as the route splits, each against the default's o; then,
    unsplit, its roles added one at a time (the chain alone with W and U from HBM, + the W/U
    warpgroup, + one output warpgroup, the chain with one or two output warpgroups and W, U
    from HBM, the chain forming V' alone and with one or two output warpgroups, two such
    chains with one output warpgroup): what each role adds to a chunk step, one chain a
    program but in the last row. do_bench medians in µs."""
    import triton
    forward_t = _gluon_kernel("gluon_transposed", "forward_t",
                              "GDN_BENCH_SKIP_GLUON_T_EXPERIMENTAL")
    if forward_t is None:
        return
    from gdn_fused.kernels import gluon_transposed as gt
    from gdn_fused.kernels.chunk_gate import chunk_cumsum, gate_rows_from
    from gdn_fused.kernels.kkt_solve import kkt_solve_from_k
    from gdn_fused.kernels.wu import recompute_w_u
    for B, T in shapes:
        q, k, v, g, beta, h0 = make_inputs(B, T)
        G, rows = chunk_cumsum(g, CHUNK, gate_rows=[beta])
        rows_c = gate_rows_from(G, [beta], chain_rows=True)   # V' on the chain
        Ai = kkt_solve_from_k(k, G, beta, HV, CHUNK, torch.bfloat16)
        w, u = recompute_w_u(k, v, G, beta, Ai, dot_precision="tf32")
        rows_g = gt._gate_rows([G], B, T, HV)
        stages = gt.NUM_STAGES
        # forward_t's main launch, unsplit (one chain a program or two: the rows' flags below)
        forward_t_launch = lambda: gt._launch(  # noqa: E731
            q, k, Ai, v, rows_c, 0.1, h0, True, True, stages, 1, True, t_on_chain=True,
            output_groups=1)
        roles = {  # _launch(..., output, num_stages, segments, wu, output_groups=...)
            "chain, W and U from HBM": lambda: gt._launch(
                q, k, w, u, rows_g, 0.1, h0, True, False, stages, 1, False),
            "chain + W/U warpgroup": lambda: gt._launch(
                q, k, Ai, v, rows, 0.1, h0, True, False, stages, 1, True),
            "chain + W/U + one output warpgroup (forward_t's W/U form)": lambda: gt._launch(
                q, k, Ai, v, rows, 0.1, h0, True, True, stages, 1, True),
            "chain + one output warpgroup, W and U from HBM": lambda: gt._launch(
                q, k, w, u, rows_g, 0.1, h0, True, True, stages, 1, False, output_groups=1),
            "chain + two output warpgroups, W and U from HBM": lambda: gt._launch(
                q, k, w, u, rows_g, 0.1, h0, True, True, stages, 1, False, output_groups=2),
            "chain forming V' from T and v": lambda: gt._launch(
                q, k, Ai, v, rows_c, 0.1, h0, True, False, stages, 1, True, t_on_chain=True),
            "chain forming V' + one output warpgroup (forward_t, one chain)": forward_t_launch,
            "two chains forming V' + one output warpgroup (forward_t, two chains)":
                forward_t_launch,
            "chain forming V' + two output warpgroups (forward_t to session 22)": lambda:
                gt._launch(q, k, Ai, v, rows_c, 0.1, h0, True, True, stages, 1, True,
                           t_on_chain=True, output_groups=2),
        }
        for name, fn in roles.items():
            # one chain a program but in the row that asks for two (two_chains_pay forced)
            with mock.patch.multiple(gt, **(dict(TWO_CHAIN_STEP_RATIO=0) if "two chains" in name
                                            else dict(TWO_CHAINS=False))):
                fn()
                us = 1e3 * triton.testing.do_bench(fn, return_mode="median")
            print(f"forward_t roles B={B} T={T} {name}: {us:.1f} us, "
                  f"{us / triton.cdiv(T, CHUNK):.2f} us a chunk", flush=True)
        o_ref = None
        variants = {"default": {}, "W/U warpgroup": dict(t_on_chain=False),
                    "W/U warpgroup, P on it": dict(t_on_chain=False,
                                                   variant=dict(P_ON_WU=True)),
                    "two staging tiles for O": dict(variant=dict(O_BUFFERS=2)),
                    "unsplit": dict(segments=1), "two segments": dict(segments=2),
                    "two segments by maps": dict(segments=2)}
        variants["W/U warpgroup, unsplit"] = dict(t_on_chain=False, segments=1)
        variants["one chain a program"] = variants["two chains a program"] = {}
        variants["default, again"] = {}
        # module flags a row sets: the maps row takes segment 1's entering state by [M | b]
        # and the composition, as before session 18; the chain rows force two_chains_pay's
        # choice either way
        flags = {"two segments by maps": dict(SEGMENT0_FROM_H0=False),
                 "one chain a program": dict(TWO_CHAINS=False),
                 "two chains a program": dict(TWO_CHAIN_STEP_RATIO=0)}
        for name, kw in variants.items():
            patched = flags.get(name)
            with mock.patch.multiple(gt, **patched) if patched else contextlib.nullcontext():
                o, _ = forward_t(q, k, v, G, beta, Ai, 0.1, h0, True, **kw)
                o_ref = o if o_ref is None else o_ref
                fn = lambda: forward_t(q, k, v, G, beta, Ai, 0.1, h0, True, **kw)  # noqa: E731
                us = 1e3 * triton.testing.do_bench(fn, return_mode="median")
                graph = 1e3 * triton.testing.do_bench_cudagraph(fn, return_mode="median")
            print(f"forward_t B={B} T={T} {name}: {us:.1f} us (graph {graph:.1f}), rel diff "
                  f"of o {rel_diff(o, o_ref):.2e}", flush=True)
        torch.cuda.empty_cache()


def _gluon_kernel(module, name, skip_env):
    """Function ``name`` of gdn_fused.kernels.<module> on a Hopper GPU, else None: the Gluon
    kernels are sm_90a only, and setting ``skip_env`` leaves one out (scripts/gpu_check.sh sets
    it after the kernel's GPU test failed or hung)."""
    if torch.cuda.get_device_capability()[0] != 9 or os.environ.get(skip_env):
        return None
    try:
        return getattr(importlib.import_module(f"gdn_fused.kernels.{module}"), name)
    except Exception as e:
        print(f"{module} not importable ({e!r})", flush=True)
        return None


# Launch configurations of the fused kernel timed by sweep_fused: (value columns, warps,
# software-pipeline stages). Only launches verified on the H200: (32, 4, ·) miscompiles there
# (kernels/fused_fwd.py, BLOCK_V) and an illegal address poisons the process for every later
# variant, so an unverified launch belongs in a separate process first (tmp scripts, not here).
FUSED_LAUNCHES = [(64, 8, 1)]


def sweep_fused(shapes):
    """The fused kernel's open choices at each shape: value columns and warps per program
    (FUSED_LAUNCHES) and, at B = 1, segments per sequence (0 = the cost model's pick; 1, 2, 4,
    8 at the first shape, 1 and 4 at the others), with the
    inverse read from its chunk-parallel launch (the default); at the first shape also the
    inverse made on the chunk loop. Each variant is checked against materialized first
    (relative difference of o and of the final state), and the inverse launch is timed alone."""
    import triton
    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.kernels import kkt_solve as kkt_solve_module
    from gdn_fused.kernels.fused_fwd import fused_fwd, precomputed_inverse
    default_route = kkt_solve_module.A_THROUGH_HBM

    for i, (B, T) in enumerate(shapes):
        q, k, v, g, beta, h0 = make_inputs(B, T)
        o_m, ht_m = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, backend="materialized")
        for through_hbm in (True, False):  # chunk_inverse's two routes (kernels/kkt_solve.py)
            kkt_solve_module.A_THROUGH_HBM = through_hbm
            inv_ms = triton.testing.do_bench(lambda: precomputed_inverse(k, g, beta, HV, CHUNK),
                                             return_mode="median")
            print(dict(variant="fused inverse launch", A_through_hbm=through_hbm, B=B, T=T,
                       ms=inv_ms), flush=True)
        kkt_solve_module.A_THROUGH_HBM = default_route
        segments = ((0, 1, 2, 4, 8) if i == 0 else (0, 1, 4)) if B == 1 else (0,)
        variants = [dict(block_v=bv, num_warps=w, num_stages=st, num_segments=ns)
                    for bv, w, st in FUSED_LAUNCHES for ns in segments]
        if i == 0:
            variants.append(dict(precompute_inverse=False))
        for kw in variants:
            fn = lambda: fused_fwd(q, k, v, g, beta, DIM ** -0.5, h0, True, None,  # noqa: E731
                                   CHUNK, **kw)
            try:
                o, ht = fn()
                diff = dict(diff_o=rel_diff(o, o_m), diff_state=rel_diff(ht, ht_m))
                ms = triton.testing.do_bench(fn, return_mode="median")
            except Exception as e:
                print(f"fused {kw} at B={B}, T={T} failed: {e!r}", flush=True)
                continue
            print(dict(variant="fused", B=B, T=T, **kw, ms=ms, **diff), flush=True)
        torch.cuda.empty_cache()


def sweep_kkt_solve(bandwidth, B=8, T=4096):
    """kkt_solve variants (the tl and the Gluon kernel, register caps), fp32 A in, bf16 T out."""
    import triton
    from gdn_fused.kernels.chunk_gate import chunk_cumsum
    from gdn_fused.kernels.kkt import chunk_kkt
    from gdn_fused.kernels.kkt_solve import kkt_solve
    q, k, v, g, beta, _ = make_inputs(B, T)
    A = chunk_kkt(k, chunk_cumsum(g, CHUNK), beta, HV, CHUNK)
    floor_us = A.numel() * 6 / bandwidth * 1e6
    ref = kkt_solve(A, torch.float32, kernel="triton")
    rows = []
    # Measured 2026-11-29 and settled (kernels/kkt_solve.py): substitution beats doubling, 1
    # warp beats 2-8, 3×TF32 beats exact fp32 products, prefetching the coupling blocks does
    # not pay, the register cap 168; mxr 387 µs. The Gluon kernel (kernels/gluon_kkt_solve.py)
    # beside it, with register caps under the 108 ptxas picks for sm_90a (no spills); its
    # program order is settled (heads fastest 131.8 µs, chunks fastest 149.4).
    variants = [dict(kernel="triton"), dict(kernel="gluon")]
    variants += [dict(kernel="gluon", maxnreg=r) for r in (112, 80)]
    for kw in variants:
        err = (kkt_solve(A, torch.float32, **kw) - ref).abs().max().item()
        us = 1e3 * triton.testing.do_bench(lambda: kkt_solve(A, torch.bfloat16, **kw),
                                           return_mode="median")
        rows.append(dict(kw, us=us, frac_bw=floor_us / us, diff=err))
        print(rows[-1], flush=True)
    # from the keys (what chunk_inverse runs): one value head a program, two (SHARED_KEYS),
    # with each head's G and β rows staged in shared memory once a chunk (STAGED_GATES) or
    # loaded by every block's gating, and under a register cap; bits against one head a
    # program. (Session 13 also tried two heads with all ten K Kᵀ blocks formed in registers
    # first and both heads' A in 20 KB of shared memory instead of 26: 211 registers, 252 µs
    # against 248 for one head a program in the same run, 227–229 for the 26 KB form in the
    # session's other runs; reverted, docs/speed_log.md)
    from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_from_k_gluon
    G = chunk_cumsum(g, CHUNK)
    one = kkt_solve_from_k_gluon(k, G, beta, HV, torch.bfloat16, shared_keys=False,
                                 staged_gates=False, swizzled=False)
    variants = [dict(shared_keys=h, staged_gates=st, swizzled=False)
                for st in (False, True) for h in (False, True)]
    # A's staged blocks swizzled (SWIZZLED_A, session 14), with one head and two a program;
    # (the first timing of a run has come out slow: the unswizzled two-head form again last)
    variants += [dict(shared_keys=h, staged_gates=True, swizzled=True) for h in (False, True)]
    variants += [dict(shared_keys=True, staged_gates=True, swizzled=True, maxnreg=184),
                 dict(shared_keys=True, staged_gates=True, swizzled=False)]
    # the two heads' work over four one-warp roles (kernels/gluon_kkt_roles.py, session 25:
    # 184 µs against 194; under a 48-register launch cap, 5 programs an SM with spills, 229)
    variants += [dict(shared_keys=True, staged_gates=True, swizzled=True, roles=False),
                 dict(shared_keys=True, staged_gates=True, swizzled=True, roles=True)]
    for kw in variants:
        same = torch.equal(kkt_solve_from_k_gluon(k, G, beta, HV, torch.bfloat16, **kw), one)
        us = 1e3 * triton.testing.do_bench(
            lambda: kkt_solve_from_k_gluon(k, G, beta, HV, torch.bfloat16, **kw),
            return_mode="median")
        rows.append(dict(kw, kernel="gluon from k", us=us, same_bits=same))
        print(rows[-1], flush=True)
    return rows


TABLE_COLUMNS = ("B", "T", "floor ms", "fla ms", "materialized ms", "mat/fla", "mat floor frac",
                 "mat, tl state+output ms", "fused ms", "fused/fla", "fused floor frac",
                 "fused, tl kernel ms", "gluon ms", "gluon/fla", "mat fwd+bwd ms",
                 "fused fwd+bwd ms", "fused fwd+bwd / fla fwd", "fla graph ms",
                 "mat graph ms", "fused graph ms", "fused/fla graph",
                 "mat fwd+bwd graph ms", "fused fwd+bwd graph ms")


def write_outputs(out, rows, kkt_row, bandwidth):
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda s: (s not in ("B", "T"), s))
    with open(out / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; bf16 tensor cores {TENSOR_CORE_FLOPS / 1e12:.0f} TFLOP/s",
             "", "| " + " | ".join(TABLE_COLUMNS) + " |", "|---" * len(TABLE_COLUMNS) + "|"]
    fmt = lambda x: "" if x is None else f"{x:.3f}"  # noqa: E731
    for r in rows:
        fla, mat, fus = r.get("fla_ms"), r.get("materialized_ms"), r.get("fused_ms")
        fla_g, fus_g = r.get("fla_graph_ms"), r.get("fused_graph_ms")
        lines.append("| " + " | ".join([str(r["B"]), str(r["T"]), fmt(r["floor_ms"]), fmt(fla),
                     fmt(mat), fmt(mat / fla if fla and mat else None),
                     fmt(r["floor_ms"] / mat if mat else None), fmt(r.get("materialized_tl_ms")),
                     fmt(fus),
                     fmt(fus / fla if fla and fus else None),
                     fmt(r["floor_ms"] / fus if fus else None), fmt(r.get("fused_tl_ms")),
                     fmt(r.get("gluon_ms")),
                     fmt(r["gluon_ms"] / fla if fla and r.get("gluon_ms") else None),
                     fmt(r.get("materialized_fwdbwd_ms")), fmt(r.get("fused_fwdbwd_ms")),
                     # issue 5's measure: fla's backward refuses on Triton 3.6 / Hopper
                     fmt(r["fused_fwdbwd_ms"] / fla if fla and r.get("fused_fwdbwd_ms")
                         else None),
                     # CUDA-graph replays: device time alone, where the host binds a call
                     fmt(fla_g), fmt(r.get("materialized_graph_ms")), fmt(fus_g),
                     fmt(fus_g / fla_g if fla_g and fus_g else None),
                     fmt(r.get("materialized_fwdbwd_graph_ms")),
                     fmt(r.get("fused_fwdbwd_graph_ms"))]) + " |")
    if kkt_row:
        lines += ["", "kkt_solve: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in kkt_row.items())]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"B={r['B']}\nT={r['T']}" for r in rows]
    xs = range(len(rows))
    for i, (key, name) in enumerate([("fla_ms", "fla 0.6.0"), ("materialized_ms", "materialized"),
                                     ("fused_ms", "fused"), ("gluon_ms", "gluon (experimental)"),
                                     ("floor_ms", "roofline floor")]):
        ax.bar([x + 0.16 * i for x in xs], [r.get(key, 0) or 0 for r in rows], width=0.16,
               label=name)
    ax.set_xticks([x + 0.32 for x in xs], labels)
    ax.set_ylabel("forward time, ms (median)")
    ax.set_title("Gated DeltaNet forward, H=16, HV=32, K=V=128, bf16, H200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=120)


def _shapes(text: str) -> list[tuple[int, int]]:
    """--shapes: 'anchors' or B:T,B:T,... with positive integers."""
    if text == "anchors":
        return ANCHOR_SHAPES
    try:
        shapes = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected 'anchors' or B:T,B:T,... with positive "
                                         f"integers, got {text!r}")
    return shapes


SWEEPS = {
    "fused": lambda shapes, bandwidth: sweep_fused(shapes),
    "kkt": lambda shapes, bandwidth: sweep_kkt_solve(bandwidth),
    "bwd": lambda shapes, bandwidth: [bench_bwd_stages(B, T) for B, T in shapes],
    "launch": lambda shapes, bandwidth: sweep_launch(shapes),
    "stages": lambda shapes, bandwidth: bench_stages(),
    "forward_t": lambda shapes, bandwidth: sweep_forward_t(shapes),
}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/bench", type=Path,
                   help="folder for bench.md, bench.csv, bench.png (default out/bench)")
    p.add_argument("--shapes", default="anchors", type=_shapes,
                   help="'anchors' (default: " + ", ".join(f"{b}:{t}" for b, t in ANCHOR_SHAPES)
                        + ") or B:T,B:T,...")
    p.add_argument("--no-backward", action="store_true", help="skip forward+backward timing")
    p.add_argument("--backward-graph", action="store_true",
                   help="also time forward+backward as a CUDA-graph replay (the kernels alone)")
    p.add_argument("--no-kkt", action="store_true", help="skip the kkt_solve benchmark")
    p.add_argument("--no-stages", action="store_true",
                   help="skip the per-kernel times of the materialized forward at B=1, "
                        "T=32768 (also --sweep stages)")
    p.add_argument("--kkt-sweep", action="store_true",
                   help="only sweep kkt_solve launch variants, then exit")
    p.add_argument("--sweep", nargs="?", const=",".join(SWEEPS), default=None,
                   metavar="PARTS",
                   help="only sweep launch variants, then exit; PARTS (comma-separated, "
                        f"default all, run in this order): {', '.join(SWEEPS)} — fused: the "
                        "fused kernel's launch, segments and inverse placement at --shapes; "
                        "kkt: kkt_solve register caps; bwd: each backward kernel's time at "
                        "--shapes; stages: each forward kernel's time at B=1, T=32768; "
                        "forward_t: the fused route's kernel, "
                        "its launch variants and its roles added one at a time at --shapes")
    args = p.parse_args(argv)
    parts = [x for x in args.sweep.split(",") if x] if args.sweep is not None else []
    unknown = set(parts) - set(SWEEPS)
    if unknown:
        p.error(f"--sweep: unknown parts {sorted(unknown)}; choose from {list(SWEEPS)}")
    if not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA device")
    shapes = args.shapes
    bandwidth = copy_bandwidth()
    if args.kkt_sweep:
        sweep_kkt_solve(bandwidth)
        return
    if args.sweep is not None:
        for name in SWEEPS:  # fixed order: the most wanted numbers first
            if name in parts:
                SWEEPS[name](shapes, bandwidth)
        return
    fla_chunk, solve_tril = load_fla()
    kkt_row = None if args.no_kkt else bench_kkt_solve(bandwidth, solve_tril)
    if not args.no_stages:
        bench_stages()
    rows = bench_forward(shapes, bandwidth, fla_chunk, not args.no_backward,
                         args.backward_graph)
    write_outputs(args.out, rows, kkt_row, bandwidth)


if __name__ == "__main__":
    main()
