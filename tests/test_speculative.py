"""Speculative decoding (generate/speculative/): drafted tokens checked in one pass leave the output exactly what
plain decoding gives, greedy or sampled, with penalties and constraints; the KV cache after a rejection is
exact; the drafters and the controller that decides when drafting pays; a draft model of another vocabulary
is refused; the server's scheduler, metrics, request field and the command line."""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import barellm
from barellm.errors import InvalidRequest
from barellm.generate.sampling import SamplingParams
from barellm.generate.speculative import Lookup, check_vocabulary, speculation
from barellm.generate.speculative.control import Acceptance, CostTable, choose
from barellm.generate.timings import Timings

from tiny_model import write_tiny_llama

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5, 6, 7,",
    "Once upon a time, there was a little",
    "Repeat after me: the red fox jumps over the blue fence. The red fox jumps over the blue fence. The red",
    "<html>\n<body>\n<ul>\n<li>one</li>\n<li>two</li>\n<li>",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\nimport numpy as np\nimport",
]


OWN_MODELS = ("tiny_path",)   # the model this module writes: its tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tied=False, ctx=1024)


def _model(path: Any, **kw: Any) -> Any:
    return barellm.load(path, threads=2, context=kw.pop("context", 1024), **kw)


# --- forcing the drafts: every one accepted, every one rejected, or a mix --------------------------------

def _force(monkeypatch: pytest.MonkeyPatch, prompt_len: int, ref: list[int], how: str, n_vocab: int,
           most: int = 6) -> None:
    """Every step drafts as far as it may (up to `most` tokens), and prompt lookup proposes the plain run's
    next tokens (`how` = "right"), those tokens each off by one ("wrong"), or the right ones with every third
    wrong ("mixed")."""
    monkeypatch.setattr(speculation, "choose", lambda cost, base, rates, caps, draft_cost=None:
                        [min(c, most) for c in caps])

    def propose(self: Lookup, k: int) -> tuple[list[int], int]:
        done = len(self.tokens) - prompt_len
        out = list(ref[done:done + k])
        if how == "wrong":
            out = [(t + 1) % n_vocab for t in out]
        elif how == "mixed":
            out = [(t + 1) % n_vocab if j % 3 == 2 else t for j, t in enumerate(out)]
        return out, 4

    monkeypatch.setattr(Lookup, "propose", propose)


# --- the engine: checking k tokens gives the bits of decoding them one at a time ------------------------

@pytest.mark.model
@pytest.mark.parametrize("which", ["smollm", "qwen05"])
def test_verification_rows_are_decodes_bits_on_every_tier(isa: str, which: str, request: Any) -> None:
    """Feeding a token and its drafts in one call (several sequences batched, drafts of different lengths,
    some past the 8 tokens where the prefill kernels take over) gives every row and every KV entry the bits
    that feeding the same tokens one at a time gives."""
    path = request.getfixturevalue("smollm_gguf" if which == "smollm" else "qwen05_gguf")
    m = _model(path, slots=3, context=64)
    e = m.engine
    prompt = m.tokenize("Guess:")
    # 9 tokens reach the prefill kernels (8 or more); the scalar tier has one path for any count, and is slow
    toks = m.tokenize(" the quick brown fox jumps over the lazy dog and runs away", add_special=False)
    toks = toks[:9] if isa != "scalar" else toks[:5]
    n = len(prompt)
    e.forward(prompt, 0, slot=0)
    for s in (1, 2):
        e.copy_prefix(0, s, n)
    one = np.stack([e.forward([t], n + i, slot=0)[0] for i, t in enumerate(toks)])
    rows = e.forward_batch([(1, toks[:3], n), (2, toks, n)], tails=[3, len(toks)])
    assert np.array_equal(rows[:3], one[:3])
    assert np.array_equal(rows[3:], one)
    last = e.forward_batch([(1, toks[:5], n), (2, toks[:2], n)], tails=[1, 2])
    assert np.array_equal(last[0], one[4]) and np.array_equal(last[1:], one[:2])
    for layer in range(m.config.n_layers):
        k0, v0 = e.kv(0, layer, n + len(toks))
        k2, v2 = e.kv(2, layer, n + len(toks))
        assert np.array_equal(k0, k2) and np.array_equal(v0, v2)


