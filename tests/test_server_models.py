"""Many models in one `barellm serve`: loading on demand, keep_alive, a budget of one model, the Ollama
lifecycle routes, driven with the real `openai` and `ollama` clients. The server runs on a temporary
BARELLM_HOME holding links to the real cache's conversions, so deleting there never touches the real cache;
and a user's own GGUF goes through run, list, serve and rm by name, leaving nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from barellm.serve.errors import ApiError
from barellm.serve.models import parse_bytes, parse_keep_alive

httpx = pytest.importorskip("httpx")
ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

SMALL, OTHER = "smollm2-135m", "gemma3-270m"
SRC = str(Path(__file__).parents[1] / "src")


def test_keep_alive_durations() -> None:
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("90s") == 90
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(2.5) == 2.5
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None and parse_keep_alive("-1") is None
    assert parse_keep_alive("300ms") == pytest.approx(0.3) and parse_keep_alive("300") == 300
    for bad in ("5 minutes", "m", "", True, [1], "5x"):
        with pytest.raises(ApiError) as e:
            parse_keep_alive(bad)
        assert e.value.status == 400 and "keep_alive" in e.value.message
    assert parse_bytes("2G") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError):
        parse_bytes("lots")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _home_with(tmp: Path, names: list[str]) -> Path:
    """A BARELLM_HOME whose cache holds the named models: each one's manifest copied, its conversion linked."""
    from barellm.store import hub

    home = tmp / "home"
    (home / "blm").mkdir(parents=True)
    for name in names:
        real = hub.cached_path(name)
        assert real is not None, f"{name} is not in the cache"
        spec = hub.REGISTRY[name]
        manifest = json.loads((hub.home() / "models" / name / "manifest.json").read_text())
        blm = hub.home() / "blm" / manifest["converted"]
        assert blm.is_file()
        (home / "models" / name).mkdir(parents=True)
        (home / "models" / name / "manifest.json").write_text(json.dumps({**manifest, "gguf_kept": False}))
        (home / "blm" / blm.name).symlink_to(blm)
        assert spec.sha256 in blm.name
    return home


def _serve(home: Path, *args: str, context: int = 512) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {**os.environ, "BARELLM_HOME": str(home), "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "serve", *args, "--port", str(port),
                             "-c", str(context), "--slots", "2", "-t", "1", "--log-level", "warning"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode() if proc.stderr else "the server exited")
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm_gguf, gemma_gguf) -> Iterator[tuple[str, Path]]:
    """One `barellm serve` with no model named, a budget of one loaded model, on a temporary cache."""
    home = _home_with(tmp_path_factory.mktemp("models"), [SMALL, OTHER])
    proc, base = _serve(home, "--max-loaded", "1")
    try:
        yield base, home
    finally:
        _stop(proc)


def _loaded(base: str) -> list[str]:
    return [m.model for m in ollama.Client(host=base).ps().models]


@pytest.mark.model
def test_two_models_in_turn_and_ps(server) -> None:
    base, _ = server
    assert _loaded(base) == []   # nothing loads before a request names it
    listed = {m.id: m for m in openai.OpenAI(base_url=f"{base}/v1", api_key="x").models.list().data}
    assert set(listed) == {SMALL, OTHER}
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    r = oa.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                   temperature=0)
    assert r.model == SMALL and r.choices[0].message.content and r.usage.completion_tokens > 0
    assert _loaded(base) == [f"{SMALL}:latest"]
    ps = ollama.Client(host=base).ps().models[0]
    assert ps.size > 50 * 10**6 and ps.details.family == "llama" and ps.expires_at is not None
    # the other model by Ollama's name with its tag: it replaces the idle first one (budget: one model)
    g = ollama.Client(host=base).generate(model=f"{OTHER}:latest", prompt="The sky is", raw=True,
                                         options={"num_predict": 6, "temperature": 0})
    assert g.response and g.done and g.load_duration > 0
    assert _loaded(base) == [f"{OTHER}:latest"]
    # the same model again: no load this time
    again = ollama.Client(host=base).generate(model=OTHER, prompt="The sea is", raw=True,
                                             options={"num_predict": 4, "temperature": 0})
    assert again.load_duration == 0 and again.response


