"""One process with T threads against R replicas on Ray: aggregate generated tokens/s with concurrent clients.

    .venv/bin/python bench/ray_load.py                          # 1 process x 2 threads vs 2 replicas x 1 thread
    .venv/bin/python bench/ray_load.py --threads 4 --replicas 4 --replica-threads 1 --clients 16

Each setup runs on this machine (Ray: a local instance of its own, started and stopped here) with the same
total of threads and slots, and the same streaming chat load as bench/server_load.py (each client sends
--per-client requests of --max-tokens tokens, one after another). Prints a Markdown table: tokens/s, time
to first token, and resident memory (the server process; for Ray each replica, and the Ray instance in all).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import free_port, rss_mb, run_clients  # noqa: E402


def tree_rss_mb(root: int) -> float:
    """Resident memory of a process and all its descendants (a local Ray instance hangs off its driver)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        rss = rss_mb(pid) if os.path.exists(f"/proc/{pid}") else float("nan")
        total += 0.0 if rss != rss else rss
        todo.extend(children.get(pid, []))
    return total


def private_mb(pid: int) -> float:
    """Memory only this process holds: its resident pages less those shared with others (the model file's
    mapped pages are shared by every replica on a machine)."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total / 1024


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ray_processes(root: int) -> dict[str, list[int]]:
    """The pids of Ray Serve's HTTP proxy, barellm's router and replicas under a local Ray instance."""
    found: dict[str, list[int]] = {"proxy": [], "router": [], "replica": []}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        for kind, tag in (("proxy", "ray::ProxyActor"), ("router", "barellm-router"), ("replica", "barellm-replica")):
            if cmd.startswith("ray::") and tag in cmd:
                found[kind].append(int(entry))
    return found


def start(cmd: list[str], url: str, ready: Any, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            if r.status_code == 200 and ready(r.json()):
                return proc
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"the server did not start: {' '.join(cmd)}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def measure(label: str, url: str, args: argparse.Namespace, watch: dict[str, list[int]] | None = None
            ) -> dict[str, Any]:
    run_clients(url, args.clients, 1, 8)   # warm-up: every replica's first calls stay out of the numbers
    watch = watch or {}
    cpu0 = {k: sum(cpu_seconds(p) for p in pids) for k, pids in watch.items()}
    res, wall = run_clients(url, args.clients, args.per_client, args.max_tokens)
    cpu = {k: sum(cpu_seconds(p) for p in pids) - cpu0[k] for k, pids in watch.items()}
    row = {"setup": label, "clients": args.clients, "requests": args.clients * args.per_client,
           "errors": res.errors, "generated_tokens": res.tokens, "seconds": wall, "tokens_per_s": res.tokens / wall,
           "ttft_median_s": statistics.median(res.ttft) if res.ttft else float("nan"),
           "cpu_ms_per_token": {k: 1000 * v / max(res.tokens, 1) for k, v in cpu.items()}}
    print(f"  {label}: {row['tokens_per_s']:.1f} tok/s, TTFT median {row['ttft_median_s']:.3f} s", file=sys.stderr)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2, help="threads of the single process (default 2)")
    ap.add_argument("--replicas", type=int, default=2, help="Ray replicas (default 2)")
    ap.add_argument("--replica-threads", type=int, default=1, help="threads of each replica (default 1)")
    ap.add_argument("--slots", type=int, default=8, help="slots in all, split evenly over the replicas (default 8)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--activations", default="q8x2", choices=["q8x2", "q8"])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-single", action="store_true", help="only the Ray setup")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    base = [sys.executable, "-m", "barellm", "serve", args.model, "--context", str(args.context),
            "--activations", args.activations, "--queue", "1024", "--log-level", "warning"]
    rows = []
    if not args.skip_single:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start([*base, "-t", str(args.threads), "--slots", str(args.slots), "--port", str(port)], url,
                     lambda h: True, env)
        try:
            row = measure(f"1 process x {args.threads} threads, {args.slots} slots", url, args, {"server": [proc.pid]})
            row["rss_mb"] = {"server": rss_mb(proc.pid), "server_private": private_mb(proc.pid)}
            rows.append(row)
        finally:
            stop(proc)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    per = max(1, args.slots // args.replicas)
    t0 = time.monotonic()
    proc = start([*base, "--ray", "--address", "local", "--replicas", str(args.replicas), "-t",
                  str(args.replica_threads), "--slots", str(per), "--port", str(port)], url,
                 lambda h: h.get("replicas_ok") == args.replicas, env)
    startup = time.monotonic() - t0
    try:
        row = measure(f"{args.replicas} replicas x {args.replica_threads} thread(s), {per} slots each", url, args,
                      ray_processes(proc.pid))
        health = httpx.get(f"{url}/health", timeout=30).json()
        row["rss_mb"] = {"replicas": [rss_mb(r["pid"]) for r in health["replicas"]],
                         "replicas_private": [private_mb(r["pid"]) for r in health["replicas"]],
                         "ray_instance_total": tree_rss_mb(proc.pid)}
        row["startup_s"] = startup
        rows.append(row)
    finally:
        stop(proc)

    print(f"\n{args.clients} streaming clients, {args.max_tokens} tokens per request, {args.model}, "
          f"{os.cpu_count()} CPUs\n")
    print("| setup | generated tok/s (aggregate) | TTFT median | errors | CPU ms per token | resident memory |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mem = r["rss_mb"]
        if "server" in mem:
            m = f"{mem['server']:.0f} MB ({mem['server_private']:.0f} MB private)"
        else:
            pairs = zip(mem["replicas"], mem["replicas_private"], strict=True)
            each = ", ".join(f"{x:.0f} ({y:.0f})" for x, y in pairs)
            m = f"replicas {each} MB (private); everything under the Ray instance {mem['ray_instance_total']:.0f} MB"
        cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items())
        print(f"| {r['setup']} | {r['tokens_per_s']:.1f} | {r['ttft_median_s'] * 1000:.0f} ms | {r['errors']} | {cpu} "
              f"| {m} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
