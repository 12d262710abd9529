"""A checkpoint's SentencePiece tokenizer (tokenizer.model, a protobuf ModelProto) as GGUF's "llama" tokenizer
keys, read without the sentencepiece library, the way llama.cpp's converter takes it (Phi-3, Gemma 2).

What is read of the ModelProto: its pieces (field 1: piece text 1, score 2, type 3) and its normalizer's
add_dummy_prefix (field 3, its field 3; true unless set), which becomes tokenizer.ggml.add_space_prefix.
Every length is checked against the bytes left; a malformed file is one FormatError naming the offset.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from barellm.errors import FormatError

# SentencePiece's piece types -> GGUF's token types (llama.cpp: unknown, control, unused and byte are kept;
# normal and user-defined pieces are normal tokens)
_TYPES = {2: 2, 3: 3, 5: 5, 6: 6}
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
_MAX_FILE = 64 << 20


def _fields(buf: bytes, start: int, end: int, where: str) -> Iterator[tuple[int, int, Any, int]]:
    """(field number, wire type, value, offset) of each field of the message in buf[start:end]: an int for
    varint and fixed fields, the (start, end) of a length-delimited one."""
    i = start

    def varint(at: int) -> tuple[int, int]:
        v, shift = 0, 0
        while True:
            if at >= end or shift > 63:
                raise FormatError(f"{where}: protobuf varint at offset {at} runs past its message")
            b = buf[at]
            v |= (b & 0x7F) << shift
            at, shift = at + 1, shift + 7
            if b < 0x80:
                return v, at

    while i < end:
        at = i
        key, i = varint(i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(i)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            if i + n > end:
                raise FormatError(f"{where}: protobuf field {field} at offset {at} runs past its message")
            value, i = int.from_bytes(buf[i:i + n], "little"), i + n
        elif wire == 2:
            n, i = varint(i)
            if i + n > end:
                raise FormatError(f"{where}: protobuf field {field} at offset {at} is {n} bytes long and runs past "
                                  "its message")
            value, i = (i, i + n), i + n
        else:
            raise FormatError(f"{where}: protobuf field {field} at offset {at} has wire type {wire}, which a "
                              "SentencePiece model does not use")
        yield field, wire, value, at


def read_model(path: Path) -> tuple[list[tuple[str, float, int]], bool]:
    """The pieces (text, score, SentencePiece type) and add_dummy_prefix of a tokenizer.model."""
    where = str(path)
    try:
        buf = path.read_bytes()
    except OSError as e:
        raise FormatError(f"{where}: cannot read: {e.strerror}") from None
    if len(buf) > _MAX_FILE:
        raise FormatError(f"{where}: {len(buf)} bytes, more than a SentencePiece model's {_MAX_FILE}")
    pieces: list[tuple[str, float, int]] = []
    dummy_prefix = True
    for field, wire, value, at in _fields(buf, 0, len(buf), where):
        if field == 1 and wire == 2:
            text, score, kind = None, 0.0, NORMAL
            for f, w, v, a in _fields(buf, *value, where):
                if f == 1 and w == 2:
                    try:
                        text = buf[v[0]:v[1]].decode("utf-8")
                    except UnicodeDecodeError:
                        raise FormatError(f"{where}: piece at offset {a} is not UTF-8") from None
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v.to_bytes(4, "little"))[0]
                elif f == 3 and w == 0:
                    kind = v
            if text is None:
                raise FormatError(f"{where}: piece {len(pieces)} at offset {at} has no text")
            pieces.append((text, score, kind))
        elif field == 3 and wire == 2:  # NormalizerSpec
            for f, w, v, _ in _fields(buf, *value, where):
                if f == 3 and w == 0:
                    dummy_prefix = bool(v)
    if not pieces:
        raise FormatError(f"{where}: no pieces; not a SentencePiece model")
    return pieces, dummy_prefix


def vocab(root: Path, n_vocab: int, tokenizer_json: Any,
          tokenizer_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """tokenizer.ggml.* of a SentencePiece checkpoint, as llama.cpp's converter makes them: the pieces, then the
    added tokens (added_tokens.json, tokenizer.json's, tokenizer_config.json's added_tokens_decoder) as
    user-defined tokens (control ones if special) of score -1000, ids past the pieces as unused "[PADi]"."""
    where = root / "tokenizer.model"
    pieces, dummy_prefix = read_model(where)
    if len(pieces) > n_vocab:
        raise FormatError(f"{where}: {len(pieces)} pieces, more than the {n_vocab}-row embedding has")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [UNUSED] * n_vocab
    for i, (text, score, kind) in enumerate(pieces):
        tokens[i], scores[i], types[i] = text, score, _TYPES.get(kind, NORMAL)

    def add(tid: Any, text: Any, special: bool, what: str) -> None:
        if isinstance(tid, str) and tid.isdigit():
            tid = int(tid)
        if not isinstance(tid, int) or isinstance(tid, bool) or not isinstance(text, str):
            raise FormatError(f"{what}: bad added token {text!r:.60} (id {tid!r:.20})")
        if not 0 <= tid < n_vocab:
            raise FormatError(f"{what}: added token {text!r:.60} has id {tid}, outside the {n_vocab}-row embedding")
        tokens[tid], scores[tid], types[tid] = text, -1000.0, CONTROL if special else USER_DEFINED

    added = root / "added_tokens.json"
    if added.is_file():
        try:
            extra = json.loads(added.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise FormatError(f"{added}: cannot read it as JSON: {e}") from None
        if not isinstance(extra, dict):
            raise FormatError(f"{added}: not an object of token -> id")
        for text, tid in extra.items():
            add(tid, text, False, str(added))
    listed = tokenizer_json.get("added_tokens") if isinstance(tokenizer_json, dict) else None
    for t in listed or []:
        if not isinstance(t, dict):
            raise FormatError(f"{root / 'tokenizer.json'}: bad added token {t!r:.80}")
        add(t.get("id"), t.get("content"), bool(t.get("special")), str(root / "tokenizer.json"))
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise FormatError(f"{root / 'tokenizer_config.json'}: added_tokens_decoder is not an object")
    for tid, t in decoder.items():
        content = t.get("content") if isinstance(t, dict) else None
        add(tid, content, bool(isinstance(t, dict) and t.get("special")), str(root / "tokenizer_config.json"))
    md: dict[str, Any] = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
                          "tokenizer.ggml.token_type": types, "tokenizer.ggml.add_space_prefix": dummy_prefix}
    md_types = {"tokenizer.ggml.model": "string", "tokenizer.ggml.pre": "string",
                "tokenizer.ggml.tokens": "array[string]", "tokenizer.ggml.scores": "array[float32]",
                "tokenizer.ggml.token_type": "array[int32]", "tokenizer.ggml.add_space_prefix": "bool"}
    return md, md_types
