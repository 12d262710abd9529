"""Tokenizer: exact parity with llama.cpp's ids on the real models, decoding, streaming, special tokens,
and the error paths, on the real vocabularies and on small hand-made ones."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
from gguf_metadata import read_metadata

from barellm.errors import FormatError, InvalidRequest
from barellm.text.tokenizer import Tokenizer

from conftest import DATA, load_data

GOLDEN = load_data("tokenizer_golden.json")["models"]


@pytest.fixture(scope="module", params=["smollm", "gemma"])
def model(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    path = request.getfixturevalue(f"{request.param}_gguf")
    return request.param, Tokenizer.from_metadata(read_metadata(path))


@pytest.fixture(scope="module")
def smollm(smollm_gguf) -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(smollm_gguf))


@pytest.fixture(scope="module")
def gemma(gemma_gguf) -> Tokenizer:
    return Tokenizer.from_metadata(read_metadata(gemma_gguf))


# --- the real models ---------------------------------------------------------------------------------------

@pytest.mark.model
def test_ids_equal_llamacpp_for_every_string_and_probe(model):
    name, tok = model
    for case in GOLDEN[name]["cases"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.encode(case["text"], add_special=True) == case["ids_add_special"], case["text"]


@pytest.mark.model
def test_smollm_splits_digits_one_by_one(smollm):
    # the byte-level BPE alone would give " 1" and "555"; SmolLM2's own tokenizer isolates every digit
    pieces = [smollm.token_text(i) for i in smollm.encode("Call 555-0100 now")]
    assert pieces == ["Call", "Ġ", "5", "5", "5", "-", "0", "1", "0", "0", "Ġnow"]
    assert [smollm.token_text(i) for i in smollm.encode("a  1")] == ["a", "ĠĠ", "1"]


@pytest.mark.model
def test_decode_golden_texts(model):
    name, tok = model
    for case in GOLDEN[name]["cases"]:
        assert tok.decode(case["ids_add_special"]) == case["decoded"]
        assert tok.decode(case["ids_add_special"], skip_special=True) == case["decoded_skip_special"]
        assert tok.decode(tok.encode(case["text"])) == case["text"]


@pytest.mark.model
def test_public_prompts_and_greedy_text(model):
    name, tok = model
    for g in GOLDEN[name]["generations"]:
        assert tok.encode(g["prompt"], add_special=True) == g["prompt_ids"]
        assert tok.decode(g["greedy_ids"]) == g["greedy_text"]
        assert tok.decode(g["prompt_ids"] + g["greedy_ids"]) == g["full_text"]


@pytest.mark.model
def test_special_ids_and_bos_rule(model):
    name, tok = model
    gold = GOLDEN[name]
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (gold["bos_id"], gold["eos_id"], gold["add_bos"])
    expected_eog = {"smollm": {"<|endoftext|>", "<|im_end|>"}, "gemma": {"<eos>", "<end_of_turn>"}}[name]
    assert {tok.token_text(i) for i in tok.eog_ids} == expected_eog
    assert tok.encode("", add_special=True) == ([tok.bos_id] if tok.add_bos else [])


@pytest.mark.model
def test_corpus_parity_roundtrip_and_speed(model, smollm_gguf, gemma_gguf):
    name, _ = model
    text = (DATA / "corpus.txt").read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) == 46507
    # a fresh tokenizer, so no word of the corpus is cached yet
    tok = Tokenizer.from_metadata(read_metadata(smollm_gguf if name == "smollm" else gemma_gguf))
    t0 = time.perf_counter()
    ids = tok.encode(text, add_special=True)
    seconds = time.perf_counter() - t0
    gold = GOLDEN[name]["corpus"]
    assert len(ids) == gold["n_tokens_add_special"]
    assert ids[:16] == gold["first_tokens"]
    assert tok.decode(ids, skip_special=True) == text
    assert seconds < 1.0, f"encoding 46 KB took {seconds:.2f} s"


@pytest.mark.model
@pytest.mark.parametrize("text", ["naïve café – “quotes” 😀", "中文分词测试", "🦙🧪 ok 👍🏽 done", "ﬁ ẞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"])
def test_stream_decoder_holds_partial_utf8(model, text):
    _, tok = model
    ids = tok.encode(text)
    dec = tok.stream_decoder()
    chunks = [dec.feed(i) for i in ids]
    chunks.append(dec.flush())
    assert "".join(chunks) == tok.decode(ids) == text
    # after each token exactly the complete characters so far are out; a partial one waits
    data = b""
    for k, i in enumerate(ids):
        data += tok.token_bytes(i)
        complete = next(data[:cut].decode("utf-8") for cut in range(len(data), -1, -1) if _valid(data[:cut]))
        assert "".join(chunks[: k + 1]) == complete
    assert chunks[-1] == ""


@pytest.mark.model
def test_stream_decoder_waits_for_the_last_byte(model):
    _, tok = model
    ids = tok.encode("𓀀𓁐")  # in neither vocabulary: four byte tokens per character
    assert len(ids) == 8
    dec = tok.stream_decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "", "𓀀", "", "", "", "𓁐"]
    assert dec.feed(ids[0]) == "" and dec.flush() == "\ufffd"  # a character cut off at the end


def _valid(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.model
def test_stream_decoder_skip_special(smollm):
    ids = smollm.encode("<|im_start|>user\nhé 😀<|im_end|>\n")
    for skip in (False, True):
        dec = smollm.stream_decoder(skip_special=skip)
        assert "".join(dec.feed(i) for i in ids) + dec.flush() == smollm.decode(ids, skip_special=skip)
    assert smollm.decode(ids, skip_special=True) == "user\nhé 😀\n"


@pytest.mark.model
def test_special_tokens_parsed_only_when_asked(smollm, gemma):
    text = "<|im_start|>user"
    assert smollm.encode(text)[0] == smollm.token_to_id("<|im_start|>") == 1
    plain = smollm.encode(text, parse_special=False)
    assert 1 not in plain and smollm.decode(plain) == text
    assert gemma.encode("<start_of_turn>model\n") == [105, gemma.token_to_id("model"), 107]
    assert 105 not in gemma.encode("<start_of_turn>", parse_special=False)
    # user-defined tokens (Gemma's HTML tags and whitespace runs) are matched even then, as in llama.cpp
    assert gemma.encode("<table>\n\n", parse_special=False) == [gemma.token_to_id("<table>"), 108]
    assert gemma.is_special(105) and not gemma.is_special(gemma.token_to_id("<table>"))


@pytest.mark.model
def test_gemma_byte_fallback(gemma):
    ch = "\U0010fffd"  # a private-use character no vocabulary has
    assert gemma.token_to_id(ch) is None and gemma.token_to_id("▁" + ch) is None
    ids = gemma.encode(ch)
    assert [gemma.token_text(i) for i in ids] == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert gemma.decode(ids) == ch
    dec = gemma.stream_decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "", ch]


@pytest.mark.model
def test_vocabulary_accessors(smollm, gemma):
    assert smollm.vocab_size == 49152 and gemma.vocab_size == 262144
    assert smollm.token_text(905) == "Ġworld" and smollm.token_bytes(905) == b" world"
    assert gemma.token_text(1902) == "▁world" and gemma.token_bytes(1902) == b" world"
    assert gemma.token_bytes(248) == b"\n"  # <0x0A>
    assert gemma.token_bytes(2) == b"<bos>" and gemma.token_bytes(2, skip_special=True) == b""


@pytest.mark.model
def test_bad_input_is_a_clear_error(smollm):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        smollm.decode([19556, 49152])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        smollm.stream_decoder().feed(-1)
    with pytest.raises(InvalidRequest, match="must be an integer"):
        smollm.decode([1.0])
    assert smollm.decode(np.array([19556, 905], dtype=np.int32)) == "Hello world"
    with pytest.raises(InvalidRequest, match="must be a str"):
        smollm.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="surrogate"):
        smollm.encode("a\ud800b")


# --- small hand-made vocabularies --------------------------------------------------------------------------

def gpt2_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table, written out independently of the implementation."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, shift = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(0x100 + shift))
            shift += 1
    return out


def bpe_metadata(pre: str = "smollm", **over: Any) -> dict[str, Any]:
    alphabet = gpt2_alphabet()
    specials = ["<|endoftext|>", "<x>", "x><y", "<tag>"]
    merges = ["b c", "a b", "Ġ 1", "h e", "Ġ he"]
    tokens = specials + alphabet + ["bc", "ab", "Ġ1", "he", "Ġhe"]
    types = [3, 3, 3, 4] + [1] * (len(tokens) - 4)
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": False,
    }
    md.update(over)
    return md


def spm_metadata(**over: Any) -> dict[str, Any]:
    pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    pieces += [("▁", -1.0, 1), ("a", -2.0, 1), ("b", -2.0, 1), ("c", -2.0, 1), ("d", -2.0, 1),
               ("ab", -1.5, 1), ("▁a", -1.2, 1), ("▁ab", -0.5, 1), ("bb", -0.1, 1), ("c▁", -3.0, 1),
               ("c▁d", -0.2, 1), ("\n", -1.0, 4)]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p[0] for p in pieces],
        "tokenizer.ggml.scores": [p[1] for p in pieces],
        "tokenizer.ggml.token_type": [p[2] for p in pieces],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(over)
    return md


@pytest.mark.parametrize("extra", [["x\u2581y"], ["x\u2581y", "q\u0000\u2581"]],
                         ids=["plain", "a token holding NUL"])
def test_spm_word_cuts_skip_spaces_that_tokens_hold_inside(extra):
    """Words are merged one at a time, cut before each U+2581, except where some token holds "<c>U+2581":
    "c▁" is in the test vocabulary and "x▁y" is added; the second case adds NUL as such a character, which
    the fast scan of the vocabulary uses as its separator, so that case takes the plain loop."""
    md = spm_metadata()
    md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], *extra]
    md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], *[-5.0] * len(extra)]
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], *[1] * len(extra)]
    cut = Tokenizer.from_metadata(md)._spm_cut
    assert cut.search("c\u2581") is None and cut.search("x\u2581") is None
    assert cut.search("a\u2581").start() == 1 and cut.search("y\u2581").start() == 1
    assert (cut.search("\u0000\u2581") is None) == (len(extra) == 2)


def pieces(tok: Tokenizer, text: str, **kw: Any) -> list[str]:
    return [tok.token_text(i) for i in tok.encode(text, **kw)]


def test_bpe_merges_lowest_rank_first():
    tok = Tokenizer.from_metadata(bpe_metadata())
    assert pieces(tok, "abc") == ["a", "bc"]  # "b c" outranks "a b" although "ab" starts further left
    assert pieces(tok, "ab") == ["ab"]
    assert pieces(tok, "the he") == ["t", "he", "Ġhe"]
    assert tok.decode(tok.encode("the he")) == "the he"


def test_bpe_pre_tokenizer_by_name():
    smol = Tokenizer.from_metadata(bpe_metadata("smollm"))
    gpt2 = Tokenizer.from_metadata(bpe_metadata("gpt-2"))
    assert pieces(smol, "a 12") == ["a", "Ġ", "1", "2"]  # digits isolated before the merge "Ġ 1" can apply
    assert pieces(gpt2, "a 12") == ["a", "Ġ1", "2"]
    # \s+(?!\S) leaves the last space of a run to the word after it
    assert pieces(gpt2, "x  \n he") == ["x", "Ġ", "Ġ", "Ċ", "Ġhe"]


def test_special_tokens_longest_text_first_like_llamacpp():
    tok = Tokenizer.from_metadata(bpe_metadata())
    # "x><y" is longer than "<x>", so it is cut out first even though "<x>" starts earlier
    assert pieces(tok, "<x><y") == ["<", "x><y"]
    assert pieces(tok, "<x>z") == ["<x>", "z"]
    # parse_special=False: control tokens stay text, user-defined ones are still matched
    assert pieces(tok, "<x><tag>", parse_special=False) == ["<", "x", ">", "<tag>"]
    assert tok.decode(tok.encode("<x><tag>", parse_special=False)) == "<x><tag>"


def llamacpp_partition(text: str, specials: list[tuple[int, str]]) -> list[str | int]:
    """llama.cpp's tokenizer_st_partition written out plainly: for each special token, longest first,
    split every raw fragment at its occurrences, left to right."""
    frags: list[tuple[int, int] | int] = [(0, len(text))] if text else []
    for tid, tok in sorted(specials, key=lambda s: (-len(s[1].encode()), s[0])):
        out: list[tuple[int, int] | int] = []
        for frag in frags:
            if isinstance(frag, int):
                out.append(frag)
                continue
            off, length = frag
            while length > 0:
                m = text.find(tok, off)
                if m < 0 or m + len(tok) > off + length:
                    out.append((off, length))
                    break
                if m > off:
                    out.append((off, m - off))
                out.append(tid)
                length -= m + len(tok) - off
                off = m + len(tok)
        frags = out
    return [f if isinstance(f, int) else text[f[0]:f[0] + f[1]] for f in frags]


def test_special_token_partition_equals_llamacpp_on_random_overlaps():
    rng = random.Random(7)
    for _ in range(400):
        words = sorted({"".join(rng.choice("ab ") for _ in range(rng.randint(1, 5))) for _ in range(6)})
        tokens = words + [c for c in ("a", "b", "▁") if c not in words]
        md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
              "tokenizer.ggml.token_type": [3] * len(words) + [1] * (len(tokens) - len(words)),
              "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_space_prefix": False}
        tok = Tokenizer.from_metadata(md)
        for _ in range(5):
            text = "".join(rng.choice("ab ") for _ in range(rng.randint(0, 60)))
            want: list[int] = []
            for frag in llamacpp_partition(text, list(enumerate(words))):
                want += [frag] if isinstance(frag, int) else tok.encode(frag)  # raw text holds no special
            assert tok.encode(text) == want, (words, text)


def test_stream_decoder_equals_decode_on_random_bytes():
    tok = Tokenizer.from_metadata(bpe_metadata())
    byte_ids = [tok.token_to_id(c) for c in gpt2_alphabet()]
    rng = random.Random(1234)
    samples = ["é", "😀", "中", "ok"]
    for _ in range(300):
        # mostly valid UTF-8 cut at every byte, sometimes broken sequences, which must become U+FFFD
        # the same way in both
        data = "".join(rng.choice(samples) for _ in range(rng.randint(0, 6))).encode("utf-8")
        if rng.random() < 0.5:
            data = bytes(rng.choice([rng.randrange(256), *data]) for _ in range(rng.randint(0, 10)))
        ids = [byte_ids[b] for b in data]
        dec = tok.stream_decoder()
        streamed = "".join(dec.feed(i) for i in ids) + dec.flush()
        assert streamed == tok.decode(ids) == data.decode("utf-8", "replace")


def test_spm_merges_by_score_with_dummy_prefix():
    tok = Tokenizer.from_metadata(spm_metadata())
    assert tok.add_bos and tok.add_space_prefix  # SentencePiece defaults when the file does not say
    assert pieces(tok, "ab") == ["▁ab"]
    assert pieces(tok, "abb") == ["▁a", "bb"]  # "bb" (-0.1) beats "ab" (-1.5); then "▁a" is the best merge
    assert tok.encode("ab", add_special=True) == [1, tok.token_to_id("▁ab")]
    assert tok.decode(tok.encode("ab b")) == "ab b"  # the dummy prefix is taken off again
    # after a special token the raw text gets its dummy prefix again
    assert pieces(tok, "<s>ab") == ["<s>", "▁ab"]
    plain = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(plain, "ab") == ["ab"] and plain.decode(plain.encode(" ab")) == " ab"


def test_spm_token_with_inner_space_is_found():
    # "c▁d" spans a word boundary: the text must not be cut into words before the "▁" there
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(tok, "c d") == ["c▁d"]
    assert pieces(tok, "d c d ab") == ["d", "▁", "c▁d", "▁ab"]


def test_spm_byte_fallback_and_user_defined():
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces(tok, "aé") == ["a", "<0xC3>", "<0xA9>"]
    assert pieces(tok, "a\nb") == ["a", "\n", "b"]
    ids = tok.encode("é€")
    assert tok.decode(ids) == "é€"
    dec = tok.stream_decoder()
    assert [dec.feed(i) for i in ids] == ["", "é", "", "", "€"]


BROKEN: list[tuple[str, dict[str, Any], str]] = [
    ("unknown model", {"tokenizer.ggml.model": "wordpiece"}, "tokenizer.ggml.model"),
    ("model missing", {"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ("tokens missing", {"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ("tokens not a list", {"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens"),
    ("empty vocabulary", {"tokenizer.ggml.tokens": [], "tokenizer.ggml.token_type": []}, "empty"),
    ("duplicate token", {"tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.token_type": [1, 1],
                         "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 0,
                         "tokenizer.ggml.eos_token_id": 0}, "duplicates"),
    ("merges missing", {"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
    ("merge of unknown token", {"tokenizer.ggml.merges": ["a b", "q zz"]}, r"merges\[1\]"),
    ("merge result unknown", {"tokenizer.ggml.merges": ["a c"]}, "'ac'"),
    ("merge without space", {"tokenizer.ggml.merges": ["ab"]}, r"merges\[0\]"),
    ("bos id out of range", {"tokenizer.ggml.bos_token_id": 100000}, "bos_token_id"),
    ("negative eos id", {"tokenizer.ggml.eos_token_id": -1}, "eos_token_id"),
    ("bool as an id", {"tokenizer.ggml.bos_token_id": True}, "bos_token_id"),
    ("token types short", {"tokenizer.ggml.token_type": [1, 1]}, "token_type"),
    ("unknown token type", {"tokenizer.ggml.token_type": [9] * 265}, r"token_type\[0\]"),
    ("unknown pre-tokenizer", {"tokenizer.ggml.pre": "klingon"}, "tokenizer.ggml.pre"),
    ("add_bos without bos", {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": None},
     "bos_token_id"),
    ("add_bos not a bool", {"tokenizer.ggml.add_bos_token": 1}, "add_bos_token"),
]


@pytest.mark.parametrize("what, change, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_inconsistent_bpe_metadata_is_a_format_error(what, change, message):
    md = bpe_metadata()
    for k, v in change.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    with pytest.raises(FormatError, match=message) as err:
        Tokenizer.from_metadata(md)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.scores": [0.0] * 3}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.scores": ["x"] * 271}, r"scores\[0\]"),
    ({"tokenizer.ggml.tokens": [*spm_metadata()["tokenizer.ggml.tokens"][:3], "<0xZZ>",
                                *spm_metadata()["tokenizer.ggml.tokens"][4:]]}, "not <0xNN>"),
    ({"tokenizer.ggml.unknown_token_id": 271}, "unknown_token_id"),
])
def test_inconsistent_spm_metadata_is_a_format_error(change, message):
    with pytest.raises(FormatError, match=message):
        Tokenizer.from_metadata(spm_metadata(**change))


def test_not_constructible_without_metadata():
    with pytest.raises(TypeError):
        Tokenizer()
    with pytest.raises(FormatError):
        Tokenizer.from_metadata([])  # type: ignore[arg-type]


# --- the pre-tokenizer regexes' compiled programs, kept in the cache ------------------------------------------


def test_a_cached_regex_program_is_exactly_what_re_compiles(tmp_path, monkeypatch):
    import re

    from barellm.text.pretokenizer import _PRE_TOKENIZERS, _compile_cached, _translate_regex

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path))
    sources = sorted({_translate_regex(r) for regexes, _ in _PRE_TOKENIZERS.values() for r in regexes})
    for src in sources:
        made, kept = _compile_cached(src), _compile_cached(src)  # compiled, then read back from the cache
        # Pattern equality compares the pattern, the flags and the compiled program itself
        assert made == kept == re.compile(src)
    files = sorted((tmp_path / "regex").iterdir())
    assert len(files) == len(sources)
    # a damaged or foreign file is compiled over, never trusted
    for garbage in (b"{", b'{"flags": 32, "code": [1, 2, 3], "groups": 0, "groupindex": {}, "indexgroup": [null]}'):
        files[0].write_bytes(garbage)
        again = [_compile_cached(src) for src in sources]
        assert again == [re.compile(src) for src in sources]
    assert files[0].read_bytes() != garbage  # rewritten


# --- o200k ("gpt-4o": gpt-oss, Phi-4-mini, Llama 4) ------------------------------------------------------------


@pytest.mark.parametrize("text, pieces", [
    ("Hello World", ["Hello", " World"]),
    ("camelCaseWord", ["camel", "Case", "Word"]),          # a capital starts a word: o200k's letter classes
    ("HTTPServer's", ["HTTPServer's"]),                    # capitals run into the lower-case tail, contraction kept
    ("I'M here", ["I'M", " here"]),
    ("12345", ["123", "45"]),                              # digits in threes
    ("a/b\n\n  c", ["a", "/b", "\n\n", " ", " c"]),
    ("déjà Vu!", ["déjà", " Vu", "!"]),
    ("hello!!!\n", ["hello", "!!!\n"]),                    # punctuation keeps its line breaks (and slashes)
])
def test_o200k_split(text, pieces):
    from barellm.text.pretokenizer import _PRE_TOKENIZERS, _make_splitter

    for name in ("gpt-4o", "llama4"):
        assert _make_splitter(_PRE_TOKENIZERS[name][0])(text) == pieces
