"""Reasoning models: the reply split into reasoning and answer (harmony, <think>), the templates' variables,
and the split through the Python API, the server (OpenAI's and Ollama's routes) and the interactive chat, on
tiny models whose output a grammar makes hold the real markers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from reasoning_models import (
    HARMONY_CALL,
    HARMONY_REPLY,
    INSIDE_REPLY,
    THINK_REPLY,
    template,
    write_harmony,
    write_qwen3,
    write_r1,
)

import barellm
from barellm.errors import InvalidRequest
from barellm.text.chat import ChatTemplate, builtin_template
from barellm.text.reasoning import (
    ReasoningStream,
    count_reasoning_tokens,
    opens_inside,
    reasoning_format,
    split_reasoning,
    template_kwargs,
    template_messages,
)

from conftest import in_own_home

OWN_MODELS = ("harmony_path", "qwen3_path", "r1_path")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is 2 + 2?"}]

# --- the splitter --------------------------------------------------------------------------------------

HARMONY = ("<|channel|>analysis<|message|>The user asks for 2 + 2.\nThat is 4.<|end|><|start|>assistant"
           "<|channel|>final<|message|>2 + 2 = **4**.\n\nAnything else?")
HARMONY_TOOL = ("<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>assistant<|channel|>"
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
HARMONY_TOOL_IN_ROLE = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant "
                        'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}')
THINK = "<think>\nThe user asks for 2 + 2.\nThat is 4.\n</think>\n\n2 + 2 = **4**."

CASES = [
    # (format, text, inside, calls, reasoning, answer, calls' (name, arguments))
    ("harmony", HARMONY, False, False, "The user asks for 2 + 2.\nThat is 4.", "2 + 2 = **4**.\n\nAnything else?", []),
    ("harmony", HARMONY_TOOL, False, True, "Need the weather in Paris.", "",
     [("get_weather", '{"city": "Paris"}')]),
    ("harmony", HARMONY_TOOL_IN_ROLE, False, True, "Need the weather.", "", [("get_weather", '{"city": "Paris"}')]),
    # a call when no tools were asked for: the model's working, not the answer
    ("harmony", HARMONY_TOOL, False, False, 'Need the weather in Paris.\n\nto=get_weather: {"city": "Paris"}', "", []),
    # cut off by max_tokens inside the analysis: reasoning only
    ("harmony", "<|channel|>analysis<|message|>The user asks for", False, False, "The user asks for", "", []),
    # a final answer without analysis, and a commentary preamble (the answer's, as llama.cpp has it)
    ("harmony", "<|channel|>final<|message|>Four.", False, False, "", "Four.", []),
    ("harmony", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>4",
     False, False, "", "Checking.4", []),
    # a model that does not write harmony at all: its text is the answer
    ("harmony", "Just text.", False, False, "", "Just text.", []),
    ("think", THINK, False, False, "The user asks for 2 + 2.\nThat is 4.", "2 + 2 = **4**.", []),
    ("think", "  <think>x</think>y", False, False, "x", "y", []),
    # no reasoning: the reply as it is, leading whitespace included
    ("think", " Four, with <think> later.", False, False, "", " Four, with <think> later.", []),
    # the prompt opened <think> (R1 distills): only the close appears
    ("think", "The user asks for 2 + 2.\n</think>\n\nFour.", True, False, "The user asks for 2 + 2.", "Four.", []),
    # cut off inside the reasoning
    ("think", "<think>\nThe user asks", False, False, "The user asks", "", []),
    ("think", "Still thinking", True, False, "Still thinking", "", []),
    # Qwen3 with enable_thinking false writes an empty block
    ("think", "<think>\n\n</think>\n\nFour.", False, False, "", "Four.", []),
]


def _joined(parts: list[tuple[str, Any]]) -> tuple[str, str, list[tuple[str, str]]]:
    return ("".join(p for k, p in parts if k == "reasoning"), "".join(p for k, p in parts if k == "content"),
            [(p["function"]["name"], p["function"]["arguments"]) for k, p in parts if k == "call"])


@pytest.mark.parametrize("fmt,text,inside,calls,reasoning,answer,called", CASES)
def test_a_reply_is_split_whole_and_at_every_point(fmt: str, text: str, inside: bool, calls: bool, reasoning: str,
                                                   answer: str, called: list[tuple[str, str]]) -> None:
    r, a, c = split_reasoning(text, fmt, inside=inside, calls=calls)
    assert (r, a, [(x["function"]["name"], x["function"]["arguments"]) for x in c]) == (reasoning, answer, called)
    for cut in range(len(text) + 1):
        s = ReasoningStream(fmt, inside=inside, calls=calls)
        assert _joined(s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()) == (reasoning, answer, called), cut
    s = ReasoningStream(fmt, inside=inside, calls=calls)
    one_by_one = [p for ch in text for p in s.feed(ch)] + s.finish()
    assert _joined(one_by_one) == (reasoning, answer, called)
    # nothing of the markers reaches the answer or the reasoning
    for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "</think>"):
        assert marker not in a and marker not in r


# what each token of a reply counts as: reasoning, or not (the answer, a call, a header never finished)
TOKEN_CASES = [
    ("think", False, False, ["<think>", "\n", "Plan", ".", "\n", "</think>", "\n\n", "Four", "."], 6),
    ("think", False, False, [" ", "<think>", "Plan", "</think>", "Four"], 4),   # leading space: opens the reasoning
    ("think", True, False, ["Plan", "</think>", "\n\n", "Four"], 2),
    ("think", False, False, [" Four", ".", "<think>"], 0),
    ("think", True, False, ["Still", " thinking"], 2),
    # a token straddling the close counts where its first character goes: the reasoning
    ("think", False, False, ["<think>", "Plan", ".</think>\n\nFour", "."], 3),
    # markers written as plain text pieces
    ("think", False, False, ["<th", "ink>", "Plan", "</", "think", ">", "Four"], 6),
    ("harmony", False, False, ["<|channel|>", "analysis", "<|message|>", "Plan", ".", "<|end|>", "<|start|>",
                               "assistant", "<|channel|>", "final", "<|message|>", "Four", "."], 6),
    ("harmony", False, False, ["<|channel|>", "final", "<|message|>", "Four"], 0),
    ("harmony", False, False, ["<|channel|>", "analysis", "<|message|>", "The", " user"], 5),   # cut off
    ("harmony", False, False, ["<|channel|>", "analy"], 0),   # a header never finished
    # a call: the answer's when calls are parsed, the reasoning's when not
    ("harmony", False, True, ["<|channel|>", "analysis", "<|message|>", "W", "<|end|>", "<|start|>", "assistant",
                              "<|channel|>", "commentary to=functions.f ", "<|constrain|>", "json", "<|message|>",
                              "{}"], 5),
    ("harmony", False, False, ["<|channel|>", "analysis", "<|message|>", "W", "<|end|>", "<|start|>", "assistant",
                               "<|channel|>", "commentary to=functions.f ", "<|constrain|>", "json", "<|message|>",
                               "{}"], 13),
]


@pytest.mark.parametrize("fmt,inside,calls,pieces,expected", TOKEN_CASES)
def test_reasoning_tokens_count_where_each_tokens_text_went(fmt: str, inside: bool, calls: bool,
                                                           pieces: list[str], expected: int) -> None:
    assert count_reasoning_tokens(pieces, fmt, inside=inside, calls=calls) == expected
    # the split itself agrees: the reasoning tokens' text alone gives the whole reasoning
    whole = split_reasoning("".join(pieces), fmt, inside=inside, calls=calls)[0]
    if expected and "".join(pieces[expected:]).strip():
        assert split_reasoning("".join(pieces[:expected]), fmt, inside=inside, calls=calls)[0] == whole


def test_the_answer_streams_before_the_reply_ends() -> None:
    s = ReasoningStream("harmony")
    first = s.feed(HARMONY[:HARMONY.index("<|end|>")])
    assert first and all(k == "reasoning" for k, _ in first)
    assert ("content", "2 + 2") in s.feed(HARMONY[HARMONY.index("<|end|>"):HARMONY.index(" =")])
    t = ReasoningStream("think")
    assert t.feed("<think>\nPlan") == [("reasoning", "Plan")]


def test_calls_ids_are_openais_and_bad_json_is_no_call() -> None:
    _, _, calls = split_reasoning(HARMONY_TOOL, "harmony", calls=True)
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    broken = HARMONY_TOOL.replace('{"city": "Paris"}', '{"city": ')
    r, a, c = split_reasoning(broken, "harmony", calls=True)
    assert c == [] and '{"city":' in r and a == ""


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="harmony, think"):
        ReasoningStream("deepseek")


# --- templates ---------------------------------------------------------------------------------------


def _no_tokens(text: str) -> bool:
    return False


def test_the_format_comes_from_the_template_and_the_vocabulary() -> None:
    assert reasoning_format(template("gpt-oss"), _no_tokens) == "harmony"
    assert reasoning_format(template("qwen3"), _no_tokens) == "think"
    assert reasoning_format(template("deepseek-r1-distill"), _no_tokens) == "think"
    chatml = builtin_template("chatml")
    assert reasoning_format(chatml, _no_tokens) is None
    assert reasoning_format(chatml, lambda t: t in ("<think>", "</think>")) == "think"
    # a gpt-oss file whose template does not name the channels (the model writes them all the same)
    stub = ("{%- for message in messages -%}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
            "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
    assert reasoning_format(stub, lambda t: t in ("<|channel|>", "<|message|>")) == "harmony"


def test_gpt_oss_template_renders_effort_thinking_and_calls_in_the_sandbox() -> None:
    t = ChatTemplate(template("gpt-oss"), "<|startoftext|>", "<|return|>", probe=False)
    msgs = [{"role": "system", "content": "Be brief."}, *ASK]
    text = t.render(msgs, **template_kwargs(None, "high"))
    assert "Reasoning: high" in text and "<|start|>developer<|message|># Instructions\n\nBe brief." in text
    assert text.endswith("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    assert "Reasoning: medium" in t.render(ASK)   # the template's own default
    # a tool call turn given back with its reasoning: gpt-oss reads it as `thinking`
    history = [*ASK, {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = t.render(template_messages(history, t.source), tools=[WEATHER])
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\"sunny\"<|end|>" in text
    assert "type get_weather = (_: {\n// " not in text and "type get_weather = (_: {\ncity: string,\n}) => any;" in text


def test_qwen3_template_kwargs_and_r1_prompt_tail() -> None:
    q = ChatTemplate(template("qwen3"), probe=False)
    on, off = q.render(ASK), q.render(ASK, **template_kwargs({"enable_thinking": False}))
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert not opens_inside(on) and not opens_inside(off)
    r1 = ChatTemplate(template("deepseek-r1-distill"), "<｜begin▁of▁sentence｜>", probe=False)
    assert opens_inside(r1.render(ASK))
    # an earlier turn's reasoning reaches Qwen3's template as reasoning_content; R1's reads neither name
    turn = {"role": "assistant", "content": "4", "thinking": "2 + 2 is 4."}
    assert template_messages([turn], q.source) == [{"role": "assistant", "content": "4",
                                                    "reasoning_content": "2 + 2 is 4."}]
    assert template_messages([turn], r1.source) == [{"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("kwargs,effort,param", [
    ([1], None, "chat_template_kwargs"), ({"messages": []}, None, "chat_template_kwargs"),
    ({"not a name": 1}, None, "chat_template_kwargs"), ({f"k{i}": i for i in range(33)}, None, "chat_template_kwargs"),
    ({"big": "x" * 20000}, None, "chat_template_kwargs"), ({"f": {1, 2}}, None, "chat_template_kwargs"),
    (None, "extreme", "reasoning_effort")])
def test_template_variables_are_bounded(kwargs: Any, effort: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        template_kwargs(kwargs, effort)
    assert e.value.param == param


# --- tiny models, end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_harmony(tmp_path_factory.mktemp("harmony") / "tiny-reasoning-harmony.gguf")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-reasoning-think.gguf")


@pytest.fixture(scope="module")
def r1_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_r1(tmp_path_factory.mktemp("r1") / "tiny-reasoning-inside.gguf")


@pytest.fixture(scope="module")
def harmony(harmony_path: Path, scratch_home: Path) -> Any:
    with in_own_home(scratch_home):
        return barellm.load(harmony_path, context=1024)


@pytest.fixture(scope="module")
def qwen3(qwen3_path: Path, scratch_home: Path) -> Any:
    with in_own_home(scratch_home):
        return barellm.load(qwen3_path, context=1024)


def test_harmony_ends_at_return_and_call_not_at_end(harmony: Any) -> None:
    tok = harmony.tokenizer
    ids = {t: tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>")}
    assert ids["<|return|>"] in tok.eog_ids and ids["<|call|>"] in tok.eog_ids
    assert ids["<|end|>"] not in tok.eog_ids
    assert harmony.reasoning_format == "harmony"


def test_python_api_answer_and_reasoning(harmony: Any, harmony_path: Path, qwen3: Any, r1_path: Path) -> None:
    assert harmony.chat(ASK, grammar=HARMONY_REPLY, temperature=0) == "Four."
    c = harmony.complete_chat(ASK, grammar=HARMONY_REPLY, temperature=0, reasoning_effort="low")
    assert (c.text, c.reasoning, c.finish_reason) == ("Four.", "Two and two make four.", "stop")
    assert "<|channel|>" in harmony.detokenize(c.token_ids)   # the markers were generated, and split off
    stream = harmony.chat_stream(ASK, grammar=HARMONY_REPLY, temperature=0)
    parts = list(stream.parts())
    assert [k for k, _ in parts] == sorted((k for k, _ in parts), reverse=True)   # reasoning first, then the answer
    assert "".join(p for k, p in parts if k == "content") == "Four." and stream.reasoning == "Two and two make four."
    assert "".join(harmony.chat_stream(ASK, grammar=HARMONY_REPLY, temperature=0)) == "Four."
    c = qwen3.complete_chat(ASK, grammar=THINK_REPLY, temperature=0)
    assert (c.text, c.reasoning) == ("Four.", "Two and two make four.")
    r1 = barellm.load(r1_path, context=1024)
    assert r1.reasoning_format == "think"
    c = r1.complete_chat(ASK, grammar=INSIDE_REPLY, temperature=0)
    assert (c.text, c.reasoning) == ("Four.", "Two and two make four.")
    # max_tokens counts the reasoning: cut inside it, the answer is empty
    c = harmony.complete_chat(ASK, grammar=HARMONY_REPLY, temperature=0, max_tokens=14)
    assert (c.text, c.finish_reason) == ("", "length") and c.reasoning and "<|" not in c.reasoning


# the text the grammars force, up to and including the marker that ends the reasoning
HARMONY_THOUGHT = "<|channel|>analysis<|message|>Two and two make four.<|end|>"
THINK_THOUGHT = "<think>\nTwo and two make four.\n</think>"
INSIDE_THOUGHT = "Two and two make four.\n</think>"


def _thought_tokens(model: Any, ids: list[int], marker: str, thought: str) -> int:
    """How many of ids are the reasoning, found independently of the splitter: up to the marker's token, whose
    text is the thought the grammar forced."""
    n = ids.index(model.tokenizer.token_to_id(marker)) + 1
    assert model.detokenize(ids[:n]) == thought and n < len(ids)
    return n


def test_python_api_counts_reasoning_tokens(harmony: Any, qwen3: Any, r1_path: Path) -> None:
    c = harmony.complete_chat(ASK, grammar=HARMONY_REPLY, temperature=0)
    n = _thought_tokens(harmony, c.token_ids, "<|end|>", HARMONY_THOUGHT)
    assert c.reasoning_tokens == c.choices[0].reasoning_tokens == n
    stream = harmony.chat_stream(ASK, grammar=HARMONY_REPLY, temperature=0)
    assert "".join(stream) == "Four." and stream.completion.reasoning_tokens == n
    body = harmony.create_chat_completion(ASK, grammar=HARMONY_REPLY, temperature=0)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    assert body["usage"]["completion_tokens"] == len(c.token_ids)
    # the reply as generated: nothing split off, nothing counted
    raw = harmony.create_chat_completion(ASK, grammar=HARMONY_REPLY, temperature=0, reasoning_format="none")
    assert raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    c = qwen3.complete_chat(ASK, grammar=THINK_REPLY, temperature=0)
    assert c.reasoning_tokens == _thought_tokens(qwen3, c.token_ids, "</think>", THINK_THOUGHT)
    r1 = barellm.load(r1_path, context=1024, slots=2)
    c = r1.complete_chat(ASK, grammar=INSIDE_REPLY, temperature=0)
    m = _thought_tokens(r1, c.token_ids, "</think>", INSIDE_THOUGHT)
    assert c.reasoning_tokens == m
    # n choices: each counted, the usage their sum
    both = r1.complete_chat(ASK, grammar=INSIDE_REPLY, temperature=0, n=2)
    assert [ch.reasoning_tokens for ch in both.choices] == [m, m]
    body = r1.create_chat_completion(ASK, grammar=INSIDE_REPLY, temperature=0, n=2)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * m}
    # cut off inside the reasoning: every token is reasoning
    c = harmony.complete_chat(ASK, grammar=HARMONY_REPLY, temperature=0, max_tokens=14)
    assert c.finish_reason == "length" and c.reasoning_tokens == len(c.token_ids) == 14
    # a plain completion has no completion_tokens_details
    assert "completion_tokens_details" not in harmony.create_completion("Hi", max_tokens=2)["usage"]


def test_python_api_checks_the_template_variables(qwen3: Any) -> None:
    with pytest.raises(InvalidRequest, match="reasoning_effort"):
        qwen3.chat(ASK, reasoning_effort="max", max_tokens=1)
    with pytest.raises(InvalidRequest, match="cannot set 'messages'"):
        qwen3.chat(ASK, chat_template_kwargs={"messages": []}, max_tokens=1)
    off = qwen3.detokenize(qwen3.chat_prompt(ASK, template_kwargs={"enable_thinking": False}))
    assert off.endswith("<think>\n\n</think>\n\n")


def test_openai_shapes_from_the_python_api(harmony: Any, qwen3: Any) -> None:
    body = harmony.create_chat_completion(ASK, grammar=HARMONY_REPLY, temperature=0)
    msg = body["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Four.", "Two and two make four.")
    chunks = list(harmony.create_chat_completion(ASK, grammar=HARMONY_REPLY, temperature=0, stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two make four."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    # reasoning_format "none": the reply as generated, markers included
    raw = harmony.create_chat_completion(ASK, grammar=HARMONY_REPLY, temperature=0, reasoning_format="none")
    assert raw["choices"][0]["message"]["content"].startswith("<|channel|>analysis<|message|>")
    assert "reasoning_content" not in raw["choices"][0]["message"]
    with pytest.raises(InvalidRequest, match="reasoning_format"):
        harmony.create_chat_completion(ASK, reasoning_format="html")
    body = qwen3.create_chat_completion(ASK, grammar=THINK_REPLY, temperature=0)
    assert body["choices"][0]["message"]["reasoning_content"] == "Two and two make four."


def test_harmony_tool_calls(harmony: Any) -> None:
    body = harmony.create_chat_completion(ASK, grammar=HARMONY_CALL, temperature=0, tools=[WEATHER])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Need the weather."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    chunks = list(harmony.create_chat_completion(ASK, grammar=HARMONY_CALL, temperature=0, tools=[WEATHER],
                                                 stream=True))
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(tc["index"], tc["function"]["name"]) for tc in calls] == [(0, "get_weather")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"



ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_harmony_forced_call_grammar(harmony: Any) -> None:
    assert harmony.tool_format.harmony
    g = harmony.tool_grammar([WEATHER, ADD], "required")

    def ids(text: str) -> list[int]:
        return harmony.tokenizer.encode(text, add_special=False, parse_special=True)

    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    thought = "<|channel|>analysis<|message|>They want the weather.<|end|><|start|>assistant"
    assert g.accepts(ids(call)) and g.accepts(ids(thought + call))
    assert not g.accepts(ids(call.replace('"Oslo"', "1")))    # the schema's string
    assert not g.accepts(ids(call.replace("get_weather", "nope")))
    assert not g.accepts(ids("<|channel|>final<|message|>Sunny."))   # no answer instead of the call
    one = harmony.tool_grammar([WEATHER, ADD], "function", "add")
    assert one.accepts(ids('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}'))
    assert not one.accepts(ids(call))
    # through the request path: whatever the model wrote first, the reply ends in a call of add or at max_tokens
    body = harmony.create_chat_completion(ASK, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {
        "name": "add"}}, temperature=0, max_tokens=200)
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length")
    if choice["finish_reason"] == "tool_calls":
        (tc,) = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "add" and set(json.loads(tc["function"]["arguments"])) == {"a", "b"}


# --- the server --------------------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def harmony_server(harmony_path: Path, scratch_home: Path) -> Any:
    pytest.importorskip("uvicorn")
    from test_server import serving

    from barellm.serve.app import create_app

    with in_own_home(scratch_home):
        model = barellm.load(harmony_path, context=1024)
    app = create_app(model, model_id="tiny-gpt-oss")
    with serving(app) as url:
        yield url


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny-gpt-oss", **body}, timeout=120)


def test_server_reasoning_content(harmony_server: str) -> None:
    body = {"messages": ASK, "grammar": HARMONY_REPLY, "temperature": 0}
    r = _post(harmony_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert (msg["content"], msg["reasoning_content"]) == ("Four.", "Two and two make four.")
    r = _post(harmony_server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two make four."
    assert "".join(d.get("content") or "" for d in deltas) == "Four."
    raw = _post(harmony_server, "/v1/chat/completions", {**body, "reasoning_format": "none"}).json()
    assert raw["choices"][0]["message"]["content"].endswith("<|channel|>final<|message|>Four.")
    r = _post(harmony_server, "/v1/chat/completions", {**body, "reasoning_effort": "high",
                                                        "chat_template_kwargs": {"model_identity": "A tiny model."}})
    assert r.status_code == 200
    for bad, param in (({"reasoning_effort": "max"}, "reasoning_effort"),
                       ({"reasoning_format": "html"}, "reasoning_format"),
                       ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs")):
        r = _post(harmony_server, "/v1/chat/completions", {**body, **bad})
        assert r.status_code == 400 and param in r.text, (bad, r.text)


def test_server_usage_counts_reasoning_tokens(harmony_server: str, harmony: Any) -> None:
    from barellm.serve import openapi_doc

    ids = harmony.complete_chat(ASK, grammar=HARMONY_REPLY, temperature=0).token_ids
    n = _thought_tokens(harmony, ids, "<|end|>", HARMONY_THOUGHT)
    body = {"messages": ASK, "grammar": HARMONY_REPLY, "temperature": 0}
    whole = _post(harmony_server, "/v1/chat/completions", body).json()
    assert whole["usage"]["completion_tokens"] == len(ids)
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}
    openapi_doc.ChatCompletion.model_validate(whole)
    r = _post(harmony_server, "/v1/chat/completions", {**body, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"] | {
        "prompt_tokens_details": chunks[-1]["usage"]["prompt_tokens_details"]}
    openapi_doc.ChatCompletionChunk.model_validate(chunks[-1])
    # not split: none counted; a completion: no details
    raw = _post(harmony_server, "/v1/chat/completions", {**body, "reasoning_format": "none"}).json()
    assert raw["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    text = _post(harmony_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).json()
    assert "completion_tokens_details" not in text["usage"]


@pytest.fixture()
def forced(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Ollama's routes have no grammar field: each request the server submits gets the grammar given here, so
    the tiny model writes harmony through the real route, scheduler and answer."""
    from barellm.serve import ollama

    real = ollama.submit

    def force(grammar: str) -> None:
        def submit(state: Any, req: Any) -> Any:
            req.grammar = state.model.structured().lark(grammar, "grammar")
            return real(state, req)
        monkeypatch.setattr(ollama, "submit", submit)
    return force


