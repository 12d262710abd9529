"""Hugging Face checkpoints of the families beyond llama's (Qwen3-MoE, Phi-3, SmolLM3, Gemma 2, Gemma 3, gpt-oss)
through `barellm convert`.

Each checkpoint is derived from one of the tiny llama.cpp-made GGUFs of tests/data by undoing llama.cpp's
convert_hf_to_gguf.py mapping of its family (written out here, independently of the converter): the
converted .blm must hold the GGUF's tensors bit for bit, so that llama.cpp's logits for the GGUF check the
converted model too. A BF16 checkpoint of each checks that whatever moves elements (permutations, stacks,
transposes, interleaved halves) keeps their bits; gpt-oss's MXFP4 experts are also decoded the way Hugging Face
decodes them. Broken checkpoints get an error naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from test_convert import CHATML, assert_refused, from_bf16, to_bf16, tokenizer_json

import barellm
from barellm.__main__ import main
from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.arch.registry import ARCHITECTURES
from barellm.errors import FormatError
from barellm.formats.blm import BLMFile
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine
from barellm.store.convert import convert
from barellm.store.hf_families import FAMILIES

from conftest import DATA

# --- writing a checkpoint ------------------------------------------------------------------------------------

_ST = {"F32": (np.float32, 4), "BF16": (np.uint16, 2), "U8": (np.uint8, 1)}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A .safetensors file: u64 header length, the JSON header, the data (name -> (dtype, array))."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        dtype, a = tensors[name]
        data = np.ascontiguousarray(a, _ST[dtype][0]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b"".join(chunks))


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's permute: a GGUF head's rows (0, hd/2, 1, hd/2 + 1, ...) back to Hugging Face's order."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_mxfp4_to_openai(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """ggml MXFP4 rows (per 32 values: E8M0 scale, 16 bytes with value j low and j + 16 high) -> gpt-oss's
    checkpoint layout: blocks (..., groups, 16) with value 2j low and 2j + 1 high, scales (..., groups)."""
    b = raw.reshape(*shape[:-1], shape[-1] // 32, 17)
    scales, qs = b[..., 0], b[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)   # the 32 values in order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), scales.copy()


def _base_config(md: dict, arch: str, n_vocab: int, tied: bool) -> dict:
    p = arch + "."
    heads = md[p + "attention.head_count"]
    cfg = {
        "hidden_size": md[p + "embedding_length"], "intermediate_size": md[p + "feed_forward_length"],
        "num_hidden_layers": md[p + "block_count"], "num_attention_heads": heads,
        "num_key_value_heads": md[p + "attention.head_count_kv"],
        "rms_norm_eps": float(md[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(md.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": md[p + "context_length"], "vocab_size": n_vocab, "tie_word_embeddings": tied,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
    if p + "attention.key_length" in md:
        cfg["head_dim"] = md[p + "attention.key_length"]
    return cfg


def hf_from_gguf(gguf: Path, root: Path, dtype: str = "F32") -> None:
    """The Hugging Face checkpoint llama.cpp's converter would have made `gguf` from."""
    root.mkdir(parents=True)
    with GGUFFile(gguf) as g:
        md = dict(g.metadata)
        arch = md["general.architecture"]
        p = arch + "."
        floats = {n: g.dequantize(n) for n, t in g.tensors.items() if t.type != 39}
        mx = {n: (np.array(g.raw(n)), t.shape) for n, t in g.tensors.items() if t.type == 39}
    n_layers, heads, kv = md[p + "block_count"], md[p + "attention.head_count"], md[p + "attention.head_count_kv"]
    n_vocab = floats["token_embd.weight"].shape[0]
    tied = "output.weight" not in floats
    cfg = _base_config(md, arch, n_vocab, tied)
    shift = 1.0 if arch in ("gemma2", "gemma3") else 0.0   # Gemma's norms: llama.cpp stores w + 1
    w = {"model.embed_tokens.weight": floats["token_embd.weight"],
         "model.norm.weight": floats["output_norm.weight"] - shift}
    if not tied:
        w["lm_head.weight"] = floats["output.weight"]
    u8: dict[str, np.ndarray] = {}
    for i in range(n_layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."

        def put(hf: str, gg: str, b: str = b, h: str = h) -> None:
            w[h + hf] = floats[b + gg]

        put("self_attn.o_proj.weight", "attn_output.weight")
        if arch == "phi3":
            put("self_attn.qkv_proj.weight", "attn_qkv.weight")
            put("mlp.gate_up_proj.weight", "ffn_up.weight")
            put("mlp.down_proj.weight", "ffn_down.weight")
        else:
            q, k = floats[b + "attn_q.weight"], floats[b + "attn_k.weight"]
            if arch in ("llama", "smollm3"):  # llama.cpp permutes llama's (and SmolLM3's) Q and K rows
                q, k = unpermute(q, heads), unpermute(k, kv)
            w[h + "self_attn.q_proj.weight"], w[h + "self_attn.k_proj.weight"] = q, k
            put("self_attn.v_proj.weight", "attn_v.weight")
        if arch == "qwen3moe":
            put("self_attn.q_norm.weight", "attn_q_norm.weight")
            put("self_attn.k_norm.weight", "attn_k_norm.weight")
        if arch == "gemma3":
            w[h + "self_attn.q_norm.weight"] = floats[b + "attn_q_norm.weight"] - shift
            w[h + "self_attn.k_norm.weight"] = floats[b + "attn_k_norm.weight"] - shift
        if arch == "qwen3moe":
            put("mlp.gate.weight", "ffn_gate_inp.weight")
            for e in range(md[p + "expert_count"]):
                for part in ("gate", "up", "down"):
                    w[f"{h}mlp.experts.{e}.{part}_proj.weight"] = floats[f"{b}ffn_{part}_exps.weight"][e]
        if arch in ("llama", "smollm3", "gemma2", "gemma3"):
            for part in ("gate", "up", "down"):
                put(f"mlp.{part}_proj.weight", f"ffn_{part}.weight")
        if arch in ("gemma2", "gemma3"):
            for hf, gg in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
                           ("pre_feedforward_layernorm", "ffn_norm"), ("post_feedforward_layernorm", "post_ffw_norm")):
                w[f"{h}{hf}.weight"] = floats[f"{b}{gg}.weight"] - shift
        elif arch == "gpt-oss":
            put("input_layernorm.weight", "attn_norm.weight")
            put("post_attention_layernorm.weight", "post_attention_norm.weight")
            for x in "qkv":
                put(f"self_attn.{x}_proj.bias", f"attn_{x}.bias")
            put("self_attn.o_proj.bias", "attn_output.bias")
            put("self_attn.sinks", "attn_sinks.weight")
            put("mlp.router.weight", "ffn_gate_inp.weight")
            put("mlp.router.bias", "ffn_gate_inp.bias")
            put("mlp.experts.down_proj_bias", "ffn_down_exps.bias")
            gate_b, up_b = floats[b + "ffn_gate_exps.bias"], floats[b + "ffn_up_exps.bias"]
            fused_b = np.empty((gate_b.shape[0], 2 * gate_b.shape[1]), np.float32)
            fused_b[:, 0::2], fused_b[:, 1::2] = gate_b, up_b   # gate|up outputs interleave
            w[h + "mlp.experts.gate_up_proj_bias"] = fused_b
            if b + "ffn_gate_exps.weight" in mx:                  # MXFP4: blocks and scales, rows interleaved
                (gb, gs), (ub, us) = (gguf_mxfp4_to_openai(*mx[b + f"ffn_{x}_exps.weight"]) for x in ("gate", "up"))
                blocks = np.empty((gb.shape[0], 2 * gb.shape[1], *gb.shape[2:]), np.uint8)
                scales = np.empty((gs.shape[0], 2 * gs.shape[1], gs.shape[2]), np.uint8)
                blocks[:, 0::2], blocks[:, 1::2], scales[:, 0::2], scales[:, 1::2] = gb, ub, gs, us
                u8[h + "mlp.experts.gate_up_proj_blocks"], u8[h + "mlp.experts.gate_up_proj_scales"] = blocks, scales
                db, ds = gguf_mxfp4_to_openai(*mx[b + "ffn_down_exps.weight"])
                u8[h + "mlp.experts.down_proj_blocks"], u8[h + "mlp.experts.down_proj_scales"] = db, ds
            else:                                                  # floats: (experts, in, out), outputs interleaved
                gate, up = floats[b + "ffn_gate_exps.weight"], floats[b + "ffn_up_exps.weight"]
                fused = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)
                fused[..., 0::2], fused[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
                w[h + "mlp.experts.gate_up_proj"] = fused
                w[h + "mlp.experts.down_proj"] = floats[b + "ffn_down_exps.weight"].transpose(0, 2, 1)
        else:
            put("input_layernorm.weight", "attn_norm.weight")
            put("post_attention_layernorm.weight", "ffn_norm.weight")
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    cfg.update({
        # rope_freqs.weight: Llama 3.1's scaling, which llama.cpp's converter makes from config.json's parameters
        # (llama3rope-tiny's factors are those of Llama 3.1's own: 8, 1, 4, 8192)
        "llama": lambda: {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
                          if "rope_freqs.weight" in floats else None},
        "qwen3moe": lambda: {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                             "num_experts": md[p + "expert_count"], "num_experts_per_tok": md[p + "expert_used_count"],
                             "moe_intermediate_size": md[p + "expert_feed_forward_length"], "norm_topk_prob": True,
                             "decoder_sparse_step": 1, "mlp_only_layers": []},
        "phi3": lambda: {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                         "partial_rotary_factor": md[p + "rope.dimension_count"] * cfg["num_attention_heads"]
                         / cfg["hidden_size"],
                         "original_max_position_embeddings": md[p + "rope.scaling.original_context_length"],
                         "rope_scaling": {"type": "longrope",
                                          "long_factor": floats["rope_factors_long.weight"].tolist(),
                                          "short_factor": floats["rope_factors_short.weight"].tolist()}},
        "smollm3": lambda: {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"],
                            "no_rope_layer_interval": 4, "use_sliding_window": False,
                            "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n_layers)]},
        "gemma2": lambda: {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                           "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                           "query_pre_attn_scalar": cfg["head_dim"],
                           "sliding_window": md[p + "attention.sliding_window"],
                           "attn_logit_softcapping": float(md[p + "attn_logit_softcapping"]),
                           "final_logit_softcapping": float(md[p + "final_logit_softcapping"]),
                           "layer_types": alternating},
        "gemma3": lambda: {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": cfg["head_dim"],
                           "sliding_window": md[p + "attention.sliding_window"],
                           "rope_local_base_freq": float(md.get(p + "rope.freq_base_swa", 10000.0)),
                           "final_logit_softcapping": None, "attn_logit_softcapping": None,
                           "rope_scaling": {"rope_type": "linear", "factor": float(md[p + "rope.scaling.factor"])}
                           if md.get(p + "rope.scaling.type") == "linear" else None,
                           "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(n_layers)]},
        "gpt-oss": lambda: {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                            "num_local_experts": md[p + "expert_count"],
                            "num_experts_per_tok": md[p + "expert_used_count"],
                            "experts_per_token": md[p + "expert_used_count"], "attention_bias": True,
                            "sliding_window": md[p + "attention.sliding_window"], "swiglu_limit": 7.0,
                            "layer_types": alternating,
                            "rope_scaling": {"rope_type": "yarn", "factor": float(md[p + "rope.scaling.factor"]),
                                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings":
                                                 md[p + "rope.scaling.original_context_length"]},
                            **({"quantization_config": {"quant_method": "mxfp4"}} if mx else {})},
    }[arch]())
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text(json.dumps(tokenizer_json("smollm")))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHATML}))
    out = {n: ("BF16", to_bf16(a)) if dtype == "BF16" else ("F32", a) for n, a in w.items()}
    out.update({n: ("U8", a) for n, a in u8.items()})
    write_safetensors(root / "model.safetensors", out)


