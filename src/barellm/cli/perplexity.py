"""Perplexity over a text file, cut and scored the way llama.cpp's llama-perplexity does it.

The convention matters more than the code: figures are only comparable when computed the same way.
llama.cpp tokenizes the whole text once (applying the model's BOS rule), cuts it into non-overlapping
windows of n_ctx tokens (the tail that does not fill a window is dropped), puts BOS in the first slot
of every window when the model adds BOS, and scores only the second half of each window: logit rows
n_ctx/2 .. n_ctx-2 predicting tokens n_ctx/2+1 .. n_ctx-1. The first half only gives each scored token
some context, so the figure does not depend on how little context the first tokens of a window have.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from barellm.errors import InvalidRequest

CONVENTION = (
    "llama.cpp's llama-perplexity convention: the whole text is tokenized once with the model's BOS rule; "
    "non-overlapping windows of C tokens (the tail is dropped); when the model adds BOS, the first token of "
    "each window is replaced by BOS; only the second half of each window is scored (rows C/2..C-2 predicting "
    "tokens C/2+1..C-1, C/2-1 tokens per window). PPL = exp(mean NLL); the ± is llama.cpp's estimate, "
    "PPL * sqrt((mean(NLL^2) - mean(NLL)^2) / (N-1)) over the N scored tokens."
)


def windows(tokens: Sequence[int], n_ctx: int, bos_id: int | None = None) -> list[list[int]]:
    """The non-overlapping windows of n_ctx tokens; with bos_id, each window starts with it instead."""
    if n_ctx < 4:
        raise InvalidRequest(f"the window must hold at least 4 tokens, got {n_ctx}")
    out = []
    for c in range(len(tokens) // n_ctx):
        w = [int(t) for t in tokens[c * n_ctx:(c + 1) * n_ctx]]
        if bos_id is not None:
            w[0] = int(bos_id)
        out.append(w)
    return out


def scored_rows(n_ctx: int, full_window: bool = False) -> tuple[int, int]:
    """[first, end) of the logit rows scored in a window; row i predicts token i+1."""
    return (0 if full_window else n_ctx // 2), n_ctx - 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64 (the log-sum-exp of float32 logits loses digits otherwise)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def token_nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log p(target_i) under row i of logits [T, V]: float64 [T]."""
    logits = np.asarray(logits)
    t = np.asarray(targets, dtype=np.int64)
    if logits.ndim != 2 or logits.shape[0] != len(t):
        raise InvalidRequest(f"{logits.shape} logits do not match {len(t)} targets")
    x = logits.astype(np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    return lse - x[np.arange(len(t)), t]


def ppl_estimate(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    """(PPL, its uncertainty) from the sums of NLL and NLL^2 over count tokens, as llama.cpp reports it."""
    if count <= 0:
        raise InvalidRequest("no tokens were scored")
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if count > 1 and var > 0 else 0.0
    return ppl, err


@dataclass
class PerplexityResult:
    ppl: float
    uncertainty: float
    n_ctx: int
    n_chunks: int
    n_scored: int
    n_tokens: int                     # the whole text's tokens
    chunk_nll_sums: list[float] = field(default_factory=list)
    running_ppl: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def perplexity_of_logits(chunks: Sequence[Sequence[int]], logits_of: Callable[[list[int]], np.ndarray], *,
                         full_window: bool = False, n_tokens: int | None = None,
                         on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Scores windows with logits_of(window) -> float [n_ctx, V] (all rows); the arithmetic of perplexity()."""
    if not chunks:
        raise InvalidRequest("no window to score")
    n_ctx = len(chunks[0])
    first, end = scored_rows(n_ctx, full_window)
    nll_sum = nll2_sum = 0.0
    count = 0
    res = PerplexityResult(0.0, 0.0, n_ctx, len(chunks), 0, n_tokens if n_tokens is not None else n_ctx * len(chunks))
    for i, w in enumerate(chunks):
        logits = logits_of(list(w))
        nll = token_nll(logits[first:end], w[first + 1:end + 1])
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        res.chunk_nll_sums.append(float(nll.sum()))
        res.running_ppl.append(math.exp(nll_sum / count))
        if on_chunk:
            on_chunk(i, res.running_ppl[-1])
    res.ppl, res.uncertainty = ppl_estimate(nll_sum, nll2_sum, count)
    res.n_scored = count
    return res


def text_tokens(model: Any, text: str) -> list[int]:
    """The whole text's tokens with the model's BOS rule and no special-token parsing, as llama.cpp does."""
    return model.tokenize(text, add_special=True, parse_special=False)


def model_windows(model: Any, text: str, n_ctx: int, n_chunks: int | None = None) -> tuple[list[list[int]], int]:
    """(the windows llama.cpp would score, the text's token count)."""
    tokens = text_tokens(model, text)
    tok = model.tokenizer
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    ws = windows(tokens, n_ctx, bos)
    if not ws:
        raise InvalidRequest(f"the text has {len(tokens)} tokens, fewer than one window of {n_ctx}")
    if n_chunks is not None:
        ws = ws[:n_chunks]
    return ws, len(tokens)


def perplexity(model: Any, text: str, n_ctx: int = 512, *, n_chunks: int | None = None, full_window: bool = False,
               progress: bool = True) -> PerplexityResult:
    """Perplexity of model on text (llama.cpp's convention, see CONVENTION); model as from barellm.load()."""
    from barellm.progress import Progress

    if n_ctx > model.n_ctx:
        raise InvalidRequest(f"a window of {n_ctx} does not fit the model's context of {model.n_ctx}")
    ws, n_tokens = model_windows(model, text, n_ctx, n_chunks)
    with Progress(len(ws), f"perplexity ({len(ws)} x {n_ctx})", enabled=progress, unit="chunks") as bar:
        def logits_of(w: list[int]) -> np.ndarray:
            return model.engine.forward(w, 0, all_logits=True)

        try:
            return perplexity_of_logits(ws, logits_of, full_window=full_window, n_tokens=n_tokens,
                                        on_chunk=lambda i, p: bar.advance(1))
        finally:
            model.reset()   # the KV cache now holds the last window, not what the Model last fed


# --- the command ---------------------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, default_ctx: int = 512) -> None:
    p.add_argument("-c", "--ctx-size", type=int, default=default_ctx, metavar="C",
                   help=f"window size in tokens (default {default_ctx})")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: physical cores)")
    p.add_argument("--engine", choices=["native", "reference"], default="native",
                   help="native: the C core (default); reference: the NumPy float32 forward (slow, exact)")
    from barellm.options import add_activations_arg

    add_activations_arg(p)
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="score only the first N windows")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a model on a text file (llama.cpp's convention)",
                       description="Perplexity of MODEL on TEXTFILE. " + CONVENTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="+", metavar="[MODEL] TEXTFILE",
                   help="model name or path (default smollm2-135m), then the text file")
    add_engine_args(p)
    p.add_argument("--full-window", action="store_true",
                   help="score every row of each window (rows 0..C-2), not llama.cpp's second half")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_perplexity)


def model_and_file(words: list[str], what: str) -> tuple[str | None, Path]:
    if len(words) > 2:
        raise InvalidRequest(f"expected [MODEL] {what}, got {len(words)} arguments")
    model, path = (words if len(words) == 2 else (None, words[0]))
    p = Path(path)
    if not p.is_file():
        raise InvalidRequest(f"{path}: no such file")
    return model, p


def check_window(n_ctx: int, n_chunks: int | None) -> None:
    if n_ctx < 16:
        raise InvalidRequest(f"-c must be at least 16, got {n_ctx}")
    if n_chunks is not None and n_chunks < 1:
        raise InvalidRequest(f"--chunks must be at least 1, got {n_chunks}")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise InvalidRequest(f"{path}: cannot read: {e.strerror}") from e


def cmd_perplexity(args: argparse.Namespace) -> int:
    import json

    import barellm

    name, path = model_and_file(args.words, "TEXTFILE")
    check_window(args.ctx_size, args.chunks)
    text = read_text(path)
    model = barellm.load(name, threads=args.threads, context=args.ctx_size, engine=args.engine,
                         activations=args.activations, kv_type=args.kv_type)
    r = perplexity(model, text, args.ctx_size, n_chunks=args.chunks, full_window=args.full_window,
                   progress=not args.quiet)
    if args.json:
        print(json.dumps({"model": model.name, "engine": args.engine, "file": str(path), **r.as_dict()}))
        return 0
    print(f"{model.name}, engine {args.engine}: {r.n_tokens} tokens, {r.n_chunks} windows of {r.n_ctx}, "
          f"{r.n_scored} scored", file=sys.stderr)
    print("".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(r.running_ppl)), file=sys.stderr)
    print(f"PPL = {r.ppl:.4f} ± {r.uncertainty:.4f}")
    return 0
