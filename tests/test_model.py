"""The Model API on a tiny synthetic model: generation, streaming, stops, seeds, chat, cache reuse, errors."""

from __future__ import annotations

import numpy as np
import pytest

import barellm
from barellm.errors import InvalidRequest

from conftest import in_own_home
from tiny_model import write_tiny_llama

ENGINES = ["reference", "native"]


OWN_MODELS = ("tiny_path",)   # the model this module writes: its tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module", params=ENGINES)
def model(request, tiny_path, scratch_home):
    if request.param == "native":
        pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    with in_own_home(scratch_home):
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
    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
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


# --- a Model shared by streams and threads --------------------------------------------------------

@pytest.fixture(scope="module", params=ENGINES)
def model2(request, tiny_path, scratch_home):
    """Two KV cache slots."""
    if request.param == "native":
        pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    with in_own_home(scratch_home):
        return barellm.load(str(tiny_path), engine=request.param, context=128, slots=2)


def test_a_stream_keeps_its_own_cache_while_generate_runs(model2):
    kw = dict(max_tokens=16, temperature=0)
    alone = "".join(model2.stream("the cat", **kw))
    other = model2.generate("in the hat and more", **kw)
    s = model2.stream("the cat", **kw)
    head = [next(s), next(s), next(s)]
    assert model2.generate("in the hat and more", **kw) == other   # runs in the other slot
    assert "".join(head) + "".join(s) == alone


def test_interleaved_streams_do_not_mix(model2):
    kw = dict(max_tokens=12, temperature=0.9, seed=4)
    a_alone = "".join(model2.stream("the cat", **kw))
    b_alone = "".join(model2.stream("a dog in the", **kw))
    streams = {"a": model2.stream("the cat", **kw), "b": model2.stream("a dog in the", **kw)}
    got: dict[str, list[str]] = {"a": [], "b": []}
    while streams:   # one piece from each in turn
        for k in list(streams):
            piece = next(streams[k], None)
            if piece is None:
                del streams[k]
            else:
                got[k].append(piece)
    got_a, got_b = got["a"], got["b"]
    assert "".join(got_a) == a_alone and "".join(got_b) == b_alone


def test_with_every_slot_held_by_this_thread_a_generation_is_refused(model):
    s = model.stream("the cat", max_tokens=10, temperature=0)
    next(s)
    with pytest.raises(barellm.SlotsBusy, match="held by unfinished generations"):
        model.generate("in the hat", max_tokens=4)
    s.close()   # a closed stream gives its slot back
    assert model.generate("in the hat", max_tokens=4, temperature=0) is not None


def test_a_dropped_stream_releases_its_slot(model):
    import gc

    s = model.stream("the cat", max_tokens=10, temperature=0)
    next(s)
    del s
    gc.collect()
    assert model.generate("the cat", max_tokens=4, temperature=0) is not None
    assert model.scheduler.slots_in_use == 0   # the slots are the scheduler's


@pytest.mark.parametrize("slots", [1, 2])
def test_threads_share_a_model(tiny_path, slots):
    import threading

    pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    m = barellm.load(str(tiny_path), engine="native", context=128, slots=slots)
    prompts = ["the cat", "in the hat", "a dog", "the end of"]
    kw = dict(max_tokens=24, temperature=0)
    alone = {p: m.generate(p, **kw) for p in prompts}
    results: dict[str, list[str]] = {p: [] for p in prompts}
    errors: list[BaseException] = []

    def worker(p: str) -> None:
        try:
            for _ in range(3):
                results[p].append(m.generate(p, **kw))
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == {p: [alone[p]] * 3 for p in prompts}


def test_serving_is_refused_while_a_stream_is_open(model):
    s = model.stream("the cat", max_tokens=10, temperature=0)
    next(s)
    with pytest.raises(InvalidRequest, match="unfinished"):
        model.serving(True)
    s.close()
    model.serving(True)
    with pytest.raises(InvalidRequest, match="being served"):
        model.generate("the cat", max_tokens=2)
    model.serving(False)


# --- token-level outputs ------------------------------------------------------------------------------

def test_logprobs_are_the_log_softmax_of_the_logits(model):
    ids = model.tokenize("the cat")
    c = model.complete(ids, max_tokens=5, temperature=0, top_logprobs=3)
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    rows = model.logits(ids + c.token_ids[:-1])[len(ids) - 1:]
    for lp, row, tok in zip(c.logprobs, rows, c.token_ids, strict=True):
        z = row.astype(np.float64)
        ref = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        assert lp.token_id == tok and lp.logprob == pytest.approx(ref[tok], abs=2e-4)
        assert [i for i, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:3])
        assert lp.top[0][0] == tok   # greedy
    assert model.complete(ids, max_tokens=3).logprobs is None
    assert all(lp.top == [] for lp in model.complete(ids, max_tokens=3, logprobs=True).logprobs)


