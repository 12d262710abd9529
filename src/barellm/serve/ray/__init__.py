"""barellm on a Ray cluster: replicas of one model behind one OpenAI-compatible endpoint (Ray Serve).

    barellm serve MODEL --ray [--address ADDR] [--replicas N | --autoscale MIN,MAX] [-t T] [--port P]
    serve run barellm.serve.ray:app_builder model=smollm2-135m replicas=2 threads=1    # or a config file

Each replica is a Ray actor that loads the model with T threads and runs the same app as `barellm serve`;
a small ingress (the Router) forwards requests to them and keeps a chat on the replica that holds its
prompt. See application.py for the application, command.py for `--ray`, deployments.py for how, routing.py
for where, and docs/ray.md for running it.

Importing this package needs no Ray; building or serving the application does (pip install 'barellm[ray]').
"""

from barellm.serve.ray.application import APP_NAME, app_builder, build_application, parse_options, replica_options
from barellm.serve.ray.command import serve_on_ray

__all__ = ["APP_NAME", "app_builder", "build_application", "parse_options", "replica_options", "serve_on_ray"]
