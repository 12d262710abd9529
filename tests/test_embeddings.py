"""Embeddings: the engines' final normed hidden states (hidden_batch), pooled and L2-normalised by
Model.embed and by the server's /v1/embeddings; batch-invariant to the bit on the native engine."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import barellm
from barellm.errors import InvalidRequest

from tiny_model import write_tiny_llama

OWN_MODELS = ("tiny_path",)   # the model this module writes: its tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_hidden_states_are_what_the_logits_are_made_of(tiny_path: Path) -> None:
    for engine in ("native", "reference"):
        m = barellm.load(tiny_path, engine=engine, slots=2)
        ids = m.tokenize("the cat in the hat")
        h = m.engine.hidden_batch([(0, ids, 0)])
        w = m.engine.output if engine == "reference" else m.engine.weights.dequant("output.weight")
        assert h.shape == (len(ids), m.config.dim)
        np.testing.assert_allclose(h @ w.T, m.logits(ids), rtol=2e-3, atol=2e-3 * float(np.abs(h @ w.T).max()))
        last = m.engine.hidden_batch([(0, ids, 0), (1, ids[:3], 0)], last_only=True)
        np.testing.assert_array_equal(last[0], h[-1])


def test_native_hidden_states_match_the_reference(tiny_path: Path) -> None:
    ids = barellm.load(tiny_path).tokenize("in the beginning")
    nat = barellm.load(tiny_path, engine="native").engine.hidden_batch([(0, ids, 0)])
    ref = barellm.load(tiny_path, engine="reference").engine.hidden_batch([(0, ids, 0)])
    np.testing.assert_allclose(nat, ref, atol=0.05 * float(np.abs(ref).max()))


def test_hidden_batch_is_batch_and_chunk_invariant(tiny_path: Path) -> None:
    m = barellm.load(tiny_path, slots=3)
    e = m.engine
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, m.config.n_vocab, n).tolist() for n in (5, 70, 130)]   # across 64-row chunks
    alone = [e.hidden_batch([(0, s, 0)]) for s in seqs]
    together = e.hidden_batch([(i, s, 0) for i, s in enumerate(seqs)])
    np.testing.assert_array_equal(together, np.concatenate(alone))
    # a sequence fed in pieces (as the server feeds a long input) gives the same rows
    s = seqs[2]
    pieces = np.concatenate([e.hidden_batch([(1, s[a:a + 40], a)]) for a in range(0, len(s), 40)])
    np.testing.assert_array_equal(pieces, alone[2])
    assert e.hidden_batch([(0, s, 0)], out=np.empty((len(s), m.config.dim), np.float32)).shape == (len(s), 64)


def test_embed_shapes_pooling_and_errors(tiny_path: Path) -> None:
    m = barellm.load(tiny_path, slots=2)
    texts = ["the cat", "the hat is on the cat", "in", "an answer", "the end"]
    e = m.embed(texts)
    assert e.shape == (5, m.config.dim) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    one = np.stack([m.embed(t) for t in texts])
    np.testing.assert_array_equal(e, one)   # batched (2 slots, 3 rounds) = one by one, to the bit
    assert m.embed("the cat").shape == (m.config.dim,)
    ids = m.tokenize("the cat")
    np.testing.assert_array_equal(m.embed([ids])[0], e[0])   # token ids embed as their text does
    # the pooling: mean of every row, or the last row
    h = m.engine.hidden_batch([(0, ids, 0)]).astype(np.float64)
    raw = m.embed("the cat", normalize=False)
    np.testing.assert_allclose(raw, h.mean(axis=0), rtol=1e-6, atol=1e-6)
    last = m.embed("the cat", pooling="last")
    np.testing.assert_allclose(last, h[-1] / np.linalg.norm(h[-1]), atol=1e-6)
    assert m.pooling == "mean"
    with pytest.raises(InvalidRequest, match="pooling"):
        m.embed("x", pooling="max")
    with pytest.raises(InvalidRequest, match="empty"):
        m.embed([""])
    with pytest.raises(InvalidRequest, match="context"):
        m.embed(["a" * 1000])


PAIRS = [   # (a sentence, a paraphrase of it, an unrelated sentence)
    ("The cat sat on the mat.", "A cat was sitting on the rug.", "The stock market fell sharply today."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?",
     "The train to Berlin leaves at noon."),
    ("He plays the guitar every evening.", "Every night he practices guitar.",
     "Photosynthesis converts light into chemical energy."),
    ("The weather is sunny and warm.", "It is a warm, sunny day.", "My laptop battery died during the meeting."),
    ("She is learning to speak French.", "She is studying the French language.", "The bridge was closed for repairs."),
    ("Python is a popular programming language.", "Many developers use the Python language.",
     "The soup needs more salt."),
]


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_paraphrases_are_closer_than_unrelated_sentences(name: str) -> None:
    m = barellm.load(name, slots=3)
    for a, b, c in PAIRS:
        e = m.embed([a, b, c])
        assert e[0] @ e[1] > e[0] @ e[2], (a, b, c)


@pytest.mark.model
def test_embeddings_endpoint_with_the_openai_client(smollm_gguf: Path) -> None:
    import openai
    from test_server import serving

    from barellm.serve.app import create_app

    model = barellm.load(smollm_gguf, slots=2, context=512)
    texts = [x for p in PAIRS[:2] for x in p]
    direct = barellm.load(smollm_gguf, slots=3, context=512).embed(texts)
    with serving(create_app(model, model_id="m", prefill_chunk=4)) as url:   # inputs fed 4 tokens a step
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.embeddings.create(model="m", input=texts)
        got = np.array([d.embedding for d in r.data], np.float32)
        assert [d.index for d in r.data] == list(range(len(texts))) and r.model == "m"
        np.testing.assert_array_equal(got, direct)   # the server's chunks and slot change no bit
        assert r.usage.prompt_tokens == sum(len(model.tokenize(t)) for t in texts) == r.usage.total_tokens
        r = client.embeddings.create(model="m", input=texts[0], encoding_format="base64")
        v = r.data[0].embedding
        if isinstance(v, str):   # older clients hand the base64 text over as it came
            v = np.frombuffer(base64.b64decode(v), "<f4")
        np.testing.assert_array_equal(np.asarray(v, np.float32), direct[0])
        ids = model.tokenize(texts[1])
        r = client.embeddings.create(model="m", input=[ids])
        np.testing.assert_array_equal(np.array(r.data[0].embedding, np.float32), direct[1])
        r = client.embeddings.create(model="m", input=ids)   # one token-id list
        assert len(r.data) == 1
        r = client.embeddings.create(model="m", input="x", dimensions=model.config.dim)
        assert len(r.data[0].embedding) == model.config.dim
        for bad, param in (({"input": "x", "dimensions": 3}, "dimensions"), ({"input": []}, "input"),
                           ({"input": [""]}, "input"), ({"input": [1, "a"]}, "input"),
                           ({"input": ["x" * 3000]}, "input")):
            with pytest.raises(openai.BadRequestError) as e:
                client.embeddings.create(model="m", **bad)
            assert e.value.body["param"] == param, (bad, e.value.body)
        # generation and embeddings share the server
        c = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
        assert c.choices[0].text


def _batch_while_generating(url: str, texts: list[str]) -> Any:
    import concurrent.futures

    import httpx

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        gen = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                                     "temperature": 0}, timeout=120)
        emb = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
        return gen.result().json(), emb.result().json()


@pytest.mark.model
def test_embeddings_interleave_with_generation(smollm_gguf: Path) -> None:
    from test_server import serving

    from barellm.serve.app import create_app

    alone = barellm.load(smollm_gguf, context=512).generate("Once upon a time", max_tokens=24, temperature=0)
    model = barellm.load(smollm_gguf, slots=2, context=512)
    with serving(create_app(model, model_id="m", prefill_chunk=8)) as url:
        texts = [p[0] for p in PAIRS] * 3
        gen, emb = _batch_while_generating(url, texts)
    assert gen["choices"][0]["text"] == alone   # greedy text unchanged by the embedding job beside it
    assert len(emb["data"]) == len(texts)
