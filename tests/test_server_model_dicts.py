"""Model.create_completion / create_chat_completion return the dicts the server returns (one builder,
barellm.api.openai), and Model.chat takes the content parts the server takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from barellm.api import openai as openai_api

CHAT = [{"role": "user", "content": "Name three colors."}]


def _shape(x: Any) -> Any:
    """The keys of a response, recursively (lists by their first item), values dropped."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(x[0])] if x else []
    return type(x).__name__ if x is not None else None


def test_openai_format_is_plain_python() -> None:
    # the builders (and the Model that uses them) must work on an install without the server's extra
    code = ("import sys, barellm.api.openai, barellm.api.model; "
            "assert not {'pydantic', 'starlette'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
    u = openai_api.usage(5, 3, 2)
    assert u == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                 "prompt_tokens_details": {"cached_tokens": 2}}
    c = openai_api.chat_completion("chatcmpl-x", "m", "hi", "stop", u, created=7)
    assert c == {"id": "chatcmpl-x", "object": "chat.completion", "created": 7, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi", "refusal": None}, "logprobs": None,
         "finish_reason": "stop"}], "usage": u}


@pytest.fixture(scope="module")
def model(smollm_gguf: Path) -> Any:
    import barellm

    return barellm.load(smollm_gguf, context=512)


@pytest.mark.model
def test_results_are_the_servers_dicts(model: Any, smollm_gguf: Path) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from test_server import serving

    import barellm
    from barellm.serve import openapi_doc
    from barellm.serve.app import create_app

    kw = {"temperature": 0, "max_tokens": 8}
    mine = model.create_chat_completion(CHAT, **kw)
    text = model.create_completion("The capital of France is", **kw)
    served = barellm.load(smollm_gguf, context=512)
    with serving(create_app(served, model_id=model.name)) as url:
        theirs = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **kw}, timeout=120).json()
        theirs_text = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", **kw},
                                 timeout=120).json()
    for a, b, doc in ((mine, theirs, openapi_doc.ChatCompletion), (text, theirs_text, openapi_doc.Completion)):
        b.pop("system_fingerprint")
        assert _shape(a) == _shape(b)
        assert a["model"] == b["model"] and a["object"] == b["object"] and a["choices"] == b["choices"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
        assert a["id"] != b["id"] and a["id"].startswith(b["id"].split("-")[0] + "-")
        doc.model_validate({**a, "system_fingerprint": "x"})
    assert mine["choices"][0]["message"]["content"] == model.chat(CHAT, **kw)
    assert text["choices"][0]["text"] == model.generate("The capital of France is", **kw)


@pytest.mark.model
def test_streamed_chunks(model: Any) -> None:
    whole = model.create_chat_completion(CHAT, temperature=0, max_tokens=8)
    chunks = list(model.create_chat_completion(CHAT, temperature=0, max_tokens=8, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    pieces = list(model.create_completion("Once upon a time", temperature=0, max_tokens=6, stream=True))
    assert "".join(p["choices"][0]["text"] for p in pieces) == model.generate("Once upon a time", temperature=0,
                                                                              max_tokens=6)
    assert pieces[-1]["choices"][0]["finish_reason"] == "length"
    # stream_options as OpenAI's: every chunk carries "usage": null, then one more chunk holds the usage
    for make, args in ((model.create_chat_completion, (CHAT,)), (model.create_completion, ("Once upon a time",))):
        whole = make(*args, temperature=0, max_tokens=8)
        chunks = list(make(*args, temperature=0, max_tokens=8, stream=True, stream_options={"include_usage": True}))
        *body, last = chunks
        assert last["choices"] == [] and last["id"] == chunks[0]["id"]
        cached = last["usage"].pop("prompt_tokens_details")["cached_tokens"]   # the prompt is in the cache now
        whole["usage"].pop("prompt_tokens_details")
        assert last["usage"] == whole["usage"] and 0 < cached <= whole["usage"]["prompt_tokens"]
        assert all(c["usage"] is None for c in body) and body[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" not in list(make(*args, temperature=0, max_tokens=2, stream=True))[-1]
    for bad in ({"include_usage": 1}, {"bogus": True}, ["include_usage"]):
        with pytest.raises(ValueError, match="stream_options must be"):
            model.create_chat_completion(CHAT, stream=True, stream_options=bad)
    with pytest.raises(ValueError, match="stream_options is only allowed with stream=True"):
        model.create_completion("Hi", stream_options={"include_usage": True})
    # validated before the first chunk is asked for
    with pytest.raises(ValueError, match="logprob"):
        model.create_completion("Hi", logprobs=25, stream=True)
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        model.create_chat_completion(CHAT, top_logprobs=2, stream=True)


@pytest.mark.model
def test_logprobs_and_n_are_the_servers(model: Any, smollm_gguf: Path) -> None:
    """Log-probabilities and several choices from Python, in the server's shapes and values (greedy and
    seeded: the same tokens either way)."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from test_server import serving

    import barellm
    from barellm.serve.app import create_app

    chat_kw = {"temperature": 0.9, "seed": 5, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "n": 2}
    comp_kw = {"temperature": 0.9, "seed": 5, "max_tokens": 6, "logprobs": 3, "n": 2}
    two = barellm.load(smollm_gguf, context=512, slots=2)
    mine = two.create_chat_completion(CHAT, **chat_kw)
    text = two.create_completion("The capital of France is", **comp_kw)
    streamed = list(two.create_completion("The capital of France is", stream=True, **comp_kw))
    served = barellm.load(smollm_gguf, context=512, slots=2)
    with serving(create_app(served, model_id=model.name)) as url:
        theirs = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **chat_kw}, timeout=120).json()
        theirs_text = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", **comp_kw},
                                 timeout=120).json()
    assert len(mine["choices"]) == 2 and [c["index"] for c in mine["choices"]] == [0, 1]
    for a, b in ((mine, theirs), (text, theirs_text)):
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
        for ca, cb in zip(a["choices"], b["choices"], strict=True):
            assert ca["index"] == cb["index"] and ca["finish_reason"] == cb["finish_reason"]
            assert ca.get("text", ca.get("message")) == cb.get("text", cb.get("message"))
            assert ca["logprobs"] == cb["logprobs"]   # the same bits: batch-invariant logits
    assert len(mine["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert text["choices"][0]["logprobs"]["text_offset"][0] == len("The capital of France is")
    for i in (0, 1):
        pieces = [p["choices"][0] for p in streamed if p["choices"][0]["index"] == i]
        assert "".join(p["text"] for p in pieces) == text["choices"][i]["text"]
        assert [t for p in pieces if p["logprobs"] for t in p["logprobs"]["tokens"]] == \
            text["choices"][i]["logprobs"]["tokens"]


@pytest.mark.model
def test_chat_takes_content_parts(model: Any) -> None:
    parts = [{"role": "user",
              "content": [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colors."}]}]
    assert model.chat_prompt(parts) == model.chat_prompt(CHAT)
    assert model.chat(parts, temperature=0, max_tokens=6) == model.chat(CHAT, temperature=0, max_tokens=6)
    from barellm.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="text only"):
        model.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
