"""eval.ptxas compiles for sm_90a on a machine without a GPU and reads ptxas' report."""
import pytest
import triton
import triton.language as tl

from gdn_fused.eval.ptxas import _kernels, compile_report, missing_arguments, ptx_features


def _dot(a, c, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(a + offs[:, None] * N + offs[None, :])
    tl.store(c + offs[:, None] * N + offs[None, :], tl.dot(x, x))


@pytest.fixture(scope="module")
def dot_kernel():
    """_dot as a compiled-mode kernel: triton.jit decides at decoration time, and the test
    session runs with TRITON_INTERPRET=1."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        return triton.jit(_dot)


def test_compile_report_of_a_dot_kernel_for_hopper(dot_kernel):
    r = compile_report(dot_kernel, {"a": "*bf16", "c": "*fp32"}, {"N": 64}, num_warps=4)
    assert 0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["num_warps"] == 4
    # a 64×64 bf16 product on sm_90a with 4 warps is one warpgroup MMA; nothing specialised
    assert r["features"]["wgmma"] > 0
    assert r["features"]["setmaxnreg"] == 0 and r["features"]["tma"] == 0


def test_register_cap_is_passed_to_ptxas(dot_kernel):
    capped = compile_report(dot_kernel, {"a": "*bf16", "c": "*fp32"}, {"N": 64}, num_warps=1,
                            maxnreg=64)
    assert capped["registers"] <= 64


def test_wgmma_serialization_is_reported(dot_kernel):
    """ptxas pipelines a 64×128 product's wgmmas at its own register count, and serializes
    them (its C75xx info line, which applies to the whole function) when capped below what the
    accumulators in flight need; compile_report gives the reason (session 26: the two-chain
    forward's output warpgroup short of registers serialized every role's wgmma)."""
    sig = {"a": "*bf16", "c": "*fp32"}
    assert compile_report(dot_kernel, sig, {"N": 128}, num_warps=4)["wgmma_serialized"] == ""
    capped = compile_report(dot_kernel, sig, {"N": 128}, num_warps=4, maxnreg=96)
    assert "insufficient register resources" in capped["wgmma_serialized"]


def test_missing_argument_types_are_named(dot_kernel):
    with pytest.raises(ValueError, match=r"\['c'\]"):
        compile_report(dot_kernel, {"a": "*bf16"}, {"N": 64})


def test_an_interpreted_kernel_is_refused_by_name():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        interpreted = triton.jit(_dot)
    with pytest.raises(TypeError, match="TRITON_INTERPRET"):
        compile_report(interpreted, {"a": "*bf16", "c": "*fp32"}, {"N": 64})


def test_ptx_features_count_instructions():
    ptx = "setmaxnreg.inc.sync.aligned.u32 240;\nwgmma.mma_async.sync.aligned ...\nmbarrier.try_wait"
    assert ptx_features(ptx) == {"wgmma": 1, "tma": 0, "mbarrier": 1, "setmaxnreg": 1,
                                 "mma.sync": 0}


def test_every_listed_kernel_has_a_complete_signature():
    """What `python -m eval.ptxas` compiles: every argument typed, valued or defaulted (a new
    kernel argument without a default must be added to its row), checked without compiling."""
    for name, (build, _) in _kernels().items():
        fn, signature, constexprs = build()
        assert missing_arguments(fn, signature, constexprs) == [], name


def test_cli_skips_hopper_only_kernels_elsewhere_and_compiles_once(capsys):
    import os

    from gdn_fused.eval.ptxas import HOPPER_ONLY, main
    before = os.environ.get("TRITON_INTERPRET")
    assert main(["--arch", "80", "--kernels", HOPPER_ONLY[0], HOPPER_ONLY[0]]) == 0
    out = capsys.readouterr().out
    assert out.count("sm_90a only: not compiled for sm_80") == 1
    assert os.environ.get("TRITON_INTERPRET") == before  # the session's interpreter stays on


def test_sass_loops_find_each_role_of_forward_t():
    """eval.ptxas.sass_loops on the sm_90a cubin of forward_t's W/U form (the route in sessions
    10–17): one innermost loop a role, told by
    its warpgroup MMAs (the output 20: Q Kᵀ, Q h_c, P V'; the W/U warpgroup 8; the chain 12;
    the producer none, 7 TMA loads); with P_ON_WU, Q Kᵀ's 8 move from the output's loop to
    the W/U one, and the mask's exps (MUFU) with them."""
    from gdn_fused.eval.ptxas import _gluon_transposed_wu, compile_for, sass, sass_loops
    from gdn_fused.kernels.gluon_transposed import MAXNREG_WU
    fn, sig, consts = _gluon_transposed_wu()
    by_role = {}
    for variant in ({}, {"P_ON_WU": True}):
        compiled = compile_for(fn, sig, {**consts, **variant}, 90, num_warps=4,
                               maxnreg=MAXNREG_WU)
        loops = [x for x in sass_loops(sass(compiled)) if x["instructions"] >= 20]
        hgmma = sorted(x["ops"].get("HGMMA", 0) for x in loops)
        assert hgmma == ([0, 12, 12, 16] if variant else [0, 8, 12, 20]), hgmma
        assert [x["ops"].get("UTMALDG", 0) for x in loops if not x["ops"].get("HGMMA")] == [7]
        by_role[bool(variant)] = {x["ops"].get("HGMMA", 0): x for x in loops}
    wu, wu_p = by_role[False][8], by_role[True][16]
    assert wu_p["ops"].get("MUFU", 0) > wu["ops"].get("MUFU", 0)


