"""Models from Ollama: its library, pulled from its registry, and the models a local Ollama already has.

Ollama keeps a model as a manifest naming content-addressed blobs:
    ROOT/manifests/HOST/NAMESPACE/NAME/TAG     JSON: {"layers": [{"mediaType", "digest", "size"}, ...]}
    ROOT/blobs/sha256-HEX                      a layer: the GGUF, the template, the params (JSON), ...
Its own store is $OLLAMA_MODELS (default ~/.ollama/models); barellm reads it in place and never writes or
removes anything there. What `barellm pull ollama:NAME[:TAG]` fetches goes to a store of the same layout in
barellm's home ($BARELLM_HOME/ollama), which `barellm rm` may clear.

The registry speaks the Docker registry protocol: GET {base}/v2/library/NAME/manifests/TAG (Accept: the
Docker v2 manifest type) and GET {base}/v2/library/NAME/blobs/sha256:HEX, every blob checked against its
digest. base is https://registry.ollama.ai unless $BARELLM_OLLAMA_REGISTRY names another (a full URL).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barellm.errors import BarellmError, ModelNotFound
from barellm.files import home, write_bytes_atomic
from barellm.store.sources.download import StatusReport, check_disk, fetch, mb, say

REGISTRY_ENV = "BARELLM_OLLAMA_REGISTRY"
DEFAULT_REGISTRY = "https://registry.ollama.ai"
REGISTRY_HOST = "registry.ollama.ai"   # where library models live in a store, whichever mirror served them
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
SYSTEM_LAYER = "application/vnd.ollama.image.system"
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*(?:/[a-z0-9][a-z0-9._-]*)?")
_TAG = re.compile(r"[a-z0-9][a-z0-9._-]*", re.IGNORECASE)
_MAX_MANIFEST = 1 << 20
_MAX_PARAMS = 1 << 16

# Ollama's parameters that barellm's generation options take under the same meaning
_OPTIONS = {"stop": "stop", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "num_predict": "max_tokens"}


@dataclass(frozen=True)
class Store:
    """An Ollama-layout model store. owned: barellm's own (it may remove what is there)."""

    root: Path
    owned: bool

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest.replace(":", "-")

    def manifest(self, host: str, namespace: str, name: str, tag: str) -> Path:
        return self.root / "manifests" / host / namespace / name / tag


def user_store() -> Store:
    """The local Ollama's store: $OLLAMA_MODELS, default ~/.ollama/models."""
    return Store(Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser(), False)


def own_store() -> Store:
    return Store(home() / "ollama", True)


