"""The Hugging Face checkpoint families `barellm convert` reads, one row each: which config.json model_type a
row takes, the architecture it becomes, the metadata its config gives beyond every family's, and for each
tensor of the architecture (GGUF's name) the recipe that makes it from the checkpoint's tensors.

llama.cpp's convert_hf_to_gguf.py is the reference for every row, so that a converted checkpoint holds what
llama.cpp's GGUF of it would: llama's (and SmolLM3's) query and key rows permuted for the "norm" RoPE
(`permute_qk`), Qwen3-MoE's per-expert matrices stacked into 3-D tensors, Phi-3's LongRoPE factors made
tensors, Gemma's norm weights stored plus one, gpt-oss's fused gate|up matrices split into their interleaved
halves and its MXFP4 experts repacked into ggml's MXFP4 blocks (the recipes themselves: store/hf_recipes.py).
store/checkpoint.py reads a checkpoint through these rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from barellm.arch.config import query_scalar
from barellm.arch.registry import ARCHITECTURES
from barellm.errors import FormatError
from barellm.store.hf_recipes import Checkpoint, Experts, FromConfig, Fused, Mxfp4, OneOf, Recipe, Same

MAX_LAYERS = 1024   # arch/config.py's bound on block_count
LAYER_TYPES = ("full_attention", "sliding_attention")   # config.json's layer_types, and rope_parameters' keys


# --- the families' config.json ---------------------------------------------------------------------------


def _rope_type(params: dict[str, Any]) -> dict[str, Any]:
    """A copy of RoPE parameters with rope_type set, from the older "type" key if need be ("default" if neither)."""
    out = {k: v for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return out


class Config:
    """config.json, read with errors that name the key."""

    def __init__(self, cfg: Mapping[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def error(self, what: str) -> FormatError:
        return FormatError(f"{self.where}: {what}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def num(self, key: str, default: Any = None, kind: type = int) -> Any:
        v = self.cfg.get(key, default)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            raise self.error(f"{key} is {v!r}, expected {'a number' if kind is float else 'an integer'}")
        return float(v) if kind is float else v

    def layers(self) -> int:
        """num_hidden_layers, range-checked (as the config reader does) before anything loops over them."""
        n = self.num("num_hidden_layers")
        if not 0 < n <= MAX_LAYERS:
            raise self.error(f"num_hidden_layers {n} is out of range (1..{MAX_LAYERS})")
        return n

    @property
    def rope_key(self) -> str:
        """Where config.json keeps its RoPE parameters: "rope_parameters" (transformers v5) or "rope_scaling"."""
        return "rope_parameters" if self.cfg.get("rope_parameters") else "rope_scaling"

    def rope(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The RoPE parameters of the global (full-attention) layers and, where config.json gives them apart, of
        the sliding-window layers (None: not given), in transformers v5's shape whichever form the file has: v5's
        rope_parameters (one object for every layer, or one per layer type: {"full_attention": {...},
        "sliding_attention": {...}}), or v4's rope_theta and rope_scaling at the top level (Gemma 3's local layers:
        rope_local_base_freq, unscaled). rope_type is always set ("default": unscaled; the older "type" key is read
        too), rope_theta where the file gives it; a value given in both places must agree."""
        params, scaling = self.cfg.get("rope_parameters"), self.cfg.get("rope_scaling")
        for key, v in (("rope_parameters", params), ("rope_scaling", scaling)):
            if v is not None and not isinstance(v, dict):
                raise self.error(f"{key} {v!r:.80} is not an object")
        sliding: dict[str, Any] | None = None
        if params and any(k in LAYER_TYPES for k in params):   # one object per layer type
            if set(params) - set(LAYER_TYPES) or "full_attention" not in params \
                    or not all(isinstance(v, dict) for v in params.values()):
                raise self.error(f"rope_parameters {params!r:.120} is neither one object of RoPE parameters nor one "
                                 f"per layer type ({', '.join(LAYER_TYPES)}, full_attention's required)")
            full = _rope_type(params["full_attention"])
            sliding = _rope_type(params["sliding_attention"]) if "sliding_attention" in params else None
        else:
            full = _rope_type(params or scaling or {})
        if params and scaling:
            self._agree("rope_scaling", _rope_type(scaling), "rope_parameters", full)
        theta, local = self.cfg.get("rope_theta"), self.cfg.get("rope_local_base_freq")
        if theta is not None:
            self._agree("rope_theta", {"rope_theta": theta}, self.rope_key, full)
        if local is not None:
            if sliding is None:
                sliding = {"rope_type": "default"}
            self._agree("rope_local_base_freq", {"rope_theta": local}, "rope_parameters' sliding_attention", sliding)
        return full, sliding

    def _agree(self, key: str, given: dict[str, Any], other: str, params: dict[str, Any]) -> None:
        """Sets params' missing entries from `given`; refuses one that params has with another value."""
        for k, v in given.items():
            if params.setdefault(k, v) != v:
                raise self.error(f"{key} gives {k} {v!r:.40}, {other} {params[k]!r:.40}")

    def rope_scaling(self) -> dict[str, Any]:
        """The global layers' RoPE parameters (rope())."""
        return self.rope()[0]

    def rope_base(self, params: dict[str, Any] | None, default: float | None) -> float | None:
        """The RoPE base (rope_theta) of one of rope()'s parameter sets; `default` where it has none."""
        v = (params or {}).get("rope_theta", default)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise self.error(f"rope_theta {v!r:.40} is not a number")
        return None if v is None else float(v)

    def alternating_layers(self, n_layers: int) -> None:
        """Refuses layer_types other than a sliding-window layer, then a global one, in turn (as llama.cpp's
        graphs of Gemma 2 and gpt-oss have them, whatever the file says)."""
        got = self.cfg.get("layer_types")
        want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
        if got is not None and got != want:
            raise self.error(f"layer_types {got!r:.120} are not sliding and full attention in turn, from layer 0")


