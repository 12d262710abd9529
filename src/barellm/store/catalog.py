"""Every model the cache holds, by name: the registered models a pull fetched (hub.REGISTRY), and the
conversions of a user's own GGUF files, which loading one by path writes into the cache.

A conversion is stored as blm/<sha256 of its source>.blm: that hash is the cache's internal file name, never
what a user types or reads. A user's conversion goes by the name of the file it came from, without its
extension (my-model.Q4_0.gguf: `my-model.Q4_0`), and by the model's own `general.name`; `barellm list` shows
it, and `run`, `chat`, `serve`, `bench`, `perplexity` and `rm` take that name (or the original path).
Two conversions of different files with one name: the later ones get their hash's first 8 digits added
(`my-model-1a2b3c4d`), so every name stays unique.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barellm.errors import InvalidRequest, ModelNotFound
from barellm.store import hub, names
from barellm.store.names import normalize

_HASH_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class LocalModel:
    """A conversion of a user's own model file in the cache."""

    name: str                 # what `barellm list` shows: the source file's name without its extension
    general_name: str | None  # the model's own name (its metadata's general.name), another name for it
    path: Path                # the cache's .blm
    sha256: str               # of the source file: the .blm's internal name
    size: int
    source: str               # the file it was converted from, by name
    instruct: bool
    mtime: float

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that resolves to this model (compared case-insensitively)."""
        out = [self.name, self.source, Path(self.source).stem]
        if self.general_name:
            out.append(self.general_name)
        return tuple(dict.fromkeys(out))


# header reads, by (path, size, mtime): a conversion's header is parsed once per process
_headers: dict[tuple[str, int, int], tuple[str, str, str | None, bool] | None] = {}


def _header(path: Path) -> tuple[str, str, str | None, bool] | None:
    """(source sha256, source file name, general.name, instruct) of a cached conversion; None if unreadable."""
    from barellm.errors import BarellmError
    from barellm.formats import blm

    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _headers:
        return _headers[key]
    note = _note_path(path)
    try:   # what an earlier read of this conversion noted: no header to parse (a large vocabulary takes a while)
        n = json.loads(note.read_text())
        if n.get("size") == st.st_size and n.get("mtime_ns") == st.st_mtime_ns:
            _headers[key] = out = (n["sha256"], n["source"], n["general_name"], bool(n["instruct"]))
            return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    out = None
    try:
        with blm.BLMFile(path, prefetch=False) as f:
            p, md = f.provenance, f.metadata
            template = md.get("tokenizer.chat_template")
            general = md.get("general.name")
            out = (str(p.get("source.sha256", "")), str(p.get("source.name", path.name)),
                   general.strip() if isinstance(general, str) and general.strip() else None,
                   isinstance(template, str) and bool(template.strip()))
    except (BarellmError, OSError, ValueError):
        out = None
    _headers[key] = out
    if out is not None:
        from barellm.files import write_bytes_atomic

        try:
            note.parent.mkdir(exist_ok=True)
            write_bytes_atomic(note, json.dumps({"sha256": out[0], "source": out[1], "general_name": out[2],
                                                 "instruct": out[3], "size": st.st_size,
                                                 "mtime_ns": st.st_mtime_ns}).encode())
        except OSError:
            pass   # a read-only cache: the header is parsed again next time
    return out


def _note_path(blm_path: Path) -> Path:
    """Where the names of a user's conversion are noted: blm/names/<sha256>.json beside blm/index."""
    return blm_path.parent / "names" / f"{blm_path.stem}.json"


def _registered_hashes() -> dict[str, str]:
    return {spec.sha256: name for name, spec in hub.REGISTRY.items()}


def _stem(file_name: str) -> str:
    stem = Path(file_name).name
    for ext in (".gguf", ".blm", ".safetensors"):
        if stem.lower().endswith(ext):
            return stem[: -len(ext)]
    return stem


