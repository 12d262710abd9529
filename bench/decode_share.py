"""Decode as a share of reading its own weights: the two alternated in one process, turn by turn.

    PYTHONPATH=src python bench/decode_share.py MODEL [-t 1,2] [-r 30] [--roofline PATH/roofline] [--ops]

Decode reads every weight once a token, so its ceiling is the rate at which the same threads can read the
same bytes. Each turn decodes 8 tokens (at a fixed position, as bench/decode_streams.py does) and then reads
the model file's tensor data once with the engine's own threads (`NativeEngine.read_pass`: each thread its
contiguous share, bench/roofline.c's read loop, over the same mapped pages); the order alternates. A turn's
share is its decode rate (weight bytes a token x tokens/s) over the read rate of the same turn, and the
table gives the medians. On a shared machine whose bandwidth moves by 10-20% within minutes, this compares
two things measured in the same second; bench/roofline.c's best pass (--roofline: measured before each
thread count, on its own anonymous buffer) is a ceiling taken from the quietest moment of a separate run,
and decode's median over the same spell comes out below it by however much the spell varied. Both are
printed, and roofline.c's best read as 2 or 3 streams a thread beside them (a core reads faster from a few
places at once; the same-turns read here is one stream a thread, as roofline.c's first column). With
--ops, each group of matmuls (by the matrices they read) gets its own share of the same turn's read rate
(the per-op cycle counters of bench/decode_streams.py split the turn's time). With
--pieces, each turn also reads the weights one matrix at a time in the decode's order (a pass per matrix,
threads meeting at its end as at a matmul's barrier): the best a decode made of those matmuls could do, as a
share of the one long read.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from side_by_side import run_roofline_streams  # (bench/ is this script's directory, first on the path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", default="1,2", help="thread counts")
    ap.add_argument("-r", type=int, default=30, help="turns per thread count")
    ap.add_argument("--roofline", default=None, help="bench/roofline.c built: its best pass, for comparison")
    ap.add_argument("--ops", action="store_true", help="a share per group of matmuls too")
    ap.add_argument("--pieces", action="store_true",
                    help="also read the weights as the decode does, one pass per matrix in op order")
    args = ap.parse_args()
    import barellm
    from barellm.plan import MatMul

    print("| model | threads | decode tok/s | decode GB/s | read GB/s (same turns) | share, median of turns "
          "| roofline.c best | share of it | roofline.c best of 1-3 streams a thread | share of it |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in (int(x) for x in args.t.split(",")):
        best, best_any = run_roofline_streams(args.roofline, t) if args.roofline else (None, None)
        model = barellm.load(args.model, threads=t)
        eng, src = model.engine, model.source
        if src.prefetching:
            src.prefetching.join()
        group = [("matmul " + op.name.split(".")[-1]) if isinstance(op, MatMul) else "other" for op in eng.ops]
        group_bytes: dict[str, int] = defaultdict(int)
        for op, g in zip(eng.ops, group, strict=True):
            if isinstance(op, MatMul):
                group_bytes[g] += sum(int(src.tensors[m].nbytes) for m in op.matrices)
        per_token = sum(group_bytes.values())
        group_shares: dict[str, list[float]] = defaultdict(list)
        data = src.tensor_data()
        matrices = [src.stored(m) for op in eng.ops if isinstance(op, MatMul) for m in op.matrices]
        pieces: list[float] = []
        prompt = list(range(100, 108))
        eng.forward(prompt, 0)
        for i in range(4):
            eng.forward([1000 + i], len(prompt))
        eng.read_pass(data)
        tps, reads, shares = [], [], []
        for r in range(args.r):
            for what in (("decode", "read") if r % 2 == 0 else ("read", "decode")):
                if what == "decode":
                    t0 = time.perf_counter()
                    if args.ops:
                        cycles = eng.profile_threads([1000], len(prompt), repeat=8).astype(float).mean(axis=0)
                    else:
                        for i in range(8):
                            eng.forward([1000 + i], len(prompt))
                    seconds = time.perf_counter() - t0
                    tps.append(8 / seconds)
                else:
                    reads.append(data.nbytes / eng.read_pass(data) / 1e9)
                    if args.pieces:
                        rate = sum(a.nbytes for a in matrices) / sum(eng.read_pass(a) for a in matrices) / 1e9
                        pieces.append(rate / reads[-1])
            shares.append(tps[-1] * per_token / 1e9 / reads[-1])
            if args.ops:
                spent: dict[str, float] = defaultdict(float)
                for g, c in zip(group, cycles, strict=True):
                    spent[g] += c / cycles.sum() * seconds / 8
                for g, nbytes in group_bytes.items():
                    group_shares[g].append(nbytes / spent[g] / 1e9 / reads[-1])
                group_shares["(not matmuls: ms a token)"].append(spent["other"] * 1e3)
        tok = statistics.median(tps)
        gbs = tok * per_token / 1e9
        row = [args.model, str(t), f"{tok:.1f}", f"{gbs:.1f}", f"{statistics.median(reads):.1f}",
               f"**{statistics.median(shares):.0%}**"]
        row += [f"{best:.1f}", f"{gbs / best:.0%}", f"{best_any:.1f}", f"{gbs / best_any:.0%}"] if best else [""] * 4
        print("| " + " | ".join(row) + " |", flush=True)
        if pieces:
            share = statistics.median(pieces)
            print(f"|   (read in the decode's pieces, share of one read) | | | | | {share:.0%} | | |", flush=True)
        for g, v in sorted(group_shares.items(), key=lambda kv: -group_bytes.get(kv[0], 0)):
            value = f"{statistics.median(v):.2f}" if g.startswith("(") else f"{statistics.median(v):.0%}"
            print(f"|   {g} | | | | | {value} | | |", flush=True)
        del model, eng, src, data


if __name__ == "__main__":
    main()
