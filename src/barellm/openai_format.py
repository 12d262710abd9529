"""OpenAI's response objects as plain dicts: the one place that builds them, for the server's routes and for
Model.create_completion / create_chat_completion alike, so code written against either sees the same
shapes (and code written for llama-cpp-python's methods of those names moves over unchanged).

Pure functions of their arguments, no dependencies: the server's pydantic models only describe these
shapes (serve/openapi_doc.py), and its tests hold the dicts to them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

__all__ = ["new_id", "usage", "chat_completion", "text_completion", "chat_chunk", "text_chunk", "usage_chunk"]


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _envelope(id: str, obj: str, created: int | None, model: str, fingerprint: str | None,
              choices: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": id, "object": obj, "created": int(time.time()) if created is None else created,
                           "model": model}
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    out["choices"] = choices
    return out


def chat_completion(id: str, model: str, text: str, finish_reason: str, usage: dict[str, Any], *,
                    logprobs: dict[str, Any] | None = None, created: int | None = None,
                    fingerprint: str | None = None) -> dict[str, Any]:
    """A whole chat reply: {"object": "chat.completion", "choices": [{"message": {...}}], "usage"}."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
              "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(id, "chat.completion", created, model, fingerprint, [choice]), "usage": usage}


def text_completion(id: str, model: str, text: str, finish_reason: str, usage: dict[str, Any], *,
                    logprobs: dict[str, Any] | None = None, created: int | None = None,
                    fingerprint: str | None = None) -> dict[str, Any]:
    """A whole completion: {"object": "text_completion", "choices": [{"text": ...}], "usage"}."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(id, "text_completion", created, model, fingerprint, [choice]), "usage": usage}


def chat_chunk(id: str, model: str, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None, created: int | None = None,
               fingerprint: str | None = None, with_usage: bool = False) -> dict[str, Any]:
    """One streamed chat piece: the opening one (role), a piece of text, or the closing one (finish_reason).
    with_usage: the stream ends with a usage_chunk, and every chunk before it says "usage": null."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif text is not None:
        delta = {"content": text}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    out = _envelope(id, "chat.completion.chunk", created, model, fingerprint, [choice])
    if with_usage:
        out["usage"] = None
    return out


def text_chunk(id: str, model: str, *, text: str = "", finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, created: int | None = None, fingerprint: str | None = None,
               with_usage: bool = False) -> dict[str, Any]:
    """One streamed completion piece (the last one carries finish_reason)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out = _envelope(id, "text_completion", created, model, fingerprint, [choice])
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(id: str, model: str, chat: bool, usage: dict[str, Any], *, created: int | None = None,
                fingerprint: str | None = None) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices, the counts."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(id, obj, created, model, fingerprint, []), "usage": usage}