def local_models() -> list[LocalModel]:
    """The user's own conversions in the cache, oldest first, each under a unique name."""
    from barellm.store.converted import cache_dir

    directory = cache_dir()
    if not directory.is_dir():
        return []
    registered = _registered_hashes()
    elsewhere = source_hashes()   # conversions of Ollama's and Hugging Face's files go by those models' names
    taken = {n.lower() for n in (*hub.REGISTRY, *hub.ALIASES)}
    found = []
    for path in directory.glob("*.blm"):
        if not _HASH_NAME.fullmatch(path.stem) or path.stem in registered or path.stem in elsewhere:
            continue
        head = _header(path)
        if head is None or head[0] != path.stem:
            continue
        st = path.stat()
        found.append((st.st_mtime, path, st.st_size, head))
    out = []
    for mtime, path, size, (sha, source, general, instruct) in sorted(found, key=lambda t: (t[0], t[1].name)):
        name = _stem(source) or sha[:8]
        if name.lower() in taken:
            name = f"{name}-{sha[:8]}"
        taken.add(name.lower())
        if general is not None and general.lower() in taken:
            general = None   # a general.name another model goes by already is no name for this one
        elif general is not None:
            taken.add(general.lower())
        out.append(LocalModel(name, general, path, sha, size, source, instruct, mtime))
    return out


def find_local(word: str) -> LocalModel | None:
    """The user's conversion a name stands for (any of its names, any case, ":latest" allowed), or None."""
    if not word or any(c in word for c in "\0\n"):
        return None
    key = word.strip().lower().removesuffix(":latest")
    models = local_models()
    for m in models:   # the listed name first: it is unique, where a file name may not be
        if m.name.lower() == key:
            return m
    for m in models:
        if key in (n.lower() for n in m.names):
            return m
    return None


def of_path(path: str | Path) -> LocalModel | None:
    """The user's conversion a file stands for: the cached .blm itself, or a source file the cache's index
    records as converted."""
    from barellm.store.converted import cache_dir, conversion_of

    p = Path(path).expanduser()
    try:
        if p.suffix == ".blm" and p.resolve().parent == cache_dir().resolve():
            blm = p.resolve()
        elif p.is_file():
            found = conversion_of(p)
            if found is None:
                return None
            blm = found.resolve()
        else:
            return None
    except OSError:
        return None
    for m in local_models():
        if m.path.resolve() == blm:
            return m
    return None


def remove_local(m: LocalModel) -> list[tuple[Path, int]]:
    """Removes a user's conversion from the cache: the .blm and every index entry that points to it (the
    source file, wherever it is, stays). Returns what was removed, with sizes."""
    return remove_conversion(m.sha256)


def remove_conversion(sha256: str) -> list[tuple[Path, int]]:
    """Removes the cache's conversion of the source whose SHA-256 is sha256: the .blm and every index entry
    that points to it (the source stays). Returns what was removed, with sizes."""
    from barellm.store.converted import cache_dir, converted_path

    removed: list[tuple[Path, int]] = []
    for entry in (cache_dir() / "index").glob("*.json"):
        try:
            sha = json.loads(entry.read_text()).get("sha256")
        except (OSError, ValueError, AttributeError):
            continue
        if sha == sha256:
            entry.unlink(missing_ok=True)
    path = converted_path(sha256)
    if path.is_file():
        size = path.stat().st_size
        path.unlink()
        removed.append((path, size))
    _note_path(path).unlink(missing_ok=True)
    _headers.clear()
    return removed


@dataclass(frozen=True)
class Listed:
    """A row of `barellm list`: a model and where it comes from. source: "catalogue" (barellm's own list),
    "ollama" (a local Ollama's store, or barellm's pull from Ollama's registry), "huggingface" (the Hugging
    Face cache), "own" (a user's file converted into the cache). paths: its files on disk, the GGUF and
    the conversion; owned: whether barellm wrote the GGUF (rm may remove it)."""

    name: str
    source: str
    instruct: bool | None
    paths: tuple[Path, ...]
    state: str            # "converted", "gguf", "converted, gguf", "no"
    description: str
    owned: bool

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in self.paths if p.is_file())


