"""The architectures barellm runs, one row each: what an architecture adds to the llama forward pass.

Every llama-family model is the same forward pass (pre-norm blocks, grouped-query attention with RoPE, a
gated MLP) with a few switches flipped. A row says which ones, and where the architecture's facts live in
files: the GGUF metadata prefix and the tensors beyond llama's. The config reader (config.py), the NumPy
reference (llama.py), the plan (plan.py), the native engine's support check (engine.py) and the converter
(convert.py) all read this table; adding a llama-family architecture is a row here, plus kernels only where the
math is new. How a Hugging Face checkpoint becomes one (its model_type, its tensor names and what is done to
them) is a row of store/hf_families.py, which names the architecture it makes: only a family that converts from
checkpoints has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from barellm.errors import FormatError


@dataclass(frozen=True)
class Architecture:
    """One row of the table. The defaults are llama's."""

    name: str                     # general.architecture, and the prefix of its metadata keys
    # RoPE: "norm" rotates adjacent pairs (x[2i], x[2i+1]), the layout GGUF's llama files store Q and K in;
    # "neox" rotates (x[i], x[i + rope_dim/2]), as the original checkpoints of every other family do.
    rope_style: str = "norm"
    rope_freqs: bool = False      # may carry rope_freqs.weight: per-pair factors dividing the RoPE frequencies
                                  # (Llama 3.1's scaling, as llama.cpp stores it)
    attn_bias: bool = False       # the Q, K and V projections add a bias
    qk_norm: bool = False         # RMSNorm over each query and key head before RoPE
    post_norms: bool = False      # RMSNorm on the attention and MLP outputs before the residual add
    act: str = "silu"             # the gated MLP's activation: "silu" or "gelu_tanh"
    embed_scale_sqrt_dim: bool = False  # token embeddings are multiplied by sqrt(dim)
    swa_pattern: int = 0          # every swa_pattern-th layer is global, the others see a sliding window
    rope_theta_local: float = 0.0  # sliding-window layers' RoPE base without rope.freq_base_swa (0: the global one)
    rope_linear_local: bool = True  # a file's linear RoPE scaling slows the sliding-window layers' positions too
                                    # (Gemma 3: only the global layers', as llama.cpp sets its local ones' scale 1)
    norm: str = "rms"             # every norm is an RMSNorm (the only kind the engines have)
    # Mixture of experts: each layer's MLP is n_experts gated MLPs stacked in 3-D tensors and a router
    # (ffn_gate_inp) that picks expert_used_count of them per token, weighted by the softmax of its logits
    moe: bool = False
    fused_qkv: bool = False       # one attn_qkv matrix: the q rows, then k's, then v's (Phi-3)
    fused_gate_up: bool = False   # one ffn_up matrix of 2 ffn rows: the gate's, then up's (Phi-3)
    long_rope: bool = False       # LongRoPE: rope_factors_short / rope_factors_long divide the RoPE frequencies
                                  # (the long ones past original_context_length), rope.scaling.attn_factor
                                  # multiplies cos and sin (Phi-3)
    softcaps: bool = False        # the file's attn_logit_softcapping and final_logit_softcapping bound the
                                  # attention scores and the logits: cap * tanh(x / cap) (Gemma 2)
    attn_out_bias: bool = False   # the attention's output projection adds a bias (gpt-oss)
    sinks: bool = False           # attn_sinks: one logit per head, in the attention softmax's denominator only
    yarn: bool = False            # may use YaRN RoPE scaling (rope.scaling.type yarn)
    expert_biases: bool = False   # the router and every expert matrix add a bias (gpt-oss)
    ffn_norm: str = "ffn_norm.weight"  # the MLP's input norm (gpt-oss names it post_attention_norm)
    nope_every: int = 0           # every nope_every-th layer has no RoPE at all (SmolLM3: 4, fixed in llama.cpp's
                                  # code, not in the files)
    expert_weights_norm: bool = False  # the chosen experts' weights are renormalized to sum 1 (as llama.cpp's
                                       # graph of the architecture does, whatever a file's key of that name says)
    # Gemma scales the attention scores by 1/sqrt(query_pre_attn_scalar), which GGUF files do not carry: llama.cpp
    # takes head_dim for it, but dim / heads for a file of this many layers (the 27B); a row with it reads
    # attention.scale where a file has one (a converted checkpoint's 1/sqrt(query_pre_attn_scalar))
    query_scalar_27b_layers: int = 0

    @property
    def layer_tensors(self) -> tuple[str, ...]:
        """The tensor names of one layer (after `blk.{i}.`), llama's and this row's extras."""
        names = ["attn_norm.weight"]
        names += ["attn_qkv.weight"] if self.fused_qkv else ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
        names.append("attn_output.weight")
        if self.attn_bias:
            names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if self.qk_norm:
            names += ["attn_q_norm.weight", "attn_k_norm.weight"]
        if self.post_norms:
            names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
        if self.attn_out_bias:
            names.append("attn_output.bias")
        if self.sinks:
            names.append("attn_sinks.weight")
        names.append(self.ffn_norm)
        if self.expert_biases:
            names += ["ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias"]
        if self.moe:
            names += ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
        elif self.fused_gate_up:
            names += ["ffn_up.weight", "ffn_down.weight"]
        else:
            names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        return tuple(names)


