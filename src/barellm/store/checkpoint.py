"""What a conversion reads: a model source as tensors and metadata (_Model, _Tensor, whichever format it came
in), and the reader of one of those formats, a Hugging Face checkpoint directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json): its config and tokenizer onto GGUF's metadata keys, its tensors
onto GGUF's as its family's row of store/hf_families.py says (the recipes llama.cpp's converter follows).
store/convert.py reads GGUF sources itself and writes the .blm.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from barellm.arch.registry import ARCHITECTURES, Architecture
from barellm.errors import FormatError, ModelNotFound
from barellm.files import open_regular
from barellm.store import sentencepiece
from barellm.store.hf_families import Config, Family, family_of, linear_scaling, supported
from barellm.store.hf_recipes import FromConfig, Recipe, Same, Stored

F32, F16, BF16 = 0, 1, 30


# --- what a converter produces ---------------------------------------------------------------------------


@dataclass
class _Tensor:
    """A tensor as the source has it: its rows' bytes in a ggml type, or float32 values on request."""

    name: str
    type: int
    shape: tuple[int, ...]
    rows: Callable[[], np.ndarray]           # uint8 bytes in GGUF's row layout
    floats: Callable[[], np.ndarray]         # float32 values, shape `shape`


@dataclass
class _Model:
    metadata: dict[str, Any]
    metadata_types: dict[str, str]
    tensors: list[_Tensor]
    source_format: str
    source_files: list[Path]
    close: Callable[[], None]
    norms_f32: bool = False


# --- safetensors -----------------------------------------------------------------------------------------

_ST_DTYPES = {  # safetensors dtype -> (bytes per element, ggml type or None if we cannot take it)
    "F32": (4, F32), "F16": (2, F16), "BF16": (2, BF16), "F64": (8, None), "I64": (8, None), "U64": (8, None),
    "I32": (4, None), "U32": (4, None), "I16": (2, None), "U16": (2, None), "I8": (1, None), "U8": (1, None),
    "BOOL": (1, None), "F8_E4M3": (1, None), "F8_E5M2": (1, None),
}
_ST_MAX_HEADER = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class _STEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute, in the file
    nbytes: int