# --- the families, against their GGUFs and llama.cpp's logits -------------------------------------------------

GGUFS = ["llama3rope-tiny", "qwen3moe-tiny", "phi3-tiny", "smollm3-tiny", "gemma2-tiny", "gpt-oss-tiny",
         "gpt-oss-mxfp4-tiny"]


@pytest.fixture(scope="module", params=GGUFS)
def converted(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    hf_from_gguf(DATA / f"{request.param}.gguf", tmp / "ckpt")
    out = convert(tmp / "ckpt", tmp / "m.blm")
    g, f = GGUFFile(DATA / f"{request.param}.gguf"), BLMFile(out)
    yield request.param, g, f, tmp / "ckpt"
    g.close()
    f.close()


def test_the_table_covers_every_tensor_of_each_architecture():
    for row in FAMILIES:
        assert set(row.layer) == set(ARCHITECTURES[row.arch].layer_tensors), row.arch


def test_converted_tensors_are_the_ggufs(converted):
    name, g, f, _ = converted
    assert set(f.tensors) == set(g.tensors)
    for n, t in g.tensors.items():
        ours = f.tensors[n]
        assert (ours.type, ours.shape) == (t.type, t.shape), n
        assert np.array_equal(np.asarray(f.raw(n)), np.asarray(g.raw(n))), n   # bit for bit
    assert config_of(f) == config_of(g)


def test_converted_logits_match_llamacpp(converted):
    """The reference engine on the converted file: the GGUF's logits exactly, so llama.cpp's top-1 and no further
    from llama.cpp's logits than the GGUF path is (tests/test_moe.py, tests/test_dense_rows.py)."""
    name, g, f, _ = converted
    gold = np.load(DATA / f"{name}.logits.npz")
    ids, want = gold["ids"].tolist(), gold["logits"]
    ours = reference_engine(config_of(f), f, 256).forward(ids, 0, all_logits=True)
    theirs = reference_engine(config_of(g), g, 256).forward(ids, 0, all_logits=True)
    assert np.array_equal(ours, theirs)
    top1 = float(np.mean(ours.argmax(1) == want.argmax(1)))
    err = float(np.abs(ours - want).max())
    print(f"{name} converted from Hugging Face, reference: top-1 {100 * top1:.2f} %, max |dlogit| {err:.2e}")
    assert top1 >= (0.95 if "mxfp4" in name else 1.0) and err <= (0.5 if "mxfp4" in name else 1e-2)


def test_native_engine_runs_the_converted_file(converted):
    engine = pytest.importorskip("barellm.runtime.engine", reason="native engine not built")
    name, g, f, _ = converted
    ids = np.load(DATA / f"{name}.logits.npz")["ids"].tolist()[:40]
    ours = engine.NativeEngine(config_of(f), f, n_ctx=128, threads=2, chunk=16).forward(ids, 0, all_logits=True)
    theirs = engine.NativeEngine(config_of(g), g, n_ctx=128, threads=2, chunk=16).forward(ids, 0, all_logits=True)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("name", [n for n in GGUFS if "mxfp4" not in n])
def test_bf16_checkpoints_keep_their_bits(name, tmp_path):
    """Every element moved (permuted, stacked, transposed, split) keeps its bf16 bits; norms become float32 (Gemma's
    1 + w computed in float32, as Hugging Face does)."""
    hf_from_gguf(DATA / f"{name}.gguf", tmp_path / "ckpt", dtype="BF16")
    with GGUFFile(DATA / f"{name}.gguf") as g, BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f:
        for n, t in g.tensors.items():
            want = g.dequantize(n)
            got = f.dequantize(n)
            if len(t.shape) == 1 or n.startswith("rope_"):
                assert f.tensors[n].type == 0, n
                if n.endswith("norm.weight") and name == "gemma2-tiny":
                    want = from_bf16(to_bf16(want - 1.0)) + np.float32(1.0)
                elif not n.startswith("rope_"):   # made from config.json (rope_factors_*, rope_freqs)
                    want = from_bf16(to_bf16(want))
            else:
                assert f.tensors[n].type == 30, n
                want = from_bf16(to_bf16(want))
            assert np.array_equal(got, want), n


def test_mxfp4_experts_decode_as_hugging_face_decodes_them(tmp_path):
    """gpt-oss's MXFP4 experts dequantized as transformers does (low nibble first, E2M1 values, 2^(scale - 127),
    then (experts, in, out) with gate and up interleaved on the outputs) equal the converted file's."""
    hf_from_gguf(DATA / "gpt-oss-mxfp4-tiny.gguf", tmp_path / "ckpt")
    from safetensors.numpy import load_file

    st = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)

    def hf_dequant(prefix: str) -> np.ndarray:
        blocks, scales = st[prefix + "_blocks"], st[prefix + "_scales"].astype(np.int32) - 127
        out = np.empty((*blocks.shape[:-1], 32), np.float32)
        out[..., 0::2], out[..., 1::2] = lut[blocks & 0x0F], lut[blocks >> 4]
        out = np.ldexp(out, scales[..., None]).reshape(*blocks.shape[:2], -1)
        return out.transpose(0, 2, 1)   # (experts, in, out)

    with BLMFile(convert(tmp_path / "ckpt", tmp_path / "m.blm")) as f:
        for i in range(2):
            fused = hf_dequant(f"model.layers.{i}.mlp.experts.gate_up_proj")
            assert np.array_equal(f.dequantize(f"blk.{i}.ffn_gate_exps.weight"), fused[..., 0::2].transpose(0, 2, 1))
            assert np.array_equal(f.dequantize(f"blk.{i}.ffn_up_exps.weight"), fused[..., 1::2].transpose(0, 2, 1))
            down = hf_dequant(f"model.layers.{i}.mlp.experts.down_proj")
            assert np.array_equal(f.dequantize(f"blk.{i}.ffn_down_exps.weight"), down.transpose(0, 2, 1))


