"""Ollama's model-management routes: /api/pull (streamed progress lines), /api/delete, /api/copy, and its
embedding routes /api/embed and /api/embeddings. Errors in Ollama's shape, {"error": "..."}."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from barellm.errors import BarellmError, InvalidRequest
from barellm.formats.file_types import file_type_name
from barellm.serve import schemas
from barellm.serve.errors import ApiError, bad
from barellm.serve.models import leasing
from barellm.serve.relay import Outbox, RelayResponse, read_body, submit_embeddings
from barellm.serve.schema_types import INT64, MAX_STOP_CHARS, MAX_STOPS, Duration, Int, _Body, _either

# _name(): the model by either of its keys, not empty
NAMED = ConfigDict(json_schema_extra={"anyOf": [
    {"required": [key], "properties": {key: {"type": "string", "minLength": 1}}} for key in ("model", "name")]})


class PullRequest(_Body):
    model_config = NAMED

    model: str | None = None
    name: str | None = None   # older clients
    stream: bool = True
    insecure: bool | None = None


class DeleteRequest(_Body):
    model_config = NAMED

    model: str | None = None
    name: str | None = None


_STOP = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class PresetParameters(_Body):
    """A preset's defaults, by Ollama's names, within what a request's options take (serve/ollama.py)."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_k: Annotated[Int, Field(ge=0, le=1 << 31)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repeat_penalty: Annotated[float, Field(ge=1e-6, le=10)] | None = None
    repeat_last_n: Annotated[Int, Field(ge=-1, le=1 << 31)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: Annotated[Int, Field(ge=-INT64, le=(1 << 64) - 1)] | None = None
    num_predict: Annotated[Int, Field(ge=-2, le=1 << 31)] | None = None
    num_ctx: Annotated[Int, Field(ge=16, le=1 << 31)] | None = None
    stop: _STOP | Annotated[list[_STOP], Field(max_length=MAX_STOPS)] | None = None


_PRESET_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}(:latest)?$"


class CreateRequest(_Body):
    """Ollama's /api/create: a preset (store/presets.py), as current Ollama takes it (model, from, system,
    parameters) or as older clients send it (name, modelfile)."""

    model_config = ConfigDict(**_Body.model_config, json_schema_extra={"allOf": [
        NAMED["json_schema_extra"],
        {"anyOf": [{"required": ["from"], "properties": {"from": {"type": "string"}}},
                   {"required": ["modelfile"], "properties": {"modelfile": {"type": "string"}}}]}]})

    model: str | None = Field(None, pattern=_PRESET_NAME)
    name: str | None = Field(None, pattern=_PRESET_NAME)   # older clients
    from_: str | None = Field(None, alias="from", pattern=r"\S",
                              description="the model it runs: any name or path barellm takes")
    system: str | None = None
    parameters: PresetParameters | None = Field(None, description="generation defaults, by Ollama's names")
    template: str | None = Field(None, description="stored, not applied: the model's own chat template is used")
    modelfile: str | None = Field(None, min_length=1, description=(
        "older clients: a Modelfile's text (FROM, SYSTEM, PARAMETER, TEMPLATE); from, system, parameters and "
        "template given beside it win"))
    license: str | list[str] | None = None
    stream: bool = True


class CopyRequest(_Body):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1, max_length=256)


class EmbedRequest(_Body):
    model: str = Field(min_length=1)
    input: _either(str, list[Annotated[str, Field(min_length=1)]], "must be a string or an array of strings") = Field(
        "", description='a text or texts; none ("", [] or left out) loads the model and answers no embeddings')
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | Duration | None = None
    dimensions: Int | None = None


class LegacyEmbeddingRequest(_Body):
    model: str = Field(min_length=1)
    prompt: str = Field("", description="the text; none loads the model and answers an empty embedding")
    options: dict[str, Any] | None = None
    keep_alive: float | Duration | None = None