def _no_extra(c: Config) -> dict[str, Any]:
    return {}


def _qwen3moe(c: Config) -> dict[str, Any]:
    if c.get("norm_topk_prob", True) is not True:
        raise c.error("norm_topk_prob is false; the engines renormalize the chosen experts' weights, as "
                      "llama.cpp's qwen3moe does")
    if c.get("mlp_only_layers") or c.num("decoder_sparse_step", 1) != 1:
        raise c.error("mlp_only_layers / decoder_sparse_step make some layers dense; every qwen3moe layer is "
                      "a mixture of experts here")
    return {"expert_count": c.num("num_experts"), "expert_used_count": c.num("num_experts_per_tok"),
            "expert_feed_forward_length": c.num("moe_intermediate_size")}


def _phi3_rope_dims(c: Config) -> int:
    rot = c.rope_scaling().get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if isinstance(rot, bool) or not isinstance(rot, (int, float)) or not 0 < rot <= 1:
        raise c.error(f"partial_rotary_factor {rot!r} is not in (0, 1]")
    return int(rot * c.num("hidden_size")) // c.num("num_attention_heads")


def _phi3(c: Config) -> dict[str, Any]:
    """llama.cpp's Phi3MiniModel: RoPE on the leading partial_rotary_factor of each head; LongRoPE's factors as
    tensors (`_phi3_factors`), its attention factor from the context extension."""
    s = c.rope_scaling()
    ctx = c.num("max_position_embeddings")
    original = c.num("original_max_position_embeddings", s.get("original_max_position_embeddings", ctx))
    if not 1 < original <= ctx:
        raise c.error(f"original_max_position_embeddings {original} is not in 2..max_position_embeddings ({ctx})")
    scale = ctx / original
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if s.get("long_factor") and scale > 1 else 1.0
    return {"rope.dimension_count": _phi3_rope_dims(c), "rope.scaling.original_context_length": original,
            "rope.scaling.attn_factor": float(attn_factor),
            "attention.sliding_window": c.num("sliding_window", 0) if c.get("sliding_window") is not None else 0}


