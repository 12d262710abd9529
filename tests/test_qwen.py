"""Qwen2.5-Coder (the qwen2 row): tokenizer, reference and native engine against the golden data.

The 0.5B runs in CI; the 1.5B (1.1 GB) in `make test-slow`. Truth for the tokenizer is llama.cpp's
tokenization; for logits, transformers in float32 on the same files (tests/data/README.md).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.runtime.engine import NativeEngine
from barellm.store.converted import open_model
from barellm.text.chat import ChatTemplate
from barellm.text.tokenizer import Tokenizer

from conftest import load_data

MODELS = [pytest.param(("qwen2.5-coder-0.5b", "qwen05_gguf"), id="0.5b"),
          pytest.param(("qwen2.5-coder-1.5b", "qwen15_gguf"), id="1.5b", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=MODELS)
def qwen(request):
    name, fixture = request.param
    src = open_model(request.getfixturevalue(fixture))
    yield name, src, load_data(f"{name}.json")
    src.close()


def test_tokenizer_matches_llamacpp(qwen):
    """Every golden string gives exactly llama.cpp's ids: special tokens parsed or not, with the BOS rule."""
    _, src, gold = qwen
    t0 = time.perf_counter()
    tok = Tokenizer.from_metadata(src.metadata)
    setup = time.perf_counter() - t0
    assert tok.vocab_size > 150000
    for case in gold["strings"]:
        text = case["text"]
        assert tok.encode(text) == case["truth_ids"], text
        assert tok.encode(text, add_special=True) == case["truth_ids_add_special"], text
        assert tok.encode(text, parse_special=False) == case["truth_ids_no_parse_special"], text
        assert tok.decode(case["truth_ids"]) == text
    for r in gold["results"]:
        assert tok.encode(r["prompt"], add_special=True) == r["prompt_ids"]
    print(f"tokenizer set-up for {tok.vocab_size} entries: {setup:.3f} s")


def _teacher_forced(engine, gold):
    """(max |logit - golden| over the top-10 of every row, top-1 agreement and mean KL over the golden top-10
    from the last prompt row on), the way llama.cpp's figures beside the golden data were measured."""
    worst, agree, kls = 0.0, [], []
    for r in gold["results"]:
        ids = r["prompt_ids"] + r["greedy_ids"]
        got = engine.forward(ids, 0, all_logits=True).astype(np.float64)
        top_ids, top = np.asarray(r["top10_ids"]), np.asarray(r["top10_logits"])
        lse = np.asarray(r["logsumexp"])
        worst = max(worst, float(np.abs(np.take_along_axis(got, top_ids, 1) - top).max()))
        m = got.max(1, keepdims=True)
        logp = got - m - np.log(np.exp(got - m).sum(1, keepdims=True))
        for i in range(len(r["prompt_ids"]) - 1, len(ids)):
            agree.append(int(got[i].argmax()) == int(top_ids[i][0]))
            p_ref = top[i] - lse[i]
            kls.append(float((np.exp(p_ref) * (p_ref - logp[i][top_ids[i]])).sum()))
    return worst, float(np.mean(agree)), float(np.mean(kls))


def test_reference_engine_matches_float32(qwen):
    """The NumPy reference is the float32 model: within 2e-3 of transformers at every position."""
    _, src, gold = qwen
    worst, top1, _ = _teacher_forced(reference_engine(config_of(src), src, 256), gold)
    assert worst < 2e-3
    assert top1 == 1.0


def test_native_engine_at_least_as_good_as_llamacpp(qwen):
    """Teacher-forced on the golden prompts: top-1 agreement and mean top-10 KL at least as good as llama.cpp's
    on the same file (its figures are stored beside the golden data)."""
    _, src, gold = qwen
    engine = NativeEngine(config_of(src), src, n_ctx=256, threads=2)
    _, top1, kl = _teacher_forced(engine, gold)
    peer = gold["llamacpp_teacher_forced"]
    print(f"native: top-1 {top1:.4f}, mean KL {kl:.6f}; llama.cpp: {peer['top1']:.4f}, {peer['mean_kl_top10']:.6f}")
    assert top1 >= peer["top1"]
    assert kl <= peer["mean_kl_top10"]


def test_chat_template_from_the_file(qwen05_gguf):
    """The file's ChatML template renders (sandboxed), its tools branch too, and its turns are special tokens."""
    src = open_model(qwen05_gguf)
    md = src.metadata
    tok = Tokenizer.from_metadata(md)
    tpl = ChatTemplate(md["tokenizer.chat_template"])
    text = tpl.render([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == tok.encode("<|im_start|>")[0] and len(tok.encode("<|im_start|>")) == 1
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    with_tools = tpl.render([{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    src.close()


def test_kv_q8_0_keys_minus_their_bias_turned(qwen):
    """Qwen2's keys carry their projection's bias, a few values of up to ~270 in some layers beside an
    informative part of a few units: an 8-bit cache stores each key minus that bias and turned by a
    Walsh-Hadamard transform (kv_q8.q8_0_keys), and the attention turns the queries alike. On the real model,
    every layer's cache holds, bit for bit, the NumPy codec of the keys and values the rope op gave, and the
    attention op's output is the float64 attention over the keys turned and shifted back (the shift adds one
    constant to each query's scores, which the softmax cancels)."""
    from barellm.arch.llama import attention
    from barellm.formats.kv_q8 import q8_0_keys, q8_0_keys_join, q8_0_round_trip

    _, src, gold = qwen
    cfg = config_of(src)
    e = NativeEngine(cfg, src, n_ctx=256, threads=2, kv_type="q8_0")
    ids = gold["results"][0]["prompt_ids"] + gold["results"][0]["greedy_ids"]
    n = len(ids)
    seen = {}

    def observe(op, out, ctx):
        if op.name.endswith((".rope", ".attn")):
            seen[op.name] = out[:n].copy()

    e.debug_forward(ids, 0, observe=observe)
    qd, kd, hd, nkv = cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.n_kv_heads
    biggest = 0.0
    for i in range(cfg.n_layers):
        qkv = seen[f"blk.{i}.rope"]
        q = qkv[:, :qd].reshape(n, cfg.n_heads, hd)
        k, v = qkv[:, qd:qd + kd].reshape(n, nkv, hd), qkv[:, qd + kd:qd + 2 * kd].reshape(n, nkv, hd)
        bias = np.asarray(src.dequantize(f"blk.{i}.attn_k.bias"), np.float32).reshape(nkv, hd)
        biggest = max(biggest, float(np.abs(bias).max()))
        keys, values = e.kv(0, i, n)
        assert np.array_equal(keys, q8_0_keys_join(*q8_0_keys(k, bias), bias)), i
        assert np.array_equal(values, q8_0_round_trip(v)), i
        want = attention(q.astype(np.float64), keys.astype(np.float64), values.astype(np.float64), 0, cfg.scale,
                         cfg.layer_window(i))
        # float32 sums of up to 69 exact products against float64: 4e-6 of the largest value at most here
        np.testing.assert_allclose(seen[f"blk.{i}.attn"], want, rtol=0, atol=2e-5 * np.abs(values).max(),
                                   err_msg=f"layer {i}")
    assert biggest > 100  # the case this storage is for
