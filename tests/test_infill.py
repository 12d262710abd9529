"""Fill-in-the-middle: the FIM tokens found as llama.cpp finds them, the exact prompt of /infill and of
OpenAI's suffix, where a fill ends, and real holes filled with code that compiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import barellm
from barellm.errors import InvalidRequest
from barellm.generate.generation import Generation
from barellm.generate.sampling import SamplingParams
from barellm.text.infill import FimTokens, end_rules, fim_tokens, infill_ids


class Vocab:
    """Just what fim_tokens and infill_ids read of a tokenizer: one token per character, markers by name."""

    add_bos = False
    bos_id = None

    def __init__(self, specials: list[str]) -> None:
        self.specials = specials
        self.vocab_size = 1000

    def token_to_id(self, text: str) -> int | None:
        return 900 + self.specials.index(text) if text in self.specials else None

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        assert not add_special and not parse_special   # code is text: marker strings in it are not markers
        return [ord(c) for c in text]


def test_fim_tokens_from_metadata_or_the_vocabulary() -> None:
    qwen = Vocab(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>"])
    assert fim_tokens({}, qwen) == FimTokens(900, 901, 902, 903, 904, 905)
    # the file's keys win over the texts (and the older prefix/suffix/middle keys count)
    md = {"tokenizer.ggml.fim_pre_token_id": 10, "tokenizer.ggml.suffix_token_id": 11,
          "tokenizer.ggml.fim_mid_token_id": 12}
    assert fim_tokens(md, qwen) == FimTokens(10, 11, 12, 903, 904, 905)
    codellama = Vocab(["▁<PRE>", "▁<SUF>", "▁<MID>"])
    assert fim_tokens({}, codellama) == FimTokens(900, 901, 902)
    assert fim_tokens({}, Vocab(["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>"])).rep == 903
    assert fim_tokens({}, Vocab(["<|fim_prefix|>", "<|fim_suffix|>"])) is None   # no middle: cannot infill
    assert fim_tokens({}, Vocab(["<repo_name>", "<file_sep>"])) is None          # SmolLM2's vocabulary


def _enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_the_infill_prompt_layout_and_its_cuts() -> None:
    v = Vocab(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"])
    fim = fim_tokens({}, v)
    assert fim is not None
    PRE, SUF, MID, REP, SEP = 900, 901, 902, 904, 905
    ids = infill_ids(v, fim, "def f(", "):", extra=[{"filename": "a.py", "text": "X = 1\n"}], prompt="x",
                     n_ctx=4096, n_predict=64)
    assert ids == ([REP] + _enc("myproject\n") + [SEP] + _enc("a.py\n") + _enc("X = 1\n") + [SEP] + _enc("filename\n")
                   + [PRE] + _enc("def f(") + _enc("x") + [SUF] + _enc("):") + [MID])
    assert infill_ids(v, fim, "def f(", "):", n_ctx=4096, n_predict=64, repo_level=False) == \
        [PRE] + _enc("def f(") + [SUF] + _enc("):") + [MID]
    # a small context: the prefix keeps its end (3/4 of half the context), the suffix its beginning (1/4 less
    # the prompt and 2), the extra context its end (what the context holds beyond that, less 2 n_predict)
    ids = infill_ids(v, fim, "a" * 100 + "b" * 20, "c" * 10 + "d" * 100, extra=[{"filename": "f", "text": "e" * 500}],
                     n_ctx=128, n_predict=10)
    pre, suf = ids.index(PRE), ids.index(SUF)
    assert ids[pre + 1:suf] == _enc("a" * 28 + "b" * 20)          # 3 * (64 // 4) = 48 tokens
    assert ids[suf + 1:-1] == _enc("c" * 10 + "d" * 4)            # 64 // 4 - 2 = 14 tokens
    assert ids[:pre] == _enc("e" * 34) + [SEP] + _enc("filename\n")   # the last 128 - 64 - 20 = 44 tokens
    assert len(ids) + 10 <= 128
    with pytest.raises(InvalidRequest, match="repo_level"):
        infill_ids(v, fim, "", "", extra=[{"text": "x"}], n_ctx=64, n_predict=4, repo_level=False)


def test_end_rules() -> None:
    assert end_rules("def f(x):\n    return ", "\n\nprint(f(1))\n") == (["\nprint(f(1))"], 4)
    assert end_rules("x = ", "") == ([], 0)
    assert end_rules("class A:\n\tdef g(self):\n\t\t", "  \n\t\treturn 1") == (["\n\t\treturn 1"], 2)


class Chars:
    """A tokenizer of one token per character (token 0 ends a generation)."""

    eog_ids = {0}

    def stream_decoder(self) -> Any:
        class D:
            def feed(self, i: int) -> str:
                return chr(i)

            def flush(self) -> str:
                return ""

        return D()


def _run(text: str, **kw: Any) -> tuple[str, str, Generation]:
    import numpy as np

    gen = Generation([1], Chars(), params=SamplingParams(temperature=0), max_tokens=1000, n_ctx=2000,
                     n_vocab=256, **kw)
    out = []
    for c in text + "\0":
        row = np.full(256, -1e9, np.float32)
        row[ord(c)] = 0
        d = gen.step(row)
        if d is not None:
            out.append(d.text)
        if gen.done:
            break
    return "".join(out), gen.finish_reason or "", gen


def test_a_dedent_ends_the_text_before_its_line() -> None:
    body = "if x:\n        y = 1\n    z = 2\n\n  \nw = 3\nmore"
    text, reason, gen = _run(body, min_indent=4)
    assert (text, reason, gen.dedented) == ("if x:\n        y = 1\n    z = 2\n\n  ", "stop", True)
    # blank and whitespace-only lines are no dedent; without the rule nothing is cut
    assert _run(body)[0] == body
    text, reason, gen = _run("a\n\n    b\n\t\tc", min_indent=2)
    assert text == "a\n\n    b\n\t\tc" and not gen.dedented
    # whichever comes first ends it: a stop string (reported) or a dedent
    text, _, gen = _run("ab STOP\ncd", min_indent=1, stops=["STOP"])
    assert text == "ab " and gen.stop_word == "STOP" and not gen.dedented
    text, _, gen = _run("ab\nSTOP\ncd", min_indent=1, stops=["STOP"])
    assert text == "ab" and gen.stop_word is None and gen.dedented


@pytest.fixture(scope="module")
def qwen(qwen05_gguf: Path) -> Any:
    return barellm.load(qwen05_gguf, slots=1, context=2048)


@pytest.mark.model
def test_qwen_infill_prompts_are_spelled_out(qwen: Any) -> None:
    tok = qwen.tokenizer
    assert qwen.fim == FimTokens(*(tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                                                                 "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")))

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=False)

    def sp(text: str) -> list[int]:
        i = tok.token_to_id(text)
        assert i is not None
        return [i]

    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))  # <|fim_pad|> is text here\n"
    plain = sp("<|fim_prefix|>") + enc(prefix) + sp("<|fim_suffix|>") + enc(suffix) + sp("<|fim_middle|>")
    assert qwen.infill_prompt(prefix, suffix, repo_level=False) == plain   # OpenAI's suffix
    assert qwen.detokenize(plain) == f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    repo = (sp("<|repo_name|>") + enc("myproject\n") + sp("<|file_sep|>") + enc("util.py\n") + enc(extra[0]["text"])
            + sp("<|file_sep|>") + enc("filename\n") + plain)
    assert qwen.infill_prompt(prefix, suffix, extra=extra) == repo         # /infill, Model.infill
    assert qwen.infill_prompt(prefix, suffix) == (
        sp("<|repo_name|>") + enc("myproject\n") + sp("<|file_sep|>") + enc("filename\n") + plain)


HOLES = [   # (prefix, suffix): Python with a hole in it
    ("def fib(n):\n    if n < 2:\n        return n\n    ", "\n\nprint(fib(10))\n"),
    ("def is_even(n: int) -> bool:\n    return ", "\n\n\nassert is_even(4)\n"),
    ("import math\n\ndef circle_area(r):\n    ", "\n\n\nprint(circle_area(2.0))\n"),
    ("def reverse_words(s: str) -> str:\n    words = s.split()\n    ", "\n    return ' '.join(words)\n"),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        ",
     "\n\n    def pop(self):\n        return self.items.pop()\n"),
    ("def total(prices):\n    s = 0\n    for p in prices:\n        ", "\n    return s\n"),
    ("def greet(name):\n    message = ", "\n    return message\n\n\nprint(greet('Ann'))\n"),
    ("def clamp(x, lo, hi):\n    if x < lo:\n        return lo\n    ", "\n    return x\n"),
    ("def count_vowels(text):\n    ", "\n\n\nprint(count_vowels('banana'))\n"),
    ("def maximum(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        ", "\n    return best\n"),
]


def _fills_compile(model: Any, holes: list[tuple[str, str]]) -> None:
    for prefix, suffix in holes:
        c = model.complete_infill(prefix, suffix, max_tokens=64, temperature=0)
        assert c.finish_reason == "stop" and c.text.strip(), (prefix, c.text)
        compile(prefix + c.text + suffix, "<fill>", "exec")


@pytest.mark.model
def test_the_0_5b_fills_holes_with_code_that_compiles(qwen: Any) -> None:
    _fills_compile(qwen, HOLES[:6])


@pytest.mark.slow
def test_the_1_5b_fills_holes_with_code_that_compiles(qwen15_gguf: Path) -> None:
    _fills_compile(barellm.load(qwen15_gguf, context=2048), HOLES)


@pytest.mark.model
def test_infill_endpoint_and_suffix_on_the_server(qwen05_gguf: Path) -> None:
    import httpx
    import openai
    from test_server import serving

    from barellm.serve.app import create_app

    model = barellm.load(qwen05_gguf, slots=1, context=2048)
    prefix, suffix = HOLES[0]
    expected = model.infill_prompt(prefix, suffix)
    c = model.complete_infill(prefix, suffix, max_tokens=40, temperature=0)
    direct, model_reason = c.text, c.finish_reason
    bare = model.create_completion(prefix, suffix=suffix, max_tokens=40, temperature=0)["choices"][0]["text"]
    app = create_app(model, model_id="coder")
    with serving(app) as url:
        body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 40, "temperature": 0}
        r = httpx.post(f"{url}/infill", json=body, timeout=120).json()
        from barellm.serve.openapi_doc import Infill

        Infill.model_validate(r)
        assert r["stop"] is True and r["tokens_evaluated"] == len(expected)
        # the fill ended by itself, at the dedent that closes the if/else block: no limit cut it
        assert (r["stop_type"], r["stopping_word"]) == ("eos", "") and r["tokens_predicted"] < 40, r
        assert model_reason == "stop"
        compile(prefix + r["content"] + suffix, "<fill>", "exec")
        # the prompt it fed is exactly llama.cpp server's layout: the slot's cache holds it
        assert app.state.server.scheduler.slot_tokens[0][:len(expected)] == expected
        # streamed: the same text in pieces, then the closing object
        events = []
        with httpx.stream("POST", f"{url}/infill", json={**body, "stream": True}, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
        assert "".join(e["content"] for e in events) == r["content"]
        assert r["content"] == direct   # the server's fill is the Python API's
        # OpenAI's suffix: the bare FIM prompt, the same fill as the Python API's create_completion
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        c = client.completions.create(model="coder", prompt=prefix, suffix=suffix, max_tokens=40, temperature=0)
        assert c.choices[0].text == bare
        plain = model.infill_prompt(prefix, suffix, repo_level=False)
        assert c.usage.prompt_tokens == len(plain)
        assert app.state.server.scheduler.slot_tokens[0][:len(plain)] == plain
        s = "".join(ch.choices[0].text for ch in client.completions.create(
            model="coder", prompt=prefix, suffix=suffix, max_tokens=40, temperature=0, stream=True))
        assert s == bare
        compile(prefix + bare + suffix, "<fill>", "exec")
        r = httpx.post(f"{url}/infill", json={**body, "input_extra": [{"filename": "m.py", "text": "A = 1\n"}],
                                              "n_indent": 4, "samplers": ["top_k"], "t_max_predict_ms": 500})
        assert r.status_code == 200
        r = httpx.post(f"{url}/infill", json={**body, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        # why a fill ended: a stop string (here the suffix's first line, written again), or n_predict
        greet_prefix, greet_suffix = HOLES[6]
        r = httpx.post(f"{url}/infill", timeout=120, json={"input_prefix": greet_prefix, "input_suffix": greet_suffix,
                                                           "n_predict": 40, "temperature": 0}).json()
        assert (r["stop_type"], r["stopping_word"]) == ("word", "\n    return message"), r
        r = httpx.post(f"{url}/infill", timeout=120, json={**body, "n_predict": 3}).json()
        assert (r["stop_type"], r["tokens_predicted"]) == ("limit", 3), r


@pytest.mark.model
def test_infill_without_fim_tokens_is_refused(smollm_gguf: Path) -> None:
    m = barellm.load(smollm_gguf)
    with pytest.raises(InvalidRequest, match="cannot infill") as e:
        m.infill("def f(", "):")
    assert str(e.value).startswith("smollm2-135m has no fill-in-the-middle tokens")   # the model, not a cache file
    with pytest.raises(InvalidRequest, match="cannot infill"):
        m.create_completion("def f(", suffix="):")