class SafetensorsFile:
    """A validating reader of one .safetensors file: u64 header length, JSON header, data.

    The header maps each name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets from the start
    of the data); every entry is checked against the file's size and its dtype and shape before use.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._name = str(path)
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise self._error(0, f"the file has {size} bytes, too few for a safetensors header")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise ModelNotFound(f"{self._name}: no such file") from None
        except OSError as e:
            raise FormatError(f"{self._name}: cannot read: {e.strerror}") from None
        self.size = size
        try:
            self._parse()
        except BaseException:
            self.close()
            raise
        self._data = np.frombuffer(self._mmap, dtype=np.uint8)

    def _error(self, offset: int, what: str) -> FormatError:
        return FormatError(f"{self._name}: safetensors header at offset {offset}: {what}")

    def _parse(self) -> None:
        (n,) = np.frombuffer(self._mmap, dtype="<u8", count=1).tolist()
        if n > min(self.size - 8, _ST_MAX_HEADER):
            raise self._error(0, f"header length {n} runs past the end of the file ({self.size} bytes) or the "
                              f"{_ST_MAX_HEADER}-byte limit")
        try:
            header = json.loads(self._mmap[8:8 + n].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise self._error(8, f"not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._error(8, "the header is not a JSON object")
        base = 8 + n
        data_size = self.size - base
        self.metadata = header.pop("__metadata__", None) or {}
        entries: dict[str, _STEntry] = {}
        for name, e in header.items():
            what = f"tensor {name!r}"
            if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"} or len(e) != 3:
                raise self._error(8, f"{what}: expected dtype, shape and data_offsets, got {e!r:.120}")
            dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if dtype not in _ST_DTYPES:
                raise self._error(8, f"{what}: unknown dtype {dtype!r}")
            if not (isinstance(shape, list) and len(shape) <= 8
                    and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape)):
                raise self._error(8, f"{what}: bad shape {shape!r:.80}")
            if not (isinstance(offs, list) and len(offs) == 2
                    and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                    and 0 <= offs[0] <= offs[1] <= data_size):
                raise self._error(8, f"{what}: data_offsets {offs!r:.80} fall outside the {data_size} bytes of data")
            nbytes = math.prod(shape) * _ST_DTYPES[dtype][0]
            if offs[1] - offs[0] != nbytes:
                raise self._error(8, f"{what}: {offs[1] - offs[0]} bytes of data for a {dtype} tensor of shape "
                                  f"{tuple(shape)}, which takes {nbytes}")
            entries[name] = _STEntry(name, dtype, tuple(shape), base + offs[0], nbytes)
        spans = sorted((t.start, t.start + t.nbytes, t.name) for t in entries.values() if t.nbytes)
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
            if start_b < end_a:
                raise self._error(8, f"the data of tensors {a!r} and {b!r} overlap")
        self.tensors = entries

    def raw(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self._data[t.start:t.start + t.nbytes]

    def floats(self, name: str) -> np.ndarray:
        """A tensor as float32 (BF16 widened by a shift: it is the top half of a float32)."""
        t = self.tensors[name]
        raw = self.raw(name)
        if t.dtype == "F32":
            out = raw.view("<f4").astype(np.float32)
        elif t.dtype == "F16":
            out = raw.view("<f2").astype(np.float32)
        elif t.dtype == "BF16":
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise FormatError(f"{self._name}: tensor {name!r} is {t.dtype}; only F32, F16 and BF16 can be converted")
        return out.reshape(t.shape)

    def close(self) -> None:
        self._data = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


# --- Hugging Face checkpoints ----------------------------------------------------------------------------

# buffers some checkpoints carry that are computed, not learned
_HF_SKIP = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")
_HF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _read_json(path: Path, required: bool = True) -> Any:
    try:
        with open_regular(path) as f:
            return json.loads(f.read().decode("utf-8"))
    except ModelNotFound:
        if required:
            raise FormatError(f"{path}: missing (a checkpoint needs it)") from None
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{path}: cannot read it as JSON: {e}") from None


def _hf_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The checkpoint's weight files and all the files conversion reads, sorted by name."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        idx = _read_json(index)
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise FormatError(f"{index}: no weight_map of tensor names to file names")
        names = sorted(set(wm.values()))
        for n in names:
            # a shard must be a plain file next to the index, never a path out of the checkpoint
            if "/" in n or "\\" in n or n in (".", "..") or not n.endswith(".safetensors"):
                raise FormatError(f"{index}: shard {n!r} is not a .safetensors file name in the checkpoint")
        weights = [root / n for n in names]
        extra = [index]
    elif (root / "model.safetensors").is_file():
        weights, extra = [root / "model.safetensors"], []
    else:
        raise FormatError(f"{root}: no model.safetensors or model.safetensors.index.json "
                          "(only safetensors checkpoints are supported)")
    for w in weights:
        if not w.is_file():
            raise FormatError(f"{w}: listed in the index but missing")
    reads = weights + extra + [root / "config.json"]
    reads += [root / n for n in ("tokenizer.json", "tokenizer.model", "added_tokens.json", "tokenizer_config.json",
                                 "chat_template.jinja") if (root / n).is_file()]
    return weights, sorted(reads, key=lambda p: p.name)


def _hf_config(cfg: Any, root: Path) -> tuple[dict[str, Any], dict[str, str], Config, Family]:
    """config.json as GGUF-style metadata: what every family has, then what its row (hf_families.py) adds."""
    where = root / "config.json"
    if not isinstance(cfg, dict):
        raise FormatError(f"{where}: not a JSON object")
    archs = cfg.get("architectures") or []
    family = family_of(cfg.get("model_type"), [str(a) for a in archs] if isinstance(archs, list) else [])
    if family is None:
        raise FormatError(f"{where}: model_type {cfg.get('model_type')!r} ({', '.join(map(str, archs)) or '?'}) is "
                          f"not supported; checkpoints convert from: {supported()}")
    arch = ARCHITECTURES[family.arch]
    c = Config(cfg, str(where))
    num = c.num

    if cfg.get("mlp_bias"):
        raise c.error("mlp_bias is set; MLP biases are not supported")
    if bool(cfg.get("attention_bias", arch.attn_bias)) != arch.attn_bias:
        raise c.error(f"attention_bias is {cfg.get('attention_bias')!r}, but {arch.name} checkpoints "
                      f"{'have' if arch.attn_bias else 'have no'} attention biases")
    if cfg.get("use_sliding_window") and not arch.swa_pattern:
        raise c.error(f"use_sliding_window is set; {arch.name} models attend over the whole context here")
    rope, rope_local = c.rope()
    if rope["rope_type"] not in family.rope_scalings:
        raise c.error(f"{c.rope_key} type {rope['rope_type']!r:.40} is not supported (a {family.model_types[0]} "
                      f"checkpoint may have: {', '.join(family.rope_scalings)})")
    quantized = cfg.get("quantization_config")
    method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
    if quantized is not None and method not in family.quant_methods:
        raise c.error(f"quantization_config {method!r}: quantized checkpoints are not supported"
                      + (f" ({family.model_types[0]} takes {', '.join(family.quant_methods)})"
                         if family.quant_methods else ""))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", family.acts[0])
    if act not in family.acts:
        raise c.error(f"hidden_act {act!r} is not supported ({family.model_types[0]} checkpoints use "
                      f"{', '.join(family.acts)})")
    dim, heads = num("hidden_size"), num("num_attention_heads")
    if heads <= 0:
        raise c.error(f"num_attention_heads is {heads}")
    head_dim = cfg.get("head_dim") or dim // heads
    p = arch.name + "."
    md: dict[str, Any] = {
        "general.architecture": arch.name,
        "general.name": str(cfg.get("_name_or_path") or root.resolve().name),
        p + "context_length": num("max_position_embeddings", 2048),
        p + "embedding_length": dim,
        p + "block_count": num("num_hidden_layers"),
        p + "feed_forward_length": num("intermediate_size"),
        p + "attention.head_count": heads,
        p + "attention.head_count_kv": num("num_key_value_heads", heads),
        p + "rope.freq_base": c.rope_base(rope, 10000.0),
        p + "attention.layer_norm_rms_epsilon": num("rms_norm_eps", 1e-6, float),
        p + "rope.dimension_count": head_dim,
        p + "vocab_size": num("vocab_size"),
    }
    if head_dim != dim // heads:
        md[p + "attention.key_length"] = md[p + "attention.value_length"] = head_dim
    md.update({p + k: v for k, v in (family.hparams(c) | linear_scaling(c)).items()})
    local_base = _local_rope_base(c, arch)
    if local_base is not None and local_base != (arch.rope_theta_local or md[p + "rope.freq_base"]):
        md[p + "rope.freq_base_swa"] = local_base   # where it is not what the engines take without it
    types = {k: ("string" if isinstance(v, str) else "float32" if isinstance(v, float) else "uint32")
             for k, v in md.items()}
    for k, v in md.items():
        if types[k] == "uint32" and not 0 <= v < 1 << 32:
            raise c.error(f"{k.removeprefix(p)} {v} is out of range (it is stored as a uint32)")
    return md, types, c, family


def _local_rope_base(c: Config, arch: Architecture) -> float | None:
    """The sliding-window layers' RoPE base where config.json gives their RoPE apart from the global layers'
    (rope_parameters' sliding_attention, Gemma 3's rope_local_base_freq), which llama.cpp's converter writes as
    rope.freq_base_swa; refused where the engines would run it otherwise (another scaling than the global layers',
    except Gemma 3's unscaled local layers; a difference in a model without sliding-window layers)."""
    rope, local = c.rope()
    if local is None:
        return None
    base = c.rope_base(local, None)
    rest, local_rest = ({k: v for k, v in d.items() if k != "rope_theta"} for d in (rope, local))
    if not arch.swa_pattern:
        if rest != local_rest or base not in (None, c.rope_base(rope, 10000.0)):
            raise c.error(f"rope_parameters' sliding_attention {local!r:.80} differs from full_attention's, but "
                          f"{arch.name} models have no sliding-window layers")
        return None
    if arch.rope_linear_local and rest != local_rest:
        raise c.error(f"rope_parameters' sliding_attention {local_rest!r:.80} scales otherwise than full_attention's "
                      f"{rest!r:.80}; {arch.name}'s sliding-window layers take the global layers' scaling")
    if not arch.rope_linear_local and local["rope_type"] != "default":
        raise c.error(f"the sliding-window layers' rope_type {local['rope_type']!r:.40} is not default; "
                      f"{arch.name}'s local layers are unscaled (as llama.cpp has them)")
    return base


# The pre-tokenizers of tokenizer.json this converter recognizes, as tokenizer.ggml.pre names.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen3's, Qwen3-MoE's): llama 3's with digits one at a time
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (gpt-oss, Phi-4-mini, Llama 4): letters split where their case changes, contractions kept on the word,
# digits in threes, slashes and line breaks kept after punctuation. llama.cpp's converter names it gpt-4o and its
# tokenizer splits by an ASCII-cased form of it (pretokenizer.py); this conversion takes that name too, so that a
# converted checkpoint tokenizes as llama.cpp's GGUF of it does (the two forms part only on combining marks and on
# non-ASCII letters where the case changes).
_O200K_WORD = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _O200K_WORD
                + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _O200K_WORD
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2", _O200K_SPLIT: "gpt-4o"}
# ignore_merges (a piece that is a token taken whole) as the tokenizer of each name has it: llama.cpp's sets it for
# llama 3's only; None: tokenizer.json's value is not checked, as llama.cpp's converter does not read it for gpt-4o
# (whose tokenizer merges every piece, as this conversion's then does too, whatever tokenizer.json says)
_IGNORE_MERGES: dict[str, bool | None] = {"llama-bpe": True, "gpt-4o": None}


def _pre_tokenizer(tj: dict[str, Any], where: Path) -> str:
    pt = tj.get("pre_tokenizer")
    steps = pt.get("pretokenizers", []) if isinstance(pt, dict) and pt.get("type") == "Sequence" else [pt]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps]

    def byte_level(s: dict[str, Any], regex: bool) -> bool:
        return (s.get("type") == "ByteLevel" and bool(s.get("use_regex", True)) == regex
                and not s.get("add_prefix_space", False))

    if len(steps) == 1 and isinstance(steps[0], dict) and byte_level(steps[0], True):
        return "gpt-2"
    if (len(steps) == 2 and kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits")
            and byte_level(steps[1], True)):
        return "smollm"  # digits one by one, then GPT-2's split (SmolLM, StarCoder)
    if len(steps) == 2 and kinds == ["Split", "ByteLevel"] and byte_level(steps[1], False):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        if pattern in _SPLITS and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
            return _SPLITS[pattern]
    raise FormatError(f"{where}: pre_tokenizer {json.dumps(pt)[:160]} is not one this converter recognizes "
                      "(supported: GPT-2's byte-level, digits + byte-level, llama 3's, Qwen2's or o200k's split + "
                      "byte-level)")


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _uses_sentencepiece(root: Path, tj: Any) -> bool:
    """Whether a checkpoint's tokenizer is its tokenizer.model (SentencePiece), not a byte-level BPE
    tokenizer.json (which some checkpoints ship beside a tokenizer.model of the same vocabulary)."""
    if not (root / "tokenizer.model").is_file():
        return False
    return not (isinstance(tj, dict) and "ByteLevel" in json.dumps(tj.get("pre_tokenizer")))


