"""Prefill and decode speed, laid out like llama-bench's table so the figures sit next to llama.cpp's.

pp<P>  prefill: one forward over P random tokens on a fresh cache, logits of the last position only
       (what a generation needs before its first token); tokens/s = P / seconds.
tg<N>  decode: N single-token forwards after a short prompt (or after D cached tokens with -d D);
       tokens/s = N / seconds. Each forward writes the KV cache and returns the last logits.
complete<N>  with --breakdown: the same decode through the Python API, model.complete(..., temperature 0.8,
       top_p 0.95, top_k 40) with the end-of-generation tokens banned (so every run makes N tokens); tokens/s
       = (N - 1) / decode seconds (the first token comes with the prompt). Then where each token's time went:
       forward (the native executor), logits copy (the rest of the engine call), sample, detokenize, stop
       (stop strings and held-back text), bookkeeping (the generation loop itself).
Every test runs once untimed (warm-up: page faults, caches, thread start), then -r times. The engine takes
its thread count at load, so the model is loaded once per thread count.
With --draft lookup|MODEL: speculative decoding instead, greedy, on three tasks, each run with and without
drafting in turn (the same model, the same cache): code-edit (a 160-line Python file given back with one
function renamed), chat (a free-form story) and completion (code to continue, no chat template); tokens/s of
both, the speedup, the share of drafted tokens accepted and the tokens each verification gave; the outputs
are checked to be the same.
With --roofline, decode speed is also given as a fraction of the memory-bandwidth limit: every decoded
token reads every weight once, so tokens/s cannot exceed bandwidth / (bytes of weights read per token).
"""

from __future__ import annotations

import argparse
import json
import sys

from barellm.cli.bench.measure import BenchRow, parse_int_list, run_bench
from barellm.cli.bench.report import (
    format_breakdown,
    format_scaling,
    format_table,
    need_matplotlib,
    plot_scaling,
    scaling_threads,
)
from barellm.errors import InvalidRequest


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="prefill and decode speed (llama-bench style table)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="model name or path (default smollm2-135m)")
    p.add_argument("-p", "--n-prompt", default="128,512", metavar="P,...",
                   help="prompt lengths to prefill (default 128,512; 0 = none)")
    p.add_argument("-n", "--n-gen", default=None, metavar="N,...",
                   help="tokens to decode (default 128; 0 = none); with --draft, at most this many per task (default: "
                        "each task's own length)")
    p.add_argument("-d", "--depth", default="0", metavar="D,...",
                   help="decode after D tokens already cached (default 0: after a short prompt)")
    p.add_argument("-t", "--threads", default=None, metavar="T,...",
                   help="thread counts, the model loaded once for each (default: physical cores)")
    p.add_argument("-r", "--repetitions", type=int, default=5, metavar="R", help="timed runs per test (default 5)")
    p.add_argument("--engine", choices=["native", "reference"], default="native",
                   help="native: the C core (default); reference: the NumPy float32 forward")
    from barellm.options import add_activations_arg

    add_activations_arg(p)
    p.add_argument("--breakdown", action="store_true",
                   help="also decode through model.complete with sampling (complete<N>) and show where each token's "
                        "time goes: forward, logits copy, sample, detokenize, stop strings, bookkeeping")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw tokens/s against threads (needs matplotlib)")
    p.add_argument("--roofline", action="store_true",
                   help="measure memory read bandwidth and give decode speed as a fraction of its limit")
    p.add_argument("--scaling", action="store_true",
                   help="thread scaling: 1, 2, 4, ... up to the physical cores (or -t's counts), with --roofline, "
                        "and a table of each count's speedup over the fewest and its share of the bandwidth limit")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                   help="with --roofline: use this bandwidth (e.g. from bench/roofline.c) instead of measuring")
    p.add_argument("--draft", default=None, metavar="lookup|MODEL",
                   help="speculative decoding with this drafter against plain decoding, on a code edit, a chat and a "
                        "code completion (see above)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from barellm.cpu import default_threads

    if args.draft is not None:
        from barellm.cli.bench.draft import cmd_bench_draft

        return cmd_bench_draft(args)
    args.n_gen = args.n_gen if args.n_gen is not None else "128"
    prompts = [x for x in parse_int_list(args.n_prompt, "-p", 0) if x]
    gens = [x for x in parse_int_list(args.n_gen, "-n", 0) if x]
    depths = parse_int_list(args.depth, "-d", 0)
    if args.scaling:
        from barellm.cpu import physical_cores

        args.roofline = True
        threads = parse_int_list(args.threads, "-t", 1) if args.threads else scaling_threads(physical_cores())
    else:
        threads = parse_int_list(args.threads, "-t", 1) if args.threads else [default_threads()]
    if not prompts and not gens:
        raise InvalidRequest("nothing to measure: -p and -n are both 0")
    if args.repetitions < 1:
        raise InvalidRequest(f"-r must be at least 1, got {args.repetitions}")
    if args.bandwidth is not None and (not args.roofline or args.bandwidth <= 0):
        raise InvalidRequest("--bandwidth is a positive GB/s figure for --roofline")
    if args.plot:
        need_matplotlib()   # fail before the minutes of measuring, not after
    if any(x > 256 for x in threads):
        raise InvalidRequest("threads must be in 1..256")

    def show(row: BenchRow) -> None:
        if not args.json:
            print(f"  {row.threads} threads {row.test}: {row.tps} t/s", file=sys.stderr)

    rows = run_bench(args.model, prompts, gens, threads, args.repetitions, args.engine, depths, args.roofline,
                     args.bandwidth, on_row=show, activations=args.activations, breakdown=args.breakdown,
                     kv_type=args.kv_type)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1))
    else:
        print(format_table(rows))
        for r in rows:
            if r.breakdown is not None:
                print("\n" + format_breakdown(r))
        if args.scaling:
            print("\nthread scaling\n\n" + format_scaling(rows))
        roof = next((r.roofline for r in rows if r.roofline), None)
        if roof:
            print(f"\nroofline: {roof['weight_bytes_per_token'] / 1e6:.1f} MB of weights per decoded token; "
                  f"bandwidth by {roof['bandwidth_method']}")
    if args.plot:
        plot_scaling(rows, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
