"""barellm on Ray Serve: the routing policy alone, then the real thing. One local Ray instance (on 127.0.0.1,
started by `barellm serve --ray --address local` as a subprocess, stopped at the end of the module) serves
the default model with 2 replicas x 1 thread; the official `openai` client talks to it, and its answers are
checked against a single-process server of the same model."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from barellm.errors import InvalidRequest
from barellm.serve.ray.routing import BLOCK_CHARS, Choice, PrefixRouter, Route, rendezvous, route_of

MODEL_ID = "smollm2-135m"
CONTEXT = 512
SLOTS = 4
TIMEOUT = 120          # the server's --timeout; no request may take longer than this (+ the router's grace)
API_KEY = "ray-test-key-0123"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "ray.md"


# --- routing policy, no Ray ------------------------------------------------------------------------

def _chat_body(*contents: str) -> bytes:
    import json

    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    messages = [{"role": r, "content": c} for r, c in zip(roles[:len(contents)], contents, strict=True)]
    return json.dumps({"model": "m", "messages": messages}).encode()


def _keys(path: str, body: bytes) -> list:
    return route_of(path, body).keys


def test_route_keys_follow_messages_and_blocks() -> None:
    sys_prompt = "You answer briefly. " * 30            # 600 characters: three keys inside it
    one = route_of("/v1/chat/completions", _chat_body(sys_prompt, "Hi"))
    two = route_of("/v1/chat/completions", _chat_body(sys_prompt, "Hi", "Hello!", "How are you?"))
    assert len(one.keys) == 3 + 1 and len(two.keys) == len(one.keys) + 2
    assert two.keys[:len(one.keys)] == one.keys          # the next turn starts with the whole previous prompt
    assert [n for n, _ in one.keys][:2] == [BLOCK_CHARS, 2 * BLOCK_CHARS]
    # the anchor is the prefix through the first user message: the same for every turn of a chat
    assert one.anchor == two.anchor == one.keys[-1]
    other = route_of("/v1/chat/completions", _chat_body(sys_prompt, "Bye"))
    assert other.keys[:3] == one.keys[:3] and other.keys[3] != one.keys[3]   # shares the system prompt only
    assert other.anchor != one.anchor
    # the same messages spelt differently give the same keys
    spelt = b'{"messages": [{"content": "%s", "role": "system"}, {"role": "user", "content": "Hi"}]}' % (
        sys_prompt.encode())
    assert route_of("/v1/chat/completions", spelt) == one
    # completions: a string, a one-element list, token ids; the anchor is the first block
    text = "x" * 700
    a = route_of("/v1/completions", b'{"prompt": "%s"}' % text.encode())
    assert a == route_of("/v1/completions", b'{"prompt": ["%s"]}' % text.encode())
    assert len(a.keys) == 3 and a.anchor == a.keys[0]
    assert len(_keys("/v1/completions", b'{"prompt": [1, 2, 3]}')) == 1
    # Ollama's routes, as the app serves them too
    assert route_of("/api/chat", _chat_body(sys_prompt, "Hi")) == one
    assert route_of("/api/generate", b'{"prompt": "%s"}' % text.encode()) == a
    # anything else routes by load only
    for path, body in [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b"[1]"),
                       ("/tokenize", b'{"content": "hello"}'), ("/v1/completions", b'{"prompt": 5}')]:
        assert route_of(path, body) == Route()


def test_prefix_router_affinity_and_load() -> None:
    r = PrefixRouter(min_prefix_chars=100, slack=2, remembered=2, rng=random.Random(0))
    r.update(["a", "b"])
    long_chat = route_of("/v1/chat/completions", _chat_body("S" * 300, "question one"))
    home = rendezvous(long_chat.anchor[1], ["a", "b"])
    away = "b" if home == "a" else "a"
    c = r.choose(long_chat)   # nothing remembered: the conversation's hashed home
    assert (c.replica, c.reason, c.matched_chars) == (home, "anchor", 0)
    r.remember(away, long_chat.keys)   # say it went elsewhere (its home was busy)
    # the next turn goes where the first went
    turn2 = route_of("/v1/chat/completions", _chat_body("S" * 300, "question one", "answer", "question two"))
    c = r.choose(turn2)
    assert (c.replica, c.reason) == (away, "prefix") and c.matched_chars == long_chat.keys[-1][0]
    # another chat sharing only the long system prompt goes to its own home, not after the system prompt
    sibling = route_of("/v1/chat/completions", _chat_body("S" * 300, "another question"))
    assert r.matched(away, sibling.keys) == sibling.keys[-2][0]   # away holds the system message
    c = r.choose(sibling)
    assert (c.replica, c.reason) == (rendezvous(sibling.anchor[1], ["a", "b"]), "anchor")
    # a short prompt goes by load alone
    r.begin(away)
    short = route_of("/v1/chat/completions", _chat_body("Hi"))
    r.remember(away, short.keys)
    assert r.choose(short) == Choice(home, 0, "least_loaded")
    # the replica holding the prefix, too busy (more than slack above the other), no longer wins
    r.begin(away)
    assert r.choose(turn2).replica == away                 # 2 in flight vs 0: within the slack
    r.begin(away)
    c = r.choose(turn2)
    assert (c.replica, c.reason) == (home, "anchor")
    for _ in range(3):
        r.end(away)
    assert r.inflight == {"a": 0, "b": 0}
    # a continued conversation replaces its earlier turn; only `remembered` prompts are kept
    r.remember(away, turn2.keys)
    assert len(r.held[away]) == 2                          # short and turn2 (long_chat was its prefix)
    r.remember(away, route_of("/v1/chat/completions", _chat_body("T" * 300, "q")).keys)
    assert r.matched(away, short.keys) == 0 and r.matched(away, turn2.keys) == turn2.keys[-1][0]
    # excluded (failed) replicas are not chosen; replicas that go away are forgotten
    assert r.choose(turn2, exclude=[away]).replica == home
    assert r.choose(turn2, exclude=["a", "b"]).replica is None
    r.update([home, "c"])
    assert set(r.inflight) == {home, "c"} and away not in r.held
    assert r.choose(turn2).reason in ("anchor", "least_loaded")


def test_anchor_hashing_agrees_across_routers_and_spreads_chats() -> None:
    """Two routers with no memory in common send each turn of a chat to the same replica; chats that share
    only a system prompt spread over the replicas; a replica that goes away moves only its own chats."""
    replicas = ["r1", "r2", "r3", "r4"]
    one, two = PrefixRouter(min_prefix_chars=64), PrefixRouter(min_prefix_chars=64)
    for r in (one, two):
        r.update(replicas)
    homes = {}
    for i in range(40):
        first = route_of("/v1/chat/completions", _chat_body("You are terse. " * 10, f"question {i}"))
        c = one.choose(first)
        one.remember(c.replica, first.keys)
        nxt = route_of("/v1/chat/completions", _chat_body("You are terse. " * 10, f"question {i}", "ok", "more"))
        assert two.choose(nxt).replica == c.replica
        homes[i] = c.replica
    assert all(list(homes.values()).count(r) >= 4 for r in replicas), homes
    survivors = replicas[1:]
    for i, home in homes.items():
        if home != "r1":
            key = route_of("/v1/chat/completions", _chat_body("You are terse. " * 10, f"question {i}")).anchor
            assert rendezvous(key[1], survivors) == home


def test_prefix_router_spreads_unrelated_requests() -> None:
    r = PrefixRouter(rng=random.Random(1))
    r.update(["a", "b", "c"])
    picks = []
    for i in range(9):
        c = r.choose(route_of("/v1/completions", b'{"prompt": "prompt %d"}' % i))
        r.begin(c.replica)
        picks.append(c.replica)
    assert sorted(picks) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3


def test_serve_options_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from barellm.__main__ import main

    for argv, message in [
        (["serve", "--replicas", "2"], "--replicas applies only with --ray"),
        (["serve", "--address", "local", "--autoscale", "1,2"], "--address, --autoscale apply only with --ray"),
        (["serve", "--ray", "--replicas", "2", "--autoscale", "1,2"], "either --replicas or --autoscale"),
        (["serve", "--ray", "--replicas", "0"], "--replicas must be >= 1"),
        (["serve", "--ray", "--autoscale", "3,1"], "MIN <= MAX"),
        (["serve", "--ray", "--autoscale", "two"], "MIN,MAX"),
        (["serve", "--ray", "-t", "0"], "--threads must be >= 1"),
        (["serve", "--ray", "--routers", "0"], "--routers must be >= 1"),
    ]:
        assert main(argv) != 0
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_app_builder_args_and_docs_config() -> None:
    pytest.importorskip("ray.serve")
    yaml = pytest.importorskip("yaml")
    from ray.serve import Application

    from barellm.serve.ray import app_builder, parse_options

    args = parse_options({"model": MODEL_ID, "replicas": 3, "threads": 2, "slots": 2, "prefill_chunk": 64,
                          "alias": ["a", "b"]})
    assert (args.models, args.replicas, args.threads, args.slots, args.prefill_chunk, args.alias) == \
        ([MODEL_ID], 3, 2, 2, 64, ["a", "b"])
    with pytest.raises(InvalidRequest, match="unrecognized arguments"):
        parse_options({"model": MODEL_ID, "replica": 2})
    with pytest.raises(InvalidRequest, match="http_options"):
        parse_options({"port": 9000})
    with pytest.raises(InvalidRequest, match="--slots must be in 1..256"):
        parse_options({"slots": 0})
    # the example config in the docs builds
    block = re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    assert block, "docs/ray.md has no yaml example"
    config = yaml.safe_load(block.group(1))
    (app,) = config["applications"]
    assert app["import_path"] == "barellm.serve.ray:app_builder"
    assert isinstance(app_builder(app["args"]), Application)


# --- the real thing ----------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def client(self, timeout: float = TIMEOUT) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=timeout)

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", timeout=60).json()


@pytest.fixture(scope="module")
def ray_service(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`barellm serve --ray` with a Ray instance of its own on 127.0.0.1 (it stops with the command)."""
    pytest.importorskip("ray.serve")
    port = _free_port()
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray binds to the machine's address unless told it is not part of a cluster; no usage reports
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "barellm", "serve", MODEL_ID, "--ray", "--address", "local",
           "--replicas", "2", "-t", "1", "--slots", str(SLOTS), "--context", str(CONTEXT), "--port", str(port),
           "--timeout", str(TIMEOUT), "--api-key", API_KEY, "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    service = Service(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"barellm serve --ray exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the replicas did not come up:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if service.health().get("replicas_ok") == 2:
                    break
            time.sleep(1)
        yield service
    finally:
        proc.send_signal(signal.SIGINT)   # takes the application down, then the Ray instance it started
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def reference(smollm_gguf: Path) -> Iterator[str]:
    """A single-process `barellm serve` of the same model (in this process), for comparison."""
    import uvicorn

    import barellm
    from barellm.serve.app import create_app

    model = barellm.load(smollm_gguf, slots=SLOTS, context=CONTEXT, threads=1)
    app = create_app(model, model_id=MODEL_ID)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()


