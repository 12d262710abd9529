"""The path from a fresh process to the first token stays short: what a load and a greedy token leave alone.

Timings are for bench/startup.py (docs/benchmarks.md); here, what must not be imported or built on the way:
Jinja (a chat template that passed its load-time probe before is compiled by its first render), NumPy's
random module (greedy decoding draws nothing), the thread pool of a full checksum pass.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys
import barellm
m = barellm.load(sys.argv[1])
for _ in m.stream("The capital of France is", max_tokens=1, temperature=0):
    break
print(" ".join(n for n in sys.argv[2:] if n in sys.modules))
m.chat([{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0)  # the template compiled when used
print("jinja2" in sys.modules)
"""
LEFT_ALONE = ("jinja2", "barellm.text.sandbox", "numpy.random", "concurrent.futures")


def test_a_start_imports_only_what_the_first_token_needs(smollm_gguf):
    for _ in range(2):  # the first start may probe the template (and note that it passed); the second may not
        out = subprocess.run([sys.executable, "-c", CHILD, str(smollm_gguf), *LEFT_ALONE], capture_output=True,
                             text=True, check=True, timeout=120).stdout.splitlines()
    assert out == ["", "True"], out