def _gguf_instruct(path: Path) -> bool | None:
    from barellm.errors import BarellmError
    from barellm.formats.gguf import GGUFFile

    try:
        g = GGUFFile(path)
    except (BarellmError, OSError, ValueError):
        return None
    try:
        return hub.is_instruct(g.metadata)
    finally:
        g.close()


def _outside(name: str, source: str, gguf: Path, sha256: str, owned: bool, description: str) -> Listed:
    from barellm.store.converted import converted_path

    blm = converted_path(sha256)
    converted = blm.is_file()
    head = _header(blm) if converted else None
    instruct = head[3] if head is not None else _gguf_instruct(gguf)
    return Listed(name, source, instruct, (gguf, blm) if converted else (gguf,),
                  "converted, gguf" if converted else "gguf", description, owned)


def listing() -> list[Listed]:
    """Every model barellm can run by name, from every source: the catalogue (pulled or not), the Ollama
    stores, the Hugging Face cache, the user's own conversions."""
    from barellm.store.converted import converted_path
    from barellm.store.sources import huggingface, ollama

    out = []
    for name, spec in sorted(hub.REGISTRY.items()):
        gguf = hub.gguf_path(name)
        cached = hub.cached_path(name)
        blm = cached if cached is not None and cached != gguf else None
        if blm is None and converted_path(spec.sha256).is_file():
            blm = converted_path(spec.sha256)   # a conversion by an older converter: on disk all the same
        state = ", ".join(w for w, p in (("converted", blm), ("gguf", gguf)) if p is not None) or "no"
        out.append(Listed(name, "catalogue", spec.instruct, tuple(p for p in (blm, gguf) if p is not None), state,
                          spec.description, True))
    for m in ollama.local_models():
        where = "pulled by barellm" if m.store.owned else f"the local Ollama's store, {m.store.root}"
        out.append(_outside(m.name, "ollama", m.model, m.model.name.removeprefix("sha256-"), m.store.owned,
                            f"Ollama, {where}"))
    for h in huggingface.cached_models():
        where = "fetched by barellm" if h.owned else "the Hugging Face cache"
        out.append(_outside(h.name, "huggingface", h.path, huggingface.conversion_sha(h), h.owned,
                            f"Hugging Face, {where}, {h.path.parent}"))
        if len(h.paths) > 1:   # a split: its other parts are on disk too
            row = out.pop()
            out.append(Listed(row.name, row.source, row.instruct, row.paths + h.paths[1:], row.state,
                              row.description, row.owned))
    for m in local_models():
        about = f"{m.general_name}, " if m.general_name else ""
        out.append(Listed(m.name, "own", m.instruct, (m.path,), "converted", f"{about}converted from {m.source}",
                          True))
    from barellm.store import presets

    for p in presets.all_presets():
        about = f"FROM {p.base}" + (", a system prompt" if p.system else "") + (
            f", {len(p.parameters)} parameter(s)" if p.parameters else "")
        instruct = next((r.instruct for r in out if r.name.lower() == normalize(p.base)), None)   # its model's
        out.append(Listed(p.name, "preset", instruct, (), "-", about, True))
    return out


def source_hashes() -> dict[str, str]:
    """The SHA-256 of each model file an outside store holds (an Ollama blob's name is its hash), to the
    model's name: what their conversions in the cache are named after."""
    from barellm.store.sources import huggingface, ollama

    out = {m.model.name.removeprefix("sha256-"): m.name for m in ollama.local_models()}
    out.update({huggingface.conversion_sha(m): m.name for m in huggingface.cached_models()})
    return out