def test_a_checkpoint_directory_loads_and_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    hf_from_gguf(DATA / "phi3-tiny.gguf", tmp_path / "ckpt")
    gold = np.load(DATA / "phi3-tiny.logits.npz")
    model = barellm.load(tmp_path / "ckpt", engine="reference", context=256)
    assert model.source.path.parent == tmp_path / "home" / "blm"
    got = model.logits(gold["ids"].tolist())
    assert np.array_equal(got.argmax(-1), gold["logits"].argmax(-1)) and np.abs(got - gold["logits"]).max() < 1e-2
    assert isinstance(model.generate("the cat", max_tokens=4, temperature=0), str)


def test_cli_converts_a_checkpoint(tmp_path, capsys):
    hf_from_gguf(DATA / "qwen3moe-tiny.gguf", tmp_path / "ckpt")
    out = tmp_path / "q.blm"
    assert main(["convert", str(tmp_path / "ckpt"), "-o", str(out), "--type", "q8_0", "-q"]) == 0
    with BLMFile(out) as f:
        assert f.tensors["blk.0.ffn_up_exps.weight"].type == 8 and f.metadata["general.architecture"] == "qwen3moe"
    assert main(["verify", str(out)]) == 0


# --- broken checkpoints ----------------------------------------------------------------------------------------


