"""The `barellm` command (`python -m barellm`): one parser over the commands of both front ends, the command
line's (barellm.cli) and the server's (barellm.serve), which know nothing of each other and share only what lies
below them (barellm.options). This module builds that parser, turns barellm errors into one line on stderr and a
non-zero exit, and dispatches.

Options may come anywhere among a command's words, before or after them (`barellm run MODEL -n 5 "Hi"`),
as in llama.cpp and Ollama: each command's parser reads its arguments intermixed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from barellm import cli, serve
from barellm.cpu import check_isa_env, check_prefetch_env
from barellm.errors import BarellmError
from barellm.options import with_defaults_in_help

# each front end's register(subparsers) adds its commands to the parser, in this order
FRONT_ENDS = (cli.register, serve.register)


def build_parser() -> argparse.ArgumentParser:
    from barellm import __version__

    parser = argparse.ArgumentParser(
        prog="barellm",
        description="A bare-metal LLM inference engine for CPUs. Models are given by name "
                    "(`barellm list` shows them; smollm2-135m is the default) or by path to a .gguf or .blm file.",
    )
    parser.add_argument("--version", action="version", version=f"barellm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in FRONT_ENDS:
        register(sub)
    for command in sub.choices.values():
        with_defaults_in_help(command)
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each command, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """argv parsed with each command's options allowed before, between and after its positionals.

    argparse cannot read a parser with subcommands intermixed, so the command's own parser reads what
    follows the command name; anything else (no command, --version, --help, a typo) goes to the top parser,
    which prints the usage or the error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parsers = command_parsers(parser)
    if argv and argv[0] in parsers:
        args = parsers[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_isa_env()
        check_prefetch_env()
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
