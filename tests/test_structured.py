"""Constrained decoding (structured.py): llguidance's view of barellm's tokenizers, grammars checked when they
are made, the mask at every step of a Generation; and the server's response_format / grammar / regex with the
official `openai` client on the real models, every answer validated against its JSON schema."""

from __future__ import annotations

import builtins
import concurrent.futures
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import in_own_home
from tiny_model import write_tiny_llama

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import barellm  # noqa: E402
from barellm.errors import InvalidRequest  # noqa: E402
from barellm.generate import structured  # noqa: E402
from barellm.generate.sampling import mask_bits  # noqa: E402

OWN_MODELS = ("tiny",)   # the model this module writes: its tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, scratch_home: Path) -> Any:
    """A random tiny model: its choices are noise, so whatever it writes under a constraint is the mask's doing."""
    with in_own_home(scratch_home):
        return barellm.load(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tied=False), slots=2)


# --- the vocabulary -------------------------------------------------------------------------------------

def test_vocabulary_is_the_tokenizers(tiny: Any) -> None:
    v = tiny.structured()
    tok = tiny.tokenizer
    assert v is tiny.structured()   # built once per model
    assert v.n_vocab == tiny.config.n_vocab and v.words == (v.n_vocab + 31) // 32
    assert v.eog == sorted(tok.eog_ids)
    assert v.special == frozenset({0, 1, 2})   # the ChatML control tokens, and nothing else
    # llguidance decodes every token to the bytes barellm's tokenizer gives it, but for the lone byte 0xFF:
    # llguidance's marker of special tokens, never part of UTF-8 text, so no grammar could match it anyway
    for i in range(3, v.n_vocab):
        b = tok.token_bytes(i)
        assert v.ll.decode_bytes([i]) == (b"" if b.startswith(b"\xff") else b), i
    text = 'Hello {"the": 1}'
    assert v.ll.tokenize_str(text) == tok.encode(text)


def test_a_grammar_checks_what_it_is_given(tiny: Any) -> None:
    v = tiny.structured()
    with pytest.raises(InvalidRequest, match=r"json_schema: unsupported JSON schema keyword\(s\).*uniqueItems"):
        v.json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(InvalidRequest, match="Unknown format: postcode"):
        v.json_schema({"type": "string", "format": "postcode"})
    with pytest.raises(InvalidRequest, match="look-around"):
        v.json_schema({"type": "string", "pattern": "(?=a)b"})
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        v.json_schema("{nope")
    with pytest.raises(InvalidRequest, match="regex.*unclosed group"):
        v.regex("a(b")
    with pytest.raises(InvalidRequest, match='unknown name: "foo"'):
        v.lark("start: foo")
    with pytest.raises(InvalidRequest, match="give one"):
        v.from_options(json_schema={}, regex="a")
    with pytest.raises(InvalidRequest, match="response_format.type"):
        v.response_format({"type": "yaml"})
    assert v.response_format({"type": "text"}) is None
    g = v.json_schema({"type": "boolean"})
    assert v.json_schema({"type": "boolean"}) is g   # compiled once
    assert g.accepts(tiny.tokenizer.encode("true")) and not g.accepts(tiny.tokenizer.encode("tru"))


def test_without_llguidance_a_constraint_is_a_clear_error(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_llguidance(name: str, *args: Any, **kw: Any) -> Any:
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    monkeypatch.delattr(tiny, "_structured_vocab", raising=False)
    assert not structured.available()
    with pytest.raises(structured.StructuredUnavailable, match=r"pip install 'barellm\[structured\]'"):
        tiny.generate("x", json_schema={"type": "object"}, max_tokens=4)
    assert isinstance(tiny.generate("x", max_tokens=2, temperature=0), str)   # the rest works as before


# --- every step follows the grammar, whatever the model wants --------------------------------------------

FINITE = {   # languages with no unbounded part: a random model must finish inside them
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 40},
                   "color": {"enum": ["red", "green", "blue"]},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                   "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}},
    "required": ["ok", "n", "color", "tags", "code"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(6))
def test_a_random_model_writes_valid_json_under_a_schema(tiny: Any, seed: int) -> None:
    c = tiny.complete("x", json_schema=FINITE, max_tokens=400, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0,
                      seed=seed)
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), FINITE)


