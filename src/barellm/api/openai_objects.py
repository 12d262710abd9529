"""OpenAI's response objects as dicts: whole answers and stream chunks of chats and completions, usage,
embeddings and log-probabilities. Pure functions of their arguments, which the server's pydantic models only
describe (serve/openapi_doc.py), and its tests hold the dicts to; api/openai.py (ResponseBuilder) shapes a
request's answer with them and offers them under its own name too.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["new_id", "usage", "chat_completion", "text_completion", "chat_chunk", "text_chunk", "usage_chunk",
           "tool_call_deltas", "embeddings", "chat_logprobs", "completion_logprobs"]


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int | None = None
          ) -> dict[str, Any]:
    """OpenAI's usage object; with reasoning_tokens (a chat's: how many of the completion tokens went to a
    reasoning model's reasoning, 0 for any other) its completion_tokens_details."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def _envelope(id: str, obj: str, created: int | None, model: str, fingerprint: str | None,
              choices: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": id, "object": obj, "created": int(time.time()) if created is None else created,
                           "model": model}
    if fingerprint is not None:
        out["system_fingerprint"] = fingerprint
    out["choices"] = choices
    return out


def chat_completion(id: str, model: str, text: str | None, finish_reason: str, usage: dict[str, Any], *,
                    logprobs: dict[str, Any] | None = None, created: int | None = None,
                    fingerprint: str | None = None, tool_calls: list[dict[str, Any]] | None = None,
                    reasoning: str | None = None) -> dict[str, Any]:
    """A whole chat reply: {"object": "chat.completion", "choices": [{"message": {...}}], "usage"}. With
    tool_calls (OpenAI's [{"id", "type": "function", "function": {"name", "arguments"}}]) the message carries
    them and text is what the model wrote besides (None when nothing). reasoning: a reasoning model's, as
    llama-server gives it (message.reasoning_content)."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(id, "chat.completion", created, model, fingerprint, [choice]), "usage": usage}


def text_completion(id: str, model: str, text: str, finish_reason: str, usage: dict[str, Any], *,
                    logprobs: dict[str, Any] | None = None, created: int | None = None,
                    fingerprint: str | None = None) -> dict[str, Any]:
    """A whole completion: {"object": "text_completion", "choices": [{"text": ...}], "usage"}."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope(id, "text_completion", created, model, fingerprint, [choice]), "usage": usage}


def chat_chunk(id: str, model: str, *, text: str | None = None, role: bool = False,
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None, created: int | None = None,
               fingerprint: str | None = None, with_usage: bool = False,
               tool_calls: list[dict[str, Any]] | None = None, reasoning: str | None = None) -> dict[str, Any]:
    """One streamed chat piece: the opening one (role), a piece of text, a piece of a reasoning model's
    reasoning (delta.reasoning_content, llama-server's), tool calls (each whole, with its "index" among the
    reply's calls), or the closing one (finish_reason).
    with_usage: the stream ends with a usage_chunk, and every chunk before it says "usage": null."""
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif tool_calls:
        delta = {"tool_calls": tool_calls}
    elif reasoning is not None:
        delta = {"reasoning_content": reasoning}
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


def tool_call_deltas(calls: list[dict[str, Any]], first_index: int) -> list[dict[str, Any]]:
    """Whole tool calls as the entries of a streamed delta.tool_calls: each with its index in the reply."""
    return [{"index": first_index + i, **c} for i, c in enumerate(calls)]


def embeddings(model: str, vectors: list[Any], prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's embeddings list: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
    "model", "usage"}; each vector a list of floats, or a base64 string of little-endian float32."""
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _token(token_bytes: Callable[[int], bytes], token_id: int, as_ids: bool) -> tuple[str, list[int]]:
    b = token_bytes(token_id)
    return (f"token_id:{token_id}" if as_ids else b.decode("utf-8", errors="replace")), list(b)


def chat_logprobs(toks: Sequence[Any], token_bytes: Callable[[int], bytes], as_ids: bool = False) -> dict[str, Any]:
    """A chat choice's logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}.
    toks: TokenLogprob-like (token_id, logprob, top [(id, logprob)]); as_ids: tokens named "token_id:<id>"."""
    content = []
    for t in toks:
        s, b = _token(token_bytes, t.token_id, as_ids)
        top = []
        for i, lp in t.top:
            ts, tb = _token(token_bytes, i, as_ids)
            top.append({"token": ts, "logprob": lp, "bytes": tb})
        content.append({"token": s, "logprob": t.logprob, "bytes": b, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(toks: Sequence[Any], token_bytes: Callable[[int], bytes], offset: int,
                        as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """A completion choice's logprobs ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}) and the
    text offset after them (offsets count characters from offset, the start of this run of tokens)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in toks:
        out["tokens"].append(_token(token_bytes, t.token_id, as_ids)[0])
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({_token(token_bytes, i, as_ids)[0]: lp for i, lp in t.top})
        out["text_offset"].append(offset)
        offset += len(token_bytes(t.token_id).decode("utf-8", errors="ignore"))
    return out, offset