def registry_base() -> str:
    return (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")


@dataclass(frozen=True)
class OllamaModel:
    """A model in an Ollama-layout store. name: as Ollama spells it (NAME:TAG for its library,
    NAMESPACE/NAME:TAG or HOST/NAMESPACE/NAME:TAG otherwise)."""

    name: str
    store: Store
    manifest: Path
    model: Path                 # the GGUF blob
    size: int                   # of every blob the manifest names
    layers: tuple[str, ...]     # their digests
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def options(self) -> dict[str, Any]:
        """The params layer's values that barellm's generation options take (stop strings, temperature,
        top_k, ...); num_ctx is the model's context, `context`."""
        out = {ours: self.params[theirs] for theirs, ours in _OPTIONS.items() if theirs in self.params}
        if isinstance(out.get("stop"), str):
            out["stop"] = [out["stop"]]
        if isinstance(self.params.get("num_ctx"), int):
            out["context"] = self.params["num_ctx"]
        return out


def display_name(host: str, namespace: str, name: str, tag: str) -> str:
    if host == REGISTRY_HOST:
        return f"{name}:{tag}" if namespace == "library" else f"{namespace}/{name}:{tag}"
    return f"{host}/{namespace}/{name}:{tag}"


def _read_json(path: Path, limit: int) -> Any:
    try:
        if path.stat().st_size > limit:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _layers(manifest: Any) -> list[dict[str, Any]] | None:
    """A manifest's layers, each with a valid digest and size; None for what is not an Ollama manifest."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
        return None
    layers = []
    for layer in manifest["layers"]:
        if not (isinstance(layer, dict) and isinstance(layer.get("digest"), str) and _DIGEST.fullmatch(layer["digest"])
                and isinstance(layer.get("size"), int) and layer["size"] >= 0):
            return None
        layers.append(layer)
    return layers


def _model_of(store: Store, manifest_path: Path, name: str, manifest: Any) -> OllamaModel | None:
    layers = _layers(manifest)
    if not layers:
        return None
    models = [la for la in layers if la.get("mediaType") == MODEL_LAYER]
    if len(models) != 1 or not store.blob(models[0]["digest"]).is_file():
        return None   # no weights, an adapter set, or a pull Ollama has not finished
    params: dict[str, Any] = {}
    for la in layers:
        if la.get("mediaType") == PARAMS_LAYER:
            read = _read_json(store.blob(la["digest"]), _MAX_PARAMS)
            params = read if isinstance(read, dict) else {}
    return OllamaModel(name, store, manifest_path, store.blob(models[0]["digest"]), sum(la["size"] for la in layers),
                       tuple(la["digest"] for la in layers), params)


def models_in(store: Store) -> list[OllamaModel]:
    """The runnable models of a store, by name."""
    top = store.root / "manifests"
    out = []
    try:
        paths = sorted(p for p in top.glob("*/*/*/*") if p.is_file() and not p.name.startswith("."))
    except OSError:
        return []
    for p in paths:
        host, namespace, name, tag = p.relative_to(top).parts
        m = _model_of(store, p, display_name(host, namespace, name, tag), _read_json(p, _MAX_MANIFEST))
        if m is not None:
            out.append(m)
    return out


def local_models() -> list[OllamaModel]:
    """Every model in the local Ollama's store and in barellm's own, one entry per name (the local Ollama's
    first: its copy costs barellm nothing)."""
    seen: set[str] = set()
    out = []
    for store in (user_store(), own_store()):
        for m in models_in(store):
            if m.name.lower() not in seen:
                seen.add(m.name.lower())
                out.append(m)
    return out


def _key(word: str) -> str:
    key = word.strip().lower().removeprefix("ollama:")
    key = key.removeprefix(f"{REGISTRY_HOST}/").removeprefix("library/")
    base, colon, tag = key.rpartition(":")
    return key if colon and base and "/" not in tag else f"{key}:latest"


def find(word: str) -> OllamaModel | None:
    """The stored model a word names (NAME, NAME:TAG, ollama:NAME:TAG; any case), or None."""
    if not word or any(c in word for c in "\0\n"):
        return None
    key = _key(word)
    return next((m for m in local_models() if m.name.lower() == key), None)


def of_path(path: Path) -> OllamaModel | None:
    """The stored model whose GGUF blob path is, or None."""
    try:
        resolved = path.resolve()
    except OSError:
        return None
    if not resolved.name.startswith("sha256-"):
        return None
    return next((m for m in local_models() if m.model.resolve() == resolved), None)


def _split(name: str, tag: str | None) -> tuple[str, str, str]:
    namespace, _, base = name.rpartition("/")
    namespace = namespace or "library"
    tag = tag or "latest"
    if not _NAME.fullmatch(name) or not _TAG.fullmatch(tag):
        raise ModelNotFound(f"ollama:{name}:{tag} is not an Ollama model name (NAME[:TAG], e.g. "
                            "ollama:qwen2.5-coder:1.5b)")
    return namespace, base, tag


def _get_manifest(namespace: str, name: str, tag: str) -> dict[str, Any]:
    import urllib.error  # here, not at the top: reading the stores (every load by name) needs no HTTP client
    import urllib.request

    url = f"{registry_base()}/v2/{namespace}/{name}/manifests/{tag}"
    request = urllib.request.Request(url, headers={"Accept": MANIFEST_TYPE})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body = response.read(_MAX_MANIFEST + 1)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ModelNotFound(f"ollama:{display_name(REGISTRY_HOST, namespace, name, tag)}: the Ollama registry "
                                f"({registry_base()}) has no such model or tag") from None
        raise BarellmError(f"the Ollama registry ({registry_base()}) answered {e.code} {e.reason} for {url}") from None
    except (urllib.error.URLError, OSError) as e:
        raise BarellmError(f"cannot reach the Ollama registry at {registry_base()}: "
                           f"{getattr(e, 'reason', e)} (${REGISTRY_ENV} sets another)") from None
    try:
        manifest = json.loads(body) if len(body) <= _MAX_MANIFEST else None
    except ValueError:
        manifest = None
    if _layers(manifest) is None or not any(la.get("mediaType") == MODEL_LAYER for la in manifest["layers"]):
        raise BarellmError(f"{url}: not an Ollama model manifest (no layer of type {MODEL_LAYER})")
    return manifest


def pull(name: str, tag: str | None = None, *, quiet: bool = False, on_status: StatusReport | None = None,
         convert: bool = True) -> OllamaModel:
    """Fetches a model of Ollama's library into barellm's own store (a no-op when the local Ollama or an
    earlier pull has it), then converts its GGUF once into the model cache."""
    def status(text: str, **more: Any) -> None:
        if on_status is not None:
            on_status({"status": text, **more})

    namespace, base, tag = _split(name, tag)
    shown = display_name(REGISTRY_HOST, namespace, base, tag)
    found = find(shown)
    if found is not None:
        where = "the local Ollama's store" if not found.store.owned else "barellm's store"
        converted = _conversion_of(found) is not None
        say(f"{shown}: already in {where} ({found.store.root}); nothing to download"
            + ("" if converted or not convert else f"; its conversion writes about {mb(found.size)} to "
               f"{home() / 'blm'}: the model is then on disk twice"), quiet)
        if convert and not converted:
            check_disk(home() / "blm", found.size, f"{shown}'s conversion")
        if convert:
            _convert(found, quiet)
        return found
    status("pulling manifest")
    manifest = _get_manifest(namespace, base, tag)
    store = own_store()
    layers = manifest["layers"]
    missing = [la for la in layers if not store.blob(la["digest"]).is_file()]
    weights = next(la for la in layers if la.get("mediaType") == MODEL_LAYER)
    download = sum(la["size"] for la in missing)
    from barellm.store.converted import converted_path

    converted = converted_path(weights["digest"].removeprefix("sha256:")).is_file()
    conversion = weights["size"] if convert and not converted else 0
    blobs = store.root / "blobs"
    check_disk(blobs, download + conversion, f"ollama:{shown}")
    say(f"ollama:{shown}: writes {mb(download)} to {blobs}"
        + (f", then about {mb(conversion)} to {home() / 'blm'} (its conversion: the model is on disk twice)"
           if conversion else ""), quiet)
    blobs.mkdir(parents=True, exist_ok=True)
    base_url = f"{registry_base()}/v2/{namespace}/{base}/blobs"
    for la in missing:
        digest = la["digest"]
        kind = str(la.get("mediaType", "")).rpartition(".")[2] or "layer"
        fetch(f"{base_url}/{digest}", store.blob(digest), sha256=digest.removeprefix("sha256:"), size=la["size"],
              label=f"pulling {kind} {digest[7:19]}", quiet=quiet or la.get("mediaType") != MODEL_LAYER,
              on_status=on_status)   # a bar for the weights; the template's or params' few bytes need none
    status("verifying sha256 digest")
    status("writing manifest")
    path = store.manifest(REGISTRY_HOST, namespace, base, tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, json.dumps(manifest).encode())
    pulled = _model_of(store, path, shown, manifest)
    assert pulled is not None
    if convert:
        _convert(pulled, quiet)
    return pulled


def _conversion_of(m: OllamaModel) -> Path | None:
    from barellm.store import converted

    path = converted.converted_path(m.model.name.removeprefix("sha256-"))
    return path if path.is_file() else None


def _convert(m: OllamaModel, quiet: bool) -> None:
    from barellm.store import converted

    if _conversion_of(m) is None:
        converted.open_cached(m.model, sha256=m.model.name.removeprefix("sha256-"), progress=not quiet).close()


def remove(m: OllamaModel) -> list[tuple[Path, int]]:
    """Removes a model barellm pulled from its own store: the manifest, and the blobs no other manifest there
    names. A model of the local Ollama's store is refused: barellm never deletes Ollama's files."""
    if not m.store.owned:
        raise BarellmError(f"{m.name} is in the local Ollama's store ({m.store.root}): barellm does not remove "
                           f"Ollama's files; `ollama rm {m.name}` does")
    others = {d for o in models_in(m.store) if o.manifest != m.manifest for d in o.layers}
    removed: list[tuple[Path, int]] = []
    size = m.manifest.stat().st_size
    m.manifest.unlink()
    removed.append((m.manifest, size))
    for digest in m.layers:
        blob = m.store.blob(digest)
        if digest not in others and blob.is_file():
            size = blob.stat().st_size
            blob.unlink()
            removed.append((blob, size))
    return removed
