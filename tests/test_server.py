"""The OpenAI-compatible server: the real app under uvicorn on a loopback port, driven by the official
`openai` client and by httpx; and the scheduler alone against a small fake engine, where timing, queueing
and chunking can be controlled exactly."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from barellm.generate.sampling import SamplingParams  # noqa: E402
from barellm.generate.scheduler import Event, Job, QueueFull, Scheduler  # noqa: E402


def _default_engine() -> str:
    """The default (native) engine where it is built in, else the NumPy reference: both implement slots and
    forward_batch, and the reference one is slow, so generations here stay a few tokens long."""
    try:
        import barellm.runtime.engine  # noqa: F401
    except ImportError:
        return "reference"
    return "native"


ENGINE = os.environ.get("BARELLM_TEST_SERVER_ENGINE") or _default_engine()
SLOTS = 4
CONTEXT = 512
MODEL_ID = "smollm2-135m"


# --- a real server ---------------------------------------------------------------------------------

@dataclass
class Server:
    url: str
    app: Any
    model: Any

    def client(self) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """Runs app under uvicorn in a background thread on a free loopback port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))   # a free loopback port, held from here on: no race with other processes
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()


@pytest.fixture(scope="module")
def server(smollm_gguf: Path) -> Iterator[Server]:
    import barellm
    from barellm.serve.app import create_app

    model = barellm.load(smollm_gguf, engine=ENGINE, slots=SLOTS, context=CONTEXT)
    app = create_app(model, model_id=MODEL_ID, aliases=["gpt-4o-mini"], max_queue=16, timeout=240)
    with serving(app) as url:
        yield Server(url, app, model)


@pytest.mark.model
def test_model_calls_refused_while_served_and_fresh_after(smollm_gguf: Path) -> None:
    """The server owns every slot of the engine: the Model's own calls are refused while it serves, and
    afterwards they do not trust a slot-0 cache the server has overwritten."""
    import barellm
    from barellm.errors import InvalidRequest
    from barellm.serve.app import create_app

    model = barellm.load(smollm_gguf, engine=ENGINE, slots=1, context=CONTEXT)
    before = model.generate("The capital of France is", max_tokens=8, temperature=0)
    app = create_app(model, model_id=MODEL_ID)
    with serving(app) as url:
        with pytest.raises(InvalidRequest, match="being served"):
            model.generate("The capital of France is", max_tokens=8, temperature=0)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        client.completions.create(model=MODEL_ID, prompt="Something else entirely, written into slot 0",
                                  max_tokens=4, temperature=0)
    assert model.generate("The capital of France is", max_tokens=8, temperature=0) == before


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _lines(resp: Any) -> Iterator[dict[str, Any] | str]:
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


@pytest.mark.model
def test_models_health_openapi(server: Server) -> None:
    client = server.client()
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    h = httpx.get(f"{server.url}/health", timeout=30).json()
    assert h["status"] == "ok" and h["slots"] == SLOTS
    spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body.split("/")[-1] in spec["components"]["schemas"]
    for path in ("/v1/models", "/health", "/metrics"):
        assert "get" in spec["paths"][path]
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]


@pytest.mark.model
def test_tokenize_detokenize(server: Server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"content": "Hello world"}, timeout=30).json()
    assert r["tokens"] == server.model.tokenize("Hello world")
    r2 = httpx.post(f"{server.url}/tokenize", json={"content": "Hello world", "with_pieces": True}, timeout=30).json()
    assert [p["id"] for p in r2["tokens"]] == r["tokens"]
    assert "".join(p["piece"] for p in r2["tokens"]) == "Hello world"
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert d["content"] == "Hello world"
    # an id past the vocabulary: the error names the model's, with or without "model" in the request
    last = server.model.config.n_vocab - 1
    for bad_id in (last + 1, 1 << 31):
        for body in ({"tokens": [1, bad_id]}, {"tokens": [1, bad_id], "model": MODEL_ID}):
            e = httpx.post(f"{server.url}/detokenize", json=body, timeout=30)
            assert e.status_code == 400, e.text
            assert e.json()["error"]["message"] == f"tokens[1] = {bad_id} is outside the vocabulary (0..{last})"
        e = httpx.post(f"{server.url}/v1/completions", json={"prompt": [bad_id], "max_tokens": 1}, timeout=30)
        assert e.status_code == 400, e.text
        assert e.json()["error"]["message"] == f"prompt[0] = {bad_id} is outside the vocabulary (0..{last})"


