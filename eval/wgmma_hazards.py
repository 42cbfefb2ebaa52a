"""Asynchronous wgmma operands overwritten before the wgmma is waited for, found in a
kernel's TTGIR without running it.

    python -m eval.wgmma_hazards [--stages 1 2 3]   # wu_bwd compiled for sm_90a, any machine
    python -m eval.wgmma_hazards --launched         # every kernel of a forward + backward (GPU)

Triton's software pipeliner (num_stages ≥ 2) may keep a ``tl.dot`` inside a loop as an
asynchronous warpgroup MMA (``ttng.warp_group_dot {isAsync = true}``) and prefetch later
iterations' tiles into the loop's shared-memory slots (``ttg.async_copy_global_to_local``,
cp.async). A slot that an in-flight wgmma reads must not be refilled until a
``ttng.warp_group_dot_wait`` has retired that wgmma. Triton 3.6 broke that rule in wu_bwd's
first key loop: the K Kᵀ wgmma read slot s of the K tiles while the same iteration's prefetch
(zero-filling, past the last key block) wrote slot s. On the H200 (session 8) K Kᵀ came out 2 %
(4 warps) to 11 % (8 warps) off and different on every run, and with it dβ and dg
(kernels/wu_bwd.py, STAGES; docs/backward.md, "Determinism").

:func:`refilled_operands` finds that pattern in one loop body: an async wgmma with an operand
taken from a multi-buffered allocation (``ttg.memdesc_index``), then an async copy into the same
allocation, with no wait in between. It is a necessary sign, not proof: the copy may target
another slot. tests/test_wgmma_hazards.py asserts it flags wu_bwd at 3 stages and nothing at
wu_bwd.STAGES, and (GPU) nothing in any kernel a forward and backward launch.
"""
from __future__ import annotations

import argparse
import re

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
    """{slot view: the multi-buffered allocation it indexes} of ``ttg.memdesc_index`` lines;
    value names are reused across sibling regions, so a later definition wins."""
    return dict(re.findall(rf"({_VALUE}) = ttg\.memdesc_index ({_VALUE})\[", "\n".join(lines)))


def refilled_operands(ttgir: str) -> list[tuple[str, str]]:
    """(wgmma line, copy line) for each async wgmma of a loop body whose multi-buffered
    shared-memory operand is written by an async copy later in the body before any
    warp_group_dot_wait."""
    found = []
    for before, body in _loop_bodies(ttgir):
        # a one-slot buffer's view may be taken once before the loop
        buffer_of = {**_slot_views(before), **_slot_views(body)}
        in_flight = []  # (allocation, wgmma line) not yet waited for
        for line in body:
            rhs = line.split("=", 1)[-1].split(" : ")[0]
            if "ttng.warp_group_dot_wait" in line:
                in_flight = []
            elif "ttng.warp_group_dot " in line and "isAsync = true" in line:
                in_flight += [(buffer_of[v], line.strip()) for v in re.findall(_VALUE, rhs)
                              if v in buffer_of]
            elif "ttg.async_copy_global_to_local" in line:
                written = {buffer_of[v] for v in re.findall(_VALUE, rhs) if v in buffer_of}
                found += [(dot, line.strip()) for buf, dot in in_flight if buf in written]
    return found


def wu_bwd_ttgir(num_stages: int, num_warps: int = 4) -> str:
    """wu_bwd's kernel compiled for sm_90a at the Qwen3-Next layer shape (bf16, H = 16,
    HV = 32, K = V = 128, chunk 64); its TTGIR. Needs compiled-mode kernels (no
    TRITON_INTERPRET=1)."""
    from gdn_fused.eval.ptxas import compile_for
    from gdn_fused.kernels.chunk_bwd_dqkwg import key_block
    from gdn_fused.kernels.wu_bwd import wu_bwd_kernel
    sig = {"k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*fp32", "Ai": "*fp32",
           "dw": "*bf16", "dv2": "*bf16", "dk": "*fp32", "dg_part": "*fp32", "dv": "*bf16",
           "dbeta": "*fp32", "dg": "*fp32", "cu_seqlens": "*i32", "chunk_indices": "*i32",
           "T": "i32", "s_dgp": "i32"}
    consts = dict(NK=128 // key_block(128), H=16, HV=32, K=128, V=128, BT=64,
                  BK=key_block(128), BV=64, IS_VARLEN=False, DOT_PREC="tf32")
    return compile_for(wu_bwd_kernel, sig, consts, 90, num_warps=num_warps,
                       num_stages=num_stages).asm["ttgir"]


def launched_hazards() -> dict[str, int]:
    """Run a bf16 forward and backward of both Triton backends on the GPU, at a shape under
    one wave of programs and one past it (where the state passes take 2 pipeline stages,
    chunk_state.state_stages), then scan every kernel compiled so far:
    {kernel name#variant: hazards found}."""
    import gc

    import torch
    from triton.runtime.jit import JITFunction

    from gdn_fused import chunk_gated_delta_rule
    from tests.cases import make_inputs
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
    for fn in gc.get_objects():
        if not issubclass(type(fn), JITFunction):  # (isinstance warns on deprecated objects)
            continue
        for caches in fn.device_caches.values():
            for i, kernel in enumerate(caches[0].values()):
                counts[f"{fn.fn.__name__}#{i}"] = len(refilled_operands(kernel.asm["ttgir"]))
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eval.wgmma_hazards", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="*", default=[1, 2, 3],
                   help="wu_bwd's num_stages to compile (sm_90a, no GPU needed)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--launched", action="store_true",
                   help="instead scan every kernel a GPU forward + backward compiles")
    args = p.parse_args(argv)
    if args.launched:
        for name, n in launched_hazards().items():
            print(f"{name}: {n} hazards", flush=True)
        return
    for stages in args.stages:
        hazards = refilled_operands(wu_bwd_ttgir(stages, args.warps))
        print(f"wu_bwd num_stages={stages} num_warps={args.warps}: {len(hazards)} hazards",
              flush=True)
        for dot, copy in hazards:
            print(f"  wgmma: {dot[:150]}\n  copy:  {copy[:150]}")


if __name__ == "__main__":
    main()