def test_n_choices_share_the_prompt(model2, monkeypatch):
    kw = dict(max_tokens=8, temperature=0.9)
    one = [model2.complete("the cat", seed=10 + i, **kw).choices[0] for i in range(2)]
    fed: list[int] = []
    real = model2.engine.forward

    def counting(tokens, start, all_logits=False, **k):
        fed.append(len(tokens))
        return real(tokens, start, all_logits, **k)

    monkeypatch.setattr(model2.engine, "forward", counting)
    model2.reset()
    c = model2.complete("the cat", n=2, seed=10, **kw)
    assert [ch.index for ch in c.choices] == [0, 1]
    # choice i draws as n=1 with seed + i does, from one prefill of the prompt
    assert [ch.text for ch in c.choices] == [ch.text for ch in one]
    assert [ch.token_ids for ch in c.choices] == [ch.token_ids for ch in one]
    assert c.text == c.choices[0].text and c.token_ids == c.choices[0].token_ids
    assert fed.count(len(model2.tokenize("the cat"))) == 1
    with pytest.raises(InvalidRequest, match="slots"):
        model2.complete("the cat", n=3)
    with pytest.raises(InvalidRequest, match="one sequence"):
        model2.stream("the cat", n=2)


def test_n_choices_when_the_first_token_ends_the_leader(model2):
    # max_tokens 1 ends the first choice at its first step, the one that also starts the others
    c = model2.complete("the cat", n=2, max_tokens=1, seed=3, temperature=0.9)
    assert [len(ch.token_ids) for ch in c.choices] == [1, 1]
    assert [ch.finish_reason for ch in c.choices] == ["length", "length"]


def test_copy_prefix_gives_the_same_continuation(model2):
    ids = model2.tokenize("the cat in the hat")
    eng = model2.engine
    a = eng.forward(ids, 0, slot=0)
    eng.forward([7, 8, 9], 0, slot=1)   # something else in slot 1 first
    eng.copy_prefix(0, 1, len(ids) - 1)
    b = eng.forward(ids[-1:], len(ids) - 1, slot=1)
    if model2.engine_name == "native":   # the same bits however the prompt was cut
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    model2.reset()


def test_logit_bias_bans_and_forces_tokens(model):
    base = model.complete("the cat", max_tokens=4, temperature=0)
    first = base.token_ids[0]
    banned = model.complete("the cat", max_tokens=4, temperature=0, logit_bias={first: -100})
    assert banned.token_ids[0] != first
    forced = model.complete("the cat", max_tokens=3, temperature=0.8, seed=1, logit_bias={42: 100})
    assert forced.token_ids == [42, 42, 42]
    with pytest.raises(InvalidRequest, match="logit_bias"):
        model.generate("the cat", logit_bias={model.config.n_vocab: 1})
    with pytest.raises(InvalidRequest, match="logit_bias"):
        model.generate("the cat", logit_bias={1: 1000})


def test_allowed_tokens_restrict_the_choice(model):
    from barellm.generate.sampling import allowed_mask

    allowed = [40, 41, 42]
    c = model.complete("the cat", max_tokens=6, temperature=1.0, seed=3,
                       allowed_tokens=allowed_mask(allowed, model.config.n_vocab))
    assert set(c.token_ids) <= set(allowed)
    with pytest.raises(InvalidRequest, match="allowed_tokens"):
        model.generate("the cat", allowed_tokens=np.zeros(1, np.uint32))


def test_completion_timings(model):
    c = model.complete("the cat", max_tokens=6, temperature=0.8, seed=2)
    t = c.timings
    assert t is not None and t.tokens == len(c.token_ids)
    b = t.breakdown()
    assert b["forward"] > 0 and b["sample"] > 0 and sum(b.values()) == pytest.approx(c.decode_seconds, rel=1e-6)


# --- one path: the scheduler the server runs, one check, keywords in the signatures ------------------------

def test_generation_methods_show_their_keywords():
    import inspect

    for name in ("generate", "stream", "complete", "chat", "chat_stream", "infill", "complete_infill"):
        params = inspect.signature(getattr(barellm.Model, name)).parameters
        assert {"max_tokens", "temperature", "top_k", "seed", "stop", "n", "json_schema", "timings"} <= set(params)
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("max_tokens", "temperature", "stop"))
        assert params["temperature"].default == 0.8 and params["max_tokens"].default is None
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), name
    params = inspect.signature(barellm.Model.create_completion).parameters
    assert params["max_tokens"].default == 16 and "top_logprobs" not in params and "timings" not in params
    assert params["temperature"].default == 0.8
    params = inspect.signature(barellm.Model.create_chat_completion).parameters
    assert params["logprobs"].default is False and "timings" not in params and "seed" in params


def test_the_one_check_names_the_parameter(model):
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
        model.generate("the cat", logit_bias={model.config.n_vocab: 1})
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match="slots") as e:
        model.complete("the cat", n=model.slots + 1)
    assert e.value.param == "n"
    with pytest.raises(InvalidRequest, match="context") as e:
        model.generate([5] * 200)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


def test_a_stream_between_its_pieces_is_not_advanced(model2, monkeypatch):
    """A stream waits, holding its slot, while its reader is away: another generation's steps run alone."""
    kw = dict(max_tokens=12, temperature=0)
    alone = "".join(model2.stream("the cat", **kw))
    sizes: list[int] = []
    real = model2.engine.forward_batch

    def recording(seqs):
        sizes.append(len(seqs))
        return real(seqs)

    monkeypatch.setattr(model2.engine, "forward_batch", recording)
    s = model2.stream("the cat", **kw)
    head = next(s)
    model2.generate("in the hat and more", **kw)
    assert max(sizes, default=1) == 1   # never batched with the paused stream
    assert head + "".join(s) == alone
