"""Sampling arithmetic on small hand-checkable distributions."""

from __future__ import annotations

import numpy as np
import pytest

from barellm.errors import InvalidRequest
from barellm.generate.sampling import Sampler, SamplingParams, apply_penalties, candidates


def logits_of(probs):
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def test_greedy_is_argmax_and_ignores_seed():
    lg = logits_of([0.1, 0.5, 0.4])
    for seed in (None, 1, 2):
        assert Sampler(SamplingParams(temperature=0, seed=seed)).sample(lg) == 1


def test_greedy_tie_takes_lowest_id():
    assert Sampler(SamplingParams(temperature=0)).sample(np.array([1.0, 3.0, 3.0], np.float32)) == 1


def test_top_k_keeps_k_best():
    ids, probs = candidates(logits_of([0.1, 0.2, 0.3, 0.4]), SamplingParams(top_k=2, top_p=1, min_p=0,
                                                                            temperature=1))
    assert list(ids) == [3, 2]
    np.testing.assert_allclose(probs, [0.4 / 0.7, 0.3 / 0.7])


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = SamplingParams(top_k=0, top_p=0.6, min_p=0, temperature=1)
    ids, _ = candidates(logits_of([0.1, 0.2, 0.3, 0.4]), p)
    assert list(ids) == [3, 2]        # 0.4 < 0.6 <= 0.7
    ids, _ = candidates(logits_of([0.1, 0.2, 0.3, 0.4]), p.with_(top_p=0.39))
    assert list(ids) == [3]           # 0.4 alone reaches 0.39


def test_min_p_drops_unlikely_tokens():
    ids, _ = candidates(logits_of([0.05, 0.15, 0.3, 0.5]), SamplingParams(top_k=0, top_p=1, min_p=0.5,
                                                                          temperature=1))
    assert list(ids) == [3, 2]        # 0.3 >= 0.25, 0.15 < 0.25


def test_temperature_sharpens_and_flattens():
    lg = logits_of([0.25, 0.75])
    base = SamplingParams(top_k=0, top_p=1, min_p=0)
    _, p1 = candidates(lg, base.with_(temperature=1))
    _, p_hot = candidates(lg, base.with_(temperature=2))
    _, p_cold = candidates(lg, base.with_(temperature=0.5))
    np.testing.assert_allclose(p1, [0.75, 0.25])
    np.testing.assert_allclose(p_hot, [np.sqrt(3) / (1 + np.sqrt(3)), 1 / (1 + np.sqrt(3))])
    np.testing.assert_allclose(p_cold, [0.9, 0.1])


def test_draws_follow_the_distribution_and_seed_reproduces():
    lg = logits_of([0.2, 0.3, 0.5])
    params = SamplingParams(top_k=0, top_p=1, min_p=0, temperature=1, seed=7)
    draws = [Sampler(params).sample(lg) for _ in range(3)]
    assert len(set(draws)) == 1      # same seed, same first draw
    s = Sampler(params)
    counts = np.bincount([s.sample(lg) for _ in range(20000)], minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.2, 0.3, 0.5], atol=0.015)


def test_repeat_penalty_divides_positive_and_multiplies_negative():
    lg = np.array([2.0, -2.0, 1.0], np.float32)
    out = apply_penalties(lg, [0, 1], SamplingParams(repeat_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert lg[0] == 2.0              # the caller's logits are untouched


def test_presence_and_frequency_penalties():
    lg = np.zeros(3, np.float32)
    out = apply_penalties(lg, [1, 1, 2], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    np.testing.assert_allclose(out, [0.0, -1.0, -0.75])


def test_repeat_last_n_limits_the_window():
    lg = np.ones(3, np.float32)
    out = apply_penalties(lg, [0, 1, 2], SamplingParams(repeat_penalty=2.0, repeat_last_n=1))
    np.testing.assert_allclose(out, [1.0, 1.0, 0.5])


@pytest.mark.parametrize("bad", [
    dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5), dict(min_p=-0.1),
    dict(top_k=-1), dict(repeat_penalty=0), dict(presence_penalty=3), dict(seed="x"), dict(top_k=1.5),
])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(InvalidRequest):
        SamplingParams(**bad).validated()


def test_a_top_k_past_any_vocabulary_keeps_every_token():
    """top_k 2**31 (a value the server's schema allows, past a C int) draws as top_k 0 does, natively too."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(300).astype(np.float32)
    for n_vocab in (None, 300):
        wide = Sampler(SamplingParams(temperature=1.0, top_k=2**31, top_p=1.0, min_p=0.0, seed=3), n_vocab=n_vocab)
        off = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3), n_vocab=n_vocab)
        assert [wide.sample(logits) for _ in range(20)] == [off.sample(logits) for _ in range(20)]
