"""Choosing the next token from logits: logit bias, penalties, then top-k, top-p, min-p, temperature, a seeded draw.

The order follows llama.cpp's default chain so the same settings mean the same thing in both.
temperature <= 0 is greedy: the argmax after bias and penalties (the lowest id wins a tie), with no randomness.
An optional allowed-token bitmask (uint32 words, bit i of word i // 32 set: token i may be chosen; the form
grammar engines such as llguidance produce) restricts every step to the tokens it allows.

The chain runs in the native core (_native/sample.c): one pass over the row keeps the best candidates in a
small heap, so no step sorts the vocabulary or makes several passes over it in NumPy. `sample_reference`
below is the same chain in NumPy: slow, kept as the oracle the native one is tested against. A draw maps
one uniform number from the seeded generator through the cumulative distribution of the candidates sorted
best first, so the same seed gives the same tokens in both.

Two rules differ from the first NumPy sampler, so a seeded run can differ from one made with it: the
penalties look at the last repeat_last_n tokens of the whole history (it took fewer when the history was
between repeat_last_n / 2 and repeat_last_n long), and when top-k cuts through tied logits the lowest ids
are kept (it kept whichever its partition left). With top-k off, the normalizing sum over the vocabulary
is taken with float exponentials on the AVX2 path, so a draw within ~1e-7 of a boundary can fall the
other way than the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from barellm.errors import InvalidRequest

try:
    from barellm import _native
except ImportError:  # the core is not built: the NumPy reference does the work
    _native = None

MAX_LOGIT_BIAS = 100.0   # OpenAI's range for a bias: -100 bans a token, 100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40              # 0 = off
    top_p: float = 0.95          # 1 = off
    min_p: float = 0.05          # 0 = off
    repeat_penalty: float = 1.0  # 1 = off; > 1 makes recent tokens less likely (llama.cpp's rule)
    repeat_last_n: int = 64      # how many recent tokens the penalties look at (-1 = all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # {token id: added to its logit}

    def validated(self) -> SamplingParams:
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequest(what)

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                  f"{name} must be a finite number, got {value!r}")
        check(0 <= self.temperature <= 100, f"temperature must be in [0, 100], got {self.temperature}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(0 < self.repeat_penalty <= 10, f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(isinstance(self.repeat_last_n, int) and self.repeat_last_n >= -1,
              f"repeat_last_n must be an integer >= -1, got {self.repeat_last_n!r}")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              f"seed must be an integer, got {self.seed!r}")
        if self.logit_bias is not None:
            check(isinstance(self.logit_bias, Mapping), "logit_bias must be a mapping {token id: bias}")
            for k, v in self.logit_bias.items():
                check(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0,
                      f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
                check(isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
                      and math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS,
                      f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}")
        return self

    def with_(self, **changes: Any) -> SamplingParams:
        """A copy with the given fields changed, ignoring those set to None (except seed)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repeat_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the best alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def allowed_mask(token_ids: Sequence[int], n_vocab: int) -> np.ndarray:
    """The bitmask that allows exactly token_ids: uint32 [ceil(n_vocab / 32)], bit i % 32 of word i // 32."""
    bits = np.zeros(((n_vocab + 31) // 32) * 32, dtype=bool)
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
        raise InvalidRequest(f"allowed token ids must be in 0..{n_vocab - 1}")
    bits[ids] = True
    return np.packbits(bits.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).reshape(-1)


def mask_bits(allowed: np.ndarray, n_vocab: int) -> np.ndarray:
    """The boolean [n_vocab] form of an allowed-token bitmask."""
    words = np.asarray(allowed, dtype=np.uint32)
    return ((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool).reshape(-1)[:n_vocab]


# --- the NumPy reference (the oracle) --------------------------------------------------------------

def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition (multiplicative, llama.cpp style) and presence/frequency (additive, OpenAI style)."""
    if not len(history) or (p.repeat_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0):
        return logits
    # the last repeat_last_n tokens, or all of a shorter history
    last = p.repeat_last_n
    recent = history if last < 0 else history[max(0, len(history) - last):] if last else []
    if len(recent) == 0:
        return logits
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    ids_ok = (ids >= 0) & (ids < logits.shape[0])
    ids, counts = ids[ids_ok], counts[ids_ok]
    out = logits.copy()
    vals = out[ids]
    if p.repeat_penalty != 1:
        vals = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - counts * np.float32(p.frequency_penalty) - np.float32(p.presence_penalty)
    out[ids] = vals
    return out


def apply_bias(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """logits + logit_bias (a copy when there is a bias)."""
    if not p.logit_bias:
        return logits
    out = logits.copy()
    ids = np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias))
    out[ids] += np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
    return out


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The ids that survive top-k, top-p and min-p, and their probabilities after temperature.

    Filters are applied in llama.cpp's order (top-k, top-p, min-p on the untempered distribution,
    then temperature), so a given setting keeps the same ids in both engines.
    """
    n = logits.shape[0]
    k = p.top_k if 0 < p.top_k < n else n
    if k < n:
        # the k best, and on a tie at the k-th value the lowest ids (as the native heap keeps them)
        kth = logits[np.argpartition(-logits, k - 1)[k - 1]]
        above = np.flatnonzero(logits > kth)
        ids = np.concatenate([above, np.flatnonzero(logits == kth)[:k - len(above)]])
    else:
        ids = np.arange(n)
    # Sort the survivors best first; ties by id so the order never depends on the partition.
    order = np.lexsort((ids, -logits[ids]))
    ids = ids[order]
    z = logits[ids].astype(np.float64)
    probs = np.exp(z - z[0])
    probs /= probs.sum()
    keep = len(ids)
    if p.top_p < 1:
        # keep the smallest prefix whose mass reaches top_p (at least one token)
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0:
        keep = min(keep, max(1, int(np.count_nonzero(probs[:keep] >= p.min_p * probs[0]))))
    ids, z = ids[:keep], z[:keep]
    t = max(p.temperature, 1e-6)
    probs = np.exp((z - z[0]) / t)
    probs /= probs.sum()
    return ids, probs


def reference_candidates(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = (),
                         allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The whole chain up to the draw: mask, bias, penalties, then `candidates` over the allowed tokens
    whose logit is a number above -inf (the others can never be drawn)."""
    x = apply_penalties(apply_bias(np.asarray(logits, np.float32).reshape(-1), p), list(history), p)
    ok = ~np.isnan(x)
    if allowed is not None:
        ok &= mask_bits(allowed, x.shape[0])
    if p.greedy:
        if not ok.any():
            return np.zeros(0, np.int64), np.zeros(0)
        xm = np.where(ok, x, -np.inf)
        i = int(np.argmax(xm))
        if xm[i] == -np.inf:
            i = int(np.flatnonzero(ok)[0])
        return np.array([i]), np.ones(1)
    ok &= x > -np.inf
    where = np.flatnonzero(ok)
    if where.size == 0:
        return where, np.zeros(0)
    ids, probs = candidates(x[where], p) if where.size < x.shape[0] else candidates(x, p)
    return (where[ids] if where.size < x.shape[0] else ids), probs


def sample_reference(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = (),
                     allowed: np.ndarray | None = None, u: float = 0.0) -> int:
    """The next token by the NumPy chain; u is the uniform draw in [0, 1). -1 when nothing is allowed."""
    ids, probs = reference_candidates(logits, p, history, allowed)
    if len(ids) == 0:
        return -1
    if p.greedy:
        return int(ids[0])
    return int(ids[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(ids) - 1)])


def logprobs_reference(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """Log-softmax of the row in float64: the chosen token's value and the k best, best first."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = float(z.max())
    lse = m + float(np.log(np.exp(z - m).sum()))
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, z.shape[0])
        ids = np.argpartition(-z, k - 1)[:k]
        ids = ids[np.lexsort((ids, -z[ids]))]   # best first, ties by id: independent of the partition
        top = [(int(i), float(z[i] - lse)) for i in ids]
    return TokenLogprob(token, float(z[token] - lse), top)


# --- the sampler a generation uses -----------------------------------------------------------------

def token_logprobs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability under the raw logits (before bias and penalties) and the k best."""
    row = np.asarray(logits, dtype=np.float32).reshape(-1)
    n = row.shape[0]
    k = min(max(int(k), 0), n)
    if _native is None:
        return logprobs_reference(row, token, k)
    if not row.flags.c_contiguous:
        row = np.ascontiguousarray(row)
    lp, top = _native.logprobs(row, n, token, k)
    return TokenLogprob(token, lp, top)


class Sampler:
    """Draws tokens for one generation; the same seed gives the same draws.

    The sampler keeps the generation's history (what the penalties look at): `accept(token)` appends one
    token, `sample(row)` reads the last repeat_last_n of them. Passing `history=` to sample() uses that
    sequence instead, for a one-off draw.
    """

    def __init__(self, params: SamplingParams, history: Sequence[int] = (), n_vocab: int | None = None) -> None:
        self.params = params.validated()
        self._rng: np.random.Generator | None = None
        self._hist = np.empty(max(64, 2 * len(history)), np.int32)
        self._len = 0
        self._native: Any = None
        self._n_vocab = 0
        self.feed(history)
        if n_vocab is not None:
            self._prepare(n_vocab)

    def feed(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if self._len + n > self._hist.shape[0]:
            grown = np.empty(max(2 * self._hist.shape[0], self._len + n), np.int32)
            grown[:self._len] = self._hist[:self._len]
            self._hist = grown
        self._hist[self._len:self._len + n] = tokens
        self._len += n

    def accept(self, token: int) -> None:
        """Appends a generated token to the history."""
        if self._len == self._hist.shape[0]:
            self.feed((token,))
            return
        self._hist[self._len] = token
        self._len += 1

    @property
    def rng(self) -> np.random.Generator:
        """The generation's random stream, made at its first draw: greedy decoding never makes one (nor
        imports numpy.random, a few milliseconds of start-up)."""
        if self._rng is None:
            self._rng = np.random.default_rng(self.params.seed)
        return self._rng

    @property
    def history(self) -> np.ndarray:
        return self._hist[:self._len]

    def _prepare(self, n_vocab: int) -> None:
        p = self.params
        if p.logit_bias:
            bad = [k for k in p.logit_bias if not 0 <= k < n_vocab]
            if bad:
                raise InvalidRequest(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        self._n_vocab = n_vocab
        if _native is None:
            return
        ids = vals = None
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), np.int32, len(p.logit_bias))
            vals = np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias))
        # a top_k past the vocabulary keeps every token, as the whole vocabulary does (and fits a C int)
        self._native = _native.Sampler(n_vocab, float(p.temperature), min(int(p.top_k), n_vocab), float(p.top_p),
                                       float(p.min_p), float(p.repeat_penalty), float(p.presence_penalty),
                                       float(p.frequency_penalty), ids, vals)

    def _window(self, n: int) -> tuple[int, int]:
        last = self.params.repeat_last_n
        if not self.params.penalized or last == 0:
            return 0, 0
        return (0 if last < 0 else max(0, n - last)), n

    def sample(self, logits: np.ndarray, history: Sequence[int] | None = None,
               allowed: np.ndarray | None = None) -> int:
        """The next token after logits (float32 [n_vocab]; left unchanged). allowed: an optional bitmask."""
        row = logits
        if not (isinstance(row, np.ndarray) and row.dtype == np.float32 and row.ndim == 1
                and row.flags.c_contiguous and row.flags.writeable):
            row = np.array(logits, dtype=np.float32).reshape(-1)
        if row.shape[0] != self._n_vocab:
            self._prepare(row.shape[0])
        if history is None:
            hist = self._hist
            start, end = self._window(self._len)
        else:
            hist = np.asarray(history, dtype=np.int32).reshape(-1)
            start, end = self._window(hist.shape[0])
        u = 0.0 if self.params.greedy else self.rng.random()
        if self._native is not None:
            if allowed is not None:
                allowed = np.ascontiguousarray(allowed, dtype=np.uint32)
            tok = self._native.sample(row, u, hist, start, end, allowed)
        else:
            # the reference takes the whole history and cuts the window itself
            tok = sample_reference(row, self.params, hist[:end], allowed, u)
        if tok < 0:
            raise InvalidRequest("no token can be chosen: the allowed-token mask allows none of the vocabulary")
        return tok
