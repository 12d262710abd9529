"""Command-line options the commands share (model loading, sampling)."""

from __future__ import annotations

import argparse


def add_activations_arg(p: argparse.ArgumentParser) -> None:
    from barellm.model import ACTIVATIONS

    p.add_argument("--activations", choices=ACTIVATIONS, default=ACTIVATIONS[0],
                   help="native engine: activation precision of the quantized matmuls; q8x2 (default): ~15 bits, "
                        "logits closest to the float reference; q8: 8-bit blocks, faster prefill")


def add_model_args(p: argparse.ArgumentParser, *, engine: bool = True) -> None:
    """The options every command that loads a model shares."""
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: physical cores)")
    p.add_argument("-c", "--context", type=int, default=None,
                   help="context size in tokens (default: min(4096, the model's))")
    if engine:
        p.add_argument("--engine", choices=["auto", "native", "reference"], default="auto",
                       help="native: the C core; reference: the NumPy float32 forward (slow, exact); "
                            "auto (default): native where it runs the model, else reference")
        add_activations_arg(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=None, help="tokens to generate at most")
    p.add_argument("--temperature", "--temp", type=float, default=None, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens, 0 = off (default 40)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, 1 = off (default 0.95)")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min_p x the top probability (0.05)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="penalize recent tokens, 1 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="makes a sampled run reproducible")
    p.add_argument("--stop", action="append", default=None, help="stop at this string (repeatable)")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    kw = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed, "stop": args.stop,
    }
    return {k: v for k, v in kw.items() if v is not None}
