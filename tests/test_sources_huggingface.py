"""Models from Hugging Face, against a stand-in for the hub on 127.0.0.1 that answers what huggingface_hub asks:
model info with files' LFS SHA-256 (/api/models/REPO?blobs=true), and HEAD/GET of /REPO/resolve/REV/FILE
with the headers it reads (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size, Content-Length, Range)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

import barellm  # noqa: E402
from barellm.__main__ import main  # noqa: E402
from barellm.store import catalog  # noqa: E402
from barellm.store.sources import huggingface  # noqa: E402

import tiny_model  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from tiny_model import write_tiny_llama  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_test_token_for_the_gated_repo"


class Hub:
    """repos: repo -> {file: bytes}; stated: (repo, file) -> the SHA-256 the model info states instead of the
    file's; gated: repos that answer 401 without the token; cut: (repo, file) -> bytes after which the next
    GET breaks off (once)."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.stated: dict[tuple[str, str], str] = {}
        self.gated: set[str] = set()
        self.cut: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _route(self) -> None:
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                repo = next((r for r in hub.repos if path.startswith((f"/api/models/{r}", f"/{r}/resolve/"))), None)
                if repo is None:
                    body = b'{"error": "Repository not found"}'
                    self._send(404, {"X-Error-Code": "RepoNotFound", "Content-Length": str(len(body))}, body)
                    return
                if repo in hub.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    body = b'{"error": "Access to this model is restricted"}'
                    self._send(401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted",
                                     "Content-Length": str(len(body))}, body)
                    return
                files = hub.repos[repo]
                if path.startswith("/api/models/"):
                    siblings = [{"rfilename": n, "size": len(d), "blobId": hashlib.sha1(d).hexdigest(),
                                 "lfs": {"sha256": hub.stated.get((repo, n), hashlib.sha256(d).hexdigest()),
                                         "size": len(d), "pointerSize": 134}} for n, d in files.items()]
                    body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                       "gated": "auto" if repo in hub.gated else False, "siblings": siblings}).encode()
                    self._send(200, {"Content-Type": "application/json", "Content-Length": str(len(body))}, body)
                    return
                name = path.split("/resolve/", 1)[1].split("/", 1)[1]
                if name not in files:
                    self._send(404, {"X-Error-Code": "EntryNotFound", "Content-Length": "0"})
                    return
                data = files[name]
                etag = f'"{hub.stated.get((repo, name), hashlib.sha256(data).hexdigest())}"'
                start = int(self.headers["Range"].split("=")[1].split("-")[0]) if self.headers.get("Range") else 0
                headers = {"X-Repo-Commit": COMMIT, "ETag": etag, "X-Linked-Etag": etag,
                           "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes",
                           "Content-Length": str(len(data) - start)}
                if start:
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                cut = hub.cut.pop((repo, name), None) if self.command == "GET" else None
                if cut is not None:
                    self.close_connection = True
                    self._send(206 if start else 200, headers, data[start:cut])
                    return
                self._send(206 if start else 200, headers, data[start:])

            do_GET = do_HEAD = _route

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def downloads(self) -> list[str]:
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tiny(tmp: Path, seed: int) -> bytes:
    return write_tiny_llama(tmp / f"t{seed}.gguf", seed=seed).read_bytes()


def tiny_parts(monkeypatch, tmp: Path) -> tuple[dict, list]:
    """The tiny model's metadata and tensors, as write_tiny_llama would write them."""
    captured: dict = {}
    with monkeypatch.context() as m:
        m.setattr(tiny_model, "write_gguf", lambda path, md, tensors: captured.update(md=md, tensors=tensors))
        write_tiny_llama(tmp / "unused.gguf", seed=7)
    return captured["md"], captured["tensors"]


def split_tiny(tmp: Path, monkeypatch) -> list[bytes]:
    """The tiny model as llama.cpp's gguf-split writes it: two GGUF files, the metadata in the first, the
    tensors shared out, split.* keys in both."""
    md, tensors = tiny_parts(monkeypatch, tmp)
    half = len(tensors) // 2
    keys = {"split.count": 2, "split.tensors.count": len(tensors)}
    write_gguf(tmp / "p1.gguf", {**md, "split.no": 0, **keys}, tensors[:half])
    write_gguf(tmp / "p2.gguf", {"split.no": 1, **keys}, tensors[half:])
    return [(tmp / "p1.gguf").read_bytes(), (tmp / "p2.gguf").read_bytes()]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    h = Hub()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    src = tmp_path / "src"
    src.mkdir()
    h.repos["org/tiny-GGUF"] = {"README.md": b"# tiny", "tiny.Q8_0.gguf": tiny(src, 1),
                                "tiny.Q4_K_M.gguf": tiny(src, 2), "tiny-F16.gguf": tiny(src, 3),
                                "mmproj-tiny-f16.gguf": b"GGUF not a model"}
    yield h
    h.close()


