"""barellm: a bare-metal LLM inference engine for CPUs, driven from Python."""

from barellm.errors import BarellmError, FormatError, InvalidRequest, ModelNotFound, SlotsBusy

__version__ = "0.1.0"

__all__ = ["BarellmError", "FormatError", "InvalidRequest", "ModelNotFound", "SlotsBusy", "__version__", "load",
           "Model"]


def __getattr__(name: str):
    # load() and Model pull in the model stack; importing barellm for its errors stays cheap.
    if name in ("load", "Model"):
        from barellm.api import model

        return getattr(model, name)
    raise AttributeError(f"module 'barellm' has no attribute {name!r}")
