"""What the scale granularity of quantized activations costs in accuracy, apart from everything else.

    PYTHONPATH=src python bench/act_scales.py MODEL [--blocks 32,256] [--golden tests/data/MODEL.json]

The native K-quant kernels multiply quantized weights by activations quantized to int8 with one scale per 32 values
(llama.cpp's K-quant kernels take one per 256, its Q8_K). This runs the NumPy reference engine (weights
dequantized exactly, float32 arithmetic) with every matmul's input vector rounded to int8 in blocks of each
size first (scale d = amax / 127, x times 1 / d to the nearest integer, as the native quantizer), teacher-forced
over the golden prompts and their greedy continuations (or over a fixed text), and prints top-1 agreement
and the KL over the top-10 of the unrounded run, from each prompt's last row on: its mean, as the tests
take it, and its median, since one near-tie row can move the mean by half. Only the error of the
activations' rounding shows: the weights are the same in every run. Rows whose length is not a whole
number of blocks fall back to 32 (the K-quant kernels need whole 256-value super-blocks; such matrices
use other types).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import barellm

TEXT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def round_blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x with each run of `block` values along its last axis rounded to int8 times its block's scale."""
    n = x.shape[-1]
    if n % block:
        block = 32
    xb = x.reshape(-1, n // block, block).astype(np.float32)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.round(xb * inv), -127, 127)  # as the native quantizer: times 1 / d, to nearest even
    return (q * d).reshape(x.shape).astype(np.float32)


class Rounded:
    """A weight matrix W for which `x @ W` rounds x first (numpy defers `@` to __rmatmul__ here)."""

    __array_ufunc__ = None

    def __init__(self, w: np.ndarray, block: int) -> None:
        self.w, self.block = w, block

    @property
    def T(self) -> Rounded:  # noqa: N802 (numpy's name)
        return Rounded(self.w.T, self.block)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return round_blocks(x, self.block) @ self.w


def logits_of(engine, seqs: list[list[int]], block: int) -> list[np.ndarray]:
    """The engine's logits for each sequence, its matmuls' inputs rounded in blocks of `block` (0: not)."""
    layers = [(L, {k: getattr(L, k) for k in MATRICES}) for L in engine.layers]
    output = engine.output
    try:
        if block:
            for L, ws in layers:
                for k, w in ws.items():
                    setattr(L, k, Rounded(w, block))
            engine.output = Rounded(output, block)
        return [engine.forward(ids, 0, all_logits=True).astype(np.float64) for ids in seqs]
    finally:
        for L, ws in layers:
            for k, w in ws.items():
                setattr(L, k, w)
        engine.output = output


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = row - row.max()
    return z - np.log(np.exp(z).sum())


def compare(ref: list[np.ndarray], got: list[np.ndarray], starts: list[int]) -> tuple[float, float, float]:
    """(top-1 agreement, mean and median KL over the reference's top-10) over rows from each start on."""
    agree, kls = [], []
    for r, g, s in zip(ref, got, starts, strict=True):
        for row_r, row_g in zip(r[s:], g[s:], strict=True):
            top = np.argsort(row_r)[::-1][:10]
            lr, lg = log_softmax(row_r)[top], log_softmax(row_g)[top]
            agree.append(int(row_g.argmax()) == int(top[0]))
            kls.append(float((np.exp(lr) * (lr - lg)).sum()))
    return float(np.mean(agree)), float(np.mean(kls)), float(np.median(kls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model name or file")
    ap.add_argument("--blocks", default="32,256", help="activation block sizes to compare")
    ap.add_argument("--golden", default=None, help="golden JSON with prompt_ids and greedy_ids "
                    "(default: tests/data/MODEL.json when there is one, else a fixed text)")
    a = ap.parse_args()
    model = barellm.load(a.model, engine="reference")
    golden = Path(a.golden) if a.golden else Path(__file__).resolve().parents[1] / "tests" / "data" / f"{a.model}.json"
    if golden.is_file():
        results = json.loads(golden.read_text())["results"]
        seqs = [r["prompt_ids"] + r["greedy_ids"] for r in results]
        starts = [len(r["prompt_ids"]) - 1 for r in results]
    else:
        seqs, starts = [model.tokenize(TEXT)], [0]
    ref = logits_of(model.engine, seqs, 0)
    print(f"{a.model}: {len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens")
    print("| activation block | top-1 agreement | mean top-10 KL | median |")
    print("|---:|---:|---:|---:|")
    for block in (int(b) for b in a.blocks.split(",")):
        top1, kl, med = compare(ref, logits_of(model.engine, seqs, block), starts)
        print(f"| {block} | {top1:.2%} | {kl:.2e} | {med:.2e} |")


if __name__ == "__main__":
    main()