@pytest.mark.model
def test_chat_stream_matches_whole(server: Server) -> None:
    client = server.client()
    messages = _chat("Name three colors.")
    # cache_prompt false: both runs prefill the prompt the same way, so even an engine whose last bits
    # depend on how a prompt is cut gives identical logits
    kw = dict(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0.7, seed=1234,
              extra_body={"cache_prompt": False})
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = server.model.chat_prompt(messages)
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert 1 <= whole.usage.completion_tokens <= 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.model
def test_completions_and_logprobs(server: Server) -> None:
    client = server.client()
    prompt = "The capital of France is"
    ids = server.model.tokenize(prompt)
    a = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"cache_prompt": False})
    assert a.object == "text_completion"
    assert a.usage.prompt_tokens == len(ids)
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == a.usage.completion_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == a.choices[0].text
    assert lp.text_offset[0] == len(prompt)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))   # greedy: the chosen token is the best one
    # a prompt of token ids gives the same continuation
    b = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=6, temperature=0,
                                  extra_body={"cache_prompt": False})
    assert b.choices[0].text == a.choices[0].text
    # streamed, with a model alias
    chunks = list(client.completions.create(model="gpt-4o-mini", prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"cache_prompt": False}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == a.choices[0].finish_reason

    # chat logprobs: OpenAI's content list, top_logprobs best first
    c = client.chat.completions.create(model=MODEL_ID, messages=_chat("Say hi."), max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert "".join(t.token for t in content) == c.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token


@pytest.mark.model
def test_stop_strings(server: Server) -> None:
    client = server.client()
    base = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                     extra_body={"cache_prompt": False}).choices[0].text
    stop = base.strip()[:2] if len(base.strip()) >= 2 else None
    if not stop:
        pytest.skip(f"the model's continuation {base!r} is too short to cut")
    cut = client.completions.create(model=MODEL_ID, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"cache_prompt": False})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == base[:base.index(stop)]


@pytest.mark.model
def test_concurrent_greedy_matches_alone(server: Server) -> None:
    client = server.client()
    prompts = ["Once upon a time", "The best way to learn", "Water boils at", "My favourite fruit is"]
    kw = dict(model=MODEL_ID, max_tokens=6, temperature=0, extra_body={"cache_prompt": False})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    steps0 = server.metric("barellm_batch_steps_total")
    seqs0 = server.metric("barellm_batch_sequences_total")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
    assert together == alone
    steps = server.metric("barellm_batch_steps_total") - steps0
    seqs = server.metric("barellm_batch_sequences_total") - seqs0
    assert steps > 0 and seqs / steps > 1.5, "the requests were not batched together"


@pytest.mark.model
def test_concurrent_chats_with_cache_reuse_match_alone(server: Server) -> None:
    if ENGINE != "native":
        pytest.skip("the reference engine's last bits depend on how a prompt is cut into chunks")
    # the native engine gives the same logits however a prompt was cut, so the cached prefixes each
    # request happens to find (different alone and together) must not change a greedy reply either
    client = server.client()
    chats = [_chat(p) for p in ("Name a river.", "Name a mountain.", "Name a desert.", "Name a forest.")]

    def ask(messages: list[dict[str, str]]) -> str:
        r = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=24, temperature=0)
        return r.choices[0].message.content

    alone = [ask(m) for m in chats]
    with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
        assert list(pool.map(ask, chats)) == alone


@pytest.mark.model
def test_second_turn_reuses_the_cache(server: Server) -> None:
    client = server.client()
    turn1 = _chat("Tell me one fact about owls, please.")
    r1 = client.chat.completions.create(model=MODEL_ID, messages=turn1, max_tokens=6, temperature=0, logprobs=True,
                                        extra_body={"return_tokens_as_token_ids": True})
    generated = [int(t.token.split(":")[1]) for t in r1.choices[0].logprobs.content]
    assert len(generated) == r1.usage.completion_tokens
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And one about cats?"}]
    r2 = client.chat.completions.create(model=MODEL_ID, messages=turn2, max_tokens=2, temperature=0)
    # the slot holds the first prompt and every generated token that was fed back: all of them when the
    # model ended its turn, all but the last when max_tokens cut it
    fed = generated if r1.choices[0].finish_reason == "stop" else generated[:-1]
    held = server.model.chat_prompt(turn1) + fed
    p2 = server.model.chat_prompt(turn2)
    common = 0
    while common < min(len(held), len(p2)) and held[common] == p2[common]:
        common += 1
    assert r2.usage.prompt_tokens == len(p2)
    assert r2.usage.prompt_tokens_details.cached_tokens == min(common, len(p2) - 1)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(server.model.chat_prompt(turn1))


