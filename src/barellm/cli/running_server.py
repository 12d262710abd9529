"""The commands that talk to a running `barellm serve`, as Ollama's do: `ps` (the models it has loaded, from
its /api/ps) and `stop MODEL` (unload one now, as a request with keep_alive 0 does). Plain HTTP from the
standard library: they work on an install without the server's extra."""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from typing import Any

from barellm.errors import BarellmError, ModelNotFound

_KEPT = 10 * 365 * 86400   # seconds: an unload further ahead than this is the server keeping the model loaded


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the server's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the server's port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("BARELLM_API_KEY") or None, metavar="KEY",
                   help="the server's --api-key (default: the environment variable BARELLM_API_KEY)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="the models a running `barellm serve` has loaded",
                       description="Lists the models loaded in a running server (its /api/ps): memory (file and "
                                   "KV caches), context, requests in flight, and when each unloads.")
    _add_server_args(p)
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("stop", help="unload a model from a running `barellm serve`",
                       description="Unloads MODEL from a running server now, as a request with keep_alive 0 does; "
                                   "requests in flight on it finish first. The next request that names it loads "
                                   "it again.")
    p.add_argument("model", metavar="MODEL")
    _add_server_args(p)
    p.set_defaults(func=cmd_stop)


def _base(args: argparse.Namespace) -> str:
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"http://{host}:{args.port}"


def call(args: argparse.Namespace, path: str, body: dict[str, Any] | None = None) -> Any:
    """The server's JSON answer to a GET (no body) or POST; a BarellmError saying what went wrong."""
    base = _base(args)
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            error = json.loads(e.read()).get("error")
            message = error.get("message") if isinstance(error, dict) else error
        except (ValueError, AttributeError):
            message = e.reason
        hint = " (--api-key, or BARELLM_API_KEY)" if e.code == 401 else ""
        raise BarellmError(f"the server at {base} answered {e.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise BarellmError(f"no barellm server answers at {base} ({reason}); start one with `barellm serve`, or "
                           "give its --host and --port") from None


def _until(expires_at: str, now: float) -> str:
    try:
        t = datetime.fromisoformat(expires_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return expires_at
    left = t - now
    if left > _KEPT:
        return "kept loaded"
    if left < 60:
        return "now" if left < 1 else f"{left:.0f} seconds from now"
    if left < 3600:
        return f"{left / 60:.0f} minutes from now"
    return f"{left / 3600:.1f} hours from now"


def cmd_ps(args: argparse.Namespace) -> int:
    models = call(args, "/api/ps")["models"]
    now = datetime.now(timezone.utc).timestamp()
    rows = [(m["name"], f"{m['size'] / 1e6:.1f} MB", str(m.get("context_length", "")), str(m.get("in_use", "")),
             m["details"].get("quantization_level", ""), _until(m["expires_at"], now)) for m in models]
    header = ("NAME", "SIZE", "CONTEXT", "IN USE", "QUANT", "UNTIL")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _bare(name: str) -> str:
    return name.lower().removesuffix(":latest")


def cmd_stop(args: argparse.Namespace) -> int:
    loaded = [m["name"] for m in call(args, "/api/ps")["models"]]
    match = next((n for n in loaded if _bare(n) == _bare(args.model)), None)
    if match is None:
        running = ", ".join(_bare(n) for n in loaded) or "none"
        raise ModelNotFound(f"{args.model} is not loaded in the server at {_base(args)} (loaded: {running})")
    model = _bare(match)
    answer = call(args, "/api/generate", {"model": model, "keep_alive": 0})
    if answer.get("done_reason") != "unload":
        raise BarellmError(f"the server did not unload {model}: {answer}")
    # it unloads once its requests are done: wait for that, as `ollama stop` does
    deadline = time.monotonic() + 600
    while any(_bare(m["name"]) == model for m in call(args, "/api/ps")["models"]):
        if time.monotonic() > deadline:
            raise BarellmError(f"{model} is still loaded after 10 minutes: its requests have not ended")
        time.sleep(0.2)
    print(f"stopped {model}")
    return 0
