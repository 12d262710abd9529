"""The command-line options the front ends share (the command line's commands, cli/, and the server's, serve/),
below both so that neither imports the other: the options of a command that loads a model (model) and the help
layout of every command (help_layout)."""

from barellm.options.help_layout import HelpFormatter, RawDescriptionHelpFormatter, with_defaults_in_help
from barellm.options.model import add_activations_arg, add_draft_arg, add_kv_type_arg, add_model_args, check_draft

__all__ = ["HelpFormatter", "RawDescriptionHelpFormatter", "add_activations_arg", "add_draft_arg", "add_kv_type_arg",
           "add_model_args", "check_draft", "with_defaults_in_help"]