@pytest.mark.model
def test_disconnect_frees_the_slot(server: Server) -> None:
    cancelled0 = server.metric("barellm_generation_finished_total", '{reason="cancelled"}')
    generated0 = server.metric("barellm_generated_tokens_total")
    body = {"model": MODEL_ID, "messages": _chat("Write a very long story about a dragon."), "max_tokens": 400,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for item in _lines(resp):
                if isinstance(item, dict) and item["choices"] and item["choices"][0]["delta"].get("content"):
                    seen += 1
                    if seen >= 2:
                        break
    # the connection is closed now; the slot must be free after at most the step in progress
    deadline = time.monotonic() + 60
    while server.metric("barellm_slots_in_use") != 0:
        assert time.monotonic() < deadline, "the slot stayed in use after the client went away"
        time.sleep(0.1)
    assert server.metric("barellm_generation_finished_total", '{reason="cancelled"}') == cancelled0 + 1
    assert server.metric("barellm_generated_tokens_total") - generated0 < 100


def _hostile_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, httpx keyword arguments) of requests that must each get a 4xx."""
    chat = {"model": MODEL_ID, "messages": _chat("hi"), "max_tokens": 1}
    comp = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 1}
    bad_values: dict[str, list[Any]] = {
        "max_tokens": [0, -1, "10", 1.5, True, [], {}, 10**6, 2**40],
        "temperature": [-0.1, 2.5, "hot", True, [], {}],
        "top_p": [-0.1, 1.1, "x", True],
        "top_k": [-1, 1.5, "x", False],
        "min_p": [-0.1, 1.5, "x"],
        "repeat_penalty": [0, -1, 11, "x"],
        "repeat_last_n": [-2, 1.5, "x"],
        "presence_penalty": [3, -3, "x", []],
        "frequency_penalty": [3, -3, "x", {}],
        "seed": ["x", 1.5, 2**70, True],
        "stop": [5, [1, 2], ["a"] * 17, {"a": 1}, ["x" * 2000], [None]],
        "n": [SLOTS + 1, 0, "1", True, -1, 10**6],
        "stream": ["yes", 1, [], {}],
        "stream_options": ["x", [], {"include_usage": True}, {"bogus": 1}],
        "model": ["nope", 5, "", [], "smollm2-135m-but-not"],
        "user": [5, [], {}],
        "logit_bias": [{"x": 5}, {"1": 101}, {"-1": 1}, {"99999999": 1}, {"1": "a"}, {"1": True}, "x", [1]],
        "cache_prompt": ["no", 0],
        "return_tokens_as_token_ids": ["yes"],
        "max_token": [5],          # a misspelt parameter
        "foo": [1],
    }
    chat_only: dict[str, list[Any]] = {
        "messages": [None, [], "hi", [1], [{}], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": 5}], [{"role": 5, "content": "x"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [5]}],
                     [{"role": "user", "content": "x", "extra": 1}], [{"role": "tool", "content": "x"}],
                     {"role": "user", "content": "x"}, [{"role": "user", "content": "hello " * 3000}],
                     [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]],
        "logprobs": ["yes", 3],
        "top_logprobs": [21, -1, "x", 5],
        "max_completion_tokens": [0, "x", 7],
        "tools": [[{"type": "function", "function": {"nam": "f"}}], "x",
                  [{"type": "function", "function": {"name": "not a name!"}}]],
        "tool_choice": ["auto", 5, "required"],
        "response_format": [{"type": "json_schema"}, "x", {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}}],
        "regex": ["a(b", 5],
        "grammar": ["start: nothing_defined", ["x"]],
    }
    comp_only: dict[str, list[Any]] = {
        "prompt": [None, 5, [], [-1], [10**9], [1.5], ["a", "b"], [[1], [2]], True, {"a": 1}, [True],
                   "hello " * 3000],
        "logprobs": [21, -1, "x", True],
        "echo": [True, "x"],
        "best_of": [2, "x"],
        "suffix": ["tail", 5],
    }
    out: list[tuple[str, str, dict[str, Any]]] = []
    for base, path, extra in ((chat, "/v1/chat/completions", chat_only), (comp, "/v1/completions", comp_only)):
        for fields in (bad_values, extra):
            for name, values in fields.items():
                for v in values:
                    body = dict(base)
                    if v is None:
                        body.pop(name, None)   # a required field left out
                    else:
                        body[name] = v
                    if name == "top_logprobs" and v == 5:
                        body.pop("logprobs", None)   # valid value, but needs logprobs: true
                    if name == "max_completion_tokens" and v == 7:
                        body["max_tokens"] = 3       # the two disagree
                    out.append(("POST", path, {"json": body}))
        good = json.dumps(base)[:-1]
        field = "messages" if "messages" in base else "prompt"
        surrogate = ('[{"role": "user", "content": "\\ud800"}]' if field == "messages" else '"\\udfff x"')
        raws = [b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe\x00", b'{"a":', b"[" * 100000,
                good + ', "temperature": NaN}', good + ', "top_p": Infinity}', good + ', "seed": -Infinity}',
                good + ', "max_tokens": 1' + "0" * 5000 + "}", good + f', "{field}": {surrogate}}}',
                b'{"model": "' + b"m" * 100 + b'"', ("{" * 200 + "}" * 200).encode(), good + "} trailing",
                good + ', "\\ud800": 1}', good + ', "stop": ["\\udfff"]}', good + ', "model": "\\ud800"}']
        for raw in raws:
            content = raw.encode() if isinstance(raw, str) else raw
            out.append(("POST", path, {"content": content, "headers": {"content-type": "application/json"}}))
        out.append(("POST", path, {"content": b'{"prompt": "' + b"x" * (2 << 20) + b'"}'}))   # over 1 MiB
        out.append(("GET", path, {}))
        out.append(("PUT", path, {"json": base}))
    for body in ({}, {"content": 5}, {"content": "x", "add_special": "yes"}, {"content": "x", "bogus": 1},
                 {"content": ["x"]}, {"content": "x", "model": 5}):
        out.append(("POST", "/tokenize", {"json": body}))
    for body in ({}, {"tokens": "x"}, {"tokens": [-1]}, {"tokens": [1.5]}, {"tokens": [10**9]}, {"tokens": [True]},
                 {"tokens": [1], "bogus": 1}, {"tokens": None}):
        out.append(("POST", "/detokenize", {"json": body}))
    for path in ("/v1/nope", "/v2/chat/completions", "/static/nope.js", "/v1/models/other-model", "/v1/../etc/passwd",
                 "/v1/chat/completions/x", "/metrics/x", "/%ff", "/v1/models/%ed%a0%80"):
        out.append(("GET", path, {}))
    for method, path in (("DELETE", "/v1/models"), ("POST", "/health"), ("GET", "/tokenize"), ("POST", "/metrics"),
                         ("PATCH", "/v1/completions"), ("POST", "/v1/models")):
        out.append((method, path, {}))
    return out


@pytest.mark.model
def test_hostile_requests_get_4xx(server: Server) -> None:
    cases = _hostile_requests()
    assert len(cases) >= 200
    failures = []
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path, kw in cases:
            r = c.request(method, path, **kw)
            if not 400 <= r.status_code < 500:
                failures.append((method, path, str(kw)[:200], r.status_code, r.text[:200]))
                continue
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err["type"], str) and "param" in err and "code" in err
        assert not failures, failures[:10]
        # still serving, and nothing was answered with a 5xx
        ok = c.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
        assert ok.status_code == 200
        assert not re.search(r'status="5\d\d"', c.get("/metrics").text)


# --- the scheduler against a fake engine ---------------------------------------------------------

ALPHABET = b"abcdefghijklmnopqrstuvwxyz .,!?"


class FakeTokenizer:
    """Token 0 ends generation; token i >= 1 is the byte ALPHABET[i - 1]."""

    eog_ids = {0}

    def token_bytes(self, i: int) -> bytes:
        return ALPHABET[i - 1:i] if i else b""

    def stream_decoder(self) -> Any:
        tok = self

        class Decoder:
            def feed(self, i: int) -> str:
                return tok.token_bytes(i).decode()

            def flush(self) -> str:
                return ""

        return Decoder()


class FakeEngine:
    """Logits that depend on every token the slot's cache holds up to the position, so feeding the wrong
    tokens or positions changes the output; every call is recorded per slot."""

    n_vocab = len(ALPHABET) + 1

    def __init__(self, n_slots: int, n_ctx: int = 256, delay: float = 0.0, eog_after: int | None = None) -> None:
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.delay = delay
        self.eog_after = eog_after
        self.cache = [[-1] * n_ctx for _ in range(n_slots)]
        self.calls: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in range(n_slots)]
        self.batch_sizes: list[int] = []

    def forward_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> np.ndarray:
        time.sleep(self.delay)
        self.batch_sizes.append(len(seqs))
        out = np.zeros((len(seqs), self.n_vocab), np.float32)
        for row, (slot, tokens, start) in enumerate(seqs):
            self.calls[slot].append((tuple(tokens), start))
            self.cache[slot][start:start + len(tokens)] = list(tokens)
            end = start + len(tokens)
            h = hash(tuple(self.cache[slot][:end])) % 1000003
            pick = 1 + h % (self.n_vocab - 1)
            if self.eog_after is not None and end >= self.eog_after:
                pick = 0
            out[row, pick] = 10.0
        return out


def _run_jobs(sched: Scheduler, prompts: list[list[int]], timeout: float = 30, **kw: Any
              ) -> list[tuple[str, str | None, list[Event]]]:
    """Submits one job per prompt at once; returns (text, finish_reason, events) of each."""
    results: list[list[Event]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    choices = kw.get("n", 1)

    def sink(i: int) -> Any:
        def emit(ev: Event) -> None:
            results[i].append(ev)
            if ev.kind == "error" or sum(e.kind == "done" for e in results[i]) == choices:
                done[i].set()
        return emit

    defaults: dict[str, Any] = {"params": SamplingParams(temperature=0), "max_tokens": 8}
    defaults.update(kw)
    for i, p in enumerate(prompts):
        sched.submit(Job(prompt=p, emit=sink(i), **defaults))
    for d in done:
        assert d.wait(timeout)
    out = []
    for evs in results:
        text = "".join(e.text for e in evs if e.kind == "delta")
        out.append((text, next((e.finish_reason for e in evs if e.kind == "done"), None), evs))
    return out


@pytest.fixture
def fake() -> Iterator[tuple[Scheduler, FakeEngine]]:
    engine = FakeEngine(n_slots=3)
    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx, prefill_chunk=4)
    sched.start()
    yield sched, engine
    sched.stop()


def test_each_sequence_is_fed_the_same_under_load(fake: tuple[Scheduler, FakeEngine]) -> None:
    sched, engine = fake
    prompt = list(range(1, 11))    # 10 tokens: chunks of 4, 4, 2
    (alone, _, _), = _run_jobs(sched, [prompt], cache_prompt=False)
    calls_alone = list(next(c for c in engine.calls if c))
    assert [len(t) for t, _ in calls_alone[:3]] == [4, 4, 2]
    for slot in engine.calls:
        slot.clear()
    engine.batch_sizes.clear()
    results = _run_jobs(sched, [[5, 6, 7, 8, 9, 10, 11, 12, 13], prompt, [20, 21]], cache_prompt=False)
    assert results[1][0] == alone
    assert max(engine.batch_sizes) > 1
    # the slot that served the prompt saw exactly the calls it saw alone: same chunks, same positions
    served = next(c for c in engine.calls if c and c[0] == (tuple(prompt[:4]), 0))
    assert served == calls_alone


def test_prefix_reuse_picks_the_best_slot(fake: tuple[Scheduler, FakeEngine]) -> None:
    sched, engine = fake
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 9, 9, 9]
    _run_jobs(sched, [a, b], max_tokens=3)
    slot_a = next(i for i, t in enumerate(sched.slot_tokens) if t[:8] == a)
    # a prompt extending a's: lands on a's slot, reusing all of it
    (_, _, evs), = _run_jobs(sched, [a + [10, 11]], max_tokens=2)
    start = next(e for e in evs if e.kind == "start")
    assert start.cached_tokens == 8 and sched.slot_tokens[slot_a][:10] == a + [10, 11]
    # the result equals a fresh prefill's (the fake engine reads the cache, so stale entries would show)
    (fresh, _, _), = _run_jobs(sched, [a + [10, 11]], max_tokens=2, cache_prompt=False)
    (reused, _, _), = _run_jobs(sched, [a + [10, 11]], max_tokens=2)
    assert fresh == reused
    # an identical prompt reuses all but its last token, which must be fed to get logits
    (_, _, evs), = _run_jobs(sched, [b], max_tokens=1)
    assert next(e for e in evs if e.kind == "start").cached_tokens == len(b) - 1


def test_conversations_keep_their_slots(fake: tuple[Scheduler, FakeEngine]) -> None:
    sched, engine = fake
    system = [27, 27, 27]
    users = [system + [1, 2, 3, 4], system + [5, 6, 7, 8], system + [9, 10, 11, 12]]
    # one after another: each new conversation shares only the system prompt with the cached ones, fewer
    # tokens than a cached conversation holds beyond it, so it takes an empty slot instead of evicting one
    firsts = [_run_jobs(sched, [u], max_tokens=3)[0] for u in users]
    assert [next(e for e in evs if e.kind == "start").cached_tokens for _, _, evs in firsts] == [0, 0, 0]
    assert sorted(tuple(t[:7]) for t in sched.slot_tokens) == sorted(tuple(u) for u in users)
    # with every slot taken, a new one reuses the system prompt from the slot that loses the least
    (_, _, evs), = _run_jobs(sched, [system + [13]], max_tokens=1)
    assert next(e for e in evs if e.kind == "start").cached_tokens == len(system)
    users = users[1:]     # the least recently used conversation was evicted
    firsts = firsts[1:]
    # every second turn finds its whole first turn cached
    for u, (_, _, evs) in zip(users, firsts, strict=True):
        generated = [t for e in evs if e.kind == "delta" for t in e.token_ids]
        turn2 = u + generated + [28, 29]
        (_, _, evs2), = _run_jobs(sched, [turn2], max_tokens=1)
        assert next(e for e in evs2 if e.kind == "start").cached_tokens == len(u) + len(generated) - 1


def test_stop_strings_and_end_of_generation() -> None:
    engine = FakeEngine(n_slots=1, eog_after=12)
    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx)
    sched.start()
    try:
        (text, reason, evs), = _run_jobs(sched, [[1, 2, 3, 4, 5]], max_tokens=50, top_logprobs=2)
        # generation ends when 12 positions are filled: tokens sampled after positions 5..11
        assert reason == "stop" and len(text) == 12 - 5
        done = evs[-1]
        assert done.completion_tokens == len(text)
        assert sum(len(e.tokens) for e in evs if e.kind == "delta") == len(text)
        stop = text[2:4]
        (cut, reason, evs), = _run_jobs(sched, [[1, 2, 3, 4, 5]], max_tokens=50, stops=["zz-never", stop],
                                        top_logprobs=0)
        assert reason == "stop" and cut == text[:text.index(stop)]
        # tokens that begin inside the stop string are not reported
        assert sum(len(e.tokens) for e in evs if e.kind == "delta") == len(cut)
    finally:
        sched.stop()


def test_queue_bound_and_time_limits() -> None:
    engine = FakeEngine(n_slots=1, delay=0.01)
    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx, max_queue=1)

    def job(**kw: Any) -> Job:
        return Job(prompt=[1, 2, 3], params=SamplingParams(temperature=0), max_tokens=100, emit=lambda e: None,
                   **kw)

    # not started: nothing is admitted, so one job for the free slot plus one queued fit, a third does not
    sched.submit(job())
    sched.submit(job())
    with pytest.raises(QueueFull):
        sched.submit(job())
    sched.stop()

    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx, max_queue=4)
    sched.start()
    try:
        events: dict[str, list[Event]] = {"long": [], "queued": []}
        finished = {k: threading.Event() for k in events}

        def sink(name: str) -> Any:
            def emit(ev: Event) -> None:
                events[name].append(ev)
                if ev.kind in ("done", "error"):
                    finished[name].set()
            return emit

        t0 = time.monotonic()
        sched.submit(Job(prompt=[1, 2, 3], params=SamplingParams(temperature=0), max_tokens=10**6,
                         emit=sink("long"), timeout=0.5))
        sched.submit(Job(prompt=[4, 5, 6], params=SamplingParams(temperature=0), max_tokens=5,
                         emit=sink("queued"), timeout=0.2))
        assert finished["queued"].wait(10) and finished["long"].wait(10)
        assert time.monotonic() - t0 < 5
        long_done = events["long"][-1]
        assert long_done.kind == "done" and long_done.finish_reason == "length" and long_done.completion_tokens > 0
        assert events["queued"][-1].kind == "error" and events["queued"][-1].status == 503
        assert sched.slots_in_use == 0 and sched.queue_depth == 0
    finally:
        sched.stop()


def test_cancel_frees_the_slot_and_the_queue() -> None:
    engine = FakeEngine(n_slots=1, delay=0.01)
    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx, max_queue=4)
    sched.start()
    try:
        seen: list[Event] = []
        running = Job(prompt=[1, 2], params=SamplingParams(temperature=0), max_tokens=10**6, emit=seen.append)
        waiting = Job(prompt=[3, 4], params=SamplingParams(temperature=0), max_tokens=10**6, emit=seen.append)
        sched.submit(running)
        sched.submit(waiting)
        deadline = time.monotonic() + 10
        while not any(e.kind == "delta" for e in seen):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sched.cancel(waiting)
        assert sched.queue_depth == 0
        sched.cancel(running)
        while sched.slots_in_use:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sched.metrics.finished["cancelled"] == 2
    finally:
        sched.stop()


class FakeModel:
    """Just what the app uses of a Model, over the fake engine: one character per token."""

    engine_name = "fake"

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.tokenizer = FakeTokenizer()
        self.n_ctx = engine.n_ctx
        self.config = SimpleNamespace(n_vocab=engine.n_vocab)
        self.path = Path("fake-model.gguf")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [ALPHABET.index(c) + 1 for c in text.encode() if c in ALPHABET]

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self.tokenizer.token_bytes(i) for i in ids).decode()

    def chat_prompt(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.tokenize(" ".join(m["content"] for m in messages))


def test_full_queue_is_429_and_time_limit_ends_with_length() -> None:
    from barellm.serve.app import create_app

    app = create_app(FakeModel(FakeEngine(n_slots=1, delay=0.01)), max_queue=0, timeout=1.0)
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        t0 = time.monotonic()
        stream = client.chat.completions.create(model="fake-model", messages=_chat("hello"),
                                                stream=True)
        first = next(iter(stream))   # the role chunk: the request holds the only slot now
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="fake-model", prompt="abc", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["type"] == "rate_limit_error"
        last = list(stream)[-1]
        assert last.choices[0].finish_reason == "length"
        assert time.monotonic() - t0 < 10
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert health["slots_in_use"] == 0 and health["queue_depth"] == 0
        # and then the slot serves again
        ok = client.completions.create(model="fake-model", prompt="abc", max_tokens=3)
        assert ok.usage.completion_tokens == 3 and ok.usage.prompt_tokens == 3


def test_disconnect_while_waiting_for_a_whole_response() -> None:
    from barellm.serve.app import create_app

    # a reply of the whole context takes 250 steps of 50 ms; the client gives up after 0.5 s
    app = create_app(FakeModel(FakeEngine(n_slots=1, delay=0.05)), timeout=60)
    with serving(app) as url:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json={"messages": _chat("hello")}, timeout=0.5)
        while httpx.get(f"{url}/health", timeout=10).json()["slots_in_use"]:
            assert time.monotonic() - t0 < 6, "the slot stayed in use after the client went away"
            time.sleep(0.05)
        assert app.state.server.metrics.finished["cancelled"] == 1


# --- several choices, logit bias, where the time goes ---------------------------------------------

@pytest.mark.model
def test_n_choices_and_logit_bias(server: Server) -> None:
    client = server.client()
    kw = dict(model=MODEL_ID, prompt="The capital of France is", max_tokens=6, extra_body={"cache_prompt": False})
    one = client.completions.create(temperature=0, **kw)
    many = client.completions.create(temperature=0, n=3, logprobs=1, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert all(c.text == one.choices[0].text for c in many.choices)   # greedy: the same text three times
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    for c in many.choices:
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset[0] == len(kw["prompt"])
    # sampled choices: choice i draws as n=1 with seed + i
    sampled = client.completions.create(temperature=1.0, seed=7, n=2, **kw)
    alone = [client.completions.create(temperature=1.0, seed=7 + i, **kw).choices[0].text for i in range(2)]
    assert [c.text for c in sampled.choices] == alone
    # streamed: chunks carry their choice's index; each choice ends with its finish reason
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=_chat("Say hi."), max_tokens=4,
                                                 temperature=0, n=2, stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    whole = client.chat.completions.create(model=MODEL_ID, messages=_chat("Say hi."), max_tokens=4, temperature=0)
    assert finished == {0, 1} and texts[0] == texts[1] == whole.choices[0].message.content
    # logit_bias (OpenAI's: token id -> bias): banning the greedy first token changes it
    first = server.model.tokenize(one.choices[0].text, add_special=False)[0]
    banned = client.completions.create(temperature=0, logit_bias={str(first): -100}, logprobs=0, **kw)
    assert banned.choices[0].logprobs.tokens[0] != server.model.detokenize([first])
    forced = client.completions.create(temperature=0.7, seed=1, logit_bias={"42": 100}, logprobs=0, **kw)
    assert forced.choices[0].logprobs.tokens == [server.model.detokenize([42])] * forced.usage.completion_tokens


@pytest.mark.model
def test_metrics_break_each_token_down(server: Server) -> None:
    client = server.client()
    client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, temperature=0.8)
    list(client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=8, stream=True))
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    phases = dict(re.findall(r'^barellm_token_phase_seconds_total\{phase="([a-z ]+)"\} (\S+)$', text, re.M))
    assert set(phases) == {"forward", "logits copy", "grammar", "sample", "logprobs", "detokenize", "stop",
                           "bookkeeping",
                           "write"}
    for p in ("forward", "sample", "detokenize", "write"):
        assert float(phases[p]) > 0, p
    if ENGINE == "native":
        assert float(phases["logits copy"]) > 0
    assert server.metric("barellm_token_phase_tokens_total") >= 16
    assert server.metric("barellm_token_phase_ms_per_token", '{phase="forward"}') > 0


class CopyingEngine(FakeEngine):
    """The fake engine with copy_prefix: the n choices of a job prefill their prompt once."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.cache[dst][:n] = self.cache[src][:n]
        self.calls[dst].append((("copy", src), n))


