"""What the compiler made of a kernel, without a GPU: registers, spills, shared memory and the
Hopper instructions in its PTX, for sm_90a (the H200).

    python -m eval.ptxas [--kernels NAME ...] [--arch 90] [--loops] [--set KEY=VALUE ...]

Triton compiles for a named target on any machine and ships ptxas, so a CPU can see what the
GPU machine would run: a kernel's register footprint (registers per thread × threads) bounds how
many programs an SM holds, spills go to local memory, and the PTX shows whether the kernel uses
warpgroup MMA (``wgmma.mma_async``), TMA (``cp.async.bulk.tensor``), mbarriers and per-role
register budgets (``setmaxnreg``, warp specialization); :func:`register_operand_hazards`
checks the SASS for registers of a wgmma operand rewritten while it runs (the table's last
column). Times still need the GPU
(``python -m eval.bench``); this says which launch variants are worth timing.

:func:`compile_report` takes a ``triton.jit`` or ``gluon.jit`` function, its argument types and
its constexprs; ``KERNELS`` holds the package's kernels at the Qwen3-Next layer shape (bf16,
H = 16, HV = 32, K = V = 128, chunk 64). ``--loops`` disassembles the sm_90a cubin (Triton's
nvdisasm) and counts the SASS instructions of each innermost loop: for a warp-specialized kernel
that is each role's work a chunk step (the chain's loop holds its 12 HGMMA, the W/U one 8, the
output's 20), the quantity the session-12 diagnostics say lengthens the chain's step;
``--set`` overrides constexprs (launch variants, e.g. ``--set P_ON_WU=True``).
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

# PTX of the Hopper features the fused-kernel issue asks evidence of, by instruction prefix
HOPPER_FEATURES = {
    "wgmma": r"\bwgmma\.mma_async",
    "tma": r"\bcp\.async\.bulk\.tensor",
    "mbarrier": r"\bmbarrier\.",
    "setmaxnreg": r"\bsetmaxnreg",
    "mma.sync": r"\bmma\.sync",
}


def ptx_features(ptx: str) -> dict[str, int]:
    """How many instructions of each HOPPER_FEATURES kind the PTX text holds."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in HOPPER_FEATURES.items()}


def tensordesc(dtype: str, block_shape, layout) -> str:
    """The signature type of a Gluon ``TensorDescriptor`` argument in Triton 3.6, e.g.
    ``tensordesc<bf16[64, 128],NVMMASharedLayout(...)>`` (what triton.language.str_to_ty
    parses; the layout is its Python repr)."""
    return f"tensordesc<{dtype}[{', '.join(map(str, block_shape))}],{layout!r}>"


def _constexpr_defaults(fn, signature: dict) -> dict:
    """The default values of ``fn``'s arguments that ``signature`` does not type."""
    params = inspect.signature(fn.fn).parameters.values()
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty and p.name not in signature}


def missing_arguments(fn, signature: dict, constexprs: dict) -> list[str]:
    """Arguments of ``fn`` with neither a type, a constexpr value nor a default."""
    known = set(signature) | set(constexprs) | set(_constexpr_defaults(fn, signature))
    return [n for n in fn.arg_names if n not in known]


