"""Tool calling: OpenAI's tools rendered through the chat template (or the built-in form), the model's calls
parsed into message.tool_calls and delta.tool_calls, forced calls constrained to the function's schema; and
a round trip with the official `openai` client on Qwen2.5-Coder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from barellm.errors import InvalidRequest
from barellm.text.toolcalls import (
    ToolCallStream,
    ToolFormat,
    call_grammar,
    parse_tool_calls,
    prepare_messages,
    resolve_choice,
    validate_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city name"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def _calls(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_a_reply_is_split_into_content_and_calls() -> None:
    content, calls = parse_tool_calls(REPLY)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # not a call: stays text; an unclosed last call still counts when its JSON is whole
    assert parse_tool_calls("a <tool_call> nope </tool_call> b") == ("a <tool_call> nope </tool_call> b", [])
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert content is None and _calls(calls) == [("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("  plain answer ") == ("plain answer", [])
    # bare call objects (small models drop the markers) only for the tools' own names
    bare = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n{"name": "add", "arguments": {"a": 3, "b": 4}}'
    assert _calls(parse_tool_calls(bare, ["add"])[1]) == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert parse_tool_calls(bare, ["sub"]) == (bare, [])
    assert parse_tool_calls('{"name": "add", "arguments": {"a": 1', ["add"])[1] == []


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_parsing_gives_the_same_at_any_split(step: int) -> None:
    s = ToolCallStream()
    parts: list[tuple[str, Any]] = []
    for i in range(0, len(REPLY), step):
        parts += s.feed(REPLY[i:i + step])
    parts += s.finish()
    assert "".join(p for k, p in parts if k == "content") == "Let me check."
    assert _calls([p for k, p in parts if k == "call"]) == _calls(parse_tool_calls(REPLY)[1])
    assert s.calls == 2
    # a call is emitted as soon as its closing marker arrives, before the reply ends
    s = ToolCallStream()
    first = s.feed(REPLY[:REPLY.index("</tool_call>") + len("</tool_call>")])
    assert [k for k, _ in first] == ["content", "call"]


def test_tool_choice_and_tool_validation() -> None:
    tools = validate_tools([WEATHER, ADD])
    assert resolve_choice(tools, None) == ("auto", None)
    assert resolve_choice(None, None) == ("none", None)
    assert resolve_choice(tools, "required") == ("required", None)
    assert resolve_choice(tools, {"type": "function", "function": {"name": "add"}}) == ("function", "add")
    named_x = {"type": "function", "function": {"name": "x"}}
    for choice, given, words in (("required", None, "needs tools"), (named_x, tools, "not among the tools"),
                                 ("sometimes", tools, "must be")):
        with pytest.raises(InvalidRequest, match=words):
            resolve_choice(given, choice)
    with pytest.raises(InvalidRequest, match="defined twice"):
        validate_tools([ADD, ADD])
    with pytest.raises(InvalidRequest, match="parameters"):
        validate_tools([{"type": "function", "function": {"name": "f", "parameters": "x"}}])


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "c2", "content": "21 C"}]


def test_messages_for_a_template_that_knows_tools() -> None:
    msgs, extra = prepare_messages(HISTORY, [WEATHER], ToolFormat(native=True, marker_tokens=True))
    assert extra == {"tools": [WEATHER]}
    # the arguments go to the template as an object (Qwen's writes them with tojson)
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert msgs[2]["content"] == "" and [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]


def test_the_built_in_form_for_other_templates() -> None:
    msgs, extra = prepare_messages(HISTORY, [WEATHER], ToolFormat(native=False, marker_tokens=False))
    assert extra == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools\n") and json.dumps(WEATHER) in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n21 C\n</tool_response>"


@pytest.fixture(scope="module")
def qwen(qwen05_gguf: Path) -> Any:
    import barellm

    return barellm.load(qwen05_gguf, slots=2, context=2048)


@pytest.mark.model
def test_qwen_renders_tools_with_its_own_template(qwen: Any) -> None:
    text = qwen.detokenize(qwen.chat_prompt(HISTORY[:4], tools=[WEATHER]))
    assert qwen.tool_format == ToolFormat(native=True, marker_tokens=True)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>") in text


@pytest.mark.model
def test_the_forced_call_grammar_takes_only_calls_of_the_schema(qwen: Any) -> None:
    tok = qwen.tokenizer
    g = qwen.tool_grammar([WEATHER, ADD], "required")

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special=False, parse_special=True)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert g.accepts(ids(call)) and g.accepts(ids(call + "\n" + call))
    assert g.accepts(ids(call + "\n")) and not g.accepts(ids(call + "\n\n"))   # one line break may end the list
    assert g.end_on_exit   # after a whole call, the model's own choice says whether another follows
    assert not g.accepts(ids('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'))  # city required
    assert not g.accepts(ids('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'))
    assert not g.accepts(ids('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}\n</tool_call>'))
    assert not g.accepts(ids("Sure!"))
    one = qwen.tool_grammar([WEATHER, ADD], "function", "add")
    assert one.accepts(ids('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'))
    assert not one.accepts(ids(call))
    src = call_grammar([WEATHER], ToolFormat(native=False, marker_tokens=False))
    assert '"<tool_call>\\n" body "\\n</tool_call>"' in src   # plain-text markers for other vocabularies


SYSTEM = {"role": "system", "content": "You are a helpful assistant. When a tool result is available, answer the "
                                       "user's question in a plain English sentence using it."}
ASK = {"role": "user", "content": "What is the weather like in Paris today?"}
RESULT = "Sunny, 21 degrees Celsius."


@pytest.fixture(scope="module")
def qwen_server(qwen05_gguf: Path) -> Any:
    from test_server import serving

    import barellm
    from barellm.serve.app import create_app

    with serving(create_app(barellm.load(qwen05_gguf, slots=2, context=2048), model_id="qwen")) as url:
        yield url


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_with_the_openai_client(qwen_server: str, stream: bool) -> None:
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=f"{qwen_server}/v1", api_key="unused", max_retries=0, timeout=300)
    kw = {"model": "qwen", "tools": [WEATHER, ADD], "temperature": 0, "max_tokens": 60}
    first = [SYSTEM, ASK]
    if not stream:
        r = client.chat.completions.create(messages=first, tool_choice="required", parallel_tool_calls=False, **kw)
        msg, reason = r.choices[0].message, r.choices[0].finish_reason
        calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                           "arguments": c.function.arguments}}
                 for c in msg.tool_calls or []]
        assert msg.content is None
    else:
        calls, reason = [], None
        for ch in client.chat.completions.create(messages=first, stream=True, **kw,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}):
            d = ch.choices[0].delta
            assert not d.content
            for tc in d.tool_calls or []:
                assert tc.index == len(calls)
                calls.append({"id": tc.id, "type": tc.type, "function": {"name": tc.function.name,
                                                                          "arguments": tc.function.arguments}})
            reason = ch.choices[0].finish_reason or reason
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "paris" in args["city"].lower()
    # the result comes back as a tool message; the model answers with it
    second = first + [{"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": calls[0]["id"], "content": RESULT}]
    r = client.chat.completions.create(messages=second, tool_choice="none", **kw)
    answer = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "21" in answer and "sunny" in answer.lower(), answer


@pytest.mark.model
def test_python_api_tool_calls_match_the_servers(qwen: Any) -> None:
    out = qwen.create_chat_completion([SYSTEM, ASK], tools=[WEATHER], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _calls(choice["message"]["tool_calls"])[0][0] == "get_weather"
    chunks = list(qwen.create_chat_completion([SYSTEM, ASK], tools=[WEATHER], tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True))
    streamed = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]) for t in streamed] == [(0, choice["message"]["tool_calls"][0]["function"])]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


MAX = 200


def _one_call_turn(body: dict[str, Any], name: str) -> None:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    [(called, args)] = _calls(choice["message"]["tool_calls"])
    assert called == name and isinstance(args, dict)
    assert body["usage"]["completion_tokens"] < MAX // 4   # the turn's call, then the end: no repeats


def _streamed_calls(chunks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    calls = [tc for c in chunks if c.get("choices") for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and
               c["choices"][0]["finish_reason"]]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c.get("choices"))
    return calls, reasons[-1] if reasons else None


FORCED = [("required", "get_weather"), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
          ({"type": "function", "function": {"name": "add"}}, "add")]


@pytest.mark.model
@pytest.mark.parametrize("tool_choice, name", FORCED)
def test_forced_calls_end_with_the_turn_in_the_python_api(qwen: Any, smollm_gguf: Path, tool_choice: Any,
                                                          name: str) -> None:
    """tool_choice "required" (parallel calls allowed, OpenAI's default) or a named function: the turn's call,
    then the end, finish_reason "tool_calls", far below max_tokens: whole and streamed, on Qwen (whose
    template knows tools) and SmolLM2 (the built-in form, plain-text markers)."""
    import barellm

    for model in (qwen, barellm.load(smollm_gguf)):
        kw = {"tools": [WEATHER, ADD], "tool_choice": tool_choice, "max_tokens": MAX, "temperature": 0}
        out = model.create_chat_completion([SYSTEM, ASK], **kw)
        _one_call_turn(out, name)
        calls, reason = _streamed_calls(list(model.create_chat_completion([SYSTEM, ASK], stream=True, **kw)))
        assert reason == "tool_calls"
        assert [c["function"] for c in calls] == [c["function"] for c in out["choices"][0]["message"]["tool_calls"]]


@pytest.mark.model
@pytest.mark.parametrize("tool_choice, name", FORCED[:2])
def test_forced_calls_end_with_the_turn_on_the_server(qwen_server: str, tool_choice: Any, name: str) -> None:
    import httpx

    body = {"model": "qwen", "messages": [SYSTEM, ASK], "tools": [WEATHER, ADD], "tool_choice": tool_choice,
            "max_tokens": MAX, "temperature": 0}
    r = httpx.post(f"{qwen_server}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    _one_call_turn(r.json(), name)
    with httpx.stream("POST", f"{qwen_server}/v1/chat/completions", timeout=300,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    calls, reason = _streamed_calls(chunks)
    assert reason == "tool_calls" and [c["function"] for c in calls] == [
        c["function"] for c in r.json()["choices"][0]["message"]["tool_calls"]]
    assert chunks[-1]["usage"]["completion_tokens"] == r.json()["usage"]["completion_tokens"]


@pytest.mark.model
def test_smollm_gets_the_built_in_form_and_forced_calls(smollm_gguf: Path) -> None:
    import barellm

    m = barellm.load(smollm_gguf)
    assert m.tool_format == ToolFormat(native=False, marker_tokens=False)
    text = m.detokenize(m.chat_prompt([ASK], tools=[WEATHER]))
    assert "<|im_start|>system\n# Tools\n" in text and json.dumps(WEATHER) in text
    out = m.create_chat_completion([ASK], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                   max_tokens=60, temperature=0)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    name, args = _calls(choice["message"]["tool_calls"])[0]
    assert name == "get_weather" and set(args) <= {"city", "unit"} and isinstance(args["city"], str)


@pytest.mark.slow
def test_the_1_5b_decides_to_call_a_tool_by_itself(qwen15_gguf: Path) -> None:
    """tool_choice "auto" on both turns: the 1.5B calls the function when it needs it (it writes the call as
    a fenced JSON object rather than between <tool_call> markers: parsed all the same) and answers from the
    result when it has it (asked to, in a system message)."""
    import barellm

    m = barellm.load(qwen15_gguf, context=2048)
    r = m.create_chat_completion([ASK], tools=[WEATHER, ADD], max_tokens=80, temperature=0)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [(name, args)] = _calls(choice["message"]["tool_calls"])
    assert name == "get_weather" and "paris" in args["city"].lower()
    second = [SYSTEM, ASK, {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]},
              {"role": "tool", "tool_call_id": choice["message"]["tool_calls"][0]["id"], "content": RESULT}]
    r = m.create_chat_completion(second, tools=[WEATHER, ADD], max_tokens=80, temperature=0)
    answer = r["choices"][0]["message"]["content"]
    assert r["choices"][0]["finish_reason"] == "stop" and "21" in answer, r