def outside_models() -> list[tuple[str, Path, tuple[str, ...]]]:
    """(name, the file to load, every name it goes by) of each model in an Ollama store or the Hugging Face
    cache: what a server serves beside the cache's own."""
    from barellm.store.sources import huggingface, ollama

    out = []
    for m in ollama.local_models():
        more = (m.name.removesuffix(":latest"), f"ollama:{m.name}")
        out.append((m.name, m.model, (m.name, *more)))
    for h in huggingface.cached_models():
        out.append((h.name, h.path, (h.name, f"hf://{h.repo}:{h.quant}", f"{h.repo}:{h.quant}")))
    return out


def options_of(path: str | Path) -> dict[str, Any]:
    """The generation defaults a model's source states for it (an Ollama model's params layer: stop
    strings, temperature, ..., `context` for num_ctx); empty for a model that states none."""
    from barellm.store.sources import ollama

    m = ollama.of_path(Path(path))
    return m.options if m is not None else {}


def display_name(path: str | Path) -> str:
    """The name to print for a model file: its registered name (the cache's conversion of a registered
    model, or its pulled GGUF), the name of a user's conversion, else the file's name without extension."""
    p = Path(path)
    registered = _registered_hashes()
    if p.stem in registered:
        return registered[p.stem]
    from barellm.store.sources import huggingface

    for h in huggingface.recorded():
        if p in h.paths:
            return h.name
    if p.name.startswith("sha256-") or _HASH_NAME.fullmatch(p.stem):
        outside = source_hashes().get(p.name.removeprefix("sha256-") if p.name.startswith("sha256-") else p.stem)
        if outside is not None:
            return outside
    for name, spec in hub.REGISTRY.items():
        if p.name == spec.filename and p.parent.name == name:
            return name
    if _HASH_NAME.fullmatch(p.stem):
        head = _header(p)
        if head is not None:
            for m in local_models():
                if m.sha256 == p.stem:
                    return m.name
            return _stem(head[1])
    return _stem(p.name)


# --- names over everything: the registry's (hub) and the user's own models ---------------------------

def known_names() -> list[str]:
    """Every model name a command takes: the registered ones, the user's own models in the cache, then
    the models of the Ollama stores."""
    from barellm.store import presets
    from barellm.store.sources import huggingface, ollama

    return [*sorted(hub.REGISTRY), *(m.name for m in local_models()), *(m.name for m in ollama.local_models()),
            *(m.name for m in huggingface.cached_models()), *(p.name for p in presets.all_presets())]


def is_known(word: str) -> bool:
    """Whether a word names a model without being a path: a registered name or alias (any case, with a
    ":latest" or size tag), or one's own model."""
    from barellm.store import presets
    from barellm.store.sources import ollama

    return (hub.registered_name(word) is not None or find_local(word) is not None or ollama.find(word) is not None
            or presets.find(word) is not None)


def close_names(word: str) -> list[str]:
    """The known names and aliases `word` is most likely a misspelling of, best first (maybe none)."""
    names = [*hub.REGISTRY, *hub.ALIASES, *(m.name for m in local_models())]
    return difflib.get_close_matches(normalize(word), names, n=3, cutoff=0.8)


def looks_like_model(word: str) -> bool:
    """Whether a word is meant as a model, whether or not it resolves: a known name, a word shaped like a
    model reference (names.looks_like_model), or a near miss of a known name."""
    if not word or word == "-":
        return False
    if names.looks_like_model(word) or is_known(word):
        return True
    return not any(c.isspace() for c in word) and bool(close_names(word))


def unknown_model(target: str) -> ModelNotFound:
    """The error for a model reference that resolves to nothing: one line naming the known models (one's
    own among them), and the closest of them when the reference looks like a misspelling of one."""
    close = close_names(target)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ModelNotFound(f"{target!r} is neither a file nor a known model{hint} (known: {', '.join(known_names())})")