def test_quant_names_and_the_default(hub, tmp_path):
    files = [huggingface.HubFile(n, len(d), "0" * 64) for n, d in hub.repos["org/tiny-GGUF"].items()]
    found = huggingface.quants(files)
    assert [q.label for q in found] == ["Q8_0", "Q4_K_M", "F16"]      # the projector is no model
    assert huggingface.pick("org/tiny-GGUF", None, found).label == "Q4_K_M"
    assert huggingface.pick("org/tiny-GGUF", "q8_0", found).files[0].name == "tiny.Q8_0.gguf"
    assert huggingface.pick("r", None, found[:1]).label == "Q8_0"       # no Q4_K_M: the first
    with pytest.raises(barellm.ModelNotFound, match="no 'Q5_K_S' quantization; it has: Q8_0, Q4_K_M, F16"):
        huggingface.pick("org/tiny-GGUF", "Q5_K_S", found)
    split = [huggingface.HubFile(f"m-Q4_0-0000{i}-of-00002.gguf", 1, "0" * 64) for i in (2, 1)]
    [q] = huggingface.quants(split)
    assert q.label == "Q4_0" and [f.name for f in q.files] == ["m-Q4_0-00001-of-00002.gguf",
                                                                "m-Q4_0-00002-of-00002.gguf"]