def test_register_operand_hazards_on_a_listing():
    """A write to a register of an in-flight HGMMA's A operand (R196 … R199) before its
    WARPGROUP.DEPBAR is found (the session-20 listing: ptxas set R197 after the wgmma that reads
    it); the same write after the wait, a read of it, or a write to another register is not."""
    from gdn_fused.eval.ptxas import register_operand_hazards

    def listing(*ins):
        return "\n".join(f"        /*{16 * i:04x}*/                   {x} ;"
                         for i, x in enumerate(ins))
    wgmma = "HGMMA.64x64x16.F32.BF16 R24, R196, gdesc[UR24], RZ, !UPT"
    found = register_operand_hazards(listing(wgmma, "MOV R197, 0x3f803f80",
                                             "WARPGROUP.DEPBAR.LE gsb0, 0x0"))
    assert found == [(wgmma, "MOV R197, 0x3f803f80")]
    assert register_operand_hazards(listing(wgmma, "WARPGROUP.DEPBAR.LE gsb0, 0x0",
                                            "MOV R197, 0x3f803f80")) == []
    assert register_operand_hazards(listing(wgmma, "FADD R200, R197, R198",
                                            "STS [R197], R199", "@P0 MOV R195, RZ",
                                            "WARPGROUP.DEPBAR.LE gsb0, 0x0")) == []
    assert len(register_operand_hazards(listing(wgmma, "@!P1 SEL R199, RZ, 0x3f80, !P0"))) == 1


@pytest.mark.parametrize("name, module", [("chunk_bwd_dqkwg gluon", "gluon_dqkwg"),
                                          ("wu_bwd gluon", "gluon_wu_bwd")])
def test_backward_gluon_kernels_fit_two_ctas_an_sm_and_keep_their_operands(name, module):
    """The backward's chunk-parallel Gluon kernels as launched (CTAS_PER_SM = 2): shared memory
    within half an SM's 228 KB less the 1 KB reserved a CTA, the launch's registers within half
    the register file, and no register of a wgmma's A operand rewritten in flight. Compiled by
    `python -m eval.ptxas` in a process of its own: in this session Triton's jitted helpers
    (gl.sum's combine) were made interpreted functions at import."""
    import importlib
    import os
    import subprocess
    import sys

    launched = importlib.import_module(f"gdn_fused.kernels.{module}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "gdn_fused.eval.ptxas", "--kernels", name],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    head, row = [[c.strip() for c in line.strip("|").split("|")]
                 for line in run.stdout.splitlines() if line.startswith("| ")][:2]
    cells = dict(zip(head, row))
    ctas, maxnreg = launched.CTAS_PER_SM, launched.MAXNREG
    assert ctas == 2
    assert int(cells["shared B"]) <= 228 * 1024 // ctas - 1024, cells
    assert int(cells["registers"]) == maxnreg and maxnreg * 256 * ctas <= 65536, cells
    assert cells["A-operand hazards"] == "0", run.stdout
    assert cells["wgmma serialized"] == "no", run.stdout


def test_set_refuses_keys_no_selected_kernel_has(capsys):
    """--set KEY=VALUE applies to the selected kernels that have that constexpr; a key none of
    them has (a typo, or a runtime argument such as T) is an argparse error (exit 2), before
    anything compiles."""
    from gdn_fused.eval.ptxas import main
    for bad in ("BOGUS=1", "=5", "T=5"):
        with pytest.raises(SystemExit) as e:
            main(["--kernels", "kkt_solve gluon (A in)", "--set", bad])
        assert e.value.code == 2
        assert "not a constexpr of any selected kernel" in capsys.readouterr().err


def test_shared_bytes_of_sass_instructions():
    """eval.ptxas.shared_bytes on hand-written SASS: per-thread loads and stores by width
    (× 128 threads of a warpgroup), ldmatrix / stmatrix by matrix count (128 B a warp each),
    wgmma's shared operands once a warpgroup (B always, A only from a descriptor), predicates
    ignored, other instructions not counted."""
    from gdn_fused.eval.ptxas import shared_bytes
    got = shared_bytes([
        "LDS.64 R4, [R2+0x100]",                                    # 8 × 128
        "@!P0 STS.128 [R3], R8",                                    # 16 × 128
        "LDS.U8 R1, [R2]",                                          # 1 × 128
        "LDSM.16.M88.4 R12, [R5]",                                  # 4 × 128 × 4 warps
        "STSM.16.MT88.2 [R6], R20",                                 # 2 × 128 × 4
        "HGMMA.64x64x16.F32.BF16 R28, R88, gdesc[UR16], RZ, !UPT",  # B: 16 × 64 × 2
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24",            # A and B from shared
        "FMUL R1, R2, R3",
    ])
    assert got == dict(lds=9 * 128, sts=16 * 128, ldsm=2048, stsm=1024, wgmma=2048 + 2048 + 4096,
                       total=9 * 128 + 16 * 128 + 2048 + 1024 + 8192)


def test_forward_t_chain_loop_shared_bytes():
    """forward_t's chain loop (V' on the chain, sm_90a): its wgmma operands a step are K for
    S Kᵀ (16 KB), T for V' (8 KB), K for the update and, in its branch, for the low half
    (16 KB each): 56 KB; h_c and V' handed over by stmatrix: 24 KB (session 28's count)."""
    from gdn_fused.eval.ptxas import compile_for, sass, sass_loops
    build, options = _kernels()["forward transposed gluon, V' on the chain"]
    loops = [x for x in sass_loops(sass(compile_for(*build(), 90, **options)))
             if x["instructions"] >= 20]
    chain = max(loops, key=lambda x: x["shared"]["stsm"])
    assert chain["shared"]["wgmma"] == 56 * 1024 and chain["shared"]["stsm"] == 24 * 1024
