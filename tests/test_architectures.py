"""The architecture registry: every row runs on both engines, and what no row covers is refused early."""

from __future__ import annotations

import numpy as np
import pytest

from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.arch.registry import ARCHITECTURES, architecture
from barellm.errors import FormatError
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine
from barellm.store.convert import convert

from conftest import DATA
from gguf_writer import write_gguf


@pytest.fixture(params=["qwen3-tiny", "llama3rope-tiny"])
def synthetic(request):
    src = GGUFFile(DATA / f"{request.param}.gguf")
    gold = np.load(DATA / f"{request.param}.logits.npz")
    yield request.param, src, gold["ids"].tolist(), gold["logits"]
    src.close()


@pytest.mark.parametrize("engine", ["reference", "native"])
def test_synthetic_rows_match_llamacpp(synthetic, engine):
    """qwen3 (per-head q/k norm, head size decoupled from dim / heads) and Llama 3.1's RoPE scaling on tiny
    files, against llama.cpp's logits for the same ids: within 1e-2, top-1 identical at every position."""
    name, src, ids, want = synthetic
    cfg = config_of(src)
    if name == "qwen3-tiny":
        assert cfg.arch == "qwen3" and cfg.qk_norm and cfg.rope_style == "neox" and cfg.q_dim != cfg.dim
    else:
        assert cfg.arch == "llama" and cfg.rope_freqs and not cfg.tied_output
    e = reference_engine(cfg, src, 256) if engine == "reference" else NativeEngine(cfg, src, n_ctx=256, threads=2)
    got = e.forward(ids, 0, all_logits=True)
    assert np.abs(got - want).max() < 1e-2
    assert np.array_equal(got.argmax(1), want.argmax(1))


def test_rope_factors_matter():
    """The rope_freqs factors are really applied: without them the llama3rope logits part from llama.cpp's
    several times further than with them."""
    src = GGUFFile(DATA / "llama3rope-tiny.gguf")
    gold = np.load(DATA / "llama3rope-tiny.logits.npz")
    ids, want = gold["ids"].tolist(), gold["logits"]
    import dataclasses

    cfg = config_of(src)
    with_factors = np.abs(reference_engine(cfg, src, 256).forward(ids, 0, all_logits=True) - want).max()
    cfg = dataclasses.replace(cfg, rope_freqs=False)
    without = np.abs(reference_engine(cfg, src, 256).forward(ids, 0, all_logits=True) - want).max()
    assert without > 4 * with_factors


def test_every_row_names_its_tensors():
    for row in ARCHITECTURES.values():
        names = row.layer_tensors
        assert ("attn_qkv.weight" in names) == row.fused_qkv and ("attn_q.weight" in names) != row.fused_qkv
        assert ("ffn_down_exps.weight" in names) == row.moe and ("ffn_down.weight" in names) != row.moe
        assert ("attn_q.bias" in names) == row.attn_bias
        assert ("attn_q_norm.weight" in names) == row.qk_norm


def test_unknown_architecture_refused_by_name():
    with pytest.raises(FormatError, match=r"architecture 'falcon' is not supported \(supported: llama, gemma3, qwen2"):
        architecture("falcon")


def _falcon(tmp_path):
    """qwen3-tiny's file under an architecture no row covers."""
    src = GGUFFile(DATA / "qwen3-tiny.gguf")
    md = {k: v for k, v in src.metadata.items() if k != "general.alignment"}
    md = {k.replace("qwen3.", "falcon."): v for k, v in md.items()}
    md["general.architecture"] = "falcon"
    tensors = [(n, src.dequantize(n), 0) for n in src.tensors]
    src.close()
    bad = tmp_path / "falcon.gguf"
    write_gguf(bad, md, tensors)
    return bad


def test_unsupported_file_refused_before_conversion(tmp_path):
    """A GGUF whose architecture no row covers is refused before a .blm is written: nothing is left behind."""
    bad = _falcon(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FormatError, match="architecture 'falcon' is not supported"):
        convert(bad, out / "x.blm")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_run_refuses_an_unsupported_architecture_by_name(tmp_path, capsys, monkeypatch, engine):
    """`barellm run FILE.gguf` of an architecture no row covers: one error line naming it and every supported one,
    exit status 1, no traceback."""
    from barellm.__main__ import main

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path / "home"))
    bad = _falcon(tmp_path)
    assert main(["run", str(bad), "hello", "-n", "2", "--engine", engine]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: architecture 'falcon' is not supported (supported: "
                                        f"{', '.join(ARCHITECTURES)})"]


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen3moe-q8_0-tiny", "phi3-tiny", "smollm3-tiny", "gemma2-tiny",
                                  "gpt-oss-tiny", "gpt-oss-mxfp4-tiny"])
def test_new_rows_run_by_path(name, capsys, monkeypatch, tmp_path):
    """`barellm run FILE.gguf` on the newer rows: the native engine's greedy continuation is the reference's."""
    from barellm.__main__ import main

    monkeypatch.setenv("BARELLM_HOME", str(tmp_path))
    outs = []
    for engine in ("native", "reference"):
        argv = ["run", str(DATA / f"{name}.gguf"), "hello", "-n", "6", "--temperature", "0", "-t", "2"]
        assert main([*argv, "--engine", engine]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0].startswith("hello") and len(outs[0]) > len("hello\n")
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["qwen3moe-q8_0-tiny", "phi3-tiny", "smollm3-tiny", "gemma2-tiny", "gpt-oss-tiny"])
def test_new_rows_op_by_op(name):
    """The per-op debugger on the newer rows: the plan run one op at a time natively gives forward()'s bits, and
    by the ops' NumPy implementations the same logits but for float rounding."""
    src = GGUFFile(DATA / f"{name}.gguf")
    e = NativeEngine(config_of(src), src, n_ctx=64, threads=2, kv_type="f32")
    ids = list(range(20, 40))
    want = e.forward(ids, 0, all_logits=True)
    assert np.array_equal(e.debug_forward(ids, 0, all_logits=True), want)
    assert np.abs(e.debug_forward(ids, 0, all_logits=True, backend="numpy") - want).max() < 1e-3
    src.close()
