"""Tiny reasoning models: the tiny llama of tiny_model.py with a real reasoning model's chat template and the
special tokens it speaks (gpt-oss's harmony tokens; Qwen3's <think> tags), so that a grammar can make its
output hold the markers, decoded and split by the real generation path."""

from __future__ import annotations

from pathlib import Path

import tiny_model
from tiny_model import write_tiny_llama

DATA = Path(__file__).parent / "data"

HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>"]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def template(name: str) -> str:
    return (DATA / f"{name}_chat_template.jinja").read_text(encoding="utf-8")


def _write(path: Path, specials: list[str], user_defined: set[str], chat_template: str, bos: str, eos: str) -> Path:
    original = tiny_model.tiny_llama_metadata

    def metadata(**kw):
        md, _ = original(**kw)
        n_old = 3   # the tiny model's own specials come first
        tokens = specials + md["tokenizer.ggml.tokens"][n_old:]
        types = [4 if t in user_defined else 3 for t in specials] + md["tokenizer.ggml.token_type"][n_old:]
        md.update({"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                   "tokenizer.ggml.bos_token_id": specials.index(bos),
                   "tokenizer.ggml.eos_token_id": specials.index(eos),
                   "tokenizer.ggml.padding_token_id": specials.index("<|endoftext|>"),
                   "tokenizer.chat_template": chat_template})
        md.pop("tokenizer.ggml.unknown_token_id", None)
        return md, len(tokens)

    tiny_model.tiny_llama_metadata = metadata
    try:
        return write_tiny_llama(path, ctx=1024)
    finally:
        tiny_model.tiny_llama_metadata = original


def write_harmony(path: Path) -> Path:
    """gpt-oss's template and harmony tokens (eos <|return|>, as gpt-oss's files have it)."""
    return _write(path, HARMONY_SPECIALS, set(), template("gpt-oss"), "<|startoftext|>", "<|return|>")


def write_qwen3(path: Path) -> Path:
    """Qwen3's template, ChatML's tokens and <think> </think> (user-defined tokens, as in Qwen3's files)."""
    return _write(path, QWEN3_SPECIALS, {"<think>", "</think>"}, template("qwen3"), "<|endoftext|>", "<|im_end|>")


def write_r1(path: Path) -> Path:
    """DeepSeek-R1-Distill's template (its prompt ends inside <think>), with Qwen3's tokens for the rest."""
    specials = QWEN3_SPECIALS + ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    return _write(path, specials, {"<think>", "</think>", "<｜User｜>", "<｜Assistant｜>"},
                  template("deepseek-r1-distill"), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


# what the grammars make the tiny models write (llguidance's Lark; special tokens named bare)
HARMONY_REPLY = ('start: <|channel|> "analysis" <|message|> "Two and two make four." <|end|> <|start|> "assistant" '
                 '<|channel|> "final" <|message|> "Four."\n')
HARMONY_CALL = ('start: <|channel|> "analysis" <|message|> "Need the weather." <|end|> <|start|> "assistant" '
                '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
                '"{\\"city\\": \\"Paris\\"}"\n')
THINK_REPLY = 'start: <think> "\\nTwo and two make four.\\n" </think> "\\n\\nFour."\n'
INSIDE_REPLY = 'start: "Two and two make four.\\n" </think> "\\n\\nFour."\n'