ARCHITECTURES: dict[str, Architecture] = {
    row.name: row
    for row in (
        Architecture("llama", rope_style="norm", rope_freqs=True),
        # Gemma 3 (as llama.cpp reads it): GGUF stores Q/K unpermuted, so RoPE rotates (i, i + d/2) pairs;
        # five local layers with base 10000 (or the file's rope.freq_base_swa) and no linear scaling (the 4B, 12B
        # and 27B files' factor 8 is the global layers') for each global one.
        Architecture("gemma3", rope_style="neox", qk_norm=True, post_norms=True, act="gelu_tanh",
                     embed_scale_sqrt_dim=True, swa_pattern=6, rope_theta_local=10000.0, rope_linear_local=False,
                     query_scalar_27b_layers=62),
        Architecture("qwen2", rope_style="neox", attn_bias=True),
        Architecture("qwen3", rope_style="neox", qk_norm=True),
        # Qwen3-MoE: qwen3's attention and an MoE MLP on every layer; llama.cpp's qwen3moe graph always
        # renormalizes the chosen experts' weights (norm_w = true)
        Architecture("qwen3moe", rope_style="neox", qk_norm=True, moe=True, expert_weights_norm=True),
        # Gemma 2: gemma3's norms, GELU and scaled embeddings without its q/k norms, every other layer local
        # (the global RoPE base, or rope.freq_base_swa), soft-capped attention scores and logits
        Architecture("gemma2", rope_style="neox", post_norms=True, act="gelu_tanh", embed_scale_sqrt_dim=True,
                     swa_pattern=2, softcaps=True, query_scalar_27b_layers=46),
        # gpt-oss: biased projections, attention sinks, every other layer local, YaRN, a mixture of experts with
        # biases whose router picks by raw logit and weighs the chosen by their softmax, clamped SwiGLU
        Architecture("gpt-oss", rope_style="neox", attn_bias=True, attn_out_bias=True, sinks=True, swa_pattern=2,
                     yarn=True, moe=True, expert_weights_norm=True, expert_biases=True, act="swiglu_oai",
                     ffn_norm="post_attention_norm.weight"),
        # Phi-3 (and Phi-4-mini): fused projections, partial RoPE with LongRoPE factors
        Architecture("phi3", rope_style="neox", fused_qkv=True, fused_gate_up=True, long_rope=True),
        # SmolLM3: llama with every fourth layer's RoPE left out (llama.cpp rotates adjacent pairs for it)
        Architecture("smollm3", rope_style="norm", nope_every=4),
    )
}


def architecture(name: object) -> Architecture:
    """The row of an architecture; FormatError naming the supported ones otherwise."""
    row = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if row is None:
        raise FormatError(f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return row

