#!/usr/bin/env python3
"""Where a kernel's executed instructions and stall samples go, by source line.

    scripts/profile-lines.py --cubin CUBIN --kernel NAME --sass-csv FILE[.gz] [--top N] [--nvdisasm PATH]

FILE is Nsight Compute's per-instruction SASS page of one launch (`ncu -i
REPORT --page source --print-source sass --csv`, what
scripts/gpu-suite/profile-planners.sh writes as `*-sass.log`), CUBIN the cubin
of the same build (kvtier's builds keep `kvtier.sm_XX.cubin` in cargo's
build-script output folder; kernels compile with -lineinfo). nvdisasm (from
scripts/sass.sh's pins under .tools/sass, or PATH) gives each instruction's
source lines; every instruction's opcode is compared with the profile's, so a
cubin of another build is refused rather than mapped wrongly. Each
instruction counts towards the line of the kernel's own file it was inlined
into (the outermost line in that file) and towards its innermost line.
Prints both tables, heaviest first: executed warp instructions, their share,
and the warp-stall samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANNOTATION = re.compile(r'\s*//## File "(.*?)", line (\d+)(?: inlined at "(.*?)", line (\d+))?')
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def opcode(text: str) -> str:
    """The opcode of a SASS line, its predicate guard dropped: `@!P0 BRA x` -> `BRA`."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def disassemble(nvdisasm: str, cubin: str, kernel: str) -> list[tuple[tuple[str, int] | None, tuple[str, int] | None, str]]:
    """Per instruction of `kernel`, in order: (innermost (file, line), the
    outermost line in the file of the kernel's entry, opcode)."""
    text = subprocess.run([nvdisasm, "-gi", cubin], check=True, capture_output=True, text=True).stdout
    lines = text.split("\n")
    try:
        start = lines.index(f".text.{kernel}:")
    except ValueError:
        sys.exit(f"profile-lines: {kernel} is not in {cubin}")
    # An instruction's annotations run from its innermost line out to the
    # line of the entry's own file (the one not inlined).
    out, inner, outer, home, fresh = [], None, None, None, True
    for line in lines[start + 1:]:
        if line.startswith((".text.", ".nv.", "\t.section")):  # the next section (labels start with .L)
            break
        m = ANNOTATION.match(line)
        if m:
            here = (os.path.basename(m.group(1)), int(m.group(2)))
            if fresh:
                inner, fresh = here, False
            if m.group(3) is None:
                # the kernel's entry file is the first file named
                home = home or here[0]
                if here[0] == home:
                    outer = here
            continue
        m = INSTRUCTION.match(line)
        if m:
            out.append((inner, outer, opcode(m.group(2))))
            fresh = True
    return out


def profile(path: str) -> list[tuple[str, int, int]]:
    """Per instruction of the CSV: (opcode, instructions executed, stall samples)."""
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    rows = list(csv.reader(io.StringIO(raw.read())))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    ix = {h: i for i, h in enumerate(rows[header])}
    out = []
    for r in rows[header + 1:]:
        if len(r) < len(ix) - 1:
            continue
        out.append((opcode(r[ix["Source"]]), int(r[ix["Instructions Executed"]] or 0),
                    int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)))
    return out


def source_line(root_dirs: list[str], where: tuple[str, int] | None) -> str:
    if where is None:
        return ""
    for d in root_dirs:
        p = os.path.join(d, where[0])
        if os.path.isfile(p):
            with open(p) as f:
                text = f.read().split("\n")
            return text[where[1] - 1].strip() if 0 < where[1] <= len(text) else ""
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cubin", required=True)
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--sass-csv", required=True)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--nvdisasm", help="default: .tools/sass's, else PATH's")
    ap.add_argument("--source", action="append", default=[],
                    help="a folder of the build's sources, for the lines' text (default: kernels/)")
    a = ap.parse_args()
    tool = a.nvdisasm or next((p for p in (os.path.join(ROOT, ".tools/sass/nvidia/cu13/bin/nvdisasm"),
                                           shutil.which("nvdisasm")) if p and os.path.exists(p)), None)
    if tool is None:
        sys.exit("profile-lines: no nvdisasm (scripts/sass.sh installs it under .tools/sass)")
    sass = disassemble(tool, a.cubin, a.kernel)
    prof = profile(a.sass_csv)
    if len(sass) != len(prof):
        sys.exit(f"profile-lines: the cubin's {a.kernel} has {len(sass)} instructions, the profile {len(prof)}: "
                 "not the same build")
    for k, ((_, _, op), (pop, _, _)) in enumerate(zip(sass, prof)):
        if op != pop:
            sys.exit(f"profile-lines: instruction {k} is {op} in the cubin and {pop} in the profile: not the same build")
    dirs = a.source or [os.path.join(ROOT, "kernels")]
    total = sum(e for _, e, _ in prof) or 1
    samples = sum(s for _, _, s in prof)
    print(f"{a.kernel}: {len(prof)} instructions, {total} warp instructions executed, {samples} stall samples")
    for title, key in (("by line of the kernel's file", 1), ("by innermost line", 0)):
        executed, stalls = collections.Counter(), collections.Counter()
        for where, (_, e, s) in zip(sass, prof):
            executed[where[key]] += e
            stalls[where[key]] += s
        print(f"\n{title}: executed (share), stall samples, line")
        for where, e in executed.most_common(a.top):
            name = f"{where[0]}:{where[1]}" if where else "?"
            print(f"{e:10d} {100 * e / total:5.1f}% {stalls[where]:6d}  {name:28s} {source_line(dirs, where)[:90]}")


if __name__ == "__main__":
    main()
