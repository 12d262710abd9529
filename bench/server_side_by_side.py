"""`barellm serve` beside llama.cpp's own `llama-server`: the same GGUF file, slots, context per slot and threads,
the same requests, interleaved round by round; and `barellm bench` tg in the same rounds, the engine speed a
server's one client should get.

    python bench/server_side_by_side.py --llama-server PATH/llama-server [--model smollm2-135m] [-t 2]
        [--slots 8] [-n 128] [-r 3] [--json OUT.json]

Each round measures, on each server in turn (which goes first alternates):
- `1 client`: one non-streamed /v1/completions of n tokens, then one streamed; generated tokens / the
  request's wall time (prompt, HTTP and JSON included);
- `8 clients`: one streamed request of n tokens from each of --slots concurrent clients; all completion tokens
  over the wall time from the first request sent to the last answer;
- `ttft 512`: a 512-token prompt (token ids, a fresh random prompt per round and server, prefix cache off)
  with max_tokens 1, streamed: request sent -> first token's chunk.
Every request samples (temperature 0.8, top-p 0.95, top-k 40) with the end-of-generation tokens banned by
logit_bias, so each makes exactly n tokens on both servers. llama-server runs with flash attention on and
`-c slots*context -np slots` (each slot gets `context` tokens, as barellm's `--slots/--context` give).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPT = "Once upon a time, in a small village by the sea, there lived"
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} did not start in {timeout:.0f} s")


def completion(url: str, body: dict, stream: bool) -> tuple[int, float, float | None]:
    """(completion tokens, wall seconds, seconds to the first text chunk when streamed)."""
    body = dict(body, stream=stream)
    t0 = time.perf_counter()
    first = None
    with httpx.Client(timeout=600) as c:
        if not stream:
            r = c.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"]), time.perf_counter() - t0, None
        body["stream_options"] = {"include_usage": True}
        tokens = 0
        pieces = 0
        with c.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    pieces += 1
                    if first is None:
                        first = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        return tokens or pieces, time.perf_counter() - t0, first


def many(url: str, body: dict, clients: int) -> float:
    counts = [0] * clients

    def one(i: int) -> None:
        counts[i] = completion(url, dict(body, seed=i + 1), True)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def bench_tg(model: str, n: int, threads: int) -> float:
    out = subprocess.run([sys.executable, "-m", "barellm", "bench", model, "-p", "0", "-n", str(n), "-t",
                          str(threads), "-r", "3", "--json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["tps"]["median"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    required="LLAMA_SERVER" not in os.environ)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="tokens per slot")
    ap.add_argument("-n", type=int, default=128, help="tokens per request")
    ap.add_argument("-r", type=int, default=3, help="rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import barellm
    from barellm.store import hub

    gguf = hub.pull(args.model, keep_gguf=True, quiet=True)
    tok = barellm.load(args.model, engine="reference", context=64).tokenizer
    eog = sorted(tok.eog_ids) if hasattr(tok, "eog_ids") else [tok.eos_id]
    bias = {str(i): -100 for i in eog}
    body = {"prompt": PROMPT, "max_tokens": args.n, "logit_bias": bias, **SAMPLING}
    vocab = tok.vocab_size

    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    logs = []
    try:
        port = free_port()
        log = open(f"/tmp/barellm-serve-{port}.log", "w")
        logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", args.model, "--port", str(port),
                                 "-t", str(args.threads), "--slots", str(args.slots), "-c", str(args.context)],
                                stdout=log, stderr=subprocess.STDOUT)
        servers["barellm"] = (f"http://127.0.0.1:{port}", proc)
        port = free_port()
        log = open(f"/tmp/llama-server-{port}.log", "w")
        logs.append(log)
        proc = subprocess.Popen([args.llama_server, "-m", str(gguf), "--port", str(port), "-t", str(args.threads),
                                 "-tb", str(args.threads), "-np", str(args.slots), "-c",
                                 str(args.slots * args.context), "-fa", "on", "--no-warmup"],
                                stdout=log, stderr=subprocess.STDOUT)
        servers["llama-server"] = (f"http://127.0.0.1:{port}", proc)
        for name, (url, proc) in servers.items():
            wait_ready(url, proc, name)
            completion(url, dict(body, max_tokens=8), False)  # warm: page faults, first-pass costs

        rng = random.Random(0)
        samples: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.r):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            for name in order:
                url = servers[name][0]
                n, s, _ = completion(url, body, False)
                samples.setdefault((name, "1 client"), []).append(n / s)
                n, s, _ = completion(url, body, True)
                samples.setdefault((name, "1 client, streamed"), []).append(n / s)
                samples.setdefault((name, f"{args.slots} clients, streamed"), []).append(many(url, body, args.slots))
                ids = [rng.randrange(1000, vocab - 1000) for _ in range(512)]
                _, _, first = completion(url, {"prompt": ids, "max_tokens": 1, "cache_prompt": False, **SAMPLING},
                                         True)
                samples.setdefault((name, "ttft 512 (ms)"), []).append(1e3 * (first or float("nan")))
            samples.setdefault(("barellm bench", f"tg{args.n}"), []).append(
                bench_tg(args.model, args.n, args.threads))
            print(f"round {rnd + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}" for k, v in samples.items()),
                  file=sys.stderr, flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()

    med = {k: statistics.median(v) for k, v in samples.items()}
    tg = med[("barellm bench", f"tg{args.n}")]
    print(f"\n{args.model}, {args.threads} threads, {args.slots} slots x {args.context}, {args.n} tokens a request; "
          f"medians of {args.r} interleaved rounds; barellm bench tg{args.n} {tg:.1f} tok/s")
    print("| test | llama-server | barellm serve | barellm / llama-server | barellm of its bench tg |")
    print("|---|---:|---:|---:|---:|")
    for test in ("1 client", "1 client, streamed", f"{args.slots} clients, streamed", "ttft 512 (ms)"):
        lc, bl = med[("llama-server", test)], med[("barellm", test)]
        share = f"{100 * bl / tg:.0f}%" if test.startswith("1 client") else ""
        print(f"| {test} | {lc:.1f} | {bl:.1f} | {bl / lc:.2f}x | {share} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"|".join(k): v for k, v in samples.items()}, indent=1))


if __name__ == "__main__":
    main()
