"""Command-line options the commands share (model loading, sampling, chat), and the help layout of them all."""

from __future__ import annotations

import argparse
from typing import Any


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


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    from barellm.generate.generation import DEFAULT_MAX_TOKENS
    from barellm.generate.sampling import SamplingParams

    d = SamplingParams()
    p.add_argument("-n", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens to generate at most (default: no limit, until the end of generation or the context "
                        "is full; a reply a limit cuts short gets a note on stderr)")
    p.add_argument("--temperature", "--temp", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="keep the k most likely tokens, 0 = off")
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass, 1 = off")
    p.add_argument("--min-p", type=float, default=d.min_p, help="drop tokens below min_p x the top probability")
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help="penalize recent tokens, 1 = off")
    p.add_argument("--seed", type=int, default=None, help="makes a sampled run reproducible (default: random)")
    p.add_argument("--stop", action="append", default=None, help="stop at this string (repeatable)")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--template", default=None,
                   help="a built-in chat template (chatml, gemma) to use instead of the file's; on a base model it "
                        "turns the plain continuation into a chat (default: the file's template)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed, "stop": args.stop,
    }
    return {k: v for k, v in kw.items() if v is not None}


def check_sampling_args(args: argparse.Namespace) -> None:
    """Refuses sampling option values no generation could run with, before a model is loaded or anything is
    printed (`run` echoes its prompt first)."""
    from barellm.errors import InvalidRequest
    from barellm.generate.sampling import SamplingParams

    if args.max_tokens is not None and args.max_tokens < 0:
        raise InvalidRequest(f"-n/--max-tokens must be an integer >= 0, got {args.max_tokens}")
    fields = SamplingParams.__dataclass_fields__
    SamplingParams().with_(**{k: v for k, v in sampling_kwargs(args).items() if k in fields}).validated()
