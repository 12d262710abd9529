"""`barellm serve`: its options, their checks before anything is loaded, and the start of the server they
describe (serve/build.py builds it). Importing this module stays cheap and works without Starlette: only the
command checks for it, so `barellm --help` lists `serve` on any install."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from barellm.errors import BarellmError, InvalidRequest
from barellm.serve.build import build_app, keep_alive


def register(sub: argparse._SubParsersAction) -> None:
    from barellm.options import add_draft_arg, add_model_args

    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server; concurrent requests share forward passes",
        description="Serves every model in the cache over OpenAI- and Ollama-compatible HTTP APIs, each loaded "
                    "when a request first names it and unloaded after --keep-alive idle or to make room "
                    "(--max-loaded, --max-memory); the MODELs given are loaded at start. Routes: "
                    "/v1/chat/completions, /v1/completions, /v1/models, /api/chat, /api/ps, /tokenize, "
                    "/health, /metrics, /openapi.json (docs/server.md). Needs the extra: pip install "
                    "'barellm[server]'.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="models to load at start (names or paths; default: none, each loads on first use)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; 0.0.0.0 exposes the server to the network: "
                        "see --api-key)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080)")
    p.add_argument("--slots", type=int, default=4,
                   help="sequences generated side by side, each with its own KV cache (default 4)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a slot; more are answered 429 (default 64)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may take, queueing included; then it ends with finish_reason "
                        "\"length\" (0 = no limit; default 600)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens fed per step, so a long prompt does not stall the others (default 256)")
    p.add_argument("--stream-interval", type=float, default=0.02, metavar="SECONDS",
                   help="a streamed response sends its text at most once per interval, what arrived meanwhile "
                        "together (0 = every token as it comes; default 0.02)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME[=MODEL]",
                   help="another model name requests may use, for MODEL or else the first MODEL given (repeatable)")
    p.add_argument("--keep-alive", default="5m", metavar="DURATION",
                   help="how long a model stays loaded after its last request: seconds or a duration (5m, 1h); "
                        "0 unloads it at once, -1 never (a request's keep_alive overrides it; default 5m)")
    p.add_argument("--max-loaded", type=int, default=3, metavar="N",
                   help="models loaded at once at most; loading another unloads the least recently used idle "
                        "one (default 3)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="memory the loaded models may take together (files and KV caches), e.g. 4G; loading "
                        "past it unloads idle models first (default: no limit)")
    p.add_argument("--template", default=None, help="a built-in chat template to use instead of the file's")
    add_draft_arg(p)
    p.add_argument("--api-key", default=os.environ.get("BARELLM_API_KEY") or None, metavar="KEY",
                   help="requests must send 'Authorization: Bearer KEY' (default: the environment variable "
                        "BARELLM_API_KEY, which keeps the key out of the process list; unset: no key)")
    p.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="a Host header name requests may carry (repeatable; '*' for any). Default: the loopback "
                        "names when --host is loopback, else any")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin allowed to call the API, e.g. https://app.example.com (repeatable; "
                        "'*' for any). Default: none, and no CORS headers are sent")
    c = p.add_argument_group("connections (0 turns a timeout off)")
    c.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this of the connection opening or of the "
                        "request's first byte; else 408 and close (default 10)")
    c.add_argument("--body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a request body must arrive within this of its headers (default 60)")
    c.add_argument("--min-body-rate", type=float, default=1024.0, metavar="BYTES",
                   help="after 5 s, a body must arrive at this many bytes a second or faster (default 1024)")
    c.add_argument("--idle-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="an idle connection is closed this long after its last response (default 5)")
    c.add_argument("--send-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a client that reads none of its response for this long is dropped (default 60)")
    c.add_argument("--max-connections", type=int, default=512,
                   help="open connections at most; past them a new one gets 503 and is closed (default 512)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="after Ctrl-C (or SIGTERM), the seconds the requests in flight get to finish; then each "
                        "ends with 503 or, streamed, an error event. A second Ctrl-C ends them at once (default 10)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("replicas on a Ray cluster (pip install 'barellm[ray]'; see docs/ray.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve replicas of the model on a Ray cluster behind one endpoint, each with its own "
                        "slots and threads; a chat's next turn goes to the replica that holds its prompt")
    g.add_argument("--address", default=None,
                   help="the Ray cluster to join (default: $RAY_ADDRESS or one started on this machine with "
                        "`ray start`, else a new local one that ends with this command)")
    g.add_argument("--replicas", type=int, default=None, help="replicas to run (default 1)")
    g.add_argument("--autoscale", default=None, metavar="MIN,MAX",
                   help="let Ray run between MIN and MAX replicas, following the load, instead of --replicas")
    g.add_argument("--routers", type=int, default=None,
                   help="router processes in front of the replicas (default 1); each relays a few hundred "
                        "streamed tokens/s")
    p.set_defaults(func=cmd_serve)


def check_args(args: argparse.Namespace) -> None:
    """Refuses option values no server could run with, before anything is loaded."""
    if not 0 <= args.port <= 65535:
        raise InvalidRequest(f"--port must be in 0..65535, got {args.port}")
    if not 1 <= args.slots <= 256:
        raise InvalidRequest(f"--slots must be in 1..256, got {args.slots}")
    if args.queue < 0:
        raise InvalidRequest(f"--queue must be >= 0, got {args.queue}")
    if not args.timeout >= 0:
        raise InvalidRequest(f"--timeout must be >= 0 seconds, got {args.timeout}")
    for name in ("header_timeout", "body_timeout", "min_body_rate", "idle_timeout", "send_timeout"):
        value = getattr(args, name)
        if not 0 <= value <= 86400:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be in 0..86400, got {value}")
    if not 1 <= args.max_connections <= 1 << 20:
        raise InvalidRequest(f"--max-connections must be in 1..{1 << 20}, got {args.max_connections}")
    if not 0 <= args.shutdown_timeout <= 86400:
        raise InvalidRequest(f"--shutdown-timeout must be in 0..86400 seconds, got {args.shutdown_timeout}")
    if args.prefill_chunk < 1:
        raise InvalidRequest(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if not 0 <= args.stream_interval <= 10:
        raise InvalidRequest(f"--stream-interval must be in 0..10 seconds, got {args.stream_interval}")
    if args.api_key is not None and len(args.api_key) < 8:
        raise InvalidRequest("--api-key must be at least 8 characters long")
    if args.threads is not None and args.threads < 1:
        raise InvalidRequest(f"-t/--threads must be >= 1, got {args.threads}")
    ray_only = [name for name, value in (("--address", args.address), ("--replicas", args.replicas),
                                         ("--autoscale", args.autoscale), ("--routers", args.routers))
                if value is not None]
    if ray_only and not args.ray:
        raise InvalidRequest(f"{', '.join(ray_only)} {'applies' if len(ray_only) == 1 else 'apply'} only with --ray")
    if args.replicas is not None and args.autoscale is not None:
        raise InvalidRequest("give either --replicas or --autoscale, not both")
    if args.replicas is not None and args.replicas < 1:
        raise InvalidRequest(f"--replicas must be >= 1, got {args.replicas}")
    if args.routers is not None and args.routers < 1:
        raise InvalidRequest(f"--routers must be >= 1, got {args.routers}")
    if args.autoscale is not None:
        autoscale_bounds(args.autoscale)
    if args.ray and len(args.models) > 1:
        raise InvalidRequest("--ray serves one model; give at most one MODEL")
    if args.max_loaded < 1:
        raise InvalidRequest(f"--max-loaded must be >= 1, got {args.max_loaded}")
    from barellm.serve.models import parse_bytes

    if args.max_memory is not None:
        try:
            parse_bytes(args.max_memory)
        except ValueError as e:
            raise InvalidRequest(f"--max-memory: {e}") from None
    keep_alive(args)
    for alias in args.alias:
        if "=" not in alias and not args.models:
            raise InvalidRequest(f"--alias {alias}: name its model (--alias {alias}=MODEL) when no MODEL is given")


def autoscale_bounds(text: str) -> tuple[int, int]:
    """--autoscale MIN,MAX as two integers, 0 <= MIN <= MAX, MAX >= 1."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise InvalidRequest(f"--autoscale takes MIN,MAX (two replica counts, e.g. 1,4), got {text!r}")
    lo, hi = (int(p) for p in parts)
    if hi < 1 or lo > hi:
        raise InvalidRequest(f"--autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return lo, hi


def connection_limits(args: argparse.Namespace) -> Any:
    """The connection rules the options give (serve/connections.py), the cap held under the process's
    open-file limit so that a refusal can still be sent."""
    from barellm.serve.connections import Limits

    cap = args.max_connections
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            cap = max(1, min(cap, soft - 64))
    except (ImportError, OSError, ValueError):
        pass
    return Limits(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                  min_body_rate=args.min_body_rate, keep_alive=args.idle_timeout, send_timeout=args.send_timeout,
                  max_connections=cap)


def check_model(args: argparse.Namespace) -> None:
    """Refuses a model that resolves to nothing (the error names the known models) before a server starts or
    a Ray cluster is joined. A path given with --address is left to the cluster: it names a file there."""
    from barellm.options import check_draft
    from barellm.store import catalog

    check_draft(args)
    for m in args.models:
        if catalog.can_resolve(m):
            continue
        if args.ray and args.address is not None and not catalog.close_names(m) and ("/" in m or "." in m):
            continue
        raise catalog.unknown_model(m)


def cmd_serve(args: argparse.Namespace) -> int:
    check_args(args)
    check_model(args)
    if args.ray:
        from barellm.serve.ray import serve_on_ray

        return serve_on_ray(args)
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise BarellmError(f"barellm serve needs Starlette and uvicorn ({e.name} is missing): "
                           "pip install 'barellm[server]'") from None

    from barellm.serve.app import run
    from barellm.serve.security import is_loopback

    app = build_app(args)
    models = app.state.server.models
    loaded = ", ".join(models.loaded) or "none yet"
    print(f"barellm: serving {len(models.catalog())} models on demand (loaded: {loaded}; {args.slots} slots each) "
          f"on http://{args.host}:{args.port}/v1 and /api", file=sys.stderr)
    if not is_loopback(args.host) and args.api_key is None:
        print("barellm: warning: listening beyond loopback without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr)
    run(app, host=args.host, port=args.port, log_level=args.log_level, limits=connection_limits(args),
        shutdown_timeout=args.shutdown_timeout)
    return 0
