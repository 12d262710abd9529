"""Fill-in-the-middle: the prompt a code model completes the hole between a prefix and a suffix from.

A FIM-trained model reads its own marker tokens. They are found as llama.cpp finds them: the file's
tokenizer.ggml.fim_*_token_id keys (and the older prefix/suffix/middle_token_id ones), else the vocabulary
entries of the known families (Qwen's <|fim_prefix|>, StarCoder's and Granite's <fim_prefix>, CodeLlama's
<PRE>, DeepSeek's, ...). Prefix, suffix and middle are required; a model without them cannot infill.

The prompt of /infill and of Model.infill() is llama.cpp server's /infill layout (PSM order), Qwen2.5-Coder's
repository-level format; OpenAI's suffix on /v1/completions uses the last line alone:

    <|repo_name|>myproject\n                         (when the model has a repository token)
    <|file_sep|>{filename}\n{text}                    (each extra file; without a separator token, the text
    ...                                                after a "--- snippet ---" line)
    <|file_sep|>filename\n
    <|fim_prefix|>{prefix}{prompt}<|fim_suffix|>{suffix}<|fim_middle|>

Each piece is tokenized on its own, without special-token parsing (code may contain marker text) and without
BOS (a BOS, when the model wants one, goes right before the prefix marker). What does not fit is cut as
llama.cpp cuts it: the prefix keeps its end, the suffix its beginning, the extra context its end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from barellm.errors import InvalidRequest

__all__ = ["FimTokens", "end_rules", "fim_tokens", "infill_ids"]

# vocabulary entries per role, as llama.cpp's loader recognizes them
_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_KEYS = {"pre": ("fim_pre", "prefix"), "suf": ("fim_suf", "suffix"), "mid": ("fim_mid", "middle"),
         "pad": ("fim_pad",), "rep": ("fim_rep",), "sep": ("fim_sep",)}

REPO_NAME = "myproject\n"       # what llama.cpp's server writes after the repository token
CURRENT_FILE = "filename\n"     # and after the last file separator
SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None      # repository name
    sep: int | None = None      # file separator


def fim_tokens(metadata: Mapping[str, Any], tokenizer: Any) -> FimTokens | None:
    """The model's fill-in-the-middle tokens, or None when it has no prefix, suffix and middle markers."""
    found: dict[str, int | None] = {}
    for role, keys in _KEYS.items():
        tid = None
        for k in keys:
            v = metadata.get(f"tokenizer.ggml.{k}_token_id")
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < tokenizer.vocab_size:
                tid = v
                break
        if tid is None:
            tid = next((i for i in map(tokenizer.token_to_id, _TEXTS[role]) if i is not None), None)
        found[role] = tid
    pre, suf, mid = found["pre"], found["suf"], found["mid"]
    if pre is None or suf is None or mid is None:
        return None
    return FimTokens(pre, suf, mid, found["pad"], found["rep"], found["sep"])


def infill_ids(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, *,
               extra: Sequence[Mapping[str, str]] = (), prompt: str = "", n_ctx: int, n_predict: int,
               repo_level: bool = True) -> list[int]:
    """The token ids of the infill prompt (module docstring), cut to leave n_predict tokens of the context.
    repo_level False: the bare <|fim_prefix|>...<|fim_suffix|>...<|fim_middle|> without the repository and
    file lines (OpenAI's suffix).

    Budget (llama.cpp server's, with its batch of 2048 tokens scaled down to half the context when that is
    smaller): the prefix and prompt take up to 3/4 of it, the suffix up to 1/4 less the prompt, and the
    extra context what the context holds beyond that batch and twice n_predict."""
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special=False, parse_special=False)

    for name, v in (("prefix", prefix), ("suffix", suffix), ("prompt", prompt)):
        if not isinstance(v, str):
            raise InvalidRequest(f"{name} must be a string, got {type(v).__name__}")
    if extra and not repo_level:
        raise InvalidRequest("other files (extra) go into the repository-level prompt: repo_level must be true")
    extra_ids: list[int] = []
    if fim.rep is not None and repo_level:
        extra_ids += [fim.rep] + enc(REPO_NAME)
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, Mapping):
            raise InvalidRequest(f"extra[{i}] must be an object {{\"filename\", \"text\"}}")
        text, filename = chunk.get("text", ""), chunk.get("filename", "tmp")
        if not isinstance(text, str) or not isinstance(filename, str):
            raise InvalidRequest(f"extra[{i}]: filename and text must be strings")
        if fim.sep is not None:
            extra_ids += [fim.sep] + enc(filename + "\n")
        else:
            extra_ids += enc(SNIPPET)
        extra_ids += enc(text)
    if fim.sep is not None and repo_level:
        extra_ids += [fim.sep] + enc(CURRENT_FILE)

    batch = min(2048, n_ctx // 2)
    pre_ids, suf_ids, prompt_ids = enc(prefix), enc(suffix), enc(prompt)
    n_pre = min(len(pre_ids), 3 * (batch // 4))
    n_suf = min(len(suf_ids), max(0, batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - batch - 2 * n_predict), len(extra_ids))
    head = [fim.pre] + pre_ids[len(pre_ids) - n_pre:] + prompt_ids
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        head = [tokenizer.bos_id] + head
    return extra_ids[len(extra_ids) - n_extra:] + head + [fim.suf] + suf_ids[:n_suf] + [fim.mid]


def end_rules(prefix: str, suffix: str) -> tuple[list[str], int]:
    """Where a fill ends besides the model's end token: (stop strings, minimum indentation of a new line).

    Instruct-tuned coder models (Qwen2.5-Coder-Instruct among them) often write the middle and then go on:
    the suffix again, more functions, an explanation. So a fill also ends before a line that repeats the
    suffix's first non-blank line, and before a line indented less than the line the hole is in (a dedent
    leaves the block being filled; llama.cpp server's n_indent rule, with the cursor line's indentation)."""
    first = next((line for line in suffix.split("\n") if line.strip()), None)
    stops = ["\n" + first] if first is not None else []
    line = prefix.rsplit("\n", 1)[-1]
    return stops, len(line) - len(line.lstrip(" \t"))