def test_forward_batch_tails_are_checked(tiny_path: Path) -> None:
    m = _model(tiny_path, slots=2, context=64)
    with pytest.raises(InvalidRequest, match="tails"):
        m.engine.forward_batch([(0, [5, 6], 0), (1, [7], 0)], tails=[3, 1])
    with pytest.raises(InvalidRequest, match="tails"):
        m.engine.forward_batch([(0, [5, 6], 0)], tails=[1, 1])


# --- prompt lookup ---------------------------------------------------------------------------------------

def test_lookup_drafts_what_followed_the_longest_latest_match() -> None:
    lk = Lookup([1, 2, 3, 4, 5, 9, 3, 4, 6, 8, 2, 3, 4])
    assert lk.propose(3) == ([5, 9, 3], 3)        # "2 3 4" came before 5 9 3; "3 4" last came before 6
    lk = Lookup([5, 6, 7, 8, 1, 9, 9, 7])
    assert lk.propose(2) == ([8, 1], 1)            # only "7" matches: a one-token match
    assert Lookup([1, 2, 3]).propose(4) == ([], 0)  # nothing recurs
    assert Lookup([1, 2, 3, 1]).propose(0) == ([], 0)


def test_lookup_follows_the_copy_it_drafts_from() -> None:
    """Once a draft came from a place, the output copying it keeps drafting from there, even where its
    last tokens also occur somewhere else more recently."""
    source = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    lk = Lookup(source + [0, 12, 13, 99, 50] + [10, 11])
    assert lk.propose(3) == ([12, 13, 14], 2)
    for t in (12, 13):            # the output copies on: "12 13" last occurred elsewhere (followed by 99)
        lk.append(t)
    draft, run = lk.propose(3)
    assert draft == [14, 15, 16] and run >= 3
    lk.append(77)                 # the copy is left: the cursor is dropped
    assert lk.cursor is None


# --- the controller ---------------------------------------------------------------------------------------

def test_cost_table_measures_interpolates_and_extends() -> None:
    t = CostTable()
    assert t(1) is None
    t.record(1, 0.050)                              # a count's first call is a cold one: not counted
    assert t(1) is None and not t.measured(1)
    t.record(1, 0.010)
    assert t(1) == pytest.approx(0.010) and t.measured(1)
    assert 0.010 < t(4) < 0.020                     # before it is measured: a small share per token (optimistic)
    for tokens, seconds in ((3, 0.014), (8, 0.040)):
        t.record(tokens, 0.5)
        t.record(tokens, seconds)
    assert t(5) == pytest.approx(0.014 + (0.040 - 0.014) * 2 / 5)
    assert t(10) == pytest.approx(0.040 + (0.040 - 0.014) / 5 * 2)
    t.record(1, 0.020)                              # a running average, not the last figure
    assert 0.010 < t(1) < 0.0116                    # and a slow call counts less than a quick one
    t.record(1, 0.010)
    assert t(1) < 0.0112
    t.record(6, 0.100)
    t.record(6, 0.100)                              # measured in a slow spell: hopefully, near its neighbours
    assert t.hopeful(6, 1) < 0.020 and t(6) == pytest.approx(0.100)
    assert t.hopeful(2, 1) == pytest.approx(min(t(2), t(1) * 1.1))


def test_choose_drafts_only_where_it_pays() -> None:
    cheap = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013, 5: 0.014, 6: 0.015, 7: 0.016, 8: 0.017, 9: 0.018}.get
    dear = {1: 0.010, 2: 0.020, 3: 0.030, 4: 0.040, 5: 0.050}.get
    assert choose(cheap, 1, [0.9], [8]) != [0]          # likely accepted, cheap to check: draft
    assert choose(cheap, 1, [0.9], [8])[0] >= 4
    assert choose(cheap, 1, [0.02], [8]) == [0]         # never accepted: nothing
    assert choose(dear, 1, [0.9], [4]) == [0]           # checking a token costs a whole decode: nothing
    assert choose(cheap, 1, [0.9], [0]) == [0]          # nothing to draft
    assert choose(lambda n: None, 1, [0.9], [8]) == [0]  # nothing measured yet
    # a batch: the sequence more likely to be accepted drafts first, and farther
    k = choose(cheap, 2, [0.95, 0.3], [8, 8])
    assert k[0] >= k[1]
    # many sequences in a batch where the batch makes the engine compute-bound: nothing
    linear = lambda n: 0.010 * n  # noqa: E731
    assert choose(linear, 8, [0.8] * 8, [8] * 8) == [0] * 8
    # a draft model's cost counts too
    assert choose(cheap, 1, [0.7], [8], draft_cost=lambda ks: 0.012 * max(ks)) == [0]