def can_resolve(word: str) -> bool:
    """Whether a model reference stands for something without anything fetched yet, or can be fetched: an
    existing file, a known name (a registered one not yet pulled is pulled by loading it), or a Hugging
    Face or Ollama reference (pulled by loading it)."""
    return names.exists(word) or is_known(word) or names.parse(word).kind in ("huggingface", "ollama")


def resolve(name_or_path: str | os.PathLike[str] | None = None, *, pull_missing: bool = True) -> Path:
    """The file a model reference stands for (see store/names.py for the shapes): a registered model (pulled
    first when it is not cached and pull_missing), one's own model by name, or a file."""
    target = os.fspath(name_or_path) if name_or_path is not None else hub.DEFAULT_MODEL
    if names.exists(target):
        return Path(target).expanduser()
    from barellm.store.sources import huggingface, ollama

    ref = names.parse(target)
    if ref.kind == "name":
        from barellm.store import presets

        preset = presets.find(target)   # a preset resolves to its model (load() adds its settings)
        if preset is not None:
            return resolve(preset.base, pull_missing=pull_missing)
    if ref.kind == "huggingface":
        found = huggingface.find(ref.name, ref.tag) or huggingface.adopt(ref.name, ref.tag)
        if found is not None:
            return _before_conversion(found.name, found.paths, huggingface.conversion_sha(found))
        if not pull_missing:
            raise ModelNotFound(f"{target} is not pulled; run `barellm pull {target}`")
        return huggingface.pull(ref.name, ref.tag).path
    if ref.kind == "path" and names.is_repo(target):
        raise ModelNotFound(f"{target!r} is neither a file nor a known model; for the Hugging Face repository, "
                            f"name it hf.co/{target}[:QUANT]")
    if ref.kind == "ollama":
        stored = ollama.find(target)
        if stored is not None:
            return _before_conversion(stored.name, (stored.model,), stored.model.name.removeprefix("sha256-"))
        if not pull_missing:
            raise ModelNotFound(f"{target} is not pulled; run `barellm pull {target}`")
        return ollama.pull(ref.name, ref.tag).model
    if ref.kind == "name":
        registered = hub.registered_name(target)
        if registered is not None and hub.cached_path(registered) is not None:
            return hub.resolve(registered, pull_missing=pull_missing)
        stored = ollama.find(target)   # a model the local Ollama has (qwen2.5-coder:1.5b): no download
        if stored is not None:
            return _before_conversion(stored.name, (stored.model,), stored.model.name.removeprefix("sha256-"))
        local = find_local(target)
        if local is not None:
            return local.path
        if registered is not None:
            return hub.resolve(registered, pull_missing=pull_missing)
    raise unknown_model(target)


def create_preset(name: str, base: str, *, system: str | None = None, parameters: dict[str, Any] | None = None,
                  template: str | None = None) -> Any:
    """Stores a preset (store/presets.py) and returns it: its model must resolve (a catalogue name not yet
    pulled is fine: running it pulls it), and its name must be no other model's."""
    from barellm.store import presets

    key = presets.check_name(name)
    base = presets.check_base(base)
    if not can_resolve(base):
        raise unknown_model(base)
    if presets.find(key) is None and is_known(key):
        raise InvalidRequest(f"{name!r} is the name of a model already; a preset needs a name of its own")
    return presets.save(key, base, system=system, parameters=parameters, template=template)


def outside_target(word: str) -> Any:
    """The model of an outside store a reference means for `rm`, as resolving it finds it (an
    huggingface.HfModel or an ollama.OllamaModel), or None: a catalogue name that is pulled means the
    catalogue's model."""
    from barellm.files import home
    from barellm.store.sources import huggingface, ollama

    ref = names.parse(word)
    if ref.kind == "huggingface":
        found = huggingface.find(ref.name, ref.tag) or next(
            (m for m in huggingface.cached_models() if m.repo.lower() == ref.name.lower()
             and (ref.tag is None or m.quant.lower() == ref.tag.lower())), None)
        if found is None:
            raise ModelNotFound(f"{word}: not in the Hugging Face cache; nothing to remove")
        return found
    registered = hub.registered_name(word)
    if registered is not None and (hub.cached_path(registered) is not None
                                   or (home() / "models" / registered).is_dir()):
        return None
    return ollama.find(word)


