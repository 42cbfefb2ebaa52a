"""Asynchronous wgmma operands overwritten before the wgmma is waited for, found in a
kernel's TTGIR without running it.

    python -m eval.wgmma_hazards [--kernels NAME ...] [--stages 1 2 3] [--block-v 64]
        # the tl kernels of KERNELS compiled for sm_90a, any machine
    python -m eval.wgmma_hazards --launched   # every kernel a GPU forward + backward compiles

Triton's software pipeliner (num_stages ≥ 2) may keep a ``tl.dot`` inside a loop as an
asynchronous warpgroup MMA (``ttng.warp_group_dot {isAsync = true}``) and prefetch later
iterations' tiles into the loop's shared-memory slots (``ttg.async_copy_global_to_local``,
cp.async). A slot that an in-flight wgmma reads must not be refilled until a
``ttng.warp_group_dot_wait`` has retired that wgmma. Triton 3.6 breaks that rule in two of our
kernels when their loops are pipelined:

- wu_bwd's first key loop: the K Kᵀ wgmma read slot s of the K tiles while the same
  iteration's prefetch (zero-filling, past the last key block) wrote slot s. On the H200
  (session 8) K Kᵀ came out 2 % (4 warps) to 11 % (8 warps) off and different on every run,
  and with it dβ and dg (kernels/wu_bwd.py, STAGES; docs/backward.md, "Determinism").
- chunk_bwd_dqkwg's loop over two value blocks: a ``wait {pendings = 4}`` leaves the step's
  four wgmmas running while the h and dh slots they read are refilled. It never showed on the
  GPU (its outputs were bit-identical run to run), but the pattern is the same
  (kernels/chunk_bwd_dqkwg.py, BLOCK_V).

:func:`refilled_operands` finds the pattern in one loop body: an async wgmma with an operand
taken from a buffered allocation (a ``ttg.memdesc_index`` view, or a transposed or sliced view
of one), then a cp.async into the same allocation while that wgmma may still run (no wait in
between, or a wait whose ``pendings`` leaves it in flight). It is a heuristic, not a proof.
It may flag a copy into another slot of the allocation. It misses refills by TMA
(``async_tma_copy_global_to_local``) or ``local_store``, a refill placed before the wgmma in the
body (a hazard carried across iterations), views passed as loop-carried values, and waits
inside nested loops that may not run. The Gluon kernels, whose rings are guarded by mbarriers
in other warp partitions, are outside what it can judge.

tests/test_wgmma_hazards.py asserts that it flags wu_bwd at 2 and 3 stages and chunk_bwd_dqkwg
with two value blocks at 3 stages, and that it finds nothing in any launch configuration of
KERNELS (CPU), nor in any kernel a GPU forward and backward compile.
"""
from __future__ import annotations

import argparse
import re

from .cli import positive_int, power_of_two

_VALUE = r"%[\w.]+"


def _loop_bodies(ttgir: str):
    """(the lines before it, the lines of its body) of each ``scf.for`` (nested loops are also
    part of their parent's body)."""
    lines = ttgir.splitlines()
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for inner in lines[i + 1:]:
            if inner.strip().startswith("}") and len(inner) - len(inner.lstrip()) == indent:
                break
            body.append(inner)
        yield lines[:i], body


def _slot_views(lines) -> dict:
    """{slot view: the buffered allocation it indexes} of ``ttg.memdesc_index`` lines, and of
    the transposed and sliced views of those (``memdesc_trans``, ``memdesc_subslice``); value
    names are reused across sibling regions, so a later definition wins."""
    views = {}
    for line in lines:
        m = re.search(rf"({_VALUE}) = ttg\.memdesc_index ({_VALUE})\[", line)
        if m:
            views[m.group(1)] = m.group(2)
            continue
        m = re.search(rf"({_VALUE}) = ttg\.memdesc_(?:trans|subslice) ({_VALUE})\b", line)
        if m and m.group(2) in views:
            views[m.group(1)] = views[m.group(2)]
    return views


