"""Chat templates: Jinja sources (from the model file or built in) rendered the way Hugging Face's
apply_chat_template renders them, inside a bounded sandbox.

A template comes from a downloaded file, so it is untrusted code: it runs in Jinja's immutable sandbox,
which refuses access to Python internals (``''.__class__.__mro__``, ``cycler.__init__.__globals__``) and
mutation of the objects passed in, and every render is held to RenderLimits (time, steps, the size of any
value, memory, output, loop nesting: see sandbox.py). A template that fails on a one-message conversation
is refused when the model loads; one that fails on a request fails that request with one line.

That load-time probe compiles and renders the template, which takes Jinja (tens of milliseconds to import)
and the compile itself. Once a template has passed it on this machine, a note in the cache says so (for
exactly that source, those tokens and limits, and the Jinja and sandbox that ran it), and later loads leave
Jinja alone until the first chat request compiles the template.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from barellm.errors import FormatError, InvalidRequest
from barellm.text.limits import RenderLimits, TemplateLimit, TemplateRaised

__all__ = ["ChatTemplate", "RenderLimits", "builtin_template", "builtin_names", "message_text", "template_for",
           "validate_messages"]

_BUILTINS = ("chatml", "gemma")
# what a template must render at load: nearly every template accepts it (one that rejects it with
# raise_exception still loads)
_PROBE = [{"role": "user", "content": "Hello"}]
_PROBE_REVISION = 1  # part of a passed probe's note: raise it when what the probe accepts changes
_SANDBOX_FILES = ("sandbox.py", "limits.py")  # their sizes and times are part of it too


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


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
    """A compiled chat template. render() turns messages into the prompt text the model was tuned on.

    limits bound every render (default RenderLimits(): 1 s, 4M characters of output, ...). With probe
    (the default), the template is rendered once on a one-message conversation here, so that a template
    that cannot render at all, or runs past its limits, is a FormatError at load rather than a failure of
    every request; one that passed that probe before on this machine is compiled by its first render."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 limits: RenderLimits | None = None, probe: bool = True) -> None:
        if not isinstance(source, str):
            raise FormatError(f"chat template must be a string, got {type(source).__name__}")
        self.limits = limits or RenderLimits()
        if len(source) > self.limits.max_source:
            raise FormatError(f"chat template is {len(source)} characters long (at most {self.limits.max_source})")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled: Any = None
        if not probe:
            self._compiled = self._compile()
            return
        from barellm.files import note_passed, passed_before

        digest = self._probe_digest()
        if passed_before(digest):
            return  # compiled by the first render
        self._compiled = self._compile()
        try:
            self._render(_PROBE, True, {})
        except TemplateRaised:
            pass  # the template refuses that conversation on purpose; it may accept others
        except Exception as e:  # noqa: BLE001 - whatever a template raises is the file's fault
            raise FormatError(f"chat template fails on a one-message conversation: {_describe(e)}") from None
        note_passed(digest)

    def _compile(self) -> Any:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError

        from barellm.text.sandbox import environment

        try:
            return environment(self.limits).from_string(self.source)
        except TemplateSyntaxError as e:
            raise FormatError(f"chat template line {e.lineno}: {_one_line(e.message or 'syntax error')}") from None
        except TemplateError as e:
            raise FormatError(f"chat template: {_one_line(e.message or type(e).__name__)}") from None
        except (RecursionError, MemoryError, SyntaxError, ValueError) as e:  # nested too deeply to compile
            raise FormatError(f"chat template cannot be compiled: {type(e).__name__}: {_one_line(str(e))}") from None

    @property
    def _template(self) -> Any:
        # two threads' first renders may both compile it: the same template either way
        if self._compiled is None:
            self._compiled = self._compile()
        return self._compiled

    def _probe_digest(self) -> str:
        """What a passed probe's note is named by: the template and its tokens and limits, and the files of
        Jinja and of the sandbox that compiled and ran it (another version may judge it otherwise)."""
        import hashlib
        import importlib.util

        h = hashlib.sha256(f"chat-template-probe {_PROBE_REVISION}".encode())
        for part in (self.source, self.bos_token, self.eos_token, repr(self.limits)):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        spec = importlib.util.find_spec("jinja2")
        here = os.path.dirname(os.path.abspath(__file__))
        for path in (spec.origin if spec else None, __file__, *(os.path.join(here, f) for f in _SANDBOX_FILES)):
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            h.update(f"\0{path} {st.st_size} {st.st_mtime_ns}".encode("utf-8", "surrogatepass") if st else b"\0-")
        return h.hexdigest()

    def _render(self, messages: Any, add_generation_prompt: bool, extra: dict[str, Any]) -> str:
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
        from barellm.text.sandbox import render

        return render(self._template, variables, self.limits)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for messages; add_generation_prompt opens the assistant's turn. extra are
        further template variables (e.g. tools, or a date a template asks for)."""
        try:
            return self._render(messages, add_generation_prompt, extra)
        except (InvalidRequest, FormatError):  # (FormatError: a template first compiled here that fails to)
            raise
        except TemplateRaised as e:
            raise InvalidRequest(f"chat template rejected the messages: {_one_line(str(e))}") from None
        except Exception as e:  # noqa: BLE001 - a template's failure is the request's, in one line
            from jinja2.exceptions import SecurityError

            if isinstance(e, SecurityError):
                # the template tried to reach outside the sandbox: a hostile or broken model file
                raise FormatError(f"chat template refused: {_one_line(str(e))}") from None
            raise InvalidRequest(f"chat template failed: {_describe(e)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} characters)"


def _describe(e: BaseException) -> str:
    from jinja2.exceptions import TemplateError

    if isinstance(e, TemplateLimit):
        return _one_line(str(e))
    if isinstance(e, TemplateError):
        return _one_line(e.message or type(e).__name__)
    return f"{type(e).__name__}: {_one_line(str(e))}"


def builtin_names() -> tuple[str, ...]:
    """Names builtin_template() knows."""
    return _BUILTINS


def builtin_template(name: str) -> str:
    """The Jinja source of a built-in template ("chatml", "gemma")."""
    if name not in _BUILTINS:
        raise InvalidRequest(f"unknown chat template {name!r} (built in: {', '.join(_BUILTINS)})")
    from importlib import resources

    return resources.files("barellm.text").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def _default_builtin(md: Mapping[str, Any]) -> str:
    tokens = md.get("tokenizer.ggml.tokens")
    # (a scan of the list: a set of a 262,144-token vocabulary took 8 MB at the height of a load's memory use)
    turns = isinstance(tokens, (list, tuple)) and "<start_of_turn>" in tokens
    arch = md.get("general.architecture")
    if turns or (isinstance(arch, str) and arch.startswith("gemma")):
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