@pytest.mark.model
def test_unknown_names_list_the_known_ones(server) -> None:
    base, _ = server
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).chat(model="smollm2-13m", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and SMALL in e.value.error and OTHER in e.value.error
    assert f"did you mean {SMALL}?" in e.value.error
    r = httpx.post(f"{base}/api/generate", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    with pytest.raises(openai.NotFoundError) as oe:
        openai.OpenAI(base_url=f"{base}/v1", api_key="x").completions.create(model="nope", prompt="x", max_tokens=2)
    assert SMALL in str(oe.value) and OTHER in str(oe.value)
    # a registered model not in this cache: 404 saying how to pull it
    r = httpx.post(f"{base}/api/chat", json={"model": "qwen2.5-coder-0.5b", "messages": []})
    assert r.status_code == 404 and "/api/pull" in r.json()["error"]


@pytest.mark.model
def test_budget_of_one_waits_for_the_busy_model(server) -> None:
    """A request for another model while the only loaded one generates: the generation runs to its end
    uncut, then the idle model goes and the other loads."""
    base, _ = server
    ollama.Client(host=base).generate(model=SMALL, prompt="Hi", options={"num_predict": 1})
    assert _loaded(base) == [f"{SMALL}:latest"]
    out: dict[str, object] = {}

    def long() -> None:
        out["long"] = ollama.Client(host=base).generate(
            model=SMALL, prompt="Count from one to one hundred in words:", raw=True,
            options={"num_predict": 120, "temperature": 0, "stop": []})
        out["long_end"] = time.monotonic()

    t = threading.Thread(target=long)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not httpx.get(f"{base}/health").json()["slots_in_use"]:
        time.sleep(0.02)
    other = ollama.Client(host=base).generate(model=OTHER, prompt="One, two,", raw=True,
                                             options={"num_predict": 3, "temperature": 0})
    other_end = time.monotonic()
    t.join(120)
    first = out["long"]
    # the generation ran to its own end (not cut by the eviction), and the other model came after it
    assert first.done and first.done_reason in ("stop", "length") and first.eval_count > 10
    assert first.response.count(" ") > 5 and out["long_end"] <= other_end
    assert other.response and other.load_duration > 0 and _loaded(base) == [f"{OTHER}:latest"]


@pytest.mark.model
def test_keep_alive_zero_unloads_and_durations_are_real(server) -> None:
    base, _ = server
    client = ollama.Client(host=base)
    client.generate(model=SMALL, prompt="Hi", options={"num_predict": 1})
    metrics = httpx.get(f"{base}/metrics").text

    def counter(text: str, name: str) -> float:
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    r = client.generate(model=SMALL, prompt="Write a long story about a dragon.", stream=False,
                        options={"num_predict": 64, "temperature": 0}, keep_alive=0)
    after = httpx.get(f"{base}/metrics").text
    tokens = counter(after, "barellm_generated_tokens_total") - counter(metrics, "barellm_generated_tokens_total")
    seconds = (counter(after, "barellm_batch_step_seconds_total")
               - counter(metrics, "barellm_batch_step_seconds_total"))
    served_rate = tokens / seconds
    client_rate = r.eval_count / (r.eval_duration / 1e9)
    assert r.eval_count == 64 and 0.5 * served_rate < client_rate < 2 * served_rate, (client_rate, served_rate)
    assert r.prompt_eval_duration > 0 and r.total_duration >= r.eval_duration + r.prompt_eval_duration
    deadline = time.monotonic() + 10
    while _loaded(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loaded(base) == []   # keep_alive 0: gone once the answer is sent
    # Ollama's way to load and to unload without generating
    assert httpx.post(f"{base}/api/generate", json={"model": SMALL}).json()["done_reason"] == "load"
    assert _loaded(base) == [f"{SMALL}:latest"]
    unload = httpx.post(f"{base}/api/generate", json={"model": SMALL, "keep_alive": "0"}).json()
    assert unload["done_reason"] == "unload"
    deadline = time.monotonic() + 10
    while _loaded(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loaded(base) == []
    r = httpx.post(f"{base}/api/generate", json={"model": SMALL, "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


@pytest.mark.model
def test_embed_copy_pull_delete(server) -> None:
    base, home = server
    client = ollama.Client(host=base)
    e = client.embed(model=SMALL, input=["a cat", "a dog"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 576 and e.prompt_eval_count > 0
    assert abs(sum(x * x for x in e.embeddings[0]) - 1) < 1e-3     # /api/embed's vectors are unit length
    one = client.embeddings(model=SMALL, prompt="a cat")
    assert len(one.embedding) == 576 and abs(sum(x * x for x in one.embedding) - 1) > 1e-3
    client.copy(SMALL, "my-assistant")
    assert client.generate(model="my-assistant", prompt="Hi", options={"num_predict": 2}).model == "my-assistant"
    # pull: a name the cache knows, present already: the progress lines end with success
    lines = list(client.pull(OTHER, stream=True))
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("no-such-model")
    assert err.value.status_code == 404 and SMALL in err.value.error
    # delete: from this cache only (links to the real one's files)
    real = os.path.realpath(home / "blm" / next(p.name for p in (home / "blm").iterdir() if p.is_symlink()
                                                and "a5fd3b62" in p.name))
    assert client.delete(OTHER).status == "success"
    assert OTHER not in {m.model.split(":")[0] for m in client.list().models}
    assert not (home / "models" / OTHER).exists() and not any("a5fd3b62" in p.name for p in (home / "blm").iterdir())
    assert os.path.isfile(real)   # the real cache keeps its file
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=OTHER, prompt="x")
    assert err.value.status_code == 404


def _cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BARELLM_HOME": str(home), "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "barellm", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_own_gguf_by_path_then_by_name(tmp_path) -> None:
    from tiny_model import write_tiny_llama

    home = tmp_path / "home"
    own = write_tiny_llama(tmp_path / "my-model.gguf")
    r = _cli(home, "run", str(own), "the cat", "-n", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    hashed = list((home / "blm").glob("*.blm"))
    assert len(hashed) == 1 and re.fullmatch(r"[0-9a-f]{64}", hashed[0].stem)
    listed = _cli(home, "list")
    assert re.search(r"^my-model\s+own\s+instruct", listed.stdout, re.M) and hashed[0].stem not in listed.stdout
    r = _cli(home, "run", "my-model", "the cat", "-n", "3", "--temperature", "0", "-v", "--raw")
    assert r.returncode == 0 and r.stdout.startswith("the cat"), r.stderr
    env = {**os.environ, "BARELLM_HOME": str(home), "PYTHONPATH": SRC}
    chat = subprocess.run([sys.executable, "-m", "barellm", "chat", "my-model", "-n", "2"], input="/show\n/bye\n",
                          env=env, capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0 and re.search(r"model\s+my-model", chat.stderr), chat.stderr
    bench = _cli(home, "bench", "my-model", "-p", "8", "-n", "4", "-r", "1", "--json")
    assert bench.returncode == 0 and json.loads(bench.stdout)[0]["model"] == "my-model", bench.stderr
    for out in (r.stdout + r.stderr, chat.stderr, bench.stdout + bench.stderr):
        assert hashed[0].stem not in out   # the hash stays the cache's internal file name
    typo = _cli(home, "run", "my-modle", "hi")
    assert typo.returncode == 1 and "did you mean my-model" in typo.stderr and "my-model" in typo.stderr
    proc, base = _serve(home, "my-model", context=128)
    try:
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]]
        assert ids == ["my-model"]
        r = httpx.post(f"{base}/v1/completions", json={"model": "my-model", "prompt": "the", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "my-model"
        assert httpx.post(f"{base}/v1/completions", json={"model": "my-model.gguf", "prompt": "the",
                                                          "max_tokens": 2}).status_code == 200
    finally:
        _stop(proc)
    rm = _cli(home, "rm", "my-model")
    assert rm.returncode == 0, rm.stderr
    assert list((home / "blm").glob("*.blm")) == [] and list((home / "blm" / "index").glob("*.json")) == []
    assert list((home / "blm" / "names").glob("*")) == []
    assert "my-model" not in _cli(home, "list").stdout
    assert own.is_file()   # the user's own file stays
    # removed by its path as well
    assert _cli(home, "run", str(own), "the", "-n", "1").returncode == 0
    assert _cli(home, "rm", str(own)).returncode == 0 and list((home / "blm").glob("*.blm")) == []
    gone = _cli(home, "rm", "my-model")
    assert gone.returncode == 1 and "unknown model" in gone.stderr
    shutil.rmtree(home)


@pytest.mark.model
def test_forced_tool_call_ends_with_the_turn_through_the_openai_client(server) -> None:
    pytest.importorskip("llguidance")
    base, _ = server
    oa = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = oa.chat.completions.create(model=SMALL, messages=ask, tools=tools, tool_choice=choice, temperature=0,
                                       parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments)["city"] and r.usage.completion_tokens < 100
        chunks = list(oa.chat.completions.create(model=SMALL, messages=ask, tools=tools, tool_choice=choice,
                                                 temperature=0, parallel_tool_calls=False, stream=True))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert reasons == ["tool_calls"] and [d.function.name for d in streamed if d.function.name] == ["get_weather"]


def test_models_share_a_load_evict_the_least_recent_idle_one_and_keep_busy_ones(tmp_path) -> None:
    """serve.models on its own, with a loader that counts its calls: concurrent requests for a model being
    loaded wait for that one load; past the budget the least recently used idle model goes, a busy one
    never (the load waits for it); keep_alive 0 unloads after the request."""
    import asyncio

    from barellm.serve.models import Candidate, Models

    files = {}
    for name in ("a", "b", "c"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"x" * 10)
    cands = [Candidate(n, p, frozenset({n, p.name}), 10, 0.0) for n, p in files.items()]
    loads: list[str] = []
    unloads: list[str] = []

    class State:
        def __init__(self, name: str) -> None:
            self.name = name

    def load(c: Candidate) -> State:
        loads.append(c.name)
        time.sleep(0.05)
        return State(c.name)

    async def main() -> None:
        models = Models(lambda: cands, load, lambda s: unloads.append(s.name), max_loaded=2, keep_alive=60)
        first = await asyncio.gather(*(models.acquire("a") for _ in range(3)))
        assert loads == ["a"] and len({id(x.state) for x in first}) == 1
        for lease in first:
            lease.release()
        b = await models.acquire("B.gguf")   # by its file name, any case
        b.release()
        a = await models.acquire("a:latest")   # a is now the more recent, and busy
        c = await models.acquire("c")          # room for c: b goes (idle), not the busy a
        await asyncio.sleep(0.05)
        assert unloads == ["b"] and set(models.loaded) == {"a", "c"}
        c.release()
        a.release()   # both idle now, c the less recently used
        got = await asyncio.wait_for(models.acquire("b"), 5)
        assert unloads == ["b", "c"] and set(models.loaded) == {"a", "b"}
        got.release()
        busy_b, busy_c = await models.acquire("b"), await models.acquire("c")
        assert unloads == ["b", "c", "a"]
        pending = asyncio.ensure_future(models.acquire("a"))   # both busy: a waits, nothing is cut
        await asyncio.sleep(0.2)
        assert not pending.done() and set(models.loaded) == {"b", "c"}
        busy_c.release()
        lease_a = await asyncio.wait_for(pending, 5)
        assert unloads[-1] == "c" and set(models.loaded) == {"a", "b"}
        busy_b.release()
        lease_a.release()
        zero = await models.acquire("a", 0)
        zero.release()
        await asyncio.sleep(0.1)
        assert "a" not in models.loaded and unloads[-1] == "a"
        with pytest.raises(ApiError) as e:
            await models.acquire("d")
        assert e.value.status == 404 and "a, b, c" in e.value.message
        await models.close()
        assert not models.loaded

    asyncio.run(main())


@pytest.mark.model
def test_a_long_answer_runs_past_128_tokens_to_its_own_end(tmp_path, qwen05_gguf) -> None:
    """No max_tokens through the openai client: the reply is not cut at the 128 tokens that once were the
    default; Qwen2.5-Coder-0.5B answers this question in about 200 tokens, greedy, and ends at its end of
    turn ("stop", well inside the context of 1024), whole and streamed alike."""
    home = _home_with(tmp_path, ["qwen2.5-coder-0.5b"])
    proc, base = _serve(home, context=1024)
    try:
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        ask = [{"role": "user", "content": "What does the Python keyword yield do? Give an example."}]
        r = oa.chat.completions.create(model="qwen2.5-coder-0.5b", messages=ask, temperature=0)
        whole = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (r.usage, whole[-200:])
        assert 128 < r.usage.completion_tokens and r.usage.prompt_tokens + r.usage.completion_tokens < 1024
        assert "yield" in whole and "def " in whole
        chunks = list(oa.chat.completions.create(model="qwen2.5-coder-0.5b", messages=ask, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == ["stop"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    finally:
        _stop(proc)