def _edit_config(root: Path, **changes) -> None:
    cfg = json.loads((root / "config.json").read_text())
    cfg.update(changes)
    (root / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(root: Path, edit) -> None:
    path = root / "model.safetensors"
    b = path.read_bytes()
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(len(h).to_bytes(8, "little") + h + b[8 + n:])


def _drop(name: str):
    return lambda header: header.pop(name)


def _rename(old: str, new: str):
    return lambda header: header.__setitem__(new, header.pop(old))


def _reshape(name: str, shape: list[int]):
    return lambda header: header[name].update(shape=shape)


def _swap_shapes(a: str, b: str):
    def edit(header: dict) -> None:
        header[a]["shape"], header[b]["shape"] = header[b]["shape"], header[a]["shape"]
    return edit


@pytest.mark.parametrize("gguf, breakage, message", [
    ("qwen3moe-tiny", lambda r: _edit_config(r, model_type="mamba", architectures=["MambaForCausalLM"]),
     "model_type 'mamba' .* not supported; checkpoints convert from: llama, qwen2, qwen3, qwen3_moe, phi3, "
     "smollm3, gemma2, gemma3_text, gpt_oss"),
    ("qwen3moe-tiny", lambda r: _edit_tensors(r, _drop("model.layers.1.mlp.experts.3.up_proj.weight")),
     "tensor 'model.layers.1.mlp.experts.3.up_proj.weight' is missing .*'blk.1.ffn_up_exps.weight'"),
    ("qwen3moe-tiny", lambda r: _edit_tensors(r, _rename("model.layers.0.mlp.gate.weight",
                                                         "model.layers.0.mlp.shared_expert_gate.weight")),
     "'model.layers.0.mlp.shared_expert_gate.weight' is not part of a qwen3_moe checkpoint"),
    ("qwen3moe-tiny", lambda r: _edit_tensors(r, _swap_shapes("model.layers.0.mlp.experts.2.up_proj.weight",
                                                              "model.layers.0.mlp.experts.2.down_proj.weight")),
     "'model.layers.0.mlp.experts.2.up_proj.weight' is F32 of shape \\(64, 32\\).*every expert's must match"),
    ("qwen3moe-tiny", lambda r: _edit_config(r, norm_topk_prob=False), "norm_topk_prob is false"),
    ("qwen3moe-tiny", lambda r: _edit_config(r, num_experts=9), "model.layers.0.mlp.experts.8.gate_proj.weight"),
    ("qwen3moe-tiny", lambda r: _edit_config(r, num_experts=10 ** 9),   # refused before a plan of 10^9 tensors
     "'qwen3moe.expert_count' = 1000000000 is out of range"),
    ("smollm3-tiny", lambda r: _edit_config(r, num_hidden_layers=10 ** 9, no_rope_layers=None),
     "num_hidden_layers 1000000000 is out of range"),
    ("phi3-tiny", lambda r: _edit_config(r, rope_scaling={"type": "longrope", "long_factor": [1.0] * 5,
                                                          "short_factor": [1.0] * 5}),
     "rope_scaling.long_factor should be 6 positive numbers"),
    ("phi3-tiny", lambda r: _edit_config(r, original_max_position_embeddings=0),
     "original_max_position_embeddings 0 is not in 2..max_position_embeddings \\(1024\\)"),
    ("gpt-oss-tiny", lambda r: _edit_config(r, rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                                             "original_max_position_embeddings": 1 << 40}),
     "rope.scaling.original_context_length 1099511627776 is out of range"),
    ("phi3-tiny", lambda r: _edit_config(r, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic' is not supported \\(a phi3 checkpoint may have: default, longrope, su\\)"),
    ("phi3-tiny", lambda r: _edit_tensors(r, _reshape("model.layers.1.self_attn.qkv_proj.weight", [64, 128])),
     "'model.layers.1.self_attn.qkv_proj.weight' make 'blk.1.attn_qkv.weight' of shape \\(64, 128\\), "
     "expected \\(128, 64\\)"),
    ("smollm3-tiny", lambda r: _edit_config(r, no_rope_layers=[1, 1, 0, 1]), "no_rope_layers \\[1, 1, 0, 1\\]"),
    ("gemma2-tiny", lambda r: _edit_config(r, query_pre_attn_scalar=0), "query_pre_attn_scalar 0.0 is out of range"),
    ("gemma2-tiny", lambda r: _edit_config(r, hidden_activation="gelu", hidden_act="gelu"), "hidden_act 'gelu'"),
    ("gemma2-tiny", lambda r: _edit_config(r, layer_types=["full_attention"] * 2), "layer_types"),
    ("gpt-oss-mxfp4-tiny", lambda r: _edit_tensors(r, _drop("model.layers.0.mlp.experts.down_proj_scales")),
     "'blk.0.ffn_down_exps.weight' needs the tensors 'model.layers.0.mlp.experts.down_proj_blocks', "
     "'model.layers.0.mlp.experts.down_proj_scales' or 'model.layers.0.mlp.experts.down_proj'"),
    ("gpt-oss-mxfp4-tiny", lambda r: _edit_tensors(r, _reshape("model.layers.1.mlp.experts.gate_up_proj_scales",
                                                               [8, 64, 1, 2])),
     "'model.layers.1.mlp.experts.gate_up_proj_blocks' .* is not MXFP4"),
    ("gpt-oss-tiny", lambda r: _edit_config(r, swiglu_limit=10.0), "swiglu_limit 10.0"),
    ("gpt-oss-tiny", lambda r: _edit_config(r, quantization_config={"quant_method": "fp8"}),
     "quantization_config 'fp8': quantized checkpoints are not supported \\(gpt_oss takes mxfp4\\)"),
    ("gpt-oss-tiny", lambda r: _edit_tensors(r, _drop("model.layers.1.self_attn.sinks")),
     "tensor 'model.layers.1.self_attn.sinks' is missing"),
    # linear RoPE scaling where llama.cpp's converter does not write it
    ("gemma2-tiny", lambda r: _edit_config(r, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling type 'linear' is not supported \\(a gemma2 checkpoint may have: default\\)"),
    ("gpt-oss-tiny", lambda r: _edit_config(r, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling type 'linear' is not supported \\(a gpt_oss checkpoint may have: default, yarn\\)"),
])
def test_broken_checkpoints_fail_cleanly(tmp_path, gguf, breakage, message):
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / f"{gguf}.gguf", root)
    breakage(root)
    assert_refused(root, message, tmp_path / "out")


def test_qwen2_tokenizer_converts(tmp_path):
    """Qwen's tokenizer.json (as Qwen3-MoE ships it): llama 3's split with single digits, an NFC normalizer
    (which llama.cpp's tokenizer of the GGUF leaves out too), no ignore_merges."""
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / "qwen3moe-tiny.gguf", root)
    tj = tokenizer_json("llama3")
    split = tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]
    split["Regex"] = split["Regex"].replace(r"\p{N}{1,3}", r"\p{N}")
    tj["model"]["ignore_merges"], tj["normalizer"] = False, {"type": "NFC"}
    (root / "tokenizer.json").write_text(json.dumps(tj))
    with BLMFile(convert(root, tmp_path / "m.blm")) as f:
        assert f.metadata["tokenizer.ggml.pre"] == "qwen2"
        from barellm.text.tokenizer import Tokenizer

        tok = Tokenizer.from_metadata(f.metadata)
    text = "the cat in 2024<|im_end|>"
    assert tok.decode(tok.encode(text)) == text and tok.encode(text)[-1] == 2
    tj["normalizer"] = {"type": "NFKC"}
    (root / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(FormatError, match="a normalizer \\(NFKC\\) is not supported"):
        convert(root, tmp_path / "n.blm")


# --- SentencePiece tokenizers (Phi-3, Gemma 2) --------------------------------------------------------------


def _pb_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _pb(field: int, value: bytes | int | float) -> bytes:
    """One protobuf field: bytes length-delimited, int varint, float fixed32."""
    if isinstance(value, bytes):
        return _pb_varint(field << 3 | 2) + _pb_varint(len(value)) + value
    if isinstance(value, float):
        return _pb_varint(field << 3 | 5) + np.float32(value).tobytes()
    return _pb_varint(field << 3) + _pb_varint(value)


def write_tokenizer_model(path: Path, tokens: list[str], scores: list[float], types: list[int],
                          dummy_prefix: bool | None) -> None:
    """A SentencePiece ModelProto: the pieces (text, score, type unless normal), a trainer spec the reader skips,
    and a normalizer spec with add_dummy_prefix when given."""
    body = b"".join(_pb(1, _pb(1, t.encode()) + _pb(2, float(s)) + (_pb(3, k) if k != 1 else b""))
                    for t, s, k in zip(tokens, scores, types, strict=True))
    body += _pb(2, _pb(3, 2) + _pb(1, b"spm.txt") + _pb(35, 1))
    if dummy_prefix is not None:
        body += _pb(3, _pb(1, b"identity") + _pb(3, int(dummy_prefix)))
    path.write_bytes(body)


@pytest.mark.parametrize("name, dummy_prefix", [("phi3-tiny", None), ("gemma2-tiny", False)])
def test_sentencepiece_tokenizer_is_the_ggufs(tmp_path, name, dummy_prefix):
    """A checkpoint with a tokenizer.model (and no tokenizer.json) gets llama.cpp's vocabulary: the GGUF's tokens,
    scores and types, and the same ids for a text; add_dummy_prefix becomes add_space_prefix."""
    from barellm.text.tokenizer import Tokenizer

    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / f"{name}.gguf", root)
    (root / "tokenizer.json").unlink()
    with GGUFFile(DATA / f"{name}.gguf") as g:
        md = dict(g.metadata)
    write_tokenizer_model(root / "tokenizer.model", md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.scores"]),
                          list(md["tokenizer.ggml.token_type"]), dummy_prefix)
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "unk_token": "<unk>", "add_bos_token": True}))
    with BLMFile(convert(root, tmp_path / "m.blm")) as f:
        got = dict(f.metadata)
    for key in ("tokens", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id", "add_bos_token"):
        assert np.array_equal(got[f"tokenizer.ggml.{key}"], md[f"tokenizer.ggml.{key}"]), key
    assert np.array_equal(np.asarray(got["tokenizer.ggml.scores"], np.float32),
                          np.asarray(md["tokenizer.ggml.scores"], np.float32))
    assert got["tokenizer.ggml.model"] == "llama" and got["tokenizer.ggml.add_space_prefix"] == (dummy_prefix is None)
    md["tokenizer.ggml.add_space_prefix"] = dummy_prefix is None
    ours, theirs = Tokenizer.from_metadata(got), Tokenizer.from_metadata(md)
    for text in ("the quick brown fox", " leading space", "x\n\ny"):
        assert ours.encode(text, add_special=True) == theirs.encode(text, add_special=True)


def test_added_tokens_of_a_sentencepiece_checkpoint(tmp_path):
    """added_tokens.json and tokenizer_config.json's added_tokens_decoder as llama.cpp's converter takes them:
    user-defined (control if special) tokens of score -1000 in place of the ids' pieces or placeholders."""
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / "phi3-tiny.gguf", root)
    (root / "tokenizer.json").unlink()
    write_tokenizer_model(root / "tokenizer.model", ["<unk>", "<s>", "</s>", "▁a", "b"], [0, 0, 0, -1.0, -2.0],
                          [2, 3, 3, 1, 1], None)
    (root / "added_tokens.json").write_text(json.dumps({"<|user|>": 300}))
    (root / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "301": {"content": "<|end|>", "special": True}, "4": {"content": "zz", "special": False}}}))
    with BLMFile(convert(root, tmp_path / "m.blm")) as f:
        md = f.metadata
        tokens, types = md["tokenizer.ggml.tokens"], list(md["tokenizer.ggml.token_type"])
        scores = np.asarray(md["tokenizer.ggml.scores"])
    assert len(tokens) == 304 and tokens[:5] == ["<unk>", "<s>", "</s>", "▁a", "zz"] and tokens[5] == "[PAD5]"
    assert (tokens[300], types[300], tokens[301], types[301]) == ("<|user|>", 4, "<|end|>", 3)
    assert types[:6] == [2, 3, 3, 1, 4, 5] and scores[4] == scores[300] == -1000 and scores[5] == -10000
    (root / "added_tokens.json").write_text(json.dumps({"<|user|>": 304}))
    with pytest.raises(FormatError, match="added_tokens.json: added token '<|user|>' has id 304, outside"):
        convert(root, tmp_path / "n.blm")