@pytest.mark.parametrize(("kw", "check"), [
    ({"regex": r"(cat|dog)s? [0-9]{2}"}, r"(cat|dog)s? [0-9]{2}"),
    ({"grammar": 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'}, r"\([a-c]{1,3}(,[a-c]{1,3})*\)"),
    ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, r"yes|no|maybe"),   # GBNF
])
def test_a_random_model_matches_a_regex_or_grammar(tiny: Any, kw: dict[str, Any], check: str) -> None:
    import re

    for seed in range(4):
        c = tiny.complete("x", **kw, max_tokens=60, temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        assert c.finish_reason == "stop" and re.fullmatch(check, c.text), c.text


def test_every_mask_is_the_grammars_and_the_next_is_computed_in_the_background(tiny: Any) -> None:
    g = tiny.structured().json_schema(FINITE)
    seen = []

    def allowed(tokens: list[int]) -> np.ndarray:   # the oracle: the same grammar, one fresh parse per step
        m = g.guide(background=False)
        for t in tokens:
            m.accept(t)
        mask = m.mask().copy()
        seen.append(mask)
        return mask

    ref = tiny.complete("x", allowed_tokens=allowed, max_tokens=300, temperature=1.0, top_k=0, seed=3)
    out = tiny.complete("x", json_schema=FINITE, max_tokens=300, temperature=1.0, top_k=0, seed=3)
    assert out.token_ids == ref.token_ids and out.text == ref.text
    # and each step allowed exactly what the grammar allows: the token taken, never anything outside
    for mask, tok in zip(seen, ref.token_ids, strict=False):
        assert mask_bits(mask, tiny.config.n_vocab)[tok]
    assert out.timings is not None and out.timings.seconds["grammar"] > 0


def test_n_choices_each_follow_the_grammar(tiny: Any) -> None:
    c = tiny.complete("x", json_schema=FINITE, n=2, max_tokens=400, temperature=1.5, top_k=0, seed=11)
    for ch in c.choices:
        jsonschema.validate(json.loads(ch.text), FINITE)


# --- the server, with the openai client, on the real models -------------------------------------------

SCHEMAS: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe Ann Smith, 31, who lives at 5 Main Street, Springfield.",
     {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
         "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                      "city": {"type": "string", "maxLength": 30}},
                     "required": ["street", "city"], "additionalProperties": False}},
      "required": ["name", "age", "address"], "additionalProperties": False}),
    ("fruits", "List three fruits.",
     {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 2, "maxItems": 4,
                                                  "items": {"type": "string", "maxLength": 15}}},
      "required": ["fruits"], "additionalProperties": False}),
    ("sentiment", "Classify the sentiment of: 'I love this phone!'",
     {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
      "required": ["sentiment"], "additionalProperties": False}),
    ("book", "Describe the book 1984 by George Orwell. The subtitle is optional.",
     {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "author": {"type": "string", "maxLength": 40},
                                       "subtitle": {"type": "string", "maxLength": 40},
                                       "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
      "required": ["title", "author"], "additionalProperties": False}),
    ("rating", "Rate the movie Jaws from 1 to 10.",
     {"type": "object", "properties": {"movie": {"type": "string", "maxLength": 30},
                                       "score": {"type": "integer", "minimum": 1, "maximum": 10}},
      "required": ["movie", "score"], "additionalProperties": False}),
    ("temperature", "Give the temperature of a hot summer day in Celsius.",
     {"type": "object", "properties": {"celsius": {"type": "number", "exclusiveMinimum": -50,
                                                   "exclusiveMaximum": 60}},
      "required": ["celsius"], "additionalProperties": False}),
    ("sku", "Make up a product code made of three capital letters, a dash and three digits.",
     {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
      "required": ["code"], "additionalProperties": False}),
    ("flags", "Is water wet? Is fire cold?",
     {"type": "object", "properties": {"water_is_wet": {"type": "boolean"}, "fire_is_cold": {"type": "boolean"}},
      "required": ["water_is_wet", "fire_is_cold"], "additionalProperties": False}),
    ("team", "Describe a team of two people with their roles.",
     {"type": "object", "properties": {"members": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
         "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "role": {"type": "string", "maxLength": 20}},
         "required": ["name", "role"], "additionalProperties": False}}},
      "required": ["members"], "additionalProperties": False}),
    ("matrix", "Write the 2 by 2 identity matrix.",
     {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
      "required": ["rows"], "additionalProperties": False}),
    ("version", "Report the API version.",
     {"type": "object", "properties": {"api": {"const": "v1"}, "build": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99999}},
      "required": ["api", "build"], "additionalProperties": False}),
    ("id", "Give an order id; it may be a number or a string.",
     {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10 ** 6},
                                                       {"type": "string", "maxLength": 12}]}},
      "required": ["id"], "additionalProperties": False}),
    ("refs", "Describe a line from point (0, 0) to point (3, 4).",
     {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                                         "y": {"type": "integer", "minimum": -99, "maximum": 99}},
                          "required": ["x", "y"], "additionalProperties": False}},
      "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
      "required": ["start", "end"], "additionalProperties": False}),
    ("date", "When did the first moon landing happen?",
     {"type": "object", "properties": {"event": {"type": "string", "maxLength": 30},
                                       "date": {"type": "string", "format": "date"}},
      "required": ["event", "date"], "additionalProperties": False}),
    ("nickname", "Suggest a nickname for a cat.",
     {"type": "object", "properties": {"nickname": {"type": "string", "minLength": 3, "maxLength": 12}},
      "required": ["nickname"], "additionalProperties": False}),
    ("point", "Give the coordinates (latitude, longitude) of Paris as a pair.",
     {"type": "object", "properties": {"coords": {"type": "array", "prefixItems": [
         {"type": "number", "minimum": -90, "maximum": 90}, {"type": "number", "minimum": -180, "maximum": 180}],
         "items": False, "minItems": 2, "maxItems": 2}},
      "required": ["coords"], "additionalProperties": False}),
    ("nullable", "Describe a user who has no middle name.",
     {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                       "middle": {"type": ["string", "null"], "maxLength": 20}},
      "required": ["first", "middle"], "additionalProperties": False}),
    ("dice", "Roll two dice.",
     {"type": "object", "properties": {"dice": {"type": "array", "minItems": 2, "maxItems": 2,
                                                "items": {"enum": [1, 2, 3, 4, 5, 6]}}},
      "required": ["dice"], "additionalProperties": False}),
    ("contact", "Give a contact email for a support team.",
     {"type": "object", "properties": {"team": {"type": "string", "maxLength": 20},
                                       "email": {"type": "string", "format": "email", "maxLength": 40}},
      "required": ["team", "email"], "additionalProperties": False}),
    ("steps", "List the first steps to make tea.",
     {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 30}}),
    ("even", "Pick an even number between 10 and 20.",
     {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 2, "minimum": 10, "maximum": 20}},
      "required": ["n"], "additionalProperties": False}),
    ("price", "Price a coffee in euros with its currency.",
     {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0, "maximum": 100},
                                       "currency": {"enum": ["EUR", "USD"]}, "note": {"type": "string",
                                                                                      "maxLength": 20}},
      "required": ["amount", "currency"], "additionalProperties": False}),
]