def _lines(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_ollama_generate_thinking(harmony_server: str, harmony: Any, forced: Any) -> None:
    forced(HARMONY_REPLY)
    body = {"prompt": "What is 2 + 2?", "options": {"temperature": 0}, "stream": False}
    for think in (None, True, "low"):
        r = _post(harmony_server, "/api/generate", {**body, **({} if think is None else {"think": think})})
        assert r.status_code == 200, r.text
        out = r.json()
        assert (out["response"], out["thinking"], out["done"]) == ("Four.", "Two and two make four.", True)
    # the level reaches gpt-oss's template: the prompt given back in context says so
    assert "Reasoning: low" in harmony.detokenize(out["context"])
    out = _post(harmony_server, "/api/generate", {**body, "think": False}).json()
    assert out["response"] == "Four." and "thinking" not in out
    # streamed: thinking pieces, then response pieces, then the done line
    lines = _lines(_post(harmony_server, "/api/generate", {**body, "stream": True}))
    assert lines[-1]["done"] and all(not x["done"] for x in lines[:-1])
    assert "".join(x.get("thinking", "") for x in lines) == "Two and two make four."
    assert "".join(x["response"] for x in lines) == "Four."
    first_answer = next(i for i, x in enumerate(lines) if x["response"])
    assert all("thinking" not in x for x in lines[first_answer:])
    # raw: the client's own template; split only when think asks for it
    prompt = harmony.detokenize(harmony.chat_prompt(ASK))
    raw = {**body, "prompt": prompt, "raw": True}
    out = _post(harmony_server, "/api/generate", raw).json()
    assert out["response"] == ("<|channel|>analysis<|message|>Two and two make four.<|end|><|start|>assistant"
                               "<|channel|>final<|message|>Four.") and "thinking" not in out
    out = _post(harmony_server, "/api/generate", {**raw, "think": True}).json()
    assert (out["response"], out["thinking"]) == ("Four.", "Two and two make four.")
    assert _post(harmony_server, "/api/generate", {**body, "think": "deep"}).status_code == 400
    # /api/chat through the same route machinery
    chat = {"messages": ASK, "options": {"temperature": 0}, "stream": False}
    msg = _post(harmony_server, "/api/chat", chat).json()["message"]
    assert (msg["content"], msg["thinking"]) == ("Four.", "Two and two make four.")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_path: Path, scratch_home: Path) -> Any:
    pytest.importorskip("uvicorn")
    from test_server import serving

    from barellm.serve.app import create_app

    with in_own_home(scratch_home):
        model = barellm.load(qwen3_path, context=1024)
    with serving(create_app(model, model_id="tiny-qwen3")) as url:
        yield url