PROMPTS = [f"Write one sentence about {thing}." for thing in
           ("the sea", "a red bicycle", "bread", "the moon", "an old clock", "winter", "a lighthouse", "music")]


def _chat(client: Any, messages: list[dict[str, str]], **kw: Any) -> tuple[str, Any]:
    raw = client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=messages, temperature=0, **kw)
    return raw.headers.get("x-barellm-replica"), raw.parse()


@pytest.mark.model
def test_concurrent_requests_spread_and_match_single_process(ray_service: Service, reference: str) -> None:
    ref = openai.OpenAI(base_url=f"{reference}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    raw = ref.chat.completions.with_raw_response.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=2, temperature=0)
    assert raw.headers["x-barellm-replica"] == f"{socket.gethostname()}:{os.getpid()}"   # the same header, alone
    expected = [_chat(ref, [{"role": "user", "content": p}], max_tokens=24)[1].choices[0].message.content
                for p in PROMPTS]

    client = ray_service.client()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _chat(client, [{"role": "user", "content": p}], max_tokens=24), PROMPTS))
    assert [a.choices[0].message.content for _, a in answers] == expected
    assert all(a.usage.completion_tokens > 0 for _, a in answers)
    names = {r["replica"] for r in ray_service.health()["replicas"]}
    served = [name for name, _ in answers]
    assert set(served) == names and len(names) == 2, f"both replicas should have served some: {served}"

    # streamed and legacy completions give the single process's text too
    kw = dict(model=MODEL_ID, prompt="The capital of France is", max_tokens=12, temperature=0)
    want = ref.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == want


