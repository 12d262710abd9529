"""barellm beside llama-cpp-python and transformers: the same prompts, token counts and threads, interleaved.

    python bench/compare.py [MODEL] [-p 512] [-n 128] [-t 2] [-r 5] [--backends barellm,llama.cpp,transformers]

Runs go A B C A B C ... so a slow spell of a shared machine hits every backend alike; medians are compared.
Prefill: one forward over P random tokens on a fresh cache, only the last position's logits (what the first
token needs). Decode: N single-token forwards after a short prompt. Every backend gets the same token ids
(the same GGUF file, so the same vocabulary) and the same thread count.

The peers are optional and never installed by barellm: llama-cpp-python (`pip install llama-cpp-python`,
which compiles llama.cpp) and transformers (`pip install torch transformers`; float32, the GGUF dequantized at
load). A missing one is skipped with a message. Figures already measured on the reference machine are in the
project's benchmark notes (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SHORT_PROMPT = 8


class Backend:
    name = ""

    def prefill(self, tokens: list[int]) -> float:
        """Seconds for a fresh-cache forward over tokens that yields the last logits."""
        raise NotImplementedError

    def decode(self, prompt: list[int], tokens: list[int]) -> float:
        """Seconds for len(tokens) single-token forwards after prompt (prompt not timed)."""
        raise NotImplementedError


class Barellm(Backend):
    def __init__(self, path: Path, threads: int, n_ctx: int, engine: str = "native", activations: str = "q8x2") -> None:
        import barellm

        self.name = "barellm" if engine == "native" else f"barellm-{engine}"
        if activations != "q8x2":
            self.name += f"-{activations}"
        self.model = barellm.load(str(path), threads=threads, context=n_ctx, engine=engine, activations=activations)
        self.engine = self.model.engine

    def prefill(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        self.engine.forward(tokens, 0)
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], tokens: list[int]) -> float:
        self.engine.forward(prompt, 0)
        t0 = time.perf_counter()
        for i, t in enumerate(tokens):
            self.engine.forward([t], len(prompt) + i)
        return time.perf_counter() - t0


class LlamaCpp(Backend):
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, flash_attn: bool = False) -> None:
        from llama_cpp import Llama

        # its default n_batch (512) takes a 512-token prompt in one batch, as barellm does
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=max(512, n_ctx), logits_all=False, flash_attn=flash_attn, verbose=False)
        if flash_attn:
            self.name = "llama.cpp-fa"

    def prefill(self, tokens: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], tokens: list[int]) -> float:
        self.llm.reset()
        self.llm.eval(prompt)
        t0 = time.perf_counter()
        for t in tokens:
            self.llm.eval([t])
        return time.perf_counter() - t0


class Transformers(Backend):
    name = "transformers"

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          torch_dtype=torch.float32).eval()

    def _forward(self, ids: list[int], past: Any = None) -> Any:
        t = self.torch.tensor([ids], dtype=self.torch.long)
        # logits_to_keep=1: the last position's logits only, like the others
        return self.model(input_ids=t, past_key_values=past, use_cache=True, logits_to_keep=1)

    def prefill(self, tokens: list[int]) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self._forward(tokens)
            return time.perf_counter() - t0

    def decode(self, prompt: list[int], tokens: list[int]) -> float:
        with self.torch.inference_mode():
            past = self._forward(prompt).past_key_values
            t0 = time.perf_counter()
            for t in tokens:
                past = self._forward([t], past).past_key_values
            return time.perf_counter() - t0


MAKERS: dict[str, tuple[Callable[..., Backend], str]] = {
    "barellm": (lambda p, t, c: Barellm(p, t, c), "the native engine; build it with make build"),
    "barellm-q8": (lambda p, t, c: Barellm(p, t, c, activations="q8"), "the native engine, 8-bit activations"),
    "barellm-reference": (lambda p, t, c: Barellm(p, t, c, "reference"), "pip install -e ."),
    "llama.cpp": (lambda p, t, c: LlamaCpp(p, t, c), "pip install llama-cpp-python (compiles llama.cpp, ~13 min)"),
    "llama.cpp-fa": (lambda p, t, c: LlamaCpp(p, t, c, True), "pip install llama-cpp-python"),
    "transformers": (lambda p, t, c: Transformers(p, t, c), "pip install torch transformers"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="model name or path to a .gguf (default smollm2-135m)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens to prefill (default 512)")
    ap.add_argument("-n", "--n-gen", type=int, default=128, help="tokens to decode (default 128)")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads for every backend (default 2)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--backends", default="barellm,llama.cpp,transformers",
                    help=f"comma-separated, the first is the baseline of the ratios; known: {', '.join(MAKERS)}")
    args = ap.parse_args(argv)
    if args.n_prompt < 1 or args.n_gen < 1 or args.threads < 1 or args.repetitions < 1:
        ap.error("-p, -n, -t and -r must be at least 1")
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in names if b not in MAKERS]
    if unknown:
        ap.error(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(MAKERS)}")

    from barellm import hub
    from barellm.errors import BarellmError

    try:
        path = hub.resolve(args.model)
    except BarellmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_ctx = max(args.n_prompt, SHORT_PROMPT + args.n_gen) + 16
    backends: list[Backend] = []
    for name in names:
        make, how = MAKERS[name]
        t0 = time.perf_counter()
        try:
            backends.append(make(path, args.threads, n_ctx))
        except ImportError as e:
            print(f"skipping {name}: {e.name or e} is not installed ({how})", file=sys.stderr)
            continue
        print(f"loaded {name} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if not backends:
        print("error: no backend could be loaded", file=sys.stderr)
        return 1

    from barellm.cache import open_model as open_model_file

    vocab = len(open_model_file(path).metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(1234)
    prompt = rng.integers(0, vocab, args.n_prompt).tolist()
    short = rng.integers(0, vocab, SHORT_PROMPT).tolist()
    gen = rng.integers(0, vocab, args.n_gen).tolist()

    pp: dict[str, list[float]] = {b.name: [] for b in backends}
    tg: dict[str, list[float]] = {b.name: [] for b in backends}
    for b in backends:                      # warm-up, untimed
        b.prefill(prompt)
        b.decode(short, gen[:8])
    for r in range(args.repetitions):       # interleaved: A B C A B C ...
        for b in backends:
            pp[b.name].append(args.n_prompt / b.prefill(prompt))
            tg[b.name].append(args.n_gen / b.decode(short, gen))
        print(f"round {r + 1}/{args.repetitions}: " + ", ".join(
            f"{b.name} pp {pp[b.name][-1]:.1f} tg {tg[b.name][-1]:.1f}" for b in backends), file=sys.stderr)

    base = backends[0].name
    print(f"\n{path.name}, {args.threads} threads, {args.repetitions} interleaved rounds, medians (t/s)\n")
    print(f"| backend | pp{args.n_prompt} | tg{args.n_gen} | pp vs {base} | tg vs {base} |")
    print("|---|---:|---:|---:|---:|")
    mp, mt = statistics.median(pp[base]), statistics.median(tg[base])
    for b in backends:
        p, t = statistics.median(pp[b.name]), statistics.median(tg[b.name])
        print(f"| {b.name} | {p:.1f} | {t:.1f} | {p / mp:.2f}x | {t / mt:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
