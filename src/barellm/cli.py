"""The `barellm` command. Each subcommand lives in the module that owns its subject; this file only
builds the parser, turns barellm errors into one line on stderr and a non-zero exit, and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from barellm.errors import BarellmError

# each module has register(subparsers), which adds its command(s) to the parser
COMMAND_MODULES = [
    "barellm.commands",
    "barellm.tools.inspect",
    "barellm.tools.perplexity",
    "barellm.tools.kld",
    "barellm.tools.bench",
    "barellm.tools.debug",
    "barellm.serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="barellm",
        description="A bare-metal LLM inference engine for CPUs. Models are given by name "
                    "(smollm2-135m, the default; gemma3-270m) or by path to a .gguf or .blm file.",
    )
    from barellm import __version__

    parser.add_argument("--version", action="version", version=f"barellm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BarellmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
