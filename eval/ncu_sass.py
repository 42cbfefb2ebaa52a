"""Per-role summary of an ncu SASS source page (``ncu --import R --page source --csv
--print-source sass``), as scripts/ncu.sh writes it.

    python -m eval.ncu_sass sass.csv [--roles N] [--top N] [--list]

In a warp-specialized kernel each role's loop body runs a different number of times (the
chain's instructions once per chunk per warp, an output warpgroup's once per chunk it owns,
the producer warp's once per chunk on one warp), so the instructions that share an execution
count are one role's loop. For the N loops holding the most stall samples this prints the
share of the kernel's stall samples, the stall reasons, the instruction mix and, with --top,
the instructions holding the most samples (where that role waits), in program order; with
--list, every instruction of those loops.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io


def _num(row, key):
    return float((row.get(key) or "0").replace(",", "") or 0)


def _opcode(source):
    words = source.split()
    return words[1 if source.startswith("@") else 0].split(".")[0] if words else ""


def kernels(text):
    """(name, rows) for each kernel of the page: rows as dicts of its columns."""
    for part in text.split('"Kernel Name"')[1:]:
        name, body = part.split("\n", 1)
        rows = list(csv.reader(io.StringIO(body)))
        yield name.strip(', "'), [dict(zip(rows[0], r)) for r in rows[1:]
                                  if len(r) == len(rows[0])]


def summarise(name, rows, roles=1, top=0, listing=False):
    lines = [name]
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] \
        if rows else []
    by_count = collections.defaultdict(list)
    for row in rows:
        by_count[_num(row, "Instructions Executed")].append(row)
    samples = {e: sum(_num(r, "Warp Stall Sampling (All Samples)") for r in body)
               for e, body in by_count.items()}
    total = sum(samples.values()) or 1.0
    # the loops holding the most samples (by instruction count, a role's set-up code can
    # outnumber a short loop)
    loops = sorted((e for e in by_count if e > 0), key=lambda e: -samples[e])[:roles]
    for e in loops:
        body = by_count[e]
        why = collections.Counter({r[6:]: sum(_num(d, r) for d in body) for r in reasons})
        s = sum(why.values()) or 1.0
        ops = collections.Counter(_opcode(d["Source"]) for d in body)
        lines.append(f"  loop executed {int(e)}: {len(body)} instrs, "
                     f"{100 * samples[e] / total:.1f}% of samples; "
                     + str({k: f"{100 * v / s:.0f}%" for k, v in why.most_common(6)}))
        lines.append("    ops: " + str(dict(ops.most_common(20))))
        ranked = sorted(enumerate(body),
                        key=lambda p: -_num(p[1], "Warp Stall Sampling (All Samples)"))
        shown = sorted(ranked[:top]) if not listing else list(enumerate(body))
        for i, d in shown:
            main = max(reasons, key=lambda r: _num(d, r)) if reasons else ""
            share = 100 * _num(d, "Warp Stall Sampling (All Samples)") / (samples[e] or 1.0)
            lines.append(f"    {i:>4} {share:5.1f}% {main[6:]:<12} {d['Source'][:90]}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m eval.ncu_sass",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu's source page as CSV")
    parser.add_argument("--roles", type=int, default=1,
                        help="loops (execution counts) to summarise, most samples first")
    parser.add_argument("--top", type=int, default=0,
                        help="instructions with the most stall samples to list per loop")
    parser.add_argument("--list", action="store_true",
                        help="every instruction of the loops, in order, with its samples")
    args = parser.parse_args(argv)
    try:
        with open(args.csv) as f:
            text = f.read()
    except OSError as e:
        parser.error(f"csv: cannot read {args.csv}: {e.strerror}")
    found = list(kernels(text))
    if not found:
        parser.error(f"csv: {args.csv} holds no ncu source page (no kernel with SASS rows)")
    for name, rows in found:
        print(summarise(name, rows, args.roles, args.top, args.list))


if __name__ == "__main__":
    main()