def compile_for(fn, signature: dict, constexprs: dict, arch: int = 90, **options):
    """Compile ``fn`` for ``cuda:<arch>`` (sm_90 → sm_90a) on this machine, no GPU needed;
    returns triton's CompiledKernel (``.asm["ttgir"]``, ``["ptx"]``, ``.metadata``).

    signature: the type of each runtime argument by name ("*bf16", "i32", "fp32", ...,
    :func:`tensordesc` for a Gluon TMA descriptor);
    constexprs: the value of each constexpr argument by name (those with a default in the
    kernel may be left out); options: launch options (num_warps, num_stages, maxnreg).
    Raises triton's CompilationError for code that does not compile, ValueError for an
    argument named in neither dict, TypeError for a kernel defined under TRITON_INTERPRET=1
    (an interpreted function cannot be compiled)."""
    import triton
    if not hasattr(fn, "cache_key"):
        raise TypeError(f"{getattr(fn, 'arg_names', fn)!r}: not a compiled-mode kernel; import "
                        "it without TRITON_INTERPRET=1 in the environment")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(fn.arg_names)
    missing = missing_arguments(fn, signature, constexprs)
    if missing:
        raise ValueError(f"no type or constexpr value for argument(s) {missing}")
    constexprs = {**_constexpr_defaults(fn, signature), **constexprs}
    sig = {n: signature[n] if n in signature else "constexpr" for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    source = ASTSource
    if type(fn).__name__ == "GluonJITFunction":
        from triton.experimental.gluon._runtime import GluonASTSource as source
    # pointers 16-byte aligned, as a launch specialises them for torch's allocations: without
    # the hint loads and stores are not vectorised and the report would not match the GPU's
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*")}
    return triton.compile(source(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def compile_report(fn, signature: dict, constexprs: dict, arch: int = 90, **options) -> dict:
    """:func:`compile_for`, then ``ptxas -v`` on its PTX: registers and spill/stack bytes per
    thread, static shared memory bytes, and :func:`ptx_features` (same arguments and errors)."""
    return report_of(compile_for(fn, signature, constexprs, arch, **options), arch, **options)


def report_of(compiled, arch: int = 90, **options) -> dict:
    """:func:`compile_report` of a kernel compile_for already compiled (same options)."""
    import triton
    ptx = compiled.asm["ptx"]
    gpu_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name", gpu_name, path,
               "-o", os.path.join(tmp, "kernel.o")]
        if options.get("maxnreg"):
            cmd.append(f"--maxrregcount={options['maxnreg']}")
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"ptxas failed for {gpu_name}: {run.stderr.strip()}")
        log = run.stderr

    def number(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"),
                stack=number(r"(\d+) bytes stack frame"),
                shared=compiled.metadata.shared, num_warps=options.get("num_warps", 4),
                features=ptx_features(ptx), wgmma_serialized=wgmma_serialized(log))


def wgmma_serialized(log: str) -> str:
    """ptxas's reason for serializing the kernel's wgmma instructions (its C75xx info line,
    e.g. "insufficient register resources for the function"), or "" where it pipelines them.
    It applies to the whole function: one warp-specialized role short of registers for its
    products in flight serializes every role's (session 26: the two-chain forward's output
    warpgroup at 120 registers)."""
    m = re.search(r"wgmma\.mma_async instructions are serialized due to ([^\n']+)", log)
    return m.group(1).strip() if m else ""


def sass(compiled) -> str:
    """The SASS of a compiled kernel (its cubin through Triton's nvdisasm), code only."""
    import triton
    nvdisasm = os.path.join(os.path.dirname(triton.knobs.nvidia.ptxas.path), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        run = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {run.stderr.strip()}")
    return run.stdout


# an instruction's first register operand, which SASS writes (stores, barriers, HGMMA and the
# TMA and synchronization ops name no register destination first)
_WRITES = re.compile(r"^(?:@!?U?P\w+\s+)?(?!HGMMA|ST|BAR|WARPGROUP|SYNCS|UTMA|RED|ATOM)"
                     r"[A-Z][\w.]*\s+R(\d+)\b")


def register_operand_hazards(text: str) -> list[tuple[str, str]]:
    """(wgmma, instruction) pairs of a SASS listing in which an instruction writes a register
    of an HGMMA's A operand (taken from registers: four of them, R_n … R_n+3) after the HGMMA
    and before the next ``WARPGROUP.DEPBAR``, i.e. while the wgmma may still read it. The
    program must keep such registers until the wait (Gluon: name the operand in
    ``warpgroup_mma_wait``'s deps), yet ptxas made one itself (session 20): a register of an
    operand that is the same constant in every thread was set after the first wgmma that
    reads it, so a CTA's first item read a stale value. A heuristic on straight-line order:
    it does not follow branches."""
    ins = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", text)]
    found = []
    for i, x in enumerate(ins):
        m = re.search(r"HGMMA\.\S+ R\d+, R(\d+),", x)
        if not m:
            continue
        regs = set(range(int(m.group(1)), int(m.group(1)) + 4))
        for y in ins[i + 1:]:
            if y.startswith("WARPGROUP.DEPBAR"):
                break
            w = _WRITES.match(y)
            if w and int(w.group(1)) in regs:
                found.append((x, y))
    return found


def _unpredicated(instruction: str) -> str:
    """A SASS instruction's text without its guard predicate (``@P0``, ``@!UPT``, …)."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", instruction)


def sass_loops(text: str) -> list[dict]:
    """The innermost loops of a SASS listing (a backward branch's span that holds no other
    loop's), in order: {"start", "end" (instruction indices), "instructions", "ops" (count by
    opcode, predicates and modifiers dropped)}."""
    ins, labels = [], {}
    for line in text.split("\n"):
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
    spans = []
    for i, text_i in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text_i)
        if m and labels.get(m.group(1), len(ins)) <= i:
            spans.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in spans
             if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
    loops = []
    for a, b in sorted(set(inner)):
        ops = {}
        for x in ins[a:b + 1]:
            op = _unpredicated(x).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        loops.append(dict(start=a, end=b, instructions=b - a + 1, ops=ops,
                          shared=shared_bytes(ins[a:b + 1])))
    return loops


# bytes a thread of LDS / STS moves, by width modifier (none: 32 bits)
_LDS_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def shared_bytes(instructions, warps: int = 4) -> dict:
    """Shared-memory bytes a pass through ``instructions`` (SASS texts, one loop iteration of
    a role of ``warps`` warps) moves, by kind: "lds" / "sts" (per-thread loads and stores,
    × 32·warps threads), "ldsm" / "stsm" (ldmatrix / stmatrix: 128 B a warp per 8×8 16-bit
    matrix), "wgmma" (HGMMA operands read from shared memory: B always, A where it is a
    descriptor; once a warpgroup). TMA's transfers are not in a consumer's instructions (their
    boxes are the descriptors'); both sides of a branch inside the loop are counted."""
    out = dict(lds=0, sts=0, ldsm=0, stsm=0, wgmma=0)
    for x in instructions:
        x = _unpredicated(x)
        parts = x.split()
        op = parts[0].split(".")
        if op[0] in ("LDS", "STS"):
            width = next((_LDS_WIDTH[m] for m in op[1:] if m in _LDS_WIDTH), 4)
            out[op[0].lower()] += width * 32 * warps
        elif op[0] in ("LDSM", "STSM"):
            count = int(op[-1]) if op[-1].isdigit() else 1
            out[op[0].lower()] += 128 * count * warps
        elif op[0] == "HGMMA":
            m = re.match(r"(\d+)x(\d+)x(\d+)", op[1])
            M, N, K = map(int, m.groups())
            size = 1 if op[-1] in ("E4M3", "E5M2", "S8", "U8") else \
                (4 if op[-1] == "TF32" else 2)
            operands = " ".join(parts[1:]).split(",")
            out["wgmma"] += K * N * size + (M * K * size if "gdesc" in operands[1] else 0)
    out["total"] = sum(out.values())
    return out


def _kkt_solve(build: bool, method: str = "blocked", iters: int = 0):
    from gdn_fused.kernels.kkt_solve import DOT_PRECISION, kkt_solve_kernel
    sig = {"A": "*fp32", "k": "*bf16", "G": "*fp64", "beta": "*bf16", "Ai": "*bf16",
           "cu_seqlens": "*i32", "chunk_indices": "*i32", "T": "i32"}
    consts = dict(H=16 if build else 1, HV=32, K=128 if build else 16, BT=64,
                  BK=128 if build else 16, IS_VARLEN=False, BUILD=build, METHOD=method,
                  NS_ITERS=iters, DOT_PREC=DOT_PRECISION, DIAG="substitution")
    return kkt_solve_kernel, sig, consts


def _gluon_kkt_solve():
    from gdn_fused.kernels.gluon_kkt_solve import kkt_solve_gluon_kernel
    sig = {"A": "*fp32", "Ai": "*bf16", "cu_seqlens": "*i32", "chunk_indices": "*i32",
           "T": "i32", "NBH": "i32"}
    return kkt_solve_gluon_kernel, sig, dict(HV=32, IS_VARLEN=False)


def _gluon_kkt_solve_from_k():
    from gdn_fused.kernels.gluon_kkt_solve import _key_layouts, kkt_solve_from_k_gluon_kernel
    sig = {"k": "*bf16", "G": "*fp64", "beta": "*fp32", "Ai": "*bf16", "cu_seqlens": "*i32",
           "chunk_indices": "*i32", "T": "i32", "NBH": "i32"}
    KA, keys, keys_smem = _key_layouts(128)
    return kkt_solve_from_k_gluon_kernel, sig, dict(H=16, HV=32, K=128, KA=KA, KEYS=keys,
                                                    KEYS_SMEM=keys_smem, IS_VARLEN=False,
                                                    HEADS=2)


def _gluon_kkt_roles():
    from gdn_fused.kernels.gluon_kkt_roles import kkt_solve_from_k_roles_kernel
    fn, sig, consts = _gluon_kkt_solve_from_k()
    consts = {n: v for n, v in consts.items() if n not in ("KEYS", "HEADS")}
    return kkt_solve_from_k_roles_kernel, sig, consts


def _fused_fwd(num_segments: int = 1, load_t: bool = True):
    from gdn_fused.kernels.fused_fwd import SUB, _fused_fwd_kernel, dot_precisions, launch_config
    import torch
    BV, _ = launch_config(128)
    precision, compose = dot_precisions(torch.bfloat16)
    sig = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*bf16",
           "Ai": "*fp32", "o": "*bf16",
           "h0": "*fp32", "ht": "*fp32", "seg_maps": "*fp32", "cu_seqlens": "*i32",
           "scale": "fp32", "T": "i32", "N": "i32"}
    sig.update({s: "i32" for s in ("s_qb", "s_qt", "s_qh", "s_vb", "s_vt", "s_vh", "s_gb",
                                   "s_gt", "s_gh")})
    consts = dict(H=16, HV=32, K=128, V=128, BV=BV, C=64, SUB=SUB, NUM_SEG=num_segments,
                  USE_H0=True, STORE_HT=True, VARLEN=False, LOAD_T=load_t,
                  STATE_PRECISION=precision,
                  COMPOSE_PRECISION=compose)
    return _fused_fwd_kernel, sig, consts


def _gluon_ring_kernel(module: str, kernel: str, pointers: dict):
    """A state kernel on the Gluon ring (kernels/gluon_ring.py): its TMA descriptors from the
    module's DESCRIPTOR_BLOCKS, ``pointers`` for the other runtime arguments."""
    import importlib
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    mod = importlib.import_module(f"gdn_fused.kernels.{module}")
    sig = {f"{n}_desc": tensordesc("bf16", b, descriptor_layout(b))
           for n, b in mod.DESCRIPTOR_BLOCKS.items()}
    sig.update(pointers, G="*fp64", h0="*fp32", ht="*fp32", T="i32")
    consts = dict(H=16, HV=32, K=128, V=128, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True,
                  STAGES=mod.NUM_STAGES)
    return getattr(mod, kernel), sig, consts


def _gluon_state():
    return _gluon_ring_kernel("gluon_state", "chunk_state_gluon_kernel", dict(v_new="*bf16"))


def _gluon_state_output():
    return _gluon_ring_kernel("gluon_state_output", "chunk_state_output_gluon_kernel",
                              dict(o="*bf16", scale="fp32"))


def _gluon_transposed(output: bool = True, map_pass: bool = False):
    from gdn_fused.kernels.gluon_transposed import DESCRIPTOR_BLOCKS, GATE_LAYOUT
    fn, sig, consts = _gluon_ring_kernel("gluon_transposed", "chunk_state_output_t_kernel",
                                         dict(o="*bf16", scale="fp32"))
    sig["g_desc"] = tensordesc("fp64", DESCRIPTOR_BLOCKS["g"], GATE_LAYOUT)
    del sig["G"]  # the gates come by TMA (g_desc)
    consts = {**consts, "OUTPUT": output, "MAP": map_pass, "NS": 2 if map_pass else 1}
    if map_pass:
        consts["USE_INITIAL_STATE"] = False
    return fn, sig, consts


def _gluon_transposed_two_outputs():
    """The state + output kernel with two output warpgroups on alternate chunks."""
    fn, sig, consts = _gluon_transposed()
    return fn, sig, {**consts, "OUT_GROUPS": 2}


def _gluon_transposed_store_h():
    """The state pass storing h and v_new (chunk_state's contract; the backward's recompute),
    two store warpgroups on alternate chunks as chunk_state_t launches it."""
    fn, sig, consts = _gluon_transposed(False)
    return fn, {**sig, "h": "*bf16"}, {**consts, "STORE_H": True, "OUT_GROUPS": 2}


def _gluon_transposed_wu(output: bool = True, map_pass: bool = False):
    """The transposed kernel with W and U formed on chip: T's [C, C] tiles in w_desc's place,
    v's in u_desc's, the gate tiles [2, C] (G and β)."""
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    from gdn_fused.kernels.gluon_transposed import WU_GATE_BLOCK, WU_GATE_LAYOUT
    fn, sig, consts = _gluon_transposed(output, map_pass)
    sig["w_desc"] = tensordesc("bf16", [64, 64], descriptor_layout([64, 64]))
    sig["g_desc"] = tensordesc("fp64", WU_GATE_BLOCK, WU_GATE_LAYOUT)
    return fn, sig, {**consts, "WU": True}


def _gluon_transposed_wu_checkpoints():
    """forward_t as a training forward at small B·HV launches it: the chain also stores the
    states entering every SEGMENT_CHUNKS-th chunk (the backward's recompute checkpoints)."""
    from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS
    fn, sig, consts = _gluon_transposed_wu()
    return fn, {**sig, "checkpoints": "*fp32"}, {**consts, "CKPT_EVERY": SEGMENT_CHUNKS}


def _gluon_transposed_chain_t(output: bool = True, map_pass: bool = False):
    """forward_t with V' formed on the chain from T and v (CHAIN_T): the ring as with WU, no
    W/U warpgroup; CHAIN_OUTPUT_GROUPS output warpgroups on alternate chunks when it has the
    output (compile with :func:`_chain_t_maxnreg`)."""
    from gdn_fused.kernels.gluon_transposed import (CHAIN_GATE_BLOCK, CHAIN_GATE_LAYOUT,
                                                    CHAIN_OUTPUT_GROUPS, STATE_UPDATE_LO,
                                                    STATE_UPDATE_LO_ABOVE)
    fn, sig, consts = _gluon_transposed_wu(output, map_pass)
    sig["g_desc"] = tensordesc("fp64", CHAIN_GATE_BLOCK, CHAIN_GATE_LAYOUT)
    return fn, sig, {**consts, "WU": False, "CHAIN_T": True,
                     "OUT_GROUPS": CHAIN_OUTPUT_GROUPS if output else 1,
                     "UPDATE_LO": STATE_UPDATE_LO, "LO_ABOVE": STATE_UPDATE_LO_ABOVE}


def _chain_t_maxnreg(chains: int = 1):
    """forward_t's register cap at launch with ``chains`` chains a program, as
    gluon_transposed._launch sets it."""
    from gdn_fused.kernels.gluon_transposed import CHAIN_OUTPUT_GROUPS, launch_maxnreg
    return launch_maxnreg(False, CHAIN_OUTPUT_GROUPS, chains)


def _gluon_transposed_chain_t_update(lo: bool, lo_above: float = -1.0):
    """forward_t (V' on the chain) with the state update's D V' as one bf16 product (lo
    False) or its high and low halves in every chunk (gluon_transposed.STATE_UPDATE_LO,
    lo_above < 0), for comparison with the shipped form (the low half where γ > 1/2)."""
    fn, sig, consts = _gluon_transposed_chain_t()
    return fn, sig, {**consts, "UPDATE_LO": lo, "LO_ABOVE": lo_above}


def _gluon_transposed_two_chains(checkpoints: bool = False):
    """forward_t's main launch with both value blocks of a head in one program (two chain
    warpgroups, gluon_transposed.TWO_CHAINS), as a launch where two_chains_pay takes it
    ((8, 4096), (32, 2048))."""
    fn, sig, consts = (_gluon_transposed_chain_t_checkpoints() if checkpoints else
                       _gluon_transposed_chain_t())
    return fn, sig, {**consts, "CHAINS": 2}


def _gluon_transposed_seg0_end():
    """The first launch of a two-segment split (V' on the chain): the state pass alone over
    segment 0 from h0, its end state stored for segment 1 (SEG0_END)."""
    fn, sig, consts = _gluon_transposed_chain_t(False)
    return fn, sig, {**consts, "NS": 2, "SEG0_END": True}


def _gluon_transposed_chain_t_checkpoints():
    """forward_t (V' on the chain) as a training forward at small B·HV launches it: the chain
    also stores the states entering every SEGMENT_CHUNKS-th chunk."""
    from gdn_fused.kernels.chunk_state import SEGMENT_CHUNKS
    fn, sig, consts = _gluon_transposed_chain_t()
    return fn, {**sig, "checkpoints": "*fp32"}, {**consts, "CKPT_EVERY": SEGMENT_CHUNKS}


def _gluon_dqkwg():
    """The backward's dq/dk/dw/dg kernel in Gluon (kernels/gluon_dqkwg.py)."""
    from gdn_fused.kernels.gluon_dqkwg import (DESCRIPTOR_BLOCKS, HEADS_IN_TURN, STAGES,
                                               chunk_bwd_dqkwg_gluon_kernel)
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    names = {"v_new": "vn", "dv2": "dv"}
    sig = {f"{names.get(n, n)}_desc": tensordesc("bf16", b, descriptor_layout(b))
           for n, b in DESCRIPTOR_BLOCKS.items()}
    sig.update(G="*fp64", dg="*fp32", s_dg="i32", scale="fp32", num_units="i32", NBH="i32",
               T="i32", stage0="i32")
    return chunk_bwd_dqkwg_gluon_kernel, sig, dict(H=16, HV=32, K=128, V=128, STAGES=STAGES,
                                                   UH=16 if HEADS_IN_TURN else 32)


def _gluon_wu_bwd():
    """The backward's W/U kernel in Gluon (kernels/gluon_wu_bwd.py)."""
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    from gdn_fused.kernels.gluon_wu_bwd import STAGES, TILE, wu_bwd_gluon_kernel
    sig = {f"{n}_desc": tensordesc("bf16", TILE, descriptor_layout(TILE))
           for n in ("k", "v", "dw", "du", "dk", "t", "dv", "dko")}
    sig.update(G="*fp64", beta="*fp32", dg_part="*fp32", s_dgp="i32", dbeta="*fp32",
               dg="*fp32", num_groups="i32", NBH="i32", T="i32", stage0="i32")
    return wu_bwd_gluon_kernel, sig, dict(H=16, HV=32, K=128, V=128, NKP=2, STAGES=STAGES)


def _gluon_bwd_state(chain_t=False, chains=1):
    """The backward's reverse state pass in Gluon (kernels/gluon_bwd_state.py), reading W or,
    with ``chain_t``, T and the chain rows; ``chains`` value blocks of a head a program."""
    from gdn_fused.kernels.gluon_bwd_state import (CHAIN_T_BLOCKS, DESCRIPTOR_BLOCKS, STAGES,
                                                   chunk_bwd_state_t_kernel)
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    from gdn_fused.kernels.gluon_transposed import CHAIN_GATE_LAYOUT, GATE_LAYOUT
    gate_layout = CHAIN_GATE_LAYOUT if chain_t else GATE_LAYOUT
    sig = {f"{n}_desc": (tensordesc("fp64", b, gate_layout) if n == "g" else
                         tensordesc("bf16", b, descriptor_layout(b)))
           for n, b in (CHAIN_T_BLOCKS if chain_t else DESCRIPTOR_BLOCKS).items()}
    sig.update(dht="*fp32", dh0="*fp32", scale="fp32", T="i32")
    return chunk_bwd_state_t_kernel, sig, dict(H=16, HV=32, K=128, V=128,
                                               USE_FINAL_STATE_GRAD=True,
                                               STORE_INITIAL_STATE_GRAD=True, STAGES=STAGES,
                                               CHAIN_T=chain_t, CHAINS=chains)


def _gluon_wu():
    from gdn_fused.kernels.gluon_ring import descriptor_layout
    from gdn_fused.kernels.gluon_wu import DESCRIPTOR_BLOCKS, wu_gluon_kernel
    sig = {f"{n}_desc": tensordesc("bf16", b, descriptor_layout(b))
           for n, b in DESCRIPTOR_BLOCKS.items()}
    sig.update(G="*fp64", beta="*fp32", w="*bf16", u="*bf16", T="i32")
    return wu_gluon_kernel, sig, dict(H=16, HV=32, K=128, V=128)


# Gluon kernels written for sm_90a alone (setmaxnreg, wgmma, TMA): compiling them for another
# architecture aborts inside LLVM, which no Python handler can catch. "(experimental)": not
# routed by any backend (the transposed state + output kernel is the materialized forward's on
# Hopper, its W/U-on-chip form the fused backend's)
HOPPER_ONLY = ("chunk_state gluon (experimental)", "chunk_state+output gluon (experimental)",
               "w, u gluon (experimental)", "state+output transposed gluon",
               "state transposed gluon, no output (experimental)",
               "segment maps transposed gluon",
               "forward transposed gluon, W/U on chip",
               "forward transposed gluon, W/U on chip, checkpoints",
               "chunk_bwd_dqkwg gluon",
               "wu_bwd gluon",
               "chunk_bwd_state transposed gluon", "chunk_bwd_state transposed gluon, T for W",
               "segment maps transposed gluon, W/U on chip",
               "state pass storing h transposed gluon (experimental)",
               "state+output transposed gluon, two output groups")
ARCHS = (80, 86, 89, 90)


# name → (builder of (fn, signature, constexprs), launch options as the package launches it)
def _kernels() -> dict:
    from gdn_fused.kernels.fused_fwd import launch_config
    from gdn_fused.kernels.gluon_dqkwg import MAXNREG as DQKWG_MAXNREG
    from gdn_fused.kernels.gluon_state import MAXNREG
    from gdn_fused.kernels.gluon_wu_bwd import MAXNREG as WU_BWD_MAXNREG
    from gdn_fused.kernels.gluon_bwd_state import MAXNREG as BWD_STATE_MAXNREG
    from gdn_fused.kernels.gluon_bwd_state import MAXNREG_TWO_CHAINS as BWD_STATE_MAXNREG_CHAINS
    from gdn_fused.kernels.gluon_state_output import MAXNREG as FUSED_MAXNREG
    from gdn_fused.kernels.gluon_transposed import MAXNREG as T_MAXNREG
    from gdn_fused.kernels.gluon_transposed import MAXNREG_WU as T_MAXNREG_WU
    from gdn_fused.kernels.gluon_transposed import MAXNREG_TWO_OUTPUTS as T_MAXNREG_2
    from gdn_fused.kernels.gluon_wu import NUM_WARPS as WU_WARPS
    from gdn_fused.kernels.kkt_solve import MAXNREG_FROM_A, NUM_WARPS
    from gdn_fused.kernels.gluon_kkt_roles import LAUNCH_MAXNREG as ROLES_MAXNREG
    return {
        "kkt_solve blocked (A in)": (lambda: _kkt_solve(False), dict(num_warps=NUM_WARPS["blocked"],
                                                                     maxnreg=MAXNREG_FROM_A)),
        "kkt_solve blocked (from k)": (lambda: _kkt_solve(True), dict(num_warps=NUM_WARPS["blocked"])),
        "kkt_solve gluon (A in)": (_gluon_kkt_solve, dict(num_warps=1)),
        "kkt_solve gluon (from k)": (_gluon_kkt_solve_from_k, dict(num_warps=1)),
        "kkt_solve gluon (from k, four roles)": (_gluon_kkt_roles,
                                                 dict(num_warps=4, maxnreg=ROLES_MAXNREG)),
        "kkt_solve newton_schulz:12 (from k)": (lambda: _kkt_solve(True, "newton_schulz", 12),
                                                dict(num_warps=NUM_WARPS["newton_schulz"])),
        "fused forward (T read)": (lambda: _fused_fwd(1), launch_config(128)[1]),
        "fused forward (T on chip)": (lambda: _fused_fwd(1, False), launch_config(128)[1]),
        "chunk_state gluon (experimental)": (_gluon_state, dict(num_warps=4, maxnreg=MAXNREG)),
        "chunk_state+output gluon (experimental)": (_gluon_state_output,
                                                    dict(num_warps=4, maxnreg=FUSED_MAXNREG)),
        "w, u gluon (experimental)": (_gluon_wu, dict(num_warps=WU_WARPS)),
        "state+output transposed gluon": (
            _gluon_transposed, dict(num_warps=4, maxnreg=T_MAXNREG)),
        "state+output transposed gluon, two output groups": (
            _gluon_transposed_two_outputs, dict(num_warps=4, maxnreg=T_MAXNREG_2)),
        "state transposed gluon, no output (experimental)": (
            lambda: _gluon_transposed(False), dict(num_warps=4, maxnreg=T_MAXNREG)),
        "segment maps transposed gluon": (
            lambda: _gluon_transposed(False, True), dict(num_warps=4, maxnreg=T_MAXNREG)),
        "forward transposed gluon, W/U on chip": (
            _gluon_transposed_wu, dict(num_warps=4, maxnreg=T_MAXNREG_WU)),
        "forward transposed gluon, W/U on chip, checkpoints": (
            _gluon_transposed_wu_checkpoints, dict(num_warps=4, maxnreg=T_MAXNREG_WU)),
        "forward transposed gluon, V' on the chain": (
            _gluon_transposed_chain_t, dict(num_warps=4, maxnreg=_chain_t_maxnreg())),
        "forward transposed gluon, V' on the chain, update hi only": (
            lambda: _gluon_transposed_chain_t_update(False), dict(num_warps=4,
                                                                  maxnreg=_chain_t_maxnreg())),
        "forward transposed gluon, V' on the chain, update hi/lo every chunk": (
            lambda: _gluon_transposed_chain_t_update(True), dict(num_warps=4,
                                                                 maxnreg=_chain_t_maxnreg())),
        "forward transposed gluon, V' on the chain, checkpoints": (
            _gluon_transposed_chain_t_checkpoints, dict(num_warps=4,
                                                        maxnreg=_chain_t_maxnreg())),
        "forward transposed gluon, V' on the chain, two chains": (
            _gluon_transposed_two_chains, dict(num_warps=4, maxnreg=_chain_t_maxnreg(2))),
        "forward transposed gluon, V' on the chain, two chains, checkpoints": (
            lambda: _gluon_transposed_two_chains(True), dict(num_warps=4,
                                                             maxnreg=_chain_t_maxnreg(2))),
        "segment 0's end state transposed gluon, V' on the chain": (
            lambda: _gluon_transposed_seg0_end(), dict(num_warps=4, maxnreg=T_MAXNREG)),
        "segment maps transposed gluon, V' on the chain": (
            lambda: _gluon_transposed_chain_t(False, True), dict(num_warps=4, maxnreg=T_MAXNREG)),
        "chunk_bwd_dqkwg gluon": (_gluon_dqkwg, dict(num_warps=4, maxnreg=DQKWG_MAXNREG)),
        "wu_bwd gluon": (_gluon_wu_bwd, dict(num_warps=4, maxnreg=WU_BWD_MAXNREG)),
        "chunk_bwd_state transposed gluon": (_gluon_bwd_state,
                                             dict(num_warps=4, maxnreg=BWD_STATE_MAXNREG)),
        "chunk_bwd_state transposed gluon, T for W": (
            lambda: _gluon_bwd_state(True), dict(num_warps=4, maxnreg=BWD_STATE_MAXNREG)),
        "chunk_bwd_state transposed gluon, T for W, two chains": (
            lambda: _gluon_bwd_state(True, 2), dict(num_warps=4,
                                                    maxnreg=BWD_STATE_MAXNREG_CHAINS)),
        "segment maps transposed gluon, W/U on chip": (
            lambda: _gluon_transposed_wu(False, True), dict(num_warps=4, maxnreg=T_MAXNREG_WU)),
        "state pass storing h transposed gluon (experimental)": (
            _gluon_transposed_store_h, dict(num_warps=4, maxnreg=T_MAXNREG_2)),
    }


def main(argv=None) -> int:
    # kernels defined (imported) from here on are compiled-mode ones; the caller's setting is
    # put back on return, so a test session that runs main() keeps its interpreter
    interpret = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return _main(argv)
    finally:
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def _main(argv) -> int:
    kernels = _kernels()
    p = argparse.ArgumentParser(prog="python -m eval.ptxas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", choices=list(kernels), default=list(kernels),
                   metavar="NAME", help=f"kernels to compile (default all: {list(kernels)})")
    p.add_argument("--arch", type=int, default=90, choices=ARCHS,
                   help="CUDA compute capability (default 90, the H200; the Gluon kernels are "
                        "compiled for 90 only)")
    p.add_argument("--loops", action="store_true",
                   help="also count each innermost loop's SASS instructions (sm_90a)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="constexpr overrides (Python literals), e.g. P_ON_WU=True; each applies "
                        "to the selected kernels that have that constexpr")
    args = p.parse_args(argv)
    import ast
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            p.error(f"--set: {item!r} is not KEY=<Python literal>")
    names = list(dict.fromkeys(args.kernels))  # each once, in the order given
    builds = {name: kernels[name][0]() for name in names}
    constexprs = {name: {q.name for q in fn.params if q.is_constexpr}
                  for name, (fn, _, _) in builds.items()}
    for key in overrides:
        if not any(key in c for c in constexprs.values()):
            which = ", ".join(names) if len(names) <= 3 else f"all {len(names)} of them"
            p.error(f"--set: {key!r} is not a constexpr of any selected kernel ({which}); "
                    "runtime arguments cannot be set")
    head = ["kernel", "warps", "registers", "spill stores B", "stack B", "shared B"] + \
        list(HOPPER_FEATURES) + ["A-operand hazards", "wgmma serialized"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name in names:
        if args.arch != 90 and name in HOPPER_ONLY:
            print(f"| {name} | sm_90a only: not compiled for sm_{args.arch} |", flush=True)
            continue
        options = kernels[name][1]
        fn, sig, consts = builds[name]
        consts = {**consts, **{k: v for k, v in overrides.items() if k in constexprs[name]}}
        compiled = compile_for(fn, sig, consts, args.arch, **options)
        r = report_of(compiled, args.arch, **options)
        cells = [name, r["num_warps"], r["registers"], r["spill_stores"], r["stack"], r["shared"]]
        cells += [r["features"][f] for f in HOPPER_FEATURES]
        listing = sass(compiled) if args.arch == 90 else ""
        hazards = register_operand_hazards(listing)
        cells.append(len(hazards) if args.arch == 90 else "")
        cells.append(r["wgmma_serialized"] or "no")
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        for wgmma, write in hazards:
            print(f"|   hazard: {wgmma} … {write} |", flush=True)
        if args.loops and args.arch == 90:
            for loop in sass_loops(listing):
                if loop["instructions"] >= 20:
                    top = sorted(loop["ops"].items(), key=lambda kv: -kv[1])[:8]
                    sh = loop["shared"]
                    print(f"|   loop {loop['start']}–{loop['end']}: {loop['instructions']} "
                          f"instructions, HGMMA {loop['ops'].get('HGMMA', 0)}; most: "
                          + ", ".join(f"{k} {v}" for k, v in top)
                          + f"; shared memory {sh['total'] / 1024:.1f} KB an iteration ("
                          + ", ".join(f"{k} {v / 1024:.1f}" for k, v in sh.items()
                                      if k != "total" and v)
                          + ") |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