def _phi3_factors(which: str) -> Callable[[Checkpoint], np.ndarray]:
    def values(ck: Checkpoint) -> np.ndarray:
        c = Config(ck.config, ck.where)
        n = _phi3_rope_dims(c) // 2
        s = c.rope_scaling()
        if not s.get("long_factor"):  # no LongRoPE: factors of 1 divide nothing
            return np.ones(n, np.float32)
        f = s.get(which)
        if (not isinstance(f, list) or len(f) != n
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f)):
            raise c.error(f"rope_scaling.{which} should be {n} positive numbers (half the rotated dims), "
                          f"got {f!r:.80}")
        return np.array(f, np.float32)

    return values


def _smollm3(c: Config) -> dict[str, Any]:
    n = c.layers()
    interval = c.num("no_rope_layer_interval", 4)
    got = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if list(got) != [int((i + 1) % 4 != 0) for i in range(n)]:
        raise c.error(f"no_rope_layers {got!r:.120} (1: RoPE, 0: none) is not every fourth layer without RoPE, "
                      "the only pattern smollm3 files have (llama.cpp fixes it)")
    return {}


def _attention_scale(c: Config, arch: str, head_dim: int) -> dict[str, Any]:
    """Gemma's attention.scale, 1/sqrt(query_pre_attn_scalar), where it is not what the config reader derives for a
    file without it (llama.cpp's rule: head_dim, or dim / heads for the 27B)."""
    scalar = c.num("query_pre_attn_scalar", head_dim, float)
    if not 0 < scalar < 1 << 20:
        raise c.error(f"query_pre_attn_scalar {scalar} is out of range")
    derived = query_scalar(ARCHITECTURES[arch], c.layers(), c.num("hidden_size"), c.num("num_attention_heads"),
                           head_dim)
    return {} if scalar == derived else {"attention.scale": 1.0 / math.sqrt(scalar)}


def _gemma2(c: Config) -> dict[str, Any]:
    hd = c.num("head_dim")
    c.alternating_layers(c.layers())
    caps = {k: c.num(k, 0.0, float) if c.get(k) is not None else 0.0
            for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {"attention.key_length": hd, "attention.value_length": hd, "attention.sliding_window":
            c.num("sliding_window"), **caps, **_attention_scale(c, "gemma2", hd)}


def linear_scaling(c: Config) -> dict[str, Any]:
    """A linear rope_scaling ({"rope_type" or "type": "linear", "factor": F}) as llama.cpp's converter writes it for
    every family (its TextModel's): rope.scaling.type linear and its factor. The engines divide the positions by it
    (Gemma 3: its global layers' only, as llama.cpp and Hugging Face's rotary_emb do)."""
    s = c.rope_scaling()
    if s["rope_type"] != "linear":
        return {}
    factor = s.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor <= 1024:
        raise c.error(f"{c.rope_key} factor {factor!r:.40} is out of range (linear scaling takes 1..1024)")
    return {"rope.scaling.type": "linear", "rope.scaling.factor": float(factor)}


def _llama3_parameters(c: Config) -> tuple[float, float, float, int]:
    """Llama 3.1's RoPE scaling (rope_type "llama3"): factor, low_freq_factor, high_freq_factor and
    original_max_position_embeddings, each required (as transformers requires them) and range-checked."""
    s = c.rope_scaling()
    got: list[Any] = []
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in s:
            raise c.error(f"{c.rope_key} has no {key}; llama3 RoPE scaling needs it")
        v = s[key]
        integer = key == "original_max_position_embeddings"
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) \
                or (isinstance(v, float) and not math.isfinite(v)) or v <= 0:
            raise c.error(f"{c.rope_key} {key} is {v!r:.40}; llama3 RoPE scaling needs a positive "
                          f"{'integer' if integer else 'number'} there")
        got.append(v)
    factor, low, high, original = got
    if not 1 <= factor <= 1024:
        raise c.error(f"{c.rope_key} factor {factor!r:.40} is out of range (llama3 scaling takes 1..1024)")
    if not low < high:
        raise c.error(f"{c.rope_key} low_freq_factor {low!r:.40} is not below high_freq_factor {high!r:.40}")
    if original > 1 << 24:
        raise c.error(f"{c.rope_key} original_max_position_embeddings {original} is out of range (1..{1 << 24})")
    return float(factor), float(low), float(high), original


