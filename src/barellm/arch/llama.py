"""The llama architecture, as a slow and exact NumPy float32 forward pass, and its relatives.

This is the reference every optimized path is checked against, so it is written for clarity: one
function per step, the forward pass readable top to bottom. Weights are dequantized to float32 once
at load; the KV cache is allocated once for the context size.

Every architecture of the registry (registry.py) is llama with a few twists, each a flag of ModelConfig:
Q/K/V biases (qwen2), RMSNorm over each query/key head (qwen3, gemma3), RoPE frequency factors (Llama
3.1), and Gemma 3's scaled embeddings, norms after attention and MLP, GELU-gated MLP and local layers that
see a sliding window of keys with their own RoPE base.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from barellm.arch.config import ModelConfig, check_tensors
from barellm.cpu import check_memory
from barellm.errors import InvalidRequest


class WeightSource(Protocol):
    """What a model file offers the engines (GGUFFile and the .blm reader both do)."""

    tensors: dict[str, Any]

    def dequantize(self, name: str) -> np.ndarray: ...


# --- the steps of the forward pass -------------------------------------------------------------


F64_COLUMNS = 4096  # matmul_f64's block: 4096 columns of a 1,024-row matrix widen to 32 MiB


def matmul_f64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b of float32 arrays summed in float64 and rounded once to float32: the same result on every CPU.

    A float32 BLAS sums in the order of the kernel it picks for the CPU (OpenBLAS: per core type), so its
    results differ between machines by float32 rounding. Here each product of two float32 values is exact
    in float64, and the sum's rounding errors (at most n * 1.1e-16 of the sum of |terms| for n terms, ~1e-13
    for a model's widths) fall far below float32's half ulp (3e-8): the order changes the float32 result only
    for a value that close to a rounding boundary, about one in a million, and then by one ulp.
    b is widened a block of columns at a time, so a wide matrix (the output's, over the vocabulary) needs no
    float64 copy of the whole."""
    a64 = a.astype(np.float64)
    out = np.empty((*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1]), np.float32)
    for j in range(0, b.shape[-1], F64_COLUMNS):
        out[..., j:j + F64_COLUMNS] = np.matmul(a64, b[..., j:j + F64_COLUMNS].astype(np.float64))
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x[T, d] / rms(x) * w, the mean taken over d."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(ms + np.float32(eps))) * w