@pytest.mark.model
def test_next_turn_goes_to_the_replica_holding_the_chat(ray_service: Service) -> None:
    client = ray_service.client()
    topics = ["rivers of Europe", "the history of clocks", "growing tomatoes", "how bridges carry loads"]
    chats = [[{"role": "user", "content": f"I would like to learn about {t}. Please explain the three most "
                                          f"important things a beginner should know about {t}, briefly."}]
             for t in topics]
    first = []
    for messages in chats:   # first turns of four chats, interleaved with the second turns below
        name, reply = _chat(client, messages, max_tokens=24)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": "Thank you. Which of those is the hardest?"})
        first.append((name, reply.usage.prompt_tokens))
    for messages, (name, prompt_tokens) in zip(chats, first, strict=True):
        again, reply = _chat(client, messages, max_tokens=8)
        assert again == name, "the second turn went to another replica"
        cached = reply.usage.prompt_tokens_details.cached_tokens
        assert cached >= prompt_tokens, f"the second turn reused {cached} tokens of the first's {prompt_tokens}"


@pytest.mark.model
def test_health_and_metrics_report_every_replica(ray_service: Service) -> None:
    h = ray_service.health()
    assert h["status"] == "ok" and h["replicas_ok"] == 2 and h["slots"] == 2 * SLOTS
    for r in h["replicas"]:
        assert r["status"] == "ok" and r["slots"] == SLOTS and r["threads"] == 1 and r["pid"] > 0
    auth = {"Authorization": f"Bearer {API_KEY}"}
    text = httpx.get(f"{ray_service.url}/metrics", headers=auth, timeout=60).text
    for r in h["replicas"]:
        m = re.search(rf'^barellm_generated_tokens_total{{replica="{r["replica"]}"}} (\d+)$', text, re.M)
        assert m and int(m.group(1)) > 0, f"no generated tokens reported for {r['replica']}"
    assert 'barellm_replicas{state="running"} 2' in text
    assert text.count("# TYPE barellm_generated_tokens_total counter") == 1
    assert re.search(r'^barellm_router_requests_total\{replica="\w+",reason="prefix"\} [1-9]', text, re.M)
    # errors keep the app's shape, and still name who answered
    names = {x["replica"] for x in h["replicas"]}
    r = httpx.post(f"{ray_service.url}/v1/chat/completions", json={"model": MODEL_ID, "messages": []},
                   headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-barellm-replica"] in names
    # the replicas' own guard sees the original request: its key and its Host header
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"{ray_service.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 401 and r.headers["x-barellm-replica"] in names
    r = httpx.post(f"{ray_service.url}/v1/chat/completions", json=body, timeout=60,
                   headers={**auth, "Host": "rebound.example.com"})
    assert r.status_code == 421
    assert httpx.get(f"{ray_service.url}/metrics", timeout=60).status_code == 401
    assert httpx.post(f"{ray_service.url}/v1/chat/completions", json=body, headers=auth, timeout=60).status_code == 200


# long enough that a replica is still generating when it is killed (a request that ends first leaves the
# router nothing to see fail)
LONG_TOKENS = 256


def _one(client: Any, i: int) -> tuple[str, float, str]:
    """A long request, streamed or not; returns how it ended, how long it took, and what it said."""
    t0 = time.monotonic()
    messages = [{"role": "user", "content": f"Tell a long story about {i + 2} travelling cats."}]
    try:
        if i % 2:
            _, reply = _chat(client, messages, max_tokens=LONG_TOKENS)
            return "ok", time.monotonic() - t0, reply.choices[0].message.content
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=LONG_TOKENS, temperature=0, stream=True) if c.choices)
        return "ok", time.monotonic() - t0, text
    except openai.APIError as e:
        return f"error: {type(e).__name__}", time.monotonic() - t0, str(e)


