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
