"""The Ray Serve application of `barellm serve` options: the replicas (each the app `barellm serve` runs) and
the Router in front of them (deployments.py), built from the command line's options or from a Serve config's
args (app_builder, the import path `serve run` and `serve deploy` take)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from barellm.errors import BarellmError, InvalidRequest

APP_NAME = "barellm"


def need_ray() -> None:
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
    need_ray()
    from ray.serve.config import RequestRouterConfig

    from barellm.serve.command import autoscale_bounds
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
    from barellm.serve.command import check_args, register

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
