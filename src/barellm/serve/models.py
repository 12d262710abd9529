"""The models one server serves, and their lifecycle: which it can load (every model in the cache, by every
name it goes by), which are loaded, and when one is let go.

A request names its model (any name `barellm list` shows, an alias, the file's own name, with or without
Ollama's ":latest"); a model not loaded yet is loaded then, in a worker thread, while other requests for it
wait for that same load. After its last request a model stays loaded for its keep-alive (default 5 minutes,
as Ollama: the request's `keep_alive` sets it, 0 unloads it at once, a negative value keeps it loaded), then
it is unloaded. Loading one more than the budget allows (`--max-loaded`, `--max-memory`) first unloads the
least recently used model that has no request in flight; when every loaded model is busy, the load waits
for one to finish. A generation is never cut by an unload: a model in use is never chosen.

Every request holds a Lease on its model from before its prompt is tokenized until its response has been
sent (or failed); the lease count is what "in use" means.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barellm.serve.errors import ApiError

DEFAULT_KEEP_ALIVE = 300.0   # seconds, as Ollama
DEFAULT_MAX_LOADED = 3       # as Ollama on a CPU

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any, what: str = "keep_alive") -> float | None:
    """Ollama's keep_alive as seconds, None for "never unload": a number of seconds, or a duration string
    such as "5m", "1h30m", "90s", "0" (Go's syntax; a bare number is seconds); negative: never."""
    if isinstance(value, bool):
        raise ApiError(400, f"{what}: expected a number of seconds or a duration such as \"5m\", got {value!r}",
                       param=what)
    if isinstance(value, (int, float)):
        if value != value:
            raise ApiError(400, f"{what}: NaN is not a duration", param=what)
        return None if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ApiError(400, f"{what}: {value!r} is not a duration (examples: \"5m\", \"1h30m\", \"30s\", "
                                    "0, -1)", param=what) from None
            seconds = sum(float(n) * _UNIT[u] for n, u in parts)
        if seconds != seconds or seconds == float("inf"):
            raise ApiError(400, f"{what}: {value!r} is not a finite duration", param=what)
        return None if sign < 0 and seconds > 0 else seconds
    raise ApiError(400, f"{what}: expected a number of seconds or a duration such as \"5m\", got {value!r}",
                   param=what)


def parse_bytes(text: str) -> int:
    """A memory size: bytes, or with a unit K, M, G, T (powers of 1024; KB, MiB, GB... read the same)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (examples: 2G, 512M, 3000000000)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


@dataclass(frozen=True)
class Candidate:
    """A model the server can serve: the name it is listed by, the file it loads from, its other names."""

    name: str
    path: Path
    names: frozenset[str]   # lower case, every name a request may use
    size: int
    modified: float
    fixed: bool = False     # an in-memory model handed to create_app: never unloaded, never reloaded
    preset: str | None = None   # a preset's name (store/presets.py): loaded by it, with its system and defaults

    def answers(self, key: str) -> bool:
        return key in self.names


def cache_candidates(extra: Iterable[tuple[str, Path]] = (), aliases: dict[str, str] | None = None
                     ) -> list[Candidate]:
    """Every model the cache holds (registered models pulled, the user's own conversions), and the extra
    (name, path) pairs (models given by path on the command line); aliases: more names, name -> model."""
    from barellm.store import catalog, hub

    out: list[Candidate] = []
    seen: dict[Path, int] = {}

    def add(name: str, path: Path, more: Iterable[str]) -> None:
        try:
            st = path.stat()
            resolved = path.resolve()
        except OSError:
            return
        names = {n.lower() for n in (name, path.name, path.stem, *more) if n}
        if resolved in seen:   # a model given at start and found in the cache: one, by all its names
            c = out[seen[resolved]]
            out[seen[resolved]] = Candidate(c.name, c.path, c.names | names, c.size, c.modified)
            return
        seen[resolved] = len(out)
        out.append(Candidate(name, path, frozenset(names), st.st_size, st.st_mtime))

    from barellm.errors import BarellmError
    from barellm.store import presets

    for name, path in extra:
        if presets.find(name) is None:   # a preset named at start is listed below, as a preset
            add(name, path, ())
    for name in sorted(hub.REGISTRY):
        path = hub.cached_path(name)
        if path is not None:
            spec = hub.REGISTRY[name]
            add(name, path, [a for a, target in hub.ALIASES.items() if target == name] +
                [spec.filename, Path(spec.filename).stem])
    for m in catalog.local_models():
        add(m.name, m.path, m.names)
    for name, path, more in catalog.outside_models():   # the Ollama stores', the Hugging Face cache's
        add(name, path, more)
    taken = {n for c in out for n in c.names}
    for p in presets.all_presets():   # a preset shares its model's file: a candidate of its own all the same
        if p.name in taken:
            continue
        try:
            path = catalog.resolve(p.base, pull_missing=False)
            st = path.stat()
        except (BarellmError, OSError):
            continue
        out.append(Candidate(p.name, path, frozenset({p.name}), st.st_size, st.st_mtime, preset=p.name))
    if aliases:
        by_name = {c.name.lower(): i for i, c in enumerate(out)}
        for alias, target in aliases.items():
            i = by_name.get(target.lower())
            if i is not None:
                c = out[i]
                out[i] = Candidate(c.name, c.path, c.names | {alias.lower()}, c.size, c.modified, c.fixed, c.preset)
    return out


def _key(name: str) -> str:
    key = name.strip().lower()
    return key[: -len(":latest")] if key.endswith(":latest") else key


@dataclass(eq=False)
class Loaded:
    """A loaded model: its serving state (model, scheduler), and what its lifecycle needs."""

    candidate: Candidate
    state: Any
    memory: int                     # bytes it takes: its file (mapped) and its KV caches
    load_seconds: float
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = DEFAULT_KEEP_ALIVE
    expires_at: float | None = None     # wall clock (time.time()), None: not while in use, or never
    _timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.candidate.name


class Lease:
    """A request's hold on a loaded model; release() (once, idempotent) lets the model go idle."""

    def __init__(self, models: Models, loaded: Loaded, load_seconds: float) -> None:
        self.models = models
        self.loaded = loaded
        self.state = loaded.state
        self.load_seconds = load_seconds   # what this request waited for the model to load
        self.keep_alive: float | None = loaded.keep_alive
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.models._release(self)


def memory_of(state: Any, file_size: int) -> int:
    """What a loaded model takes: its mapped file, and its engine's KV cache arrays."""
    engine = getattr(getattr(state, "model", None), "engine", None)
    kv = 0
    for attr in ("k_cache", "v_cache"):
        kv += int(getattr(getattr(engine, attr, None), "nbytes", 0) or 0)
    return file_size + kv


class Models:
    """The server's models: resolves names, loads on demand, unloads after keep-alive or for room.

    catalog: the models that can be served (called again when a name is not found: the cache changes);
    load: builds a started ServerState for a candidate (runs in a worker thread); unload: stops one
    (also in a worker thread); default: the model a request that names none gets.
    All methods run on the event loop."""

    def __init__(self, catalog: Callable[[], list[Candidate]], load: Callable[[Candidate], Any] | None,
                 unload: Callable[[Any], None], *, max_loaded: int | None = DEFAULT_MAX_LOADED,
                 max_memory: int | None = None, keep_alive: float | None = DEFAULT_KEEP_ALIVE,
                 default: str | None = None, on_change: Callable[[list[Loaded]], None] | None = None) -> None:
        self._catalog_fn = catalog
        self._catalog: list[Candidate] = catalog()
        self._load = load
        self._unload = unload
        self.max_loaded = max_loaded
        self.max_memory = max_memory
        self.keep_alive = keep_alive
        self.default = default
        self.loaded: dict[str, Loaded] = {}         # by candidate name
        self._loading: dict[str, asyncio.Future[Loaded]] = {}
        self._unloading: set[asyncio.Future[None]] = set()
        self._changed: asyncio.Condition | None = None
        self._on_change = on_change
        self.aliases: dict[str, str] = {}           # names /api/copy added: name -> candidate name

    # --- names ---------------------------------------------------------------------------------

    def catalog(self, refresh: bool = False) -> list[Candidate]:
        if refresh:
            self._catalog = self._catalog_fn()
        out = []
        for c in self._catalog:
            extra = {a for a, target in self.aliases.items() if target == c.name}
            out.append(Candidate(c.name, c.path, c.names | extra, c.size, c.modified, c.fixed, c.preset)
                       if extra else c)
        return out

    def known_names(self) -> list[str]:
        return [c.name for c in self.catalog()]

    def _find(self, key: str, refresh: bool) -> Candidate | None:
        cands = self.catalog(refresh)
        for c in cands:
            if c.name.lower() == key:
                return c
        for c in cands:
            if c.answers(key):
                return c
        return None

    def resolve(self, name: str | None) -> Candidate:
        """The candidate a request's model name stands for; no name: the default model. A 404 naming the
        models this server knows when there is none."""
        if name is None:
            return self._default()
        from barellm.store.names import normalize

        for key in dict.fromkeys((_key(name), normalize(name))):   # the name as given, then as the CLI reads it
            c = self._find(key, False) or self._find(key, True)
            if c is not None:
                return c
        raise self.not_found(name)

    def not_found(self, name: str) -> ApiError:
        import difflib

        from barellm.store import hub

        known = self.known_names()
        hint = ""
        registered = hub.registered_name(name) or _key(name)
        close = difflib.get_close_matches(_key(name), [n for c in self.catalog() for n in sorted(c.names)], n=1,
                                          cutoff=0.8)
        if registered in hub.REGISTRY:
            hint = f"; it is not pulled: POST /api/pull {{\"model\": \"{registered}\"}} or `barellm pull {registered}`"
        elif close:
            hint = f"; did you mean {self.resolve(close[0]).name}?"
        return ApiError(404, f"model {name!r} not found{hint}; this server knows: "
                             f"{', '.join(known) if known else '(none: the cache is empty, see barellm pull)'}",
                        param="model", code="model_not_found")

    def _default(self) -> Candidate:
        from barellm.store import hub

        if self.default is not None:
            c = self._find(_key(self.default), False) or self._find(_key(self.default), True)
            if c is not None:
                return c
        if self.loaded:
            return max(self.loaded.values(), key=lambda m: m.last_used).candidate
        cands = self.catalog(True)
        for c in cands:
            if c.name == hub.DEFAULT_MODEL:
                return c
        if cands:
            return cands[0]
        raise ApiError(404, "no model is available: the cache is empty (barellm pull NAME, or POST /api/pull)",
                       param="model", code="model_not_found")

    # --- leases --------------------------------------------------------------------------------

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        cond = self._cond()
        async with cond:
            cond.notify_all()
        if self._on_change is not None:
            self._on_change(list(self.loaded.values()))

    def adopt(self, candidate: Candidate, state: Any, *, keep_alive: float | None = None,
              load_seconds: float = 0.0) -> Loaded:
        """Takes a model loaded outside (at start-up) into the loaded set; keep_alive None: kept loaded."""
        m = Loaded(candidate, state, memory_of(state, candidate.size), load_seconds, keep_alive=keep_alive)
        self.loaded[candidate.name] = m
        if self._on_change is not None:
            self._on_change(list(self.loaded.values()))
        return m

    async def acquire(self, name: str | None, keep_alive: float | None | str = "default") -> Lease:
        """A lease on the model a request names, loading it first if need be. keep_alive: the request's
        (seconds, None: never unload), or "default": the model's current one (the server's default for a
        model this request loads)."""
        cand = self.resolve(name)
        t0 = time.monotonic()
        while True:
            m = self.loaded.get(cand.name)
            if m is not None:
                break
            pending = self._loading.get(cand.name)
            if pending is None:
                pending = asyncio.ensure_future(self._load_one(cand))
                self._loading[cand.name] = pending
                pending.add_done_callback(lambda _f, n=cand.name: self._loading.pop(n, None))
            await asyncio.shield(pending)   # a load that fails raises here, for every request waiting on it
        m.leases += 1
        m.last_used = time.monotonic()
        m.expires_at = None
        if m._timer is not None:
            m._timer.cancel()
            m._timer = None
        if keep_alive != "default":
            m.keep_alive = keep_alive   # type: ignore[assignment]
        waited = time.monotonic() - t0
        return Lease(self, m, waited if waited > 1e-3 else 0.0)

    def _release(self, lease: Lease) -> None:
        m = lease.loaded
        m.leases -= 1
        m.last_used = time.monotonic()
        if self.loaded.get(m.name) is not m:
            return
        if m.leases == 0 and not m.candidate.fixed and m.keep_alive is not None:
            m.expires_at = time.time() + m.keep_alive
            loop = asyncio.get_running_loop()
            if m.keep_alive <= 0:
                self._start_unload(m)
            else:
                m._timer = loop.call_later(m.keep_alive, self._expire, m)
        asyncio.ensure_future(self._notify())

    def _expire(self, m: Loaded) -> None:
        m._timer = None
        if m.leases == 0 and self.loaded.get(m.name) is m:
            self._start_unload(m)

    def _start_unload(self, m: Loaded) -> asyncio.Future[None]:
        del self.loaded[m.name]
        if m._timer is not None:
            m._timer.cancel()
            m._timer = None
        from starlette.concurrency import run_in_threadpool

        async def go() -> None:
            try:
                await run_in_threadpool(self._unload, m.state)
            finally:
                await self._notify()

        fut = asyncio.ensure_future(go())
        self._unloading.add(fut)
        fut.add_done_callback(self._unloading.discard)
        return fut

    async def unload(self, name: str) -> bool:
        """Unloads a model now if it is loaded and idle; False if it is busy. (Not loaded: True.)"""
        cand = self.resolve(name)
        m = self.loaded.get(cand.name)
        if m is None:
            return True
        if m.leases or m.candidate.fixed:
            return False
        await self._start_unload(m)
        return True

    def forget(self, candidate: Candidate) -> None:
        """Drops a candidate whose files are gone (after /api/delete)."""
        self._catalog = [c for c in self._catalog if c.path != candidate.path]
        self.aliases = {a: t for a, t in self.aliases.items() if t != candidate.name}

    # --- loading -------------------------------------------------------------------------------

    def _used_memory(self) -> int:
        return sum(m.memory for m in self.loaded.values())

    def _fits(self, size: int) -> bool:
        n = len(self.loaded) + len(self._loading) - 1   # this load counts among _loading
        if self.max_loaded is not None and n + 1 > self.max_loaded:
            return False
        return self.max_memory is None or not self.loaded or self._used_memory() + size <= self.max_memory

    async def _make_room(self, size: int) -> None:
        """Unloads least recently used idle models until one of `size` bytes fits; waits while every loaded
        model is busy."""
        cond = self._cond()
        while not self._fits(size):
            idle = [m for m in self.loaded.values() if m.leases == 0 and not m.candidate.fixed]
            if idle:
                await self._start_unload(min(idle, key=lambda m: m.last_used))
                continue
            if self._unloading:
                await asyncio.gather(*list(self._unloading), return_exceptions=True)
                continue
            if not self.loaded:
                return   # other loads fill the budget: this one goes ahead rather than wait on a load
            async with cond:
                await cond.wait()

    async def _load_one(self, cand: Candidate) -> Loaded:
        from starlette.concurrency import run_in_threadpool

        if cand.fixed or self._load is None:
            raise ApiError(503, f"model {cand.name!r} is not loaded, and this server cannot load it again",
                           type="server_error", code="model_unavailable")
        await self._make_room(cand.size)
        t0 = time.monotonic()
        try:
            state = await run_in_threadpool(self._load, cand)
        except ApiError:
            raise
        except Exception as e:   # a file that does not load: the client is told why
            raise ApiError(500, f"model {cand.name!r} failed to load: {e}", type="server_error",
                           code="model_load_failed") from e
        m = Loaded(cand, state, memory_of(state, cand.size), time.monotonic() - t0, keep_alive=self.keep_alive)
        self.loaded[cand.name] = m
        await self._notify()
        return m

    async def close(self) -> None:
        """Unloads every model (the server is stopping)."""
        if self._loading:
            await asyncio.gather(*list(self._loading.values()), return_exceptions=True)
        for m in list(self.loaded.values()):
            if not m.candidate.fixed:
                self._start_unload(m)
        if self._unloading:
            await asyncio.gather(*list(self._unloading), return_exceptions=True)


class Server:
    """What every handler shares: the models, the metrics, the limits on a request. Per model, a
    ServerState (app.py) holds the model and its scheduler; a handler gets one through lease()."""

    def __init__(self, models: Models, metrics: Any, *, max_body: int, stream_interval: float,
                 timeout: float | None) -> None:
        self.models = models
        self.metrics = metrics
        self.max_body = max_body
        self.stream_interval = stream_interval
        self.timeout = timeout

    async def lease(self, request: Any, name: str | None, keep_alive: float | None | str = "default") -> Lease:
        """The model a request names, loaded and held until its response is sent (see leasing())."""
        lease = await self.models.acquire(name, keep_alive)
        held = getattr(request.state, "barellm_leases", None)
        if held is None:
            lease.release()
            raise RuntimeError("lease() from a handler not wrapped by leasing()")
        held.append(lease)
        return lease

    # the one model of a server built around one (create_app, each replica on Ray)
    def _only(self) -> Any:
        if not self.models.loaded:
            raise RuntimeError("no model is loaded")
        return next(iter(self.models.loaded.values())).state

    @property
    def model(self) -> Any:
        return self._only().model

    @property
    def scheduler(self) -> Any:
        return self._only().scheduler

    @property
    def model_id(self) -> str:
        return self._only().model_id


def leasing(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wraps a route's handler so the leases it takes are released when its response has been sent (a
    relayed generation: when its relay ends), or at once when it fails or answers without relaying."""
    from barellm.serve.relay import RelayResponse

    async def wrapped(request: Any) -> Any:
        leases: list[Lease] = []
        request.state.barellm_leases = leases

        def release() -> None:
            for lease in leases:
                lease.release()

        try:
            response = await handler(request)
        except BaseException:
            release()
            raise
        if leases:
            if isinstance(response, RelayResponse):
                response.on_close = release
            else:
                release()
        return response

    wrapped.__name__ = getattr(handler, "__name__", "handler")
    return wrapped