def test_ollama_generate_think_on_a_think_model(qwen3_server: str, qwen3: Any, forced: Any) -> None:
    forced(THINK_REPLY)
    body = {"model": "tiny-qwen3", "prompt": "What is 2 + 2?", "options": {"temperature": 0}, "stream": False}
    out = _post(qwen3_server, "/api/generate", body).json()
    assert (out["response"], out["thinking"]) == ("Four.", "Two and two make four.")
    # think false: Qwen3's template is asked for no thinking (it writes the empty block into the prompt)
    out = _post(qwen3_server, "/api/generate", {**body, "think": False}).json()
    prompt = qwen3.detokenize(out["context"][:out["prompt_eval_count"]])
    assert prompt.endswith("<think>\n\n</think>\n\n") and "thinking" not in out and out["response"] == "Four."
    # a raw prompt that leaves <think> open: the reply starts inside the reasoning
    forced(INSIDE_REPLY)
    raw = {**body, "raw": True,
           "prompt": "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"}
    out = _post(qwen3_server, "/api/generate", {**raw, "think": True}).json()
    assert (out["response"], out["thinking"]) == ("Four.", "Two and two make four.")
    lines = _lines(_post(qwen3_server, "/api/generate", {**raw, "think": True, "stream": True}))
    assert "".join(x.get("thinking", "") for x in lines) == "Two and two make four."
    assert "".join(x["response"] for x in lines) == "Four."
    out = _post(qwen3_server, "/api/generate", raw).json()
    assert out["response"] == "Two and two make four.\n</think>\n\nFour." and "thinking" not in out


