"""barellm on a Ray cluster: replicas of one model behind one OpenAI-compatible endpoint (Ray Serve).

    barellm serve MODEL --ray [--address ADDR] [--replicas N | --autoscale MIN,MAX] [-t T] [--port P]
    serve run barellm.serve.ray:app_builder model=smollm2-135m replicas=2 threads=1    # or a config file

Each replica is a Ray actor that loads the model with T threads and runs the same app as `barellm serve`;
a small ingress (the Router) forwards requests to them and keeps a chat on the replica that holds its
prompt. See deployments.py for how, routing.py for where, and docs/ray.md for running it.

Importing this package needs no Ray; building or serving the application does (pip install 'barellm[ray]').
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from barellm.errors import BarellmError, InvalidRequest

APP_NAME = "barellm"


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise BarellmError(f"barellm serve --ray needs Ray Serve ({e.name} is missing): "
                           "pip install 'barellm[ray]'") from None


def replica_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options each replica builds its app from (those of `barellm serve`), with the thread count fixed
    here, as it is also the CPUs Ray reserves for each replica."""
    from barellm.cpu import default_threads

    options = {k: v for k, v in vars(args).items() if k != "func"}
    options["threads"] = args.threads or default_threads()
    return options


def build_application(args: argparse.Namespace) -> Any:
    """The Ray Serve application for checked `barellm serve` options: N replicas and the Router."""
    _need_ray()
    from ray.serve.config import RequestRouterConfig

    from barellm.serve import autoscale_bounds
    from barellm.serve.ray.deployments import ReplicaDeployment, RouterDeployment, TargetedRouter

    options = replica_options(args)
    scaling: dict[str, Any]
    if args.autoscale is not None:
        lo, hi = autoscale_bounds(args.autoscale)
        # a replica whose slots are all busy is loaded: past that, requests queue
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                                          "target_ongoing_requests": args.slots}}
    else:
        scaling = {"num_replicas": args.replicas or 1}
    replica = ReplicaDeployment.options(
        ray_actor_options={"num_cpus": options["threads"]},
        # what a replica takes itself: a request per slot, its queue, and the router's /health and /metrics
        max_ongoing_requests=args.slots + args.queue + 8,
        request_router_config=RequestRouterConfig(request_router_class=TargetedRouter),
        health_check_period_s=5, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=min(args.timeout or 600, 600),
        **scaling,
    )
    # The router only relays (each streamed token costs it a few hundred microseconds of Ray's messaging):
    # one event loop for its code and for its calls to the replicas saves a thread hop per message.
    fast = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    router = RouterDeployment.options(num_replicas=args.routers or 1, max_ongoing_requests=100_000, ray_actor_options={
        "num_cpus": 0, "runtime_env": {"env_vars": fast}})
    settings = {"timeout": args.timeout, "slots": args.slots}
    return router.bind(replica.bind(options), settings)


def parse_options(config: Mapping[str, Any]) -> argparse.Namespace:
    """`barellm serve` options from a Serve config's `args` (or `serve run ... key=value`): keys are the
    long option names (dashes or underscores), model the model name or path."""
    from barellm.serve import check_args, register

    class _Parser(argparse.ArgumentParser):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **{**kw, "allow_abbrev": False})   # a misspelt key is an error

        def error(self, message: str) -> Any:   # argparse would print usage and exit
            raise InvalidRequest(f"barellm.serve.ray:app_builder args: {message}")

    parser = _Parser(prog="barellm")
    register(parser.add_subparsers(parser_class=_Parser))
    argv = ["serve", "--ray"]
    for key, value in config.items():
        if key in ("ray", "host", "port", "address"):
            raise InvalidRequest(f"barellm.serve.ray:app_builder args: {key!r} is set by Ray Serve here "
                                 "(http_options in the config file, or the cluster you deploy to)")
        if key == "model":
            argv.append(str(value))
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        elif value is not None:
            argv += [flag, str(value)]
    args = parser.parse_args(argv)
    check_args(args)
    return args


def app_builder(args: Mapping[str, Any]) -> Any:
    """The application for `serve run` / `serve deploy`: import path barellm.serve.ray:app_builder, args the
    `barellm serve` options (model, replicas or autoscale, threads, slots, context, ...)."""
    return build_application(parse_options(dict(args or {})))


def serve_on_ray(args: argparse.Namespace) -> int:
    """`barellm serve --ray`: deploys the application on a Ray cluster and serves it until interrupted;
    then takes it down (and the local cluster, if this command started one)."""
    _need_ray()
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