def _tag(name: str) -> str:
    """A model's name as Ollama shows it: with its tag, ":latest" where it has none (hf.co/ORG/REPO:Q4_K_M and
    qwen2.5-coder:1.5b have theirs)."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


def _keep_alive(body: Any) -> float | None | str:
    from barellm.serve.models import parse_keep_alive

    return "default" if body.keep_alive is None else parse_keep_alive(body.keep_alive)


B = TypeVar("B", bound=_Body)


async def _parsed(request: Request, shape: type[B]) -> tuple[Any, B]:
    """The server, and the request's body read as shape."""
    server = request.app.state.server
    return server, schemas.parse(shape, await read_body(request, server.max_body))


async def _leased(request: Request, shape: type[B]) -> tuple[B, Any]:
    """The request's body read as shape, and a lease on the model it names (loaded first where it is not), held
    as its keep_alive asks."""
    server, body = await _parsed(request, shape)
    return body, await server.lease(request, body.model, _keep_alive(body))


def _details(state: Any) -> dict[str, Any]:
    model = state.model
    return _details_of(getattr(model, "metadata", {}) or {}, getattr(getattr(model, "source", None), "tensors", {}),
                       getattr(getattr(model, "config", None), "arch", "unknown"))


_file_details: dict[tuple[str, float], dict[str, Any]] = {}


def _details_of_file(path: Any, modified: float) -> dict[str, Any]:
    """The details of a model not loaded, from its file's header (read once per file)."""
    key = (str(path), modified)
    if key not in _file_details:
        from barellm.formats import sniff

        try:
            if sniff(path) == "blm":
                from barellm.formats.blm import BLMFile

                with BLMFile(path, prefetch=False) as f:
                    _file_details[key] = _details_of(f.metadata, f.tensors, "unknown")
            else:
                from barellm.formats.gguf import GGUFFile

                g = GGUFFile(path)
                try:
                    _file_details[key] = _details_of(g.metadata, g.tensors, "unknown")
                finally:
                    g.close()
        except Exception:   # an unreadable file is listed with what is known of it
            _file_details[key] = {"parent_model": "", "format": "gguf", "family": "unknown", "families": ["unknown"],
                                  "parameter_size": "", "quantization_level": "unknown"}
    return _file_details[key]


def _details_of(md: Any, tensors: Any, arch_default: str) -> dict[str, Any]:
    arch = str(md.get("general.architecture", arch_default))
    tensors = tensors or {}
    n_params = sum(int(getattr(t, "n_elements", 0)) for t in tensors.values())
    types: dict[str, int] = {}
    for t in tensors.values():
        if len(getattr(t, "shape", ())) == 2:
            name = str(getattr(t, "type_name", "?")).upper()
            types[name] = types.get(name, 0) + int(t.nbytes)
    size = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"
    # the file's type as llama.cpp names it (Q4_K_M); the matrices' commonest type where the file does not say
    level = file_type_name(md) or (max(types, key=lambda k: types[k]) if types else "unknown")
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": md.get("general.size_label") or size, "quantization_level": level}


def _digest(cand: Any) -> str:
    # a stable id for the file (Ollama's is the sha256 of the weights; hashing gigabytes per request is not)
    import hashlib

    return hashlib.sha256(f"{cand.path}:{int(cand.modified)}".encode()).hexdigest()


_FAR_AHEAD = 100 * 365 * 86400.0   # seconds: when /api/ps says a model kept loaded unloads


async def ps(request: Request) -> Response:
    """The loaded models: size (file and KV caches), when each unloads (far ahead: kept loaded)."""
    server = request.app.state.server
    out = []
    never = time.time() + _FAR_AHEAD
    for m in sorted(server.models.loaded.values(), key=lambda m: -m.last_used):
        expires = m.expires_at
        if expires is None:
            expires = time.time() + (m.keep_alive if m.keep_alive is not None and not m.candidate.fixed else
                                     _FAR_AHEAD)
        expires = min(expires, never)   # a keep_alive of 1e300 s is "never" too; a date that far has no year
        out.append({"name": _tag(m.name), "model": _tag(m.name), "size": m.memory, "size_vram": 0,
                    "digest": _digest(m.candidate), "details": _details(m.state),
                    "expires_at": datetime.fromtimestamp(expires, timezone.utc).isoformat().replace("+00:00", "Z"),
                    "context_length": m.state.n_ctx, "in_use": m.leases})
    return JSONResponse({"models": out})


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _ollama(handler: Any) -> Any:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as e:
            request.app.state.server.metrics.error("other", e.type)
            return _error(e.status, e.message)
    wrapped.__name__ = handler.__name__
    return wrapped