def refilled_operands(ttgir: str) -> list[tuple[str, str]]:
    """(wgmma line, copy line) for each async wgmma of a loop body whose buffered
    shared-memory operand is written by an async copy (cp.async) later in the same body while
    the wgmma may still run: no ``warp_group_dot_wait`` in between, or one whose
    ``pendings = N`` leaves it among the N most recent wgmmas in flight."""
    found = []
    for before, body in _loop_bodies(ttgir):
        # a one-slot buffer's view may be taken once before the loop
        buffer_of = {**_slot_views(before), **_slot_views(body)}
        in_flight = []  # per async wgmma not yet retired, oldest first: [(allocation, line)]
        for line in body:
            rhs = line.split("=", 1)[-1].split(" : ")[0]
            if "ttng.warp_group_dot_wait" in line:
                m = re.search(r"pendings = (\d+)", line)
                keep = int(m.group(1)) if m else 0
                in_flight = in_flight[len(in_flight) - keep:] if keep else []
            elif "ttng.warp_group_dot " in line and "isAsync = true" in line:
                in_flight.append([(buffer_of[v], line.strip()) for v in re.findall(_VALUE, rhs)
                                  if v in buffer_of])
            elif "ttg.async_copy_global_to_local" in line:
                written = {buffer_of[v] for v in re.findall(_VALUE, rhs) if v in buffer_of}
                found += [(dot, line.strip()) for dot_reads in in_flight
                          for buf, dot in dot_reads if buf in written]
    return list(dict.fromkeys(found))  # once per pair (an operand and its transposed view)


