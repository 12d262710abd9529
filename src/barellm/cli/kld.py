"""How far an engine's next-token distributions are from the float32 reference's, on the same tokens.

Two modes:
  text    windows of a text file cut as llama-perplexity cuts them (see tools/perplexity.py); for every
          scored row, KL(reference || engine) over the whole vocabulary and whether the top-1 tokens agree.
          The reference is the NumPy float32 forward run now, or log-probabilities saved earlier (--save).
  golden  teacher-forced against golden figures of an independent float32 implementation (the prompt plus
          its golden greedy continuation is fed; each row is compared with the golden row). The golden file
          holds only the top-10 logits and the log-sum-exp of each row, so the KL is taken over 11 outcomes:
          the 10 golden tokens and "any other token". That is a lower bound of the full KL (merging outcomes
          never increases it) that is still a true divergence (never negative, zero only on agreement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from barellm.cli.perplexity import (
    CONVENTION,
    add_engine_args,
    check_window,
    log_softmax,
    model_windows,
    ppl_estimate,
    read_text,
    scored_rows,
)
from barellm.errors import InvalidRequest


def kl_from_logprobs(base_lp: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row from log-probabilities [T, V] (float64 [T]); rows where P puts mass Q lacks are inf."""
    base_lp = np.asarray(base_lp, dtype=np.float64)
    lp = np.asarray(lp, dtype=np.float64)
    p = np.exp(base_lp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (base_lp - lp), 0.0)
    # tiny negative sums are rounding of a KL that is zero
    return np.maximum(terms.sum(axis=-1), 0.0)


def kl_divergence(base_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(base) || softmax(logits)) per row of [T, V] logits, float64 [T]."""
    return kl_from_logprobs(log_softmax(base_logits), log_softmax(logits))


def topk_kl(golden_ids: Sequence[int], golden_logits: Sequence[float], golden_lse: float,
            logits: np.ndarray) -> float:
    """KL(golden || engine) over the golden top-k tokens plus one outcome for all the others.

    golden_logits are the golden row's logits at golden_ids and golden_lse the log-sum-exp of its whole row;
    logits is the engine's full row [V]."""
    lp_engine = log_softmax(np.asarray(logits)[None, :])[0]
    ids = np.asarray(golden_ids, dtype=np.int64)
    p = np.exp(np.asarray(golden_logits, dtype=np.float64) - golden_lse)
    q = np.exp(lp_engine[ids])
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 0.0)
    kl = float(np.sum(p * (np.log(p) - np.log(q))))
    if p_rest > 0:
        kl += p_rest * (np.log(p_rest) - np.log(max(q_rest, 1e-300)))
    return max(kl, 0.0)


@dataclass
class KLStats:
    n: int
    mean: float
    mean_err: float       # standard error of the mean
    median: float
    p99: float
    max: float
    top1: float           # % of rows whose top-1 tokens agree
    top1_err: float

    @staticmethod
    def of(kl: Sequence[float], agree: Sequence[bool]) -> KLStats:
        k = np.asarray(kl, dtype=np.float64)
        a = np.asarray(agree, dtype=np.float64)
        if len(k) == 0:
            raise InvalidRequest("no rows were compared")
        n = len(k)
        se = float(k.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
        top1 = float(a.mean())
        top1_se = float(np.sqrt(top1 * (1 - top1) / (n - 1))) if n > 1 else 0.0
        return KLStats(n, float(k.mean()), se, float(np.median(k)), float(np.percentile(k, 99)), float(k.max()),
                       100 * top1, 100 * top1_se)

    def lines(self) -> list[str]:
        return [
            f"rows compared   {self.n}",
            f"mean KL         {self.mean:.6g} ± {self.mean_err:.3g}",
            f"median KL       {self.median:.6g}",
            f"99th pct KL     {self.p99:.6g}",
            f"max KL          {self.max:.6g}",
            f"top-1 agreement {self.top1:.3f} ± {self.top1_err:.3f} %",
        ]


@dataclass
class KLDResult:
    stats: KLStats
    ppl_base: float
    ppl: float
    n_ctx: int = 0
    n_chunks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kl": self.stats.__dict__, "ppl_base": self.ppl_base, "ppl": self.ppl, "n_ctx": self.n_ctx,
                "n_chunks": self.n_chunks, **self.extra}