def _hf_tokenizer(root: Path, cfg: dict[str, Any], n_vocab: int) -> tuple[dict[str, Any], dict[str, str]]:
    spm = (root / "tokenizer.model").is_file()
    tj = _read_json(root / "tokenizer.json", required=not spm)
    tc = _read_json(root / "tokenizer_config.json", required=False) or {}
    if not isinstance(tc, dict):
        raise FormatError(f"{root / 'tokenizer_config.json'}: not a JSON object")
    if _uses_sentencepiece(root, tj):
        md, types_md = sentencepiece.vocab(root, n_vocab, tj, tc)
    else:
        md, types_md = _bpe_vocab(root / "tokenizer.json", tj, n_vocab)
    tokens = md["tokenizer.ggml.tokens"]
    size = len(tokens)
    ids = {text: i for i, text in enumerate(tokens)}
    for key, cfg_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", None), ("padding", None)):
        tc_key = {"unknown": "unk_token", "padding": "pad_token"}.get(key, f"{key}_token")
        text = _token_content(tc.get(tc_key))
        tid = ids.get(text) if text is not None else None
        if tid is None and cfg_key is not None:
            v = cfg.get(cfg_key)
            v = v[0] if isinstance(v, list) and v else v
            tid = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < size else None
        if tid is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = tid
            types_md[f"tokenizer.ggml.{key}_token_id"] = "uint32"
    add_bos = tc.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # llama 3 style: the post-processor puts BOS in front of every single sequence
        post = (tj.get("post_processor") if isinstance(tj, dict) else None) or {}
        procs = post.get("processors", [post]) if isinstance(post, dict) else []
        bos_text = tokens[md["tokenizer.ggml.bos_token_id"]] if "tokenizer.ggml.bos_token_id" in md else None
        add_bos = any(isinstance(p, dict) and p.get("type") == "TemplateProcessing"
                      and any(isinstance(s, dict) and (s.get("SpecialToken") or {}).get("id") == bos_text
                              for s in (p.get("single") or [])[:1])
                      for p in procs) and bos_text is not None
    md["tokenizer.ggml.add_bos_token"] = add_bos
    types_md["tokenizer.ggml.add_bos_token"] = "bool"
    if isinstance(tc.get("add_eos_token"), bool):
        md["tokenizer.ggml.add_eos_token"] = tc["add_eos_token"]
        types_md["tokenizer.ggml.add_eos_token"] = "bool"
    template = tc.get("chat_template")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        for t in template:
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str):
                key = "tokenizer.chat_template" + ("" if t["name"] == "default" else f".{t['name']}")
                md[key], types_md[key] = t["template"], "string"
    elif isinstance(template, str):
        md["tokenizer.chat_template"], types_md["tokenizer.chat_template"] = template, "string"
    return md, types_md


