"""Chat templates: Jinja sources (from the model file or built in) rendered the way Hugging Face's
apply_chat_template renders them, inside a sandbox.

A template comes from a downloaded file, so it is untrusted code: it runs in Jinja's immutable sandbox,
which refuses access to Python internals (``''.__class__.__mro__``, ``cycler.__init__.__globals__``) and
mutation of the objects passed in; on top of that, string and list repetition and powers are capped so a
template cannot exhaust memory with one expression.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from importlib import resources
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from barellm.errors import FormatError, InvalidRequest

__all__ = ["ChatTemplate", "builtin_template", "builtin_names", "message_text", "template_for", "validate_messages"]

_BUILTINS = ("chatml", "gemma")
_MAX_REPEAT = 1 << 20  # characters or items one '*' may produce
_MAX_EXPONENT = 1024


class _TemplateRaised(Exception):
    """raise_exception() called by a template: the template rejects the conversation."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON, as HF gives them
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: HF marks assistant text for training masks with it; for
    rendering it is transparent, but templates that use it must still parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja's default hands back an Undefined that prints as "", so a probe like {{ x.__class__ }}
        # would pass silently; a template that reaches for internals is hostile and should say so.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is too large")
        if operator == "*":
            for seq, k in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and len(seq) * k > _MAX_REPEAT:
                    raise SecurityError(f"repetition to {len(seq) * k} items is too large")
        return super().call_binop(context, operator, left, right)


def _environment() -> _Sandbox:
    # HF's settings: blocks eat their trailing newline and leading indentation; the template's own final
    # newline is dropped (keep_trailing_newline stays False); break/continue are allowed.
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def message_text(content: Any, where: str = "content") -> str:
    """A message's text: a string as it is, or OpenAI's content parts ([{"type": "text", "text": ...}, ...])
    joined with nothing between them; InvalidRequest for anything else (images and audio included: the
    models read text only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
        raise InvalidRequest(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequest(f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": str}} "
                                 f"(this model reads text only), got {str(kind)[:50]!r}")
        texts.append(part["text"])
    return "".join(texts)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """messages as a list of dicts, each with a str role and a content that is a string or OpenAI's text
    parts (made a string here); InvalidRequest otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequest(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string, got {role!r}")
        out.append({**m, "content": message_text(m.get("content"), f"messages[{i}].content")})
    return out


class ChatTemplate:
    """A compiled chat template. render() turns messages into the prompt text the model was tuned on."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str):
            raise FormatError(f"chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as e:
            raise FormatError(f"chat template line {e.lineno}: {_one_line(e.message or 'syntax error')}") from None
        except TemplateError as e:
            raise FormatError(f"chat template: {_one_line(e.message or type(e).__name__)}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for messages; add_generation_prompt opens the assistant's turn. extra are
        further template variables (e.g. tools, or a date a template asks for)."""
        msgs = validate_messages(messages)
        variables: dict[str, Any] = {
            # HF passes tools and documents even when absent, so "is defined" tests see them as None
            "tools": None,
            "documents": None,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        variables.update(extra)
        variables["messages"] = msgs
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(**variables)
        except _TemplateRaised as e:
            raise InvalidRequest(f"chat template rejected the messages: {_one_line(str(e))}") from None
        except SecurityError as e:
            # the template tried to reach outside the sandbox: a hostile or broken model file
            raise FormatError(f"chat template refused: {_one_line(str(e))}") from None
        except TemplateError as e:
            raise InvalidRequest(f"chat template failed: {_one_line(e.message or type(e).__name__)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError,
                OverflowError, RecursionError) as e:
            raise InvalidRequest(f"chat template failed: {type(e).__name__}: {_one_line(str(e))}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} characters)"


def builtin_names() -> tuple[str, ...]:
    """Names builtin_template() knows."""
    return _BUILTINS


def builtin_template(name: str) -> str:
    """The Jinja source of a built-in template ("chatml", "gemma")."""
    if name not in _BUILTINS:
        raise InvalidRequest(f"unknown chat template {name!r} (built in: {', '.join(_BUILTINS)})")
    return resources.files("barellm.text").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def _default_builtin(md: Mapping[str, Any]) -> str:
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = set(tokens) if isinstance(tokens, (list, tuple)) else set()
    arch = md.get("general.architecture")
    if "<start_of_turn>" in vocab or (isinstance(arch, str) and arch.startswith("gemma")):
        return "gemma"
    return "chatml"  # llama.cpp's fallback too


def template_for(metadata: Mapping[str, Any], name: str | None = None) -> str:
    """The chat template source to use for a model.

    With no name: the file's tokenizer.chat_template, or, when the file has none, the built-in that fits
    the vocabulary (gemma for Gemma's turn tokens, chatml otherwise). A name picks one of the file's
    named templates (tokenizer.chat_template.<name>) or a built-in, overriding the file's default.
    """
    if name is not None:
        named = metadata.get(f"tokenizer.chat_template.{name}")
        if isinstance(named, str) and named:
            return named
        return builtin_template(name)
    src = metadata.get("tokenizer.chat_template")
    if src is not None and not isinstance(src, str):
        raise FormatError(f"tokenizer.chat_template: expected a string, got {type(src).__name__}")
    if src:
        return src
    return builtin_template(_default_builtin(metadata))
