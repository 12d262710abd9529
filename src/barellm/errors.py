"""Errors barellm raises on purpose. Each carries one line that says what is wrong.

The CLI prints `error: <message>` and exits non-zero for any BarellmError; anything else is a bug.
"""


class BarellmError(Exception):
    """Base of every error barellm raises on purpose."""


class FormatError(BarellmError):
    """A model file is malformed, truncated, hostile or of a kind we do not read."""


class ModelNotFound(BarellmError):
    """A model name or path that resolves to nothing."""


class InvalidRequest(BarellmError, ValueError):
    """A request (generation parameters, messages, prompt) that cannot be served. `param` names the parameter
    at fault where one is (the HTTP routes answer with it), `code` the kind of fault where it has a name
    ("context_length_exceeded")."""

    def __init__(self, message: str = "", param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class SlotsBusy(BarellmError):
    """Every KV cache slot a generation needs is held by unfinished generations that waiting cannot end."""
