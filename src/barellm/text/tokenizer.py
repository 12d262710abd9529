"""Tokenizers built from GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2") and SentencePiece ("llama").

Both follow llama.cpp's tokenizer, which reproduces the models' original tokenizers, so the ids we produce are
the ids the model was trained on:

* Special tokens are cut out of the text first. Control (and unknown) tokens only when parse_special is set;
  user-defined tokens always, as llama.cpp and Hugging Face both do. The cut is llama.cpp's: longest token
  text first, each one's occurrences left to right within the text that is still raw (special_tokens.py: the
  token types, the order and tries of that cut, and which tokens end a generation).
* Byte-level BPE splits the raw text with the pre-tokenizer named by tokenizer.ggml.pre (a list of regexes
  applied one after another, each refining the pieces of the previous one), maps each piece's UTF-8 bytes
  to GPT-2's printable byte alphabet, then merges adjacent symbols by merge rank, lowest first.
* SentencePiece replaces spaces by U+2581, merges adjacent symbols by the score of the token they form,
  highest first, and falls back to <0xNN> byte tokens for characters the vocabulary lacks.
"""

from __future__ import annotations

import array
import codecs
import heapq
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from barellm.errors import FormatError, InvalidRequest
from barellm.text.pretokenizer import _BYTE_DEC, _PRE_TOKENIZERS, _make_splitter, _to_byte_level
from barellm.text.special_tokens import _SURROGATE, TokenType, end_of_generation, special_id, special_matching
from barellm.text.vocab import _array, _checked_once, _key

__all__ = ["Tokenizer", "StreamDecoder", "TokenType"]


_SPACE = "\u2581"  # SentencePiece's visible space
_TOKEN_TYPES = bytes(range(7))  # the TokenType values
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_CACHE_LIMIT = 1 << 16  # entries per word cache; cleared when full so a server's memory stays bounded


def _links(n: int) -> tuple[list[int], list[int]]:
    """Each of n symbols' next and previous neighbour (-1: none), as merging links them."""
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    return nxt, list(range(-1, n - 1))


def _join(syms: list[str], nxt: list[int], prv: list[int], left: int, right: int) -> int:
    """Merges symbol right into its neighbour left (right becomes ""); returns left's new next (-1: none)."""
    syms[left] += syms[right]
    syms[right] = ""
    nx = nxt[right]
    nxt[left] = nx
    if nx >= 0:
        prv[nx] = left
    return nx


# --- the tokenizer -------------------------------------------------------------------------------------------

