"""What one render of a chat template may spend, and the errors a render raises past it or on purpose.

Apart from sandbox.py (which holds the Jinja machinery that enforces them) so that naming them costs no
Jinja import: a model loads without importing Jinja when its template passed the load-time probe before.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RenderLimits", "TemplateLimit", "TemplateRaised"]


@dataclass(frozen=True)
class RenderLimits:
    """What one render of a chat template may spend. The defaults are far above what real templates
    need (a few thousand steps, kilobytes of text, well under a millisecond of work per message) and far
    below what would hurt a server."""

    seconds: float = 1.0           # wall time of one render
    max_steps: int = 1 << 20       # loop iterations, calls, look-ups, operators, filters, outputs
    max_value: int = 1 << 20       # characters or items of any one value the template builds
    max_memory: int = 1 << 26      # bytes of values and text built, summed over the render
    max_output: int = 1 << 22      # characters of rendered text
    max_nesting: int = 8           # for-loops inside one another
    max_source: int = 1 << 18      # characters of template source


class TemplateLimit(Exception):
    """A render ran past one of its RenderLimits."""


class TemplateRaised(Exception):
    """raise_exception() called by a template: the template rejects the conversation."""