def rope_frequencies(rope_dim: int, base: float, factors: np.ndarray | None = None, yarn: float = 0.0,
                     original_context: int = 0, position_scale: float = 1.0) -> np.ndarray:
    """theta_i = base^(-2i/rope_dim) / factor_i (float64 [rope_dim/2]); the factors are a file's
    rope_freqs.weight (Llama 3.1's scaling: low frequencies slowed down for long contexts). With a YaRN factor
    (and the context the model was trained for), ggml's YaRN: each frequency slowed by the factor, blended back
    towards the original by a ramp over the dims between the corrections for 32 and 1 rotations (beta fast
    and slow) in the original context: the fast dims keep their frequency, the slow ones are interpolated.
    position_scale (linear RoPE scaling's 1 / factor, ggml's freq_scale) multiplies every frequency, which is
    multiplying the positions by it."""
    inv_freq = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    if yarn:
        def corr_dim(rotations: float) -> float:
            return rope_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(0.0, math.floor(corr_dim(32.0))), min(rope_dim - 1.0, math.ceil(corr_dim(1.0)))
        y = (np.arange(rope_dim // 2, dtype=np.float64) - low) / max(0.001, high - low)
        mix = 1.0 - np.clip(y, 0.0, 1.0)
        inv_freq = inv_freq / yarn * (1.0 - mix) + inv_freq * mix
    return inv_freq * position_scale if position_scale != 1.0 else inv_freq


def rope_tables(rope_dim: int, base: float, n_ctx: int, factors: np.ndarray | None = None,
                scale: float = 1.0, yarn: float = 0.0, original_context: int = 0,
                position_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n_ctx, rope_dim/2] of position * position_scale * theta_i (rope_frequencies), times scale
    (LongRoPE's attention factor)."""
    inv_freq = rope_frequencies(rope_dim, base, factors, yarn, original_context, position_scale)
    angles = np.outer(np.arange(n_ctx, dtype=np.float64), inv_freq)
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(np.float32), sin.astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotates the first rope_dim values of each head of x[T, n_heads, head_dim] by position.

    cos/sin are [T, rope_dim/2], the rows of the tables for the tokens' positions.
    """
    half = cos.shape[-1]
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "norm":      # pairs (2i, 2i+1)
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = a * c - b * s
        out[..., 1:2 * half:2] = a * s + b * c
    else:                    # "neox": pairs (i, i + half)
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half] = a * c - b * s
        out[..., half:2 * half] = a * s + b * c
    return out


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap): x bounded to (-cap, cap) smoothly (Gemma 2's scores and logits); x for cap 0."""
    return x if not cap else np.float32(cap) * np.tanh(x / np.float32(cap))


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float, window: int = 0,
              cap: float = 0.0, sinks: np.ndarray | None = None,
              matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul) -> np.ndarray:
    """Causal grouped-query attention.

    q[T, n_heads, hd] for positions start..start+T-1; k, v [start+T, n_kv_heads, hd] from the cache.
    Query head h reads kv head h // (n_heads / n_kv_heads). With a window, the query at position p
    sees only the keys at p - window + 1 .. p. With cap, the scaled scores are soft-capped (softcap). With
    sinks [n_heads], each head's softmax has one more term, exp(sink), in its denominator only. matmul
    computes the scores and their mix of values (matmul_f64: the same bits on every CPU).
    """
    T, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    kh = np.repeat(k, group, axis=1).transpose(1, 2, 0)   # [n_heads, hd, S]
    vh = np.repeat(v, group, axis=1).transpose(1, 0, 2)   # [n_heads, S, hd]
    scores = softcap(matmul(q.transpose(1, 0, 2), kh) * np.float32(scale), cap)  # [n_heads, T, S]
    key_pos = np.arange(k.shape[0])[None, :]
    query_pos = (start + np.arange(T))[:, None]
    hidden = key_pos > query_pos
    if window:
        hidden |= query_pos - key_pos >= window
    scores[:, hidden] = -np.inf
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    p = np.exp(scores - top)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks[:, None, None] - top)
    p /= denom
    return matmul(p, vh).transpose(1, 0, 2).reshape(T, n_heads * hd)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation, as Gemma is trained with."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0   # gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai)


def gated(act: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """A gated MLP's act(gate) * up; "swiglu_oai": gpt-oss's, the gate clamped above and up on both sides,
    min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)."""
    if act == "swiglu_oai":
        g = np.minimum(gate, np.float32(SWIGLU_LIMIT))
        u = np.clip(up, np.float32(-SWIGLU_LIMIT), np.float32(SWIGLU_LIMIT))
        return g / (np.float32(1.0) + np.exp(np.float32(-SWIGLU_ALPHA) * g)) * (u + np.float32(1.0))
    return ACTIVATIONS[act](gate) * up


def route(logits: np.ndarray, n_used: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """The experts each token goes to, from the router's logits [T, n_experts]: their ids [T, n_used] (the
    largest logits first, ties to the lower id) and weights [T, n_used], the softmax over all experts or, with
    norm, over the chosen ones. llama.cpp takes the softmax, then the top n_used, then renormalizes; the
    softmax keeps the logits' order, so the top n_used of the logits are the same experts, chosen exactly."""
    choice = np.argsort(-logits, axis=1, kind="stable")[:, :n_used]
    e = np.exp(logits.astype(np.float64) - logits.max(axis=1, keepdims=True))
    chosen = np.take_along_axis(e, choice, axis=1)
    weight = chosen / (chosen.sum(axis=1, keepdims=True) if norm else e.sum(axis=1, keepdims=True))
    return choice, weight.astype(np.float32)


def moe(x: np.ndarray, logits: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, n_used: int,
        norm: bool, act: str, biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """A mixture-of-experts MLP of x [T, dim]: each token's chosen experts (route), each a gated MLP whose
    matrices are one slice of the stacks gate, up [n_experts, ffn, dim] and down [n_experts, dim, ffn] (plus
    that slice of the biases [n_experts, ffn], [n_experts, ffn], [n_experts, dim], if any), summed with their
    weights in the order they were chosen."""
    choice, weight = route(logits, n_used, norm)
    y = np.zeros((x.shape[0], n_used, down.shape[1]), np.float32)
    for e in np.unique(choice):
        t, k = np.nonzero(choice == e)
        g, u = x[t] @ gate[e].T, x[t] @ up[e].T
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        y[t, k] = gated(act, g, u) @ down[e].T
        if biases is not None:
            y[t, k] += biases[2][e]
    out = y[:, 0] * weight[:, :1]
    for k in range(1, n_used):
        out = out + y[:, k] * weight[:, k:k + 1]
    return out


# --- the model ---------------------------------------------------------------------------------


@dataclass
class ExpertWeights:
    """A mixture-of-experts MLP: the router's matrix (transposed, [dim, n_experts]) and the experts' stacks."""

    router: np.ndarray
    router_bias: np.ndarray | None
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None   # gate's, up's and down's [n_experts, rows]
    gate: np.ndarray   # [n_experts, ffn, dim]
    up: np.ndarray     # [n_experts, ffn, dim]
    down: np.ndarray   # [n_experts, dim, ffn]


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray | None = None   # the dense MLP (None with experts)
    w_up: np.ndarray | None = None
    w_down: np.ndarray | None = None
    experts: ExpertWeights | None = None
    bo: np.ndarray | None = None        # the attention output projection's bias
    sinks: np.ndarray | None = None     # [n_heads]
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


class ReferenceEngine:
    """The NumPy float32 forward pass over a KV cache allocated once for n_ctx positions.

    kv_type: what the cache holds: "f32" (the default: exact), or the values a native cache of "f16" or
    "q8_0" would hold (K and V rounded to halves, or through ggml's q8_0 blocks: V as it is, K minus its bias
    and turned by a Walsh-Hadamard transform first, kv_q8.q8_0_keys), kept as float32.

    accumulate: how every matmul sums: "float32" (the default: NumPy's BLAS, whose order and so whose
    rounding depend on the kernel it picks for the CPU), or "float64", rounded once to float32 (matmul_f64:
    the same logits on every CPU, for comparisons that a float32 difference could tip, such as a rounding
    to the q8_0 cache's int8 grid; slower, and each matrix is widened to float64 while it is used)."""

    def __init__(self, cfg: ModelConfig, source: WeightSource, n_ctx: int | None = None, n_slots: int = 1,
                 kv_type: str = "f32", accumulate: str = "float32") -> None:
        check_tensors(cfg, source.tensors)
        if kv_type not in ("f32", "f16", "q8_0"):
            raise InvalidRequest(f"kv_type must be one of f32, f16, q8_0, got {kv_type!r}")
        if accumulate not in ("float32", "float64"):
            raise InvalidRequest(f"accumulate must be float32 or float64, got {accumulate!r}")
        self.accumulate = accumulate
        self.matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = (
            matmul_f64 if accumulate == "float64" else np.matmul)
        if kv_type == "q8_0" and cfg.head_dim % 32:
            raise InvalidRequest(f"kv_type q8_0 needs a head_dim that is a multiple of 32; this model's is "
                                 f"{cfg.head_dim}")
        self.kv_type = kv_type
        self.cfg = cfg
        self.n_ctx = n_ctx or cfg.context_length
        self.n_vocab = cfg.n_vocab
        # before anything is allocated: the float32 weights (and one matrix's transposed copy), the cache and
        # the RoPE tables (built in float64) against the machine's available memory
        sizes = [4 * int(np.prod(t.shape, dtype=np.int64)) for t in source.tensors.values()]
        bases = len({cfg.layer_rope_table(i) for i in range(cfg.n_layers)})
        check_memory("reference", self.n_ctx, 2 * n_slots * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4,
                     bases * cfg.rope_dim * 20, sum(sizes) + max(sizes, default=0), fixed_what="float32 weights")

        def w(name: str) -> np.ndarray:
            return np.ascontiguousarray(source.dequantize(name), dtype=np.float32)

        def optional(name: str, present: bool) -> np.ndarray | None:
            return w(name) if present else None

        def transposed(name: str, present: bool) -> np.ndarray | None:
            return w(name).T.copy() if present else None

        def qkv(i: int) -> tuple[np.ndarray, ...]:
            """W_q, W_k, W_v transposed: the file's own, or the row ranges of its fused attn_qkv."""
            b = f"blk.{i}."
            if not cfg.spec.fused_qkv:
                return tuple(w(b + n).T.copy() for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight"))
            m, q, k = w(b + "attn_qkv.weight"), cfg.q_dim, cfg.kv_dim
            return m[:q].T.copy(), m[q:q + k].T.copy(), m[q + k:].T.copy()

        def gate_up(i: int) -> tuple[np.ndarray | None, np.ndarray | None]:
            """W_gate, W_up transposed (None with experts): the file's own, or the halves of its fused ffn_up."""
            b = f"blk.{i}."
            if cfg.n_experts:
                return None, None
            if not cfg.spec.fused_gate_up:
                return w(b + "ffn_gate.weight").T.copy(), w(b + "ffn_up.weight").T.copy()
            m = w(b + "ffn_up.weight")
            return m[:cfg.ffn_dim].T.copy(), m[cfg.ffn_dim:].T.copy()

        def experts(i: int) -> ExpertWeights | None:
            if not cfg.n_experts:
                return None
            b = f"blk.{i}."
            biased = cfg.spec.expert_biases
            biases = tuple(w(b + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down")) if biased else None
            return ExpertWeights(router=w(b + "ffn_gate_inp.weight").T.copy(),
                                 router_bias=optional(b + "ffn_gate_inp.bias", biased), biases=biases,  # type: ignore[arg-type]
                                 gate=w(b + "ffn_gate_exps.weight"),
                                 up=w(b + "ffn_up_exps.weight"), down=w(b + "ffn_down_exps.weight"))

        self.token_embd = w("token_embd.weight")
        self.output_norm = w("output_norm.weight")
        self.output = self.token_embd if cfg.tied_output else w("output.weight")
        # Matrices are stored transposed once, so every projection is a plain x @ W.
        self.layers = [
            LayerWeights(
                attn_norm=w(f"blk.{i}.attn_norm.weight"),
                wq=qkv(i)[0], wk=qkv(i)[1], wv=qkv(i)[2],
                wo=w(f"blk.{i}.attn_output.weight").T.copy(),
                ffn_norm=w(f"blk.{i}.{cfg.spec.ffn_norm}"),
                bo=optional(f"blk.{i}.attn_output.bias", cfg.spec.attn_out_bias),
                sinks=optional(f"blk.{i}.attn_sinks.weight", cfg.spec.sinks),
                w_gate=gate_up(i)[0], w_up=gate_up(i)[1],
                w_down=transposed(f"blk.{i}.ffn_down.weight", not cfg.n_experts),
                experts=experts(i),
                bq=optional(f"blk.{i}.attn_q.bias", cfg.attn_bias),
                bk=optional(f"blk.{i}.attn_k.bias", cfg.attn_bias),
                bv=optional(f"blk.{i}.attn_v.bias", cfg.attn_bias),
                q_norm=optional(f"blk.{i}.attn_q_norm.weight", cfg.qk_norm),
                k_norm=optional(f"blk.{i}.attn_k_norm.weight", cfg.qk_norm),
                post_attn_norm=optional(f"blk.{i}.post_attention_norm.weight", cfg.post_norms),
                post_ffn_norm=optional(f"blk.{i}.post_ffw_norm.weight", cfg.post_norms),
            )
            for i in range(cfg.n_layers)
        ]
        # one cache region per slot (independent sequences served side by side)
        self.n_slots = n_slots
        self.k_cache = np.zeros((n_slots, cfg.n_layers, self.n_ctx, cfg.n_kv_heads, cfg.head_dim), np.float32)
        self.v_cache = np.zeros_like(self.k_cache)
        factor_name = cfg.rope_factors(self.n_ctx)
        factors = None if factor_name is None else w(factor_name)
        tables = {(base, pos_scale): rope_tables(cfg.rope_dim, base, self.n_ctx, factors, cfg.rope_cs_scale,
                                                 cfg.rope_yarn_factor, cfg.rope_original_context, pos_scale)
                  for base, pos_scale in {cfg.layer_rope_table(i) for i in range(cfg.n_layers)}}
        self.rope = [tables[cfg.layer_rope_table(i)] for i in range(cfg.n_layers)]

    def _cached(self, x: np.ndarray) -> np.ndarray:
        """Values as the cache holds them (see kv_type)."""
        if self.kv_type == "f16":
            return x.astype(np.float16).astype(np.float32)
        if self.kv_type == "q8_0":
            from barellm.formats.kv_q8 import q8_0_round_trip

            return q8_0_round_trip(x)
        return x

    def _cached_keys(self, k: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """Keys [T, n_kv_heads, head_dim] as the cache holds them; bias: the K projection's, if the model has one."""
        if self.kv_type == "q8_0":
            from barellm.formats.kv_q8 import q8_0_keys_round_trip

            return q8_0_keys_round_trip(k, None if bias is None else bias.reshape(k.shape[-2:]))
        return self._cached(k)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copies the KV entries of positions 0..n-1 from slot src to slot dst."""
        if not (0 <= src < self.n_slots and 0 <= dst < self.n_slots and 0 <= n <= self.n_ctx):
            raise InvalidRequest(f"copy_prefix: slots {src}, {dst} of {self.n_slots}, {n} positions of {self.n_ctx}")
        self.k_cache[dst, :, :n] = self.k_cache[src, :, :n]
        self.v_cache[dst, :, :n] = self.v_cache[src, :, :n]

    def forward_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]],
                      tails: Sequence[int] | None = None) -> np.ndarray:
        """Runs several sequences (slot, tokens, start); returns each one's last logits [len(seqs), n_vocab],
        or with tails the logits of each one's tails[i] last positions, in order (NativeEngine's contract)."""
        if tails is None:
            return np.concatenate([self.forward(tokens, start, slot=slot) for slot, tokens, start in seqs])
        if len(tails) != len(seqs) or any(not 1 <= int(t) <= len(s[1]) for t, s in zip(tails, seqs, strict=True)):
            raise InvalidRequest("forward_batch: tails needs one count per sequence, each in 1..its length")
        return np.concatenate([self.forward(tokens, start, all_logits=True, slot=slot)[len(tokens) - int(t):]
                               for (slot, tokens, start), t in zip(seqs, tails, strict=True)])

    def forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0) -> np.ndarray:
        """Feeds tokens at positions start.. of a slot (overwriting its cache from there); returns logits.

        The result is [len(tokens), n_vocab] if all_logits, else [1, n_vocab] for the last token.
        """
        x = self._final(tokens, start, slot)
        if not all_logits:
            x = x[-1:]
        return softcap(self.matmul(x, self.output.T), self.cfg.final_softcap)

    def hidden_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]], last_only: bool = False) -> np.ndarray:
        """The final normed hidden states of several sequences (slot, tokens, start): every row in order
        [sum of lengths, dim], or each sequence's last [len(seqs), dim] (NativeEngine.hidden_batch's
        contract)."""
        if not seqs:
            raise InvalidRequest("hidden_batch needs at least one sequence")
        rows = [self._final(tokens, start, slot) for slot, tokens, start in seqs]
        return np.concatenate([r[-1:] for r in rows] if last_only else rows).astype(np.float32, copy=False)

    def _final(self, tokens: Sequence[int], start: int, slot: int) -> np.ndarray:
        """The output norm of the last layer's residual stream, every row: what the logits are made from."""
        cfg = self.cfg
        ids = np.asarray(tokens, dtype=np.int64)
        T = len(ids)
        if T == 0:
            raise InvalidRequest("forward needs at least one token")
        if start < 0 or start + T > self.n_ctx:
            raise InvalidRequest(f"positions {start}..{start + T - 1} do not fit the context of {self.n_ctx}")
        if ids.min() < 0 or ids.max() >= cfg.n_vocab:
            raise InvalidRequest(f"token id out of range 0..{cfg.n_vocab - 1}")
        if not 0 <= slot < self.n_slots:
            raise InvalidRequest(f"slot {slot} out of range 0..{self.n_slots - 1}")
        k_cache, v_cache = self.k_cache[slot], self.v_cache[slot]
        end = start + T
        eps = cfg.norm_eps

        mm = self.matmul
        x = self.token_embd[ids]                                       # [T, dim]
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        for i, L in enumerate(self.layers):
            # attention block
            xn = rmsnorm(x, L.attn_norm, eps)
            q, k, v = mm(xn, L.wq), mm(xn, L.wk), mm(xn, L.wv)
            if L.bq is not None and L.bk is not None and L.bv is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q = q.reshape(T, cfg.n_heads, cfg.head_dim)
            k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
            v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
            if L.q_norm is not None and L.k_norm is not None:
                q, k = rmsnorm(q, L.q_norm, eps), rmsnorm(k, L.k_norm, eps)
            if cfg.layer_rope(i):
                cos, sin = (table[start:end] for table in self.rope[i])
                q, k = rope(q, cos, sin, cfg.rope_style), rope(k, cos, sin, cfg.rope_style)
            k_cache[i, start:end] = self._cached_keys(k, L.bk)
            v_cache[i, start:end] = self._cached(v)
            att = mm(attention(q, k_cache[i, :end], v_cache[i, :end], start, cfg.scale, cfg.layer_window(i),
                               cfg.attn_softcap, L.sinks, mm), L.wo)
            if L.bo is not None:
                att = att + L.bo
            if L.post_attn_norm is not None:
                att = rmsnorm(att, L.post_attn_norm, eps)
            x = x + att
            # feed-forward block (gated: SwiGLU for llama, GELU for gemma; a mixture of such for MoE rows)
            xn = rmsnorm(x, L.ffn_norm, eps)
            if L.experts is not None:
                X = L.experts
                logits = xn @ X.router if X.router_bias is None else xn @ X.router + X.router_bias
                ffn = moe(xn, logits, X.gate, X.up, X.down, cfg.n_experts_used, cfg.expert_weights_norm, cfg.act,
                          X.biases)
            else:
                assert L.w_gate is not None and L.w_up is not None and L.w_down is not None
                ffn = mm(gated(cfg.act, mm(xn, L.w_gate), mm(xn, L.w_up)), L.w_down)
            if L.post_ffn_norm is not None:
                ffn = rmsnorm(ffn, L.post_ffn_norm, eps)
            x = x + ffn

        return rmsnorm(x, self.output_norm, cfg.norm_eps)