@pytest.mark.parametrize("engine_cls", [FakeEngine, CopyingEngine])
def test_n_choices_in_the_scheduler(engine_cls: type) -> None:
    engine = engine_cls(n_slots=3)
    sched = Scheduler(engine, FakeTokenizer(), n_ctx=engine.n_ctx, prefill_chunk=4)
    sched.start()
    try:
        prompt = list(range(1, 11))
        (alone, _, _), = _run_jobs(sched, [prompt], cache_prompt=False, params=SamplingParams(temperature=1.0, seed=3))
        for slot in engine.calls:
            slot.clear()
        (_, _, evs), = _run_jobs(sched, [prompt], cache_prompt=False, n=3, params=SamplingParams(temperature=1.0,
                                                                                               seed=3))
        dones = [e for e in evs if e.kind == "done"]
        assert sorted(e.index for e in dones) == [0, 1, 2]
        by_choice = {i: "".join(e.text for e in evs if e.kind == "delta" and e.index == i) for i in range(3)}
        assert by_choice[0] == alone
        prefills = [c for slot in engine.calls for c in slot if len(c[0]) > 1 and c[0][0] != "copy"]
        if engine_cls is CopyingEngine:
            assert len(prefills) == 3 and sum(1 for s in engine.calls for c in s if c[0][0] == "copy") == 2
        else:
            assert len(prefills) == 9   # each choice prefilled the prompt itself (chunks of 4, 4, 2)
        with pytest.raises(ValueError, match="n must be"):
            sched.submit(Job(prompt=prompt, params=SamplingParams(), max_tokens=2, emit=lambda e: None, n=4))
    finally:
        sched.stop()