def _bpe_vocab(where: Path, tj: Any, n_vocab: int) -> tuple[dict[str, Any], dict[str, str]]:
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json."""
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise FormatError(f"{where}: model type {kind!r}; only byte-level BPE tokenizers convert (or a "
                          "SentencePiece tokenizer.model beside it)")
    # NFC: llama.cpp's tokenizer of the GGUF (Qwen2's) leaves it out too; text in NFC tokenizes the same
    if tj.get("normalizer") and tj["normalizer"] != {"type": "NFC"}:
        raise FormatError(f"{where}: a normalizer ({tj['normalizer'].get('type')}) is not supported with "
                          "byte-level BPE")
    pre = _pre_tokenizer(tj, where)
    ignore_merges = _IGNORE_MERGES.get(pre, False)
    if ignore_merges is not None and bool(model.get("ignore_merges", False)) != ignore_merges:
        raise FormatError(f"{where}: ignore_merges = {model.get('ignore_merges')} does not match the "
                          f"{pre} pre-tokenizer")
    vocab: dict[int, str] = {}
    for text, i in model["vocab"].items():
        if not isinstance(i, int) or not 0 <= i < 1 << 22:
            raise FormatError(f"{where}: token {text!r} has id {i!r}")
        vocab[i] = text
    types: dict[int, int] = {}
    for t in tj.get("added_tokens") or []:
        if not isinstance(t, dict) or not isinstance(t.get("id"), int) or not isinstance(t.get("content"), str):
            raise FormatError(f"{where}: bad added token {t!r:.80}")
        if not 0 <= t["id"] < 1 << 22:
            raise FormatError(f"{where}: added token {t['content']!r} has id {t['id']}")
        vocab[t["id"]] = t["content"]
        types[t["id"]] = 3 if t.get("special") else 4  # CONTROL, USER_DEFINED
    if max(vocab) >= n_vocab:
        raise FormatError(f"{where}: token id {max(vocab)} has no row in the {n_vocab}-row embedding")
    size = n_vocab
    # llama.cpp's convention: ids the tokenizer does not use become unused placeholders
    tokens = [vocab.get(i, f"[PAD{i}]") for i in range(size)]
    token_types = [types.get(i, 1 if i in vocab else 5) for i in range(size)]
    merges = []
    for m in model.get("merges") or []:
        if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m):
            merges.append(f"{m[0]} {m[1]}")
        elif isinstance(m, str):
            merges.append(m)
        else:
            raise FormatError(f"{where}: bad merge {m!r:.80}")
    md: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": token_types,
        "tokenizer.ggml.merges": merges,
    }
    types_md = {"tokenizer.ggml.model": "string", "tokenizer.ggml.pre": "string",
                "tokenizer.ggml.tokens": "array[string]", "tokenizer.ggml.token_type": "array[int32]",
                "tokenizer.ggml.merges": "array[string]"}
    return md, types_md


class _Checkpoint:
    """The checkpoint's tensors by name, as the families' recipes see them (hf_recipes.Checkpoint)."""

    def __init__(self, root: Path, files: list[SafetensorsFile], md: dict[str, Any], config: Config,
                 family: Family) -> None:
        self.where, self.metadata, self.config, self.family = str(root), md, config.cfg, family
        self.arch = ARCHITECTURES[family.arch]
        self.tensors: dict[str, Stored] = {}
        for f in files:
            for name, e in f.tensors.items():
                if name in self.tensors:
                    raise FormatError(f"{f.path}: tensor {name!r} is also in another shard")
                self.tensors[name] = Stored(name, e.dtype, e.shape, lambda f=f, name=name: f.raw(name))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, needed_for: str) -> Stored:
        t = self.tensors.get(name)
        if t is None:
            raise FormatError(f"{self.where}: tensor {name!r} is missing (a {self.family.model_types[0]} "
                              f"checkpoint has it; {needed_for!r} is made from it)")
        return t

    def meta(self, key: str) -> Any:
        return self.metadata[f"{self.arch.name}.{key}"]

    def permutation(self, gguf_name: str) -> int:
        """GGUF files of the "norm" RoPE store Q and K rows permuted (see permute_qk); the others keep the
        checkpoint's order."""
        if self.arch.rope_style != "norm":
            return 0
        return {"attn_q": self.meta("attention.head_count"),
                "attn_k": self.meta("attention.head_count_kv")}.get(gguf_name.split(".")[-2], 0)

    def norm_shift(self) -> float:
        return self.family.norm_shift


