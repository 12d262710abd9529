"""What a JSON-schema constraint costs: decode tokens/s with and without it, and the time to compile schemas.

    PYTHONPATH=src python bench/structured.py [MODEL ...] [-r ROUNDS] [-n TOKENS] [-t THREADS]

For each model, ROUNDS rounds of three generations, interleaved and in turn first (free, constrained with
the masks computed in line, constrained with the masks computed on a worker thread beside the forward pass;
barellm picks the second when the engine's threads take every core, else the third), each of up to TOKENS
tokens from the same chat prompt; the end-of-generation tokens are banned (logit bias -100) so the free run
goes the whole way and a constrained one ends only when its JSON is complete (the grammar then allows
nothing else). Decode tokens/s
are each run's generated tokens over its decode time (prefill excluded); the medians are printed, with the
grammar's share of a token (the "grammar" phase: waiting for the mask and taking the token).

Then the schema compile times: the model's vocabulary built for llguidance (once per model), and each of the
test suite's JSON schemas compiled from nothing (the median of 5, with the compile cache cleared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "days": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
            "type": "object",
            "properties": {"day": {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday",
                                            "Sunday"]},
                           "sky": {"type": "string", "maxLength": 40},
                           "high_c": {"type": "integer", "minimum": -40, "maximum": 50},
                           "low_c": {"type": "integer", "minimum": -40, "maximum": 50}},
            "required": ["day", "sky", "high_c", "low_c"], "additionalProperties": False}},
    },
    "required": ["city", "days"], "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a six-day weather forecast for Lisbon as JSON."}]


def decode_rate(model: Any, ids: list[int], n: int, bias: dict[int, float], **kw: Any) -> tuple[float, int, float]:
    """(decode tokens/s, tokens, grammar ms per token) of one generation."""
    c = model.complete(ids, max_tokens=n, temperature=0, logit_bias=bias, **kw)
    tokens = len(c.token_ids)
    t = c.timings
    return tokens / c.decode_seconds, tokens, 1000 * t.seconds["grammar"] / max(t.tokens, 1)


def bench_model(name: str, rounds: int, n: int, threads: int | None) -> None:
    import barellm
    from barellm.generate import structured

    model = barellm.load(name, threads=threads)
    ids = model.chat_prompt(PROMPT)
    bias = {t: -100.0 for t in model.tokenizer.eog_ids}
    model.structured().json_schema(SCHEMA)   # build the vocabulary and compile once, outside the timing
    model.generate(ids, max_tokens=8, temperature=0)   # warm the caches

    real_guide = structured.Grammar.guide
    rates: dict[str, list[float]] = {"free": [], "schema, mask in line": [], "schema, mask on a thread": []}
    grammar_ms: dict[str, list[float]] = {"schema, mask in line": [], "schema, mask on a thread": []}
    counts: dict[str, list[int]] = {k: [] for k in rates}
    labels = list(rates)
    for r in range(rounds):
        for label in labels[r % 3:] + labels[:r % 3]:   # each variant takes each place in the order in turn
            kw: dict[str, Any] = {}
            if label != "free":
                kw["json_schema"] = SCHEMA
            thread = label.endswith("on a thread")
            structured.Grammar.guide = (   # type: ignore[method-assign]
                lambda self, background=True, thread=thread: real_guide(self, thread))
            try:
                rate, tokens, gms = decode_rate(model, ids, n, bias, **kw)
            finally:
                structured.Grammar.guide = real_guide   # type: ignore[method-assign]
            rates[label].append(rate)
            counts[label].append(tokens)
            if label in grammar_ms:
                grammar_ms[label].append(gms)
    free = statistics.median(rates["free"])
    default = "on a thread" if structured.spare_core(model.threads) else "in line"
    print(f"\n{name} ({model.config.n_vocab} tokens, {model.threads} threads: masks {default} by default), "
          f"{rounds} rounds of up to {n} tokens")
    for label, r in rates.items():
        med = statistics.median(r)
        extra = f", grammar {statistics.median(grammar_ms[label]):.3f} ms/token" if label in grammar_ms else ""
        print(f"  {label:24s} {med:7.1f} tok/s  ({med / free:5.1%} of free; {statistics.median(counts[label])} "
              f"tokens{extra})")


def bench_compile(name: str) -> None:
    import barellm
    from barellm.generate import structured

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_structured import SCHEMAS

    model = barellm.load(name)
    t0 = time.perf_counter()
    vocab = structured.Vocabulary(model.tokenizer, model.config.n_vocab)
    print(f"\n{name}: vocabulary for llguidance built in {1000 * (time.perf_counter() - t0):.0f} ms")
    times = []
    for label, _, schema in [*SCHEMAS, ("bench", "", SCHEMA)]:
        one = []
        for _ in range(5):
            vocab._cache.clear()
            t0 = time.perf_counter()
            vocab.json_schema(schema)
            one.append(time.perf_counter() - t0)
        times.append((statistics.median(one), label))
    ms = sorted(1000 * t for t, _ in times)
    print(f"  {len(times)} schemas compiled (and checked) in median {statistics.median(ms):.2f} ms, "
          f"max {ms[-1]:.2f} ms ({max(times)[1]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-n", "--tokens", type=int, default=160)
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    for name in args.models:
        bench_model(name, args.rounds, args.tokens, args.threads)
        bench_compile(name)



if __name__ == "__main__":
    main()
