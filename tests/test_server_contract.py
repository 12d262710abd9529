"""The server keeps its own contract: what it documents in /openapi.json is what it does.

Impossible output constraints are refused with the request; a constraint that dead-ends later says so in
the finish reason; routing errors come before content-type errors; messages name the real problem; and
schemathesis, generating requests from the document itself, finds no response the document does not
allow (tests/test_server_connections.py holds the socket-level rules)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from barellm.serve.app import create_app  # noqa: E402

MODEL_ID = "smollm2-135m"


@pytest.fixture(scope="module")
def client(smollm_gguf: Path) -> Iterator[TestClient]:
    import barellm

    model = barellm.load(smollm_gguf, slots=2, context=256)
    app = create_app(model, model_id=MODEL_ID, timeout=60)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


# --- impossible constraints ------------------------------------------------------------------------

_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.model
@pytest.mark.parametrize("extra,param", [
    ({"grammar": "root ::= root"}, "grammar"),
    ({"response_format": _schema_format({"$ref": "#"})}, "response_format.json_schema.schema"),
    ({"response_format": _schema_format(_CYCLE)}, "response_format.json_schema.schema"),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "regex"),
    ({"json_schema": {"$ref": "#"}}, "json_schema"),
], ids=["grammar-self-loop", "schema-ref-root", "schema-ref-cycle", "regex-empty-class", "json-schema-ref-root"])
def test_impossible_constraint_is_a_400_naming_it(client: TestClient, extra: dict[str, Any], param: str) -> None:
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 8}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8})):
        err = _error(client.post(path, json={**body, **extra}))
        assert err["param"] == param, err
        assert "can never be satisfied" in err["message"] and err["message"].startswith(param), err


@pytest.mark.model
@pytest.mark.parametrize("pattern, repeats, at", [("a{1000000}", "1,000,000", "{1000000} at character 1"),
                                                 ("x(ab{1000}){11}", "11,000", "{11} at character 11")])
def test_an_oversized_regex_is_a_400_before_anything_runs(client: TestClient, pattern: str, repeats: str,
                                                          at: str) -> None:
    # compiled, it failed at the first masks: 200 with an empty reply and finish_reason constraint_failed
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 8}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8})):
        err = _error(client.post(path, json={**body, "regex": pattern}))
        assert err["param"] == "regex" and err["message"] == (
            f"regex: the repetition {at} asks for {repeats} repeats (nested counts multiplied); at most 10,000 "
            "are supported")
    # up to the limit it answers
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "regex": "(a{100}){100}"})
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    assert text and set(text) == {"a"}, text


@pytest.mark.model
def test_satisfiable_constraints_still_answer(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "regex": "[ab]{3}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and len(choice["text"]) == 3 and set(choice["text"]) <= {"a", "b"}


@pytest.mark.model
def test_constraint_that_dead_ends_later_says_so(client: TestClient) -> None:
    # "Hello" can begin it; the rule after it can never produce anything: the parser fails mid-way
    grammar = 'root ::= "Hello" loop\nloop ::= loop'
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "grammar": grammar,
                                                 "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            assert reasons[-1] == "constraint_failed"
        else:
            choice = r.json()["choices"][0]
            text = choice["text"]
            assert choice["finish_reason"] == "constraint_failed"
        assert text == "Hello"


# --- messages that name the real problem ---------------------------------------------------------

@pytest.mark.model
def test_too_many_logit_bias_entries_gives_the_count(client: TestClient) -> None:
    bias = {str(i): 1.0 for i in range(301)}
    err = _error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": bias}))
    assert err["param"] == "logit_bias"
    assert err["message"] == "logit_bias must have at most 300 entries, got 301"


@pytest.mark.model
def test_huge_schema_number_is_named(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**300}}}
    body = '{"prompt": "x", "max_tokens": 4, "response_format": ' + json.dumps(_schema_format(schema)) + "}"
    err = _error(client.post("/v1/completions", content=body, headers={"content-type": "application/json"}))
    assert err["param"] == "response_format.json_schema.schema"
    assert err["message"] == ("response_format.json_schema.schema.properties.n.minimum is an integer of 301 digits; "
                              "numbers in a schema must fit 64 bits (-2^63 .. 2^64-1)")
    assert "serializable" not in err["message"]


# --- routing before content type, one Host --------------------------------------------------------

def _fake_client() -> TestClient:
    from test_server import FakeEngine, FakeModel

    return TestClient(create_app(FakeModel(FakeEngine(n_slots=1))), raise_server_exceptions=False)


def test_wrong_method_is_405_and_unknown_path_404_whatever_the_body() -> None:
    with _fake_client() as c:
        for headers in ({}, {"content-type": "text/plain"}):
            err = _error(c.post("/health", content=b"x", headers=headers), 405)
            assert err["code"] == "method_not_allowed"
            err = _error(c.post("/no/such/route", content=b"x", headers=headers), 404)
            assert err["code"] == "not_found"
        # a route that takes a POST still wants JSON
        err = _error(c.post("/tokenize", content=b"x", headers={"content-type": "text/plain"}), 415)
        assert err["code"] == "unsupported_media_type"


def test_two_host_headers_are_a_400() -> None:
    with _fake_client() as c:
        r = c.get("/health", headers=[("host", "localhost"), ("host", "evil.example")])
        err = _error(r, 400)
        assert err["code"] == "duplicate_host" and "2 Host headers" in err["message"]
        assert c.get("/health").status_code == 200


_OLLAMA_POSTS = ("/api/chat", "/api/generate", "/api/show", "/api/pull", "/api/copy", "/api/embed", "/api/embeddings")


def test_ollama_routes_refuse_in_ollama_shape() -> None:
    """Ollama's routes answer every refusal as {"error": "message"}, the Guard's (415, 401) and the router's (405,
    404) included, as the document says; the OpenAI routes keep OpenAI's error object."""
    with _fake_client() as c:
        for path in _OLLAMA_POSTS:
            r = c.post(path, content=b"x", headers={"content-type": "text/plain"})
            assert r.status_code == 415, r.text
            assert r.json() == {"error": "the body must be JSON sent as Content-Type: application/json "
                                         "(got text/plain)"}
            assert r.headers["content-type"] == "application/json"
        assert c.get("/api/chat").json() == {"error": "GET is not allowed on /api/chat"}
        assert c.post("/api/nothing", json={}).json() == {"error": "no such endpoint: POST /api/nothing"}
        assert _error(c.post("/v1/completions", content=b"x"), 415)["code"] == "unsupported_media_type"
    from test_server import FakeEngine, FakeModel

    with TestClient(create_app(FakeModel(FakeEngine(n_slots=1)), api_key="k"), raise_server_exceptions=False) as c:
        r = c.post("/api/chat", json={"model": "m"})
        assert r.status_code == 401 and r.json() == {
            "error": "a valid API key is needed: send the header 'Authorization: Bearer KEY'"}
        assert _error(c.post("/v1/completions", json={"prompt": "x"}), 401)["code"] == "invalid_api_key"