def test_server_tool_call_and_history_with_reasoning(harmony_server: str) -> None:
    r = _post(harmony_server, "/v1/chat/completions", {"messages": ASK, "grammar": HARMONY_CALL, "temperature": 0,
                                                       "tools": [WEATHER]})
    msg = r.json()["choices"][0]["message"]
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": msg["reasoning_content"],
                      "tool_calls": msg["tool_calls"]},
               {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"}]
    r = _post(harmony_server, "/v1/chat/completions", {"messages": history, "grammar": HARMONY_REPLY,
                                                       "temperature": 0, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Four."


def test_ollama_thinking(harmony_server: str) -> None:
    body = {"messages": ASK, "format": None, "options": {"temperature": 0}, "stream": False}
    # Ollama's routes have no grammar field: the tiny model's own output is not harmony, so it is the answer
    r = _post(harmony_server, "/api/chat", body)
    assert r.status_code == 200, r.text
    assert "thinking" not in r.json()["message"]
    r = _post(harmony_server, "/api/chat", {**body, "think": "high"})
    assert r.status_code == 200, r.text
    r = _post(harmony_server, "/api/chat", {**body, "think": "deep"})
    assert r.status_code == 400


def test_ollama_thinking_split(harmony: Any) -> None:
    """/api/chat's answer shape on a reply holding harmony's markers (the builder the route uses)."""
    from barellm.api.openai import GenerationRequest
    from barellm.serve.ollama import OllamaResponse

    req = GenerationRequest(messages=ASK, reasoning="harmony")
    state = type("State", (), {"tokenizer": harmony.tokenizer})()
    text = "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four."
    for think, shown in ((None, "Two and two."), (True, "Two and two."), (False, None)):
        resp = OllamaResponse.__new__(OllamaResponse)
        OllamaResponse.__init__(resp, state, None, None, req, "/api/chat", True, "m", think=think)
        lines = [json.loads(b) for b in resp._pieces(text[:20]) + resp._pieces(text[20:], final=True)]
        assert "".join(m["message"]["content"] for m in lines) == "Four."
        assert ("".join(m["message"].get("thinking", "") for m in lines) or None) == shown
        done = resp._final(text, type("Done", (), {"finish_reason": "stop", "prompt_tokens": 1,
                                                   "completion_tokens": 1})(), 0, None, [])
        assert done["message"]["content"] == "Four." and done["message"].get("thinking") == shown


# --- the interactive chat ----------------------------------------------------------------------------


def test_chat_repl_hides_reasoning_when_piped_and_keeps_it_in_history(harmony: Any) -> None:
    from barellm.cli.chat_repl import ChatSession
    from barellm.cli.reply import DONE_THINKING, THINKING

    for mode, shown in (("auto", False), ("hide", False), ("show", True)):
        out, err = io.StringIO(), io.StringIO()
        s = ChatSession(harmony, {"temperature": 0, "grammar": HARMONY_REPLY}, out=out, err=err, reasoning=mode)
        reply = s.ask("What is 2 + 2?")
        assert reply is not None and (reply.text, reply.reasoning) == ("Four.", "Two and two make four.")
        printed = out.getvalue()
        assert printed.rstrip().endswith("Four.") and "<|" not in printed
        assert (THINKING in printed and DONE_THINKING in printed and "Two and two" in printed) == shown
        assert s.turns[-1] == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two make four."}
    # the next turn renders the history through gpt-oss's template (it drops an answered turn's reasoning)
    assert "<|channel|>final<|message|>Four.<|end|>" in harmony.detokenize(s.prompt_ids(
        [*s.turns, {"role": "user", "content": "And 3 + 3?"}]))


def test_chat_repl_dims_reasoning_on_a_terminal(harmony: Any) -> None:
    from barellm.cli.reply import DIM, stream_reply

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    ids, inside = harmony._chat_prompt(ASK)
    reply = stream_reply(harmony, ids, {"temperature": 0, "grammar": HARMONY_REPLY}, out,
                         reasoning=(harmony.reasoning_format, inside), show_reasoning=True)
    assert reply.text == "Four." and out.getvalue().startswith(DIM + "Thinking...")


def test_cli_help_documents_reasoning(capsys: pytest.CaptureFixture[str]) -> None:
    from barellm.__main__ import main

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "--reasoning {auto,show,hide}" in capsys.readouterr().out


def test_show_names_the_reasoning_format(harmony_path: Path, qwen3_path: Path) -> None:
    from barellm.cli.show import describe
    from barellm.formats.gguf import GGUFFile

    for path, text in ((harmony_path, "harmony channels"), (qwen3_path, "<think>")):
        with GGUFFile(path) as f:
            rows = dict(describe(f.metadata, f.tensors))
        assert text in rows["reasoning"]


# --- the chat page -----------------------------------------------------------------------------------


def test_chat_page_script_reads_reasoning_content() -> None:
    from importlib import resources

    script = resources.files("barellm.serve").joinpath("static", "chat.js").read_text(encoding="utf-8")
    assert "delta?.reasoning_content" in script and '"reasoning"' in script and "block.open = false" in script
    assert "completion_tokens_details?.reasoning_tokens" in script


def test_chat_page_shows_reasoning_above_the_answer(harmony_server: str) -> None:
    from test_server_webui import _browser, _send, _wait

    chrome, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        browser.get(harmony_server + "/")
        _wait("the model picker",
              lambda: browser.find_element(By.ID, "model").get_attribute("value") == "tiny-gpt-oss", 30)
        # the page sends no grammar: its requests get the one that makes the tiny model write harmony, and the
        # reasoning block's folding is recorded as it happens
        browser.execute_script("""
            const grammar = arguments[0], real = window.fetch;
            window.fetch = (url, init) => {
              if (url === "/v1/chat/completions") {
                init = {...init, body: JSON.stringify({...JSON.parse(init.body), grammar, temperature: 0})};
              }
              return real(url, init);
            };
            window.folds = [];
            new MutationObserver((records) => { for (const r of records) {
              if (r.attributeName === "open" && r.target.classList.contains("reasoning")) {
                window.folds.push([r.oldValue, r.target.open]);
              }
            }}).observe(document.getElementById("conversation"),
                        {subtree: true, attributes: true, attributeOldValue: true});
        """, HARMONY_REPLY)
        reply = _send(browser, "What is 2 + 2?")
        _wait("the reply to finish", lambda: reply.get_attribute("data-state") != "streaming")
        assert reply.get_attribute("data-state") == "done" and reply.get_attribute("data-text") == "Four."
        block = reply.find_element(By.CSS_SELECTOR, "details.reasoning")
        assert block.find_element(By.TAG_NAME, "summary").text == "Reasoning"
        assert block.get_attribute("open") is None   # folded once the answer started
        text = browser.execute_script("return arguments[0].querySelector('.reasoning-text').textContent", block)
        assert text == "Two and two make four."
        # above the answer, which holds none of it
        assert browser.execute_script("return arguments[0].nextElementSibling.className", block) == "content"
        assert reply.find_element(By.CSS_SELECTOR, ".content").text == "Four."
        # it was open while the model thought, and folded once
        assert browser.execute_script("return window.folds") == [["", False]]
        assert "reasoning" in browser.find_element(By.ID, "status").text
        block.find_element(By.TAG_NAME, "summary").click()
        assert block.get_attribute("open") is not None
        history = browser.execute_script("return window.barellmChat.conversation")
        assert history[-1] == {"role": "assistant", "content": "Four."}
    finally:
        browser.quit()