def llama3_rope_factors(dims: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """rope_freqs.weight of Llama 3.1's scaling, as llama.cpp's converter makes it (LlamaModel's extra tensor): per
    pair of rotated dims, what divides its frequency base^(-2i/dims). Wavelengths 2 pi / frequency shorter than
    original / high keep it (1), those longer than original / low are slowed by the factor, and those between
    blend the two: 1 / ((1 - s) / factor + s), s = (original / wavelength - low) / (high - low). Computed in
    float64, then rounded to float32."""
    inv_freq = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    between = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, between)) \
        .astype(np.float32)


def _is_llama3(config: Mapping[str, Any]) -> bool:
    return Config(config, "config.json").rope_scaling()["rope_type"] == "llama3"


def _llama3_freqs(ck: Checkpoint) -> np.ndarray:
    return llama3_rope_factors(ck.meta("rope.dimension_count"), ck.meta("rope.freq_base"),
                               *_llama3_parameters(Config(ck.config, ck.where)))


def _llama(c: Config) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling becomes the rope_freqs.weight tensor (no metadata key, as llama.cpp's converter
    writes none); its parameters are checked here, before any tensor is read."""
    if c.rope_scaling()["rope_type"] == "llama3":
        _llama3_parameters(c)
    return {}


def _gemma3(c: Config) -> dict[str, Any]:
    """Gemma 3's text model as llama.cpp's gemma3 has it: five sliding-window layers for each global one, no
    soft-caps, the global RoPE base 1e6 unless the config says; the 4B/12B/27B's linear scaling (factor 8), which
    llama.cpp (as Hugging Face's rotary_emb) applies to the global layers only (linear_scaling writes it); the
    local layers' base (rope_local_base_freq) as every family's (checkpoint.py)."""
    hd, n = c.num("head_dim"), c.layers()
    want = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    got = c.get("layer_types")
    if (got is not None and got != want) or (got is None and c.num("sliding_window_pattern", 6) != 6):
        raise c.error(f"layer_types {got!r:.120} / sliding_window_pattern {c.get('sliding_window_pattern')} are not "
                      "five sliding-window layers, then a global one, in turn (as llama.cpp's gemma3 has them)")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(k) is not None:
            raise c.error(f"{k} is {c.get(k)}; gemma3 models have no soft-caps")
    return {"attention.key_length": hd, "attention.value_length": hd, "attention.sliding_window":
            c.num("sliding_window"), "rope.freq_base": c.rope_base(c.rope()[0], 1_000_000.0),
            **_attention_scale(c, "gemma3", hd)}


def _gpt_oss(c: Config) -> dict[str, Any]:
    if c.num("swiglu_limit", 7.0, float) != 7.0:
        raise c.error(f"swiglu_limit {c.get('swiglu_limit')} is not gpt-oss's 7")
    c.alternating_layers(c.layers())
    used = c.get("num_experts_per_tok", c.get("experts_per_token"))
    md: dict[str, Any] = {
        "expert_count": c.num("num_local_experts"),
        "expert_used_count": used if isinstance(used, int) and not isinstance(used, bool) else
        c.num("num_experts_per_tok"),
        "expert_feed_forward_length": c.num("intermediate_size"),
        "attention.sliding_window": c.num("sliding_window"),
    }
    s = c.rope_scaling()
    if s["rope_type"] == "yarn":  # with the ramp llama.cpp applies (beta fast 32, beta slow 1)
        if s.get("beta_fast", 32) != 32 or s.get("beta_slow", 1) != 1:
            raise c.error(f"{c.rope_key} beta_fast {s.get('beta_fast')} / beta_slow {s.get('beta_slow')}: only "
                          "YaRN's 32 / 1 are supported")
        factor = s.get("factor")
        original = s.get("original_max_position_embeddings", 4096)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or \
                isinstance(original, bool) or not isinstance(original, int):
            raise c.error(f"{c.rope_key} {s!r:.120} needs a numeric factor and an integer "
                          "original_max_position_embeddings")
        md.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(factor),
                   "rope.scaling.original_context_length": original})
    return md


# --- the table -------------------------------------------------------------------------------------------


# Hugging Face tensor names inside a layer -> GGUF names: llama's, and the groups other families add
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_BIAS_NAMES = {
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}
HF_QK_NORM_NAMES = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}


def _layer(*names: Mapping[str, str], **recipes: Recipe) -> Mapping[str, Recipe]:
    """A block's recipes: plain renames (Hugging Face name -> GGUF name; a later group's name for a tensor wins),
    and recipes by GGUF name (a dot in a GGUF name written as "__": ffn_gate_exps__weight)."""
    renames = {hf: gguf for group in names for hf, gguf in group.items()}   # a later group's name wins
    out: dict[str, Recipe] = {gguf: Same(hf) for hf, gguf in renames.items()}
    out.update({k.replace("__", "."): v for k, v in recipes.items()})
    return MappingProxyType(out)


_ATTN = {k: v for k, v in HF_LAYER_NAMES.items() if not k.startswith("mlp.")}
_MLP = {k: v for k, v in HF_LAYER_NAMES.items() if k.startswith("mlp.")}


@dataclass(frozen=True)
class Family:
    """One row: a Hugging Face family and how it converts (the defaults are llama's)."""

    arch: str                                  # the architecture (arch/registry.py) it becomes
    model_types: tuple[str, ...]               # config.json's model_type
    classes: tuple[str, ...]                   # config.json's architectures, when model_type is not one above
    layer: Mapping[str, Recipe]                # GGUF name within a block -> its recipe over "model.layers.N."
    hparams: Callable[[Config], dict[str, Any]] = _no_extra   # metadata beyond every family's (no prefix)
    extra: Mapping[str, Recipe] = field(default_factory=dict)  # tensors outside the blocks beyond every family's
    acts: tuple[str, ...] = ("silu",)          # hidden_act (hidden_activation) values meaning the arch's MLP
    # rope_scaling types taken: linear_scaling writes linear's keys (llama.cpp's converter does for every family
    # but Gemma 2, Phi-3 and gpt-oss), hparams and extra read the others
    rope_scalings: tuple[str, ...] = ("default", "linear")
    quant_methods: tuple[str, ...] = ()        # quantization_config.quant_method values taken
    norm_shift: float = 0.0                    # added to every norm weight (Gemma's RMSNorm scales by 1 + w)
    ignored: tuple[str, ...] = ()              # tensors outside the blocks that llama.cpp leaves out


FAMILIES: tuple[Family, ...] = (
    # Llama 3.1's RoPE scaling ("llama3") becomes rope_freqs.weight, as llama.cpp's converter writes it
    Family("llama", ("llama",), ("LlamaForCausalLM",), _layer(HF_LAYER_NAMES), _llama,
           extra=MappingProxyType({"rope_freqs.weight": FromConfig(_llama3_freqs, when=_is_llama3)}),
           rope_scalings=("default", "linear", "llama3")),
    Family("qwen2", ("qwen2",), ("Qwen2ForCausalLM",), _layer(HF_LAYER_NAMES, HF_BIAS_NAMES)),
    Family("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), _layer(HF_LAYER_NAMES, HF_QK_NORM_NAMES)),
    # Qwen3-MoE: qwen3's attention; mlp.gate routes over mlp.experts.N, stacked as llama.cpp's converter does
    Family("qwen3moe", ("qwen3_moe",), ("Qwen3MoeForCausalLM",), _layer(
        _ATTN, HF_QK_NORM_NAMES, ffn_gate_inp__weight=Same("mlp.gate.weight"),
        ffn_gate_exps__weight=Experts("mlp.experts.{}.gate_proj.weight"),
        ffn_up_exps__weight=Experts("mlp.experts.{}.up_proj.weight"),
        ffn_down_exps__weight=Experts("mlp.experts.{}.down_proj.weight")), _qwen3moe),
    # Phi-3 and Phi-4-mini: fused Q|K|V and gate|up kept fused; LongRoPE's factors become tensors
    Family("phi3", ("phi3",), ("Phi3ForCausalLM",), _layer(
        {"input_layernorm.weight": "attn_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
         "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}), _phi3,
        extra=MappingProxyType({"rope_factors_long.weight": FromConfig(_phi3_factors("long_factor")),
                                "rope_factors_short.weight": FromConfig(_phi3_factors("short_factor"))}),
        rope_scalings=("default", "longrope", "su")),
    # SmolLM3: llama's tensors (permuted alike), every fourth layer without RoPE
    Family("smollm3", ("smollm3",), ("SmolLM3ForCausalLM",), _layer(HF_LAYER_NAMES), _smollm3),
    # Gemma 2: norms before and after attention and MLP, each stored less one; no lm_head of its own
    Family("gemma2", ("gemma2",), ("Gemma2ForCausalLM",), _layer(
        _ATTN, _MLP, {"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}), _gemma2,
        acts=("gelu_pytorch_tanh",), norm_shift=1.0, ignored=("lm_head.weight",), rope_scalings=("default",)),
    # Gemma 3's text model: Gemma 2's norms with per-head q/k norms (all stored less one), no soft-caps, linear
    # RoPE scaling (the 4B, 12B and 27B)
    Family("gemma3", ("gemma3_text",), ("Gemma3ForCausalLM",), _layer(
        _ATTN, _MLP, HF_QK_NORM_NAMES, {"post_attention_layernorm.weight": "post_attention_norm.weight",
                                        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                                        "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}), _gemma3,
        acts=("gelu_pytorch_tanh",), norm_shift=1.0, ignored=("lm_head.weight",)),
    # gpt-oss: biased attention with sinks; the router and the experts' fused gate|up (interleaved outputs) and
    # down, in MXFP4 blocks or transposed floats, with biases
    Family("gpt-oss", ("gpt_oss",), ("GptOssForCausalLM",), _layer(
        _ATTN, HF_BIAS_NAMES, {"post_attention_layernorm.weight": "post_attention_norm.weight",
                               "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
                               "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                               "mlp.experts.down_proj_bias": "ffn_down_exps.bias"},
        ffn_gate_exps__weight=OneOf((Mxfp4("mlp.experts.gate_up_proj", 0),
                                     Fused("mlp.experts.gate_up_proj", 0, transpose=True))),
        ffn_up_exps__weight=OneOf((Mxfp4("mlp.experts.gate_up_proj", 1),
                                   Fused("mlp.experts.gate_up_proj", 1, transpose=True))),
        ffn_down_exps__weight=OneOf((Mxfp4("mlp.experts.down_proj"), Fused("mlp.experts.down_proj", transpose=True))),
        ffn_gate_exps__bias=Fused("mlp.experts.gate_up_proj_bias", 0),
        ffn_up_exps__bias=Fused("mlp.experts.gate_up_proj_bias", 1)), _gpt_oss,
        rope_scalings=("default", "yarn"), quant_methods=("mxfp4",)),
)


def family_of(model_type: object, classes: list[str]) -> Family | None:
    """The row a config.json's model_type (or, failing that, its architectures) converts as, if any."""
    for row in FAMILIES:
        if model_type in row.model_types:
            return row
    for row in FAMILIES:
        if any(c in row.classes for c in classes):
            return row
    return None


def supported() -> str:
    """The families' model_types, for messages."""
    return ", ".join(t for row in FAMILIES for t in row.model_types)
