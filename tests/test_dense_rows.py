"""The dense rows beyond llama's switches: phi3 (fused Q|K|V and gate|up matrices, partial RoPE with LongRoPE
factors and attention factor) and smollm3 (every fourth layer without RoPE), against llama.cpp's logits on tiny
files (tests/data/README.md), on both engines and every kernel tier; and each feature shown to matter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine

from conftest import DATA


def _open(name: str):
    gold = np.load(DATA / f"{name}.logits.npz")
    return GGUFFile(DATA / f"{name}.gguf"), gold["ids"].tolist(), gold["logits"]


@pytest.fixture(scope="module", params=["phi3-tiny", "smollm3-tiny"])
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
])
def test_each_feature_matters(name, off):
    """Switching a feature off moves the reference's logits several times further from llama.cpp's."""
    src, ids, want = _open(name)
    cfg = config_of(src)
    with_it = np.abs(reference_engine(cfg, src, 256).forward(ids, 0, all_logits=True) - want).max()
    without = np.abs(reference_engine(dataclasses.replace(cfg, **off), src, 256).forward(ids, 0, all_logits=True)
                     - want).max()
    src.close()
    assert without > 10 * with_it and without > 1e-2
