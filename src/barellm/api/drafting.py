"""The drafting a `load(..., draft=...)` asks for: prompt lookup, or a draft model opened and given a native
engine the way load() opens the target. What drafting does (the drafters, the controller, the checks) is
generate/speculative/'s; this is where a name becomes a model file and an engine, as for the target.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from barellm.errors import InvalidRequest
from barellm.generate.speculative import LOOKUP, DraftModel, Speculator, check_draft_model

__all__ = ["open_draft_model", "speculator"]


def speculator(draft: str | os.PathLike[str] | None, target: Any) -> Speculator | None:
    """The drafting `draft` asks for a target Model: None (none), "lookup", or a draft model's name or path
    (refused when its vocabulary is not the target's, or when it is the target itself)."""
    if draft is None or draft is False:
        return None
    if not isinstance(draft, (str, os.PathLike)) or not os.fspath(draft):
        raise InvalidRequest(f'draft must be "lookup" or a draft model\'s name or path, got {draft!r}', "draft")
    if os.fspath(draft) == LOOKUP:
        return Speculator(target.engine)
    from barellm.store import catalog

    path = catalog.resolve(draft)
    if path.resolve() == target.path.resolve():
        raise InvalidRequest(f"{target.name} cannot draft for itself: name a smaller model of its family, "
                             'or draft="lookup"', "draft")
    return Speculator(target.engine, open_draft_model(path, target))


# A draft model computes the logits of the vocabulary's first 65,536 tokens only: Qwen2.5's byte-pair ids are
# numbered by merge order, roughly by frequency, and the 1.5B's greedy output on the bench tasks had 98-100%
# of its tokens below 65,536 (the rest only cost the draft its guess there), while the 0.5B's output matrix
# shrinks from 145 to 62 MB of the 485 MB a drafted token reads.
DRAFT_LOGIT_ROWS = 65536


def open_draft_model(path: Path, target: Any) -> DraftModel:
    """The model at path as a DraftModel of target: its vocabulary checked before anything is allocated, then
    a native engine with a slot per target slot, the target's threads, activations and KV type."""
    from barellm.arch.config import config_of
    from barellm.runtime.engine import NativeEngine, NativeUnsupported, unsupported_reason
    from barellm.store.catalog import display_name
    from barellm.store.converted import open_model
    from barellm.text.tokenizer import Tokenizer

    name = display_name(path)
    source = open_model(path)
    cfg = config_of(source)
    check_draft_model(target, name, cfg, Tokenizer.from_metadata(source.metadata))
    source.release_header()
    reason = unsupported_reason(cfg, source)
    if reason is not None or getattr(target, "engine_name", "native") != "native":
        raise InvalidRequest(f"{name} cannot draft: the native engine cannot run "
                             f"{'it' if reason else target.name} ({reason or 'the reference engine is used'})",
                             "draft")
    try:
        engine = NativeEngine(cfg, source, n_ctx=min(target.n_ctx, cfg.context_length), threads=target.threads,
                              n_slots=target.slots, activations=target.activations,
                              kv_type=target.kv_type or "f16", logit_rows=DRAFT_LOGIT_ROWS)
    except NativeUnsupported as e:
        raise InvalidRequest(f"{name} cannot draft: {e}", "draft") from None
    return DraftModel(name, source, engine, target)
