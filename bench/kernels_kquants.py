"""Single-thread speed of the Q5_0, Q4_K and Q6_K matmul kernels on Gemma 3 270M's shapes.

    python bench/kernels_kquants.py [--quick] [--reps N] [--no-scalar] [--wall]

For each shape and T: GMAC/s (rows * cols * T multiply-adds per second) and GB/s (weight bytes per second)
of the AVX2 kernel on the interleaved layout (i8) and on GGUF rows, of the scalar path, and of NumPy's f32
matmul on the dequantized weights (its GB/s counts the f32 bytes it reads). "hot" reuses one weight copy
(it stays in cache); "cold" cycles through enough copies (> 128 MB) that the weights stream from memory, as
in a real decode. Times are this thread's CPU time (--wall: wall time), the best of --reps runs (the
machine may be shared), and include one activation quantization per timed batch of calls. The last line
is a memory read reference: NumPy summing a 256 MB array of int64.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from barellm import _native as nat  # noqa: E402
from barellm import quant  # noqa: E402

Q5_0, Q4_K, Q6_K = 6, 12, 14
ROWS, I8 = 0, 1
NAMES = {Q5_0: "q5_0", Q4_K: "q4_k", Q6_K: "q6_k"}
UNIT = {Q5_0: 32, Q4_K: 256, Q6_K: 256}
UNIT_BYTES = {Q5_0: 22, Q4_K: 144, Q6_K: 210}
SHAPES = [  # (rows, cols, type, what)
    (1024, 640, Q5_0, "attn_q"),
    (256, 640, Q5_0, "attn_k/v"),
    (2048, 640, Q5_0, "gate/up"),
    (640, 1024, Q4_K, "attn_out"),
    (640, 2048, Q4_K, "down"),
    (640, 2048, Q6_K, "down"),
]
COLD_BYTES = 128 << 20
clock = time.thread_time  # this thread's CPU time: steadier than wall time on a shared machine


def make_weights(type_, rows, cols, rng):
    """Random valid GGUF rows: random quants and scales, small finite f16 d (and dmin)."""
    nu = rows * cols // UNIT[type_]
    b = rng.integers(0, 256, (nu, UNIT_BYTES[type_]), dtype=np.uint8)
    d = rng.uniform(-0.01, 0.01, (nu, 2)).astype("<f2").view(np.uint8)
    if type_ == Q5_0:
        b[:, 0:2] = d[:, 0:2]
    elif type_ == Q4_K:
        b[:, 0:4] = d
    else:
        b[:, 208:210] = d[:, 0:2]
    return b.reshape(-1)


def timed(fn, budget):
    """Seconds per call of fn(iters) -> seconds per call, with iters chosen to fill `budget` seconds."""
    per = fn(1)
    iters = max(1, int(budget / max(per, 1e-7)))
    return fn(iters)


def best_of(fn, reps, budget):
    return min(timed(fn, budget) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-scalar", action="store_true")
    ap.add_argument("--wall", action="store_true", help="wall time instead of this thread's CPU time")
    args = ap.parse_args()
    global clock
    clock = time.perf_counter if args.wall else time.thread_time
    budget = 0.05 if args.quick else 0.15
    rng = np.random.default_rng(0)
    print(f"cpu: {nat.cpu_info()}  (single thread, best of {args.reps})")
    hdr = f"{'shape':>24} {'T':>4} {'path':>12} {'GMAC/s':>8} {'GB/s':>7} {'us/call':>9}"
    print(hdr)
    print("-" * len(hdr))
    for rows, cols, type_, what in SHAPES:
        raw = make_weights(type_, rows, cols, rng)
        wrows = raw.tobytes()
        wi8 = nat.repack(type_, I8, rows, cols, wrows)
        nbytes = len(wrows)
        W = quant.dequantize(raw, type_, (rows, cols))
        Wt = np.ascontiguousarray(W.T)
        label = f"{what} {rows}x{cols} {NAMES[type_]}"
        for T in (1, 64):
            x = rng.standard_normal((T, cols)).astype(np.float32)
            macs = rows * cols * T
            results = []

            def kern(ws, layout, isa, type_=type_, rows=rows, cols=cols, x=x):
                def run(iters):
                    nat.set_isa(isa)
                    t0 = clock()
                    nat.bench_matmul(type_, layout, rows, cols, ws, x, iters)
                    return (clock() - t0) / iters

                return run

            results.append(("avx2 i8", best_of(kern([wi8], I8, "avx2"), args.reps, budget)))
            if T == 1:
                cold = [bytes(wi8) for _ in range(max(2, COLD_BYTES // nbytes + 1))]
                results.append(("avx2 i8 cold", best_of(kern(cold, I8, "avx2"), args.reps, budget)))
                del cold
            results.append(("avx2 rows", best_of(kern([wrows], ROWS, "avx2"), args.reps, budget)))
            if not args.no_scalar:
                results.append(("scalar", best_of(kern([wi8], I8, "scalar"), 1, budget)))
            nat.set_isa("avx2")

            def npy(iters, x=x, Wt=Wt):
                t0 = clock()
                for _ in range(iters):
                    x @ Wt
                return (clock() - t0) / iters

            results.append(("numpy f32", best_of(npy, args.reps, budget)))
            for name, sec in results:
                wb = nbytes if name != "numpy f32" else W.nbytes
                print(f"{label:>24} {T:>4} {name:>12} {macs / sec / 1e9:8.2f} {wb / sec / 1e9:7.2f} {sec * 1e6:9.1f}")
    big = np.ones(32 << 20, np.int64)

    def mem(iters):
        t0 = clock()
        for _ in range(iters):
            big.sum()
        return (clock() - t0) / iters

    sec = best_of(mem, args.reps, budget)
    print(f"{'memory read (numpy sum)':>24} {'':>4} {'':>12} {'':>8} {big.nbytes / sec / 1e9:7.2f} {sec * 1e6:9.1f}")


if __name__ == "__main__":
    main()