def test_a_broken_tokenizer_model_fails_cleanly(tmp_path):
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / "phi3-tiny.gguf", root)
    (root / "tokenizer.json").unlink()
    write_tokenizer_model(root / "tokenizer.model", ["<unk>", "<s>"], [0.0, 0.0], [2, 3], None)
    data = (root / "tokenizer.model").read_bytes()
    (root / "tokenizer.model").write_bytes(data[:-3])
    with pytest.raises(FormatError, match="tokenizer.model: protobuf .* runs past its message"):
        convert(root, tmp_path / "m.blm")
    (root / "tokenizer.model").write_bytes(b"\x0b" + data)   # wire type 3 (a group)
    with pytest.raises(FormatError, match="wire type 3"):
        convert(root, tmp_path / "m.blm")


# --- o200k tokenizers (gpt-oss, Phi-4-mini) ------------------------------------------------------------------

# tokenizer.json's Split regex of gpt-oss, Phi-4-mini and Llama 4 (tiktoken's o200k pattern), as they ship it
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>"]
O200K_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("'", "s"), ("'", "l"), ("'l", "l"), ("1", "2"), ("12", "3"),
                ("Ġ", "Ġ"), ("Ġ", "d"), ("o", "n"), ("Ġd", "on"), ("C", "a"), ("e", "r"), ("ä", "½"), ("å", "¥")]
# contractions (lower and upper case), numbers, CJK, emoji, case changes, whitespace runs and line breaks, a
# special token
O200K_TEXT = ("I'm sure THEY'LL say we'll see: it's 12345 dollars, don't they? The cat's 1234567 hats\n\n\n   "
              "你好，世界 🙂👍 camelCaseWORDS and/or a/b/c  \t tabs   end<|return|> \n")


def _o200k_vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    """The vocabulary llama.cpp's converter writes for the tokenizer.json below: the 256 bytes, the merges' tokens,
    the specials (control), and [PADi] placeholders (unused) up to the embedding's rows."""
    from tiny_model import byte_vocab

    words = byte_vocab() + [a + b for a, b in O200K_MERGES] + O200K_SPECIALS
    tokens = words + [f"[PAD{i}]" for i in range(len(words), n_vocab)]
    types = [1] * (len(words) - len(O200K_SPECIALS)) + [3] * len(O200K_SPECIALS) + [5] * (n_vocab - len(words))
    return tokens, types