@pytest.fixture(scope="module", params=[pytest.param("qwen2.5-coder-0.5b", id="qwen0.5b"),
                                        pytest.param("smollm2-135m", id="smollm2")])
def served(request: pytest.FixtureRequest) -> Any:
    from test_server import serving

    from barellm.serve.app import create_app

    model = barellm.load(request.param, slots=2, context=1024)
    with serving(create_app(model, model_id=request.param)) as url:
        yield url, request.param


def _ask(client: Any, model: str, prompt: str, schema: dict[str, Any], stream: bool) -> tuple[str, str]:
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    msgs = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=120,
                                           temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = [], None
    for ch in client.chat.completions.create(model=model, messages=msgs, response_format=rf, max_tokens=120,
                                             temperature=0, stream=True):
        if ch.choices:
            text.append(ch.choices[0].delta.content or "")
            reason = ch.choices[0].finish_reason or reason
    return "".join(text), reason


@pytest.mark.model
def test_json_schemas_with_the_openai_client(served: Any) -> None:
    """Every answer, streamed or not, parses and validates against its schema; the two run side by side
    (batched) and, greedy, agree to the character."""
    import openai

    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    assert len(SCHEMAS) >= 20
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for name, prompt, schema in SCHEMAS:
            whole = pool.submit(_ask, client, model, prompt, schema, False)
            streamed = pool.submit(_ask, client, model, prompt, schema, True)
            (text, reason), (s_text, s_reason) = whole.result(), streamed.result()
            assert reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
            assert (s_text, s_reason) == (text, reason), name


@pytest.mark.model
def test_json_object_regex_and_grammar_with_the_openai_client(served: Any) -> None:
    import openai

    url, model = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A JSON object about a dog"}],
                                       response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:   # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"regex": " ?(yes|no)"})
    assert r.choices[0].text.strip() in ("yes", "no") and r.choices[0].finish_reason == "stop"
    gbnf = 'root ::= " " c ", " c ", " c\nc ::= "red" | "green" | "blue"'
    r = client.completions.create(model=model, prompt="Three primary colors:", max_tokens=20, temperature=0,
                                  extra_body={"grammar": gbnf})
    assert [x.strip() for x in r.choices[0].text.split(",")] and r.choices[0].finish_reason == "stop"
    for x in r.choices[0].text.split(","):
        assert x.strip() in ("red", "green", "blue")
    r = client.completions.create(model=model, prompt='A JSON object whose key "a" holds a digit: ', max_tokens=40,
                                  temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "x", "schema": {"type": "object", "properties": {"a": {
                                          "type": "integer", "minimum": 1, "maximum": 9}},
                                          "required": ["a"], "additionalProperties": False}}}})
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].text)["a"] in range(1, 10)


@pytest.mark.model
def test_an_unsupported_schema_is_a_400_naming_it(served: Any) -> None:
    import httpx

    url, model = served
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema" and "uniqueItems" in err["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "regex": "(?<=a)b"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"


def test_constraint_keywords_of_the_python_api(tiny: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="both constrain"):
        tiny.generate("x", json_schema={}, allowed_tokens=np.zeros(10, np.uint32))
    # llguidance's own options ride in the schema: here no whitespace at all, so the noise fits the context
    compact = {"x-guidance": {"whitespace_flexible": False}, **FINITE}
    out = tiny.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=200, temperature=1.0, seed=2,
                                      response_format={"type": "json_schema", "json_schema": {"schema": compact}})
    text = out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop" and not any(c.isspace() for c in text)
    jsonschema.validate(json.loads(text), FINITE)
    pieces = list(tiny.chat_stream([{"role": "user", "content": "hi"}], json_schema=compact, max_tokens=200,
                                   temperature=1.0, seed=2))
    assert "".join(pieces) == out["choices"][0]["message"]["content"]
