"""Single-thread speed of the matmul kernels on SmolLM2-135M's shapes (or Gemma 3 270M's: --model gemma3; a
gpt-oss expert's, MXFP4 beside Q4_0: --model gptoss).

    python bench/kernels.py [--model smollm2|gemma3|qwen15|gptoss|all] [--quick] [--reps N] [--cpu-time] [--no-scalar]
                            [--cold-mb MB] [-T 1,64] [--ghz F]

For each shape and T: GMAC/s (rows * cols * T multiply-adds per second) and GB/s (weight bytes read per
second) of
(each SIMD tier the CPU runs, avx2 and up, in turn: TIER below)
  TIER i8       the tier's kernel on the interleaved layout with 8-bit activations,
  TIER i8 cold  the same streaming its weights from memory (it cycles through > 96 MB of copies, the size
                of the model, as a real decode does; T = 1 only),
  TIER i8x2 (cold)  the same with Q8X2 activations (two int8 planes; the engine's default where a type has
                them: Q4_0, Q4_1, Q8_0, MXFP4),
  TIER rows     the tier's kernel on GGUF-ordered rows,
  scalar        the portable C path,
  numpy f32     NumPy's matmul on the dequantized f32 weights (GB/s counts its 4-byte weights).
On a CPU with AMX the amx rows run the tile kernels for every T of BARELLM_AMX_MIN_TOKENS (default 16) or more
(fewer: avx512's, as in the engine); with --ghz F (the core's clock under load) each row also says its share of
one core's int8 tile peak, 1,024 multiply-adds a cycle.
Times exclude the activation quantization (done once per input vector and shared by the matmuls that
read it); its cost per vector is printed separately. Each figure is the median of --reps runs of about
--budget seconds. --cpu-time counts the thread's CPU time instead of wall time (steadier on a shared
machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from barellm import _native as nat  # noqa: E402
from barellm.formats import quant  # noqa: E402

Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, MXFP4 = 2, 3, 6, 8, 12, 14, 39
ROWS, I8 = 0, 1
NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q8_0: "q8_0", Q4_K: "q4_k", Q6_K: "q6_k", MXFP4: "mxfp4"}
SHAPES = {  # model -> [(what, rows, cols, type)]
    "smollm2": [
        ("q/o", 576, 576, Q4_1),
        ("k/v", 192, 576, Q4_1),
        ("gate/up", 1536, 576, Q4_1),
        ("down", 576, 1536, Q4_1),
        ("output", 49152, 576, Q8_0),
    ],
    "gemma3": [  # Q4_K_M: ffn_down is Q4_K in half the layers, Q6_K in the others
        ("q", 1024, 640, Q5_0),
        ("k/v", 256, 640, Q5_0),
        ("gate/up", 2048, 640, Q5_0),
        ("o", 640, 1024, Q4_K),
        ("down", 640, 2048, Q4_K),
        ("down", 640, 2048, Q6_K),
    ],
    "qwen15": [  # Qwen2.5-Coder-1.5B Q4_K_M: Q|K|V and gate|up fused, ffn_down and attn_v Q6_K in half the layers
        ("qkv", 2048, 1536, Q4_K),
        ("o", 1536, 1536, Q4_K),
        ("gate/up", 17920, 1536, Q4_K),
        ("down", 1536, 8960, Q4_K),
        ("down", 1536, 8960, Q6_K),
        ("output", 151936, 1536, Q6_K),
    ],
    "gptoss": [  # gpt-oss-20b: an expert's gate, up or down matrix (2880 x 2880), as the file stores it and in Q4_0
        ("expert", 2880, 2880, MXFP4),
        ("expert", 2880, 2880, Q4_0),
    ],
}

_BLOCK = {
    Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
}


def make_weights(type_, rows, cols, rng):
    if type_ in (Q4_0, MXFP4):  # random nibbles; a small finite f16 d, or an E8M0 scale near 2^-6
        b = rng.integers(0, 256, (rows * cols // 32, quant.get(type_).block_bytes), dtype=np.uint8)
        if type_ == Q4_0:
            b[:, :2] = rng.uniform(-0.01, 0.01, (len(b), 1)).astype("<f2").view(np.uint8)
        else:
            b[:, 0] = rng.integers(120, 124, len(b))
        return b.reshape(-1)
    if type_ in (Q5_0, Q4_K, Q6_K):  # random quants and scales, small finite f16 d (and dmin)
        nu = rows * cols // (32 if type_ == Q5_0 else 256)
        b = rng.integers(0, 256, (nu, quant.get(type_).block_bytes), dtype=np.uint8)
        d = rng.uniform(-0.01, 0.01, (nu, 2)).astype("<f2").view(np.uint8)
        if type_ == Q6_K:
            b[:, 208:210] = d[:, :2]
        else:
            b[:, : 4 if type_ == Q4_K else 2] = d[:, : 4 if type_ == Q4_K else 2]
        return b.reshape(-1)
    b = np.zeros(rows * cols // 32, dtype=_BLOCK[type_])
    b["d"] = rng.uniform(-0.05, 0.05, b.shape)
    if type_ == Q4_1:
        b["m"] = rng.uniform(-0.5, 0.5, b.shape)
    lo, hi = (-127, 128) if type_ == Q8_0 else (0, 256)
    b["qs"] = rng.integers(lo, hi, b["qs"].shape)
    return b.view(np.uint8)


def dequantize(raw, type_, rows, cols):
    if type_ not in _BLOCK:
        return quant.dequantize(raw, type_, (rows, cols))
    b = raw.view(_BLOCK[type_])
    d = b["d"].astype(np.float32)[:, None]
    if type_ == Q8_0:
        return (b["qs"] * d).reshape(rows, cols)
    q = np.concatenate([b["qs"] & 15, b["qs"] >> 4], axis=1).astype(np.float32)
    return (q * d + b["m"].astype(np.float32)[:, None]).reshape(rows, cols)


def kernel_run(iters, *, isa, type_, layout, rows, cols, ws, x, cpu, act=0):
    nat.set_isa(isa)
    return nat.bench_matmul(type_, layout, rows, cols, ws, x, iters, cpu, act)


def numpy_run(iters, x, wt, cpu):
    clock = time.thread_time if cpu else time.perf_counter  # NumPy's BLAS is held to one thread above
    t0 = clock()
    for _ in range(iters):
        x @ wt
    return (clock() - t0) / iters


def quant_run(iters, type_, cols, x, act=0):
    t0 = time.perf_counter()
    for _ in range(iters):
        nat.quantize_act(type_, I8, cols, x, act)
    return (time.perf_counter() - t0) / iters / x.shape[0]


def measure(fn, reps, budget):
    """Median over reps of seconds per call, each rep as many calls as fill about `budget` seconds."""
    per = fn(1)
    if per > budget:  # slow paths: a single call per rep, and fewer reps
        return statistics.median([per] + [fn(1) for _ in range(min(reps, 3) - 1)])
    iters = max(1, int(budget / max(per, 1e-7)))
    return statistics.median(fn(iters) for _ in range(reps))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=[*SHAPES, "all"], default="smollm2", help="whose matrix shapes")
    ap.add_argument("--quick", action="store_true", help="T = 1 and 64 only, shorter runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget", type=float, default=None, help="seconds per rep (default 0.05, quick 0.02)")
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time instead of wall time")
    ap.add_argument("--no-scalar", action="store_true")
    ap.add_argument("--cold-mb", type=int, default=96,
                    help="size of the weight copies the cold runs cycle through (default 96, SmolLM2's weights)")
    ap.add_argument("-T", default=None, help="token counts, comma-separated (default 1,64,128; quick 1,64)")
    ap.add_argument("--ghz", type=float, default=None,
                    help="the core's clock in GHz: print each row's share of the AMX int8 tile peak (1024 MAC/cycle)")
    args = ap.parse_args()
    budget = args.budget or (0.02 if args.quick else 0.05)
    ts = [int(t) for t in args.T.split(",")] if args.T else [1, 64] if args.quick else [1, 64, 128]
    simd = [t for t in nat.cpu_info()["tiers"] if t != "scalar"]  # every SIMD tier the CPU runs
    rng = np.random.default_rng(0)
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"cpu: {nat.cpu_info()}; single thread; medians of {args.reps} ({clock})")
    hdr = f"{'shape':>24} {'T':>4} {'path':>13} {'GMAC/s':>8} {'GB/s':>7} {'us/call':>10}"
    if args.ghz:
        hdr += f" {'tile peak':>9}"
    print(hdr)
    print("-" * len(hdr))
    shapes = [s for m in SHAPES if args.model in (m, "all") for s in SHAPES[m]]
    for what, rows, cols, type_ in shapes:
        raw = make_weights(type_, rows, cols, rng)
        wrows = raw.tobytes()
        wi8 = nat.repack(type_, I8, rows, cols, wrows)
        nbytes = len(wrows)
        wt = np.ascontiguousarray(dequantize(raw, type_, rows, cols).T)
        label = f"{what} {rows}x{cols} {NAMES[type_]}"
        for T in ts:
            x = rng.standard_normal((T, cols)).astype(np.float32)
            run = partial(kernel_run, type_=type_, rows=rows, cols=cols, x=x, cpu=args.cpu_time)
            results = []
            for tier in simd:
                fn = partial(run, isa=tier, layout=I8, ws=[wi8])
                results.append((f"{tier} i8", nbytes, measure(fn, args.reps, budget)))
                x2 = nat.act_supported(type_, 1)
                if x2:
                    fn = partial(run, isa=tier, layout=I8, ws=[wi8], act=1)
                    results.append((f"{tier} i8x2", nbytes, measure(fn, args.reps, budget)))
                if T == 1:
                    cold = [bytes(wi8) for _ in range((args.cold_mb << 20) // nbytes + 2)]
                    fn = partial(run, isa=tier, layout=I8, ws=cold)
                    results.append((f"{tier} i8 cold", nbytes, measure(fn, args.reps, budget)))
                    if x2:
                        fn = partial(run, isa=tier, layout=I8, ws=cold, act=1)
                        results.append((f"{tier} i8x2 cold", nbytes, measure(fn, args.reps, budget)))
                    del cold
                fn = partial(run, isa=tier, layout=ROWS, ws=[wrows])
                results.append((f"{tier} rows", nbytes, measure(fn, args.reps, budget)))
            if not args.no_scalar and (T == 1 or rows * cols * T <= 1536 * 576 * 64):  # ~1 GMAC/s
                fn = partial(run, isa="scalar", layout=ROWS, ws=[wrows])
                results.append(("scalar", nbytes, measure(fn, args.reps, budget)))
            nat.set_isa("amx")  # back to the best tier the CPU has
            fn = partial(numpy_run, x=x, wt=wt, cpu=args.cpu_time)
            results.append(("numpy f32", wt.nbytes, measure(fn, args.reps, budget)))
            for name, wb, sec in results:
                gmac, gbs = rows * cols * T / sec / 1e9, wb / sec / 1e9
                peak = f" {gmac / (1024 * args.ghz):8.1%}" if args.ghz else ""
                print(f"{label:>24} {T:>4} {name:>13} {gmac:8.1f} {gbs:7.1f} {sec * 1e6:10.1f}{peak}", flush=True)
        xq = rng.standard_normal((64, cols)).astype(np.float32)
        sec = measure(partial(quant_run, type_=type_, cols=cols, x=xq), args.reps, budget)
        print(f"{label:>24} {'':>4} {'quantize x':>13} {'':>8} {'':>7} {sec * 1e6:10.2f}")
        if nat.act_supported(type_, 1):
            sec = measure(partial(quant_run, type_=type_, cols=cols, x=xq, act=1), args.reps, budget)
            print(f"{label:>24} {'':>4} {'quantize x2':>13} {'':>8} {'':>7} {sec * 1e6:10.2f}")


if __name__ == "__main__":
    main()
