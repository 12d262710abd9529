"""The forward pass as a plan: a flat list of ops over named buffers.

The plan says *what* runs, in order, in architecture terms; engine.py binds it to buffers and weights
and compiles it for the native executor. Op names are stable (the debug tools address ops by them):

    token_embd
    blk.{i}.attn_norm  blk.{i}.qkv  blk.{i}.rope  blk.{i}.attn  blk.{i}.attn_out  [blk.{i}.post_attn_norm]
    blk.{i}.ffn_norm   blk.{i}.ffn_gate_up  blk.{i}.ffn_act  blk.{i}.ffn_down  [blk.{i}.post_ffn_norm]
    output_norm  output
(the bracketed ones in models with post norms, Gemma 3).

Buffers (rows = tokens of the current chunk, or the selected rows for the output ops):
    x [T, dim] residual stream      xn [T, dim] normed          qkv [T, q_dim + 2 kv_dim]
    att [T, q_dim]                  proj [T, dim] scratch       gu [T, 2 ffn_dim] (gate | up)
    act [T, ffn_dim]                xo [n_out, dim]             logits [n_out, n_vocab]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from barellm.arch.config import ModelConfig

KINDS = ("embed", "rmsnorm", "matmul", "rope_kv", "attention", "silu_mul", "add")


@dataclass
class Op:
    name: str
    kind: str                                  # one of KINDS
    out: str                                   # the buffer the op writes (its observable result)
    x: str | None = None                       # the buffer it reads
    weights: tuple[str, ...] = ()              # tensor names; a matmul's parts, concatenated by rows
    params: dict[str, Any] = field(default_factory=dict)
    # rows: "tokens" (the chunk's T rows) or "selected" (rows picked for logits: out row i <- x row sel[i])
    rows: str = "tokens"

    def __repr__(self) -> str:
        w = f" {'|'.join(self.weights)}" if self.weights else ""
        return f"<{self.name}: {self.kind} {self.x} -> {self.out}{w}>"


def buffer_widths(cfg: ModelConfig) -> dict[str, int]:
    return {
        "x": cfg.dim, "xn": cfg.dim, "qkv": cfg.q_dim + 2 * cfg.kv_dim, "att": cfg.q_dim, "proj": cfg.dim,
        "gu": 2 * cfg.ffn_dim, "act": cfg.ffn_dim, "xo": cfg.dim, "logits": cfg.n_vocab,
    }


def llama_plan(cfg: ModelConfig) -> list[Op]:
    """The llama-family forward pass: pre-norm blocks, GQA attention with RoPE, a gated MLP; and what
    Gemma 3 adds to it (scaled embeddings, per-head QK norms, post norms, GELU, sliding windows)."""
    eps = cfg.norm_eps
    ops = [Op("token_embd", "embed", out="x", weights=("token_embd.weight",), params={"scale": cfg.embed_scale})]
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        qk_norms = (b + "attn_q_norm.weight", b + "attn_k_norm.weight") if cfg.qk_norm else ()
        ops += [
            Op(b + "attn_norm", "rmsnorm", out="xn", x="x", weights=(b + "attn_norm.weight",), params={"eps": eps}),
            Op(b + "qkv", "matmul", out="qkv", x="xn",
               weights=(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight")),
            Op(b + "rope", "rope_kv", out="qkv", x="qkv", weights=qk_norms, params={"layer": i, "eps": eps}),
            Op(b + "attn", "attention", out="att", x="qkv", params={"layer": i, "window": cfg.layer_window(i)}),
        ]
        if cfg.post_norms:  # out = x + rmsnorm(W att): the norm needs the whole projected row first
            ops += [
                Op(b + "attn_out", "matmul", out="proj", x="att", weights=(b + "attn_output.weight",)),
                Op(b + "post_attn_norm", "rmsnorm", out="x", x="proj", weights=(b + "post_attention_norm.weight",),
                   params={"eps": eps, "accumulate": True}),
            ]
        else:
            ops.append(Op(b + "attn_out", "matmul", out="x", x="att", weights=(b + "attn_output.weight",),
                          params={"accumulate": True}))
        ops += [
            Op(b + "ffn_norm", "rmsnorm", out="xn", x="x", weights=(b + "ffn_norm.weight",), params={"eps": eps}),
            Op(b + "ffn_gate_up", "matmul", out="gu", x="xn", weights=(b + "ffn_gate.weight", b + "ffn_up.weight")),
            Op(b + "ffn_act", "silu_mul", out="act", x="gu", params={"act": cfg.act}),
        ]
        if cfg.post_norms:
            ops += [
                Op(b + "ffn_down", "matmul", out="proj", x="act", weights=(b + "ffn_down.weight",)),
                Op(b + "post_ffn_norm", "rmsnorm", out="x", x="proj", weights=(b + "post_ffw_norm.weight",),
                   params={"eps": eps, "accumulate": True}),
            ]
        else:
            ops.append(Op(b + "ffn_down", "matmul", out="x", x="act", weights=(b + "ffn_down.weight",),
                          params={"accumulate": True}))
    out_w = "token_embd.weight" if cfg.tied_output else "output.weight"
    ops += [
        Op("output_norm", "rmsnorm", out="xo", x="x", weights=("output_norm.weight",), params={"eps": eps},
           rows="selected"),
        Op("output", "matmul", out="logits", x="xo", weights=(out_w,), rows="selected"),
    ]
    return ops
