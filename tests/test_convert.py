"""Conversion into .blm: from GGUF (bit-identical logits), from tiny Hugging Face llama checkpoints written
here (checked against an independent NumPy forward in Hugging Face's own convention), requantization
within the types' error bounds, the transparent model cache, the CLI, and a convert killed mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import barellm
from barellm.__main__ import main
from barellm.arch.config import config_from_metadata
from barellm.arch.llama import ReferenceEngine
from barellm.errors import FormatError
from barellm.formats import quant
from barellm.formats.blm import LAYOUT_INTERLEAVE8, LAYOUT_ROWS, BLMFile, verify
from barellm.formats.gguf import GGUFFile
from barellm.store.convert import CONVERTER_REVISION, SafetensorsFile, convert, permute_qk
from barellm.store.converted import open_model as open_model_file
from barellm.text.tokenizer import Tokenizer

from conftest import plain
from tiny_model import CHATML, byte_vocab, write_tiny_llama

safetensors = pytest.importorskip("safetensors")
from safetensors import TensorSpec, serialize_file  # noqa: E402

# --- a tiny Hugging Face llama checkpoint ----------------------------------------------------------------

DIM, FFN, HEADS, KV_HEADS, LAYERS = 64, 96, 4, 2, 2
HD = DIM // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n"), ("e", "r"), ("o", "n"), ("Ġ", "a")]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _vocab() -> list[str]:
    return SPECIALS + byte_vocab() + [a + b for a, b in MERGES]


N_VOCAB = len(_vocab())


def hf_weights(seed: int = 0, tied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(N_VOCAB, DIM, 4.0), "model.norm.weight": norm()}
    if not tied:
        w["lm_head.weight"] = mat(N_VOCAB, DIM, 4.0)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": mat(HEADS * HD, DIM, 3.0),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * HD, DIM, 3.0),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * HD, DIM),
            p + "self_attn.o_proj.weight": mat(DIM, HEADS * HD),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": mat(FFN, DIM),
            p + "mlp.up_proj.weight": mat(FFN, DIM),
            p + "mlp.down_proj.weight": mat(DIM, FFN),
        })
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(HD // 2, np.float32)  # a buffer to skip
    return w


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def _save(tensors: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "F32":
        from safetensors.numpy import save_file

        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
        return
    keep = {k: np.ascontiguousarray(to_bf16(v)) for k, v in tensors.items()}  # numpy has no bf16
    specs = {k: TensorSpec(dtype="bfloat16", shape=v.shape, data_ptr=v.ctypes.data, data_len=v.nbytes)
             for k, v in keep.items()}
    serialize_file(specs, str(path), metadata={"format": "pt"})


def tokenizer_json(pre: str = "smollm", pair_merges: bool = False) -> dict:
    vocab = {t: i for i, t in enumerate(_vocab())}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if pre == "smollm":
        pt = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    elif pre == "gpt2":
        pt = byte_level
    elif pre == "llama3":
        pt = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            dict(byte_level, use_regex=False)]}
    else:
        pt = {"type": "Metaspace", "replacement": "▁"}
    tj = {
        "version": "1.0",
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": pt,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre == "llama3", "vocab": vocab,
                  "merges": [list(m) for m in MERGES] if pair_merges else [f"{a} {b}" for a, b in MERGES]},
    }
    if pre == "llama3":  # BOS comes from the post-processor, as in Llama 3
        tj["post_processor"] = {"type": "TemplateProcessing",
                                "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                           {"Sequence": {"id": "A", "type_id": 0}}],
                                "pair": [], "special_tokens": {}}
    return tj


def write_hf(root: Path, dtype: str = "F32", shards: int = 1, tied: bool = False, pre: str = "smollm",
             seed: int = 0, **config_extra) -> dict[str, np.ndarray]:
    """Writes a checkpoint directory; returns the float32 weights the checkpoint holds (after bf16 rounding)."""
    root.mkdir(parents=True, exist_ok=True)
    w = hf_weights(seed, tied)
    if dtype == "BF16":
        w = {k: from_bf16(to_bf16(v)) for k, v in w.items()}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": N_VOCAB,
        "tie_word_embeddings": tied, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32" if dtype == "F32" else "bfloat16", **config_extra,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text(json.dumps(tokenizer_json(pre, pair_merges=shards > 1)))
    tc = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True},
          "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "chat_template": CHATML}
    if pre != "llama3":
        tc["add_bos_token"] = False
    (root / "tokenizer_config.json").write_text(json.dumps(tc))
    names = sorted(w)
    if shards == 1:
        _save(w, root / "model.safetensors", dtype)
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            _save({k: w[k] for k in part}, root / fname, dtype)
            weight_map.update({k: fname for k in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return w


def transformers_llama3_inv_freq(base: float, dim: int, factor: float, low_freq_factor: float,
                                 high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """transformers' _compute_llama3_parameters (modeling_rope_utils.py) transcribed into float64 NumPy: the
    default inv_freq, its low frequencies (wavelength above original / low_freq_factor) divided by the factor, the
    medium ones interpolated between the two by a smooth factor."""
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def hf_forward(w: dict[str, np.ndarray], ids: list[int], theta: float = 10000.0, eps: float = 1e-5,
               linear: float = 1.0, inv_freq: np.ndarray | None = None) -> np.ndarray:
    """Logits of every position, computed the Hugging Face way: unpermuted Q/K, rotate_half RoPE (a linear
    rope_scaling's factor dividing inv_freq, as _compute_linear_scaling_rope_parameters does; or the given
    inv_freq, a scaled one), float64."""
    W = {k: v.astype(np.float64) for k, v in w.items()}
    T = len(ids)
    x = W["model.embed_tokens.weight"][ids]

    def rms(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    if inv_freq is None:
        inv_freq = 1.0 / theta ** (np.arange(0, HD, 2) / HD) / linear
    freqs = np.outer(np.arange(T), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rotate_half(t: np.ndarray) -> np.ndarray:
        return np.concatenate([-t[..., HD // 2:], t[..., :HD // 2]], axis=-1)

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, HEADS, HD)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, KV_HEADS, HD)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, KV_HEADS, HD)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(HD) + mask
        p_att = np.exp(scores - scores.max(-1, keepdims=True))
        p_att /= p_att.sum(-1, keepdims=True)
        att = np.einsum("hts,shd->thd", p_att, v).reshape(T, DIM)
        x = x + att @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        gate = h @ W[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    out = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return rms(x, W["model.norm.weight"]) @ out.T


IDS = [1, 60, 80, 3 + 72, 3 + 101, 259, 261, 2, 100, 33, 5]


def _logits(src, ids=IDS) -> np.ndarray:
    cfg = config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                               "output.weight" not in src.tensors)
    return ReferenceEngine(cfg, src, n_ctx=64).forward(ids, 0, all_logits=True)


def _no_temps(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


# --- Hugging Face checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, shards, tied, pre", [
    ("F32", 1, False, "smollm"), ("BF16", 2, False, "llama3"), ("F32", 3, True, "gpt2"),
])
def test_checkpoint_converts_and_matches_a_hugging_face_forward(tmp_path, dtype, shards, tied, pre):
    w = write_hf(tmp_path / "ckpt", dtype=dtype, shards=shards, tied=tied, pre=pre)
    out = convert(tmp_path / "ckpt", tmp_path / "m.blm")
    _no_temps(tmp_path)
    with BLMFile(out) as f:
        assert f.provenance["source.format"] == "safetensors" and len(f.provenance["source.sha256"]) == 64
        assert ("output.weight" in f.tensors) != tied
        assert f.tensors["blk.0.attn_norm.weight"].type == 0  # norms are float32 whatever the checkpoint has
        assert f.tensors["blk.1.ffn_up.weight"].type == (30 if dtype == "BF16" else 0)
        assert f.metadata["tokenizer.ggml.pre"] == {"smollm": "smollm", "llama3": "llama-bpe", "gpt2": "gpt-2"}[pre]
        ours = _logits(f)
    ref = hf_forward(w, IDS)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    # and it runs as a model
    m = barellm.load(out, engine="reference", context=64)
    assert isinstance(m.generate("the cat", max_tokens=4, temperature=0), str)


LONG_IDS = [(13 * i + 7) % N_VOCAB for i in range(100)]   # positions up to 99: well past where a 1/4 step shows


def _rope_config(key: str, **scaling) -> dict:
    """config.json's RoPE entries: v4's rope_scaling (its type under `key`), or v5's rope_parameters (key "v5")."""
    kind = scaling.pop("rope_type")
    if key == "v5":   # transformers v5: rope_theta moves into rope_parameters, rope_scaling is gone
        return {"rope_theta": None, "rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **scaling}}
    return {"rope_scaling": {key: kind, **scaling}}


def _v5(root: Path) -> None:
    """Drops the null rope_theta _rope_config leaves (a v5 config.json has none)."""
    cfg = json.loads((root / "config.json").read_text())
    if "rope_theta" in cfg and cfg["rope_theta"] is None:
        del cfg["rope_theta"]
    (root / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key", ["rope_type", "type", "v5"])
def test_linear_rope_scaling_converts(tmp_path, key):
    """A llama checkpoint's linear rope_scaling ({"rope_type" or the older "type": "linear", "factor": 4}, or v5's
    rope_parameters with those) converts to the keys llama.cpp's converter writes (rope.scaling.type linear,
    rope.scaling.factor): both engines on the converted file give the Hugging Face forward's logits at inv_freq / 4,
    exactly those of the same model written directly as a GGUF with the keys, and the unscaled forward is far from
    them."""
    from barellm.arch.config import config_of
    from barellm.runtime.engine import NativeEngine

    from gguf_writer import write_gguf

    w = write_hf(tmp_path / "ckpt", **_rope_config(key, rope_type="linear", factor=4.0))
    _v5(tmp_path / "ckpt")
    write_hf(tmp_path / "plain")
    with BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f, \
            BLMFile(convert(tmp_path / "plain", tmp_path / "plain.blm")) as plain:
        assert f.metadata["llama.rope.scaling.type"] == "linear" and f.metadata["llama.rope.scaling.factor"] == 4.0
        assert "llama.rope.scaling.type" not in plain.metadata
        cfg = config_of(f)
        assert cfg.rope_linear == 4.0 and {cfg.layer_rope_scale(i) for i in range(cfg.n_layers)} == {0.25}
        ours = ReferenceEngine(cfg, f, n_ctx=128).forward(LONG_IDS, 0, all_logits=True)
        native = NativeEngine(cfg, f, n_ctx=128, threads=2, chunk=48, kv_type="f32").forward(LONG_IDS, 0,
                                                                                               all_logits=True)
        md = {k: v for k, v in plain.metadata.items() if k.startswith("llama.") or k == "general.architecture"}
        md.update({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
        write_gguf(tmp_path / "direct.gguf", md, [(n, plain.dequantize(n), 0) for n in plain.tensors])
    with GGUFFile(tmp_path / "direct.gguf") as g:
        assert config_of(g) == cfg
        assert np.array_equal(ReferenceEngine(cfg, g, n_ctx=128).forward(LONG_IDS, 0, all_logits=True), ours)
    ref = hf_forward(w, LONG_IDS, linear=4.0)
    tol = 1e-4 * np.abs(ref).max()
    assert np.abs(ours - ref).max() < tol and np.abs(native - ref).max() < tol
    assert np.abs(hf_forward(w, LONG_IDS) - ref).max() > 100 * tol


# Llama 3.1's scaling (its own: 8, 1, 4, 8192) with the original context shrunk to the tiny model's head: of its
# 8 frequency pairs the first keeps its frequency (wavelength 6.3 < 64 / 4), the next two are blended, the rest
# slowed by 8 (wavelengths above 64)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("key, tied", [("rope_type", False), ("type", False), ("v5", True)])
def test_llama3_rope_scaling_converts(tmp_path, key, tied):
    """Llama 3.1's RoPE scaling (rope_type "llama3" in rope_scaling, the older "type" key, or v5's rope_parameters;
    tied embeddings as Llama 3.2 1B/3B have them) converts as llama.cpp's converter converts it: no metadata key,
    rope_freqs.weight (F32, a factor per rotated pair) equal to the ratio of the default inv_freq to transformers'
    scaled one. Both engines on the converted file give the Hugging Face forward's logits at the scaled inv_freq,
    exactly those of the same model written directly as a GGUF with that rope_freqs.weight, and the unscaled
    forward is far from them."""
    from barellm.arch.config import config_of
    from barellm.runtime.engine import NativeEngine

    from gguf_writer import write_gguf

    w = write_hf(tmp_path / "ckpt", tied=tied, head_dim=HD, **_rope_config(key, rope_type="llama3", **LLAMA3))
    _v5(tmp_path / "ckpt")
    write_hf(tmp_path / "plain", tied=tied)
    inv_freq = transformers_llama3_inv_freq(10000.0, HD, **LLAMA3)
    want = (1.0 / 10000.0 ** (np.arange(0, HD, 2) / HD) / inv_freq).astype(np.float32)
    assert want[0] == 1.0 and 1.0 < want[1] < want[2] < 8.0 and set(want[3:].tolist()) == {8.0}

    def engines(src) -> tuple[np.ndarray, np.ndarray]:
        cfg = config_of(src)
        return (ReferenceEngine(cfg, src, n_ctx=128).forward(LONG_IDS, 0, all_logits=True),
                NativeEngine(cfg, src, n_ctx=128, threads=2, chunk=48, kv_type="f32").forward(LONG_IDS, 0,
                                                                                              all_logits=True))

    with BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f, \
            BLMFile(convert(tmp_path / "plain", tmp_path / "plain.blm")) as plain:
        assert {k for k in f.metadata if k.startswith("llama.")} == {k for k in plain.metadata
                                                                      if k.startswith("llama.")}
        assert not any("rope.scaling" in k for k in f.metadata)
        t = f.tensors["rope_freqs.weight"]
        assert (t.type, t.shape) == (0, (HD // 2,)) and "rope_freqs.weight" not in plain.tensors
        assert np.array_equal(f.dequantize("rope_freqs.weight"), want)
        assert ("output.weight" in f.tensors) != tied
        cfg = config_of(f)
        assert cfg.rope_freqs and cfg.tied_output == tied and cfg.rope_linear == 1.0
        ours, native = engines(f)
        md = {k: v for k, v in plain.metadata.items() if k.startswith("llama.") or k == "general.architecture"}
        write_gguf(tmp_path / "direct.gguf", md, [(n, plain.dequantize(n), 0) for n in plain.tensors]
                   + [("rope_freqs.weight", want, 0)])
    with GGUFFile(tmp_path / "direct.gguf") as g:
        assert config_of(g) == cfg
        direct, direct_native = engines(g)
        assert np.array_equal(direct, ours) and np.array_equal(direct_native, native)
    ref = hf_forward(w, LONG_IDS, inv_freq=inv_freq)
    tol = 1e-4 * np.abs(ref).max()
    assert np.abs(ours - ref).max() < tol and np.abs(native - ref).max() < tol
    assert np.abs(hf_forward(w, LONG_IDS) - ref).max() > 100 * tol


@pytest.mark.parametrize("key", ["rope_type", "v5"])
@pytest.mark.parametrize("change, message", [
    ({"factor": None}, "has no factor; llama3 RoPE scaling needs it"),
    ({"low_freq_factor": None}, "has no low_freq_factor; llama3 RoPE scaling needs it"),
    ({"high_freq_factor": None}, "has no high_freq_factor; llama3 RoPE scaling needs it"),
    ({"original_max_position_embeddings": None}, "has no original_max_position_embeddings; llama3 RoPE scaling"),
    ({"factor": "8"}, "factor is '8'; llama3 RoPE scaling needs a positive number there"),
    ({"factor": True}, "factor is True; llama3 RoPE scaling needs a positive number there"),
    ({"factor": float("nan")}, "factor is nan; llama3 RoPE scaling needs a positive number there"),
    ({"factor": 0.5}, "factor 0.5 is out of range \\(llama3 scaling takes 1..1024\\)"),
    ({"low_freq_factor": 0}, "low_freq_factor is 0; llama3 RoPE scaling needs a positive number there"),
    ({"high_freq_factor": -4.0}, "high_freq_factor is -4.0; llama3 RoPE scaling needs a positive number"),
    ({"low_freq_factor": 4.0}, "low_freq_factor 4.0 is not below high_freq_factor 4.0"),
    ({"high_freq_factor": 0.5}, "low_freq_factor 1.0 is not below high_freq_factor 0.5"),
    ({"original_max_position_embeddings": 64.0},
     "original_max_position_embeddings is 64.0; llama3 RoPE scaling needs a positive integer there"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings is 0; llama3 RoPE scaling needs"),
    ({"original_max_position_embeddings": 10 ** 30}, "original_max_position_embeddings 1000000000000000000000000000000 "
     "is out of range"),
])
def test_broken_llama3_rope_scaling_refused_by_key(tmp_path, key, change, message):
    params = {k: v for k, v in {**LLAMA3, **change}.items() if v is not None}
    write_hf(tmp_path / "ckpt", **_rope_config(key, rope_type="llama3", **params))
    _v5(tmp_path / "ckpt")
    where = "rope_parameters" if key == "v5" else "rope_scaling"
    assert_refused(tmp_path / "ckpt", f"config.json: {where} {message}", tmp_path / "out")


@pytest.mark.parametrize("key", ["rope_type", "v5"])
def test_rope_base_and_default_type_convert(tmp_path, key):
    """rope_theta (v5: rope_parameters' rope_theta) is the file's RoPE base; a "default" type scales nothing."""
    cfg = _rope_config(key, rope_type="default")
    cfg = {"rope_theta": None, "rope_parameters": {**cfg["rope_parameters"], "rope_theta": 500000.0}} \
        if key == "v5" else {**cfg, "rope_theta": 500000.0}
    w = write_hf(tmp_path / "ckpt", **cfg)
    _v5(tmp_path / "ckpt")
    with BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f:
        assert f.metadata["llama.rope.freq_base"] == 500000.0 and "llama.rope.scaling.type" not in f.metadata
        ours = _logits(f)
    ref = hf_forward(w, IDS, theta=500000.0)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("key", ["rope_type", "v5"])
@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_unknown_rope_types_refused_by_name(tmp_path, key, kind):
    write_hf(tmp_path / "ckpt", **_rope_config(key, rope_type=kind, factor=8.0))
    _v5(tmp_path / "ckpt")
    where = "rope_parameters" if key == "v5" else "rope_scaling"
    assert_refused(tmp_path / "ckpt", f"{where} type '{kind}' is not supported \\(a llama checkpoint may have: "
                   "default, linear, llama3\\)", tmp_path / "out")


def test_permutation_is_llama_cpps():
    # head_dim 4: a head's rows [0 1 2 3] become [0 2 1 3] (pairs (i, i + hd/2) become adjacent)
    rows = np.arange(8).reshape(8, 1)
    assert permute_qk(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_checkpoint_tokenizer(tmp_path):
    write_hf(tmp_path / "ckpt", pre="smollm")
    with BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f:
        md = f.metadata
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert md["tokenizer.ggml.tokens"] == _vocab()
    assert md["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in MERGES]
    assert list(md["tokenizer.ggml.token_type"][:4]) == [3, 3, 3, 1]
    assert (md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert (md["tokenizer.ggml.unknown_token_id"], md["tokenizer.ggml.padding_token_id"]) == (0, 2)
    assert md["tokenizer.ggml.add_bos_token"] is False and md["tokenizer.chat_template"] == CHATML
    tok = Tokenizer.from_metadata(md)
    ids = tok.encode("the cat in the<|im_end|>")
    assert ids[-1] == 2 and _vocab().index("Ġthe") in ids and tok.decode(ids) == "the cat in the<|im_end|>"
    # llama 3 style: BOS from the post-processor
    write_hf(tmp_path / "l3", pre="llama3")
    with BLMFile(convert(tmp_path / "l3", tmp_path / "l3.blm")) as f:
        assert f.metadata["tokenizer.ggml.add_bos_token"] is True


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1", "f16", "bf16"])
def test_requantized_checkpoint_within_the_types_error_bounds(tmp_path, qtype):
    write_hf(tmp_path / "ckpt")
    f32 = BLMFile(convert(tmp_path / "ckpt", tmp_path / "f32.blm"))
    q = BLMFile(convert(tmp_path / "ckpt", tmp_path / "q.blm", type=qtype))
    qt = quant.by_name(qtype)
    assert q.provenance["convert.type"] == qtype
    for name, info in q.tensors.items():
        x = f32.dequantize(name)
        if len(info.shape) == 1:
            assert info.type == 0 and np.array_equal(q.dequantize(name), x)
            continue
        assert info.type == qt.id, name
        blocks = x.reshape(-1, qt.block_size)
        err = np.abs(q.dequantize(name).reshape(blocks.shape) - blocks).max(axis=-1)
        assert (err <= qt.max_error(blocks)).all(), name
    q.close()
    f32.close()
    m = barellm.load(tmp_path / "q.blm", engine="reference", context=64)
    assert isinstance(m.generate("in the", max_tokens=3, temperature=0), str)


@pytest.mark.parametrize("breakage, message", [
    (lambda r: (r / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'),
     "checkpoints convert from: llama, qwen2"),
    (lambda r: (r / "config.json").write_text("{not json"), "cannot read it as JSON"),
    (lambda r: (r / "tokenizer.json").write_text(json.dumps(tokenizer_json("metaspace"))), "pre_tokenizer"),
    (lambda r: (r / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    (lambda r: (r / "model.safetensors").write_bytes(b"\xff" * 16), "header length"),
    (lambda r: (r / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops"), "not valid JSON"),
    (lambda r: _patch_header(r, "model.norm.weight", data_offsets=[0, 10 ** 9]), "fall outside"),
    (lambda r: _patch_header(r, "model.norm.weight", shape=[65]), "which takes"),
    (lambda r: _patch_header(r, "model.norm.weight", dtype="I32"), "only F32, F16 and BF16"),
    (lambda r: _patch_header(r, "model.norm.weight", dtype="Q9"), "unknown dtype"),
    (lambda r: _rename_tensor(r, "lm_head.weight", "model.mystery.weight"), "not part of a llama checkpoint"),
    (lambda r: _rename_tensor(r, "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up.weight"),
     "not part of a llama"),
])
def test_broken_checkpoints_fail_cleanly(tmp_path, breakage, message):
    root = tmp_path / "ckpt"
    write_hf(root)
    breakage(root)
    assert_refused(root, message, tmp_path / "out")


def assert_refused(root, message, out_dir):
    """Converting the checkpoint at `root` fails with a FormatError matching `message` and writes nothing."""
    out_dir.mkdir()
    with pytest.raises(FormatError, match=message):
        convert(root, out_dir / "m.blm")
    assert not list(out_dir.iterdir())


def test_shard_names_cannot_leave_the_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    write_hf(root, shards=2)
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "../evil.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match="not a .safetensors file name"):
        convert(root, tmp_path / "m.blm")


def _read_st(path: Path) -> tuple[dict, bytes]:
    b = path.read_bytes()
    n = int.from_bytes(b[:8], "little")
    return json.loads(b[8:8 + n]), b[8 + n:]


def _write_st(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(len(h).to_bytes(8, "little") + h + data)


def _patch_header(root: Path, name: str, **fields) -> None:
    header, data = _read_st(root / "model.safetensors")
    header[name].update(fields)
    _write_st(root / "model.safetensors", header, data)


def _rename_tensor(root: Path, old: str, new: str) -> None:
    header, data = _read_st(root / "model.safetensors")
    header[new] = header.pop(old)
    _write_st(root / "model.safetensors", header, data)


def test_safetensors_reader_matches_the_library(tmp_path):
    from safetensors.numpy import load_file

    write_hf(tmp_path / "ckpt", shards=1)
    ours = SafetensorsFile(tmp_path / "ckpt" / "model.safetensors")
    theirs = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert set(ours.tensors) == set(theirs)
    for name, arr in theirs.items():
        assert np.array_equal(ours.floats(name), arr)
    ours.close()


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    write_hf(tmp_path / "ckpt")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    calls = {"n": 0}
    real = quant.quantize

    def flaky(x, t):
        calls["n"] += 1
        if calls["n"] == 6:
            raise FormatError("simulated failure")
        return real(x, t)

    monkeypatch.setattr("barellm.store.convert.quant.quantize", flaky)
    with pytest.raises(FormatError, match="simulated failure"):
        convert(tmp_path / "ckpt", out_dir / "m.blm", type="q8_0")
    assert calls["n"] == 6 and not list(out_dir.iterdir())


# --- GGUF ------------------------------------------------------------------------------------------------


OWN_MODELS = ("tiny_gguf",)   # the model this module writes: its tests run in their own cache (conftest)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_gguf_keeps_types_bytes_and_metadata(tiny_gguf, tmp_path):
    out = convert(tiny_gguf, tmp_path / "t.blm")
    with GGUFFile(tiny_gguf) as g, BLMFile(out) as f:
        assert plain(f.metadata) == {k: v for k, v in g.metadata.items() if k != "general.alignment"}
        assert all(f.metadata_types[k] == g.metadata_types[k] for k in f.metadata)
        for name, info in g.tensors.items():
            assert (f.tensors[name].type, f.tensors[name].shape) == (info.type, info.shape)
            assert np.array_equal(f.raw(name), g.raw(name))
        assert np.array_equal(_logits(f), _logits(g))


def test_gguf_requantized_and_repacked(tiny_gguf, tmp_path):
    with GGUFFile(tiny_gguf) as g:
        ref = _logits(g)
    k = convert(tiny_gguf, tmp_path / "k.blm", layout="kernels")
    with BLMFile(k) as f:
        layouts = {n: t.layout for n, t in f.tensors.items()}
        assert layouts["blk.0.attn_q.weight"] == LAYOUT_INTERLEAVE8 and layouts["output.weight"] == LAYOUT_INTERLEAVE8
        assert layouts["token_embd.weight"] == LAYOUT_ROWS and layouts["output_norm.weight"] == LAYOUT_ROWS
        assert np.array_equal(_logits(f), ref)  # the layout changes where bytes are, not what they say
    q = convert(tiny_gguf, tmp_path / "q.blm", type="q4_0")
    with BLMFile(q) as f:
        assert {t.type for n, t in f.tensors.items() if len(t.shape) == 2} == {2}
        assert {t.type for n, t in f.tensors.items() if len(t.shape) == 1} == {0}
        assert np.isfinite(_logits(f)).all()


def test_native_engine_reads_the_blm_as_it_reads_the_gguf(tiny_gguf, tmp_path):
    engine = pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    out = convert(tiny_gguf, tmp_path / "t.blm")

    def native(src):
        cfg = config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                                   "output.weight" not in src.tensors)
        return engine.NativeEngine(cfg, src, n_ctx=64, threads=1).forward(IDS, 0, all_logits=True)

    with GGUFFile(tiny_gguf) as g, BLMFile(out) as f:
        ref = native(g)
        assert np.array_equal(native(f), ref)
    # a file that stores the matrices repacked already gives the same bits, read in place (no repacking)
    with BLMFile(convert(tiny_gguf, tmp_path / "k.blm", layout="kernels")) as f:
        assert f.tensors["blk.0.attn_output.weight"].layout == LAYOUT_INTERLEAVE8
        cfg = config_from_metadata(f.metadata, f.tensors["token_embd.weight"].shape[0], False)
        e = engine.NativeEngine(cfg, f, n_ctx=64, threads=1)
        assert np.array_equal(e.forward(IDS, 0, all_logits=True), ref)
        data = e.weights.matrix(("blk.0.attn_output.weight",))[0][4]
        assert np.shares_memory(data, f.stored("blk.0.attn_output.weight"))
        del e, data
        # and a reader of rows is refused clearly, never handed repacked bytes as rows
        with pytest.raises(FormatError, match="stored in layout interleave8"):
            f.raw("blk.0.attn_output.weight")


# --- the model cache -------------------------------------------------------------------------------------


def test_transparent_conversion_happens_once(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BARELLM_CONVERT", raising=False)
    src = open_model_file(tiny_gguf)
    assert isinstance(src, BLMFile) and src.path.parent == tmp_path / "home" / "blm"
    assert src.path.name == f"{src.provenance['source.sha256']}.blm"
    first = src.path
    src.close()

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    def no_hashing(*a, **k):
        raise AssertionError("hashed again")

    with monkeypatch.context() as m:
        m.setattr("barellm.store.convert.convert", no_conversion)
        m.setattr("barellm.store.convert.sha256_files", no_hashing)
        again = open_model_file(tiny_gguf)
        assert again.path == first
        again.close()
        # the model API goes the same way
        model = barellm.load(tiny_gguf, engine="reference", context=32)
        assert isinstance(model.source, BLMFile)
    # the same bytes under another path (or touched): hashed, not converted
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    with monkeypatch.context() as m:
        m.setattr("barellm.store.convert.convert", no_conversion)
        other = open_model_file(copy)
        assert other.path == first
        other.close()
    # a direct read on request
    assert isinstance(open_model_file(tiny_gguf, convert=False), GGUFFile)
    monkeypatch.setenv("BARELLM_CONVERT", "0")
    assert isinstance(open_model_file(tiny_gguf), GGUFFile)


def test_an_unwritable_cache_falls_back_to_the_gguf(tiny_gguf, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.write_text("a file where the cache directory should be")
    monkeypatch.setenv("BARELLM_HOME", str(home))
    monkeypatch.delenv("BARELLM_CONVERT", raising=False)
    assert isinstance(open_model_file(tiny_gguf), GGUFFile)
    assert "reading tiny.gguf directly" in capsys.readouterr().err


def test_cache_reconverts_a_corrupt_or_stale_file(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BARELLM_CONVERT", raising=False)
    path = open_model_file(tiny_gguf).path
    buf = bytearray(path.read_bytes())
    buf[100] ^= 0xFF  # inside the header: refused at load
    path.write_bytes(bytes(buf))
    src = open_model_file(tiny_gguf)
    assert src.path == path and src.provenance["converter.revision"] == CONVERTER_REVISION
    src.close()
    monkeypatch.setattr("barellm.store.convert.CONVERTER_REVISION", CONVERTER_REVISION + 1)
    src = open_model_file(tiny_gguf)
    assert src.provenance["converter.revision"] == CONVERTER_REVISION + 1
    src.close()


def test_a_checkpoint_directory_loads_by_path(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    w = write_hf(tmp_path / "ckpt", shards=2)
    model = barellm.load(tmp_path / "ckpt", engine="reference", context=64)
    np.testing.assert_allclose(model.logits(IDS), hf_forward(w, IDS), rtol=0, atol=2e-3)
    assert model.source.path.parent == tmp_path / "home" / "blm"


# --- commands --------------------------------------------------------------------------------------------


def test_cli_convert_verify_inspect(tiny_gguf, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "t.blm"
    assert main(["convert", str(tiny_gguf), "-o", str(out), "--type", "q8_0", "--layout", "kernels", "-q"]) == 0
    assert "tensors" in capsys.readouterr().out
    assert main(["verify", str(out)]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["inspect", str(out), "--tensors"]) == 0
    text = capsys.readouterr().out
    assert "format: blm v1.2" in text and "source: tiny.gguf (gguf" in text and "interleave8" in text
    assert "converter: barellm" in text and "type q8_0, layout kernels" in text
    assert main(["inspect", str(tiny_gguf)]) == 0  # a GGUF is shown as itself, not converted
    assert "format: gguf v3" in capsys.readouterr().out
    with BLMFile(out) as f:
        info = f.tensors["blk.1.ffn_down.weight"]
    buf = bytearray(out.read_bytes())
    buf[info.offset + 3] ^= 0x40
    out.write_bytes(bytes(buf))
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'blk.1.ffn_down.weight'" in err and err.count("\n") == 1
    # a GGUF path verifies its cached conversion, once there is one
    assert main(["verify", str(tiny_gguf)]) == 1
    assert "not converted yet" in capsys.readouterr().err
    open_model_file(tiny_gguf).close()
    assert main(["verify", str(tiny_gguf)]) == 0


# --- the real model --------------------------------------------------------------------------------------


@pytest.mark.model
def test_default_model_blm_logits_bit_identical_to_gguf(smollm_gguf, tmp_path):
    out = convert(smollm_gguf, tmp_path / "smol.blm")
    ids = [1, 504, 3458, 282, 4649, 314, 216]
    with GGUFFile(smollm_gguf) as g:
        ref = _logits(g, ids)
    with BLMFile(out) as f:
        assert f.provenance["source.sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ours = _logits(f, ids)
    assert ours.dtype == np.float32 and np.array_equal(ours, ref)
    r = verify(out)
    assert r.n_tensors == 272


@pytest.mark.model
def test_convert_killed_mid_write_leaves_nothing_that_loads(smollm_gguf, tmp_path):
    out = tmp_path / "killed.blm"
    # requantizing makes the write take seconds, so there is a window to kill it in
    proc = subprocess.Popen([sys.executable, "-m", "barellm", "convert", str(smollm_gguf), "-o", str(out),
                             "--type", "q8_0", "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while True:
            temps = list(tmp_path.glob(".killed.blm.*.tmp"))
            if temps and temps[0].stat().st_size > 4 << 20:  # past the header, into the tensor data
                break
            assert proc.poll() is None, f"convert ended before it could be killed: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not out.exists()
    leftovers = list(tmp_path.glob(".*.tmp"))
    assert leftovers  # the killed writer could not clean up ...
    for p in leftovers:  # ... but what it left is no model
        with pytest.raises(FormatError, match="not a barellm .blm file"):
            BLMFile(p)
    # ... and the next convert into that directory removes it
    subprocess.run([sys.executable, "-m", "barellm", "convert", str(smollm_gguf), "-o", str(out), "-q"],
                   check=True, stdout=subprocess.DEVNULL)
    assert not list(tmp_path.glob(".*.tmp"))
    assert BLMFile(out).tensors


# A writer that stops inside write_blm, between two tensors, until it is killed.
_SLOW_WRITER = r"""
import sys, time
import numpy as np
from barellm.formats.blm_writer import TensorSpec, write_blm

def stall():
    print("writing", flush=True)
    time.sleep(600)
    return np.zeros(64, np.float32)

write_blm(sys.argv[1], {"general.architecture": "llama"},
          [TensorSpec("a", 0, (64,), np.ones(64, np.float32)), TensorSpec("b", 0, (64,), stall)])
"""


def test_the_next_convert_removes_what_a_killed_one_left(tiny_gguf, tmp_path):
    out = tmp_path / "X.blm"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    [stale] = tmp_path.glob(".X.blm.*.tmp")
    assert stale.name.startswith(f".X.blm.{proc.pid}.")
    # a temporary of a writer still running, and files that only look like temporaries, are left alone
    live = tmp_path / f".Y.blm.{os.getpid()}.0123abcd.tmp"
    other = tmp_path / ".notes.txt.1.0123abcd.tmp"  # not a .blm: not ours to judge
    for p in (live, other):
        p.write_bytes(b"x")
    assert main(["convert", str(tiny_gguf), "-o", str(tmp_path / "Z.blm"), "-q"]) == 0
    assert not stale.exists()
    assert live.exists() and other.exists()
    assert BLMFile(tmp_path / "Z.blm").tensors