def compare_windows(chunks: Sequence[Sequence[int]], base_of: Callable[[int, list[int]], np.ndarray],
                    logits_of: Callable[[list[int]], np.ndarray], *, full_window: bool = False,
                    on_chunk: Callable[[int, np.ndarray], None] | None = None,
                    base_top1_of: Callable[[int], np.ndarray] | None = None) -> KLDResult:
    """KL and top-1 agreement over the scored rows of each window.

    base_of(i, window) gives the reference log-probabilities of window i's scored rows; logits_of(window) the
    engine's logits for all rows. on_chunk(i, base_lp) sees each window's reference log-probabilities.
    base_top1_of(i), when given, is the reference's top-1 per row (saved exactly; float16 log-probabilities
    can tie where the float32 ones did not)."""
    n_ctx = len(chunks[0])
    first, end = scored_rows(n_ctx, full_window)
    kls: list[np.ndarray] = []
    agree: list[np.ndarray] = []
    nll_b = nll2_b = nll = nll2 = 0.0
    for i, w in enumerate(chunks):
        base_lp = np.asarray(base_of(i, list(w)), dtype=np.float64)
        lp = log_softmax(logits_of(list(w))[first:end])
        if base_lp.shape != lp.shape:
            raise InvalidRequest(f"reference rows {base_lp.shape} do not match the engine's {lp.shape}")
        kls.append(kl_from_logprobs(base_lp, lp))
        top1 = base_top1_of(i) if base_top1_of else base_lp.argmax(axis=1)
        agree.append(np.asarray(top1) == lp.argmax(axis=1))
        tgt = np.asarray(w[first + 1:end + 1])
        rows = np.arange(len(tgt))
        vb, v = -base_lp[rows, tgt], -lp[rows, tgt]
        nll_b += vb.sum()
        nll2_b += (vb * vb).sum()
        nll += v.sum()
        nll2 += (v * v).sum()
        if on_chunk:
            on_chunk(i, base_lp)
    count = sum(len(k) for k in kls)
    stats = KLStats.of(np.concatenate(kls), np.concatenate(agree))
    return KLDResult(stats, ppl_estimate(nll_b, nll2_b, count)[0], ppl_estimate(nll, nll2, count)[0], n_ctx,
                     len(chunks))


# --- saved reference log-probabilities ------------------------------------------------------------


class SavedReference:
    """Reference log-probabilities saved by `kld --save`: tokens [n_chunks, n_ctx], the first scored row,
    logprobs float16 [n_chunks, rows, V] and top1 [n_chunks, rows]. float16 log-probabilities are precise
    where the probability mass is (near 0) and coarse only in the far tail, which weighs next to nothing in
    KL(reference || engine); the top-1 ids are kept exactly, since rounding can tie near-equal logits."""

    def __init__(self, path: Path) -> None:
        try:
            self._z = np.load(path, allow_pickle=False)
            self.tokens = np.asarray(self._z["tokens"])
            self.first = int(self._z["first"])
            self.logprobs = self._z["logprobs"]
            self.top1 = np.asarray(self._z["top1"])
        except (OSError, KeyError, ValueError) as e:
            raise InvalidRequest(f"{path}: not a saved reference from `barellm kld --save` ({e})") from e
        if self.tokens.ndim != 2 or self.logprobs.ndim != 3 or self.logprobs.shape[0] != self.tokens.shape[0]:
            raise InvalidRequest(f"{path}: inconsistent shapes {self.tokens.shape} and {self.logprobs.shape}")


def save_reference(path: Path, chunks: Sequence[Sequence[int]], first: int, logprobs: np.ndarray,
                   top1: np.ndarray, model_name: str) -> None:
    try:
        np.savez(path, tokens=np.asarray(chunks, dtype=np.int32), first=np.int64(first), logprobs=logprobs,
                 top1=np.asarray(top1, dtype=np.int32), model=np.str_(model_name))
    except OSError as e:
        raise InvalidRequest(f"{path}: cannot write: {e.strerror}") from e


# --- golden mode ----------------------------------------------------------------------------------