@pytest.mark.model
def test_killed_replica_is_replaced_and_no_request_hangs(ray_service: Service) -> None:
    before = {r["replica"]: r["pid"] for r in ray_service.health()["replicas"]}
    victim = sorted(before)[0]
    client = ray_service.client(timeout=TIMEOUT + 60)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_one, client, i) for i in range(8)]
        deadline = time.monotonic() + 60
        while not all(r.get("slots_in_use", 0) > 0 for r in ray_service.health()["replicas"]):
            assert time.monotonic() < deadline, "the requests never reached both replicas"
            time.sleep(0.2)
        os.kill(before[victim], signal.SIGKILL)
        results = [f.result() for f in futures]
    # every request ended, well within its limit: whole or retried elsewhere, or (a stream the replica had
    # begun) with the router's error event
    for outcome, seconds, text in results:
        assert seconds < TIMEOUT, f"a request took {seconds:.0f} s"
        assert outcome == "ok" or "replica serving this request stopped" in text, (outcome, text)
    assert all(outcome == "ok" for i, (outcome, _, _) in enumerate(results) if i % 2), \
        "a non-streamed request failed: it should have been served by the other replica"
    assert sum(outcome == "ok" for outcome, _, _ in results) >= 4
    text = httpx.get(f"{ray_service.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).text
    failures = re.findall(r"^barellm_router_replica_failures_total\{stage=\"\w+\"\} (\d+)$", text, re.M)
    assert sum(int(n) for n in failures) >= 1, "the router saw no replica fail"
    # the service keeps answering, and Ray brings a new replica in place of the killed one
    reply = client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text
    deadline = time.monotonic() + 180
    while True:
        h = ray_service.health()
        pids = {r["replica"]: r.get("pid") for r in h["replicas"]}
        if h["replicas_ok"] == 2 and victim not in pids and before[victim] not in pids.values():
            break
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {h}"
        time.sleep(1)
    assert set(pids) - {victim} >= set(before) - {victim}
