"""`barellm serve --ray`: the application deployed on a Ray cluster and served until interrupted, then taken
down."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from barellm.errors import BarellmError
from barellm.serve.ray.application import APP_NAME, build_application, need_ray, replica_options


def serve_on_ray(args: argparse.Namespace) -> int:
    """`barellm serve --ray`: deploys the application on a Ray cluster and serves it until interrupted;
    then takes it down (and the local cluster, if this command started one)."""
    need_ray()
    import ray
    from ray import serve

    app = build_application(args)
    threads = replica_options(args)["threads"]
    try:
        ray.init(address=args.address, logging_level=args.log_level.upper(), configure_logging=True)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise BarellmError(f"cannot join the Ray cluster at {args.address or 'this machine'}: {e}") from None
    stop = _stop_on_sigterm()
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        wanted = (args.replicas or 1) if args.autoscale is None else max(1, int(args.autoscale.split(",")[0]))
        if wanted * threads > cpus:
            print(f"barellm: warning: {wanted} replicas x {threads} threads need {wanted * threads} CPUs and the "
                  f"cluster has {cpus:g}; Ray will wait for more (lower --replicas or -t, or add machines)",
                  file=sys.stderr)
        logging = {"log_level": args.log_level.upper(), "enable_access_log": args.log_level in ("info", "debug")}
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=logging)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False, logging_config=logging)
        except RuntimeError as e:
            raise BarellmError(f"the replicas did not start: {_failure(serve, e)}") from None
        print(f"barellm: serving {(args.models or ['smollm2-135m'])[0]} on Ray: "
              f"{args.autoscale and f'{args.autoscale} (autoscaled)' or args.replicas or 1} replicas x {threads} "
              f"threads, {args.slots} slots each, on http://{args.host}:{args.port}/v1", file=sys.stderr)
        while not stop():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        try:
            serve.delete(APP_NAME)
        except Exception as e:   # the cluster may be gone already; nothing is left to take down then
            print(f"barellm: could not remove the application: {e}", file=sys.stderr)
        ray.shutdown()
    return 0


def _failure(serve: Any, error: Exception) -> str:
    """Why the application failed to deploy, in one line: the replica's own error when it raised one."""
    lines: list[str] = []
    try:
        status = serve.status().applications[APP_NAME]
        for deployment in status.deployments.values():
            lines += deployment.message.strip().splitlines()
    except Exception:   # the status is only for a better message
        pass
    ours = [line.split(": ", 1)[1] for line in lines if line.startswith("barellm.errors.") and ": " in line]
    if ours:
        return ours[-1]
    text = str(error).strip() or type(error).__name__
    return f"{text.splitlines()[0]} (the replicas' logs are in Ray's log directory, /tmp/ray/session_latest)"


def _stop_on_sigterm() -> Any:
    """SIGTERM ends the serving loop like Ctrl-C, so the replicas are taken down either way."""
    stopped = [False]

    def handler(signum: int, frame: Any) -> None:
        stopped[0] = True

    signal.signal(signal.SIGTERM, handler)
    return lambda: stopped[0]
