"""The OpenAI- and Ollama-compatible server: `barellm serve` (needs the extra: pip install 'barellm[server]').

The command (its options, their checks, the start) is command.py; the app it starts, built from those options,
build.py; the app's state and handlers app.py, and beside them the routes' bodies, the models loaded on demand,
the connections' rules and the shutdown. Importing this package stays cheap and works without Starlette.
"""

from barellm.serve.build import build_app
from barellm.serve.command import register

__all__ = ["build_app", "register"]
