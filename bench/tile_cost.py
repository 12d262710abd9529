"""What the one-token (decode) tiles can compute at best: the static cost of their inner loops on a CPU model.

    python bench/tile_cost.py [--mcpu znver3] [--ghz 3.1] [--cc cc] [--mca llvm-mca-14]

Decode streams every weight once a token, so a tile that computes no faster than memory delivers cannot keep
the memory busy while it works. This compiles the native core's K-quant tiles to assembly (the flags setup.py
builds them with), takes each 2-group decode tile's hottest loop (the backward jump around the most maddubs)
and asks llvm-mca for its cycles an iteration on the given CPU model, with the vector pipes' load. Bytes an
iteration are the weights that loop consumes, the unit's scales included (a unit's bytes over the loop's
iterations a unit, two groups). The per-unit work outside the loop (scale unpacking, Q4_K/Q5_K's mins pass)
is not counted: the rate printed is an upper bound, which the tile's measured rate with its data in L2
(bench/tile_stream.c) can be set against. Needs llvm-mca (LLVM's machine code analyzer); a static model
knows nothing of caches, prefetching or the frequency the core runs at.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "barellm" / "_native"

# tile function -> (type, bytes a unit of one group's 8 rows, iterations of the hot loop a unit)
TILES = {
    "q50_g2": ("Q5_0", 176, 1),
    "q4k_g2": ("Q4_K", 1152, 4),
    "q5k_g2": ("Q5_K", 1408, 4),
    "q6k_g2": ("Q6_K", 1680, 4),
    "q3k_g2": ("Q3_K", 880, 8),
}


def kernels_asm(cc: str = "cc") -> list[str]:
    """The K-quant kernels compiled to assembly, a line each."""
    return subprocess.run([cc, "-O3", "-std=gnu11", "-S", f"-I{SRC}", str(SRC / "avx2" / "quant_kq.c"), "-o", "-"],
                          capture_output=True, text=True, check=True).stdout.splitlines()


def hot_loop(asm: list[str], fn: str) -> list[str]:
    """The instructions of fn's backward-jump loop with the most vpmaddubsw."""
    start = asm.index(fn + ":")
    end = next(i for i in range(start, len(asm)) if asm[i].startswith(f"\t.size\t{fn},"))
    body = asm[start:end]
    labels = {line[:-1]: i for i, line in enumerate(body) if re.fullmatch(r"\.L\d+:", line)}
    best: tuple[int, list[str]] = (-1, [])
    for i, line in enumerate(body):
        m = re.fullmatch(r"\s+j\w+\s+(\.L\d+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loop = body[labels[m.group(1)]:i + 1]
            n = sum("vpmaddubsw" in x for x in loop)
            if n > best[0]:
                best = (n, loop)
    return [x for x in best[1] if not x.startswith(".") and not x.lstrip().startswith(".")]


def mca(tool: str, mcpu: str, loop: list[str]) -> tuple[float, list[float]]:
    """(cycles an iteration, load of the 4 vector pipes an iteration) from llvm-mca"""
    out = subprocess.run([tool, f"-mcpu={mcpu}", "-iterations=200"], input="\n".join(loop) + "\n",
                         capture_output=True, text=True, check=True).stdout
    cycles = float(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / 200
    pipes: list[float] = []
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Resource pressure per iteration:"):
            names, values = lines[i + 1].split(), lines[i + 2].split()
            # Zen 3's model names its FP/vector pipes [8]..[11] (Zn3FPP0-3); other models print theirs
            pipes = [float(v) if v != "-" else 0.0 for n, v in zip(names, values, strict=False)
                     if n in ("[8]", "[9]", "[10]", "[11]")]
            break
    return cycles, pipes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mcpu", default="znver3")
    ap.add_argument("--ghz", type=float, default=3.1, help="core clock to turn cycles into GB/s")
    ap.add_argument("--cc", default="cc")
    ap.add_argument("--mca", default=shutil.which("llvm-mca") or "llvm-mca-14")
    args = ap.parse_args()
    if not shutil.which(args.mca):
        sys.exit(f"tile_cost: {args.mca} not found (install LLVM's llvm-mca)")
    asm = kernels_asm(args.cc)
    print(f"| tile | type | instructions an iteration | maddubs | cycles an iteration ({args.mcpu}) "
          "| vector pipes busy | bytes an iteration | bytes a cycle | GB/s at most, " f"{args.ghz} GHz |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for fn, (qtype, unit, per_unit) in TILES.items():
        loop = hot_loop(asm, fn)
        cycles, pipes = mca(args.mca, args.mcpu, loop)
        nbytes = 2 * unit / per_unit
        busy = f"{sum(pipes) / (4 * cycles):.0%}" if pipes else "?"
        madd = sum("vpmaddubsw" in x for x in loop)
        print(f"| {fn} | {qtype} | {len(loop)} | {madd} | {cycles:.1f} | {busy} | {nbytes:.0f} | "
              f"{nbytes / cycles:.1f} | {nbytes / cycles * args.ghz:.0f} |")


if __name__ == "__main__":
    main()
