"""Chat templates: HF-compatible rendering, the built-in templates, template choice, message validation,
and the sandbox holding against templates that try to escape it."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
from gguf_metadata import read_metadata

from barellm.errors import FormatError, InvalidRequest
from barellm.text.chat import ChatTemplate, RenderLimits, builtin_names, builtin_template, template_for
from barellm.text.tokenizer import Tokenizer

from conftest import load_data

GOLDEN = load_data("chat_golden.json")

CONVERSATION = [
    {"role": "system", "content": "  Answer briefly.\n"},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": " Hello! "},
    {"role": "user", "content": "What is 2+2?"},
]


# --- the real models ---------------------------------------------------------------------------------------

@pytest.mark.model
def test_smollm_file_template_matches_transformers(smollm_gguf):
    md = read_metadata(smollm_gguf)
    tok = Tokenizer.from_metadata(md)
    tmpl = ChatTemplate(template_for(md), bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id))
    gold = GOLDEN["models"]["smollm"]
    text = tmpl.render(GOLDEN["messages"])
    assert text == gold["text"]
    assert tok.encode(text, add_special=True) == gold["prompt_ids"]
    assert tok.decode(gold["greedy_ids"]) == gold["greedy_text"]


@pytest.mark.model
def test_gemma_falls_back_to_builtin_and_tokenizes_like_the_reference(gemma_gguf):
    md = read_metadata(gemma_gguf)
    assert "tokenizer.chat_template" not in md
    assert template_for(md) == builtin_template("gemma")
    tok = Tokenizer.from_metadata(md)
    text = ChatTemplate(template_for(md), "<bos>", "<eos>").render(GOLDEN["messages"])
    gold = GOLDEN["models"]["gemma"]
    # the reference text writes <bos> itself; ours leaves it to the tokenizer's BOS rule, like llama.cpp
    assert "<bos>" + text == gold["text"]
    assert tok.encode(text, add_special=True) == gold["prompt_ids"]


# --- built-in templates ------------------------------------------------------------------------------------

def test_builtin_gemma_turns():
    text = ChatTemplate(builtin_template("gemma")).render(CONVERSATION)
    assert text == (
        "<start_of_turn>user\nAnswer briefly.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    closed = ChatTemplate(builtin_template("gemma")).render(CONVERSATION[:3], add_generation_prompt=False)
    assert closed.endswith("<start_of_turn>model\nHello!<end_of_turn>\n")


def test_builtin_gemma_system_waits_for_a_user_turn():
    msgs = [{"role": "system", "content": "A."}, {"role": "system", "content": "B."},
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert ChatTemplate(builtin_template("gemma")).render(msgs, add_generation_prompt=False) == (
        "<start_of_turn>model\nx<end_of_turn>\n<start_of_turn>user\nA.B.\n\ny<end_of_turn>\n")


def test_builtin_chatml():
    text = ChatTemplate(builtin_template("chatml")).render(CONVERSATION[1:3])
    assert text == ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n Hello! <|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_builtin_names():
    assert set(builtin_names()) == {"chatml", "gemma"}
    with pytest.raises(InvalidRequest, match="unknown chat template 'vicuna'"):
        builtin_template("vicuna")


def test_template_choice():
    smol_like = {"tokenizer.chat_template": "{{ 'file' }}", "tokenizer.ggml.tokens": ["<|im_start|>"],
                 "tokenizer.chat_template.tool_use": "{{ 'tools' }}"}
    assert template_for(smol_like) == "{{ 'file' }}"
    assert template_for(smol_like, "tool_use") == "{{ 'tools' }}"
    assert template_for(smol_like, "gemma") == builtin_template("gemma")  # an explicit name wins
    assert template_for({"tokenizer.ggml.tokens": ["<start_of_turn>"]}) == builtin_template("gemma")
    assert template_for({"general.architecture": "gemma3"}) == builtin_template("gemma")
    assert template_for({"tokenizer.ggml.tokens": ["a"]}) == builtin_template("chatml")
    with pytest.raises(InvalidRequest):
        template_for(smol_like, "nope")
    with pytest.raises(FormatError, match="tokenizer.chat_template"):
        template_for({"tokenizer.chat_template": 7})


# --- rendering as Hugging Face does ----------------------------------------------------------------------

def render(source: str, messages: list[dict] | None = None, **kw) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
        messages if messages is not None else [{"role": "user", "content": "hi"}], **kw)


def test_block_whitespace_is_trimmed_and_final_newline_dropped():
    src = ("{% for m in messages %}\n"
           "    {% if m.role == 'user' %}\n"
           "[{{ m.content }}]\n"
           "    {% endif %}\n"
           "{% endfor %}\n")
    assert render(src, CONVERSATION) == "[Hi there]\n[What is 2+2?]\n"
    assert render("x\n") == "x"


def test_variables_and_helpers():
    assert render("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}") == "<s>hi</s>"
    assert render("{{ add_generation_prompt }}", add_generation_prompt=False) == "False"
    assert render("{{ tools is none }}/{{ documents is none }}") == "True/True"
    assert render("{{ date }}", date="26 Jul 2024") == "26 Jul 2024"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.date.today().year)
    # tojson as HF: plain JSON, non-ASCII kept, no HTML escaping, optional indent
    assert render("{{ messages | tojson }}", [{"role": "user", "content": "<é & ü>"}]) == \
        '[{"role": "user", "content": "<é & ü>"}]'
    assert render("{{ {'a': 1} | tojson(indent=2) }}") == '{\n  "a": 1\n}'
    assert render("{% for m in messages %}{{ loop.index }}{% if loop.index == 2 %}{% break %}{% endif %}"
                  "{% endfor %}", CONVERSATION) == "12"
    assert render("{% generation %}{{ 'kept' }}{% endgeneration %}") == "kept"


def test_raise_exception_is_a_one_line_invalid_request():
    src = "{% if messages[0].role != 'system' %}{{ raise_exception('System message first!\\nplease') }}{% endif %}"
    with pytest.raises(InvalidRequest, match="System message first! please") as err:
        render(src)
    assert "\n" not in str(err.value)


def test_syntax_error_is_a_one_line_format_error():
    with pytest.raises(FormatError, match="line 3") as err:
        ChatTemplate("ok\n{% for m in messages %}\n{{ m.content }")
    assert "\n" not in str(err.value)


def test_runtime_failures_are_invalid_requests():
    # the template renders a one-message conversation (so it loads) and fails on longer ones
    for body, message in (("{{ nothing.here }}", "undefined"), ("{{ 1 / 0 }}", "ZeroDivisionError")):
        tmpl = ChatTemplate("{% if messages | length > 1 %}" + body + "{% endif %}ok")
        assert tmpl.render([{"role": "user", "content": "hi"}]) == "ok"
        with pytest.raises(InvalidRequest, match=message) as err:
            tmpl.render(CONVERSATION)
        assert "\n" not in str(err.value)


def test_a_template_that_cannot_render_one_message_is_refused_at_load():
    for source, message in (("{{ nothing.here }}", "undefined"), ("{{ 1 / 0 }}", "ZeroDivisionError"),
                            ("{{ messages[3].content }}", "no element 3"),
                            ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                             "longer than|more than")):
        with pytest.raises(FormatError, match="one-message conversation: .*(" + message + ")") as err:
            ChatTemplate(source)
        assert "\n" not in str(err.value)
    # one that rejects that conversation on purpose still loads, and says so when asked to render it
    tmpl = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}x")
    with pytest.raises(InvalidRequest, match="system first"):
        tmpl.render([{"role": "user", "content": "hi"}])
    assert tmpl.render([{"role": "system", "content": "s"}]) == "x"


@pytest.mark.parametrize("messages, message", [
    ("hello", "messages must be a list"),
    ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\].role"),
    ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\].content"),
    ([{"role": "user", "content": None}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text only"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\].content\[0\] must be a text part"),
    ([{"role": 3, "content": "hi"}], "role must be a non-empty string"),
])
def test_messages_are_validated(messages, message):
    with pytest.raises(InvalidRequest, match=message):
        ChatTemplate(builtin_template("chatml")).render(messages)


def test_content_parts_are_text():
    # OpenAI's content parts, as the server accepts them, render as their joined text
    t = ChatTemplate(builtin_template("chatml"))
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}]
    assert t.render(parts) == t.render([{"role": "user", "content": "Hello, world"}])


# --- the sandbox -----------------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__['__builtins__']['open']('{marker}', 'w') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append({'role': 'x'}) %}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ self.__init__.__globals__ }}",
    "{{ ('a' * 100000) * 100000 }}",
    "{{ 'x' * 999999999 }}",
    "{{ 9 ** 99999999 }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_sandbox_refuses_escapes(source, tmp_path: Path):
    marker = tmp_path / "pwned"
    src = source.replace("{marker}", str(marker))
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises((FormatError, InvalidRequest)) as err:
        ChatTemplate(src).render(msgs)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    assert msgs == [{"role": "user", "content": "hi"}]


def test_sandbox_reports_probes_that_would_print_nothing():
    # Jinja alone renders an unsafe attribute as ""; here even a bare probe is refused
    for probe in ("{{ ''.__class__ }}", "{{ '{0.__class__}'.format(messages) }}", "{{ messages.__len__ }}"):
        with pytest.raises(FormatError, match="unsafe"):
            render(probe)


# --- bounds: time, size, memory, output, nesting -------------------------------------------------------

# Each must end in one clean error line, within 2 s and 200 MB; before bounds, the first ran for hours, the
# second died of MemoryError after gigabytes, the third and fourth built a 1 GB string.
HOSTILE = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{{ 'x' * 1000000 }}{% endfor %}",
    "{{ '{:>999999999}'.format('a') }}",
    '{{ "%999999999d" % 1 }}',
    '{{ "%.999999999f" % 1.0 }}',
    '{{ "%*d" % (999999999, 1) }}',
    "{{ '%(a)s%(a)s%(a)s%(a)s' * 200000 % {'a': 'x' * 1000000} }}",
    "{{ ('{0}' * 200000).format('x' * 1000000) }}",
    "{{ 'a'.center(999999999) }}",
    "{{ 'a' | center(999999999) }}",
    "{{ ('a' * 1000000).replace('', 'b' * 1000000) }}",
    "{{ (['x' * 1000000] * 1000) | join }}",
    "{{ ','.join(['x' * 1000000] * 1000) }}",
    "{{ ('\\t' * 1000000).expandtabs(1000000) }}",
    "{{ (1).to_bytes(999999999, 'big') }}",
    "{% set a = ['x' * 1000] * 1000 %}{% set b = [a] * 1000 %}{{ b }}",
    "{% set ns = namespace(x=['y']) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x }}",
    "{% set ns = namespace(x=['y']) %}{% for i in range(64) %}{% set ns.x = [ns.x, ns.x] %}{% endfor %}"
    "{{ ns.x | tojson }}",
    "{% set ns = namespace(x='y') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{{ (9 ** 1024) ** 1024 }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + ['x' * 1000000 ~ i] %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "{% macro m(s) %}{{ m(s ~ 'x' * 500000) }}{% endmacro %}{{ m('') }}",
    "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 200 + "{% endfor %}{% endfor %}"
    "{% endset %}",
    "{% for i in range(100000) %}{% for j in range(100000) if false %}{% endfor %}{% endfor %}",
    "{% for x in [1] recursive %}{% for y in range(100000) %}{{ loop(range(100000)) }}{% endfor %}{% endfor %}",
    "{{ ('a\\n' * 500000) | indent(100) }}",
    "{{ {'a': 'b'} | tojson(indent=999999999) }}",
    "{{ [1] | batch(999999999, 0) | list }}",
    "{{ range(100000) | slice(999999) | list }}",
    "{{ ('a' * 1000000) | wordwrap(1) }}",
    "{{ lipsum(999999) }}",
]

_HOSTILE_RUNNER = r"""
import json, resource, sys, time
from barellm.errors import BarellmError
from barellm.text.chat import ChatTemplate