def barellm_fetched(target: Any) -> bool:
    """Whether barellm fetched an outside model's files itself (so that `rm` removes them)."""
    from barellm.store.sources import ollama

    return target.store.owned if isinstance(target, ollama.OllamaModel) else bool(target.owned)


def where(target: Any) -> str:
    from barellm.store.sources import ollama

    if isinstance(target, ollama.OllamaModel):
        return f"the local Ollama's store ({target.store.root})" if not target.store.owned else str(target.store.root)
    return f"the Hugging Face cache ({target.path.parent})"


def remove_outside(word: str) -> list[tuple[Path, int]] | None:
    """Removes what barellm wrote for a model of an outside store: its conversion, and the files barellm
    fetched itself (a pull from Ollama's registry, a Hugging Face download, their records). Never a file of
    a local Ollama's store or of the Hugging Face cache that barellm did not fetch: with nothing of barellm's
    to remove, that is an error that says so. Returns what was removed, with sizes; None: the reference
    means no outside model."""
    from barellm.errors import InvalidRequest
    from barellm.store.sources import huggingface, ollama

    target = outside_target(word)
    if target is None:
        return None
    if isinstance(target, ollama.OllamaModel):
        files = remove_conversion(target.model.name.removeprefix("sha256-"))
        if target.store.owned:
            files += ollama.remove(target)
        hint = f"`ollama rm {target.name}`"
    else:
        files = remove_conversion(huggingface.conversion_sha(target)) + huggingface.remove(target)
        hint = "`hf cache delete`"
    if not files and not barellm_fetched(target):
        raise InvalidRequest(f"{target.name} is in {where(target)}, and barellm wrote nothing for it; barellm "
                             f"never removes files it did not write ({hint} does)")
    return files


def _before_conversion(name: str, files: tuple[Path, ...], sha256: str) -> Path:
    """The file to load of a model from an outside store, once the disk is known to hold its conversion:
    the first load converts it into the cache, a second copy of the model, which is said first."""
    import sys

    from barellm.store.converted import converted_path
    from barellm.store.sources.download import check_disk, mb

    if not converted_path(sha256).is_file():
        size = sum(f.stat().st_size for f in files)
        check_disk(converted_path(sha256).parent, size, f"{name}'s conversion")
        print(f"barellm: {name} is converted once into {converted_path(sha256).parent} (about {mb(size)}): the "
              "model is then on disk twice (`barellm rm` frees the conversion)", file=sys.stderr)
    return files[0]


def pull(word: str, *, quiet: bool = False, keep_gguf: bool = False,
         on_status: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Fetches a model by reference into the caches, and returns the file barellm loads it from: a
    registered name from the catalogue (hub.pull), ollama:NAME[:TAG] from Ollama's registry."""
    from barellm.store.sources import huggingface, ollama

    ref = names.parse(word)
    if ref.kind == "ollama":
        return ollama.pull(ref.name, ref.tag, quiet=quiet, on_status=on_status).model
    if ref.kind == "huggingface":
        return huggingface.pull(ref.name, ref.tag, quiet=quiet, on_status=on_status).path
    registered = hub.registered_name(word) if ref.kind == "name" else None
    if registered is not None:
        return hub.pull(registered, quiet=quiet, keep_gguf=keep_gguf, on_status=on_status)
    stored = ollama.find(word) if ref.kind == "name" else None
    if stored is not None:
        return stored.model
    close = close_names(word)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ModelNotFound(f"unknown model {word!r}{hint} (known: {', '.join(sorted(hub.REGISTRY))}; or pull "
                        f"ollama:NAME[:TAG] from Ollama's library, hf.co/ORG/REPO[:QUANT] from Hugging Face)")
