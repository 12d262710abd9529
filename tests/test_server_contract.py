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


# --- schemathesis over the whole document ---------------------------------------------------------

def test_schemathesis_finds_no_undocumented_answer(smollm_gguf: Path) -> None:
    """Requests generated from /openapi.json against every operation: no 5xx, no status, content type or
    body the document does not list. Bounded: a fixed number of examples per operation, derandomized (the
    same requests every run), and short generations (max_tokens is clamped to a 128-token context, and a
    5 s time limit ends any request).

    Left out: schemathesis's positive_data_acceptance check, which wants every schema-valid request
    accepted. The server refuses some for reasons the schema does not state yet (n past --slots, two
    constraints at once, a tool message without content, echoed fields that are not empty, a model
    without fill-in-the-middle tokens on /infill)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    import barellm

    model = barellm.load(smollm_gguf, slots=2, context=128)
    app = create_app(model, model_id=MODEL_ID, timeout=5)
    found: dict[str, list[str]] = {}
    with TestClient(app):
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        ops = [r.ok() for r in schema.get_all_operations()]
        documented = {f"{m.upper()} {p}" for p, item in app.state.openapi["paths"].items() for m in item}
        assert {op.label for op in ops} == documented - {"GET /openapi.json"}   # all but the document itself
        for op in ops:
            @given(case=op.as_strategy())
            @settings(max_examples=100, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                case.call_and_validate(excluded_checks=[positive_data_acceptance])

            try:
                run()
            except BaseException as e:  # noqa: BLE001 - schemathesis's failure groups; collected, reported below
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                found[op.label] = [line for line in str(e).splitlines() if line.strip()][:12]
    assert not found, json.dumps(found, indent=1, ensure_ascii=False)


# --- what the schema states is accepted ------------------------------------------------------------

def test_one_prompt_in_a_batch_form_is_stated_and_accepted() -> None:
    with _fake_client() as c:
        prompt = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
        assert {"items": {"type": "string"}, "maxItems": 1, "minItems": 1, "type": "array"} in prompt["anyOf"]
        r = c.post("/v1/completions", json={"prompt": ["abc"], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
        err = _error(c.post("/v1/completions", json={"prompt": ["abc", "def"], "max_tokens": 2}))
        assert err["param"] == "prompt" and "one prompt per request" in err["message"]


def test_tool_message_without_content_is_an_empty_result() -> None:
    with _fake_client() as c:
        messages = [{"role": "user", "content": "abc"}, {"role": "tool", "tool_call_id": "call_1"}]
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_numeric_bounds_are_stated_in_json_schema_words() -> None:
    with _fake_client() as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        n = schemas["CompletionRequest"]["properties"]["n"]["anyOf"][0]
        assert n == {"type": "integer", "minimum": 1, "maximum": 128}
        text = json.dumps(schemas)
        assert all(f'"{k}":' not in text for k in ("ge", "le", "gt", "lt")), "a bound in pydantic's words"