sources = json.loads(sys.stdin.read())
ChatTemplate("{{ messages[0].content }}").render([{"role": "user", "content": "warm up"}])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for src in sources:
    t = time.perf_counter()
    try:
        ChatTemplate(src, probe=False).render([{"role": "user", "content": "hi"}])
        kind, msg = "ok", ""
    except BarellmError as e:
        kind, msg = type(e).__name__, str(e)
    except BaseException as e:
        kind, msg = "!" + type(e).__name__, str(e)[:200]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"kind": kind, "message": msg, "seconds": time.perf_counter() - t, "grown_mb": grown}),
          flush=True)
"""


def test_hostile_templates_end_cleanly_in_bounded_time_and_memory():
    import json
    import resource
    import subprocess
    import sys

    def cap_memory():  # a render that escapes its bounds fails here instead of taking the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-c", _HOSTILE_RUNNER], input=json.dumps(HOSTILE), capture_output=True,
                          text=True, timeout=240, preexec_fn=cap_memory)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(HOSTILE), proc.stderr[-2000:]
    for src, r in zip(HOSTILE, results, strict=True):
        assert r["kind"] in ("InvalidRequest", "FormatError"), (src, r)
        assert "\n" not in r["message"] and len(r["message"]) < 400, (src, r)
        assert r["seconds"] < 2.0, (src, r)
    # peak resident memory of the whole run, over what the interpreter held before the first template
    assert max(r["grown_mb"] for r in results) < 200, results


def test_limits_are_named_and_adjustable():
    fast = RenderLimits(seconds=0.05)
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match=r"longer than 0.05 s"):
        ChatTemplate(HOSTILE[0], limits=fast, probe=False).render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 1.0
    small = RenderLimits(max_output=100, max_value=50, max_steps=1000)
    msg = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match="output of more than 100 characters"):
        ChatTemplate("{% for i in range(20) %}0123456789{% endfor %}", limits=small, probe=False).render(msg)
    with pytest.raises(InvalidRequest, match="a repetition of 60 characters"):
        ChatTemplate("{{ 'x' * 60 }}", limits=small, probe=False).render(msg)
    with pytest.raises(InvalidRequest, match="more than 1000 steps"):
        ChatTemplate("{% for i in range(2000) %}{% endfor %}", limits=small, probe=False).render(msg)
    # a render within the limits is untouched by them
    assert ChatTemplate("{{ 'x' * 50 }}", limits=small).render(msg) == "x" * 50


def test_loop_nesting_is_bounded_when_the_template_loads():
    def nested(depth: int) -> str:
        return "{% for i in [1] %}" * depth + "x" + "{% endfor %}" * depth

    assert ChatTemplate(nested(8)).render([{"role": "user", "content": "hi"}]) == "x"
    with pytest.raises(FormatError, match="line 1: for-loops nested more than 8 deep"):
        ChatTemplate(nested(9))
    with pytest.raises(FormatError, match="at most 262144"):
        ChatTemplate("x" * 300000)


def test_bounds_leave_ordinary_template_features_alone():
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    cases = {
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '.' if loop.last }}{% endfor %}": "1/32/33/3.",
        "{% for m in messages if m.role == 'user' %}{{ m.content }}{% else %}none{% endfor %}": "ac",
        "{{ messages | map(attribute='content') | join('-') }}": "a-b-c",
        "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}": "2",
        "{{ (messages[1:] | last).content }}{{ messages[-1]['content'] ~ 'x' }}": "ccx",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}": "3",
        "{% macro turn(m) %}<{{ m.role }}>{% endmacro %}{% for m in messages %}{{ turn(m) }}{% endfor %}":
            "<user><assistant><user>",
        "{{ '%s=%d' % ('n', 3) }} {{ '{}:{:>3}'.format('a', 7) }} {{ 'a b'.split() }} {{ 'ab' * 2 }}":
            "n=3 a:  7 ['a', 'b'] abab",
        "{{ [1, 2] + [3] }} {{ {'k': [1]} | tojson }} {{ 2 ** 10 }} {{ -3 }} {{ 'x' | center(5) }}":
            "[1, 2, 3] {\"k\": [1]} 1024 -3   x  ",
        "{{ messages | map(attribute='content') | map('upper') | join }} {{ [1, 2, 3] | sum }}": "ABC 6",
        "{% for a, b in [(1, 2)] %}{{ a + b }}{% endfor %} {{ 'a\\nb' | indent(2, true) }}": "3   a\n  b",
        "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}{% endif %}"
        "{% endfor %}": "123",
    }
    for source, expected in cases.items():
        assert ChatTemplate(source, probe=False).render(conv) == expected, source


# --- Qwen2.5: the tools branch -------------------------------------------------------------------------

QWEN = (Path(__file__).parent / "data" / "qwen2.5_chat_template.jinja").read_text(encoding="utf-8")
QWEN_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QWEN_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "21 degrees, clear."},
    {"role": "user", "content": "Thanks"},
]


def _unbounded_hf_render(source: str, messages: list[dict], **kw) -> str:
    """The template rendered as transformers' apply_chat_template does: the oracle for the bounded one."""
    import json

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    args = {"tools": None, "documents": None, "bos_token": "", "eos_token": "", "add_generation_prompt": True}
    return env.from_string(source).render(**{**args, **kw, "messages": messages})