def _o200k_tokenizer_json(ignore_merges: bool, pattern: str = O200K_SPLIT) -> dict:
    tokens, _ = _o200k_vocab(0)
    n_plain = len(tokens) - len(O200K_SPECIALS)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "added_tokens": [{"id": n_plain + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in enumerate(O200K_SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": ignore_merges, "vocab": {t: i for i, t in enumerate(tokens[:n_plain])},
                  "merges": [[a, b] for a, b in O200K_MERGES]},
    }


def _hf_o200k_split(text: str) -> list[str]:
    """tokenizer.json's regex as Hugging Face's tokenizers (Rust's regex) runs it, for the characters of `text`:
    each Unicode property class written out from unicodedata over those characters (Python's re has no \\p)."""
    import re
    import unicodedata

    chars = sorted(set(text))

    def cls(*cats: str) -> str:
        return "".join(re.escape(c) for c in chars if unicodedata.category(c) in cats
                       or unicodedata.category(c)[0] in cats)

    sub = {"Lu": cls("Lu"), "Lt": cls("Lt"), "Lm": cls("Lm"), "Lo": cls("Lo"), "M": cls("M"), "Ll": cls("Ll"),
           "L": cls("L"), "N": cls("N")}
    pattern = O200K_SPLIT.replace(r"\p{N}{1,3}", f"[{sub['N']}]{{1,3}}")   # the one class outside brackets
    for name in sorted(sub, key=len, reverse=True):
        pattern = pattern.replace(f"\\p{{{name}}}", sub[name])
    return re.findall(pattern, text)


@pytest.mark.parametrize("gguf, ignore_merges", [("gpt-oss-tiny", False), ("gpt-oss-tiny", True),
                                                 ("phi3-tiny", False)])
def test_o200k_tokenizer_converts_as_the_gguf_tokenizes(tmp_path, gguf, ignore_merges):
    """A checkpoint whose tokenizer.json splits by o200k's regex (gpt-oss; Phi-4-mini, a phi3) converts to llama.cpp's
    gpt-4o pre-tokenizer: the vocabulary llama.cpp's converter writes, and the ids of the GGUF made of it (this
    GGUF's weights with that vocabulary) for a text of contractions, numbers, CJK, emoji and whitespace runs; its
    pieces are the ones Hugging Face's regex cuts."""
    from barellm.text.pretokenizer import _PRE_TOKENIZERS, _make_splitter
    from barellm.text.tokenizer import Tokenizer

    from gguf_writer import write_gguf

    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / f"{gguf}.gguf", root)
    (root / "tokenizer.json").write_text(json.dumps(_o200k_tokenizer_json(ignore_merges)))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "add_bos_token": False}))
    with BLMFile(convert(root, tmp_path / "m.blm")) as f:
        ours = dict(f.metadata)
    with GGUFFile(DATA / f"{gguf}.gguf") as g:   # the GGUF llama.cpp's converter makes of this checkpoint
        md = {k: v for k, v in g.metadata.items() if not k.startswith("tokenizer.") and k != "general.alignment"}
        tensors = [(n, np.asarray(g.raw(n)).tobytes(), t.type, t.shape) for n, t in g.tensors.items()]
        n_vocab = g.tensors["token_embd.weight"].shape[0]
    tokens, types = _o200k_vocab(n_vocab)
    md.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
               "tokenizer.ggml.token_type": np.array(types, np.int32),
               "tokenizer.ggml.merges": [f"{a} {b}" for a, b in O200K_MERGES],
               "tokenizer.ggml.bos_token_id": tokens.index("<|startoftext|>"),
               "tokenizer.ggml.eos_token_id": tokens.index("<|return|>"), "tokenizer.ggml.add_bos_token": False})
    write_gguf(tmp_path / "o200k.gguf", md, tensors)
    with GGUFFile(tmp_path / "o200k.gguf") as g:
        theirs = dict(g.metadata)
    assert ours["tokenizer.ggml.pre"] == "gpt-4o"
    for key in ("model", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id", "add_bos_token"):
        assert np.array_equal(ours[f"tokenizer.ggml.{key}"], theirs[f"tokenizer.ggml.{key}"]), key
    a, b = Tokenizer.from_metadata(ours), Tokenizer.from_metadata(theirs)
    ids = a.encode(O200K_TEXT)
    assert ids == b.encode(O200K_TEXT) and a.decode(ids) == O200K_TEXT
    assert tokens.index("<|return|>") in ids   # the special token cut out whole
    for merged in ("'s", "'ll", "123", "Ġthe", "Ġdon", "ĠĠ", "ä½"):   # BPE merged within o200k's pieces
        assert tokens.index(merged) in ids, merged
    plain = O200K_TEXT.replace("<|return|>", "")
    assert _make_splitter(_PRE_TOKENIZERS["gpt-4o"][0])(plain) == _hf_o200k_split(plain)


def test_an_unknown_split_regex_is_refused_by_name(tmp_path):
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / "gpt-oss-tiny.gguf", root)
    near = O200K_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}{1,4}")
    (root / "tokenizer.json").write_text(json.dumps(_o200k_tokenizer_json(False, near)))
    assert_refused(root, r"pre_tokenizer .*is not one this converter recognizes \(supported: .*o200k's",
                   tmp_path / "out")


