"""Decode as a share of reading its own weights: the two alternated in one process, turn by turn.

    PYTHONPATH=src python bench/decode_share.py MODEL [-t 1,2] [-r 30] [--roofline PATH/roofline]

Decode reads every weight once a token, so its ceiling is the rate at which the same threads can read the
same bytes. Each turn decodes 8 tokens (at a fixed position, as bench/decode_streams.py does) and then reads
the model file's tensor data once with the engine's own threads (`NativeEngine.read_pass`: each thread its
contiguous share, bench/roofline.c's read loop, over the same mapped pages); the order alternates. A turn's
share is its decode rate (weight bytes a token x tokens/s) over the read rate of the same turn, and the
table gives the medians. On a shared machine whose bandwidth moves by 10-20% within minutes, this compares
two things measured in the same second; bench/roofline.c's best pass (--roofline: measured before each
thread count, on its own anonymous buffer) is a ceiling taken from the quietest moment of a separate run,
and decode's median over the same spell comes out below it by however much the spell varied. Both are
printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

from side_by_side import run_roofline  # (bench/ is this script's directory, first on the path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", default="1,2", help="thread counts")
    ap.add_argument("-r", type=int, default=30, help="turns per thread count")
    ap.add_argument("--roofline", default=None, help="bench/roofline.c built: its best pass, for comparison")
    args = ap.parse_args()
    import barellm
    from barellm.plan import MatMul

    print("| model | threads | decode tok/s | decode GB/s | read GB/s (same turns) | share, median of turns "
          "| roofline.c best | share of it |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for t in (int(x) for x in args.t.split(",")):
        best = run_roofline(args.roofline, t) if args.roofline else None
        model = barellm.load(args.model, threads=t)
        eng, src = model.engine, model.source
        if src.prefetching:
            src.prefetching.join()
        per_token = sum(int(src.tensors[m].nbytes) for op in eng.ops if isinstance(op, MatMul) for m in op.matrices)
        data = src.tensor_data()
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
                    for i in range(8):
                        eng.forward([1000 + i], len(prompt))
                    tps.append(8 / (time.perf_counter() - t0))
                else:
                    reads.append(data.nbytes / eng.read_pass(data) / 1e9)
            shares.append(tps[-1] * per_token / 1e9 / reads[-1])
        tok = statistics.median(tps)
        gbs = tok * per_token / 1e9
        row = [args.model, str(t), f"{tok:.1f}", f"{gbs:.1f}", f"{statistics.median(reads):.1f}",
               f"**{statistics.median(shares):.0%}**"]
        row += [f"{best:.1f}", f"{gbs / best:.0%}"] if best else ["", ""]
        print("| " + " | ".join(row) + " |", flush=True)
        del model, eng, src, data


if __name__ == "__main__":
    main()