def test_qwen_template_with_tools():
    text = ChatTemplate(QWEN).render(QWEN_CONVERSATION, tools=QWEN_TOOLS)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"sky": "clear"}\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n21 degrees, clear.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("source", [QWEN, builtin_template("chatml"), builtin_template("gemma")])
@pytest.mark.parametrize("tools", [None, QWEN_TOOLS])
def test_bounded_rendering_equals_unbounded(source, tools):
    tmpl = ChatTemplate(source, bos_token="", eos_token="")
    for messages in (QWEN_CONVERSATION, QWEN_CONVERSATION[1:2], CONVERSATION):
        for agp in (True, False):
            try:
                expected = _unbounded_hf_render(source, messages, tools=tools, add_generation_prompt=agp)
            except Exception:  # noqa: BLE001 - the template rejects this conversation; ours must too
                with pytest.raises(InvalidRequest):
                    tmpl.render(messages, add_generation_prompt=agp, tools=tools)
                continue
            assert tmpl.render(messages, add_generation_prompt=agp, tools=tools) == expected


# --- the probe's note: a template that passed it is compiled by its first render --------------------------------


def test_a_passed_probe_is_remembered_and_the_next_load_compiles_at_the_first_render(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path))
    source = builtin_template("chatml")
    first = ChatTemplate(source, "<s>", "</s>")
    assert first._compiled is not None  # probed: compiled and rendered here
    assert len(list((tmp_path / "checked").iterdir())) == 1
    again = ChatTemplate(source, "<s>", "</s>")
    assert again._compiled is None  # the note stood for the probe
    assert again.render(CONVERSATION) == first.render(CONVERSATION)
    # another bos token, other limits or another source are other checks, probed in full
    for other in (ChatTemplate(source, "<bos>", "</s>"), ChatTemplate(source, "<s>", "</s>", limits=RenderLimits(
            max_steps=1 << 19)), ChatTemplate(source + " ", "<s>", "</s>")):
        assert other._compiled is not None
    assert len(list((tmp_path / "checked").iterdir())) == 4


def test_a_template_that_fails_is_never_noted_and_fails_at_every_load(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path))
    for _ in range(2):
        with pytest.raises(FormatError, match="one-message conversation"):
            ChatTemplate("{{ messages[5].content.upper() }}")
        with pytest.raises(FormatError, match="line 1"):
            ChatTemplate("{% for m in messages %}")
    assert not (tmp_path / "checked").exists()


def test_a_note_that_stands_for_a_broken_template_fails_its_renders_with_a_format_error(tmp_path, monkeypatch):
    # a note is only written after a passed probe; one that a different Jinja would no longer stand behind
    # (stood in for here by a note made by hand) leaves the failure to the first render, as a FormatError
    from barellm.files import note_passed

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path))
    broken = "{% for m in messages %}"
    probe = object.__new__(ChatTemplate)
    probe.source, probe.bos_token, probe.eos_token, probe.limits = broken, "", "", RenderLimits()
    note_passed(probe._probe_digest())
    tmpl = ChatTemplate(broken)
    with pytest.raises(FormatError, match="line 1"):
        tmpl.render([{"role": "user", "content": "hi"}])