# --- Gemma's query_pre_attn_scalar ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch, layers_27b", [("gemma2", 46), ("gemma3", 62)])
@pytest.mark.parametrize("size, scalar, stored", [
    ("small", 24, 1 / np.sqrt(24)),   # neither head_dim (32) nor dim / heads (16): stored as attention.scale
    ("small", 32, None),              # head_dim, what the reader derives for this size: nothing stored
    ("27b", 16, None),                # a 27B's dim / heads (Gemma 2 27B: 144 = 4608 / 32), as llama.cpp derives it
    ("27b", 32, 1 / np.sqrt(32)),     # a 27B-sized checkpoint scaled by head_dim after all: stored
])
def test_gemma_query_pre_attn_scalar_converts(tmp_path, arch, layers_27b, size, scalar, stored):
    """A Gemma 2 or Gemma 3 checkpoint's attention is scaled by 1/sqrt(query_pre_attn_scalar) once converted: the
    .blm carries attention.scale where the config reader would derive another scale (llama.cpp's rule for GGUFs),
    and both engines on the converted file give the float64 Hugging Face-convention forward's logits at that
    scale."""
    from test_dense_rows import GEMMA_IDS, assert_gemma_logits, gemma_forward64, write_gemma

    write_gemma(tmp_path / "m.gguf", arch, layers_27b if size == "27b" else 6)
    root = tmp_path / "ckpt"
    hf_from_gguf(tmp_path / "m.gguf", root)
    _edit_config(root, query_pre_attn_scalar=scalar)
    with BLMFile(convert(root, tmp_path / "m.blm")) as f, GGUFFile(tmp_path / "m.gguf") as g:
        got = f.metadata.get(f"{arch}.attention.scale")
        assert (got is None) if stored is None else got == np.float32(stored)
        cfg = config_of(f)
        assert np.float32(cfg.scale) == np.float32(1 / np.sqrt(scalar))   # what the engines scale by
        assert dataclasses.replace(cfg, attn_scale=0.0) == dataclasses.replace(config_of(g), attn_scale=0.0)
        if size == "small":   # (the 27B-sized forwards are test_dense_rows's)
            assert_gemma_logits(f, cfg, scalar)
            assert np.allclose(gemma_forward64(f, GEMMA_IDS, 1.0), gemma_forward64(g, GEMMA_IDS, 1.0), atol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": None, "sliding_window_pattern": 4}, "sliding_window_pattern 4 are not five sliding-window"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types .* are not five sliding-window layers, then a global"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping is 30.0; gemma3 models have no soft-caps"),
    ({"query_pre_attn_scalar": -4}, "query_pre_attn_scalar -4.0 is out of range"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_scaling type 'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling factor 0.5 is out of range"),
    ({"rope_scaling": {"type": "linear", "factor": "8"}}, "rope_scaling factor '8' is out of range"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling factor None is out of range"),
])
def test_broken_gemma3_checkpoints_fail_cleanly(tmp_path, change, message):
    from test_dense_rows import write_gemma

    write_gemma(tmp_path / "m.gguf", "gemma3", 6)
    root = tmp_path / "ckpt"
    hf_from_gguf(tmp_path / "m.gguf", root)
    _edit_config(root, **change)
    assert_refused(root, message, tmp_path / "out")


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_gemma3_linear_rope_scaling_converts(tmp_path, key):
    """Gemma 3 4B/12B/27B's rope_scaling {"rope_type" (or the older "type"): "linear", "factor": 8} converts to
    llama.cpp's keys: the converted file's config is the GGUF's, and both engines on it give the float64 forward's
    logits (global layers' positions / 8) at positions past 100."""
    from test_dense_rows import GEMMA3_LINEAR, LINEAR_IDS, gemma_forward64, write_gemma

    write_gemma(tmp_path / "m.gguf", "gemma3", 6, seed=5, **GEMMA3_LINEAR)
    root = tmp_path / "ckpt"
    hf_from_gguf(tmp_path / "m.gguf", root)
    _edit_config(root, rope_scaling={key: "linear", "factor": 8.0})
    with BLMFile(convert(root, tmp_path / "m.blm")) as f, GGUFFile(tmp_path / "m.gguf") as g:
        assert f.metadata["gemma3.rope.scaling.type"] == "linear" and f.metadata["gemma3.rope.scaling.factor"] == 8.0
        cfg = config_of(f)
        assert cfg == config_of(g) and cfg.rope_linear == 8.0
        want = gemma_forward64(g, LINEAR_IDS, 1 / np.sqrt(cfg.head_dim))
        for e in (reference_engine(cfg, f, 128), NativeEngine(cfg, f, n_ctx=128, threads=2, kv_type="f32")):
            got = e.forward(LINEAR_IDS, 0, all_logits=True)
            assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
            assert np.array_equal(got.argmax(1), want.argmax(1))


@pytest.mark.parametrize("gguf", ["qwen3moe-tiny", "smollm3-tiny"])
def test_linear_rope_scaling_converts_in_every_family_llamacpp_writes_it_for(tmp_path, gguf):
    """A linear rope_scaling converts beyond llama (and Gemma 3): the converted file is the GGUF with llama.cpp's two
    keys, which the config reader turns into every layer's position scale."""
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / f"{gguf}.gguf", root)
    _edit_config(root, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with BLMFile(convert(root, tmp_path / "m.blm")) as f, GGUFFile(DATA / f"{gguf}.gguf") as g:
        p = g.metadata["general.architecture"] + "."
        assert (f.metadata[p + "rope.scaling.type"], f.metadata[p + "rope.scaling.factor"]) == ("linear", 2.0)
        cfg = config_of(f)
        assert cfg == dataclasses.replace(config_of(g), rope_linear=2.0)
        assert {cfg.layer_rope_scale(i) for i in range(cfg.n_layers)} == {0.5}


# --- transformers v5's rope_parameters --------------------------------------------------------------------------


def to_v5(root: Path, per_layer_type: bool = False, sliding: dict | None = None) -> None:
    """Rewrites a checkpoint's config.json as transformers v5 saves it (its configs' convert_rope_params_to_dict and
    standardize_rope_params): rope_theta, rope_scaling and partial_rotary_factor move into one rope_parameters
    object (rope_type from the older "type", "default" without scaling; original_max_position_embeddings added
    for llama3, yarn and longrope); with per_layer_type, one object per layer type, the sliding-window layers' from
    rope_local_base_freq (Gemma 3) or `sliding` (else the global layers')."""
    cfg = json.loads((root / "config.json").read_text())
    scaling = cfg.pop("rope_scaling", None) or {}
    params = {k: v for k, v in scaling.items() if k != "type"}
    params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    params["rope_theta"] = cfg.pop("rope_theta")
    if "partial_rotary_factor" in cfg:
        params["partial_rotary_factor"] = cfg.pop("partial_rotary_factor")
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
    local = cfg.pop("rope_local_base_freq", None)
    if per_layer_type:
        if sliding is None:
            sliding = dict(params) if local is None else {"rope_type": "default", "rope_theta": local}
        params = {"full_attention": params, "sliding_attention": sliding}
    cfg["rope_parameters"] = params
    (root / "config.json").write_text(json.dumps(cfg))


def _converted_md(root: Path, out: Path) -> dict:
    """The converted file's metadata, and the tensors made from config.json (rope_freqs, rope_factors_*) by name."""
    with BLMFile(convert(root, out)) as f:
        md = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in f.metadata.items() if k != "general.name"}
        return md | {n: f.dequantize(n).tolist() for n in f.tensors if n.startswith("rope_")}


@pytest.mark.parametrize("gguf, per_layer_type", [
    ("llama3rope-tiny", False), ("qwen3moe-tiny", False), ("phi3-tiny", False), ("smollm3-tiny", False),
    ("gemma2-tiny", False), ("gemma2-tiny", True), ("gpt-oss-tiny", False), ("gpt-oss-tiny", True), ("gemma3", True),
    ("gemma3", False), ("gemma3-linear", True),
])
def test_v5_rope_parameters_convert_as_v4_config_does(tmp_path, gguf, per_layer_type):
    """A config.json in transformers v5's form (rope_parameters: one object, or one per layer type) converts to the
    metadata and RoPE tensors the v4 form gives (llama.cpp's converter reads both alike): RoPE base, scaling, Llama
    3.1's rope_freqs, LongRoPE's partial rotary factor and factors, YaRN's, Gemma 3's linear factor and its local
    layers' base."""
    from test_dense_rows import GEMMA3_LINEAR, write_gemma

    if gguf.startswith("gemma3"):
        src = tmp_path / "m.gguf"
        write_gemma(src, "gemma3", 6, **(GEMMA3_LINEAR if gguf == "gemma3-linear" else {}))
    else:
        src = DATA / f"{gguf}.gguf"
    hf_from_gguf(src, tmp_path / "v4")
    hf_from_gguf(src, tmp_path / "v5")
    to_v5(tmp_path / "v5", per_layer_type)
    cfg = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert "rope_theta" not in cfg and "rope_scaling" not in cfg and "rope_parameters" in cfg
    v4, v5 = _converted_md(tmp_path / "v4", tmp_path / "v4.blm"), _converted_md(tmp_path / "v5", tmp_path / "v5.blm")
    assert v5 == v4
    assert ("rope_freqs.weight" in v5) == (gguf == "llama3rope-tiny")
    with GGUFFile(src) as g:
        p = g.metadata["general.architecture"] + "."
        assert v5[p + "rope.freq_base"] == np.float32(g.metadata.get(p + "rope.freq_base", 10000.0))
        for key in ("rope.scaling.type", "rope.scaling.factor", "rope.dimension_count"):
            assert v5.get(p + key) == g.metadata.get(p + key, v5.get(p + key))


