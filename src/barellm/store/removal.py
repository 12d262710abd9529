"""Removing a model from barellm's cache: what `barellm rm` and the server's DELETE /api/delete share. A
registered model's pulled file, manifest and conversion go here; a user's own file's conversion and what
barellm fetched from a local Ollama or the Hugging Face cache, through catalog (remove_local, remove_outside),
which this dispatches to."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from barellm.errors import BarellmError, InvalidRequest, ModelNotFound


def _converted(spec: Any, model_file: Path | None) -> Path | None:
    """The cached .blm of a registered model: as the cache's index records it, or by its content's name
    (the cache names a conversion after its source's SHA256, which a registered model's file must have)."""
    from barellm.store.converted import cache_dir, conversion_of

    if model_file is not None and model_file.is_file():
        found = conversion_of(model_file)
        if found is not None:
            return found
    by_hash = cache_dir() / f"{spec.sha256}.blm"
    return by_hash if by_hash.is_file() else None


def remove_model(name: str) -> list[tuple[Path, int]]:
    """Removes a registered model's files from the cache; returns what it removed, with sizes.

    The model's directory is first renamed to a temporary name, in one step: from then on the model is not
    cached, for this process and any other. A removal killed part-way leaves only names the next `rm`
    (files.remove_stale_temps) clears, and a converted .blm with no model file, which `rm` also takes.
    A process still running the model keeps its memory-mapped copy until it exits.
    """
    from barellm.files import fsync_dir, home, remove_stale_temps, temp_path
    from barellm.store import catalog, hub
    from barellm.store.converted import cache_dir

    canonical = hub.registered_name(name) or name
    outside = catalog.remove_outside(name)   # a model of a local Ollama or the Hugging Face cache
    if outside is not None:
        return outside
    if canonical not in hub.REGISTRY:
        local = catalog.of_path(name) if hub.exists(name) else catalog.find_local(name)
        if local is not None:
            return catalog.remove_local(local)   # the cache's conversion; the user's own file stays
        if hub.exists(name):
            raise InvalidRequest(f"{name}: not a model in barellm's cache (it was never converted, or already "
                                 "removed); rm only deletes what barellm itself put in its cache")
        raise ModelNotFound(f"unknown model {name!r} (known: {', '.join(catalog.known_names())})")
    spec = hub.REGISTRY[canonical]
    models = home() / "models"
    model_dir = models / spec.name
    remove_stale_temps(models)   # what an earlier, killed rm left
    if model_dir.is_dir():
        remove_stale_temps(model_dir)
        busy = [p.name for p in model_dir.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        if busy:
            raise BarellmError(f"{canonical}: a pull is writing into {model_dir} ({busy[0]}); try again when it ends")
    model_file = model_dir / spec.filename
    blm = _converted(spec, model_file)
    index = [p for p in (cache_dir() / "index").glob("*.json") if _indexes(p, model_file)]
    if not model_dir.is_dir() and blm is None:
        raise ModelNotFound(f"model {canonical!r} is not cached; nothing to remove")
    removed: list[tuple[Path, int]] = []
    if model_dir.is_dir():
        size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
        doomed = temp_path(model_dir)
        os.replace(model_dir, doomed)
        fsync_dir(models)
        removed.append((model_file, size))
        shutil.rmtree(doomed, ignore_errors=True)
    if blm is not None:
        size = blm.stat().st_size
        blm.unlink(missing_ok=True)
        removed.append((blm, size))
    for p in index:
        p.unlink(missing_ok=True)
    return removed


def _indexes(entry: Path, model_file: Path) -> bool:
    """Whether a cache index entry records `model_file` as its source."""
    import json

    try:
        return json.loads(entry.read_text()).get("source") == str(model_file.resolve())
    except (OSError, ValueError, AttributeError):
        return False