def _name(body: Any) -> str:
    name = body.model or body.name
    if not name:
        raise bad("model is required", "model")
    return name


def _line(obj: Any) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


_pull_lock: asyncio.Lock | None = None


@_ollama
async def pull(request: Request) -> Response:
    """Fetches a model as `barellm pull` does: a catalogue name, hf.co/ORG/REPO[:QUANT] or ollama:NAME[:TAG];
    streamed, Ollama's progress lines, with completed/total bytes while a file downloads."""
    from barellm.store import catalog, hub, names

    server, body = await _parsed(request, PullRequest)
    name = _name(body)
    key = hub.registered_name(name) or name
    if key not in hub.REGISTRY and names.parse(name).kind not in ("huggingface", "ollama"):
        raise ApiError(404, f"model {name!r} is not one this server can pull; it pulls: "
                            f"{', '.join(sorted(hub.REGISTRY))}, hf.co/ORG/REPO[:QUANT] and ollama:NAME[:TAG]",
                       param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def tell(status: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, status)

    async def run() -> None:
        global _pull_lock
        from starlette.concurrency import run_in_threadpool

        _pull_lock = _pull_lock or asyncio.Lock()
        try:
            async with _pull_lock:
                await run_in_threadpool(lambda: catalog.pull(key, quiet=True, on_status=tell))
            server.models.catalog(refresh=True)
            queue.put_nowait({"status": "success"})
        except (BarellmError, OSError) as e:
            queue.put_nowait({"error": f"pulling {key} failed: {e}"})
        queue.put_nowait(None)

    task = asyncio.ensure_future(run())
    if not body.stream:
        await task
        last: dict[str, Any] = {}
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                last = item
        if "error" in last:
            return _error(500, last["error"])
        return JSONResponse(last)

    async def lines() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            yield _line(item)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@_ollama
async def delete(request: Request) -> Response:
    """Removes a model from the cache (unloading it first); one in use is refused, 409."""
    from barellm.store import catalog, hub
    from barellm.store.removal import remove_model

    server, body = await _parsed(request, DeleteRequest)
    cand = server.models.resolve(_name(body))
    if cand.fixed:
        raise ApiError(400, f"model {cand.name!r} was handed to this server in memory; it cannot delete it")
    if cand.preset is not None:   # the preset alone: its model stays
        from barellm.store import presets

        if not await server.models.unload(cand.name):
            raise ApiError(409, f"model {cand.name!r} is in use; delete it once its requests end", code="model_busy")
        presets.remove(cand.preset)   # not forget(): that drops every name of the file, its model's too
        server.models.catalog(refresh=True)
        return JSONResponse({})
    registered = cand.name in hub.REGISTRY
    local = None if registered else catalog.find_local(cand.name)
    outside = None if registered or local is not None else catalog.outside_target(cand.name)
    if not registered and local is None and outside is None:
        raise ApiError(400, f"model {cand.name!r} is served from {cand.path}, outside barellm's cache; "
                            "delete only removes what barellm put in its cache")
    if not await server.models.unload(cand.name):
        raise ApiError(409, f"model {cand.name!r} is in use; delete it once its requests end", code="model_busy")
    from starlette.concurrency import run_in_threadpool

    try:
        if registered:
            await run_in_threadpool(remove_model, cand.name)
        elif local is not None:
            await run_in_threadpool(catalog.remove_local, local)
        else:   # barellm's conversion, and what barellm fetched; a local Ollama's or the user's files stay
            await run_in_threadpool(catalog.remove_outside, cand.name)
    except InvalidRequest as e:
        raise ApiError(400, str(e)) from None
    except BarellmError as e:
        raise ApiError(500, f"deleting {cand.name} failed: {e}", type="server_error") from None
    server.models.forget(cand)
    server.models.catalog(refresh=True)
    return JSONResponse({})


@_ollama
async def create(request: Request) -> Response:
    """Stores a preset, as `barellm create` does: Ollama's status lines (streamed unless stream is false),
    the last {"status": "success"}."""
    from starlette.concurrency import run_in_threadpool

    from barellm.errors import ModelNotFound
    from barellm.store import catalog, presets

    server, body = await _parsed(request, CreateRequest)
    name = _name(body)
    read: dict[str, Any] = {"from": None, "system": None, "parameters": {}, "template": None}
    try:
        if body.modelfile:
            read = presets.parse_modelfile(body.modelfile)
    except InvalidRequest as e:
        raise bad(f"modelfile: {e}", "modelfile") from None
    base = body.from_ or read["from"]
    if not base:
        raise bad("from is required: the model the preset runs", "from")
    given = body.parameters.model_dump(exclude_none=True) if body.parameters is not None else {}
    params = {**read["parameters"], **given}
    try:
        preset = await run_in_threadpool(lambda: catalog.create_preset(
            name, base, system=body.system if body.system is not None else read["system"], parameters=params,
            template=body.template if body.template is not None else read["template"]))
    except ModelNotFound as e:
        raise ApiError(404, str(e), param="from", code="model_not_found") from None
    except InvalidRequest as e:
        raise bad(str(e), "model") from None
    try:   # a preset named anew drops what a loaded one of that name had: its next request loads it again
        old = server.models.resolve(preset.name)
        if old.preset is not None:
            await server.models.unload(old.name)
    except ApiError:
        pass
    server.models.catalog(refresh=True)
    lines: list[dict[str, Any]] = [{"status": f"creating {preset.name} from {preset.base}"}]
    if preset.template is not None:
        lines.append({"status": presets.TEMPLATE_NOTE})
    lines += [{"status": "writing manifest"}, {"status": "success"}]
    if not body.stream:
        return JSONResponse(lines[-1])

    async def out() -> AsyncIterator[bytes]:
        for line in lines:
            yield _line(line)

    return StreamingResponse(out(), media_type="application/x-ndjson")


@_ollama
async def copy(request: Request) -> Response:
    """Another name for a model, for as long as this server runs."""
    server, body = await _parsed(request, CopyRequest)
    cand = server.models.resolve(body.source)
    dest = body.destination.strip().lower().removesuffix(":latest")
    if not dest:
        raise bad("destination is empty", "destination")
    try:
        other = server.models.resolve(dest)
    except ApiError:
        other = None
    if other is not None and other.name != cand.name:
        raise ApiError(400, f"destination {body.destination!r} already names the model {other.name!r}",
                       param="destination")
    server.models.aliases[dest] = cand.name
    return JSONResponse({})


class EmbedResponse(RelayResponse):
    """/api/embed's {"embeddings": [...]} or /api/embeddings' {"embedding": [...]}."""

    def __init__(self, state: Any, job: Any, events: Outbox, path: str, model: str, legacy: bool,
                 load_seconds: float) -> None:
        super().__init__(state, job, events, path)
        self.model = model
        self.legacy = legacy
        self.t0 = time.perf_counter_ns()
        self.load_ns = int(load_seconds * 1e9)

    async def _respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        async for ev in self._each():
            if ev.kind == "error":
                await _error(ev.status, ev.message)(scope, receive, send)
                return
            if ev.kind == "embeddings":
                vectors = ev.data.tolist()
                if self.legacy:
                    body: dict[str, Any] = {"embedding": vectors[0]}
                else:
                    body = {"model": self.model, "embeddings": vectors,
                            "total_duration": time.perf_counter_ns() - self.t0 + self.load_ns,
                            "load_duration": self.load_ns, "prompt_eval_count": ev.prompt_tokens}
                await JSONResponse(body)(scope, receive, send)
                return


async def _embed(request: Request, legacy: bool) -> Response:
    from starlette.concurrency import run_in_threadpool

    body: Any
    body, lease = await _leased(request, LegacyEmbeddingRequest if legacy else EmbedRequest)
    state = lease.state
    texts = [body.prompt] if legacy else ([body.input] if isinstance(body.input, str) else list(body.input))
    texts = [t for t in texts if t]   # "" alone: nothing to embed (in a list, the model forbids it)
    if not texts:   # as Ollama does: an empty request loads the model, and answers no embeddings
        load_ns = int(lease.load_seconds * 1e9)
        return JSONResponse({"embedding": []} if legacy else {
            "model": body.model, "embeddings": [], "total_duration": load_ns, "load_duration": load_ns,
            "prompt_eval_count": 0})
    dim = state.model.config.dim
    if not legacy and body.dimensions is not None and body.dimensions != dim:
        raise bad(f"dimensions: this model's embeddings have {dim} dimensions; it cannot make others", "dimensions")

    def ids_of() -> list[list[int]]:
        out = []
        for i, t in enumerate(texts):
            ids = state.model.tokenize(t)
            if len(ids) > state.n_ctx:
                if legacy or not body.truncate:
                    raise InvalidRequest(f"input {i} has {len(ids)} tokens; the context holds {state.n_ctx}")
                ids = ids[: state.n_ctx]
            out.append(ids)
        return state.model.embed_ids(out)

    try:
        ids = await run_in_threadpool(ids_of)
    except InvalidRequest as e:
        raise bad(str(e), "input") from None
    job, events = submit_embeddings(state, ids, state.model.pooling, normalize=not legacy)
    return EmbedResponse(state, job, events, request.url.path, body.model, legacy, lease.load_seconds)


@_ollama
async def embed(request: Request) -> Response:
    return await _embed(request, legacy=False)


@_ollama
async def embeddings(request: Request) -> Response:
    return await _embed(request, legacy=True)


MODELS = [PullRequest, DeleteRequest, CreateRequest, CopyRequest, EmbedRequest, LegacyEmbeddingRequest]


_ERROR = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "string"}},
                                          "required": ["error"]}}}


