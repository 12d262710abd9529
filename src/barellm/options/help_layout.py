"""The help layout of every barellm command: each option's default shown beside it."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.HelpFormatter):
    """Every option that takes a value shows its default in --help: the value itself, or "none" where
    leaving it out means "not set". A help text that already says what its default is stays as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or action.required or "default" in text
                or action.default is argparse.SUPPRESS):
            return text
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter, keeping the description's own line breaks (commands whose description is a docstring)."""


def with_defaults_in_help(parser: argparse.ArgumentParser) -> None:
    """Gives a parser the formatter that shows defaults, keeping a raw description raw."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)  # type: ignore[arg-type]
    parser.formatter_class = RawDescriptionHelpFormatter if raw else HelpFormatter
