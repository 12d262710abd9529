"""Chat templates: HF-compatible rendering, the built-in templates, template choice, message validation,
and the sandbox holding against templates that try to escape it."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from gguf_metadata import read_metadata

from barellm.errors import FormatError, InvalidRequest
from barellm.text.chat import ChatTemplate, builtin_names, builtin_template, template_for
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
    with pytest.raises(InvalidRequest, match="undefined"):
        render("{{ nothing.here }}")
    with pytest.raises(InvalidRequest, match="ZeroDivisionError"):
        render("{{ 1 / 0 }}")


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