@pytest.mark.model
def test_an_empty_embed_request_loads_the_model(client: TestClient) -> None:
    """As Ollama: /api/embed with no input (left out, "" or []) loads the model and answers no embeddings, and
    /api/embeddings with no prompt an empty one; an empty text among texts is refused, as the document says."""
    for extra in ({}, {"input": ""}, {"input": []}):
        r = client.post("/api/embed", json={"model": MODEL_ID, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == MODEL_ID and body["embeddings"] == [] and body["prompt_eval_count"] == 0
    r = client.post("/api/embeddings", json={"model": MODEL_ID})
    assert r.status_code == 200 and r.json() == {"embedding": []}
    r = client.post("/api/embed", json={"model": MODEL_ID, "input": ["a", ""]})
    assert r.status_code == 400 and r.json()["error"].startswith("input[1]"), r.text


# --- schemathesis over the whole document ---------------------------------------------------------

def _refetch(spare: Path, home: Path, name: str) -> None:
    """name's manifest and conversion put back into home from spare (a home _home_with made), where gone."""
    import os
    import shutil

    shutil.copytree(spare / "models" / name, home / "models" / name, dirs_exist_ok=True)
    for link in (spare / "blm").iterdir():
        if not (home / "blm" / link.name).exists():
            os.symlink(os.readlink(link), home / "blm" / link.name)


@pytest.fixture(scope="module")
def served_cache(tmp_path_factory, smollm_gguf: Path) -> Iterator[Any]:
    """`barellm serve` as the command builds it, with no model named: every model of a temporary BARELLM_HOME
    (SmolLM2, linked to the real cache's conversion) on demand, a context of 128 (short generations), two
    slots. /api/delete, /api/copy and /api/pull act on that home only, and a pull never reaches the network (one
    of a model in the cache succeeds, as it does there)."""
    from test_server_models import _home_with

    from barellm.__main__ import build_parser
    from barellm.errors import BarellmError
    from barellm.serve import build_app
    from barellm.store import catalog, hub

    home = _home_with(tmp_path_factory.mktemp("contract"), [MODEL_ID])
    spare = _home_with(tmp_path_factory.mktemp("contract-spare"), [MODEL_ID])   # what a pull fetches again
    mp = pytest.MonkeyPatch()
    mp.setenv("BARELLM_HOME", str(home))

    def offline(name: str, **kw: Any) -> Path:
        if name != MODEL_ID:
            raise BarellmError(f"{name}: this test server does not download")
        _refetch(spare, home, name)   # after an /api/delete of it, as a pull would
        cached = hub.cached_path(name)
        assert cached is not None
        return cached

    mp.setattr(hub, "pull", offline)
    mp.setattr(catalog, "pull", offline)   # hf.co/... and ollama:... names too
    args = build_parser().parse_args(["serve", "-c", "128", "--slots", "2", "-t", "1", "--allowed-host", "testserver"])
    try:
        yield build_app(args)
    finally:
        mp.undo()


@pytest.mark.model
def test_a_keep_alive_past_any_date_is_never(served_cache: Any) -> None:
    """keep_alive 1e300 (or 999999999h, which the document's duration pattern allows) keeps the model loaded,
    and /api/ps still answers: the unload date it shows is at most a century ahead, not a 500."""
    import datetime

    with TestClient(served_cache) as c:
        for keep_alive in (1e300, "999999999h"):
            r = c.post("/api/embed", json={"model": MODEL_ID, "input": "a", "keep_alive": keep_alive})
            assert r.status_code == 200, r.text
            ps = c.get("/api/ps")
            assert ps.status_code == 200, ps.text
            when = datetime.datetime.fromisoformat(ps.json()["models"][0]["expires_at"].replace("Z", "+00:00"))
            assert 2100 < when.year < datetime.date.today().year + 102


def _generable(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """doc with the cross-field rules (allOf) that schemathesis's generator cannot take all at once left out of
    the request bodies that have too many (it expands them into alternatives, a few dozen at most; the chat
    body's rules make more), and what was left out of which."""
    import copy

    from schemathesis.core.errors import UnsupportedSchema
    from schemathesis.generation.jsonschema.builder import build

    out = copy.deepcopy(doc)
    left_out: dict[str, list[Any]] = {}
    for name, schema in out["components"]["schemas"].items():
        while True:
            try:
                build({"$ref": f"#/components/schemas/{name}", "components": out["components"]}, draft=20, formats={})
                break
            except UnsupportedSchema:
                left_out.setdefault(name, []).append(schema["allOf"].pop())
    return out, left_out


SEED = 777   # the same requests every run, and the same as `st run --seed 777` (tests/schemathesis_hooks.py)


def test_schemathesis_finds_no_undocumented_answer(served_cache: Any) -> None:
    """Requests generated from /openapi.json against every operation of the many-model server, in schemathesis's
    three phases (the document's examples, the coverage phase's boundary and missing-field cases in both modes,
    and fuzzing), under every check: no 5xx, no status, content type, header or body the document does not list,
    every request the document forbids refused and every schema-valid request accepted unless it is refused for a
    reason no JSON schema can state (schemathesis_hooks.UNSTATABLE: the model's or the server's settings, a
    relation between values, a grammar's own language). Where a body's rules are too many for schemathesis's
    generator, it generates from the document without the last few and only the requests the whole document
    allows are sent as valid ones.
    Bounded: a fixed number of fuzzed examples per operation (BARELLM_SCHEMATHESIS_EXAMPLES, default 60) and the
    coverage phase's fixed set, seed 777 (the same requests every run), short generations (a context of 128
    tokens): about two minutes on two cores."""
    schemathesis = pytest.importorskip("schemathesis")
    import os

    import jsonschema_rs
    from hypothesis import HealthCheck, Phase, settings
    from schemathesis.generation.hypothesis.builder import HypothesisTestConfig, HypothesisTestMode, create_test
    from schemathesis.specs.openapi.checks import positive_data_acceptance
    from schemathesis_hooks import accepts_stated_data

    examples = int(os.environ.get("BARELLM_SCHEMATHESIS_EXAMPLES", "60"))
    app = served_cache
    excluded = [positive_data_acceptance, accepts_stated_data]

    def fuzz(op: Any, whole: Any) -> Any:
        """op's test over its generated requests (the valid ones only those the whole document allows, when
        whole is its validator)."""
        def run(case: Any) -> None:
            positive = case.meta is None or case.meta.generation.mode.is_positive
            if whole is not None and positive and not whole.is_valid(case.body):
                return
            # a timeout past the longest answer: 2,048 embedding inputs take more than the default 10 s here
            case.call_and_validate(excluded_checks=excluded, additional_checks=[accepts_stated_data], timeout=120)
        config = HypothesisTestConfig(
            project=op.schema.config, modes=list(HypothesisTestMode), seed=SEED,
            settings=settings(max_examples=examples, deadline=None, database=None,
                              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck)))
        return create_test(operation=op, test_func=run, config=config)

    found: dict[str, list[str]] = {}
    with TestClient(app) as c:
        doc = c.get("/openapi.json").json()
        relaxed, left_out = _generable(doc)
        assert set(left_out) <= {"ChatCompletionRequest"}, left_out
        schema = schemathesis.openapi.from_dict(relaxed)
        schema.app = app
        ops = [r.ok() for r in schema.get_all_operations()]
        documented = {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item}
        assert {op.label for op in ops} == documented
        lifecycle = {"POST /api/pull", "DELETE /api/delete", "POST /api/copy", "POST /api/embed", "GET /api/ps"}
        assert lifecycle <= documented
        for op in ops:
            body = op.definition.raw.get("requestBody", {}).get("content", {}).get("application/json", {})
            ref = body.get("schema", {}).get("$ref", "")
            whole = jsonschema_rs.Draft202012Validator({"$ref": ref, "components": doc["components"]}) if (
                ref.rsplit("/", 1)[-1] in left_out) else None
            try:
                fuzz(op, whole)()
            except BaseException as e:  # noqa: BLE001 - schemathesis's failure groups; collected, reported below
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                found[op.label] = [line for line in str(e).splitlines() if line.strip()][:14]
    assert not found, json.dumps(found, indent=1, ensure_ascii=False)


# --- what the schema states is accepted ------------------------------------------------------------

def test_one_prompt_in_a_batch_form_is_stated_and_accepted() -> None:
    with _fake_client() as c:
        prompt = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
        one_text = {"items": {"type": "string", "minLength": 1}, "maxItems": 1, "minItems": 1, "type": "array"}
        assert one_text in prompt["anyOf"]
        r = c.post("/v1/completions", json={"prompt": ["abc"], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
        err = _error(c.post("/v1/completions", json={"prompt": ["abc", "def"], "max_tokens": 2}))
        assert err["param"] == "prompt" and "one prompt per request" in err["message"]


def test_tool_message_without_content_is_an_empty_result() -> None:
    with _fake_client() as c:
        messages = [{"role": "user", "content": "abc"}, {"role": "tool", "tool_call_id": "call_1"}]
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text


_STATED_REFUSALS = [   # (path, body schema, body): refused by the server, and outside what the document allows
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user"}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "x", "tool_calls": [
         {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ("/v1/chat/completions", "ChatCompletionRequest",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}),
    ("/v1/completions", "CompletionRequest", {"prompt": "x", "stream_options": {"include_usage": True}}),
    ("/v1/completions", "CompletionRequest", {"prompt": "x", "grammar": "root ::= \"a\"", "regex": "a"}),
    ("/v1/completions", "CompletionRequest", {"prompt": [1, 2], "suffix": "x"}),
    ("/v1/completions", "CompletionRequest", {"prompt": "x", "best_of": 2}),
    ("/v1/completions", "CompletionRequest", {"prompt": "x", "logit_bias": {"a": 1}}),
    ("/v1/embeddings", "EmbeddingRequest", {"input": ["a", 1]}),
    ("/infill", "InfillRequest", {"input_prefix": "a", "n": 2}),
    ("/infill", "InfillRequest", {"input_prefix": "a", "n_predict": 0}),
    ("/api/show", "OllamaShowRequest", {"name": ""}),
    ("/api/generate", "OllamaGenerateRequest", {"model": "m", "think": "max"}),
    ("/api/generate", "OllamaGenerateRequest", {"model": "m", "keep_alive": "soon"}),
    ("/api/chat", "OllamaChatRequest", {"model": "m", "messages": [
        {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}),
    ("/api/embed", "EmbedRequest", {"model": "m", "input": ["a", ""]}),
    ("/detokenize", "DetokenizeRequest", {"tokens": [1, -1]}),
]


@pytest.mark.model
@pytest.mark.parametrize("path,component,body", _STATED_REFUSALS)
def test_what_the_server_refuses_the_document_does_not_allow(client: TestClient, path: str, component: str,
                                                             body: dict[str, Any]) -> None:
    """The cross-field rules and neutral values the request models state in the document, checked both ways on
    the requests that break them: the document's own schema rejects each, and so does the server, 400."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    doc = client.get("/openapi.json").json()
    schema = {"$ref": f"#/components/schemas/{component}", "components": doc["components"]}
    assert not jsonschema_rs.Draft202012Validator(schema).is_valid(body)
    body = {**body, "model": MODEL_ID} if path.startswith("/api/") and "model" in body else body
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text


@pytest.mark.model
def test_integral_numbers_are_integers(client: TestClient) -> None:
    """JSON Schema's integer is any number without a fraction: 3.0 and 1e20 are integers where the document
    says integer, and the server reads them so."""
    for path, body in (("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 2.0}),
                       ("/v1/embeddings", {"input": [[1.0, 2.0]]}),
                       ("/api/embed", {"model": MODEL_ID, "input": "a", "dimensions": 576.0}),
                       ("/api/generate", {"model": MODEL_ID, "prompt": "a", "context": [1.0], "stream": False,
                                          "options": {"num_predict": 2.0}})):
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    r = client.post("/infill", json={"input_prefix": "a", "id_slot": 1e20, "n_predict": 2.0})
    assert "fill-in-the-middle" in r.text   # past the body's checks: SmolLM2 has no FIM tokens


def test_numeric_bounds_are_stated_in_json_schema_words() -> None:
    with _fake_client() as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        n = schemas["CompletionRequest"]["properties"]["n"]["anyOf"][0]
        assert n == {"type": "integer", "minimum": 1, "maximum": 128}
        text = json.dumps(schemas)
        assert all(f'"{k}":' not in text for k in ("ge", "le", "gt", "lt")), "a bound in pydantic's words"