def test_a_whole_response_gets_one_delta(fake: tuple[Scheduler, FakeEngine]) -> None:
    sched, _ = fake
    (streamed, _, evs), = _run_jobs(sched, [[1, 2, 3]], max_tokens=12, top_logprobs=1)
    assert sum(e.kind == "delta" for e in evs) > 1
    (whole, _, evs), = _run_jobs(sched, [[1, 2, 3]], max_tokens=12, top_logprobs=1, stream=False)
    deltas = [e for e in evs if e.kind == "delta"]
    assert whole == streamed and len(deltas) == 1 and len(deltas[0].tokens) == len(whole)


def test_outbox_wakes_the_loop_once_per_batch() -> None:
    import asyncio

    from barellm.serve.relay import Outbox

    async def main() -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        box = Outbox(loop)
        wakes = []
        real = loop.call_soon_threadsafe

        def counting(cb: Any, *args: Any) -> Any:
            wakes.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        t = threading.Thread(target=lambda: [box.push(Event("delta", text=str(i))) for i in range(100)])
        t.start()
        t.join()
        batches = [await box.batch()]
        box.push(Event("done"))
        batches.append(await box.batch())
        return [[e.text for e in b] for b in batches] + [[len(wakes)]]

    first, second, (wakes,) = asyncio.run(main())
    assert first == [str(i) for i in range(100)] and second == [""] and wakes <= 2


