"""Per-token overhead outside the engine: decode speed of the bare engine (like `barellm bench` tg), of
`model.complete` with sampling, and of one client of `barellm serve` (streamed and not), side by side.

    .venv/bin/python bench/overhead.py                 # smollm2-135m, 2 threads, 128 tokens, 3 repetitions
    .venv/bin/python bench/overhead.py -t 1 -n 64 -r 5 --no-server

The engine figure is single-token forwards per second; "model.complete, decode" is (tokens - 1) / the
Completion's decode seconds (the first token comes with the prompt); the others are generated tokens / a
whole call's wall time, so prompt processing and, for the server, HTTP and JSON count against them;
"serve, streamed, decode" is the rate the client sees between the first token's chunk and the last's. The
median of the repetitions is printed, as a fraction of the engine's; then the server's per-token time
breakdown from /metrics.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

PROMPT = "Once upon a time, in a small village by the sea, there lived"
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}


def engine_tg(model, n: int) -> float:
    import numpy as np

    eng = model.engine
    toks = np.random.default_rng(1).integers(0, model.config.n_vocab, n + 8).tolist()
    eng.forward(toks[:8], 0)
    t0 = time.perf_counter()
    for i in range(n):
        eng.forward([toks[8 + i]], 8 + i)
    return n / (time.perf_counter() - t0)


def complete_tps(model, n: int, seed: int) -> tuple[float, float]:
    model.reset()
    t0 = time.perf_counter()
    c = model.complete(PROMPT, max_tokens=n, seed=seed, **SAMPLING)
    return (len(c.token_ids) - 1) / c.decode_seconds, len(c.token_ids) / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_tps(client, url: str, n: int, seed: int, stream: bool) -> tuple[float, float]:
    """Generated tokens / the call's wall time, and, streamed, the decode rate the client sees: (tokens - 1) /
    the time from the first token's chunk to the last's (the non-streamed call gives no such times: nan)."""
    body = {"prompt": PROMPT, "max_tokens": n, "seed": seed, "stream": stream, **SAMPLING}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    tokens = 0
    first = last = float("nan")
    if stream:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif chunk["choices"] and chunk["choices"][0].get("text"):
                        last = time.perf_counter()
                        if first != first:
                            first = last
    else:
        tokens = client.post(f"{url}/v1/completions", json=body).json()["usage"]["completion_tokens"]
    whole = tokens / (time.perf_counter() - t0)
    return whole, (tokens - 1) / (last - first) if stream else float("nan")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", args.model, "-t", str(args.threads),
                             "--context", "1024", "--slots", "1", "--port", str(port), "--log-level", "warning"])
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            raise SystemExit("the server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--no-server", action="store_true")
    args = ap.parse_args()

    import barellm

    model = barellm.load(args.model, threads=args.threads, context=1024)
    proc = client = None
    lines: list[str] = []
    if not args.no_server:
        import httpx

        proc, url = start_server(args)   # idle while the in-process figures run: its workers sleep
        # one client for every call, as an application keeps one: building an httpx.Client (its TLS
        # context) costs ~15 ms, a tenth of a 128-token call, and is no part of the server
        client = httpx.Client(timeout=600)
    # every round measures each way once, one after the other, so that the machine's drift (a shared VM's
    # memory bandwidth moves by tens of percent within minutes) falls on all of them alike; the ratios
    # are taken within a round
    rows: dict[str, list[float]] = {}     # tok/s by way, a figure per round
    ratios: dict[str, list[float]] = {}   # the same over the round's engine tg
    engine_tg(model, 16)
    complete_tps(model, 16, 0)
    if client is not None:
        server_tps(client, url, 16, 0, False)
    try:
        for r in range(args.repetitions):
            got = {"engine tg": engine_tg(model, args.tokens)}
            got["model.complete, decode"], got["model.complete, whole call"] = complete_tps(model, args.tokens, r + 1)
            if client is not None:
                got["serve, whole"] = server_tps(client, url, args.tokens, r + 1, False)[0]
                got["serve, streamed"], got["serve, streamed, decode"] = server_tps(client, url, args.tokens, r + 1,
                                                                                    True)
            for name, v in got.items():
                rows.setdefault(name, []).append(v)
                ratios.setdefault(name, []).append(v / got["engine tg"])
        if client is not None:
            try:
                metrics = client.get(f"{url}/metrics", timeout=10).text
                lines = [ln for ln in metrics.splitlines() if ln.startswith("barellm_token_phase_ms_per_token")]
            except httpx.HTTPError:
                pass
    finally:
        if client is not None:
            client.close()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"| {args.model}, {args.threads} threads, {args.tokens} tokens, {args.repetitions} rounds "
          "| tok/s (median) | of engine tg (median of the rounds' ratios) |")
    print("|---|---:|---:|")
    for name, xs in rows.items():
        print(f"| {name} | {statistics.median(xs):.1f} | {100 * statistics.median(ratios[name]):.0f} % |")
    if lines:
        print("\nserver per-token breakdown (/metrics):")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
