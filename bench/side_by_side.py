"""barellm beside llama.cpp's own llama-bench: the same GGUF files, tests and threads, interleaved round by round.

    python bench/side_by_side.py --llama-bench PATH/llama-bench [--models smollm2-135m,qwen2.5-coder-1.5b]
        [-p 512] [-n 128] [-d 0,4096] [-t 1,2] [-r 3] [--isa avx2,avx512] [--kv-type f16,q8_0]
        [--roofline PATH/roofline] [--json OUT.json]

Each round runs, for every model and thread count, llama-bench once (flash attention on) and `barellm bench`
once, and (with --roofline, bench/roofline.c built) the machine's read bandwidth; the table gives medians over
the rounds and barellm's speed as a multiple of llama.cpp's, so a slow spell of a shared machine hits both
alike (with --isa, one barellm row per kernel tier, BARELLM_ISA set for each; a model may also be a .gguf
path, such as the 7B shape). Decode rows also give tokens/s as a share of the bandwidth limit (weights read
per token / bandwidth, as `barellm bench --roofline` counts them): the roofline's best pass is measured right
before each decode pair, each round's speed is taken over that round's limit, and the row gives the median of
those shares. The limit is roofline.c's one-stream read; its best read as 1, 2 or 3 streams a thread (one core
reads faster from a few places at once) is given beside it, with decode's share of that.

--kv-type runs every test once per KV cache type, the same type on both sides: barellm's `--kv-type` beside
llama-bench's `-ctk TYPE -ctv TYPE` (f16, q8_0; llama.cpp turns keys, queries and values by a Walsh-Hadamard
transform for its quantized caches, barellm keys and queries), so decode at depth (-d 4096,16384) compares
the 8-bit caches' attention.

llama-bench is built from the llama.cpp sources vendored in the llama-cpp-python sdist (docs/benchmarks.md has
the command); the GGUF files come from `barellm pull --keep-gguf`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def gguf_of(name: str) -> Path:
    """A model name's GGUF from the hub cache, or a .gguf path as given (the real-shaped fixtures of
    ../shared/bench/make_model.py: the 7B shape)."""
    if name.endswith(".gguf"):
        return Path(name)
    from barellm.store import hub

    return hub.pull(name, keep_gguf=True, quiet=True)


def run_llama_bench(exe: str, gguf: Path, test: str, n: int, depth: int, threads: int, kv: str = "f16") -> float:
    args = [exe, "-m", str(gguf), "-t", str(threads), "-r", "1", "-fa", "1", "-o", "json", "-ctk", kv, "-ctv", kv]
    args += ["-p", str(n), "-n", "0"] if test == "pp" else ["-p", "0", "-n", str(n)]
    if depth:
        args += ["-d", str(depth)]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    return float(rows[0]["avg_ts"])


def run_barellm(model: str, test: str, n: int, depth: int, threads: int, isa: str = "",
                kv: str = "f16") -> tuple[float, dict]:
    args = [sys.executable, "-m", "barellm", "bench", model, "-t", str(threads), "-r", "1", "--json",
            "--roofline", "--kv-type", kv]
    env = dict(os.environ, BARELLM_ISA=isa) if isa else None
    args += ["-p", str(n), "-n", "0"] if test == "pp" else ["-p", "0", "-n", str(n)]
    if depth:
        args += ["-d", str(depth)]
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout
    rows = json.loads(out)
    row = rows[0]
    return float(row["tps"]["median"]), row


def label(model: str) -> str:
    return Path(model).stem if model.endswith(".gguf") else model


def run_roofline_streams(exe: str, threads: int) -> tuple[float, float]:
    """bench/roofline.c's best read in GB/s with `threads` threads: (one stream a thread, the best of 1, 2 and
    3 streams a thread). A build without the stream columns gives its one figure twice."""
    out = subprocess.run([exe, "1024", str(threads)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        m = re.match(rf"\s*{threads}((?:\s+[\d.]+)+)\s*$", line)
        if m:
            v = [float(x) for x in m.group(1).split()]
            return v[0], max([v[0]] + v[2:4]) if len(v) >= 5 else v[0]
    raise RuntimeError(f"no bandwidth for {threads} threads in the roofline output:\n{out}")


def run_roofline(exe: str, threads: int) -> float:
    """bench/roofline.c's best one-stream read in GB/s with `threads` threads."""
    return run_roofline_streams(exe, threads)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"), required="LLAMA_BENCH" not in os.environ)
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("-p", type=int, default=512, help="prompt length of the prefill test (0: none)")
    ap.add_argument("-n", type=int, default=128, help="tokens of the decode test (0: none)")
    ap.add_argument("-d", default="0", help="cached tokens before the decode test, comma-separated")
    ap.add_argument("-t", default="1,2", help="thread counts")
    ap.add_argument("-r", type=int, default=3, help="rounds")
    ap.add_argument("--roofline", default=None, help="bench/roofline.c built (bandwidth in the same rounds)")
    ap.add_argument("--isa", default="", help="barellm's kernel tiers to run, comma-separated (BARELLM_ISA each; "
                                              "default: the best the CPU has)")
    ap.add_argument("--kv-type", default="f16", help="KV cache types, comma-separated (f16, q8_0): each test "
                                                    "once per type, the same on both sides")
    ap.add_argument("--json", default=None, help="write every sample here")
    args = ap.parse_args()
    kvs = args.kv_type.split(",")
    if not kvs or any(k not in ("f16", "q8_0") for k in kvs):
        ap.error(f"--kv-type: f16 and/or q8_0, comma-separated, got {args.kv_type!r}")
    isas = args.isa.split(",") if args.isa else [""]
    models = args.models.split(",")
    threads = [int(t) for t in args.t.split(",")]
    depths = [int(d) for d in args.d.split(",")]
    tests = [(test, n, d, kv) for kv in kvs
             for test, n, d in ([("pp", args.p, 0)] if args.p else []) + ([("tg", args.n, d) for d in depths]
                                                                          if args.n else [])]
    ggufs = {m: gguf_of(m) for m in models}
    samples: dict[tuple, dict[str, list[float]]] = {}
    weights: dict[str, float] = {}
    for rnd in range(args.r):
        for t in threads:
            for m in models:
                for test, n, d, kv in tests:
                    key = (m, t, test, n, d, kv)
                    s = samples.setdefault(key, {"llama.cpp": [], "GB/s": [], "GB/s streams": [],
                                                 **{f"barellm{isa}": [] for isa in isas}})
                    if args.roofline and test == "tg":
                        # the limit of this very moment: a shared machine's bandwidth drifts within minutes
                        bw, bw_any = run_roofline_streams(args.roofline, t)
                        s["GB/s"].append(bw)
                        s["GB/s streams"].append(bw_any)
                        samples.setdefault(("bw", t), {}).setdefault("GB/s", []).append(bw)
                    s["llama.cpp"].append(run_llama_bench(args.llama_bench, ggufs[m], test, n, d, t, kv))
                    for isa in isas:
                        tps, row = run_barellm(str(ggufs[m]) if m.endswith(".gguf") else m, test, n, d, t, isa, kv)
                        s[f"barellm{isa}"].append(tps)
                        if row.get("roofline"):
                            weights[m] = float(row["roofline"]["weight_bytes_per_token"])
                    print(f"round {rnd + 1}: {label(m)} t{t} {test}{n}{f' @{d}' if d else ''} KV {kv}: llama.cpp "
                          f"{s['llama.cpp'][-1]:.1f}, " + ", ".join(
                              f"barellm{f' {i}' if i else ''} {s[f'barellm{i}'][-1]:.1f}" for i in isas) + " tok/s",
                          file=sys.stderr, flush=True)
    print(f"\nmedians of {args.r} interleaved rounds; load average now {os.getloadavg()[0]:.1f}")
    hdr = "| model | threads | test | KV | llama.cpp tok/s | barellm tok/s | barellm / llama.cpp |"
    if args.roofline:
        hdr += (" read GB/s | decode limit tok/s | barellm of limit | llama.cpp of limit |"
                " best read, 1-3 streams a thread | barellm of it |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for (m, t, test, n, d, kv), s0 in [(k, v) for k, v in samples.items() if k[0] != "bw"]:
        for isa in isas:
            s = dict(s0, barellm=s0[f"barellm{isa}"])
            lc, bl = statistics.median(s["llama.cpp"]), statistics.median(s["barellm"])
            name = f"{test}{n}" + (f" after {d}" if d else "")
            line = (f"| {label(m)}{f' [{isa}]' if isa else ''} | {t} | {name} | {kv} | {lc:.1f} | {bl:.1f} | "
                    f"{bl / lc:.2f}x |")
            if args.roofline:
                if test == "tg" and weights.get(m) and s["GB/s"]:
                    # each round's speed over the limit measured just before it, then the median of those shares
                    bw = statistics.median(s["GB/s"])
                    limit = bw * 1e9 / weights[m]
                    share = {e: statistics.median(100 * tps * weights[m] / (g * 1e9)
                                                  for tps, g in zip(s[e], s["GB/s"], strict=True))
                             for e in ("barellm", "llama.cpp")}
                    any_bw = statistics.median(s["GB/s streams"])
                    any_share = statistics.median(100 * tps * weights[m] / (g * 1e9)
                                                  for tps, g in zip(s["barellm"], s["GB/s streams"], strict=True))
                    line += (f" {bw:.1f} | {limit:.1f} | {share['barellm']:.0f}% | {share['llama.cpp']:.0f}% |"
                             f" {any_bw:.1f} | {any_share:.0f}% |")
                else:
                    bw = statistics.median(samples[("bw", t)]["GB/s"]) if ("bw", t) in samples else float("nan")
                    line += f" {bw:.1f} | | | | | |"
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(map(str, k)): v for k, v in samples.items()}, indent=1))


if __name__ == "__main__":
    main()
