"""The native sampling chain (_native/sample.c) against its NumPy reference (sampling.py), on random rows of
random lengths (tails of the 8- and 32-wide loops included), on both kernel paths."""

from __future__ import annotations

import numpy as np
import pytest

from barellm.generate.sampling import (
    SamplingParams,
    allowed_mask,
    logprobs_reference,
    mask_bits,
    reference_candidates,
    sample_reference,
)

_native = pytest.importorskip("barellm._native", reason="native core not built")

LENGTHS = [1, 2, 7, 8, 9, 31, 33, 100, 257, 1000, 4099]




def _row(rng, n, kind):
    x = (rng.standard_normal(n) * rng.uniform(0.5, 6)).astype(np.float32)
    if kind == "ties":
        x = np.round(x).astype(np.float32)
    elif kind == "peaky":
        x[rng.integers(0, n, max(1, n // 50))] += 12
    elif kind == "inf":
        x[rng.integers(0, n, max(1, n // 4))] = -np.inf
    return x


def _native_sampler(p: SamplingParams, n: int):
    ids = vals = None
    if p.logit_bias:
        ids = np.fromiter(p.logit_bias.keys(), np.int32)
        vals = np.fromiter(p.logit_bias.values(), np.float32)
    return _native.Sampler(n, float(p.temperature), p.top_k, float(p.top_p), float(p.min_p), float(p.repeat_penalty),
                           float(p.presence_penalty), float(p.frequency_penalty), ids, vals)


def _random_params(rng, n):
    return SamplingParams(
        temperature=float(rng.choice([0, 0.3, 0.8, 1.5])), top_k=int(rng.choice([0, 1, 5, 40, 300, 5000])),
        top_p=float(rng.choice([1, 0.5, 0.95])), min_p=float(rng.choice([0, 0.05, 0.3])),
        repeat_penalty=float(rng.choice([1, 1.3])), presence_penalty=float(rng.choice([0, 0.5])),
        frequency_penalty=float(rng.choice([0, -0.3])), repeat_last_n=int(rng.choice([-1, 0, 8, 64])),
        logit_bias={int(i): float(rng.uniform(-5, 5)) for i in rng.integers(0, n, 3)} if rng.random() < 0.5 else None)


def _window(p, hist):
    if not p.penalized or p.repeat_last_n == 0:
        return 0, 0
    return (0 if p.repeat_last_n < 0 else max(0, len(hist) - p.repeat_last_n)), len(hist)


@pytest.mark.parametrize("n", LENGTHS)
def test_argmax_top_and_sums_match_numpy(isa, n):
    rng = np.random.default_rng(n)
    for kind in ("plain", "ties", "inf"):
        x = _row(rng, n, kind)
        for masked in (False, True):
            allowed = allowed_mask(rng.choice(n, max(1, n // 3), replace=False), n) if masked else None
            ok = mask_bits(allowed, n) if masked else np.ones(n, bool)
            xm = np.where(ok, x, -np.inf)
            want = int(np.argmax(xm)) if xm.max() > -np.inf else int(np.flatnonzero(ok)[0])
            assert _native.argmax(x, n, allowed) == want
            m = int(min(n, rng.integers(1, 60)))
            order = [i for i in np.lexsort((np.arange(n), -xm)) if ok[i] and x[i] > -np.inf][:m]
            assert _native.top(x, n, m, allowed) == order
            ref = float(x.max()) if np.isfinite(x).any() else 0.0
            sel = ok & (x >= -1.0)
            want_sum = float(np.exp((x[sel].astype(np.float64) - ref) * 0.5).sum())
            got = _native.sum_exp(x, n, ref, 0.5, -1.0, allowed)
            assert got == pytest.approx(want_sum, rel=1e-6, abs=1e-30)


@pytest.mark.parametrize("n", [5, 64, 1000, 49157])
def test_logprobs_match_numpy(isa, n):
    rng = np.random.default_rng(n + 1)
    x = _row(rng, n, "peaky")
    tok = int(rng.integers(0, n))
    k = min(5, n)
    lp, top = _native.logprobs(x, n, tok, k)
    ref = logprobs_reference(x, tok, k)
    assert lp == pytest.approx(ref.logprob, abs=1e-5)
    assert [i for i, _ in top] == [i for i, _ in ref.top]
    np.testing.assert_allclose([v for _, v in top], [v for _, v in ref.top], atol=1e-5)


def test_sampler_matches_the_reference_on_random_rows(isa):
    """Same candidates, same probabilities, and for every u the same token as the NumPy chain."""
    rng = np.random.default_rng(7)
    draws = 0
    for trial in range(160):
        n = int(rng.choice(LENGTHS[2:]))
        x = _row(rng, n, ("plain", "ties", "peaky", "inf")[trial % 4])
        p = _random_params(rng, n)
        hist = np.array(rng.integers(0, n, int(rng.integers(0, 100))), np.int32)
        allowed = allowed_mask(rng.choice(n, max(1, n // 2), replace=False), n) if trial % 5 == 0 else None
        s = _native_sampler(p, n)
        a, b = _window(p, hist)
        ids, probs = s.candidates(x, hist, a, b, allowed)
        want_ids, want_probs = reference_candidates(x, p, hist.tolist(), allowed)
        assert ids == want_ids.tolist(), (trial, p)
        np.testing.assert_allclose(probs, want_probs, rtol=1e-9, atol=1e-12)
        for _ in range(10):
            u = float(rng.random())
            assert s.sample(x, u, hist, a, b, allowed) == sample_reference(x, p, hist.tolist(), allowed, u), (trial, p)
            draws += 1
    assert draws == 1600


@pytest.mark.parametrize("params", [
    dict(top_k=0, top_p=0.95, min_p=0.0),     # the top-p cut falls past the first 256 candidates
    dict(top_k=0, top_p=1.0, min_p=0.0),      # pure temperature: every token takes part
    dict(top_k=0, top_p=1.0, min_p=0.001),    # min-p alone keeps thousands
    dict(top_k=0, top_p=0.9, min_p=0.01),
])
def test_top_k_off_walks_past_the_heap(isa, params):
    """Flat rows keep thousands of candidates: the bucketed walk must give the reference's tokens."""
    rng = np.random.default_rng(3)
    n = 5000
    for temperature in (0.7, 1.0, 3.0):
        p = SamplingParams(temperature=temperature, **params)
        s = _native_sampler(p, n)
        x = (rng.standard_normal(n) * 1.5).astype(np.float32)
        for u in list(rng.random(40)) + [0.0, 0.999999]:
            assert s.sample(x, float(u)) == sample_reference(x, p, (), None, float(u)), (p, u)


def test_the_row_is_left_unchanged(isa):
    rng = np.random.default_rng(5)
    n = 300
    x = _row(rng, n, "plain")
    before = x.copy()
    p = SamplingParams(repeat_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5, logit_bias={3: 5.0, 7: -100})
    hist = np.array([3, 3, 7, 9, 3, 250], np.int32)
    s = _native_sampler(p, n)
    s.sample(x, 0.5, hist, 0, len(hist))
    s.candidates(x, hist, 0, len(hist))
    assert np.array_equal(x, before)


def test_bias_bans_and_forces(isa):
    n = 100
    x = np.arange(n, dtype=np.float32) / 10   # token 99 is the best
    greedy = SamplingParams(temperature=0)
    assert _native_sampler(greedy, n).sample(x, 0.0) == 99
    assert _native_sampler(greedy.with_(logit_bias={99: -100.0}), n).sample(x, 0.0) == 98
    forced = SamplingParams(temperature=1.0, logit_bias={17: 100.0})
    s = _native_sampler(forced, n)
    assert {s.sample(x, u) for u in np.linspace(0, 0.999, 50)} == {17}


def test_mask_restricts_and_an_empty_mask_chooses_nothing(isa):
    n = 1000
    rng = np.random.default_rng(9)
    x = _row(rng, n, "plain")
    allowed_ids = {3, 500, 999}
    mask = allowed_mask(sorted(allowed_ids), n)
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)):
        s = _native_sampler(p, n)
        assert {s.sample(x, float(u), None, 0, 0, mask) for u in rng.random(30)} <= allowed_ids
    none = np.zeros_like(mask)
    assert _native_sampler(SamplingParams(), n).sample(x, 0.5, None, 0, 0, none) == -1
    assert _native_sampler(SamplingParams(temperature=0), n).sample(x, 0.5, None, 0, 0, none) == -1


def test_bad_arguments_are_refused():
    s = _native.Sampler(10, 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="float32"):
        s.sample(np.zeros(10, np.float64), 0.5)
    with pytest.raises(ValueError, match="needs 10"):
        s.sample(np.zeros(9, np.float32), 0.5)
    row = np.zeros(10, np.float32)
    row.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        s.sample(row, 0.5)
    with pytest.raises(ValueError, match="history window"):
        s.sample(np.zeros(10, np.float32), 0.5, np.zeros(4, np.int32), 2, 5)
    with pytest.raises(ValueError, match="uint32|needs"):
        s.sample(np.zeros(10, np.float32), 0.5, None, 0, 0, np.zeros(0, np.uint32))
    with pytest.raises(ValueError):
        _native.Sampler(10, 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0, np.array([10], np.int32), np.ones(1, np.float32))
    with pytest.raises(ValueError):
        _native.Sampler(0, 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        _native.logprobs(np.zeros(4, np.float32), 4, 4, 1)