def test_acceptance_follows_recent_evidence_and_drifts_back_when_idle() -> None:
    a = Acceptance(0.5)
    for _ in range(10):
        a.observe(4, 0)
    assert a.rate > 0.95
    before = a.rate
    for _ in range(25):
        a.observe(0, 1)
        assert a.rate < before
        before = a.rate
    assert a.rate < 0.1
    for _ in range(200):
        a.idle()
    assert 0.4 < a.rate < 0.6


# --- greedy and sampled output equal plain decoding --------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("which", ["smollm", "qwen05"])
def test_greedy_with_lookup_equals_plain(which: str, request: Any) -> None:
    path = request.getfixturevalue("smollm_gguf" if which == "smollm" else "qwen05_gguf")
    plain, spec = _model(path), _model(path, draft="lookup")
    drafted = accepted = 0
    for i, p in enumerate(PROMPTS):
        a = plain.complete(p, max_tokens=48, temperature=0)
        b = spec.complete(p, max_tokens=48, temperature=0)
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason, p
        drafted += b.timings.drafted
        accepted += b.timings.accepted
        if i < 2:
            c = spec.complete(p, max_tokens=48, temperature=0, draft=False)   # off for one call
            assert c.token_ids == a.token_ids and c.timings.drafted == 0
    assert drafted > 0 and accepted > 0


