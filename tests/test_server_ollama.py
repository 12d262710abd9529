"""The Ollama-compatible routes, driven by the `ollama` client package against a real `barellm serve`
process on the default model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0, "num_predict": 12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(smollm_gguf: Path) -> Iterator[str]:
    """`barellm serve` on the default model (pulled by the fixture), in its own process."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", MODEL, "--port", str(port), "--slots", "2",
                             "-c", "512", "--log-level", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.model
def test_tags_name_the_file_type_as_llama_cpp_does(url: str, qwen05_gguf: Path) -> None:
    # Qwen2.5-Coder-0.5B Q4_K_M: most of its matrix bytes are Q5_0, and its file says Q4_K_M
    by_name = {m.model: m.details for m in ollama.Client(host=url).list().models}
    assert by_name["qwen2.5-coder-0.5b:latest"].quantization_level == "Q4_K_M"
    assert by_name[f"{MODEL}:latest"].quantization_level == "Q4_1"


@pytest.mark.model
def test_list_version_show(url: str) -> None:
    client = ollama.Client(host=url)
    models = client.list().models   # every model in the cache, the one given at start among them
    served = [m for m in models if m.model == f"{MODEL}:latest"]
    assert len(served) == 1 and len({m.model for m in models}) == len(models)
    d = served[0].details
    assert d.format == "gguf" and d.family == "llama" and d.quantization_level == "Q4_1"
    assert served[0].size > 10**7 and served[0].modified_at is not None
    assert httpx.get(f"{url}/api/version").json()["version"].count(".") == 2
    shown = client.show(MODEL)
    assert "<|im_start|>" in shown.template and shown.details.family == "llama"
    assert shown.modelinfo["llama.context_length"] == 512
    with pytest.raises(ollama.ResponseError) as e:
        client.show("no-such-model")
    assert e.value.status_code == 404


@pytest.mark.model
def test_chat_streamed_and_not(url: str) -> None:
    client = ollama.Client(host=url)
    whole = client.chat(model=MODEL, messages=CHAT, options=GREEDY, stream=False)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason in ("stop", "length") and 1 <= whole.eval_count <= 12
    assert whole.prompt_eval_count > 5 and whole.total_duration > 0
    parts = list(client.chat(model=f"{MODEL}:latest", messages=CHAT, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count
    assert len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    # the same request through the OpenAI route: the same scheduler path, the same greedy reply
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 12}).json()
    assert r["choices"][0]["message"]["content"] == whole.message.content
    assert r["usage"]["completion_tokens"] == whole.eval_count


@pytest.mark.model
def test_generate(url: str) -> None:
    client = ollama.Client(host=url)
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True, options={"temperature": 0,
                                                                                          "num_predict": 6})
    assert raw.done and raw.eval_count == 6 and raw.done_reason == "length"
    comp = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 6}).json()
    assert raw.response == comp["choices"][0]["text"]
    # templated (the chat template around the prompt), streamed, and the context carries on
    parts = list(client.generate(model=MODEL, prompt="Say hello.", system="Be brief.", stream=True,
                                 options={"temperature": 0, "num_predict": 8}))
    assert parts[-1].done and parts[-1].context
    text = "".join(p.response for p in parts)
    tokens = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
    assert parts[-1].context[-len(tokens):] == tokens or parts[-1].done_reason == "stop"
    more = client.generate(model=MODEL, prompt="Again.", context=parts[-1].context,
                           options={"temperature": 0, "num_predict": 4})
    assert more.prompt_eval_count > len(parts[-1].context)
    # nothing to generate: Ollama's way of loading the model
    assert client.generate(model=MODEL).done_reason == "load"


@pytest.mark.model
def test_ndjson_shape(url: str) -> None:
    with httpx.stream("POST", f"{url}/api/chat", timeout=120, json={
            "model": MODEL, "messages": CHAT, "options": {"temperature": 0, "num_predict": 4}}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    for obj in lines[:-1]:
        assert set(obj) == {"model", "created_at", "message", "done"} and obj["done"] is False
        assert obj["created_at"].endswith("Z") and obj["message"]["role"] == "assistant"
    assert set(lines[-1]) == {"model", "created_at", "message", "done", "done_reason", "total_duration",
                              "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                              "eval_duration"}
    r = httpx.post(f"{url}/api/generate", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    assert r.headers["content-type"] == "application/json" and r.json()["done"] is True


@pytest.mark.model
@pytest.mark.parametrize(("options", "status", "words"), [
    ({"num_ctx": 100000}, 400, "num_ctx"),
    ({"mirostat": 2}, 400, "mirostat"),
    ({"typical_p": 0.5}, 400, "typical_p"),
    ({"temprature": 0.5}, 400, "temprature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 2}, 400, "top_p"),
])
def test_options_refused(url: str, options: dict[str, Any], status: int, words: str) -> None:
    client = ollama.Client(host=url)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=CHAT, options=options)
    assert e.value.status_code == status and words in e.value.error


@pytest.mark.model
def test_options_applied(url: str) -> None:
    client = ollama.Client(host=url)
    base = {"num_predict": 10, "temperature": 0}
    plain = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options=base).response
    stop = plain.strip()[:2]
    cut = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={**base, "stop": [stop]})
    assert cut.response == plain[:plain.index(stop)] and cut.done_reason == "stop"
    # runtime options are ignored; a num_ctx within the server's context is served
    same = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={
        **base, "num_ctx": 256, "num_thread": 1, "num_gpu": 0, "use_mmap": True, "mirostat": 0})
    assert same.response == plain
    seeded = {"num_predict": 10, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0, "seed": 7}
    a = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=seeded).response
    b = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=seeded).response
    assert a == b


@pytest.mark.model
def test_format_constrains_the_answer(url: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    client = ollama.Client(host=url)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    r = client.chat(model=MODEL, messages=CHAT, format=schema, options={"temperature": 0, "num_predict": 60})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model=MODEL, prompt="A JSON object about a cat:", format="json",
                        options={"temperature": 0, "num_predict": 80})
    assert r.response.startswith("{")
    r = httpx.post(f"{url}/api/chat", timeout=60, json={"model": MODEL, "messages": CHAT, "format": {
        "type": "array", "uniqueItems": True}})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.mark.model
def test_chat_tools_in_ollamas_shape(url: str) -> None:
    """SmolLM2 gets the built-in tool form; whatever it answers, a call in its reply comes back as Ollama's
    message.tool_calls, and a tool message with the result renders into the next turn."""
    client = ollama.Client(host=url)
    msgs = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    r = client.chat(model=MODEL, messages=msgs, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    streamed = list(client.chat(model=MODEL, messages=msgs, tools=[WEATHER], stream=True,
                                options={"temperature": 0, "num_predict": 60}))
    calls = [c for part in streamed for c in part.message.tool_calls or []]
    assert [c.function.name for c in calls] == [c.function.name for c in r.message.tool_calls or []]
    assert "".join(p.message.content for p in streamed) == r.message.content
    for c in r.message.tool_calls or []:
        assert c.function.name == "get_weather" and isinstance(c.function.arguments, dict)
    history = msgs + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 21 degrees", "tool_name": "get_weather"}]
    r = client.chat(model=MODEL, messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 20})
    assert r.done
