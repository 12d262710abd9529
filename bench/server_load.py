"""Load test for `barellm serve`: aggregate generation throughput and time to first token with 1, 2, 4 and
8 concurrent streaming clients, then the server's resident memory before and after many short requests.

    .venv/bin/python bench/server_load.py                       # starts its own server (smollm2-135m, 8 slots)
    .venv/bin/python bench/server_load.py --engine reference --max-tokens 16 --rss-requests 200
    .venv/bin/python bench/server_load.py --url http://127.0.0.1:8080 --pid 1234   # a running server

Prints a Markdown table (the format of docs/benchmarks.md) and, with --json, writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "What makes bread rise?",
    "Describe a walk through a forest in autumn.",
    "Why is the sky blue?",
    "Give me three tips for learning a language.",
    "Tell a story about a robot who learns to paint.",
]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int, res: Result, lock: threading.Lock
                ) -> None:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:   # counted and reported; a load test should finish and say what failed
        with lock:
            res.errors += 1
        print(f"  request failed: {e}", file=sys.stderr)
        return
    with lock:
        res.tokens += tokens
        if first is not None:
            res.ttft.append(first)


def run_clients(url: str, clients: int, per_client: int, max_tokens: int) -> tuple[Result, float]:
    res = Result()
    lock = threading.Lock()

    def worker(i: int) -> None:
        with httpx.Client(timeout=600) as c:
            for j in range(per_client):
                one_request(c, url, PROMPTS[(i + j * clients) % len(PROMPTS)], max_tokens, res, lock)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return res, time.perf_counter() - t0


def short_requests(url: str, n: int, clients: int) -> int:
    """n non-streaming requests of one or two tokens; returns how many failed."""
    failed = [0]
    lock = threading.Lock()
    counter = iter(range(n))

    def worker() -> None:
        with httpx.Client(timeout=600) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                body = {"prompt": f"{PROMPTS[i % len(PROMPTS)]} ({i})", "max_tokens": 1 + i % 2, "temperature": 0}
                r = c.post(f"{url}/v1/completions", json=body)
                if r.status_code != 200:
                    with lock:
                        failed[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default smollm2-135m)")
    ap.add_argument("--engine", default="native", choices=["native", "reference"])
    ap.add_argument("--activations", default="q8x2", choices=["q8x2", "q8"],
                    help="the native engine's activation precision (default q8x2)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--draft", default=None, metavar="lookup|MODEL",
                    help="serve with speculative decoding (serve --draft): compare a run without it")
    ap.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--concurrency", default="1,2,4,8", help="client counts to measure (default 1,2,4,8)")
    ap.add_argument("--per-client", type=int, default=3, help="requests each client sends per level (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    ap.add_argument("--rss-requests", type=int, default=1000, help="short requests for the memory check (1000)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args()

    proc = None
    url = args.url
    pid = args.pid
    if url is None:
        port = free_port()
        cmd = [sys.executable, "-m", "barellm", "serve", *([args.model] if args.model else []),
               "--engine", args.engine, "--activations", args.activations, "--slots", str(args.slots),
               "--context", str(args.context),
               "--port", str(port), "--queue", "1024", "--log-level", "warning",
               *(["-t", str(args.threads)] if args.threads else []), *(["--draft", args.draft] if args.draft else [])]
        proc = subprocess.Popen(cmd)
        pid = proc.pid
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
    try:
        info = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        print(f"# {info['id']}, {info['slots']} slots, context {info['context_length']}, engine {args.engine}, "
              f"{os.cpu_count()} CPUs", file=sys.stderr)
        run_clients(url, 1, 1, 8)   # warm-up: first-call costs stay out of the numbers
        rows = []
        for clients in (int(c) for c in args.concurrency.split(",")):
            res, wall = run_clients(url, clients, args.per_client, args.max_tokens)
            row = {
                "clients": clients, "requests": clients * args.per_client, "errors": res.errors,
                "generated_tokens": res.tokens, "seconds": wall, "tokens_per_s": res.tokens / wall,
                "ttft_median_s": statistics.median(res.ttft) if res.ttft else float("nan"),
                "ttft_max_s": max(res.ttft) if res.ttft else float("nan"),
            }
            rows.append(row)
            print(f"  {clients} clients: {row['tokens_per_s']:.1f} tok/s, TTFT median {row['ttft_median_s']:.3f} s",
                  file=sys.stderr)
        memory: dict[str, float] = {}
        if pid:
            memory["rss_before_mb"] = rss_mb(pid)
            t0 = time.perf_counter()
            failed = short_requests(url, args.rss_requests, 8)
            memory["short_requests"] = args.rss_requests
            memory["short_failed"] = failed
            memory["short_seconds"] = time.perf_counter() - t0
            memory["rss_after_mb"] = rss_mb(pid)

        print("\n| concurrent clients | requests | generated tok/s (aggregate) | TTFT median | TTFT max | errors |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['ttft_median_s'] * 1000:.0f} ms "
                  f"| {r['ttft_max_s'] * 1000:.0f} ms | {r['errors']} |")
        if memory:
            print(f"\nServer RSS: {memory['rss_before_mb']:.0f} MB before, {memory['rss_after_mb']:.0f} MB after "
                  f"{args.rss_requests} short requests ({memory['short_seconds']:.1f} s, "
                  f"{int(memory['short_failed'])} failed).")
        if args.json:
            args.json.write_text(json.dumps({"server": info, "engine": args.engine, "max_tokens": args.max_tokens,
                                             "levels": rows, "memory": memory}, indent=2))
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
