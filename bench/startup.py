"""Start-up time: process start to the first generated token, and model load time alone, each the median of
fresh processes, for the default model opened from its cached .blm and, for comparison, from the GGUF file.

start->1st token runs from just before the interpreter is started to the first token (the process's exit is
not counted); load() is `barellm.load()` (with its imports); "open file" opens the model file once more in the
same process after the first token: the parse and the checks alone, without imports. Python's bytecode cache
matters: with PYTHONDONTWRITEBYTECODE=1 every start compiles barellm's modules again (run it without, once
first, as an installed package has its .pyc files).

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
import sys, time
t1 = time.perf_counter()
import barellm
m = barellm.load(sys.argv[1], engine=sys.argv[2])
t2 = time.perf_counter()
for _ in m.stream("The capital of France is", max_tokens=1, temperature=0):
    break
t3 = time.perf_counter()
# after the first token, so that it neither delays it nor warms anything for it
from barellm.store import hub
from barellm.store.converted import open_model as open_model_file
path = hub.resolve(sys.argv[1])
t4 = time.perf_counter()
open_model_file(path).close()
t5 = time.perf_counter()
print(f"imports={t1} first_at={t3} load={t2 - t1:.4f} first={t3 - t2:.4f} open={t5 - t4:.4f}", flush=True)
"""

def run_once(model: str, engine: str, env: dict[str, str]) -> dict[str, float]:
    # perf_counter is CLOCK_MONOTONIC, one clock for every process of the machine: the child reports when
    # its first token came, so the interpreter's exit (and the extra open after the token) are not counted
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, engine], env=env, capture_output=True, text=True,
                         check=True).stdout
    fields = {k: float(v) for k, v in (kv.split("=") for kv in out.split())}
    return {"total": fields.pop("first_at") - t0, "start": fields.pop("imports") - t0, **fields}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--engines", default="native,reference")
    args = ap.parse_args()
    # convert once (the cache), so every timed run finds it
    subprocess.run([sys.executable, "-c", "import sys, barellm.store.converted as c, barellm.store.hub as h; "
                    "c.open_model(h.resolve(sys.argv[1]))", args.model], check=True)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; median of {args.runs} fresh processes")
    print(f"{'engine':<10} {'source':<12} {'start->1st token':>17} {'interpreter':>12} {'load()':>8} "
          f"{'1st token':>10} {'open file':>10}")
    sources = (("cached .blm", {}), ("gguf direct", {"BARELLM_CONVERT": "0"}))
    for engine in args.engines.split(","):
        runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in sources}
        for _ in range(args.runs):  # interleaved, so a slow spell of a shared machine hits both alike
            for label, extra in sources:
                runs[label].append(run_once(args.model, engine, dict(os.environ, **extra)))
        for label, _ in sources:
            med = {k: statistics.median(r[k] for r in runs[label]) for k in runs[label][0]}
            print(f"{engine:<10} {label:<12} {med['total']:>15.3f} s {med['start']:>10.3f} s {med['load']:>6.3f} s "
                  f"{med['first']:>8.3f} s {med['open']:>8.3f} s")


if __name__ == "__main__":
    main()
