"""The command line's front end: run, chat, pull, list, rm, create, info, convert, verify (commands), show,
ps and stop (show, running_server), bench, perplexity, kld, debug, inspect. Each subcommand lives in the module
that owns its subject; `barellm` (barellm/__main__.py) puts these beside the server's `serve` in one parser.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the command line's commands to the `barellm` parser, in the order --help lists them."""
    from barellm.cli import bench, commands, debug, inspect, kld, perplexity, running_server, show

    for module in (commands, inspect, show, running_server, perplexity, kld, bench, debug):
        module.register(sub)
