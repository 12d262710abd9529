"""The tokenizer's special tokens, as llama.cpp reads them from a model file's metadata: the token types, the
ids the file names (BOS, EOS, ...), which tokens end a generation, and the order and tries in which special
tokens' texts are found in raw text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from barellm.errors import FormatError
from barellm.text.vocab import _key, _Trie

__all__ = ["TokenType", "EOG_TEXTS", "special_id", "end_of_generation", "special_matching"]


class TokenType:
    """GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens that end a turn even when the file does not name them; llama.cpp matches the same texts, so a
# model that writes <|im_end|> stops here as it does there.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
    # fill-in-the-middle separators: the model has left the region it was asked to fill
    "<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
    "<|file_sep|>",
})

_SPECIAL_KINDS = re.compile(b"[" + bytes((TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)) + b"]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def special_id(md: Mapping[str, Any], name: str, n: int) -> int | None:
    """tokenizer.ggml.<name>_token_id, checked to be in a vocabulary of n tokens; None when the file has none."""
    v = _key(md, f"{name}_token_id", int)
    if v is not None and not 0 <= v < n:
        raise FormatError(f"tokenizer.ggml.{name}_token_id: {v} is outside the vocabulary (0..{n - 1})")
    return v


def end_of_generation(token_to_id: Mapping[str, int], types: bytearray, named: tuple[int | None, ...]) -> set[int]:
    """The ids that end a generation: those the file names (EOS, EOT, EOM), the vocabulary's turn ends
    (EOG_TEXTS, each made a control token in `types` if it is not special already) and harmony's rule."""
    eog = {i for i in named if i is not None}
    for text in EOG_TEXTS:
        i = token_to_id.get(text)
        if i is not None:
            eog.add(i)
            # a turn end must never be produced from plain text nor printed as content
            if types[i] not in (TokenType.CONTROL, TokenType.USER_DEFINED):
                types[i] = TokenType.CONTROL
    # harmony's vocabulary (gpt-oss): <|return|> ends the answer and <|call|> a tool call, while <|end|>
    # only ends a message (the reasoning's, before the answer's), so it is no end of generation there
    # (llama.cpp's rule for this vocabulary)
    ret, call, end = (token_to_id.get(t) for t in ("<|return|>", "<|call|>", "<|end|>"))
    if ret is not None and call is not None:
        eog |= {ret, call}
        if end is not None:
            eog.discard(end)
    return eog


def special_matching(tokens: list[str], types: bytearray) -> tuple[dict[int, int], _Trie, _Trie]:
    """How special tokens are cut out of raw text: each special token's rank (llama.cpp tries the longest
    texts, in bytes, first; ties by id, for a deterministic order), the trie of every special token's text and
    that of the user-defined ones only (matched even without parse_special)."""
    specials = [i for i in (m.start() for m in _SPECIAL_KINDS.finditer(types)) if tokens[i]]
    for i in specials:
        # a special token is matched in the text as written, and text is valid Unicode: one whose bytes
        # are not UTF-8 (kept by the reader as lone surrogates) could never be written, only break things
        if _SURROGATE.search(tokens[i]):
            raw = tokens[i].encode("utf-8", "surrogateescape")
            raise FormatError(f"tokenizer.ggml.tokens[{i}]: special token {raw!r} is not valid UTF-8")
    specials.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
    rank = {tid: r for r, tid in enumerate(specials)}
    every, user = _Trie(), _Trie()
    for tid in specials:
        every.add(tokens[tid], tid)
        if types[tid] == TokenType.USER_DEFINED:
            user.add(tokens[tid], tid)
    every.finish()
    user.finish()
    return rank, every, user