def golden_cases(path: Path, model_file: str) -> list[dict[str, Any]]:
    """The golden cases for a model file from a golden_logits.json-style file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        models = data["models"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"{path}: not a golden logits file ({e})") from e
    if model_file not in models:
        raise InvalidRequest(f"{path} has no figures for {model_file} (it has: {', '.join(models)})")
    return models[model_file]["results"]


@dataclass
class GoldenResult:
    stats: KLStats
    per_case: list[dict[str, Any]]


def compare_golden(cases: Sequence[dict[str, Any]], logits_of: Callable[[list[int]], np.ndarray]) -> GoldenResult:
    """Teacher-forced comparison: feed prompt + golden greedy ids, compare every row with the golden row."""
    kls: list[float] = []
    agree: list[bool] = []
    per_case = []
    for case in cases:
        ids = [int(t) for t in case["prompt_ids"]] + [int(t) for t in case["greedy_ids"]]
        logits = np.asarray(logits_of(ids))
        n = min(len(case["top10_ids"]), logits.shape[0])
        ck, ca = [], []
        for i in range(n):
            ck.append(topk_kl(case["top10_ids"][i], case["top10_logits"][i], case["logsumexp"][i], logits[i]))
            ca.append(int(np.argmax(logits[i])) == int(case["top10_ids"][i][0]))
        kls += ck
        agree += ca
        per_case.append({"label": case.get("label", ""), "rows": n, "mean_kl": float(np.mean(ck)),
                         "top1": 100 * float(np.mean(ca))})
    return GoldenResult(KLStats.of(kls, agree), per_case)


# --- the command ---------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kld", help="KL divergence and top-1 agreement of an engine against the float32 reference",
                       description="Compares MODEL's next-token distributions from --engine with the NumPy float32 "
                                   "reference on the windows of TEXTFILE: KL(reference || engine) over the whole "
                                   "vocabulary (mean, median, 99th percentile, max) and top-1 agreement. Windows "
                                   "and scored rows follow " + CONVENTION + " With --golden FILE.json (no "
                                   "TEXTFILE), compares teacher-forced with golden figures instead: KL over the "
                                   "golden top-10 plus the rest.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="*", metavar="[MODEL] [TEXTFILE]",
                   help="model name or path (default smollm2-135m), then the text file (not with --golden)")
    add_engine_args(p)
    p.add_argument("--base", default="reference", metavar="reference|FILE.npz",
                   help="the reference: 'reference' runs the NumPy forward now (default); a file from --save "
                        "reuses its tokens and log-probabilities")
    p.add_argument("--save", default=None, metavar="FILE.npz",
                   help="save the reference log-probabilities (float16; ~2 x rows x vocab bytes) for later --base")
    p.add_argument("--golden", default=None, metavar="FILE.json",
                   help="teacher-forced comparison with golden figures (e.g. tests/data/golden_logits.json)")
    p.add_argument("--full-window", action="store_true", help="compare every row of each window, not the second half")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_kld)


def _reference_engine(model: Any) -> Any:
    if model.engine_name == "reference":
        return model.engine
    from barellm.arch import reference_engine

    return reference_engine(model.config, model.source, model.n_ctx)


def cmd_kld(args: argparse.Namespace) -> int:
    import barellm
    from barellm.progress import Progress

    check_window(args.ctx_size, args.chunks)
    if args.golden:
        if len(args.words) > 1:
            raise InvalidRequest("with --golden, kld takes only [MODEL]")
        golden = Path(args.golden)
        if not golden.is_file():
            raise InvalidRequest(f"{golden}: no such file")
        model = barellm.load(args.words[0] if args.words else None, threads=args.threads, engine=args.engine,
                             activations=args.activations, kv_type=args.kv_type)
        cases = golden_cases(golden, model.path.name)
        r = compare_golden(cases, lambda ids: model.logits(ids))
        if args.json:
            print(json.dumps({"model": model.name, "engine": args.engine, "golden": str(golden),
                              "kl_top10": r.stats.__dict__, "cases": r.per_case}))
            return 0
        print(f"{model.name}, engine {args.engine}, teacher-forced against {golden} "
              f"({len(cases)} prompts; KL over the golden top-10 plus the rest)")
        for c in r.per_case:
            print(f"  {c['label']:<12} rows {c['rows']:>3}  mean KL {c['mean_kl']:<10.4g}  top-1 {c['top1']:.1f} %")
        print("\n".join(r.stats.lines()))
        return 0

    if not args.words or len(args.words) > 2:
        raise InvalidRequest("kld takes [MODEL] TEXTFILE (or [MODEL] --golden FILE.json)")
    name, path = (args.words if len(args.words) == 2 else (None, args.words[0]))
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"{path}: no such file")
    saved = None
    if args.base != "reference":
        if args.save:
            raise InvalidRequest("--save writes the reference; it goes with --base reference")
        if not Path(args.base).is_file():
            raise InvalidRequest(f"--base must be 'reference' or a saved .npz file; {args.base}: no such file")
        saved = SavedReference(Path(args.base))
    if args.save and not Path(args.save).resolve().parent.is_dir():
        raise InvalidRequest(f"--save {args.save}: no such directory")
    text = read_text(path)
    n_ctx = args.ctx_size if saved is None else int(saved.tokens.shape[1])
    model = barellm.load(name, threads=args.threads, context=n_ctx, engine=args.engine,
                         activations=args.activations, kv_type=args.kv_type)
    first, end = scored_rows(n_ctx, args.full_window)

    if saved is not None:
        if saved.first != first:
            raise InvalidRequest(f"{args.base} holds rows from {saved.first}; this comparison scores from {first} "
                                 "(--full-window must match the saved run)")
        if saved.logprobs.shape[2] != model.config.n_vocab:
            raise InvalidRequest(f"{args.base} is for a vocabulary of {saved.logprobs.shape[2]}, "
                                 f"the model's is {model.config.n_vocab}")
        chunks = [list(map(int, row)) for row in saved.tokens][: args.chunks]

        def base_of(i: int, w: list[int]) -> np.ndarray:
            # renormalized: rounding then shifts the KL only at second order (a first-order bias otherwise)
            return log_softmax(np.asarray(saved.logprobs[i], dtype=np.float64))
    else:
        chunks, _ = model_windows(model, text, n_ctx, args.chunks)
        ref = _reference_engine(model)

        def base_of(i: int, w: list[int]) -> np.ndarray:
            return log_softmax(ref.forward(w, 0, all_logits=True)[first:end])

    store = None
    tmp_name = None
    top1 = np.zeros((len(chunks), end - first), np.int32)
    if args.save:
        # collected on disk: a full run is hundreds of MB
        fd, tmp_name = tempfile.mkstemp(suffix=".npy", dir=Path(args.save).resolve().parent)
        os.close(fd)
        store = np.lib.format.open_memmap(tmp_name, mode="w+", dtype=np.float16,
                                          shape=(len(chunks), end - first, model.config.n_vocab))

    try:
        with Progress(len(chunks), f"kld ({len(chunks)} x {n_ctx})", enabled=not args.quiet, unit="chunks") as bar:
            def on_chunk(i: int, base_lp: np.ndarray) -> None:
                if store is not None:
                    store[i] = base_lp.astype(np.float16)
                    top1[i] = base_lp.argmax(axis=1)
                bar.advance(1)

            r = compare_windows(chunks, base_of, lambda w: model.engine.forward(w, 0, all_logits=True),
                                full_window=args.full_window, on_chunk=on_chunk,
                                base_top1_of=(lambda i: saved.top1[i]) if saved is not None else None)
        if store is not None:
            store.flush()
            save_reference(Path(args.save), chunks, first, store, top1, model.path.name)
    finally:
        model.reset()
        if tmp_name:
            del store
            os.unlink(tmp_name)

    if args.json:
        print(json.dumps({"model": model.name, "engine": args.engine, "file": str(path),
                          "base": args.base, **r.as_dict()}))
        return 0
    print(f"{model.name}, engine {args.engine} against {args.base}: {r.n_chunks} windows of {r.n_ctx}",
          file=sys.stderr)
    print("\n".join(r.stats.lines()))
    print(f"PPL reference   {r.ppl_base:.4f}")
    print(f"PPL engine      {r.ppl:.4f} ({100 * (r.ppl / r.ppl_base - 1):+.3f} %)")
    return 0
