"""The server's request models (pydantic): what they accept, how an error names what is wrong, the
features refused until implemented, and the OpenAPI document generated from them; the real server's
responses are held to the response models the document describes."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from test_server import MODEL_ID  # noqa: E402
from test_server import server as server  # noqa: E402  (this module's real server)

from barellm.serve import ollama, openapi_doc, schemas  # noqa: E402
from barellm.serve.errors import ApiError  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
N_VOCAB = 1000


def _chat(**fields: Any) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def _error(fn: Any, raw: bytes, *args: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(raw, *args)
    assert e.value.status == 400
    return e.value


def test_a_valid_request_becomes_the_scheduler_request() -> None:
    req = schemas.chat_request(_chat(
        max_tokens=16.0, temperature=0, top_p=0, top_k=5, seed=-1, stop="\n", stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=3, n=1, tools=[], tool_choice="none",
        response_format={"type": "text"}, logit_bias={}, metadata={"a": [1, {"b": None}]},
        messages=[{"role": "developer",
                   "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                  {"role": "user", "content": "hi", "name": "ann"},
                  {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": []}]))
    assert req.kind == "chat" and req.max_tokens == 16 and isinstance(req.max_tokens, int)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}]
    p = req.params
    assert p.temperature == 0 and p.top_p == 1e-9 and p.top_k == 5 and p.seed == (1 << 64) - 1
    assert req.stops == ["\n"] and req.stream and req.include_usage and req.top_logprobs == 3
    # defaults are barellm's sampling defaults, not OpenAI's
    d = schemas.chat_request(_chat()).params
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.8, 0.95, 40, 0.05)

    c = schemas.completion_request(json.dumps({"prompt": [[1, 2, 3]], "logprobs": 2, "echo": False,
                                               "suffix": "", "best_of": 1}).encode(), N_VOCAB)
    assert c.kind == "completion" and c.prompt == [1, 2, 3] and c.top_logprobs == 2
    assert schemas.completion_request(b'{"prompt": ["abc"]}', N_VOCAB).prompt_text == "abc"   # tokenized with the model


@pytest.mark.parametrize(("fields", "param", "code", "words"), [
    ({"max_token": 5}, "max_token", "unknown_parameter", "unrecognized request argument: max_token"),
    ({"max_tokens": "10"}, "max_tokens", None, "integer, got string"),
    ({"max_tokens": True}, "max_tokens", None, "integer, got boolean"),
    ({"max_tokens": 1.5}, "max_tokens", None, "integer"),
    ({"max_tokens": 0}, "max_tokens", None, ">= 1"),
    ({"temperature": 2.5}, "temperature", None, "<= 2"),
    ({"seed": 2**70}, "seed", None, f"<= {2**64 - 1}"),
    ({"stop": ["a"] * 17}, "stop", None, "at most 16 items"),
    ({"stop": 5}, "stop", None, "a string or an array of strings"),
    ({"stream_options": {"include_usage": True}}, "stream_options", None, "only allowed when stream is true"),
    ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus", "unknown_parameter", "bogus"),
    ({"messages": []}, "messages", None, "at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None, "'user'"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra", "unknown_parameter", "extra"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None, "text parts, got number"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", None, "'text'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", None, "is required"),
    ({"max_tokens": 3, "max_completion_tokens": 7}, "max_completion_tokens", None, "disagree"),
    ({"top_logprobs": 2}, "top_logprobs", None, "needs logprobs"),
])
def test_an_error_names_the_field(fields: dict[str, Any], param: str, code: str | None, words: str) -> None:
    err = _error(schemas.chat_request, _chat(**fields))
    assert err.param == param and err.code == code
    assert words in err.message and param.split(".")[-1].split("[")[0] in err.message


@pytest.mark.parametrize(("raw", "words"), [
    (b"", "empty"), (b"[]", "must be a JSON object"), (b"{", "not valid JSON"), (b"[" * 100000, "not valid JSON"),
    (b'{"temperature": NaN, "messages": []}', "temperature"), (b'{"top_p": 1e400}', "top_p"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON"),   # a lone surrogate
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"), (b"\xff\xfe", "not valid JSON"),
])
def test_hostile_bodies(raw: bytes, words: str) -> None:
    assert words in _error(schemas.chat_request, raw).message


@pytest.mark.parametrize(("fields", "param"), [
    ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"messages": [{"role": "assistant", "content": "", "audio": {"id": "x"}}]}, "messages[0].audio"),
])
def test_unimplemented_features_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    err = _error(schemas.chat_request, _chat(**fields))
    assert (err.param, err.code) == (param, "unsupported_parameter")
    assert "not supported" in err.message


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_and_formats_become_the_scheduler_request() -> None:
    req = schemas.chat_request(_chat(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]))
    assert req.tools == [TOOL] and req.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert req.parallel_tool_calls is False and req.constraint is None
    assert req.messages == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    c = schemas.chat_request(_chat(response_format=rf)).constraint
    assert c == schemas.Constraint("json_schema", schema, "response_format.json_schema.schema")
    assert schemas.chat_request(_chat(response_format={"type": "json_object"})).constraint.kind == "json_object"
    assert schemas.chat_request(_chat(response_format={"type": "text"})).constraint is None
    c = schemas.completion_request(json.dumps({"prompt": "x", "regex": "a+"}).encode(), N_VOCAB).constraint
    assert c == schemas.Constraint("regex", "a+", "regex")
    req = schemas.completion_request(json.dumps({"prompt": "def f(", "suffix": "):"}).encode(), N_VOCAB)
    assert req.suffix == "):"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),                                     # no tools
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [TOOL, TOOL]}, "tools"),                                               # a name defined twice
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),            # two constraints
    ({"grammar": "start: x", "json_schema": {}}, "grammar"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
])
def test_tool_and_format_mistakes_are_named(fields: dict[str, Any], param: str) -> None:
    err = _error(schemas.chat_request, _chat(**fields))
    assert err.param == param, err.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"nam": "f"}}]}, "tools[0].function.nam"),
    ({"tools": [{"type": "web", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].type"),
    ({"logit_bias": {"1": 500}}, "logit_bias.1"),
    ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"logit_bias": {"1": "5"}}, "logit_bias.1"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
])
def test_coming_features_are_validated_by_their_shape(fields: dict[str, Any], param: str) -> None:
    err = _error(schemas.chat_request, _chat(**fields))
    assert err.param == param and err.code != "unsupported_parameter", err.message


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"prompt": ["a", "b"]}, "prompt", "unsupported_parameter"),
    ({"prompt": [5, N_VOCAB]}, "prompt", None),
    ({"prompt": [1.5]}, "prompt[0]", None),
    ({"prompt": [1, 2], "suffix": "tail"}, "suffix", None),
    ({"prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
    ({"prompt": "x", "logprobs": True}, "logprobs", None),
    ({}, "prompt", None),
])
def test_completion_errors(body: dict[str, Any], param: str, code: str | None) -> None:
    err = _error(schemas.completion_request, json.dumps(body).encode(), N_VOCAB)
    assert (err.param, err.code) == (param, code), err.message


def test_openapi_is_generated_from_the_models() -> None:
    doc = openapi_doc.openapi("1.2.3")
    assert doc["openapi"] == "3.1.0" and doc["info"]["version"] == "1.2.3"
    comp = doc["components"]["schemas"]
    chat = comp["ChatCompletionRequest"]
    # exactly the model's fields, closed to others: the document and the validation cannot drift apart
    fields = {f.alias or name for name, f in schemas.ChatCompletionRequest.model_fields.items()}
    assert set(chat["properties"]) == fields and chat["additionalProperties"] is False
    assert chat["required"] == ["messages"]
    assert set(comp["CompletionRequest"]["properties"]) >= {"prompt", "suffix", "echo", "logprobs", "stop"}
    # every reference resolves
    refs: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "$ref" in x:
                refs.append(x["$ref"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    assert refs
    for r in refs:
        assert r.startswith("#/components/schemas/") and r.split("/")[-1] in comp, r
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert op["responses"]["200"], path


@pytest.mark.model
def test_responses_match_the_documented_models(server: Any) -> None:
    """Every response shape the server sends validates against the model the OpenAPI document shows
    (the response models forbid fields they do not list)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
        openapi_doc.ChatCompletion.model_validate(c.post("/v1/chat/completions", json=body).json())
        openapi_doc.ChatCompletion.model_validate(
            c.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": 2}).json())
        with c.stream("POST", "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 3
        for chunk in chunks:
            openapi_doc.ChatCompletionChunk.model_validate(chunk)
        comp = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 2}
        openapi_doc.Completion.model_validate(c.post("/v1/completions", json=comp).json())
        with c.stream("POST", "/v1/completions", json={**comp, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    openapi_doc.Completion.model_validate(json.loads(line[6:]))
        openapi_doc.ModelList.model_validate(c.get("/v1/models").json())
        openapi_doc.ModelCard.model_validate(c.get(f"/v1/models/{MODEL_ID}").json())
        openapi_doc.Tokens.model_validate(c.post("/tokenize", json={"content": "Hi"}).json())
        openapi_doc.Tokens.model_validate(c.post("/tokenize", json={"content": "Hi", "with_pieces": True}).json())
        openapi_doc.Text.model_validate(c.post("/detokenize", json={"tokens": [1, 2]}).json())
        openapi_doc.Health.model_validate(c.get("/health").json())
        r = c.post("/v1/chat/completions", json={**body, "max_token": 3})
        assert r.status_code == 400
        openapi_doc.Error.model_validate(r.json())
        r = c.post("/v1/embeddings", json={"model": MODEL_ID, "input": ["Hi", "there"]})
        assert r.status_code == 200
        openapi_doc.EmbeddingList.model_validate(r.json())
        r = c.post("/v1/embeddings", json={"input": [[1, 2, 3]], "encoding_format": "base64"})
        openapi_doc.EmbeddingList.model_validate(r.json())
        assert c.post("/v1/embeddings", json={"inputs": "Hi"}).json()["error"]["param"] == "inputs"  # not "input"
        r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
        assert r.status_code == 400 and "cannot infill" in r.json()["error"]["message"]   # SmolLM2 has no FIM
        doc = c.get("/openapi.json").json()
        assert doc == json.loads(json.dumps(openapi_doc.openapi(doc["info"]["version"], ollama.MODELS, ollama.PATHS)))
        assert {"/api/chat", "/api/generate", "/v1/chat/completions"} <= set(doc["paths"])
        assert "OllamaChatRequest" in doc["components"]["schemas"]


def test_n_and_logit_bias_are_read() -> None:
    req = schemas.chat_request(_chat(n=3, logit_bias={"5": -100, "17": 2.5}))
    assert req.n == 3 and req.params.logit_bias == {5: -100.0, 17: 2.5}
    req = schemas.chat_request(_chat(logit_bias={}))
    assert req.n == 1 and req.params.logit_bias is None
    err = _error(schemas.chat_request, _chat(logit_bias={str(i): 1 for i in range(301)}))
    assert err.param == "logit_bias"
