"""Where a decoded token's time goes, and how fast each matmul streams its weights from memory.

    PYTHONPATH=src python bench/decode_streams.py MODEL [-t 1,2] [-r 48] [--roofline PATH/roofline]

For each thread count, one token is decoded `-r` times at a fixed position with the per-op cycle counters on
(`Engine.profile_threads`); ops are grouped by kind (the matmuls by which matrices they read) and each group
gets its milliseconds per token, its share of the token, the megabytes of weights it reads and the rate it
reads them at (bytes / its time, barrier waits included). With --roofline (bench/roofline.c built) the
machine's best read bandwidth is measured right before and printed beside it, so a matmul's rate can be read
as a share of the limit. Decode is bandwidth-bound: a matmul far below the limit is what to look at.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from side_by_side import run_roofline  # (bench/ is this script's directory, first on the path)


def profile(name: str, threads: int, reps: int) -> tuple[float, list[tuple[str, float, float, float]]]:
    """(tokens/s, [(group, seconds per token, share of the token, weight bytes per token)])"""
    import barellm

    model = barellm.load(name, threads=threads)
    eng, tensors = model.engine, model.source.tensors
    prompt = list(range(100, 108))
    eng.forward(prompt, 0)
    for i in range(4):   # warm the thread pool and the pages
        eng.forward([1000 + i], len(prompt))
    t0 = time.perf_counter()
    cycles = eng.profile_threads([1000], len(prompt), repeat=reps).astype(float).mean(axis=0)
    seconds = time.perf_counter() - t0
    total = float(cycles.sum())
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for op, c in zip(eng.ops, cycles, strict=True):
        kind = type(op).__name__
        if kind == "MatMul":
            key = "matmul " + op.name.split(".")[-1]
            groups[key][1] += sum(int(tensors[m].nbytes) for m in op.matrices)
        else:
            key = kind
        groups[key][0] += c
    rows = [(k, v[0] / total * seconds / reps, v[0] / total, v[1]) for k, v in groups.items()]
    rows.sort(key=lambda r: -r[1])
    del model, eng
    return reps / seconds, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", default="1,2", help="thread counts")
    ap.add_argument("-r", type=int, default=48, help="tokens decoded per thread count")
    ap.add_argument("--roofline", default=None, help="bench/roofline.c built: the limit, measured right before")
    args = ap.parse_args()
    for t in (int(x) for x in args.t.split(",")):
        bw = run_roofline(args.roofline, t) if args.roofline else None
        tps, rows = profile(args.model, t, args.r)
        weights = sum(r[3] for r in rows)
        rate = tps * weights / 1e9
        head = f"\n{args.model}, {t} thread(s): {tps:.1f} tok/s, {weights / 1e6:.0f} MB of weights a token"
        if bw:
            head += f", reading {rate:.1f} GB/s = {100 * rate / bw:.0f}% of the roofline's {bw:.1f}"
        print(head)
        print("| op | ms/token | share | weights MB | GB/s |" + (" of limit |" if bw else ""))
        print("|---|---:|---:|---:|---:|" + ("---:|" if bw else ""))
        for k, s, share, nbytes in rows:
            rate = nbytes / s / 1e9 if nbytes else 0.0
            line = f"| {k} | {s * 1e3:.3f} | {100 * share:.1f}% | {nbytes / 1e6:.1f} | {rate:.1f} |" if nbytes else \
                f"| {k} | {s * 1e3:.3f} | {100 * share:.1f}% | | |"
            if bw:
                line += f" {100 * rate / bw:.0f}% |" if nbytes else " |"
            print(line)


if __name__ == "__main__":
    main()
