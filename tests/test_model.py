"""The Model API on a tiny synthetic model: generation, streaming, stops, seeds, chat, cache reuse, errors."""

from __future__ import annotations

import numpy as np
import pytest

import barellm
from barellm.errors import InvalidRequest

from tiny_model import write_tiny_llama

ENGINES = ["reference", "native"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module", params=ENGINES)
def model(request, tiny_path):
    if request.param == "native":
        pytest.importorskip("barellm.engine", reason="native engine not built")
    return barellm.load(str(tiny_path), engine=request.param, context=128)


def test_greedy_is_deterministic_and_ignores_seed(model):
    a = model.generate("the cat", max_tokens=12, temperature=0)
    b = model.generate("the cat", max_tokens=12, temperature=0, seed=5)
    assert a == b and len(a) > 0


def test_same_seed_same_text_other_seed_other_text(model):
    kw = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = model.generate("the cat", seed=1, **kw)
    assert model.generate("the cat", seed=1, **kw) == a
    others = {model.generate("the cat", seed=s, **kw) for s in range(2, 6)}
    assert others - {a}


def test_stream_pieces_join_to_generate(model):
    kw = dict(max_tokens=20, temperature=0.7, seed=3)
    assert "".join(model.stream("in the", **kw)) == model.generate("in the", **kw)


def test_max_tokens_and_completion_counts(model):
    c = model.complete("the cat", max_tokens=7, temperature=0)
    assert len(c.token_ids) <= 7
    assert c.prompt_tokens == len(model.tokenize("the cat"))
    assert c.finish_reason in ("length", "stop")
    assert model.complete("the cat", max_tokens=0).text == ""


def test_stop_string_cuts_the_text_before_it(model):
    full = model.generate("the", max_tokens=24, temperature=0)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop
    c = model.complete("the", max_tokens=24, temperature=0, stop=[stop])
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop"
    assert "".join(model.stream("the", max_tokens=24, temperature=0, stop=stop)) == c.text


def test_end_of_generation_token_stops(model, monkeypatch):
    eos = model.tokenizer.eos_id
    real = model.engine.forward

    def prefer_eos_after_three(tokens, start, all_logits=False, **kw):
        out = real(tokens, start, all_logits, **kw)
        if start >= n_prompt + 3:
            out = out.copy()
            out[:, eos] = 1e4
        return out

    n_prompt = len(model.tokenize("the cat"))
    monkeypatch.setattr(model.engine, "forward", prefer_eos_after_three)
    model.reset()
    c = model.complete("the cat", max_tokens=50, temperature=0)
    assert c.finish_reason == "stop" and len(c.token_ids) == 4


def test_prompt_that_extends_the_cache_reuses_it(model):
    model.reset()
    ids = model.tokenize("the cat in the hat")
    first = model.complete(ids, max_tokens=3, temperature=0)
    assert first.cached_tokens == 0
    longer = ids + first.token_ids + model.tokenize(" and more")
    second = model.complete(longer, max_tokens=3, temperature=0)
    # the cache holds the prompt and every generated token that was fed back: all but the last when
    # max_tokens cut the generation (the last one's logits were never needed), as the server's slots do
    fed = first.token_ids if first.finish_reason == "stop" else first.token_ids[:-1]
    assert first.finish_reason == "length" and second.cached_tokens == len(ids) + len(fed)
    # the reused cache gives exactly what a fresh run gives
    model.reset()
    assert model.complete(longer, max_tokens=3, temperature=0).token_ids == second.token_ids


def test_logits_rows_match_one_at_a_time(model):
    ids = model.tokenize("the cat in")
    all_rows = model.logits(ids)
    assert all_rows.shape == (len(ids), model.config.n_vocab) and all_rows.dtype == np.float32
    model.reset()
    last = model.engine.forward(ids, 0)[-1]
    np.testing.assert_allclose(all_rows[-1], last, rtol=1e-5, atol=1e-5)


def test_chat_renders_template_and_generates(model):
    msgs = [{"role": "user", "content": "hi"}]
    ids = model.chat_prompt(msgs)
    assert model.detokenize(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.chat(msgs, max_tokens=5, temperature=0) == "".join(model.chat_stream(msgs, max_tokens=5,
                                                                                      temperature=0))


def test_tokenize_detokenize_round_trip(model):
    text = "the cat <|im_end|> naïve"
    assert model.detokenize(model.tokenize(text)) == text


@pytest.mark.parametrize("kw", [
    dict(temperature=-1), dict(top_p=2), dict(max_tokens=-1), dict(max_tokens="5"), dict(stop=5),
    dict(bogus=1), dict(seed=1.5),
])
def test_bad_generation_parameters_are_refused(model, kw):
    with pytest.raises(InvalidRequest):
        model.generate("the cat", **kw)


def test_bad_prompts_are_refused(model):
    with pytest.raises(InvalidRequest):
        model.generate([model.config.n_vocab + 5])
    with pytest.raises(InvalidRequest):
        model.generate([])
    with pytest.raises(InvalidRequest, match="context"):
        model.generate([5] * 200)
    with pytest.raises(InvalidRequest):
        model.generate(3.5)


def test_bad_load_arguments(tiny_path):
    with pytest.raises(InvalidRequest):
        barellm.load(str(tiny_path), engine="gpu")
    with pytest.raises(InvalidRequest):
        barellm.load(str(tiny_path), context=100000)
    with pytest.raises(InvalidRequest):
        barellm.load(str(tiny_path), threads=0)
    with pytest.raises(barellm.ModelNotFound):
        barellm.load("/no/such/model.gguf")
    with pytest.raises(InvalidRequest, match="activations"):
        barellm.load(str(tiny_path), activations="q4")


def test_activation_precision_choice(tiny_path):
    """q8x2 (the default) is closer to the float32 reference than q8; both are deterministic."""
    pytest.importorskip("barellm.engine", reason="native engine not built")
    ids = list(range(1, 40))
    ref = barellm.load(str(tiny_path), engine="reference", context=128).logits(ids)
    err = {}
    for acts in ("q8x2", "q8"):
        m = barellm.load(str(tiny_path), engine="native", context=128, activations=acts)
        assert m.engine.activations == acts
        got = m.logits(ids)
        assert np.array_equal(got, m.logits(ids))
        err[acts] = np.abs(got - ref).max()
    assert barellm.load(str(tiny_path), engine="native", context=128).engine.activations == "q8x2"
    assert err["q8x2"] * 10 < err["q8"], err
