"""Time to first token of a chat's second turn, whose prompt the server finds already in a slot's cache,
against the first turn's, which is prefilled whole.

    python bench/chat_ttft.py [MODEL] [--port 8123] [--threads 2] [--rounds 3]

Starts `barellm serve` on a loopback port; each round opens a new conversation (a ~570-token system prompt
that differs from the other rounds' from its first token on), asks one question, then a second one.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model", nargs="?", default="smollm2-135m")
ap.add_argument("--port", type=int, default=8123)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
port = args.port
barellm = os.path.join(os.path.dirname(sys.executable), "barellm")
srv = subprocess.Popen([barellm, "serve", args.model, "--port", str(port), "--slots", "2", "-t", str(args.threads)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
base = f"http://127.0.0.1:{port}"
for _ in range(200):
    try:
        if httpx.get(base + "/health").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.1)
system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and cite rule {i}." for i in range(40))


def turn(msgs):
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    with httpx.stream("POST", base + "/v1/chat/completions", json={"model": "smollm2-135m", "messages": msgs,
                      "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                usage = ch["usage"]
            for c in ch.get("choices", []):
                if c["delta"].get("content") and first is None:
                    first = time.perf_counter() - t0
                text += c["delta"].get("content") or ""
    return first, text, usage


try:
    rows = []
    for rep in range(args.rounds):
        msgs = [{"role": "system", "content": f"Session {rep * 7919}. " + system},
                {"role": "user", "content": "What is 2+2?"}]
        f1, t1, u1 = turn(msgs)
        msgs += [{"role": "assistant", "content": t1}, {"role": "user", "content": "And 3+3?"}]
        f2, t2, u2 = turn(msgs)
        rows.append((u1["prompt_tokens"], f1, u2["prompt_tokens"], u2["prompt_tokens_details"]["cached_tokens"], f2))
    for p1, f1, p2, cached, f2 in rows:
        print(f"turn 1: prompt {p1} tokens, TTFT {f1:.3f} s | turn 2: prompt {p2} tokens, {cached} cached, "
              f"TTFT {f2:.3f} s")
finally:
    srv.terminate()
    srv.wait()