def test_pull_picks_the_quant_checks_it_and_run_downloads_nothing_again(hub, tmp_path, capsys):
    data = hub.repos["org/tiny-GGUF"]["tiny.Q8_0.gguf"]
    assert main(["pull", "hf.co/org/tiny-GGUF:q8_0"]) == 0            # the tag in any case
    out, err = capsys.readouterr()
    path = Path(out.strip())
    assert path.read_bytes() == data and path.name == "tiny.Q8_0.gguf"
    assert str(path).startswith(str(tmp_path / "hf" / "models--org--tiny-GGUF" / "snapshots" / COMMIT))
    assert "writes" in err and str(tmp_path / "hf") in err
    assert hub.downloads() == [f"/org/tiny-GGUF/resolve/{COMMIT}/tiny.Q8_0.gguf"]
    # run, load and list by the same name, none of them asking the hub anything
    asked = len(hub.requests)
    assert main(["run", "hf.co/org/tiny-GGUF:Q8_0", "the cat", "-n", "3", "--temperature", "0", "--raw"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    model = barellm.load("hf://org/tiny-GGUF:Q8_0")
    assert model.path == path and model.name == "hf.co/org/tiny-GGUF:Q8_0"
    assert catalog.resolve("org/tiny-GGUF:Q8_0") == path
    assert main(["list"]) == 0
    [row] = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("hf.co/org/tiny-GGUF:Q8_0")]
    assert row[1] == "huggingface" and row[5:7] == ["converted,", "gguf"]
    assert len(hub.requests) == asked
    # no tag: the repository's Q4_K_M
    assert main(["pull", "hf.co/org/tiny-GGUF"]) == 0
    assert Path(capsys.readouterr().out.strip()).name == "tiny.Q4_K_M.gguf"
    assert catalog.resolve("hf.co/org/tiny-GGUF") == catalog.resolve("hf.co/org/tiny-GGUF:Q4_K_M")
    # a tag the repository has not: the quants it has
    assert main(["pull", "hf.co/org/tiny-GGUF:Q2_K"]) == 1
    assert "it has: Q8_0, Q4_K_M, F16" in capsys.readouterr().err
    # rm: what barellm fetched goes, from the Hugging Face cache too
    assert main(["rm", "hf.co/org/tiny-GGUF:Q8_0"]) == 0
    assert not path.exists() and not path.resolve().exists()
    assert catalog.resolve("hf.co/org/tiny-GGUF:Q4_K_M").is_file()


def test_a_file_already_in_the_cache_is_used_in_place_and_left_by_rm(hub, tmp_path, capsys):
    from huggingface_hub import hf_hub_download

    theirs = Path(hf_hub_download("org/tiny-GGUF", "tiny-F16.gguf", cache_dir=str(tmp_path / "hf"), endpoint=hub.url))
    fetched = len(hub.downloads())
    assert main(["list"]) == 0
    assert any(ln.startswith("hf.co/org/tiny-GGUF:F16 ") for ln in capsys.readouterr().out.splitlines())
    assert main(["run", "hf.co/org/tiny-GGUF:f16", "the cat", "-n", "2", "--raw"]) == 0
    assert len(hub.downloads()) == fetched
    capsys.readouterr()
    assert main(["pull", "hf.co/org/tiny-GGUF:F16"]) == 0
    assert "nothing to download" in capsys.readouterr().err and len(hub.downloads()) == fetched
    assert main(["rm", "hf.co/org/tiny-GGUF:F16"]) == 0
    assert "stay" in capsys.readouterr().err and theirs.is_file()


def test_an_interrupted_download_resumes(hub, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    # huggingface_hub keeps what it received in whole chunks (10 MB): smaller ones for a file of 80 KB
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    data = hub.repos["org/tiny-GGUF"]["tiny.Q4_K_M.gguf"]
    hub.cut[("org/tiny-GGUF", "tiny.Q4_K_M.gguf")] = 4096 * 5
    assert main(["pull", "hf.co/org/tiny-GGUF:Q4_K_M"]) == 0
    assert Path(capsys.readouterr().out.strip()).read_bytes() == data
    ranges = [r for m, p, r in hub.requests if m == "GET" and p.endswith("tiny.Q4_K_M.gguf")]
    assert ranges == [None, f"bytes={4096 * 5}-"]       # the rest only, after the break


def test_a_file_that_does_not_match_the_hubs_sha256_is_refused_and_removed(hub, tmp_path, capsys):
    hub.stated[("org/tiny-GGUF", "tiny.Q8_0.gguf")] = "ab" * 32
    assert main(["pull", "hf.co/org/tiny-GGUF:Q8_0"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: hf.co/org/tiny-GGUF:Q8_0: tiny.Q8_0.gguf has SHA-256") and "removed" in err
    repo = tmp_path / "hf" / "models--org--tiny-GGUF"
    assert not list((repo / "blobs").iterdir()) and not list((repo / "snapshots").rglob("*.gguf"))
    assert not list(repo.rglob("*.incomplete"))
    assert not (tmp_path / "home" / "huggingface").exists() or not list((tmp_path / "home" / "huggingface").iterdir())
    assert not (tmp_path / "home" / "blm").exists() or not list((tmp_path / "home" / "blm").glob("*.blm"))


def test_a_gated_repo_needs_a_token(hub, monkeypatch, capsys):
    hub.repos["org/gated"] = {"g.Q4_K_M.gguf": hub.repos["org/tiny-GGUF"]["tiny.Q4_K_M.gguf"]}
    hub.gated.add("org/gated")
    assert main(["pull", "hf.co/org/gated"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gated" in err and "HF_TOKEN" in err
    assert main(["pull", "hf.co/org/no-such-repo"]) == 1
    assert "no such repository" in capsys.readouterr().err
    assert main(["pull", "hf.co/org/../x"]) == 1
    assert "not a Hugging Face repository id" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["pull", "hf.co/org/gated"]) == 0


def test_a_split_gguf_is_fetched_whole_and_runs_as_one_model(hub, tmp_path, monkeypatch, capsys):
    parts = split_tiny(tmp_path, monkeypatch)
    hub.repos["org/split-GGUF"] = {"m-Q4_0-00001-of-00002.gguf": parts[0], "m-Q4_0-00002-of-00002.gguf": parts[1]}
    assert main(["pull", "hf.co/org/split-GGUF"]) == 0
    first = Path(capsys.readouterr().out.strip())
    assert first.name == "m-Q4_0-00001-of-00002.gguf" and (first.parent / "m-Q4_0-00002-of-00002.gguf").is_file()
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, *tiny_parts(monkeypatch, tmp_path))
    expected = barellm.load(whole).generate("the cat", max_tokens=5, temperature=0)
    assert barellm.load("hf.co/org/split-GGUF:Q4_0").generate("the cat", max_tokens=5, temperature=0) == expected


def test_the_servers_api_pull_streams_byte_progress_for_a_hugging_face_name(hub, tmp_path, monkeypatch):
    pytest.importorskip("starlette")
    from huggingface_hub import constants
    from starlette.testclient import TestClient

    from barellm.__main__ import build_parser
    from barellm.serve import build_app

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)   # several progress steps for a small file
    size = len(hub.repos["org/tiny-GGUF"]["tiny.Q8_0.gguf"])
    args = build_parser().parse_args(["serve", "-c", "64", "-t", "1", "--allowed-host", "testserver"])
    with TestClient(build_app(args)) as c:
        r = c.post("/api/pull", json={"model": "hf.co/org/tiny-GGUF:Q8_0"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(ln) for ln in r.text.splitlines()]
        assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
        progress = [ln for ln in lines if "completed" in ln]
        assert progress and all(ln["total"] == size and ln["digest"].startswith("sha256:") for ln in progress)
        assert progress[-1]["completed"] == size
        assert [ln["completed"] for ln in progress] == sorted(ln["completed"] for ln in progress)
        tags = [m["name"] for m in c.get("/api/tags").json()["models"]]
        assert "hf.co/org/tiny-GGUF:Q8_0" in tags
        r = c.post("/api/generate", json={"model": "hf.co/org/tiny-GGUF:Q8_0", "prompt": "the cat", "stream": False,
                                          "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
        r = c.post("/api/pull", json={"model": "hf.co/org/tiny-GGUF:Q5_K_S", "stream": False})
        assert r.status_code == 500 and "it has: Q8_0, Q4_K_M, F16" in r.json()["error"]


def test_offline_mode_runs_what_is_cached_and_says_what_is_not(hub, monkeypatch, capsys):
    assert main(["pull", "hf.co/org/tiny-GGUF:Q8_0"]) == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = len(hub.requests)
    assert main(["run", "hf.co/org/tiny-GGUF:Q8_0", "the cat", "-n", "2", "--raw"]) == 0
    assert main(["pull", "hf.co/org/tiny-GGUF:q8_0"]) == 0
    capsys.readouterr()
    assert main(["pull", "hf.co/org/tiny-GGUF:F16"]) == 1
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err and len(hub.requests) == asked
