"""Resident memory levels off under a few hundred mixed requests: chat, completions, output constraints
(a different one each time, past the grammar cache's bound), embeddings, and streams the client drops
mid-way. The server runs in this process under uvicorn with `barellm serve`'s settings; the RSS after
200 requests (and after 400) must be within 10 % of the RSS after 50 (the KV cache, the engine's buffers and the bounded
caches are all in place by then)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from barellm.serve.app import create_app, server_config  # noqa: E402

WARM, MID, TOTAL = 50, 200, 400


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _request(c: httpx.Client, url: str, i: int) -> None:
    kind = i % 6
    chat = {"messages": [{"role": "user", "content": f"Say something about the number {i}."}], "max_tokens": 6}
    if kind == 0:
        r = c.post(f"{url}/v1/chat/completions", json=chat)
    elif kind == 1:
        r = c.post(f"{url}/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 6})
    elif kind == 2:   # a new regex each time: the grammar cache fills to its bound, then evicts
        r = c.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 6, "regex": f"[a-z]{{{i % 97 + 1}}}"})
    elif kind == 3:
        r = c.post(f"{url}/v1/embeddings", json={"input": [f"text {i}", "another text"]})
    elif kind == 4:   # a stream dropped after its first event
        with c.stream("POST", f"{url}/v1/chat/completions", json={**chat, "max_tokens": 64, "stream": True}) as s:
            assert s.status_code == 200
            next(s.iter_lines())
        return
    else:
        r = c.post(f"{url}/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_resident_memory_levels_off(smollm_gguf: Path) -> None:
    import barellm

    model = barellm.load(smollm_gguf, slots=4, context=1024)
    app = create_app(model, model_id="smollm2-135m", timeout=60)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(server_config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    figures = {0: rss_mb()}
    try:
        t0 = time.monotonic()
        with httpx.Client(timeout=120) as c:
            for i in range(TOTAL):
                _request(c, url, i)
                if i + 1 in (WARM, 100, MID, 300, TOTAL):
                    figures[i + 1] = rss_mb()
        took = time.monotonic() - t0
    finally:
        srv.should_exit = True
        thread.join(60)
        sock.close()
    print(f"RSS MB after n requests: {figures}; {TOTAL} requests in {took:.0f} s")
    assert figures[MID] <= figures[WARM] * 1.10, figures
    assert figures[TOTAL] <= figures[WARM] * 1.10, figures
