"""What a conversion reads: a model source as tensors and metadata (_Model, _Tensor, whichever format it came
in), and the reader of one of those formats, a Hugging Face checkpoint directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json): its tensors mapped onto GGUF's names, the query and key rows
permuted as llama.cpp's converter does (`permute_qk`), its config and tokenizer onto GGUF's metadata keys.
store/convert.py reads GGUF sources itself and writes the .blm.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from barellm.arch.registry import ARCHITECTURES, Architecture, for_hf_model_type
from barellm.errors import FormatError, ModelNotFound
from barellm.files import open_regular

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

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
# buffers some checkpoints carry that are computed, not learned
_HF_SKIP = re.compile(r"(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def hf_name(name: str, n_layers: int, arch: Architecture | None = None) -> str | None:
    """Our (GGUF's) name for a Hugging Face tensor of an architecture (default llama); None for a buffer to
    skip; FormatError if the architecture has no such tensor."""
    arch = arch or ARCHITECTURES["llama"]
    if name in _HF_NAMES:
        return _HF_NAMES[name]
    if _HF_SKIP.fullmatch(name):
        return None
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in arch.hf_layer_names and int(m.group(1)) < n_layers:
        return f"blk.{int(m.group(1))}.{arch.hf_layer_names[m.group(2)]}"
    raise FormatError(f"tensor {name!r} is not part of a {arch.name} checkpoint this converter knows")


def permute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q or K rows (`n_heads` heads of head_dim rows each).

    Hugging Face stores each head's rows so that RoPE rotates the pairs (i, i + head_dim/2) ("neox"); GGUF
    stores them interleaved so that it rotates (2i, 2i+1) ("norm"). Row 2i of a permuted head is row i of
    the original and row 2i+1 is row i + head_dim/2. `rows` may hold any per-row data (bytes of a quantized
    row too): only whole rows move.
    """
    n = rows.shape[0]
    return rows.reshape(n_heads, 2, n // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


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
    reads = weights + extra + [root / "config.json", root / "tokenizer.json"]
    reads += [root / n for n in ("tokenizer_config.json", "chat_template.jinja") if (root / n).is_file()]
    return weights, sorted(reads, key=lambda p: p.name)


def _hf_config(cfg: Any, root: Path) -> tuple[dict[str, Any], dict[str, str], dict[str, Any], Architecture]:
    where = root / "config.json"
    if not isinstance(cfg, dict):
        raise FormatError(f"{where}: not a JSON object")
    archs = cfg.get("architectures") or []
    arch = for_hf_model_type(cfg.get("model_type"), [str(a) for a in archs] if isinstance(archs, list) else [])
    if arch is None:
        known = ", ".join(t for row in ARCHITECTURES.values() for t in row.hf_model_types)
        raise FormatError(f"{where}: model_type {cfg.get('model_type')!r} ({', '.join(map(str, archs)) or '?'}) is "
                          f"not supported; checkpoints convert from: {known}")

    def num(key: str, default: Any = None, kind: type = int) -> Any:
        v = cfg.get(key, default)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            raise FormatError(f"{where}: {key} is {v!r}, expected {'a number' if kind is float else 'an integer'}")
        return v

    if cfg.get("mlp_bias"):
        raise FormatError(f"{where}: mlp_bias is set; MLP biases are not supported")
    if bool(cfg.get("attention_bias", arch.attn_bias)) != arch.attn_bias:
        raise FormatError(f"{where}: attention_bias is {cfg.get('attention_bias')!r}, but {arch.name} checkpoints "
                          f"{'have' if arch.attn_bias else 'have no'} attention biases")
    scaling = cfg.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise FormatError(f"{where}: rope_scaling {scaling!r:.80} is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != arch.act:
        raise FormatError(f"{where}: hidden_act {act!r} is not supported ({arch.name} uses {arch.act})")
    dim, heads = num("hidden_size"), num("num_attention_heads")
    head_dim = cfg.get("head_dim") or (dim // heads if heads else 0)
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
        p + "rope.freq_base": float(num("rope_theta", 10000.0, float)),
        p + "attention.layer_norm_rms_epsilon": float(num("rms_norm_eps", 1e-6, float)),
        p + "rope.dimension_count": head_dim,
        p + "vocab_size": num("vocab_size"),
    }
    if head_dim != dim // heads:
        md[p + "attention.key_length"] = md[p + "attention.value_length"] = head_dim
    types = {k: ("string" if isinstance(v, str) else "float32" if isinstance(v, float) else "uint32")
             for k, v in md.items()}
    return md, types, cfg, arch


# The pre-tokenizers of tokenizer.json this converter recognizes, as tokenizer.ggml.pre names.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


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
        if pattern == _LLAMA3_SPLIT and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
            return "llama-bpe"
    raise FormatError(f"{where}: pre_tokenizer {json.dumps(pt)[:160]} is not one this converter recognizes "
                      "(supported: GPT-2's byte-level, digits + byte-level, llama 3's split + byte-level)")


def _token_content(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _hf_tokenizer(root: Path, cfg: dict[str, Any], n_vocab: int) -> tuple[dict[str, Any], dict[str, str]]:
    where = root / "tokenizer.json"
    tj = _read_json(where)
    tc = _read_json(root / "tokenizer_config.json", required=False) or {}
    model = tj.get("model") if isinstance(tj, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise FormatError(f"{where}: model type {kind!r}; only byte-level BPE tokenizers convert")
    if tj.get("normalizer"):
        raise FormatError(f"{where}: a normalizer ({tj['normalizer'].get('type')}) is not supported with "
                          "byte-level BPE")
    pre = _pre_tokenizer(tj, where)
    if bool(model.get("ignore_merges", False)) != (pre == "llama-bpe"):
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
        post = tj.get("post_processor") or {}
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


def _from_hf(root: Path) -> _Model:
    weights, reads = _hf_files(root)
    md, types, cfg, arch = _hf_config(_read_json(root / "config.json"), root)
    p = arch.name + "."
    files = [SafetensorsFile(p) for p in weights]

    def close() -> None:
        for f in files:
            f.close()

    try:
        n_layers = md[p + "block_count"]
        heads, kv_heads = md[p + "attention.head_count"], md[p + "attention.head_count_kv"]
        # GGUF llama files store Q and K rows permuted for the "norm" RoPE (see permute_qk); the others keep
        # the checkpoint's order
        permute = arch.rope_style == "norm"
        found: dict[str, tuple[SafetensorsFile, str]] = {}
        for f in files:
            for name in f.tensors:
                ours = hf_name(name, n_layers, arch)
                if ours is None:
                    continue
                if ours in found:
                    raise FormatError(f"{f.path}: tensor {name!r} is also in {found[ours][0].path}")
                found[ours] = (f, name)
        if "token_embd.weight" not in found:
            raise FormatError(f"{root}: no model.embed_tokens.weight")
        # A checkpoint that ties the output to the embedding may still carry lm_head.weight (a copy): it is
        # kept as the untied output, which computes the same. One that does not tie them must have it.
        tied = "output.weight" not in found
        if tied and not cfg.get("tie_word_embeddings", False):
            raise FormatError(f"{root}: no lm_head.weight, and config.json does not tie the output to the embedding")
        n_vocab = found["token_embd.weight"][0].tensors[found["token_embd.weight"][1]].shape[0]
        tok_md, tok_types = _hf_tokenizer(root, cfg, n_vocab)
        md.update(tok_md)
        types.update(tok_types)

        from barellm.arch.config import check_tensors, config_from_metadata

        config = config_from_metadata(md, n_vocab, tied)
        check_tensors(config, {n: f.tensors[hn] for n, (f, hn) in found.items()})
        order = list(_expected_order(arch, n_layers, tied))
        tensors = []
        for ours in order:
            f, name = found[ours]
            e = f.tensors[name]
            ttype = _ST_DTYPES[e.dtype][1]
            if ttype is None:
                raise FormatError(f"{f.path}: tensor {name!r} is {e.dtype}; only F32, F16 and BF16 convert")
            perm = (heads if ours.endswith(("attn_q.weight", "attn_q.bias")) else
                    kv_heads if ours.endswith(("attn_k.weight", "attn_k.bias")) else 0) if permute else 0

            def rows(f: SafetensorsFile = f, name: str = name, e: _STEntry = e, perm: int = perm) -> np.ndarray:
                raw = f.raw(name)
                if perm:
                    raw = permute_qk(raw.reshape(e.shape[0], -1), perm).reshape(-1)
                return raw

            def floats(f: SafetensorsFile = f, name: str = name, perm: int = perm) -> np.ndarray:
                x = f.floats(name)
                return permute_qk(x, perm) if perm else x

            tensors.append(_Tensor(ours, ttype, e.shape, rows, floats))
        md[p + "vocab_size"] = n_vocab
        from barellm.text.tokenizer import Tokenizer

        Tokenizer.from_metadata(md)  # refuse a vocabulary the runtime would refuse, now rather than at load
    except BaseException:
        close()
        raise
    return _Model(md, types, tensors, "safetensors", reads, close, norms_f32=True)


def _expected_order(arch: Architecture, n_layers: int, tied: bool) -> Iterator[str]:
    """GGUF's usual order: embedding, layers, final norm, output."""
    yield "token_embd.weight"
    for i in range(n_layers):
        for n in arch.layer_tensors:
            yield f"blk.{i}.{n}"
    yield "output_norm.weight"
    if not tied:
        yield "output.weight"
