"""GGUF models from Hugging Face: `hf.co/ORG/REPO[:QUANT]`, fetched with huggingface_hub into its own cache.

huggingface_hub does the transfer: its cache layout ($HF_HUB_CACHE, default ~/.cache/huggingface/hub), its
resumed downloads, $HF_TOKEN for gated and private repositories, $HF_ENDPOINT for a mirror, $HF_HUB_OFFLINE.
barellm picks the file and checks it:

- QUANT picks the GGUF as Ollama does: the quantization in the file's name (Q4_K_M, q8_0, IQ2_XXS, F16...),
  compared case-insensitively; without one the repository's Q4_K_M, else its first GGUF. A tag that matches
  none is an error listing the quantizations the repository has.
- A split GGUF (NAME-00001-of-00003.gguf) is fetched whole; the converter reads its parts as one model.
- Every file is hashed and compared with the SHA-256 the hub states for it (its LFS metadata) before it is
  used; a file that differs is removed from the cache.

What barellm fetched is recorded in $BARELLM_HOME/huggingface/ (one JSON file per model): that is how a
later run finds it without asking the hub, and how `barellm rm` knows which files of the Hugging Face cache
it wrote itself (those it removes; a file the user had already fetched stays).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barellm.errors import BarellmError, ModelNotFound
from barellm.files import home, sha256_file, write_bytes_atomic
from barellm.store.sources.download import Reporter, StatusReport, check_disk, mb, say

DEFAULT_QUANT = "Q4_K_M"
# a quantization in a GGUF file's name: Q4_K_M, Q8_0, IQ2_XXS, Q4_0_4_4, F16, BF16, F32
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|[Bb]?[Ff]16|[Ff]32)(?=[-_.])")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


@dataclass(frozen=True)
class HubFile:
    name: str       # path in the repository
    size: int
    sha256: str     # as the hub states it (LFS)


@dataclass(frozen=True)
class Quant:
    """One GGUF model of a repository: its quantization, and its file or the parts of its split, in order."""

    label: str
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class HfModel:
    """A GGUF model of the Hugging Face cache. path: the file barellm loads (a split's first part);
    owned: barellm downloaded its files (rm may remove them)."""

    repo: str
    quant: str
    paths: tuple[Path, ...]
    sha256: tuple[str, ...]
    owned: bool
    record: Path | None

    @property
    def name(self) -> str:
        return f"hf.co/{self.repo}:{self.quant}"

    @property
    def path(self) -> Path:
        return self.paths[0]

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.paths if p.exists())


def cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment now (huggingface_hub reads it once, at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    return Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
                ).expanduser() / "hub"


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name states (upper case), or None."""
    base = filename.rsplit("/", 1)[-1]
    found = _QUANT.findall(_SPLIT.sub(".gguf", base))
    return found[-1].upper() if found else None


def quants(files: list[HubFile]) -> list[Quant]:
    """The GGUF models among a repository's files, in the repository's order: a split's parts together.
    Projector files (mmproj) are no model of their own."""
    groups: dict[str, list[HubFile]] = {}
    labels: dict[str, str] = {}
    for f in files:
        base = f.name.rsplit("/", 1)[-1]
        if not base.lower().endswith(".gguf") or base.lower().startswith("mmproj"):
            continue
        key = _SPLIT.sub("", f.name) if _SPLIT.search(f.name) else f.name
        groups.setdefault(key, []).append(f)
        labels[key] = quant_of(f.name) or base[: -len(".gguf")]
    out = []
    for key, group in groups.items():
        group.sort(key=lambda f: f.name)
        split = _SPLIT.search(group[0].name)
        if split and int(split.group(2)) != len(group):
            continue   # a split with parts missing from the repository
        out.append(Quant(labels[key], tuple(group)))
    return out


def pick(repo: str, tag: str | None, found: list[Quant]) -> Quant:
    """The model a tag names among a repository's (see the module docstring)."""
    if not found:
        raise ModelNotFound(f"hf.co/{repo} has no GGUF file; barellm runs GGUF models from Hugging Face")
    if tag is None:
        return next((q for q in found if q.label.upper() == DEFAULT_QUANT), found[0])
    for q in found:
        if q.label.lower() == tag.lower():
            return q
    listed = ", ".join(dict.fromkeys(q.label for q in found))
    raise ModelNotFound(f"hf.co/{repo} has no {tag!r} quantization; it has: {listed}")


# --- what barellm fetched: the records --------------------------------------------------------------


def _records_dir() -> Path:
    return home() / "huggingface"


def _record_path(repo: str, quant: str) -> Path:
    return _records_dir() / f"{repo.replace('/', '--')}--{quant.upper()}.json"


def _from_record(path: Path) -> HfModel | None:
    try:
        r = json.loads(path.read_text())
        paths = tuple(Path(f["path"]) for f in r["files"])
        model = HfModel(r["repo"], r["quant"], paths, tuple(f["sha256"] for f in r["files"]),
                        any(f["downloaded"] for f in r["files"]), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return model if all(p.is_file() for p in paths) else None


def recorded() -> list[HfModel]:
    out = []
    for path in sorted(_records_dir().glob("*.json")):
        m = _from_record(path)
        if m is not None:
            out.append(m)
    return out


def _default_of(repo: str) -> str | None:
    try:
        return json.loads((_records_dir() / f"{repo.replace('/', '--')}.default").read_text())["quant"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find(repo: str, tag: str | None) -> HfModel | None:
    """The model of a repository barellm has fetched (or checked in the cache), without asking the hub;
    no tag: the one a pull without a tag picked, or the only one there is."""
    mine = [m for m in recorded() if m.repo.lower() == repo.lower()]
    if tag is not None:
        return next((m for m in mine if m.quant.lower() == tag.lower()), None)
    default = _default_of(repo)
    chosen = [m for m in mine if default is not None and m.quant.lower() == default.lower()]
    return chosen[0] if chosen else (mine[0] if len(mine) == 1 else None)


def _scan() -> Iterator[tuple[str, Path]]:
    """(ORG/REPO, file) for every GGUF in the Hugging Face cache's snapshots."""
    root = cache_dir()
    try:
        repos = sorted(root.glob("models--*--*"))
    except OSError:
        return
    for d in repos:
        repo = d.name.removeprefix("models--").replace("--", "/", 1)
        for snapshot in sorted((d / "snapshots").glob("*")):
            for f in sorted(snapshot.rglob("*.gguf")):
                yield repo, f


def cached_models() -> list[HfModel]:
    """Every GGUF model in the Hugging Face cache: what barellm fetched (recorded), and what else is there
    (not owned, its hash the blob's name the hub gave it)."""
    out = recorded()
    seen = {p.resolve() for m in out for p in m.paths}
    files: dict[tuple[str, str], list[Path]] = {}
    for repo, f in _scan():
        try:
            if f.resolve() in seen or not f.is_file():
                continue
        except OSError:
            continue
        rel = f.relative_to(next(p for p in f.parents if p.parent.name == "snapshots"))
        if rel.name.lower().startswith("mmproj"):
            continue
        key = _SPLIT.sub("", str(rel)) if _SPLIT.search(rel.name) else str(rel)
        files.setdefault((repo, key), []).append(f)
    for (repo, key), paths in files.items():
        paths.sort()
        label = quant_of(paths[0].name) or Path(key).stem
        out.append(HfModel(repo, label, tuple(paths), tuple(p.resolve().name for p in paths), False, None))
    return out


# --- fetching ----------------------------------------------------------------------------------------


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise BarellmError("models from Hugging Face need huggingface_hub: pip install 'barellm[hub]'") from None
    return huggingface_hub


def _hub_error(repo: str, e: Exception) -> BarellmError:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        token = "your HF_TOKEN has no access to it" if os.environ.get("HF_TOKEN") else "set HF_TOKEN"
        return BarellmError(f"hf.co/{repo} is a gated repository: accept its conditions on its page on "
                            f"huggingface.co and {token} (a token with read access)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelNotFound(f"hf.co/{repo}: no such repository on Hugging Face (a private one needs HF_TOKEN)")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return BarellmError(f"hf.co/{repo}: Hugging Face answered {status}: {str(e).splitlines()[0]}")
    where = endpoint() or "https://huggingface.co"
    return BarellmError(f"hf.co/{repo}: cannot reach Hugging Face at {where} ({type(e).__name__}: {e}); "
                        "HF_HUB_OFFLINE=1 runs what is cached")


def _repo_files(repo: str) -> tuple[str, list[HubFile]]:
    """The repository's commit and its files with their sizes and SHA-256 (model info with blobs=true)."""
    hub = _hub()
    api = hub.HfApi(endpoint=endpoint(), token=os.environ.get("HF_TOKEN") or None)
    try:
        info = api.model_info(repo, files_metadata=True)
    except Exception as e:   # huggingface_hub's errors, and the HTTP client's beneath them
        raise _hub_error(repo, e) from None
    files = []
    for s in info.siblings or []:
        if s.rfilename.lower().endswith(".gguf"):
            if s.lfs is None or not s.lfs.sha256:
                raise BarellmError(f"hf.co/{repo}: the hub states no SHA-256 for {s.rfilename}; refusing to use it "
                                   "unchecked")
            files.append(HubFile(s.rfilename, int(s.lfs.size), s.lfs.sha256.lower()))
    return str(info.sha), files


def _progress_class(report: Reporter | None, quiet: bool) -> Any:
    """huggingface_hub's progress bar (bytes, rate, time left), which also tells a server how far it is."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class Bar(hub_tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if quiet:
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.seen = int(kwargs.get("initial") or 0)

        def update(self, n: float | None = 1) -> bool | None:
            self.seen += int(n or 0)
            if report is not None:
                report(self.seen)
            return super().update(n)

    return Bar


def _cached(repo: str, revision: str, f: HubFile) -> Path | None:
    hub = _hub()
    found = hub.try_to_load_from_cache(repo, f.name, cache_dir=str(cache_dir()), revision=revision)
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def _drop(path: Path) -> None:
    """Removes a file of the Hugging Face cache: the snapshot's link and the blob it points to."""
    try:
        blob = path.resolve()
    except OSError:
        blob = None
    path.unlink(missing_ok=True)
    if blob is not None and blob != path:
        blob.unlink(missing_ok=True)


def pull(repo: str, tag: str | None, *, quiet: bool = False, on_status: StatusReport | None = None,
         convert: bool = True) -> HfModel:
    """Fetches a GGUF model of a Hugging Face repository (a no-op when it was fetched before), checks every
    file against the hub's SHA-256, records it, and converts it once into the model cache."""
    def status(text: str, **more: Any) -> None:
        if on_status is not None:
            on_status({"status": text, **more})

    if not _REPO_ID.fullmatch(repo) or ".." in repo:
        raise ModelNotFound(f"hf.co/{repo}: not a Hugging Face repository id (hf.co/ORG/REPO[:QUANT])")
    # without a tag, the repository's default is the hub's to say, unless a pull without one asked it before
    known = find(repo, tag) if tag is not None or _default_of(repo) is not None or offline() else None
    if known is not None:
        say(f"{known.name}: in the Hugging Face cache ({known.path}); nothing to download", quiet)
        if convert:
            _convert(known, quiet)
        return known
    if offline():
        raise ModelNotFound(f"hf.co/{repo}{':' + tag if tag else ''} is not in the Hugging Face cache, and "
                            "HF_HUB_OFFLINE is set")
    status("pulling manifest")
    revision, files = _repo_files(repo)
    quant = pick(repo, tag, quants(files))
    have = {f.name: _cached(repo, revision, f) for f in quant.files}
    missing = [f for f in quant.files if have[f.name] is None]
    fetch_bytes = sum(f.size for f in missing)
    from barellm.store.converted import converted_path

    sha = _listing_sha([f.name.rsplit("/", 1)[-1] for f in quant.files], [f.sha256 for f in quant.files])
    conversion = quant.size if convert and not converted_path(sha).is_file() else 0
    check_disk(cache_dir(), fetch_bytes + conversion, f"hf.co/{repo}:{quant.label}")
    name = f"hf.co/{repo}:{quant.label}"
    if missing:
        say(f"{name}: writes {mb(fetch_bytes)} to the Hugging Face cache ({cache_dir()})"
            + (f", then about {mb(conversion)} to {home() / 'blm'} (its conversion)" if conversion else ""), quiet)
    else:
        say(f"{name}: already in the Hugging Face cache ({cache_dir()}); nothing to download"
            + (f"; its conversion writes about {mb(conversion)} to {home() / 'blm'}: the model is then on disk "
               "twice" if conversion else ""), quiet)
    hub = _hub()
    paths: list[Path] = []
    downloaded: list[bool] = []
    for f in quant.files:
        path = have[f.name]
        if path is None:
            report = Reporter(on_status, f"pulling {f.sha256[:12]}", f"sha256:{f.sha256}", f.size)
            try:
                path = Path(hub.hf_hub_download(repo, f.name, revision=revision, cache_dir=str(cache_dir()),
                                                endpoint=endpoint(), token=os.environ.get("HF_TOKEN") or None,
                                                tqdm_class=_progress_class(report, quiet)))
            except Exception as e:
                raise _hub_error(repo, e) from None
            report(f.size, force=True)
        paths.append(path)
        downloaded.append(have[f.name] is None)
    status("verifying sha256 digest")
    for f, path, mine in zip(quant.files, paths, downloaded, strict=True):
        digest = sha256_file(path)
        if digest != f.sha256:
            if mine:
                _drop(path)
            raise BarellmError(f"{name}: {f.name} has SHA-256 {digest}, not the {f.sha256} the hub states; "
                               + ("the download was removed" if mine else
                                  "the file in the Hugging Face cache is corrupt (barellm did not write it, and "
                                  "leaves it there)"))
    status("writing manifest")
    record = _record_path(repo, quant.label)
    record.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(record, json.dumps({
        "repo": repo, "quant": quant.label, "revision": revision,
        "files": [{"file": f.name, "path": str(p), "sha256": f.sha256, "size": f.size, "downloaded": d}
                  for f, p, d in zip(quant.files, paths, downloaded, strict=True)]}, indent=1).encode())
    if tag is None:
        write_bytes_atomic(_records_dir() / f"{repo.replace('/', '--')}.default",
                           json.dumps({"quant": quant.label}).encode())
    model = HfModel(repo, quant.label, tuple(paths), tuple(f.sha256 for f in quant.files), any(downloaded), record)
    if convert:
        _convert(model, quiet)
    return model


def adopt(repo: str, tag: str | None) -> HfModel | None:
    """A model already in the Hugging Face cache that barellm did not fetch, checked against the hash the
    hub named its blob by, and recorded (not owned), so that it runs by name offline; None if there is none."""
    wanted = [m for m in cached_models() if m.record is None and m.repo.lower() == repo.lower()
              and (tag is None or m.quant.lower() == tag.lower())]
    if tag is None and len(wanted) > 1:
        wanted = [m for m in wanted if m.quant.upper() == DEFAULT_QUANT] or wanted[:1]
    if not wanted:
        return None
    m = wanted[0]
    for path, sha in zip(m.paths, m.sha256, strict=True):
        if sha256_file(path) != sha:
            raise BarellmError(f"{m.name}: {path} does not hash to the SHA-256 its blob is named after; the file in "
                               "the Hugging Face cache is corrupt (barellm leaves it there)")
    record = _record_path(m.repo, m.quant)
    record.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(record, json.dumps({
        "repo": m.repo, "quant": m.quant, "revision": m.path.parent.name,
        "files": [{"file": p.name, "path": str(p), "sha256": s, "size": p.stat().st_size, "downloaded": False}
                  for p, s in zip(m.paths, m.sha256, strict=True)]}, indent=1).encode())
    return _from_record(record)


def _convert(m: HfModel, quiet: bool) -> None:
    from barellm.store import converted

    if converted.conversion_of(m.path) is None:
        converted.open_cached(m.path, sha256=conversion_sha(m), progress=not quiet).close()


def conversion_sha(m: HfModel) -> str:
    """The SHA-256 the cache names the model's conversion after (a split's: of its parts' hashes listed)."""
    return _listing_sha([p.name for p in m.paths], list(m.sha256))


def _listing_sha(names: list[str], digests: list[str]) -> str:
    """What convert.sha256_files makes of files of these names and hashes: the one hash, or for several
    the SHA-256 of their "<sha256>  <name>" lines."""
    if len(digests) == 1:
        return digests[0]
    import hashlib

    listing = "".join(f"{d}  {n}\n" for n, d in sorted(zip(names, digests, strict=True)))
    return hashlib.sha256(listing.encode()).hexdigest()


def remove(m: HfModel) -> list[tuple[Path, int]]:
    """Removes the files barellm downloaded into the Hugging Face cache for a model, and its record; a file
    that was there before barellm fetched anything stays."""
    removed: list[tuple[Path, int]] = []
    if m.record is not None:
        try:
            files = json.loads(m.record.read_text())["files"]
        except (OSError, ValueError, KeyError):
            files = []
        for f in files:
            path = Path(f.get("path", ""))
            if f.get("downloaded") and path.is_file():
                size = path.stat().st_size
                _drop(path)
                removed.append((path, size))
        m.record.unlink(missing_ok=True)
    return removed
