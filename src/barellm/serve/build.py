"""The server the `serve` options describe, built and its named models loaded: many models on demand, or with
--ray one model a replica serves alone (serve/ray/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from barellm.errors import InvalidRequest


def keep_alive(args: argparse.Namespace) -> float | None:
    """--keep-alive in seconds, None for never."""
    from barellm.serve.errors import ApiError
    from barellm.serve.models import parse_keep_alive

    try:
        return parse_keep_alive(args.keep_alive, "--keep-alive")
    except ApiError as e:
        raise InvalidRequest(e.message) from None


def served_id(model: str | None, path: Path) -> str:
    """The id /v1/models reports: the registry name when the model was given by name, else the name the
    cache knows the file by (a user's own model), else the file's stem."""
    from barellm.store import catalog, hub, presets

    name = model if model is not None else hub.DEFAULT_MODEL
    preset = presets.find(name)
    return preset.name if preset is not None else hub.registered_name(name) or catalog.display_name(path)


def build_app(args: argparse.Namespace, *, replica: str | None = None) -> Any:
    """Builds the app the options describe and loads the models they name: what `barellm serve` runs.
    With --ray (each replica runs this), the one model given or the default, served alone. replica: the
    name its responses carry (default: host and process id)."""
    import barellm
    from barellm.serve.app import create_app
    from barellm.serve.security import default_allowed_hosts

    allowed = args.allowed_host if args.allowed_host else default_allowed_hosts(args.host)
    if getattr(args, "ray", False):
        first = args.models[0] if args.models else None
        model = barellm.load(first, threads=args.threads, context=args.context, engine=args.engine,
                             chat_template=args.template, slots=args.slots, activations=args.activations,
                             kv_type=args.kv_type, verify=args.verify, draft=args.draft)
        return create_app(model, model_id=served_id(first, model.path), aliases=args.alias,
                          max_queue=args.queue, timeout=args.timeout or None, prefill_chunk=args.prefill_chunk,
                          api_key=args.api_key, allowed_hosts=allowed, cors_origins=args.cors_origin,
                          stream_interval=args.stream_interval, replica=replica)
    return build_server(args, allowed, replica)


def build_server(args: argparse.Namespace, allowed: Any, replica: str | None) -> Any:
    """Many models on demand (serve.models), the ones named loaded now."""
    import barellm
    from barellm.serve.app import create_server, model_state, stop_state
    from barellm.serve.metrics import Metrics
    from barellm.serve.models import Models, cache_candidates, parse_bytes
    from barellm.store import catalog

    given: list[tuple[str, Path]] = []
    for m in args.models:
        path = catalog.resolve(m)
        given.append((served_id(m, path), path))
    aliases: dict[str, str] = {}
    for a in args.alias:
        name, _, target = a.partition("=")
        aliases[name] = target or given[0][0]
    metrics = Metrics(0)
    timeout = args.timeout or None

    def load(cand: Any) -> Any:
        model = barellm.load(cand.preset or cand.path, threads=args.threads, context=args.context, engine=args.engine,
                             chat_template=args.template, slots=args.slots, activations=args.activations,
                             kv_type=args.kv_type, verify=args.verify)
        add_draft(model, args.draft)
        return model_state(model, cand.name, metrics, max_queue=args.queue, timeout=timeout,
                           prefill_chunk=args.prefill_chunk, stream_interval=args.stream_interval)

    models = Models(lambda: cache_candidates(given, aliases), load, stop_state, max_loaded=args.max_loaded,
                    max_memory=parse_bytes(args.max_memory) if args.max_memory else None,
                    keep_alive=keep_alive(args), default=given[0][0] if given else None)
    for name, _ in given[: args.max_loaded]:
        cand = models.resolve(name)
        if cand.name not in models.loaded:
            models.adopt(cand, load(cand), keep_alive=None)   # named at start: kept until a request says else
    return create_server(models, metrics, timeout=timeout, api_key=args.api_key, allowed_hosts=allowed,
                         cors_origins=args.cors_origin, stream_interval=args.stream_interval, replica=replica)


def add_draft(model: Any, draft: str | None) -> None:
    """Gives a model the server's --draft. A server serves many models, and a draft model drafts only for
    those of its vocabulary: another one is served without drafting, with a warning naming why."""
    if draft is None:
        return
    from barellm.api.drafting import speculator

    try:
        model.scheduler.configure(speculator=speculator(draft, model))
    except InvalidRequest as e:
        print(f"barellm: warning: {model.name} is served without drafting: {e}", file=sys.stderr)