class Tokenizer:
    """Text <-> token ids for one model, built from its GGUF metadata with from_metadata()."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eog_ids: set[int]
    add_bos: bool
    add_eos: bool
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None

    def __init__(self) -> None:
        # from_metadata does the work; a bare Tokenizer() would be an empty vocabulary, useless and confusing
        raise TypeError("use Tokenizer.from_metadata(metadata)")

    # ----- construction -----

    @staticmethod
    def from_metadata(md: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF-style keys (tokenizer.ggml.*). Raises FormatError on missing or inconsistent data."""
        if not isinstance(md, Mapping):
            raise FormatError(f"tokenizer metadata must be a mapping, got {type(md).__name__}")
        self = object.__new__(Tokenizer)
        model = _key(md, "model", str, required=True)
        if model not in ("gpt2", "llama"):
            raise FormatError(f"tokenizer.ggml.model: unsupported tokenizer {model!r} (supported: gpt2, llama)")
        self.model = model

        tokens = _array(md, "tokens", str, None, required=True)
        assert tokens is not None
        n = len(tokens)
        if n == 0:
            raise FormatError("tokenizer.ggml.tokens: the vocabulary is empty")
        self.vocab_size = n
        self._tokens = tokens
        types = _array(md, "token_type", int, n)
        types = types if types is not None else [TokenType.NORMAL] * n
        try:
            kinds = bytearray(types)  # one byte a token (a 262,144-entry list of ints took 2 MB), searched as bytes
        except ValueError:  # a type outside 0..255
            kinds = None
        if kinds is None or kinds.translate(None, _TOKEN_TYPES):
            for i, t in enumerate(types):
                if not 0 <= t <= 6:
                    raise FormatError(f"tokenizer.ggml.token_type[{i}]: unknown token type {t}")
        assert kinds is not None
        self._types = kinds

        # the first id of each text (built back to front so that it wins); an empty entry can never be produced
        # by encoding, it only decodes to nothing
        self._token_to_id: dict[str, int] = dict(zip(reversed(tokens), range(n - 1, -1, -1), strict=True))
        self._token_to_id.pop("", None)
        if len(self._token_to_id) != n - tokens.count(""):  # a duplicate: name the first one
            for i, t in enumerate(tokens):
                if t and self._token_to_id[t] != i:
                    raise FormatError(f"tokenizer.ggml.tokens[{i}]: {t!r} duplicates token {self._token_to_id[t]}")

        self.bos_id, self.eos_id, self.unk_id, self.pad_id, eot_id, eom_id = (
            special_id(md, name, n) for name in ("bos", "eos", "unknown", "padding", "eot", "eom"))

        # llama.cpp's defaults: SentencePiece models add BOS unless told otherwise, byte-level BPE ones do not
        add_bos = _key(md, "add_bos_token", bool)
        self.add_bos = add_bos if add_bos is not None else model == "llama"
        add_eos = _key(md, "add_eos_token", bool)
        self.add_eos = bool(add_eos)
        if self.add_bos and self.bos_id is None:
            raise FormatError("tokenizer.ggml.add_bos_token is set but tokenizer.ggml.bos_token_id is missing")
        if self.add_eos and self.eos_id is None:
            raise FormatError("tokenizer.ggml.add_eos_token is set but tokenizer.ggml.eos_token_id is missing")

        self.eog_ids = end_of_generation(self._token_to_id, kinds, (self.eos_id, eot_id, eom_id))

        self._special_rank, self._trie_all, self._trie_user = special_matching(tokens, kinds)

        self._piece_cache: dict[int, bytes] = {}  # filled as tokens are decoded (a list of the whole vocabulary: 2 MB)
        self._word_cache: dict[str, tuple[int, ...]] = {}
        self.pre = _key(md, "pre", str)
        add_prefix = _key(md, "add_space_prefix", bool)
        if model == "gpt2":
            self._init_bpe(md)
            self.add_space_prefix = False
        else:
            self._init_spm(md)
            # SentencePiece's "dummy prefix": llama.cpp adds it unless the file says not to
            self.add_space_prefix = add_prefix if add_prefix is not None else True
        return self

    def _init_bpe(self, md: Mapping[str, Any]) -> None:
        pre = self.pre if self.pre is not None else "gpt-2"
        if pre not in _PRE_TOKENIZERS:
            known = ", ".join(sorted(_PRE_TOKENIZERS))
            raise FormatError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r} (supported: {known})")
        regexes, self._ignore_merges = _PRE_TOKENIZERS[pre]
        self._split = _make_splitter(regexes)
        merges = _array(md, "merges", str, None, required=True)
        assert merges is not None
        # Ranks are keyed by the merge's own text "a b" (the first space after the first character separates
        # the halves; a half may itself be " "), so building them is one dict of the lines: Qwen's 151,387
        # merges split into pairs one by one took most of a second of start-up. Byte-level symbols never hold
        # a space, so "a" + " " + "b" finds exactly the line of the pair (a, b).
        n = len(merges)
        self._ranks = dict(zip(reversed(merges), range(n - 1, -1, -1), strict=True))  # the first rank wins
        _checked_once(("bpe-merges", self._tokens, merges), lambda: self._check_merges(merges))

    def _check_merges(self, merges: list[str]) -> None:
        """Every merge is two tokens separated by a space, and both halves and their join are tokens."""
        vocab = self._token_to_id
        for rank, line in enumerate(merges):
            cut = line.find(" ", 1)
            if cut < 0:
                raise FormatError(f"tokenizer.ggml.merges[{rank}]: {line!r} is not two tokens separated by a space")
            a, b = line[:cut], line[cut + 1:]
            for part in (a, b, a + b):
                if part not in vocab:
                    raise FormatError(f"tokenizer.ggml.merges[{rank}]: {line!r} refers to {part!r}, which is "
                                      "not in the vocabulary")

    def _init_spm(self, md: Mapping[str, Any]) -> None:
        # float32 in an array, not a list of floats (a 262,144-entry vocabulary: 1 MB instead of 8), as the file
        # stores them; a float array from the file (the .blm reader hands numeric arrays over as views) goes in
        # without Python floats
        raw = md.get("tokenizer.ggml.scores")
        if getattr(raw, "dtype", None) is not None and raw.dtype.kind == "f" and raw.ndim == 1:
            if len(raw) != self.vocab_size:
                raise FormatError(f"tokenizer.ggml.scores: {len(raw)} entries for {self.vocab_size} tokens")
            self._scores = array.array("f", raw.astype("<f4", copy=False).tobytes())
        else:
            scores = _array(md, "scores", (float, int), self.vocab_size)
            self._scores = array.array("f", scores if scores is not None else bytes(4 * self.vocab_size))
        vocab = self._token_to_id
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = vocab.get(f"<0x{b:02X}>")
            if tid is None and b < 128:
                tid = vocab.get(chr(b))
            self._byte_ids.append(tid)
        byte = TokenType.BYTE
        for i in (i for i, t in enumerate(self._types) if t == byte):
            if not _BYTE_PIECE.fullmatch(self._tokens[i]):
                raise FormatError(f"tokenizer.ggml.tokens[{i}]: byte token {self._tokens[i]!r} is not <0xNN>")
        # A merge can only join two symbols if the joined text is a token, so a boundary between two
        # characters that no token contains side by side is never crossed. Words start at U+2581; those
        # boundaries are safe unless some token has "<c>▁" inside it. Cutting the text there lets each word
        # be merged (and cached) on its own with exactly the result of merging the whole text.
        # (a regex pass over the tokens joined, a batch at a time: the whole vocabulary joined took 7 MB at once)
        glue: set[str] = set()
        tokens = self._tokens
        after = re.compile(f"([^\0])(?={_SPACE})")
        for i in range(0, len(tokens), 16384):
            batch = tokens[i:i + 16384]
            joined = "\0".join(batch)
            if joined.count("\0") != len(batch) - 1:  # a token holds the separator
                break
            glue.update(after.findall(joined))
        else:
            tokens = []
        if tokens:  # the slow way
            glue = set()
            for t in tokens:
                k = t.find(_SPACE, 1)
                while k > 0:
                    glue.add(t[k - 1])
                    k = t.find(_SPACE, k + 1)
        look = "".join(sorted(glue))
        self._spm_cut = re.compile(f"(?<![{re.escape(look)}])(?={_SPACE})" if look else f"(?={_SPACE})")

    # ----- encoding -----

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text. add_special applies the model's BOS/EOS rule; parse_special reads control
        tokens written in the text (e.g. "<|im_start|>") as those tokens rather than as characters."""
        if not isinstance(text, str):
            raise InvalidRequest(f"text to tokenize must be a str, got {type(text).__name__}")
        bad = _SURROGATE.search(text)
        if bad:
            # a lone surrogate has no UTF-8 form, so no token sequence could stand for it
            raise InvalidRequest(f"text has a lone surrogate U+{ord(bad.group()):04X} at {bad.start()}; "
                                 "it is not valid Unicode")
        out: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "gpt2":
                self._encode_bpe(frag, out)
            else:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                self._encode_spm(frag, out)
            prev_special = False
        if add_special and self.add_eos:
            assert self.eos_id is not None
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Text split into raw pieces (str) and special tokens (int), llama.cpp's way."""
        if not text:
            return []
        trie = self._trie_all if parse_special else self._trie_user
        if not trie:
            return [text]
        found = trie.present(text)
        if not found:
            return [text]
        tokens = self._tokens
        claimed = bytearray(len(text))
        taken: list[tuple[int, int, int]] = []
        for tid in sorted(found, key=self._special_rank.__getitem__):
            # llama.cpp: longest token first, its occurrences left to right, each taken only if all of it
            # is still raw text (not inside a longer token taken earlier, nor an earlier one of its own)
            t = tokens[tid]
            size = len(t)
            p = text.find(t)
            while p >= 0:
                hit = claimed.find(1, p, p + size)
                if hit < 0:
                    claimed[p:p + size] = b"\x01" * size
                    taken.append((p, size, tid))
                    p = text.find(t, p + size)
                    continue
                # any later start before the end of the taken stretch it ran into overlaps it as well
                free = claimed.find(0, hit)
                if free < 0:
                    break
                p = text.find(t, free)
        taken.sort()
        out: list[str | int] = []
        last = 0
        for start, length, tid in taken:
            if start > last:
                out.append(text[last:start])
            out.append(tid)
            last = start + length
        if last < len(text):
            out.append(text[last:])
        return out

    def _remember(self, key: str, ids: tuple[int, ...]) -> None:
        if len(self._word_cache) >= _CACHE_LIMIT:
            self._word_cache.clear()
        self._word_cache[key] = ids

    def _encode_bpe(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for piece in self._split(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(_to_byte_level(piece))
                self._remember(piece, ids)
            out.extend(ids)

    def _bpe(self, word: str) -> tuple[int, ...]:
        vocab = self._token_to_id
        if self._ignore_merges and word in vocab:
            return (vocab[word],)
        syms = list(word)
        n = len(syms)
        if n > 1:
            ranks = self._ranks
            nxt, prv = _links(n)
            heap: list[tuple[int, int, int, str, str]] = []
            for i in range(n - 1):
                r = ranks.get(syms[i] + " " + syms[i + 1])
                if r is not None:
                    heap.append((r, i, i + 1, syms[i], syms[i + 1]))
            heapq.heapify(heap)
            # lowest rank first, leftmost on ties (llama.cpp's order); an entry whose symbols have changed
            # since it was queued is stale and skipped
            while heap:
                _, left, right, a, b = heapq.heappop(heap)
                if syms[left] != a or syms[right] != b:
                    continue
                nx = _join(syms, nxt, prv, left, right)
                p = prv[left]
                if p >= 0:
                    r = ranks.get(syms[p] + " " + syms[left])
                    if r is not None:
                        heapq.heappush(heap, (r, p, left, syms[p], syms[left]))
                if nx >= 0:
                    r = ranks.get(syms[left] + " " + syms[nx])
                    if r is not None:
                        heapq.heappush(heap, (r, left, nx, syms[left], syms[nx]))
        return self._ids(syms, self._bpe_bytes)

    def _bpe_bytes(self, symbol: str) -> list[int]:
        """A merged symbol that is no token: its (byte-level) bytes one by one."""
        vocab = self._token_to_id
        return [tid if (tid := vocab.get(ch)) is not None else self._unknown(ch) for ch in symbol]

    def _ids(self, syms: list[str], spell: Callable[[str], list[int]]) -> tuple[int, ...]:
        """The ids of the symbols merging left ("" once merged away); spell gives a non-token symbol's ids."""
        vocab = self._token_to_id
        ids: list[int] = []
        for s in syms:
            if s:
                tid = vocab.get(s)
                if tid is not None:
                    ids.append(tid)
                else:
                    ids.extend(spell(s))
        return tuple(ids)

    def _unknown(self, what: str) -> int:
        if self.unk_id is None:
            raise InvalidRequest(f"the vocabulary cannot represent {what!r} and has no unknown token")
        return self.unk_id

    def _encode_spm(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for word in self._spm_cut.split(text.replace(" ", _SPACE)):
            if not word:
                continue
            ids = cache.get(word)
            if ids is None:
                ids = self._spm(word)
                self._remember(word, ids)
            out.extend(ids)

    def _spm(self, text: str) -> tuple[int, ...]:
        vocab = self._token_to_id
        scores = self._scores
        syms = list(text)
        n = len(syms)
        nxt, prv = _links(n)
        heap: list[tuple[float, int, int, int]] = []

        def bigram(left: int, right: int) -> None:
            joined = syms[left] + syms[right]
            tid = vocab.get(joined)
            if tid is not None:
                # highest score first, leftmost on ties, as llama.cpp's queue orders them
                heapq.heappush(heap, (-scores[tid], left, right, len(joined)))

        for i in range(n - 1):
            bigram(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            a, b = syms[left], syms[right]
            # symbols only grow, so a changed length means the queued pair is gone
            if not a or not b or len(a) + len(b) != size:
                continue
            nx = _join(syms, nxt, prv, left, right)
            if prv[left] >= 0:
                bigram(prv[left], left)
            if nx >= 0:
                bigram(left, nx)
        return self._ids(syms, self._spm_bytes)

    def _spm_bytes(self, char: str) -> list[int]:
        """A character that is no token (merged symbols are tokens by construction): its UTF-8 bytes' tokens."""
        byte_ids = self._byte_ids
        return [tid if (tid := byte_ids[b]) is not None else self._unknown(char) for b in char.encode("utf-8")]

    # ----- decoding -----

    def _check_id(self, token_id: Any) -> int:
        try:
            i = operator.index(token_id)  # ints and NumPy integers; not floats, which would truncate silently
        except TypeError:
            raise InvalidRequest(f"token id must be an integer, got {token_id!r}") from None
        if isinstance(token_id, bool) or not 0 <= i < self.vocab_size:
            raise InvalidRequest(f"token id {token_id!r} is outside the vocabulary (0..{self.vocab_size - 1})")
        return i

    def _piece(self, i: int) -> bytes:
        """The bytes token i stands for (special tokens as their text)."""
        b = self._piece_cache.get(i)
        if b is not None:
            return b
        text = self._tokens[i]
        t = self._types[i]
        # Entries that were not valid UTF-8 in the file reach us with their bytes escaped as surrogates
        # (U+DC80..U+DCFF); surrogateescape gives the original bytes back.
        if t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            b = text.encode("utf-8", "surrogateescape")  # as-is: user-defined tokens are literal text
        elif t == TokenType.UNUSED:
            b = b""
        elif t == TokenType.BYTE and (m := _BYTE_PIECE.fullmatch(text)):
            b = bytes([int(m.group(1), 16)])
        elif self.model == "gpt2":
            buf = bytearray()
            for c in text:
                v = _BYTE_DEC.get(c)
                # a character outside the byte alphabet (a hand-edited vocabulary) is kept as itself
                buf += c.encode("utf-8", "surrogateescape") if v is None else bytes((v,))
            b = bytes(buf)
        else:
            b = text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
        self._piece_cache[i] = b
        return b

    def _skipped(self, i: int) -> bool:
        return self._types[i] in (TokenType.CONTROL, TokenType.UNKNOWN)

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes one token decodes to (may be part of a UTF-8 character)."""
        i = self._check_id(token_id)
        return b"" if skip_special and self._skipped(i) else self._piece(i)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ids. Special tokens are written as their text unless skip_special. Bytes that do not
        form valid UTF-8 become U+FFFD."""
        parts: list[bytes] = []
        first = True
        for t in ids:
            i = self._check_id(t)
            if skip_special and self._skipped(i):
                continue
            b = self._piece(i)
            if first and self.add_space_prefix and b.startswith(b" "):
                b = b[1:]  # the dummy prefix encode() added
            first = False
            parts.append(b)
        return b"".join(parts).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        """Incremental decode for generation: feed ids one at a time, get text as soon as it is whole."""
        return StreamDecoder(self, skip_special)

    # ----- vocabulary -----

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of token_id as stored in the file (e.g. "Ġworld", "▁world", "<0x0A>")."""
        return self._tokens[self._check_id(token_id)]

    def token_to_id(self, text: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._token_to_id.get(text)

    def token_type(self, token_id: int) -> int:
        """The token's TokenType (NORMAL, CONTROL, USER_DEFINED, BYTE, ...), as the file gives it."""
        return self._types[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """Whether token_id is a control token (BOS, turn markers...) that skip_special drops."""
        return self._skipped(self._check_id(token_id))

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})")


class StreamDecoder:
    """Turns ids fed one at a time into text, holding back the bytes of a character not yet complete.

    The concatenation of every feed() and the final flush() equals Tokenizer.decode() of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def feed(self, token_id: int) -> str:
        """Text completed by this token ("" while a multi-byte character is still partial)."""
        i = self._tok._check_id(token_id)
        if self._skip and self._tok._skipped(i):
            return ""
        b = self._tok._piece(i)
        if self._first and self._tok.add_space_prefix and b.startswith(b" "):
            b = b[1:]
        self._first = False
        return self._utf8.decode(b)

    def flush(self) -> str:
        """End of stream: whatever is held back (an unfinished character becomes U+FFFD). Resets."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        self._first = True
        return tail
