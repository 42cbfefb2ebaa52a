"""eval.ncu_sass: an ncu SASS source page summarised per role (loop = execution count)."""
from gdn_fused.eval import ncu_sass

HEADER = ('"Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)",'
          '"stall_wait","stall_long_sb"\n')


def _page():
    chain = [f'"{i}","HGMMA.64x64x16 R{i}","64","{1 + i}","{1 + i}","0"' for i in range(3)]
    output = [f'"{10 + i}","@!P0 BRA 0x{i}","32","9","0","9"' for i in range(2)]
    setup = [f'"{20 + i}","IMAD R{i}","1","0","0","0"' for i in range(5)]
    return '"Kernel Name", "k"\n' + HEADER + "\n".join(chain + output + setup) + "\n"


def test_roles_are_ranked_by_samples_and_hot_instructions_listed():
    (name, rows), = list(ncu_sass.kernels(_page()))
    assert name == "k" and len(rows) == 10
    text = ncu_sass.summarise(name, rows, roles=2, top=1)
    lines = text.splitlines()
    # the output loop (18 samples) before the chain's (6); the 5 set-up instructions, the
    # most numerous, hold none and are not a loop shown
    assert lines[1].startswith("  loop executed 32: 2 instrs, 75.0% of samples")
    assert "'long_sb': '100%'" in lines[1] and "{'BRA': 2}" in lines[2]
    assert lines[4].startswith("  loop executed 64: 3 instrs, 25.0% of samples")
    # the chain's hottest instruction (its third, 3 of its 6 samples), predicate skipped in
    # the op count
    assert lines[6].split()[:3] == ["2", "50.0%", "wait"]
    assert "executed 1:" not in text
    listing = ncu_sass.summarise(name, rows, roles=1, listing=True)
    assert len(listing.splitlines()) == 1 + 2 + 2