@pytest.mark.parametrize("v5", [False, True])
def test_gemma3_local_rope_base_converts(tmp_path, v5):
    """Gemma 3's rope_local_base_freq (v5: rope_parameters' sliding_attention rope_theta) becomes
    gemma3.rope.freq_base_swa, as llama.cpp's converter writes it: the converted file is the GGUF with that key, and
    both engines on it give the float64 forward's logits with that local base (which the default base's are far
    from)."""
    from test_dense_rows import GEMMA_HD, GEMMA_IDS, gemma_forward64, write_gemma

    write_gemma(tmp_path / "m.gguf", "gemma3", 6, seed=4, **{"rope.freq_base_swa": 2000.0})
    root = tmp_path / "ckpt"
    hf_from_gguf(tmp_path / "m.gguf", root)
    assert json.loads((root / "config.json").read_text())["rope_local_base_freq"] == 2000.0
    if v5:
        to_v5(root, per_layer_type=True)
    with BLMFile(convert(root, tmp_path / "m.blm")) as f, GGUFFile(tmp_path / "m.gguf") as g:
        assert f.metadata["gemma3.rope.freq_base_swa"] == 2000.0
        cfg = config_of(f)
        assert cfg == config_of(g) and cfg.rope_theta_local == 2000.0
        want = gemma_forward64(g, GEMMA_IDS, 1 / np.sqrt(GEMMA_HD))
        tol = 1e-3 * np.abs(want).max()
        for e in (reference_engine(cfg, f, 64), NativeEngine(cfg, f, n_ctx=64, threads=2, kv_type="f32")):
            got = e.forward(GEMMA_IDS, 0, all_logits=True)
            assert np.abs(got - want).max() < tol and np.array_equal(got.argmax(1), want.argmax(1))
        assert np.abs(gemma_forward64(g, GEMMA_IDS, 1 / np.sqrt(GEMMA_HD), local_base=10000.0) - want).max() > 50 * tol


def test_gemma2_v5_local_rope_base_converts(tmp_path):
    """A per-layer-type rope_parameters whose sliding-window layers have a base of their own gives it to Gemma 2's
    local layers as rope.freq_base_swa (llama.cpp's converter writes it; its gemma2 reads it)."""
    root = tmp_path / "ckpt"
    hf_from_gguf(DATA / "gemma2-tiny.gguf", root)
    to_v5(root, per_layer_type=True, sliding={"rope_type": "default", "rope_theta": 1234.0})
    with BLMFile(convert(root, tmp_path / "m.blm")) as f:
        assert f.metadata["gemma2.rope.freq_base_swa"] == 1234.0
        cfg = config_of(f)
        assert {cfg.layer_rope_theta(i) for i in range(cfg.n_layers) if cfg.is_local(i)} == {1234.0}
        assert {cfg.layer_rope_theta(i) for i in range(cfg.n_layers) if not cfg.is_local(i)} == {cfg.rope_theta}


def _v5_params(**changes):
    def edit(root: Path) -> None:
        cfg = json.loads((root / "config.json").read_text())
        cfg.update(changes)
        (root / "config.json").write_text(json.dumps(cfg))
    return edit


@pytest.mark.parametrize("gguf, per_layer_type, breakage, message", [
    ("gpt-oss-tiny", False, _v5_params(rope_theta=10.0), "rope_theta gives rope_theta 10.0, rope_parameters 150000"),
    ("gpt-oss-tiny", False, _v5_params(rope_scaling={"rope_type": "yarn", "factor": 16.0}),
     "rope_scaling gives factor 16.0, rope_parameters 32.0"),
    ("gpt-oss-tiny", False, _v5_params(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
     "rope_parameters type 'dynamic' is not supported \\(a gpt_oss checkpoint may have: default, yarn\\)"),
    ("gpt-oss-tiny", True, _v5_params(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 32.0},
                                                       "sliding_attention": {"rope_type": "default"}}),
     "sliding_attention .* scales otherwise than full_attention's .*; gpt-oss's sliding-window layers take the global"),
    ("gemma2-tiny", True, _v5_params(rope_parameters={"sliding_attention": {"rope_type": "default"}}),
     "rope_parameters .* is neither one object of RoPE parameters nor one per layer type"),
    ("gemma2-tiny", True, _v5_params(rope_parameters={"full_attention": {}, "sliding_attention": {},
                                                      "rope_theta": 1e4}),
     "rope_parameters .* is neither one object"),
    ("gemma2-tiny", False, _v5_params(rope_parameters=[10000.0]), "rope_parameters \\[10000.0\\] is not an object"),
    ("gemma2-tiny", False, _v5_params(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     "rope_theta '1e4' is not a number"),
    ("gemma3", True, _v5_params(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 8.0}}),
     "the sliding-window layers' rope_type 'linear' is not default; gemma3's local layers are unscaled"),
    ("gemma3", True, _v5_params(rope_local_base_freq=500.0), "rope_local_base_freq gives rope_theta 500.0, "
                                                             "rope_parameters' sliding_attention 10000.0"),
    ("gemma3", True, _v5_params(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 0.5}}),
     "rope_parameters factor 0.5 is out of range"),
    ("smollm3-tiny", True, lambda r: None, "sliding_attention .* differs from full_attention's, but smollm3 models "
                                           "have no sliding-window layers"),
])
def test_broken_v5_rope_parameters_fail_cleanly(tmp_path, gguf, per_layer_type, breakage, message):
    from test_dense_rows import write_gemma

    src = DATA / f"{gguf}.gguf"
    if gguf == "gemma3":
        src = tmp_path / "m.gguf"
        write_gemma(src, "gemma3", 6)
    root = tmp_path / "ckpt"
    hf_from_gguf(src, root)
    to_v5(root, per_layer_type, sliding={"rope_type": "default", "rope_theta": 99.0} if gguf == "smollm3-tiny"
          else None)
    breakage(root)
    assert_refused(root, message, tmp_path / "out")