# The tl (non-Gluon) kernels with wgmma products in a pipelined loop, compiled as the package
# launches them at the Qwen3-Next layer shape (bf16, H = 16, HV = 32, K = V = 128, chunk 64,
# dense): name -> (module, kernel, pointer arguments and their types, constexprs, launches).
# Each launch: num_warps, num_stages (an int, or the name of the module constant the launcher
# uses) and constexpr overrides. The state passes run BV 32 below B·HV = 66 and 64 above it,
# each at 3 stages within one wave of programs and 2 past it (chunk_state.state_blocks,
# state_stages); the W/U kernel runs 4 warps with bf16 T (the forward and, since session 9,
# the backward's recompute), 8 with fp32 T (materialized_fwd's inverse_dtype). Other
# arguments are i32 (T, strides) or fp32 (scale). Not here: _fused_fwd_kernel (one stage:
# nothing pipelined) and the Gluon kernels (see the module docstring).
_BF, _F32, _I32 = "*bf16", "*fp32", "*i32"
_DENSE = dict(H=16, HV=32, K=128, V=128, BT=64, IS_VARLEN=False, DOT_PREC="tf32")
_STATE_LAUNCHES = [dict(num_warps=4, num_stages=st, BV=bv) for bv in (32, 64) for st in (3, 2)]
KERNELS = {
    "wu_bwd": ("wu_bwd", "wu_bwd_kernel", dict(
        k=_BF, v=_BF, g=_F32, beta=_F32, Ai=_BF, dw=_BF, dv2=_BF, dk=_BF, dg_part=_F32,
        dv=_BF, dbeta=_F32, dg=_F32, cu_seqlens=_I32, chunk_indices=_I32),
        dict(_DENSE, NK=2, NKP=2, BV=64),
        [dict(num_warps=4, num_stages="STAGES", BK="BLOCK_K")]),
    "chunk_bwd_dqkwg": ("chunk_bwd_dqkwg", "chunk_bwd_dqkwg_kernel", dict(
        q=_BF, k=_BF, v_new=_BF, h=_BF, dh=_BF, g=_F32, do=_BF, dv2=_BF, dq=_BF, dk=_BF,
        dw=_BF, dg=_F32, cu_seqlens=_I32, chunk_indices=_I32, chunk_offsets=_I32),
        dict(_DENSE), [dict(num_warps=4, num_stages=3, BK="BLOCK_K", BV="BLOCK_V")]),
    "chunk_bwd_dv_local": ("chunk_bwd_dv", "chunk_bwd_dv_local_kernel", dict(
        q=_BF, k=_BF, g=_F32, do=_BF, dv=_BF, cu_seqlens=_I32, chunk_indices=_I32),
        dict(_DENSE, BK=128, BV=64), [dict(num_warps=4, num_stages=3)]),
    "chunk_bwd_state": ("chunk_bwd_state", "chunk_bwd_state_kernel", dict(
        q=_BF, k=_BF, w=_BF, g=_F32, do=_BF, dv_local=_BF, dh=_BF, dv2=_BF, dht=_F32,
        dh0=_F32, cu_seqlens=_I32, chunk_offsets=_I32, beta=_F32),
        dict(_DENSE, BK=128, USE_FINAL_STATE_GRAD=True, STORE_INITIAL_STATE_GRAD=True),
        # and with T in W's place (the backward's chain form, kernels/chunk_bwd.py CHAIN_T)
        _STATE_LAUNCHES + [dict(launch, CHAIN_T=True) for launch in _STATE_LAUNCHES]),
    "chunk_state": ("chunk_state", "chunk_state_kernel", dict(
        k=_BF, w=_BF, u=_BF, G="*fp64", h=_BF, v_new=_BF, h0=_F32, ht=_F32, cu_seqlens=_I32,
        chunk_offsets=_I32, checkpoints=_F32, beta=_F32),
        dict(_DENSE, BK=128, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True),
        # and the backward's recompute split at the forward's checkpoints (chunk_state.py),
        # in the W/U form and in the chain form (T and v: kernels/chunk_bwd.py CHAIN_T)
        _STATE_LAUNCHES + [dict(num_warps=4, num_stages=2, BV=64, SEG_CHUNKS=64, CHAIN_T=c)
                           for c in (False, True)]
        + [dict(launch, CHAIN_T=True) for launch in _STATE_LAUNCHES]),
    "chunk_output": ("chunk_output", "chunk_output_kernel", dict(
        q=_BF, k=_BF, v_new=_BF, h=_BF, G="*fp64", o=_BF, cu_seqlens=_I32,
        chunk_indices=_I32, chunk_offsets=_I32), dict(_DENSE, BK=128, BV=64),
        [dict(num_warps=4, num_stages=3)]),
    "recompute_w_u": ("wu", "wu_kernel", dict(
        k=_BF, v=_BF, G="*fp64", beta=_F32, Ai=_F32, w=_BF, u=_BF, cu_seqlens=_I32,
        chunk_indices=_I32), dict(_DENSE, BK=128, BV=64),
        [dict(num_warps=8, num_stages=3), dict(num_warps=4, num_stages=3, Ai=_BF)]),
}


def launches(name: str) -> list[dict]:
    """The launches of KERNELS[name] with the module constants they name resolved: dicts of
    num_warps, num_stages and constexpr or pointer-type overrides."""
    import importlib
    module = importlib.import_module(f"gdn_fused.kernels.{KERNELS[name][0]}")
    return [{k: getattr(module, v) if isinstance(v, str) and v.isupper() else v
             for k, v in launch.items()} for launch in KERNELS[name][4]]


def kernel_ttgir(name: str, num_stages: int, num_warps: int, **overrides) -> str:
    """The TTGIR of KERNELS[name] compiled for sm_90a with these launch options; overrides:
    constexprs, or pointer types for pointer arguments. Any machine, but the kernels must be
    compiled-mode ones (no TRITON_INTERPRET=1)."""
    import importlib

    from gdn_fused.eval.ptxas import compile_for, missing_arguments
    module, kernel, pointers, consts, _ = KERNELS[name]
    fn = getattr(importlib.import_module(f"gdn_fused.kernels.{module}"), kernel)
    sig = {**pointers, **{k: v for k, v in overrides.items() if k in pointers}}
    consts = {**consts, **{k: v for k, v in overrides.items() if k not in pointers}}
    for arg in missing_arguments(fn, sig, consts):  # the scalars: T, strides, scale
        sig[arg] = "fp32" if arg == "scale" else "i32"
    return compile_for(fn, sig, consts, 90, num_warps=num_warps,
                       num_stages=num_stages).asm["ttgir"]


