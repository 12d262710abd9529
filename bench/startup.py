"""Start-up time: process start to the first generated token, and model load time alone, each the median of
fresh processes, for the default model opened from its cached .blm and, for comparison, from the GGUF file.

    python bench/startup.py [MODEL] [-r 5] [--engines native,reference]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
t0 = time.perf_counter()
import barellm
from barellm.cache import open_model as open_model_file
from barellm import hub
path = hub.resolve(sys.argv[1])
t1 = time.perf_counter()
open_model_file(path).close()
t2 = time.perf_counter()
m = barellm.load(sys.argv[1], engine=sys.argv[2])
t3 = time.perf_counter()
for _ in m.stream("The capital of France is", max_tokens=1, temperature=0):
    break
t4 = time.perf_counter()
print(f"open={t2 - t1:.4f} load={t3 - t2:.4f} first={t4 - t3:.4f}", flush=True)
"""


def run_once(model: str, engine: str, env: dict[str, str]) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, engine], env=env, capture_output=True, text=True,
                         check=True).stdout
    total = time.perf_counter() - t0  # process start (fork/exec of the interpreter) to the first token
    fields = dict(kv.split("=") for kv in out.split())
    return {"total": total, **{k: float(v) for k, v in fields.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--engines", default="native,reference")
    args = ap.parse_args()
    # convert once (the cache), so every timed run finds it
    subprocess.run([sys.executable, "-c", "import sys, barellm.cache as c, barellm.hub as h; "
                    "c.open_model(h.resolve(sys.argv[1]))", args.model], check=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; median of {args.runs} fresh processes")
    print(f"{'engine':<10} {'source':<12} {'start->1st token':>17} {'load()':>8} {'open file':>10}")
    sources = (("cached .blm", {}), ("gguf direct", {"BARELLM_CONVERT": "0"}))
    for engine in args.engines.split(","):
        runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in sources}
        for _ in range(args.runs):  # interleaved, so a slow spell of a shared machine hits both alike
            for label, extra in sources:
                runs[label].append(run_once(args.model, engine, dict(os.environ, **extra)))
        for label, _ in sources:
            med = {k: statistics.median(r[k] for r in runs[label]) for k in runs[label][0]}
            print(f"{engine:<10} {label:<12} {med['total']:>15.2f} s {med['load']:>6.2f} s {med['open']:>8.3f} s")


if __name__ == "__main__":
    main()
