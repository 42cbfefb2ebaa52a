"""The kernels of one call on the GPU's timeline (GPU machine).

    python -m eval.kernel_times [--shapes 1:32768,8:4096] [--backward] [--graph]

For each shape, one fused forward call (and with --backward one forward + backward of the
same inputs) is run under torch.profiler after a warm-up, and each kernel it launched is
printed with its stream, its start and end relative to the call's first kernel, and its
duration in µs: where a call's time goes, including what runs side by side on two streams
(the split forward's segment-0 state pass beside the rest of the inverse, the backward's
reverse pass beside the recompute). The inputs are eval.bench's anchor inputs. With --graph
the call is captured into a CUDA graph and one replay is profiled: the timeline without the
host's time between launches (an eager call at (1, 32768) starts its kernels up to hundreds
of µs apart, so what overlaps there is partly the host's doing).
"""
from __future__ import annotations

import argparse

import torch

from .bench import DIM, _shapes, graphed, make_inputs


def _call(B, T, backward):
    """The fused call at (B, T), forward only or forward + backward."""
    from gdn_fused import chunk_gated_delta_rule
    q, k, v, g, beta, h0 = make_inputs(B, T)
    if backward:
        for x in (q, k, v, g, beta, h0):
            x.requires_grad_(True)
        do, dht = torch.randn_like(v), torch.randn_like(h0)   # made once: not on the timeline

    def call():
        for x in (q, k, v, g, beta, h0):
            x.grad = None   # else the warm-up calls' gradients are added to (extra launches)
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=DIM ** -0.5, initial_state=h0,
                                       output_final_state=True, backend="fused")
        if backward:
            torch.autograd.backward((o, ht), (do, dht))
    return call


def timeline(fn, warmup=3):
    """[(name, stream, start µs, end µs)] of the kernels one fn() launches, start-ordered,
    times relative to the first kernel's start."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not events:
        return []
    t0 = min(e.time_range.start for e in events)
    rows = [(e.name, getattr(e, "device_resource_id", 0), e.time_range.start - t0,
             e.time_range.end - t0) for e in events]
    return sorted(rows, key=lambda r: r[2])


def print_timeline(label, rows, width=60):
    """A markdown table of :func:`timeline`'s rows under a heading with ``label``, the kernel
    count and the span from the first start to the last end; names cut to ``width``."""
    print(f"## {label}: {len(rows)} kernels, "
          f"{max((r[3] for r in rows), default=0):.1f} µs first start to last end", flush=True)
    print("| kernel | stream | start µs | end µs | µs |")
    print("|---|---:|---:|---:|---:|")
    for name, stream, start, end in rows:
        short = name if len(name) <= width else name[:width - 1] + "…"
        print(f"| {short} | {stream} | {start:.1f} | {end:.1f} | {end - start:.1f} |")
    print(flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.kernel_times",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1:32768,8:4096,1:8192,1:2048", type=_shapes,
                   help="'anchors' or B:T,B:T,... (default: %(default)s)")
    p.add_argument("--backward", action="store_true",
                   help="also forward + backward of the same call")
    p.add_argument("--graph", action="store_true",
                   help="profile a CUDA-graph replay of the call (no host time between "
                        "launches)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the kernel timeline needs a CUDA device")
    for B, T in args.shapes:
        for backward in (False, True) if args.backward else (False,):
            call = _call(B, T, backward)
            rows = timeline(graphed(call) if args.graph else call)
            print_timeline(f"fused {'forward + backward' if backward else 'forward'} "
                           f"B={B} T={T}{', graph replay' if args.graph else ''}", rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
