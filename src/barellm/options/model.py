"""The options of every command that loads a model, whichever front end runs it: threads, context, the
engine and its precisions, the KV cache's type, a checksum pass, and drafting (speculative decoding)."""

from __future__ import annotations

import argparse


def add_activations_arg(p: argparse.ArgumentParser) -> None:
    from barellm.api.model import ACTIVATIONS

    p.add_argument("--activations", choices=ACTIVATIONS, default=ACTIVATIONS[0],
                   help="native engine: activation precision of the quantized matmuls; q8x2 (default): ~15 bits, "
                        "logits closest to the float reference; q8: 8-bit blocks, faster prefill")
    add_kv_type_arg(p)


def add_kv_type_arg(p: argparse.ArgumentParser) -> None:
    from barellm.api.model import KV_TYPES

    p.add_argument("--kv-type", choices=KV_TYPES, default=None,
                   help="what the KV cache holds: f16 (the native default), q8_0 (8-bit blocks: 53%% of f16's "
                        "memory, for long contexts and many slots) or f32")


def add_model_args(p: argparse.ArgumentParser, *, engine: bool = True) -> None:
    """The options every command that loads a model shares."""
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: physical cores)")
    p.add_argument("-c", "--context", type=int, default=None,
                   help="context size in tokens (default: min(4096, the model's))")
    p.add_argument("--verify", action="store_true",
                   help="check every tensor of the model file against its checksum before running it "
                        "(every load checks a sample of them)")
    if engine:
        p.add_argument("--engine", choices=["auto", "native", "reference"], default="auto",
                       help="native: the C core; reference: the NumPy float32 forward (slow, exact); "
                            "auto (default): native where it runs the model, else reference")
        add_activations_arg(p)


def add_draft_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", default=None, metavar="lookup|MODEL",
                   help="speculative decoding, the output unchanged: 'lookup' drafts from the prompt and the text so "
                        "far (code edits), MODEL a smaller model of the same vocabulary drafts (e.g. "
                        "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b); it turns itself off where it does not pay")


def check_draft(args: argparse.Namespace) -> None:
    """Refuses a --draft that names no model, before anything is loaded (a registered model not yet pulled
    passes: loading pulls it)."""
    from barellm.store import catalog

    draft = getattr(args, "draft", None)
    if draft is None or draft == "lookup" or catalog.can_resolve(draft):
        return
    raise catalog.unknown_model(draft)
