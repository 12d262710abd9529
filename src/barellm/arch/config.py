"""Model hyperparameters, read from file metadata (GGUF-style keys) and checked before use.

What differs between architectures is a row of the registry (registry.py); this module reads the
hyperparameters every llama-family file has under its architecture's prefix, and applies the row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from barellm.arch.registry import ARCHITECTURES, Architecture, architecture
from barellm.errors import FormatError

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_vocab: int
    dim: int                 # width of the residual stream
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_dim: int            # leading dims of each head that RoPE rotates
    # "norm": rotate adjacent pairs (x[2i], x[2i+1]), the layout GGUF llama files store Q/K in;
    # "neox": rotate (x[i], x[i + rope_dim/2]), as Hugging Face checkpoints store them.
    rope_style: str
    context_length: int      # what the model was trained for
    tied_output: bool        # output projection shares the token embedding
    # What the architectures beyond llama add (the defaults are llama's; registry.py says which has what):
    attn_bias: bool = False            # the Q, K, V projections add a bias (qwen2)
    rope_freqs: bool = False           # rope_freqs.weight divides the RoPE frequencies (Llama 3.1 scaling)
    embed_scale: float = 1.0           # token embeddings are multiplied by this (gemma: sqrt(dim))
    act: str = "silu"                  # the gated MLP's activation: "silu" or "gelu_tanh"
    qk_norm: bool = False              # RMSNorm over each query and key head before RoPE
    post_norms: bool = False           # RMSNorm on the attention and MLP outputs before the residual add
    attn_scale: float = 0.0            # scores are multiplied by this (0: 1/sqrt(head_dim))
    sliding_window: int = 0            # keys a local layer sees, counting the query's own (0: all)
    swa_pattern: int = 0               # every swa_pattern-th layer is global, the others local (0: all global)
    rope_theta_local: float = 0.0      # RoPE base of local layers (0: rope_theta); rope.freq_base_swa
    rope_linear: float = 1.0           # linear RoPE scaling's factor, dividing positions (where: layer_rope_scale)
    rope_long: bool = False            # LongRoPE: rope_factors_short/_long.weight divide the RoPE frequencies
    rope_original_context: int = 0     # LongRoPE: contexts past this take the long factors
    rope_yarn_factor: float = 0.0      # YaRN: the context extension factor (0: no YaRN)
    rope_cs_scale: float = 1.0         # multiplies RoPE's cos and sin (LongRoPE's attn_factor)
    attn_softcap: float = 0.0          # attention scores s become cap * tanh(s / cap) (0: none)
    final_softcap: float = 0.0         # the logits likewise
    nope_every: int = 0                # every nope_every-th layer has no RoPE (0: all have it)
    n_experts: int = 0                 # mixture of experts: experts per layer (0: a dense MLP)
    n_experts_used: int = 0            # experts each token is routed to
    expert_ffn_dim: int = 0            # rows of each expert's gate and up matrices
    expert_weights_norm: bool = False  # the chosen experts' weights renormalized to sum 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> Architecture:
        """The architecture's row in the registry."""
        return ARCHITECTURES[self.arch]

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends over the sliding window only."""
        return self.swa_pattern > 0 and self.sliding_window > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    def layer_window(self, layer: int) -> int:
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope(self, layer: int) -> bool:
        """Whether a layer rotates its queries and keys."""
        return not (self.nope_every and (layer + 1) % self.nope_every == 0)

    def rope_factors(self, n_ctx: int) -> str | None:
        """The tensor whose values divide the RoPE frequencies for an engine of n_ctx positions, if any: LongRoPE's
        long factors past the original context (as llama.cpp chooses by its context), else its short ones."""
        if self.rope_long:
            return "rope_factors_long.weight" if n_ctx > self.rope_original_context else "rope_factors_short.weight"
        return "rope_freqs.weight" if self.rope_freqs else None

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.is_local(layer) and self.rope_theta_local else self.rope_theta

    def layer_rope_scale(self, layer: int) -> float:
        """What a layer's RoPE multiplies positions by: 1 / the linear scaling factor (ggml's freq_scale), except on
        the local layers of a row whose linear scaling is its global layers' only (Gemma 3)."""
        if self.rope_linear == 1.0 or self.is_local(layer) and not self.spec.rope_linear_local:
            return 1.0
        return 1.0 / self.rope_linear

    def layer_rope_table(self, layer: int) -> tuple[float, float]:
        """The RoPE table a layer reads, as (base, position scale): layers with the same pair share one."""
        return self.layer_rope_theta(layer), self.layer_rope_scale(layer)

    @property
    def scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _get(md: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    if key not in md:
        if default is None:
            raise FormatError(f"metadata key {key!r} is missing")
        return default
    value = md[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise FormatError(f"metadata key {key!r} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _positive(key: str, value: int, limit: int) -> int:
    if not 0 < value <= limit:
        raise FormatError(f"metadata key {key!r} = {value} is out of range (1..{limit})")
    return value


def query_scalar(row: Architecture, n_layers: int, dim: int, n_heads: int, head_dim: int) -> int:
    """What llama.cpp scales a file's attention scores by the inverse square root of, when the file does not say:
    head_dim, or for Gemma's 27B (known by its layer count) dim // heads, Gemma's query_pre_attn_scalar."""
    return dim // n_heads if row.query_scalar_27b_layers and n_layers == row.query_scalar_27b_layers else head_dim


def config_from_metadata(md: dict[str, Any], n_vocab: int, tied_output: bool, rope_freqs: bool = False) -> ModelConfig:
    """The config of a model file, with every hyperparameter range-checked.

    n_vocab comes from the token embedding's shape, which is what the weights actually hold; tied_output and
    rope_freqs say whether the file has an output matrix of its own and a rope_freqs.weight.
    """
    row = architecture(_get(md, "general.architecture", str))
    arch = row.name
    p = arch + "."
    dim = _positive(p + "embedding_length", _get(md, p + "embedding_length", int), 1 << 16)
    n_layers = _positive(p + "block_count", _get(md, p + "block_count", int), 1024)
    n_heads = _positive(p + "attention.head_count", _get(md, p + "attention.head_count", int), 1024)
    n_kv_heads = _positive(p + "attention.head_count_kv",
                           _get(md, p + "attention.head_count_kv", int, n_heads), n_heads)
    if n_heads % n_kv_heads:
        raise FormatError(f"head_count {n_heads} is not a multiple of head_count_kv {n_kv_heads}")
    head_dim = _get(md, p + "attention.key_length", int, dim // n_heads)
    _positive(p + "attention.key_length", head_dim, 1024)
    if head_dim % 2:
        raise FormatError(f"head dimension {head_dim} is odd; RoPE needs pairs")
    value_dim = _get(md, p + "attention.value_length", int, head_dim)
    if value_dim != head_dim:
        raise FormatError(f"attention.value_length {value_dim} differs from key_length {head_dim}; not supported")
    n_experts = n_used = expert_ffn = 0
    if row.moe:
        n_experts = _positive(p + "expert_count", _get(md, p + "expert_count", int), 4096)
        n_used = _positive(p + "expert_used_count", _get(md, p + "expert_used_count", int), n_experts)
        expert_ffn = _positive(p + "expert_feed_forward_length",
                               _get(md, p + "expert_feed_forward_length", int), 1 << 18)
    ffn_dim = _positive(p + "feed_forward_length",
                        _get(md, p + "feed_forward_length", int, expert_ffn or None), 1 << 18)
    rope_dim = _get(md, p + "rope.dimension_count", int, head_dim)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise FormatError(f"rope.dimension_count {rope_dim} does not fit head dimension {head_dim}")
    eps = _get(md, p + "attention.layer_norm_rms_epsilon", float, 1e-5)
    theta = _get(md, p + "rope.freq_base", float, 10000.0)
    if not (0 < eps < 1 and theta > 1 and math.isfinite(theta)):
        raise FormatError(f"norm epsilon {eps} or rope base {theta} out of range")
    # the sliding-window layers' RoPE base, as llama.cpp reads it for these architectures: rope.freq_base_swa,
    # else the row's (Gemma 3: 10000) or the global one (Gemma 2, gpt-oss)
    theta_local = row.rope_theta_local
    if row.swa_pattern and p + "rope.freq_base_swa" in md:
        theta_local = _get(md, p + "rope.freq_base_swa", float)
        if not (theta_local > 1 and math.isfinite(theta_local)):
            raise FormatError(f"rope.freq_base_swa {theta_local} is out of range (a finite RoPE base above 1)")
    ctx = _positive(p + "context_length", _get(md, p + "context_length", int, 2048), 1 << 24)
    # llama.cpp's reading: the type defaults to linear, its factor is rope.scaling.factor or the older
    # rope.scale_linear (none: 1); type none ignores the factor
    scaling = _get(md, p + "rope.scaling.type", str, "linear")
    yarn = linear = 0.0
    if scaling == "yarn" and row.yarn:
        yarn = _get(md, p + "rope.scaling.factor", float)
        if not 1 <= yarn <= 1024:
            raise FormatError(f"rope.scaling.factor {yarn} is out of range (1..1024)")
    elif scaling == "linear":
        key = p + ("rope.scaling.factor" if p + "rope.scaling.factor" in md else "rope.scale_linear")
        linear = _get(md, key, float, 1.0)
        if not 1 <= linear <= 1024:
            raise FormatError(f"linear RoPE scaling: {key} {linear} is out of range (1..1024)")
    elif scaling != "none":
        raise FormatError(f"rope scaling {scaling!r} is not supported")
    if rope_freqs and not row.rope_freqs:
        raise FormatError(f"rope_freqs.weight is not part of a {arch} model")
    original = _get(md, p + "rope.scaling.original_context_length", int, ctx) if row.long_rope or yarn else 0
    cs_scale = _get(md, p + "rope.scaling.attn_factor", float, 1.0) if row.long_rope else 1.0
    if yarn:  # YaRN's magnitude correction, as llama.cpp applies it to cos and sin
        cs_scale = 1.0 + 0.1 * math.log(yarn)
    if not 0 < cs_scale < 16:
        raise FormatError(f"rope.scaling.attn_factor {cs_scale} is out of range")
    caps = [_get(md, p + key, float, 0.0) if row.softcaps else 0.0
            for key in ("attn_logit_softcapping", "final_logit_softcapping")]
    if any(not 0 <= c < 1e6 for c in caps):
        raise FormatError(f"soft-caps {caps} out of range")
    attn_scale = 0.0   # 1/sqrt(head_dim)
    if row.query_scalar_27b_layers:
        if p + "attention.scale" in md:
            attn_scale = _get(md, p + "attention.scale", float)
            if not 0 < attn_scale <= 16:
                raise FormatError(f"attention.scale {attn_scale} is out of range (0..16]")
        elif (scalar := query_scalar(row, n_layers, dim, n_heads, head_dim)) != head_dim:
            if scalar < 1:
                raise FormatError(f"embedding_length {dim} is less than head_count {n_heads}")
            attn_scale = 1.0 / math.sqrt(scalar)
    window = 0
    if row.swa_pattern:
        window = _get(md, p + "attention.sliding_window", int, 0)
        if not 0 <= window <= ctx:
            raise FormatError(f"attention.sliding_window {window} is out of range (0..{ctx})")
    return ModelConfig(
        arch=arch, n_vocab=_positive("vocabulary size", n_vocab, 1 << 22), dim=dim, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim, norm_eps=eps,
        rope_theta=theta, rope_dim=rope_dim, rope_style=row.rope_style, context_length=ctx,
        tied_output=tied_output, attn_bias=row.attn_bias, rope_freqs=rope_freqs,
        embed_scale=math.sqrt(dim) if row.embed_scale_sqrt_dim else 1.0, act=row.act, qk_norm=row.qk_norm,
        post_norms=row.post_norms, attn_scale=attn_scale, sliding_window=window, swa_pattern=row.swa_pattern,
        rope_theta_local=theta_local, rope_linear=linear or 1.0, rope_long=row.long_rope,
        rope_original_context=original,
        rope_cs_scale=cs_scale, rope_yarn_factor=yarn, nope_every=row.nope_every, attn_softcap=caps[0],
        final_softcap=caps[1],
        n_experts=n_experts, n_experts_used=n_used,
        expert_ffn_dim=expert_ffn,
        expert_weights_norm=row.expert_weights_norm,
    )


def config_of(source: Any) -> ModelConfig:
    """The config of an opened model file (anything with .metadata and .tensors)."""
    tensors: Mapping[str, Any] = source.tensors
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise FormatError("tensor 'token_embd.weight' is missing")
    return config_from_metadata(source.metadata, int(embd.shape[0]), tied_output="output.weight" not in tensors,
                                rope_freqs="rope_freqs.weight" in tensors)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with the shape it must have (NumPy order)."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, cfg.dim),
        "output_norm.weight": (cfg.dim,),
    }
    if not cfg.tied_output:
        shapes["output.weight"] = (cfg.n_vocab, cfg.dim)
    if cfg.rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rope_dim // 2,)
    if cfg.rope_long:
        shapes["rope_factors_short.weight"] = shapes["rope_factors_long.weight"] = (cfg.rope_dim // 2,)
    per_layer = {
        "attn_norm.weight": (cfg.dim,), "ffn_norm.weight": (cfg.dim,),
        "attn_q.weight": (cfg.q_dim, cfg.dim), "attn_k.weight": (cfg.kv_dim, cfg.dim),
        "attn_v.weight": (cfg.kv_dim, cfg.dim), "attn_output.weight": (cfg.dim, cfg.q_dim),
        "attn_q.bias": (cfg.q_dim,), "attn_k.bias": (cfg.kv_dim,), "attn_v.bias": (cfg.kv_dim,),
        "attn_q_norm.weight": (cfg.head_dim,), "attn_k_norm.weight": (cfg.head_dim,),
        "post_attention_norm.weight": (cfg.dim,), "post_ffw_norm.weight": (cfg.dim,),
        "ffn_gate.weight": (cfg.ffn_dim, cfg.dim), "ffn_up.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_down.weight": (cfg.dim, cfg.ffn_dim),
        "attn_qkv.weight": (cfg.q_dim + 2 * cfg.kv_dim, cfg.dim),
        "attn_output.bias": (cfg.dim,), "attn_sinks.weight": (cfg.n_heads,),
        "ffn_gate_inp.bias": (cfg.n_experts,), "ffn_gate_exps.bias": (cfg.n_experts, cfg.expert_ffn_dim),
        "ffn_up_exps.bias": (cfg.n_experts, cfg.expert_ffn_dim), "ffn_down_exps.bias": (cfg.n_experts, cfg.dim),
        "ffn_gate_inp.weight": (cfg.n_experts, cfg.dim),
        "ffn_gate_exps.weight": (cfg.n_experts, cfg.expert_ffn_dim, cfg.dim),
        "ffn_up_exps.weight": (cfg.n_experts, cfg.expert_ffn_dim, cfg.dim),
        "ffn_down_exps.weight": (cfg.n_experts, cfg.dim, cfg.expert_ffn_dim),
    }
    if cfg.spec.fused_gate_up:
        per_layer["ffn_up.weight"] = (2 * cfg.ffn_dim, cfg.dim)
    for i in range(cfg.n_layers):
        for name in cfg.spec.layer_tensors:
            shapes[f"blk.{i}.{name}"] = per_layer[name]
    return shapes


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
    """Refuses a file whose tensors do not match its own hyperparameters."""
    for name, shape in expected_shapes(cfg).items():
        info = tensors.get(name)
        if info is None:
            raise FormatError(f"tensor {name!r} is missing")
        if tuple(info.shape) != shape:
            raise FormatError(f"tensor {name!r} has shape {tuple(info.shape)}, expected {shape}")