def launched_hazards() -> dict[str, int]:
    """Run a bf16 forward and backward of both Triton backends on the GPU, at a shape under
    one wave of programs and one past it (where the state passes take 2 pipeline stages,
    chunk_state.state_stages), then scan the kernels those launches compiled: {module.kernel
    #variant: hazards found}. Empties every jitted function's in-process cache first, so that
    an earlier caller's compiles (say a test's deliberately miscompiled control) are neither
    scanned nor reused; they recompile from Triton's disk cache when next launched."""
    import gc

    import torch
    from triton.runtime.jit import JITFunction

    from gdn_fused import chunk_gated_delta_rule
    from gdn_fused.eval.cases import make_inputs

    def jitted():
        return [fn for fn in gc.get_objects()
                if issubclass(type(fn), JITFunction)]  # (isinstance warns on deprecated objects)
    for fn in jitted():  # forget earlier compiles (a test's deliberate miscompiled control)
        fn.device_caches.clear()
    for backend, (B, H, HV) in [(b, s) for b in ("materialized", "fused")
                                for s in ((1, 2, 4), (8, 16, 32))]:
        xs = make_inputs(B, 1024, H, HV, 128, 128, torch.bfloat16, initial_state=True,
                         device="cuda", seed=1)
        leaves = [x.requires_grad_() for x in xs]
        o, ht = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                       output_final_state=True, backend=backend)
        (o.float().square().sum() + ht.square().sum()).backward()
    torch.cuda.synchronize()
    counts = {}
    for fn in jitted():
        for caches in fn.device_caches.values():
            for i, kernel in enumerate(caches[0].values()):
                name = f"{fn.fn.__module__}.{fn.fn.__name__}#{i}"
                counts[name] = len(refilled_operands(kernel.asm["ttgir"]))
    return counts


def block_v(text: str) -> int:
    """argparse ``type=`` for --block-v: a power of two of at least 16 (a tl.dot's N)."""
    value = power_of_two(text)
    if value < 16:
        raise argparse.ArgumentTypeError(f"must be >= 16 (a dot's N), got {value}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.wgmma_hazards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS),
                   metavar="NAME", help=f"tl kernels to compile (default all: {list(KERNELS)})")
    p.add_argument("--stages", type=positive_int, nargs="*", default=None,
                   help="num_stages to compile instead, varying each kernel's first launch "
                        "(default: every launch the package makes)")
    p.add_argument("--warps", type=power_of_two, default=None,
                   help="num_warps, a power of two (default: the launch's)")
    p.add_argument("--block-v", type=block_v, default=None,
                   help="the BV constexpr, a power of two >= 16 (default: the launch's)")
    p.add_argument("--launched", action="store_true",
                   help="instead scan every kernel a GPU forward + backward compiles")
    args = p.parse_args(argv)
    import torch
    if args.launched and not torch.cuda.is_available():
        p.error("--launched needs a CUDA device (it runs a forward and backward)")
    if args.launched:
        for name, n in launched_hazards().items():
            print(f"{name}: {n} hazards", flush=True)
        return
    for name in args.kernels:
        configs = launches(name)
        if args.stages or args.warps or args.block_v:  # variations of the first launch
            base = configs[0]
            configs = [dict(base, num_stages=st, **({} if args.warps is None
                                                     else dict(num_warps=args.warps)),
                            **({} if args.block_v is None else dict(BV=args.block_v)))
                       for st in (args.stages or [base["num_stages"]])]
        for launch in configs:
            launch = dict(launch)
            stages, warps = launch.pop("num_stages"), launch.pop("num_warps")
            hazards = refilled_operands(kernel_ttgir(name, stages, warps, **launch))
            shown = "".join(f" {a}={b}" for a, b in launch.items())
            print(f"{name} num_stages={stages} num_warps={warps}{shown}: {len(hazards)} hazards",
                  flush=True)
            for dot, copy in hazards:
                print(f"  wgmma: {dot[:150]}\n  copy:  {copy[:150]}")

if __name__ == "__main__":
    main()
