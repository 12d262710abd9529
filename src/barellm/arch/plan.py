"""The forward pass as a plan: a flat list of typed ops over named buffers.

The plan says *what* runs, in order, in architecture terms; engine.py binds it to buffers and weights
and compiles it for the native executor. One small dataclass per op kind, so a misspelt field is an error
where the plan is written, not a zero in C. Op names are stable (the debug tools address ops by them):

    token_embd
    blk.{i}.attn_norm  blk.{i}.qkv  blk.{i}.rope  blk.{i}.attn  blk.{i}.attn_out  [blk.{i}.post_attn_norm]
    blk.{i}.ffn_norm   blk.{i}.ffn_gate_up  blk.{i}.ffn_act  blk.{i}.ffn_down  [blk.{i}.post_ffn_norm]
    output_norm  output  [output_softcap]
(the bracketed ones in models with post norms, Gemma 3). A mixture-of-experts layer's MLP is instead
    blk.{i}.ffn_norm   blk.{i}.ffn_router  blk.{i}.ffn_moe  [blk.{i}.post_ffn_norm]

Buffers (rows = tokens of the current chunk, or the selected rows for the output ops):
    x [T, dim] residual stream      xn [T, dim] normed          qkv [T, q_dim + 2 kv_dim]
    att [T, q_dim]                  proj [T, dim] scratch       gu [T, 2 ffn_dim] (gate | up)
    act [T, ffn_dim]                xo [n_out, dim]             logits [n_out, n_vocab]
    router [T, n_experts] (MoE)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from barellm.arch.config import ModelConfig


@dataclass(frozen=True)
class Op:
    """What every op has: a name, the buffer it writes (its observable result), and which rows it covers:
    "tokens" (the chunk's T rows) or "selected" (the rows picked for logits: out row i <- x row sel[i])."""

    kind: ClassVar[str]
    name: str
    out: str

    @property
    def x(self) -> str | None:
        """The buffer the op reads (None for the embedding lookup)."""
        return None

    @property
    def weights(self) -> tuple[str, ...]:
        """Every tensor the op reads."""
        return ()

    @property
    def rows(self) -> str:
        return "tokens"

    def __repr__(self) -> str:
        w = f" {'|'.join(self.weights)}" if self.weights else ""
        return f"<{self.name}: {self.kind} {self.x} -> {self.out}{w}>"


@dataclass(frozen=True, repr=False)
class Embed(Op):
    """out[t] = table row tokens[t] * scale."""

    kind: ClassVar[str] = "embed"
    table: str
    scale: float = 1.0

    @property
    def weights(self) -> tuple[str, ...]:
        return (self.table,)


@dataclass(frozen=True, repr=False)
class RMSNorm(Op):
    """out = rmsnorm(src) * weight; with accumulate, out += rmsnorm(src) * weight (a post norm)."""

    kind: ClassVar[str] = "rmsnorm"
    src: str
    weight: str
    eps: float
    accumulate: bool = False
    selected: bool = False   # the output rows only (the final norm)

    @property
    def x(self) -> str:
        return self.src

    @property
    def weights(self) -> tuple[str, ...]:
        return (self.weight,)

    @property
    def rows(self) -> str:
        return "selected" if self.selected else "tokens"


@dataclass(frozen=True, repr=False)
class MatMul(Op):
    """out = src @ W.T (+ bias) with W the row-concatenation of `matrices`; with accumulate, out += that."""

    kind: ClassVar[str] = "matmul"
    src: str
    matrices: tuple[str, ...]
    bias: tuple[str, ...] = ()   # one vector per matrix, concatenated the same way
    accumulate: bool = False
    selected: bool = False

    @property
    def x(self) -> str:
        return self.src

    @property
    def weights(self) -> tuple[str, ...]:
        return self.matrices + self.bias

    @property
    def rows(self) -> str:
        return "selected" if self.selected else "tokens"


@dataclass(frozen=True, repr=False)
class RopeKV(Op):
    """In place on the qkv rows: (RMSNorm of each q and k head,) RoPE of q and k; then K and V into the
    layer's cache at each token's position (an 8-bit cache stores each key minus k_bias, the K projection's
    bias where the model has one, and turned by a Walsh-Hadamard transform: kv_q8.q8_0_keys)."""

    kind: ClassVar[str] = "rope_kv"
    layer: int
    eps: float
    rope: bool = True            # False: no rotation (a NoPE layer), the cache writes only
    q_norm: str | None = None
    k_norm: str | None = None
    k_bias: str | None = None

    @property
    def x(self) -> str:
        return self.out

    @property
    def weights(self) -> tuple[str, ...]:
        return tuple(n for n in (self.q_norm, self.k_norm, self.k_bias) if n)


@dataclass(frozen=True, repr=False)
class Attention(Op):
    """out[t] = causal grouped-query attention of the q heads of src[t] over the slot's cache (the last
    `window` keys only, when window > 0)."""

    kind: ClassVar[str] = "attention"
    src: str
    layer: int
    window: int = 0
    softcap: float = 0.0         # scores s become softcap * tanh(s / softcap) (0: as they are)
    sinks: str | None = None     # a tensor of one logit per head, in its softmax's denominator only

    @property
    def weights(self) -> tuple[str, ...]:
        return (self.sinks,) if self.sinks else ()

    @property
    def x(self) -> str:
        return self.src


@dataclass(frozen=True, repr=False)
class GatedAct(Op):
    """out = act(gate) * up, gate and up the two halves of each src row."""

    kind: ClassVar[str] = "silu_mul"
    src: str
    act: str = "silu"            # "silu" or "gelu_tanh"

    @property
    def x(self) -> str:
        return self.src


@dataclass(frozen=True, repr=False)
class SoftCap(Op):
    """In place on the selected rows of out: x = cap * tanh(x / cap) (Gemma 2's bounded logits)."""

    kind: ClassVar[str] = "softcap"
    cap: float

    @property
    def x(self) -> str:
        return self.out

    @property
    def rows(self) -> str:
        return "selected"


@dataclass(frozen=True, repr=False)
class MoE(Op):
    """A mixture-of-experts MLP: each row of src goes to the n_used experts with the largest router logits
    (`logits`, a buffer), weighted by their softmax (over the chosen ones with norm); expert e is slice e of
    the stacks gate, up and down, a gated MLP act(gate_e src) * (up_e src) -> down_e. out = the weighted sum of
    the experts' outputs; with accumulate, out += that."""

    kind: ClassVar[str] = "moe"
    src: str
    logits: str
    gate: str
    up: str
    down: str
    n_used: int
    norm: bool
    act: str = "silu"            # "silu", "gelu_tanh" or "swiglu_oai" (llama.gated)
    accumulate: bool = False
    biases: tuple[str, ...] = ()  # gate's, up's and down's, stacked as their matrices ([n_experts, rows])

    @property
    def x(self) -> str:
        return self.src

    @property
    def weights(self) -> tuple[str, ...]:
        return (self.gate, self.up, self.down) + self.biases


OP_TYPES = (Embed, RMSNorm, MatMul, RopeKV, Attention, GatedAct, MoE, SoftCap)


def buffer_widths(cfg: ModelConfig) -> dict[str, int]:
    widths = {
        "x": cfg.dim, "xn": cfg.dim, "qkv": cfg.q_dim + 2 * cfg.kv_dim, "att": cfg.q_dim, "proj": cfg.dim,
        "gu": 2 * cfg.ffn_dim, "act": cfg.ffn_dim, "xo": cfg.dim, "logits": cfg.n_vocab,
    }
    if cfg.n_experts:  # the experts' own buffers are the engine's (their rows are (token, expert) pairs)
        del widths["gu"], widths["act"]
        widths["router"] = cfg.n_experts
    return widths


def _mlp(cfg: ModelConfig, b: str) -> list[Op]:
    """A layer's MLP after its input norm (into xn): x += the gated MLP of xn (or its post norm), or the
    mixture of experts in an MoE row."""
    if not cfg.n_experts:
        return [
            MatMul(b + "ffn_gate_up", "gu", src="xn",
                   matrices=(b + "ffn_up.weight",) if cfg.spec.fused_gate_up else (b + "ffn_gate.weight",
                                                                                   b + "ffn_up.weight")),
            GatedAct(b + "ffn_act", "act", src="gu", act=cfg.act),
            *_residual(cfg, b + "ffn_down", "act", b + "ffn_down.weight",
                       b + "post_ffn_norm", b + "post_ffw_norm.weight"),
        ]
    moe = MoE(b + "ffn_moe", "proj" if cfg.post_norms else "x", src="xn", logits="router",
              gate=b + "ffn_gate_exps.weight", up=b + "ffn_up_exps.weight", down=b + "ffn_down_exps.weight",
              n_used=cfg.n_experts_used, norm=cfg.expert_weights_norm, act=cfg.act, accumulate=not cfg.post_norms,
              biases=tuple(b + f"ffn_{n}_exps.bias" for n in ("gate", "up", "down")) if cfg.spec.expert_biases else ())
    router_bias = (b + "ffn_gate_inp.bias",) if cfg.spec.expert_biases else ()
    ops: list[Op] = [MatMul(b + "ffn_router", "router", src="xn", matrices=(b + "ffn_gate_inp.weight",),
                            bias=router_bias), moe]
    if cfg.post_norms:
        ops.append(RMSNorm(b + "post_ffn_norm", "x", src="proj", weight=b + "post_ffw_norm.weight",
                           eps=cfg.norm_eps, accumulate=True))
    return ops


def _residual(cfg: ModelConfig, name: str, src: str, matrix: str, norm: str, norm_weight: str,
              bias: tuple[str, ...] = ()) -> list[Op]:
    """x += W src (+ bias); with post norms x += rmsnorm(W src), which needs the whole projected row first."""
    if not cfg.post_norms:
        return [MatMul(name, "x", src=src, matrices=(matrix,), bias=bias, accumulate=True)]
    return [
        MatMul(name, "proj", src=src, matrices=(matrix,), bias=bias),
        RMSNorm(norm, "x", src="proj", weight=norm_weight, eps=cfg.norm_eps, accumulate=True),
    ]


def llama_plan(cfg: ModelConfig) -> list[Op]:
    """The llama-family forward pass: pre-norm blocks, GQA attention with RoPE, a gated MLP; and what the
    other rows of the registry add to it (Q/K/V biases, per-head QK norms, scaled embeddings, post norms,
    GELU, sliding windows, mixtures of experts)."""
    eps = cfg.norm_eps
    ops: list[Op] = [Embed("token_embd", "x", table="token_embd.weight", scale=cfg.embed_scale)]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        qkv = ((b + "attn_qkv.weight",) if cfg.spec.fused_qkv
               else (b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"))
        bias = (b + "attn_q.bias", b + "attn_k.bias", b + "attn_v.bias") if cfg.attn_bias else ()
        ops += [
            RMSNorm(b + "attn_norm", "xn", src="x", weight=b + "attn_norm.weight", eps=eps),
            MatMul(b + "qkv", "qkv", src="xn", matrices=qkv, bias=bias),
            RopeKV(b + "rope", "qkv", layer=i, eps=eps, rope=cfg.layer_rope(i),
                   q_norm=b + "attn_q_norm.weight" if cfg.qk_norm else None,
                   k_norm=b + "attn_k_norm.weight" if cfg.qk_norm else None,
                   k_bias=b + "attn_k.bias" if cfg.attn_bias else None),
            Attention(b + "attn", "att", src="qkv", layer=i, window=cfg.layer_window(i), softcap=cfg.attn_softcap,
                      sinks=b + "attn_sinks.weight" if cfg.spec.sinks else None),
            *_residual(cfg, b + "attn_out", "att", b + "attn_output.weight",
                       b + "post_attn_norm", b + "post_attention_norm.weight",
                       (b + "attn_output.bias",) if cfg.spec.attn_out_bias else ()),
            RMSNorm(b + "ffn_norm", "xn", src="x", weight=b + cfg.spec.ffn_norm, eps=eps),
            *_mlp(cfg, b),
        ]
    out_w = "token_embd.weight" if cfg.tied_output else "output.weight"
    ops += [
        RMSNorm("output_norm", "xo", src="x", weight="output_norm.weight", eps=eps, selected=True),
        MatMul("output", "logits", src="xo", matrices=(out_w,), selected=True),
    ]
    if cfg.final_softcap:
        ops.append(SoftCap("output_softcap", "logits", cap=cfg.final_softcap))
    return ops