def _op(method: str, summary: str, op_id: str, schema: str, response: str,
        errors: dict[str, str] | None = None) -> dict[str, Any]:
    return {method: {"summary": summary, "operationId": op_id, "tags": ["ollama"],
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
                     "responses": {"200": {"description": response},
                                   **{code: {"description": what, "content": _ERROR}
                                      for code, what in (errors or {}).items()}}}}


PATHS: dict[str, Any] = {
    "/api/pull": _op("post", "Ollama: fetch a model the cache knows by name", "ollamaPull", "PullRequest",
                     "streamed: one progress object per line, the last {status: success}",
                     {"500": "with stream false: the pull failed (the network, the disk); streamed, an error line"}),
    "/api/delete": _op("delete", "Ollama: remove a model from the cache", "ollamaDelete", "DeleteRequest", "{}",
                       {"409": "the model is in use", "500": "removing its files failed"}),
    "/api/create": _op("post", "Ollama: a preset: a model with a system prompt and default parameters",
                       "ollamaCreate", "CreateRequest",
                       "streamed: one status object per line, the last {status: success}; with stream false that "
                       "last one alone", {"404": "from names no model"}),
    "/api/copy": _op("post", "Ollama: another name for a model (while the server runs)", "ollamaCopy",
                     "CopyRequest", "{}"),
    "/api/embed": _op("post", "Ollama: embeddings of texts", "ollamaEmbed", "EmbedRequest", "{embeddings}"),
    "/api/embeddings": _op("post", "Ollama: the embedding of one text (older route)", "ollamaEmbeddings",
                           "LegacyEmbeddingRequest", "{embedding}"),
    "/api/ps": {"get": {"summary": "Ollama: the loaded models", "operationId": "ollamaPs", "tags": ["ollama"],
                        "responses": {"200": {"description": "{models: [...]}"}}}},
}


def routes() -> list[Route]:
    return [
        Route("/api/pull", pull, methods=["POST"]),
        Route("/api/delete", delete, methods=["DELETE"]),
        Route("/api/create", create, methods=["POST"]),
        Route("/api/copy", copy, methods=["POST"]),
        Route("/api/embed", leasing(embed), methods=["POST"]),
        Route("/api/embeddings", leasing(embeddings), methods=["POST"]),
        Route("/api/ps", ps, methods=["GET"]),
    ]
