"""Model hyperparameters, read from file metadata (GGUF-style keys) and checked before use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from barellm.errors import FormatError

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")


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
    # What the architectures beyond llama add (the defaults are llama's):
    embed_scale: float = 1.0           # token embeddings are multiplied by this (gemma: sqrt(dim))
    act: str = "silu"                  # the gated MLP's activation: "silu" or "gelu_tanh"
    qk_norm: bool = False              # RMSNorm over each query and key head before RoPE
    post_norms: bool = False           # RMSNorm on the attention and MLP outputs before the residual add
    attn_scale: float = 0.0            # scores are multiplied by this (0: 1/sqrt(head_dim))
    sliding_window: int = 0            # keys a local layer sees, counting the query's own (0: all)
    swa_pattern: int = 0               # every swa_pattern-th layer is global, the others local (0: all global)
    rope_theta_local: float = 0.0      # RoPE base of local layers (0: rope_theta)
    extra: dict[str, Any] = field(default_factory=dict)

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends over the sliding window only."""
        return self.swa_pattern > 0 and self.sliding_window > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    def layer_window(self, layer: int) -> int:
        return self.sliding_window if self.is_local(layer) else 0

    def layer_rope_theta(self, layer: int) -> float:
        return self.rope_theta_local if self.is_local(layer) and self.rope_theta_local else self.rope_theta

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


def config_from_metadata(md: dict[str, Any], n_vocab: int, tied_output: bool) -> ModelConfig:
    """The config of a model file, with every hyperparameter range-checked.

    n_vocab comes from the token embedding's shape, which is what the weights actually hold.
    """
    arch = _get(md, "general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FormatError(f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
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
    ffn_dim = _positive(p + "feed_forward_length", _get(md, p + "feed_forward_length", int), 1 << 18)
    rope_dim = _get(md, p + "rope.dimension_count", int, head_dim)
    if not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise FormatError(f"rope.dimension_count {rope_dim} does not fit head dimension {head_dim}")
    eps = _get(md, p + "attention.layer_norm_rms_epsilon", float, 1e-5)
    theta = _get(md, p + "rope.freq_base", float, 10000.0)
    if not (0 < eps < 1 and theta > 1):
        raise FormatError(f"norm epsilon {eps} or rope base {theta} out of range")
    ctx = _positive(p + "context_length", _get(md, p + "context_length", int, 2048), 1 << 24)
    common = dict(
        arch=arch, n_vocab=_positive("vocabulary size", n_vocab, 1 << 22), dim=dim, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim, norm_eps=eps,
        rope_theta=theta, rope_dim=rope_dim, context_length=ctx, tied_output=tied_output,
    )
    if arch == "gemma3":
        window = _get(md, p + "attention.sliding_window", int, 0)
        if not 0 <= window <= ctx:
            raise FormatError(f"attention.sliding_window {window} is out of range (0..{ctx})")
        # As Gemma 3 defines them (and llama.cpp reads them): GGUF stores Q/K unpermuted, so RoPE
        # rotates (i, i + d/2) pairs; five local layers with base 10000 for each global one.
        return ModelConfig(**common, rope_style="neox", embed_scale=math.sqrt(dim), act="gelu_tanh",
                           qk_norm=True, post_norms=True, sliding_window=window, swa_pattern=6,
                           rope_theta_local=10000.0)
    return ModelConfig(**common, rope_style="norm")
