"""The options of the command line's generating commands (sampling, chat); those every front end's commands
share (model loading, drafting) are barellm.options'."""

from __future__ import annotations

import argparse
from typing import Any


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


REASONING_MODES = ("auto", "show", "hide")


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--template", default=None,
                   help="a built-in chat template (chatml, gemma) to use instead of the file's; on a base model it "
                        "turns the plain continuation into a chat (default: the file's template)")
    p.add_argument("--reasoning", choices=REASONING_MODES, default="auto",
                   help="a reasoning model's thinking (gpt-oss, Qwen3, DeepSeek-R1): show it (dimmed on a terminal, "
                        "between 'Thinking...' and '...done thinking.' lines elsewhere) or hide it; auto (the "
                        "default) shows it on a terminal and leaves it out of piped output. The answer is printed "
                        "either way")


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