def test_stream_interval_gathers_deltas(fake: tuple[Scheduler, FakeEngine]) -> None:
    sched, _ = fake
    (each, _, evs), = _run_jobs(sched, [[1, 2, 3]], max_tokens=12, top_logprobs=0)
    assert sum(e.kind == "delta" for e in evs) == len(each)   # one event per token (one character each)
    (gathered, _, evs), = _run_jobs(sched, [[1, 2, 3]], max_tokens=12, top_logprobs=0, stream_interval=1000.0)
    deltas = [e for e in evs if e.kind == "delta"]
    # the first token goes out at once, the rest when the interval has passed or the choice ends
    assert gathered == each and len(deltas) == 2 and len(deltas[0].text) == 1
    assert [len(e.tokens) for e in deltas] == [1, len(each) - 1]


def test_without_max_tokens_every_chat_route_runs_until_the_context_is_full(tmp_path: Path, own_home: Path) -> None:
    """No max_tokens (OpenAI's chat, Ollama's num_predict unset or -1): the reply ends at
    the end of generation or when the context is full ("length"), never at a default of its own.
    OpenAI's legacy /v1/completions keeps OpenAI's 16."""
    import barellm
    from barellm.serve.app import create_app

    from tiny_model import write_tiny_llama

    model = barellm.load(write_tiny_llama(tmp_path / "tiny.gguf"), context=256)
    ban = {str(i): -100 for i in model.tokenizer.eog_ids}   # the tiny model's text ends only at a limit
    messages = _chat("hello")
    room = 256 - len(model.chat_prompt(messages))
    alone = model.complete(model.chat_prompt(messages), temperature=0)
    assert room > 128 and len(alone.token_ids) > 128
    with serving(create_app(model, model_id="tiny")) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "messages": messages, "temperature": 0, "logit_bias": ban}).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == room
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": messages, "temperature": 0, "logit_bias": ban, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            chunks = [c for c in _lines(resp) if isinstance(c, dict)]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == room
        # Ollama's options have no logit_bias: its reply is the Python API's, run as far as the model goes
        for options in ({"temperature": 0}, {"temperature": 0, "num_predict": -1}):
            body = httpx.post(f"{url}/api/chat", timeout=120, json={
                "model": "tiny", "messages": messages, "stream": False, "options": options}).json()
            assert (body["done_reason"], body["eval_count"]) == (alone.finish_reason, len(alone.token_ids))
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={"model": "tiny", "prompt": "the cat",
                                                                   "temperature": 0, "logit_bias": ban}).json()
        assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