@pytest.mark.model
@pytest.mark.parametrize("how", ["right", "wrong", "mixed"])
@pytest.mark.parametrize("which", ["smollm", "qwen05"])
def test_every_draft_accepted_or_rejected_leaves_the_output(which: str, how: str, request: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and seeded sampling with penalties, the drafts forced: all of them what the model chooses, all
    of them wrong, or every third wrong."""
    path = request.getfixturevalue("smollm_gguf" if which == "smollm" else "qwen05_gguf")
    plain, spec = _model(path), _model(path, draft="lookup")
    kws = [{"temperature": 0}, {"temperature": 0.9, "seed": 7, "repeat_penalty": 1.15, "top_k": 0, "top_p": 0.98},
           {"temperature": 0.7, "seed": 3, "presence_penalty": 0.5, "logit_bias": {13: 2.0}}]
    for p in PROMPTS[:4] if which == "smollm" else PROMPTS[1:3]:
        for kw in kws:
            ids = spec.tokenize(p)
            a = plain.complete(ids, max_tokens=32, **kw)
            with monkeypatch.context() as mp:
                _force(mp, len(ids), a.token_ids, how, spec.config.n_vocab)
                b = spec.complete(ids, max_tokens=32, **kw)
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason, (p, kw)
            t = b.timings
            assert t.verifications > 0 and t.drafted > 0
            if how == "right":
                assert t.accepted == t.drafted and t.tokens_per_verification > 2
            elif how == "wrong":
                assert t.accepted == 0 and t.tokens_per_verification == 1
            else:
                assert 0 < t.accepted < t.drafted


@pytest.mark.model
def test_n_choices_with_drafts_equal_plain(smollm_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, spec = _model(smollm_gguf, slots=3), _model(smollm_gguf, slots=3, draft="lookup")
    ids = spec.tokenize(PROMPTS[4])
    a = plain.complete(ids, n=3, max_tokens=30, temperature=0.8, seed=5)
    b = spec.complete(ids, n=3, max_tokens=30, temperature=0.8, seed=5)
    assert [c.token_ids for c in b.choices] == [c.token_ids for c in a.choices]
    g = plain.complete(ids, n=2, max_tokens=30, temperature=0)
    _force(monkeypatch, len(ids), g.token_ids, "mixed", spec.config.n_vocab)
    h = spec.complete(ids, n=2, max_tokens=30, temperature=0)
    assert [c.token_ids for c in h.choices] == [c.token_ids for c in g.choices]
    assert h.timings.accepted > 0


def test_sampled_output_follows_the_target_distribution(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 1 with nothing cut (top-k, top-p, min-p off), so the model's softmax is the distribution.
    The first token is fixed (allowed_tokens), then two drafted tokens are checked at every run: the second
    token's frequencies follow the exact probabilities after the first, the acceptance of the draft is its
    probability, and the third token, given the draft was accepted, follows the probabilities after it."""
    m = _model(tiny_path, context=64, draft="lookup")
    prompt = m.tokenize("the cat")
    bias = {t: -100.0 for t in m.tokenizer.eog_ids}   # no end: every run makes its three tokens
    first = int(np.argmax(m.logits(prompt)[-1]))
    p2 = _softmax(m.logits(prompt + [first])[-1], bias)
    d1 = int(np.argmax(p2))
    p3 = _softmax(m.logits(prompt + [first, d1])[-1], bias)
    d2 = int(np.argsort(p3)[-2])      # the second most likely: rejected often, so both branches are exercised
    monkeypatch.setattr(speculation, "choose", lambda cost, base, rates, caps, draft_cost=None:
                        list(caps))
    monkeypatch.setattr(Lookup, "propose", lambda self, k: ([d1, d2][:k], 4))
    words = (m.config.n_vocab + 31) // 32
    only_first = np.zeros(words, np.uint32)
    only_first[first // 32] = np.uint32(1 << (first % 32))
    every = np.full(words, 0xFFFFFFFF, np.uint32)

    def allowed(ids: list[int]) -> np.ndarray:
        return only_first if not ids else every

    kw = {"max_tokens": 3, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "allowed_tokens": allowed,
          "logit_bias": bias}
    m.complete(prompt, seed=0, **kw)   # the plain call's cost is measured: every later run drafts
    runs = 3000
    second, third, verified = [], [], 0
    for seed in range(1, runs + 1):
        c = m.complete(prompt, seed=seed, **kw)
        assert c.token_ids[0] == first and len(c.token_ids) == 3
        verified += c.timings.verifications
        second.append(c.token_ids[1])
        if c.token_ids[1] == d1:
            third.append(c.token_ids[2])
    assert verified == runs
    _check_frequencies(second, p2)
    assert abs(second.count(d1) / runs - p2[d1]) < 5 * math.sqrt(p2[d1] * (1 - p2[d1]) / runs)
    _check_frequencies(third, p3)
    # and the same seeds without drafting give the same tokens, not merely the same distribution
    for seed in (1, 2, 3):
        assert m.complete(prompt, seed=seed, draft=False, **kw).token_ids == \
            m.complete(prompt, seed=seed, **kw).token_ids


def _softmax(row: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    z = row.astype(np.float32)
    for t, b in bias.items():
        z[t] += np.float32(b)
    z = z.astype(np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def _check_frequencies(samples: list[int], p: np.ndarray) -> None:
    """Pearson's chi-square of the samples against p, bins with fewer than 5 expected merged; the bound is
    the statistic's mean plus 6 standard deviations (chance of a false alarm far below 1e-6)."""
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    expected = n * p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)


# --- the KV cache after a rejection ---------------------------------------------------------------------

@pytest.mark.model
def test_kv_cache_after_rejections_is_exact(smollm_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot's record holds only accepted tokens, and its entries for them are the bits a plain feed of
    those tokens writes; a next prompt that extends the conversation reuses them and continues exactly."""
    spec = _model(smollm_gguf, slots=2, draft="lookup")
    plain = _model(smollm_gguf, slots=2)
    ids = spec.tokenize(PROMPTS[3])
    ref = plain.complete(ids, max_tokens=40, temperature=0)
    with monkeypatch.context() as mp:
        _force(mp, len(ids), ref.token_ids, "mixed", spec.config.n_vocab)
        out = spec.complete(ids, max_tokens=40, temperature=0)
    assert out.token_ids == ref.token_ids and 0 < out.timings.accepted < out.timings.drafted
    slot = next(s for s in range(2) if spec.scheduler.slot_tokens[s])
    held = list(spec.scheduler.slot_tokens[slot])
    whole = ids + out.token_ids
    assert held == whole[:len(held)] and len(held) >= len(whole) - 1
    other = 1 - slot
    spec.engine.forward(held, 0, slot=other)
    for layer in range(spec.config.n_layers):
        k, v = spec.engine.kv(slot, layer, len(held))
        k2, v2 = spec.engine.kv(other, layer, len(held))
        assert np.array_equal(k, k2) and np.array_equal(v, v2), layer
    spec.scheduler._table.forget(other)
    more = whole + spec.tokenize(" And then", add_special=False)
    again = spec.complete(more, max_tokens=30, temperature=0)
    assert again.cached_tokens >= len(whole) - 1
    assert again.token_ids == plain.complete(more, max_tokens=30, temperature=0).token_ids


# --- constraints hold with drafting on ---------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.mark.parametrize("how", ["lookup", "right", "wrong"])
def test_constraints_hold_with_drafting(tiny_path: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafted tokens pass the grammar's mask like any other: what the grammar forbids is never accepted, and
    the output is the plain run's, valid against the schema or regex."""
    pytest.importorskip("llguidance")
    plain, spec = _model(tiny_path, context=512), _model(tiny_path, context=512, draft="lookup")
    cases: list[dict[str, Any]] = [{"json_schema": SCHEMA}, {"regex": r"(cat|dog)s? [0-9]{2}( and (cat|dog))*"}]
    for i, case in enumerate(cases):
        for seed in range(3):
            kw = {**case, "max_tokens": 120, "temperature": 1.2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed}
            ids = spec.tokenize("x")
            a = plain.complete(ids, **kw)
            with monkeypatch.context() as mp:
                if how != "lookup":
                    _force(mp, len(ids), a.token_ids, how, spec.config.n_vocab)
                b = spec.complete(ids, **kw)
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
            if b.finish_reason == "stop":
                if i == 0:
                    doc = json.loads(b.text)
                    assert set(doc) == {"name", "n"} and 0 <= doc["n"] <= 99
                else:
                    assert re.fullmatch(case["regex"], b.text)
            if how == "right" and len(b.token_ids) > 3:
                assert b.timings.accepted > 0


# --- a draft model -------------------------------------------------------------------------------------------

def test_draft_model_greedy_and_sampled_equal_plain(tiny_path: Path, tmp_path: Path) -> None:
    """A tiny model of other weights but the same vocabulary drafts (mostly wrong), and a copy of the target
    itself drafts (always right, greedy): either way the output is plain decoding's; the draft slots' record
    follows the sequence."""
    other = write_tiny_llama(tmp_path / "other.gguf", seed=5, tied=False, ctx=1024)
    same = tmp_path / "same.gguf"
    shutil.copyfile(tiny_path, same)
    plain = _model(tiny_path, slots=2)
    for draft, right in ((other, False), (same, True)):
        spec = _model(tiny_path, slots=2, draft=str(draft))
        assert spec.speculator.kind == "model"
        for p in ("the cat", "the the the the the", "x"):
            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 4, "top_k": 0, "repeat_penalty": 1.1}):
                a = plain.complete(p, max_tokens=48, **kw)
                b = spec.complete(p, max_tokens=48, **kw)
                assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason, (draft, p, kw)
                if right and kw["temperature"] == 0 and b.timings.drafted:
                    assert b.timings.accepted == b.timings.drafted
                _check_draft_slots(spec.speculator.draft_model)


def test_new_sequences_start_from_the_drafters_recent_acceptance(tiny_path: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence's acceptance starts from what the drafter achieved over the sequences before it (a fixed
    prior would keep a good draft model off for each new sequence's first tokens)."""
    same = tmp_path / "same.gguf"
    shutil.copyfile(tiny_path, same)
    monkeypatch.setattr(speculation, "choose", lambda cost, base, rates, caps, draft_cost=None:
                        [min(c, 4) for c in caps])
    spec = _model(tiny_path, draft=str(same))
    session = spec.scheduler._spec
    assert session._priors()[0].rate == pytest.approx(speculation.MODEL_PRIOR)
    c = spec.complete("the cat", max_tokens=32, temperature=0)
    assert c.timings.drafted and c.timings.accepted == c.timings.drafted
    assert session._priors()[0].rate > 0.9


def _check_draft_slots(dm: Any) -> None:
    """Each draft slot's record is what its cache holds: the bits a plain feed of those tokens writes."""
    for slot, held in enumerate(dm.held):
        if not held:
            continue
        other = (slot + 1) % len(dm.held)
        tokens = list(held)
        dm.engine.forward(tokens, 0, slot=other)
        for layer in range(dm.config.n_layers):
            k, v = dm.engine.kv(slot, layer, len(tokens))
            k2, v2 = dm.engine.kv(other, layer, len(tokens))
            assert np.array_equal(k, k2) and np.array_equal(v, v2)
        dm.held[other] = tokens


class _Vocab:
    def __init__(self, tokens: list[str], eos: int = 0) -> None:
        self.tokens, self.vocab_size, self.eos_id, self.bos_id = tokens, len(tokens), eos, None

    def token_text(self, i: int) -> str:
        return self.tokens[i]


def test_draft_model_with_another_vocabulary_is_refused(tiny_path: Path) -> None:
    words = ["<s>", "a", "b", "ab", "c"]
    check_vocabulary(_Vocab(words), _Vocab(list(words)), "target", "draft")
    with pytest.raises(InvalidRequest, match=r"draft cannot draft for target: their vocabularies differ \(token 3 "
                                             r"is 'ba' in draft and 'ab' in target\)"):
        check_vocabulary(_Vocab(words), _Vocab(["<s>", "a", "b", "ba", "c"]), "target", "draft")
    with pytest.raises(InvalidRequest, match="vocabularies differ .*draft has 4 tokens, target 5"):
        check_vocabulary(_Vocab(words), _Vocab(words[:4]), "target", "draft")
    with pytest.raises(InvalidRequest, match="special tokens differ"):
        check_vocabulary(_Vocab(words), _Vocab(words, eos=4), "target", "draft")
    with pytest.raises(InvalidRequest, match="cannot draft for itself"):
        _model(tiny_path, draft=str(tiny_path))
    with pytest.raises(InvalidRequest, match="draft must be"):
        _model(tiny_path, draft=3)
    m = _model(tiny_path)
    with pytest.raises(InvalidRequest, match="draft must be True or False"):
        m.complete("x", draft="yes")


@pytest.mark.model
def test_a_draft_model_of_another_family_is_refused_by_name(qwen05_gguf: Path, smollm_gguf: Path) -> None:
    with pytest.raises(InvalidRequest, match=r"cannot draft for .*vocabularies differ"):
        _model(qwen05_gguf, draft=str(smollm_gguf))


# --- the server's scheduler, metrics and request field ----------------------------------------------------

def _run_jobs(sched: Any, prompts: list[list[int]], **kw: Any) -> list[list[int]]:
    from barellm.generate.scheduler import Event, Job

    results: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def sink(i: int) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:
            if ev.kind == "delta":
                results[i].extend(ev.token_ids)
            if ev.kind in ("done", "error"):
                assert ev.kind == "done", ev.message
                done[i].set()
        return emit

    for i, p in enumerate(prompts):
        sched.submit(Job(prompt=p, emit=sink(i), **kw))
    for d in done:
        assert d.wait(300)
    return results


@pytest.fixture
def scheduler_of() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(model: Any) -> Any:
        from barellm.generate.scheduler import Scheduler
        from barellm.serve.metrics import Metrics

        model.serving(True)
        sched = Scheduler(model.engine, model.tokenizer, n_ctx=model.n_ctx, prefill_chunk=16,
                          metrics=Metrics(model.slots), speculator=model.speculator)
        sched.start()
        made.append((sched, model))
        return sched

    yield make
    for sched, model in made:
        sched.stop()
        model.serving(False)


@pytest.mark.model
def test_scheduler_with_drafting_matches_plain(smollm_gguf: Path, scheduler_of: Callable[..., Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent sequences, some prefilling while others draft, some with drafting off: each one's output
    is what the Model gives it alone without drafting; the metrics count the drafts."""
    plain = _model(smollm_gguf, slots=4, context=512)
    spec = _model(smollm_gguf, slots=4, context=512, draft="lookup")
    prompts = [plain.tokenize(p) for p in PROMPTS[:4]]
    refs = [plain.complete(p, max_tokens=40, temperature=0).token_ids for p in prompts]
    sched = scheduler_of(spec)
    params = SamplingParams(temperature=0)
    assert _run_jobs(sched, prompts, params=params, max_tokens=40) == refs
    sched.timings.drafted = 0
    assert _run_jobs(sched, prompts, params=params, max_tokens=40, draft=False) == refs
    assert sched.timings.drafted == 0
    # the drafts forced (the first sequence's plain continuation, right for it and wrong for the others)
    _force(monkeypatch, len(prompts[0]), refs[0], "right", spec.config.n_vocab)
    assert _run_jobs(sched, prompts, params=params, max_tokens=40) == refs
    t = sched.timings
    assert t.drafted > 0 and 0 < t.accepted < t.drafted
    text = sched.metrics.render()
    assert re.search(r"^barellm_draft_tokens_total [1-9]", text, re.M)
    assert re.search(r"^barellm_draft_accepted_tokens_total [1-9]", text, re.M)
    assert "barellm_draft_verifications_total" in text


def test_request_field_turns_drafting_off() -> None:
    pytest.importorskip("pydantic")
    from barellm.serve.schemas import ChatCompletionRequest, parse

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse(ChatCompletionRequest, json.dumps(body).encode()).generation("chat").draft is True
    off = parse(ChatCompletionRequest, json.dumps({**body, "draft": False}).encode()).generation("chat")
    assert off.draft is False


def test_ollama_option_turns_drafting_off() -> None:
    """Ollama's routes make the same request: options.draft false turns drafting off, absent leaves it on."""
    pytest.importorskip("pydantic")
    from types import SimpleNamespace

    from barellm.serve.ollama import OllamaChatRequest, OllamaGenerateRequest
    from barellm.serve.schemas import parse

    state = SimpleNamespace(n_ctx=1024)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse(OllamaChatRequest, json.dumps(chat).encode()).generation(state, "chat").draft is True
    off = parse(OllamaChatRequest, json.dumps({**chat, "options": {"draft": False}}).encode())
    assert off.generation(state, "chat").draft is False
    gen = parse(OllamaGenerateRequest, json.dumps({"model": "m", "prompt": "x", "options": {"draft": False}}).encode())
    assert gen.generation(state, "completion").draft is False


def test_python_api_takes_draft_as_a_keyword(tiny_path: Path) -> None:
    """draft is one of the generation methods' typed keyword-only parameters, the OpenAI-shaped ones too, and
    the one check refuses a value that is not a bool, naming it."""
    import inspect

    m = _model(tiny_path, context=64, draft="lookup")
    for method in (m.generate, m.complete, m.stream, m.chat, m.chat_stream, m.infill, m.create_completion,
                   m.create_chat_completion):
        p = inspect.signature(method).parameters["draft"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is True and p.annotation == "bool", method
    plain = m.complete("the cat", max_tokens=8, temperature=0, draft=False)
    assert plain.timings.drafted == 0
    out = m.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, draft=False)
    assert out["choices"][0]["finish_reason"] in ("stop", "length")
    for call in (lambda: m.complete("x", draft="yes"), lambda: m.create_completion("x", draft=1)):
        with pytest.raises(InvalidRequest, match="draft must be True or False") as e:
            call()
        assert e.value.param == "draft"


def test_paused_and_closed_streams_keep_their_guarantees_with_drafting(tiny_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With drafting on at every step: a stream whose reader is away is not advanced while another call runs,
    and both give plain decoding's tokens; a stream closed mid-way leaves each slot's record what its cache
    holds (accepted tokens only), and the next call still gives the plain tokens."""
    monkeypatch.setattr(speculation, "choose", lambda cost, base, rates, caps, draft_cost=None: list(caps))
    plain = _model(tiny_path, slots=2, context=256)
    spec = _model(tiny_path, slots=2, context=256, draft="lookup")
    a_ids, b_ids = spec.tokenize("the the the the the the"), spec.tokenize("x y x y x y x y")
    ref_a = plain.complete(a_ids, max_tokens=40, temperature=0).token_ids
    ref_b = plain.complete(b_ids, max_tokens=40, temperature=0).token_ids
    spec.complete(a_ids[:2], max_tokens=2, temperature=0)   # a call measured: the steps after it draft

    s = spec.stream(a_ids, max_tokens=40, temperature=0)
    for _ in range(2):
        next(s)
    (live,) = spec.scheduler._live.values()
    made = len(live.gen.generated)
    b = spec.complete(b_ids, max_tokens=40, temperature=0)
    assert len(live.gen.generated) == made            # paused: not advanced meanwhile
    assert b.token_ids == ref_b and b.timings.drafted > 0
    list(s)
    assert s.token_ids == ref_a and s.completion.timings.drafted > 0

    s = spec.stream(b_ids, max_tokens=40, temperature=0)
    for _ in range(3):
        next(s)
    s.close()                                          # cancelled mid-way: its slot freed at the next round
    for held in spec.scheduler.slot_tokens:
        whole = a_ids + ref_a if held[:len(a_ids)] == a_ids else b_ids + ref_b
        assert held == whole[:len(held)]
    again = spec.complete(b_ids + ref_b[:3], max_tokens=37, temperature=0)
    assert again.token_ids == ref_b[3:]
    for held in spec.scheduler.slot_tokens:
        whole = a_ids + ref_a if held[:len(a_ids)] == a_ids else b_ids + ref_b
        assert held == whole[:len(held)]


# --- the command line and -v -----------------------------------------------------------------------------

def test_run_with_draft_prints_the_same_and_reports_acceptance(tiny_path: Path, capsys: Any) -> None:
    from barellm.__main__ import main
    from barellm.cli.reply import Reply

    args = ["run", str(tiny_path), "the the the the the the the", "-n", "24", "--temperature", "0"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--draft", "lookup", "-v"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "tokens/s" in out.err
    t = Timings()
    t.drafted, t.accepted, t.verifications, t.verified = 10, 8, 4, 12
    note = Reply("", 12, 3, 1.0, 0.1, False, False, timings=t).draft_note
    assert "8/10 accepted (80%)" in note and "3.00 tokens per verification" in note
    assert main([*args, "--draft", "no-such-model-xyz"]) != 0
    assert "no-such-model-xyz" in capsys.readouterr().err
# --- the slow test: Qwen2.5-Coder-1.5B with prompt lookup and with the 0.5B draft model --------------------

@pytest.mark.slow
@pytest.mark.model
def test_qwen15_with_lookup_and_the_05b_draft_equals_plain(qwen15_gguf: Path, qwen05_gguf: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's tasks (the code edit among them) and sampled prompts, with each drafter as the controller
    decides and with drafting forced at every step (up to 6 tokens): the output is plain decoding's."""
    from barellm.cli.bench.draft import speculative_tasks

    plain = _model(qwen15_gguf, context=4096)
    specs = [_model(qwen15_gguf, context=4096, draft=d) for d in ("lookup", str(qwen05_gguf))]
    tasks = speculative_tasks(plain)
    for forced in (False, True):
        with monkeypatch.context() as mp:
            if forced:
                mp.setattr(speculation, "choose", lambda cost, base, rates, caps, draft_cost=None:
                           [min(c, 6) for c in caps])
            for name, ids, n in tasks:
                a = plain.complete(ids, max_tokens=min(n, 160), temperature=0)
                for spec in specs:
                    b = spec.complete(ids, max_tokens=min(n, 160), temperature=0)
                    assert b.token_ids == a.token_ids, (name, spec.speculator.name, forced)
                    if forced:
                        assert b.timings.accepted > 0, (name, spec.speculator.name)
            for p in PROMPTS[:3]:
                a = plain.complete(p, max_tokens=48, temperature=0.8, seed=2)
                for spec in specs:
                    assert spec.complete(p, max_tokens=48, temperature=0.8, seed=2).token_ids == a.token_ids