def _from_hf(root: Path) -> _Model:
    weights, reads = _hf_files(root)
    md, types, config, family = _hf_config(_read_json(root / "config.json"), root)
    arch = ARCHITECTURES[family.arch]
    p = arch.name + "."
    files = [SafetensorsFile(w) for w in weights]

    def close() -> None:
        for f in files:
            f.close()

    try:
        from barellm.arch.config import config_from_metadata, expected_shapes

        ck = _Checkpoint(root, files, md, config, family)
        if not ck.has("model.embed_tokens.weight"):
            raise FormatError(f"{root}: no model.embed_tokens.weight")
        # A checkpoint that ties the output to the embedding may still carry lm_head.weight (a copy): it is
        # kept as the untied output, which computes the same. One that does not tie them must have it.
        tied = not ck.has("lm_head.weight") or "lm_head.weight" in family.ignored
        n_vocab = (ck.tensors["model.embed_tokens.weight"].shape or (0,))[0]
        # the tensors outside the blocks beyond every family's: one made from config.json only where it asks for it
        extra = {n: r for n, r in family.extra.items() if not isinstance(r, FromConfig) or r.when(config.cfg)}
        # every hyperparameter range-checked (layers, experts, ...) before the tensors are planned by them
        cfg = config_from_metadata(md, n_vocab, tied, rope_freqs="rope_freqs.weight" in extra)
        # every tensor the model needs: its recipe, and the prefix the recipe's names are under
        plan: list[tuple[str, Recipe, str]] = [(n, Same(_HF_GLOBAL[n]), "")
                                               for n in ("token_embd.weight", "output_norm.weight", "output.weight")
                                               if n != "output.weight" or not tied]
        plan += [(n, r, "") for n, r in extra.items()]
        plan += [(f"blk.{i}.{n}", family.layer[n], f"model.layers.{i}.")
                 for i in range(cfg.n_layers) for n in arch.layer_tensors]
        known = {hf for _, recipe, prefix in plan for hf in recipe.names(prefix, ck)} | {"lm_head.weight"}
        for name in ck.tensors:
            if name not in known and name not in family.ignored and not _HF_SKIP.fullmatch(name):
                raise FormatError(f"{root}: tensor {name!r} is not part of a {family.model_types[0]} checkpoint "
                                  "this converter knows")
        if tied and not config.get("tie_word_embeddings", True):
            raise FormatError(f"{root}: no lm_head.weight, and config.json does not tie the output to the embedding")
        made = [recipe.make(name, prefix, ck) for name, recipe, prefix in plan]
        want = expected_shapes(cfg)
        for t in made:
            if t.shape != want.get(t.name):
                raise FormatError(f"{root}: {', '.join(map(repr, t.sources))} make {t.name!r} of shape {t.shape}, "
                                  f"expected {want.get(t.name)} from config.json")
        tensors = [_Tensor(t.name, t.type, t.shape, t.rows, t.floats) for t in made]
        tok_md, tok_types = _hf_tokenizer(root, config.cfg, n_vocab)
        md.update(tok_md)
        types.update(tok_types)
        md[p + "vocab_size"] = n_vocab
        from barellm.text.tokenizer import Tokenizer

        Tokenizer.from_metadata(md)  # refuse a vocabulary the runtime would refuse, now rather than at load
    except BaseException:
        close()
        raise
    return _Model(md, types, tensors, "safetensors", reads, close, norms_f32=True)
