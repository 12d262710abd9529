"""The dense rows beyond llama's switches: phi3 (fused Q|K|V and gate|up matrices, partial RoPE with LongRoPE
factors and attention factor), smollm3 (every fourth layer without RoPE) and gemma2 (soft-capped attention scores
and logits, alternating sliding windows), against llama.cpp's logits on tiny files (tests/data/README.md), on
both engines and every kernel tier; each feature shown to matter; the soft-capped attention kernel against NumPy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_kernels_attention import attention_reference

from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.errors import FormatError
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine

from conftest import DATA


def _open(name: str):
    gold = np.load(DATA / f"{name}.logits.npz")
    return GGUFFile(DATA / f"{name}.gguf"), gold["ids"].tolist(), gold["logits"]


@pytest.fixture(scope="module", params=["phi3-tiny", "smollm3-tiny", "gemma2-tiny"])
def row(request):
    src, ids, want = _open(request.param)
    yield request.param, src, ids, want
    src.close()


def _report(what: str, got: np.ndarray, want: np.ndarray) -> None:
    agree, err = float(np.mean(got.argmax(1) == want.argmax(1))), float(np.abs(got - want).max())
    print(f"{what}: top-1 {100 * agree:.2f} %, max |dlogit| {err:.2e}")
    assert agree == 1.0 and err <= 1e-2


def test_reference_matches_llamacpp(row):
    name, src, ids, want = row
    _report(f"{name} reference", reference_engine(config_of(src), src, 256).forward(ids, 0, all_logits=True), want)


def test_native_matches_llamacpp(row, isa):
    name, src, ids, want = row
    e = NativeEngine(config_of(src), src, n_ctx=256, threads=2, chunk=32)
    _report(f"{name} native {isa}", e.forward(ids, 0, all_logits=True), want)


def test_native_independent_of_threads_and_chunks(row):
    _, src, ids, _ = row
    cfg = config_of(src)
    one = NativeEngine(cfg, src, n_ctx=256, threads=1, chunk=64).forward(ids, 0, all_logits=True)
    two = NativeEngine(cfg, src, n_ctx=256, threads=2, chunk=5).forward(ids, 0, all_logits=True)
    assert np.array_equal(one, two)


def test_phi3_config():
    src, _, _ = _open("phi3-tiny")
    cfg = config_of(src)
    src.close()
    assert cfg.spec.fused_qkv and cfg.spec.fused_gate_up and cfg.rope_dim == 12 < cfg.head_dim
    assert cfg.rope_factors(256) == "rope_factors_short.weight"   # llama.cpp's choice at its context, 256
    assert cfg.rope_factors(1024) == "rope_factors_long.weight"
    assert abs(cfg.rope_cs_scale - 1.118) < 1e-3


@pytest.mark.parametrize("name, off", [
    ("smollm3-tiny", {"nope_every": 0}),                       # RoPE on every layer
    ("phi3-tiny", {"rope_long": False}),                       # no LongRoPE factors
    ("phi3-tiny", {"rope_cs_scale": 1.0}),                     # no attention factor
    ("gemma2-tiny", {"attn_softcap": 0.0}),                    # raw attention scores
    ("gemma2-tiny", {"final_softcap": 0.0}),                   # raw logits
])
def test_each_feature_matters(name, off):
    """Switching a feature off moves the reference's logits several times further from llama.cpp's."""
    src, ids, want = _open(name)
    cfg = config_of(src)
    with_it = np.abs(reference_engine(cfg, src, 256).forward(ids, 0, all_logits=True) - want).max()
    without = np.abs(reference_engine(dataclasses.replace(cfg, **off), src, 256).forward(ids, 0, all_logits=True)
                     - want).max()
    src.close()
    assert without > 10 * with_it or without > 0.5
    assert without > 1e-2


@pytest.mark.parametrize("cap, sink", [(2.0, None), (0.0, 1.5), (3.0, -0.5)])
@pytest.mark.parametrize("hd, window", [(32, 0), (40, 0), (6, 0), (16, 70)])
def test_capped_attention_vs_numpy(isa, hd, window, cap, sink):
    """Each tier's soft-capped scores and sinks on one f32 kv head, head sizes with and without vector tails,
    queries at tile edges, with and without a window: with s = cap tanh(q k / sqrt(hd) / cap) (q k / sqrt(hd)
    for cap 0), exp(s) v / (sum exp(s) + exp(sink)) in float64 (test_kernels_attention: every cache type, the
    tiers' bits)."""
    from barellm import _native as nat

    tile, n_ctx, S = nat.KV_TILE, 192, 150
    rng = np.random.default_rng(hd)
    K = (rng.standard_normal((S, hd)) * 2).astype(np.float32)
    V = rng.standard_normal((S, hd)).astype(np.float32)
    kc = np.zeros((n_ctx // tile, hd, tile), np.float32)   # the cache's K tiles: [tile][head_dim][key]
    for p in range(S):
        kc[p // tile, :, p % tile] = K[p]
    vc = np.zeros((n_ctx, hd), np.float32)
    vc[:S] = V
    pos = np.array([0, 1, 63, 64, 65, 127, 128, 149], np.int32)
    q = (rng.standard_normal((len(pos), hd)) * 3).astype(np.float32)
    out = np.empty_like(q)
    scale = float(np.float32(1 / np.sqrt(hd)))
    nat.attend(q, pos, kc, vc, out, len(pos), hd, n_ctx, scale, 0, window, cap, -np.inf if sink is None else sink)
    sinks = None if sink is None else np.full(len(pos), sink)
    for i, want in enumerate(attention_reference(q, K, V, pos, window, scale, cap, sinks)):
        assert np.abs(out[i] - want).max() < 1e-5 * max(1.0, np.abs(want).max())


# --- Gemma's attention scale: 1/sqrt(query_pre_attn_scalar), which may differ from 1/sqrt(head_dim) ---------------

GEMMA_DIM, GEMMA_HEADS, GEMMA_KV, GEMMA_HD, GEMMA_FFN, GEMMA_WINDOW = 64, 4, 2, 32, 96, 8   # dim / heads = 16


def write_gemma(path, arch: str, n_layers: int, seed: int = 0, **extra) -> None:
    """A tiny Gemma 2 or Gemma 3 GGUF with random weights, head_dim 32 while dim / heads is 16, llama.cpp's layout
    (norm weights stored as the multiplier, 1 + w), windows of 8 on the local layers; `extra`: more metadata."""
    from gguf_writer import write_gguf

    with GGUFFile(DATA / "gemma2-tiny.gguf") as g:
        md = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
        n_vocab = g.tensors["token_embd.weight"].shape[0]
    md["tokenizer.ggml.token_type"] = np.asarray(md["tokenizer.ggml.token_type"], np.int32)   # as llama.cpp reads it
    p = arch + "."
    md.update({"general.architecture": arch, p + "block_count": n_layers, p + "context_length": 256,
               p + "embedding_length": GEMMA_DIM, p + "feed_forward_length": GEMMA_FFN,
               p + "attention.head_count": GEMMA_HEADS, p + "attention.head_count_kv": GEMMA_KV,
               p + "attention.key_length": GEMMA_HD, p + "attention.value_length": GEMMA_HD,
               p + "attention.layer_norm_rms_epsilon": 1e-6, p + "rope.freq_base": 100000.0,
               p + "attention.sliding_window": GEMMA_WINDOW})
    if arch == "gemma2":
        md.update({p + "attn_logit_softcapping": 8.0, p + "final_logit_softcapping": 30.0})
    md.update({p + k: v for k, v in extra.items()})
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n: int = GEMMA_DIM) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    q_dim, kv_dim = GEMMA_HEADS * GEMMA_HD, GEMMA_KV * GEMMA_HD
    tensors = [("token_embd.weight", mat(n_vocab, GEMMA_DIM, 0.3), 0), ("output_norm.weight", norm(), 0)]
    for i in range(n_layers):
        b = f"blk.{i}."
        D, F = GEMMA_DIM, GEMMA_FFN
        tensors += [(b + "attn_norm.weight", norm(), 0), (b + "attn_q.weight", mat(q_dim, D, 4.0), 0),
                    (b + "attn_k.weight", mat(kv_dim, D, 4.0), 0), (b + "attn_v.weight", mat(kv_dim, D), 0),
                    (b + "attn_output.weight", mat(D, q_dim), 0), (b + "post_attention_norm.weight", norm(), 0),
                    (b + "ffn_norm.weight", norm(), 0), (b + "ffn_gate.weight", mat(F, D), 0),
                    (b + "ffn_up.weight", mat(F, D), 0), (b + "ffn_down.weight", mat(D, F), 0),
                    (b + "post_ffw_norm.weight", norm(), 0)]
        if arch == "gemma3":
            tensors += [(b + "attn_q_norm.weight", norm(GEMMA_HD), 0), (b + "attn_k_norm.weight", norm(GEMMA_HD), 0)]
    write_gguf(path, md, tensors)


def gemma_forward64(src, ids: list[int], scale: float, linear: float | None = None,
                    linear_local: bool = False, local_base: float | None = None) -> np.ndarray:
    """Gemma 2's or Gemma 3's logits for every position in float64, written from Hugging Face's modeling code (not
    from barellm's forward): embeddings times sqrt(dim); per layer RMSNorm (1 + w, stored as the multiplier),
    attention with rotate-half RoPE (Gemma 3: per-head q/k norms first; the local layers' base is the file's
    rope.freq_base_swa (Hugging Face's rope_local_base_freq), else Gemma 3's 10000 or Gemma 2's global one,
    `local_base` overriding it; a linear
    rope_scaling factor divides the global rotary embedding's inv_freq only, as modeling_gemma3's rotary_emb has
    the config's rope_scaling and its rotary_emb_local none: `linear` overrides the file's factor, `linear_local`
    scales the local layers too), scores
    times `scale` (1/sqrt(query_pre_attn_scalar)), Gemma 2's tanh soft-cap, a causal mask and the local layers'
    window (Gemma 2: even layers; Gemma 3: five of every six), post-attention norm, GELU(tanh)-gated MLP, post-MLP
    norm; the final norm, the tied output, Gemma 2's final soft-cap."""
    md = src.metadata
    arch = md["general.architecture"]
    p = arch + "."

    def w(name: str) -> np.ndarray:
        return src.dequantize(name).astype(np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + md[p + "attention.layer_norm_rms_epsilon"]) * g

    if linear is None:
        linear = md.get(p + "rope.scaling.factor", 1.0) if md.get(p + "rope.scaling.type") == "linear" else 1.0
    if local_base is None:
        local_base = md.get(p + "rope.freq_base_swa", 10000.0 if arch == "gemma3" else md[p + "rope.freq_base"])

    def rope(x: np.ndarray, base: float, factor: float) -> np.ndarray:   # x [T, heads, hd]
        half = x.shape[-1] // 2
        inv_freq = 1.0 / base ** (np.arange(0, x.shape[-1], 2) / x.shape[-1]) / factor
        ang = np.arange(len(ids))[:, None] * inv_freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)

    n_layers, heads, kv = md[p + "block_count"], md[p + "attention.head_count"], md[p + "attention.head_count_kv"]
    hd, window = md[p + "attention.key_length"], md[p + "attention.sliding_window"]
    cap, final_cap = md.get(p + "attn_logit_softcapping", 0.0), md.get(p + "final_logit_softcapping", 0.0)
    emb = w("token_embd.weight")
    T = len(ids)
    x = emb[ids] * np.sqrt(emb.shape[1])
    pos = np.arange(T)
    for i in range(n_layers):
        b = f"blk.{i}."
        local = i % 2 == 0 if arch == "gemma2" else i % 6 != 5
        h = rms(x, w(b + "attn_norm.weight"))
        q = (h @ w(b + "attn_q.weight").T).reshape(T, heads, hd)
        k = (h @ w(b + "attn_k.weight").T).reshape(T, kv, hd)
        v = (h @ w(b + "attn_v.weight").T).reshape(T, kv, hd)
        if arch == "gemma3":
            q, k = rms(q, w(b + "attn_q_norm.weight")), rms(k, w(b + "attn_k_norm.weight"))
        base = local_base if local else md[p + "rope.freq_base"]
        factor = linear if not local or linear_local else 1.0
        q, k = rope(q, base, factor), rope(k, base, factor)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) * scale
        if cap:
            s = cap * np.tanh(s / cap)
        hidden = pos[None, :] > pos[:, None]
        if local:
            hidden |= pos[:, None] - pos[None, :] >= window
        s[:, hidden] = -np.inf
        e = np.exp(s - s.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", e / e.sum(-1, keepdims=True), v).reshape(T, heads * hd)
        x = x + rms(att @ w(b + "attn_output.weight").T, w(b + "post_attention_norm.weight"))
        h = rms(x, w(b + "ffn_norm.weight"))
        g = h @ w(b + "ffn_gate.weight").T
        g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
        x = x + rms((g * (h @ w(b + "ffn_up.weight").T)) @ w(b + "ffn_down.weight").T, w(b + "post_ffw_norm.weight"))
    logits = rms(x, w("output_norm.weight")) @ emb.T
    return final_cap * np.tanh(logits / final_cap) if final_cap else logits


GEMMA_IDS = [(7 * i + 3) % 300 for i in range(24)]   # 24 positions: three windows of 8


def assert_gemma_logits(src, cfg, scalar: float) -> None:
    """Both engines give the float64 forward's logits at 1/sqrt(scalar), and those at 1/sqrt(head_dim) are far off
    (the scale matters)."""
    want = gemma_forward64(src, GEMMA_IDS, 1 / np.sqrt(scalar))
    ref = reference_engine(cfg, src, 64).forward(GEMMA_IDS, 0, all_logits=True)
    nat = NativeEngine(cfg, src, n_ctx=64, threads=2, chunk=7, kv_type="f32").forward(GEMMA_IDS, 0, all_logits=True)
    tol = 1e-3 * np.abs(want).max()   # float32 through up to 62 layers
    assert np.abs(ref - want).max() < tol and np.abs(nat - want).max() < tol
    assert np.array_equal(ref.argmax(1), want.argmax(1))
    if scalar != GEMMA_HD:
        assert np.abs(gemma_forward64(src, GEMMA_IDS, 1 / np.sqrt(GEMMA_HD)) - want).max() > 50 * tol


@pytest.mark.parametrize("arch, layers_27b", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_gguf_scales_by_dim_over_heads(tmp_path, arch, layers_27b):
    """llama.cpp's rule for a GGUF (which carries no query_pre_attn_scalar): the 27B, known by its layer count, scales
    the scores by 1/sqrt(dim / heads) (Gemma 2 27B: 144; Gemma 3 27B: 168), any other size by 1/sqrt(head_dim)."""
    write_gemma(tmp_path / "27b.gguf", arch, layers_27b)
    with GGUFFile(tmp_path / "27b.gguf") as src:
        cfg = config_of(src)
        assert cfg.scale == 1 / np.sqrt(GEMMA_DIM // GEMMA_HEADS) and cfg.head_dim == GEMMA_HD
        assert_gemma_logits(src, cfg, GEMMA_DIM // GEMMA_HEADS)
    write_gemma(tmp_path / "other.gguf", arch, layers_27b - 1)
    with GGUFFile(tmp_path / "other.gguf") as src:
        assert config_of(src).scale == 1 / np.sqrt(GEMMA_HD)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_attention_scale_key(tmp_path, arch):
    """A file with attention.scale (what a converted checkpoint's query_pre_attn_scalar becomes) is scaled by it,
    whatever its layer count; a scale out of range is refused."""
    write_gemma(tmp_path / "m.gguf", arch, 3, **{"attention.scale": float(1 / np.sqrt(24.0))})
    with GGUFFile(tmp_path / "m.gguf") as src:
        cfg = config_of(src)
        assert cfg.scale == np.float32(1 / np.sqrt(24.0))
        assert_gemma_logits(src, cfg, 24.0)
        e = NativeEngine(cfg, src, n_ctx=64, threads=2, kv_type="f32")   # the per-op debugger scales alike
        want = e.forward(GEMMA_IDS, 0, all_logits=True)
        assert np.abs(e.debug_forward(GEMMA_IDS, 0, all_logits=True, backend="numpy") - want).max() < 1e-4
    write_gemma(tmp_path / "bad.gguf", arch, 2, **{"attention.scale": -1.0})
    with GGUFFile(tmp_path / "bad.gguf") as src, pytest.raises(FormatError, match="attention.scale -1.0 is out of"):
        config_of(src)


# --- Linear RoPE scaling: Gemma 3 4B/12B/27B (factor 8 on the global layers only), linear-scaled llama files -------

LINEAR_IDS = [(11 * i + 5) % 300 for i in range(112)]   # positions up to 111: well past where a 1/8 step shows
GEMMA3_LINEAR = {"rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}


@pytest.fixture(scope="module")
def gemma3_linear(tmp_path_factory):
    """A tiny Gemma 3 file as the 4B/12B/27B store their RoPE: global base 1e6, linear factor 8; 8 layers (local
    0-4, global 5, local 6-7); with the float64 forward's logits."""
    path = tmp_path_factory.mktemp("linear") / "gemma3-linear.gguf"
    write_gemma(path, "gemma3", 8, seed=3, **GEMMA3_LINEAR)
    with GGUFFile(path) as src:
        yield src, gemma_forward64(src, LINEAR_IDS, 1 / np.sqrt(GEMMA_HD))


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()
    assert np.array_equal(got.argmax(1), want.argmax(1))


def test_gemma3_linear_config(gemma3_linear):
    """Factor 8 slows the global layers' positions only (llama.cpp: the sliding-window layers keep base 10000 and
    scale 1): two RoPE tables, (10000, 1) and (1e6, 1/8)."""
    cfg = config_of(gemma3_linear[0])
    assert cfg.rope_linear == 8.0
    assert [cfg.layer_rope_table(i) for i in range(cfg.n_layers)] == [(10000.0, 1.0)] * 5 + [(1e6, 0.125)] + [
        (10000.0, 1.0)] * 2


def test_gemma3_linear_reference(gemma3_linear):
    src, want = gemma3_linear
    _close(reference_engine(config_of(src), src, 128).forward(LINEAR_IDS, 0, all_logits=True), want)


def test_gemma3_linear_native(gemma3_linear, isa):
    """Each tier, in chunks that cross tables' fills, with the per-op debugger's NumPy ops reading the same tables."""
    src, want = gemma3_linear
    e = NativeEngine(config_of(src), src, n_ctx=128, threads=2, chunk=40, kv_type="f32")
    got = e.forward(LINEAR_IDS, 0, all_logits=True)
    _close(got, want)
    assert np.abs(e.debug_forward(LINEAR_IDS, 0, all_logits=True, backend="numpy") - got).max() < 1e-4


def test_gemma3_linear_independent_of_threads_and_chunks(gemma3_linear):
    src, _ = gemma3_linear
    cfg = config_of(src)
    one = NativeEngine(cfg, src, n_ctx=128, threads=1, chunk=64).forward(LINEAR_IDS, 0, all_logits=True)
    two = NativeEngine(cfg, src, n_ctx=128, threads=2, chunk=5).forward(LINEAR_IDS, 0, all_logits=True)
    assert np.array_equal(one, two)


@pytest.mark.parametrize("linear, local", [(1.0, False), (8.0, True)])
def test_gemma3_linear_scaling_and_its_layers_matter(gemma3_linear, linear, local):
    """Without the scaling, or with it on the local layers too, the float64 forward is far from the scaled one."""
    src, want = gemma3_linear
    other = gemma_forward64(src, LINEAR_IDS, 1 / np.sqrt(GEMMA_HD), linear=linear, linear_local=local)
    assert np.abs(other - want).max() > 50 * 1e-3 * np.abs(want).max()


def llama_forward64(src, ids: list[int]) -> np.ndarray:
    """A llama GGUF's logits for every position in float64, written from llama.cpp's graph (not barellm's forward):
    RMSNorm, RoPE on adjacent pairs (the layout GGUF stores llama's Q and K in) at positions times 1 / the linear
    factor (ggml's freq_scale), grouped-query causal attention, SwiGLU MLP, the separate output matrix."""
    md = src.metadata
    eps, base = md["llama.attention.layer_norm_rms_epsilon"], md["llama.rope.freq_base"]
    heads, kv = md["llama.attention.head_count"], md["llama.attention.head_count_kv"]
    hd = md["llama.attention.key_length"]
    factor = md.get("llama.rope.scaling.factor", md.get("llama.rope.scale_linear", 1.0))

    def w(name: str) -> np.ndarray:
        return src.dequantize(name).astype(np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g

    T = len(ids)
    theta = (np.arange(T) / factor)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:
        out = x.copy()
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    x = w("token_embd.weight")[ids]
    for i in range(md["llama.block_count"]):
        b = f"blk.{i}."
        h = rms(x, w(b + "attn_norm.weight"))
        q = rope((h @ w(b + "attn_q.weight").T).reshape(T, heads, hd))
        k = rope((h @ w(b + "attn_k.weight").T).reshape(T, kv, hd))
        v = (h @ w(b + "attn_v.weight").T).reshape(T, kv, hd)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        sc = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        sc[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
        e = np.exp(sc - sc.max(-1, keepdims=True))
        att = np.einsum("hts,shd->thd", e / e.sum(-1, keepdims=True), v).reshape(T, heads * hd)
        x = x + att @ w(b + "attn_output.weight").T
        h = rms(x, w(b + "ffn_norm.weight"))
        g = h @ w(b + "ffn_gate.weight").T
        x = x + (g / (1 + np.exp(-g)) * (h @ w(b + "ffn_up.weight").T)) @ w(b + "ffn_down.weight").T
    return rms(x, w("output_norm.weight")) @ w("output.weight").T


def write_llama_linear(path, **scaling) -> None:
    """llama3rope-tiny's weights without its rope_freqs factors, with `scaling` as llama.* metadata."""
    from gguf_writer import write_gguf

    with GGUFFile(DATA / "llama3rope-tiny.gguf") as g:
        md = {k: v for k, v in g.metadata.items() if k != "general.alignment"}
        tensors = [(n, g.dequantize(n), 0) for n in g.tensors if n != "rope_freqs.weight"]
    md.update({"llama." + k: v for k, v in scaling.items()})
    write_gguf(path, md, tensors)


@pytest.mark.parametrize("scaling", [
    {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
    {"rope.scale_linear": 4.0},   # the older key, with llama.cpp's default type (linear)
])
def test_llama_linear_scaling(tmp_path, scaling, isa):
    """Every layer of a linear-scaled llama file rotates at positions / factor: both engines on each tier against
    the float64 forward, which the unscaled one is far from."""
    write_llama_linear(tmp_path / "m.gguf", **scaling)
    with GGUFFile(tmp_path / "m.gguf") as src:
        cfg = config_of(src)
        assert cfg.rope_linear == 4.0 and {cfg.layer_rope_scale(i) for i in range(cfg.n_layers)} == {0.25}
        want = llama_forward64(src, LINEAR_IDS)
        _close(reference_engine(cfg, src, 128).forward(LINEAR_IDS, 0, all_logits=True), want)
        _close(NativeEngine(cfg, src, n_ctx=128, threads=2, chunk=48).forward(LINEAR_IDS, 0, all_logits=True), want)
        unscaled = reference_engine(dataclasses.replace(cfg, rope_linear=1.0), src, 128)
        assert np.abs(unscaled.forward(LINEAR_IDS, 0, all_logits=True) - want).max() > 50 * 1e-3 * np.abs(want).max()


def test_linear_scaling_type_none_ignores_the_factor(tmp_path):
    write_llama_linear(tmp_path / "m.gguf", **{"rope.scaling.type": "none", "rope.scaling.factor": 4.0})
    with GGUFFile(tmp_path / "m.gguf") as src:
        assert config_of(src).rope_linear == 1.0


@pytest.mark.parametrize("factor", [0.5, 0.0, -8.0, 2048.0])
def test_linear_factor_out_of_range_refused(tmp_path, factor):
    write_gemma(tmp_path / "bad.gguf", "gemma3", 2, **{**GEMMA3_LINEAR, "rope.scaling.factor": factor})
    message = rf"linear RoPE scaling: gemma3\.rope\.scaling\.factor {factor} is out of range \(1\.\.1024\)"
    with GGUFFile(tmp_path / "bad.gguf") as src, pytest.raises(FormatError, match=message):
        config_of(src)


# llama.cpp's own figures for a linear-scaled Gemma 3 (tests/data/README.md): its log-probabilities at positions 64
# to 126 of 128 ids, for the file write_gemma makes with these arguments (its sha256 stored beside them)
LLAMACPP_LINEAR = {"arch": "gemma3", "n_layers": 6, "seed": 11, **GEMMA3_LINEAR}


@pytest.fixture(scope="module")
def llamacpp_linear(tmp_path_factory):
    import hashlib

    gold = np.load(DATA / "gemma3-linear-tiny.logprobs.npz")
    path = tmp_path_factory.mktemp("llamacpp") / "gemma3-linear-tiny.gguf"
    write_gemma(path, **LLAMACPP_LINEAR)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(gold["gguf_sha256"]), \
        "write_gemma no longer writes the file llama.cpp's figures are of"
    with GGUFFile(path) as src:
        yield src, gold["ids"].tolist(), gold["positions"], gold["logprobs"]


def _llamacpp_error(logits: np.ndarray, positions: np.ndarray, want: np.ndarray, top1: bool = True) -> float:
    """Largest |log-probability difference| from llama.cpp's over the entries it stored (it floors the row's
    minimum); with top1, the top-1 is asserted identical at every position."""
    x = logits.astype(np.float64)[positions]
    m = x.max(1, keepdims=True)
    got = x - m - np.log(np.exp(x - m).sum(1, keepdims=True))
    assert not top1 or np.array_equal(got.argmax(1), want.argmax(1))
    return float(np.abs(got - want)[np.isfinite(want)].max())


def test_gemma3_linear_reference_matches_llamacpp(llamacpp_linear):
    """llama.cpp's GELU reads an F16 table, hence ~7e-4 (the float64 forward is as far); without the scaling the
    reference is over 50 times further."""
    src, ids, positions, want = llamacpp_linear
    cfg = config_of(src)
    err = _llamacpp_error(reference_engine(cfg, src, 128).forward(ids, 0, all_logits=True), positions, want)
    assert err < 2e-3
    assert _llamacpp_error(gemma_forward64(src, ids, 1 / np.sqrt(GEMMA_HD)), positions, want) < 2e-3
    unscaled = reference_engine(dataclasses.replace(cfg, rope_linear=1.0), src, 128).forward(ids, 0, all_logits=True)
    assert _llamacpp_error(unscaled, positions, want, top1=False) > 50 * err


def test_gemma3_linear_native_matches_llamacpp(llamacpp_linear, isa):
    src, ids, positions, want = llamacpp_linear
    for kv_type in ("f32", "f16"):
        e = NativeEngine(config_of(src), src, n_ctx=128, threads=2, chunk=48, kv_type=kv_type)
        assert _llamacpp_error(e.forward(ids, 0, all_logits=True), positions, want) < 5e-3


# --- The sliding-window layers' RoPE base: rope.freq_base_swa (llama.cpp reads it for gemma3, gemma2, gpt-oss) -----


@pytest.mark.parametrize("arch, default", [("gemma3", 10000.0), ("gemma2", 100000.0)])
def test_local_rope_base_key(tmp_path, arch, default, isa):
    """A file's rope.freq_base_swa is its local layers' RoPE base (without it: Gemma 3's 10000, Gemma 2's global
    base, as llama.cpp has them): both engines on each tier and the per-op debugger give the float64 forward's
    logits with that base, which the default base's are far from."""
    write_gemma(tmp_path / "m.gguf", arch, 6, seed=7, **{"rope.freq_base_swa": 500.0})
    with GGUFFile(tmp_path / "m.gguf") as src:
        cfg = config_of(src)
        local = [i for i in range(cfg.n_layers) if cfg.is_local(i)]
        assert local and {cfg.layer_rope_theta(i) for i in local} == {500.0}
        assert {cfg.layer_rope_theta(i) for i in range(cfg.n_layers) if i not in local} == {100000.0}
        want = gemma_forward64(src, GEMMA_IDS, 1 / np.sqrt(GEMMA_HD))
        ref = reference_engine(cfg, src, 64).forward(GEMMA_IDS, 0, all_logits=True)
        e = NativeEngine(cfg, src, n_ctx=64, threads=2, chunk=7, kv_type="f32")
        nat = e.forward(GEMMA_IDS, 0, all_logits=True)
        tol = 1e-3 * np.abs(want).max()
        assert np.abs(ref - want).max() < tol and np.abs(nat - want).max() < tol
        assert np.array_equal(ref.argmax(1), want.argmax(1)) and np.array_equal(nat.argmax(1), want.argmax(1))
        assert np.abs(e.debug_forward(GEMMA_IDS, 0, all_logits=True, backend="numpy") - nat).max() < 1e-4
        other = gemma_forward64(src, GEMMA_IDS, 1 / np.sqrt(GEMMA_HD), local_base=default)
        assert np.abs(other - want).max() > 50 * tol
    write_gemma(tmp_path / "plain.gguf", arch, 6, seed=7)
    with GGUFFile(tmp_path / "plain.gguf") as src:
        cfg = config_of(src)
        assert {cfg.layer_rope_theta(i) for i in range(cfg.n_layers) if cfg.is_local(i)} == {default}
        plain = reference_engine(cfg, src, 64).forward(GEMMA_IDS, 0, all_logits=True)
        assert np.abs(plain - ref).max() > 50 * tol   # the same weights with the default local base


@pytest.mark.parametrize("base", [0.0, -10000.0, 1.0, float("inf"), float("nan")])
def test_local_rope_base_out_of_range_refused(tmp_path, base):
    write_gemma(tmp_path / "bad.gguf", "gemma3", 6, **{"rope.freq_base_swa": base})
    message = r"rope\.freq_base_swa .* is out of range \(a finite RoPE base above 1\)"
    with GGUFFile(tmp_path / "bad.gguf") as src, pytest.raises(FormatError, match=message):
        config_of(src)


@pytest.mark.parametrize("name, local_base", [("gpt-oss-tiny", 500.0), ("gpt-oss-tiny", None),
                                              ("qwen3moe-tiny", 500.0)])
def test_local_rope_base_of_other_architectures(name, local_base):
    """gpt-oss's local layers take rope.freq_base_swa too (without it, the global base, as llama.cpp's openai-moe);
    an architecture without sliding-window layers has no use for the key (llama.cpp does not read it there)."""
    from barellm.arch.config import config_from_metadata

    with GGUFFile(DATA / f"{name}.gguf") as src:
        md = dict(src.metadata)
        n_vocab, tied = src.tensors["token_embd.weight"].shape[0], "output.weight" not in src.tensors
    p = md["general.architecture"] + "."
    if local_base is not None:
        md[p + "rope.freq_base_swa"] = local_base
    cfg = config_from_metadata(md, n_vocab, tied)
    local = [i for i in range(cfg.n_layers) if cfg.is_local(i)]
    assert bool(local) == (name == "gpt-oss-tiny")
    assert {cfg.layer_rope_theta(i) for i in local} == ({local_base or cfg.rope_theta} if local else set())
    assert {cfg.layer_rope_theta(i) for i in range(cfg.n_layers) if i not in local} == {cfg.rope_theta}
