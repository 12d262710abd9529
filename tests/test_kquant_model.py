"""A tiny model whose weights are K-quants (Q3_K, Q4_K, Q5_K, Q6_K) run end to end: the native engine against
the NumPy reference, from the GGUF file and from its .blm in the kernels' layout (the same bits, every weight
used in place from the mapping: no copy, no repacking); and Gemma's cached .blm stores its K-quants so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from barellm.arch.config import config_from_metadata
from barellm.formats import kernels, quant
from barellm.formats.blm import LAYOUT_INTERLEAVE8, LAYOUT_ROWS, BLMFile
from barellm.formats.gguf import GGUFFile
from barellm.store.convert import FUSED_GROUPS, convert

from gguf_writer import write_gguf
from tiny_model import tiny_llama_metadata

engine = pytest.importorskip("barellm.runtime.engine", reason="native engine not built")

Q8_0, Q3_K, Q4_K, Q5_K, Q6_K = 8, 11, 12, 13, 14
IDS = [5, 80, 81, 82, 40, 200, 7, 7, 150, 99, 13, 250]


def _f16(v) -> np.ndarray:
    return np.asarray(v, "<f2").view(np.uint8).reshape(-1, 2)


def k_blocks(type_id: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF rows of random K-quant blocks (every bit of the quants and scales random) with small f16 scales."""
    t = quant.TYPES[type_id]
    nu = rows * cols // t.block_size
    b = rng.integers(0, 256, (nu, t.block_bytes), dtype=np.uint8)
    if type_id == Q3_K:
        b[:, 108:110] = _f16(rng.uniform(0.5, 1.5, nu) * 1e-3)
    elif type_id == Q4_K:
        b[:, 0:2] = _f16(rng.uniform(0.5, 1.5, nu) * 1e-3)
        b[:, 2:4] = _f16(rng.uniform(0.5, 1.5, nu) * 2e-3)
    elif type_id == Q6_K:
        b[:, 208:210] = _f16(rng.uniform(-1, 1, nu) * 4e-4)
    return b.reshape(-1)


def write_kquant_llama(path: Path, seed: int = 0) -> Path:
    """Q|K in Q5_K (encoded by barellm.formats.quant), V, gate and up in Q3_K, the attention output in Q4_K, down in
    Q6_K, and a tied Q5_K embedding (the output matmul reads it too): Gemma's mix of fused and unfused groups."""
    md, n_vocab = tiny_llama_metadata(n_layers=2, dim=256, ffn=512, heads=4, kv_heads=2)
    dim, ffn, hd = 256, 512, 64
    rng = np.random.default_rng(seed)

    def enc(name: str, rows: int, cols: int, scale: float) -> tuple:
        return (name, (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32), Q5_K)

    def raw(name: str, type_id: int, rows: int, cols: int) -> tuple:
        return (name, k_blocks(type_id, rows, cols, rng), type_id, (rows, cols))

    def norm(name: str) -> tuple:
        return (name, (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32), 0)

    tensors = [enc("token_embd.weight", n_vocab, dim, 4.0), norm("output_norm.weight")]
    for i in range(2):
        b = f"blk.{i}."
        tensors += [norm(b + "attn_norm.weight"), enc(b + "attn_q.weight", 4 * hd, dim, 2.0),
                    raw(b + "attn_output.weight", Q4_K, dim, 4 * hd), enc(b + "attn_k.weight", 2 * hd, dim, 2.0),
                    raw(b + "attn_v.weight", Q3_K, 2 * hd, dim), norm(b + "ffn_norm.weight"),
                    raw(b + "ffn_up.weight", Q3_K, ffn, dim), raw(b + "ffn_down.weight", Q6_K, dim, ffn),
                    raw(b + "ffn_gate.weight", Q3_K, ffn, dim)]
    write_gguf(path, md, tensors)
    return path


@pytest.fixture(scope="module")
def kq_gguf(tmp_path_factory):
    return write_kquant_llama(tmp_path_factory.mktemp("kq") / "kq.gguf")


def _cfg(src):
    return config_from_metadata(src.metadata, src.tensors["token_embd.weight"].shape[0],
                                "output.weight" not in src.tensors)


def test_kquant_model_native_matches_the_reference(kq_gguf):
    from barellm.arch.llama import ReferenceEngine

    with GGUFFile(kq_gguf) as g:
        cfg = _cfg(g)
        ref = ReferenceEngine(cfg, g, n_ctx=64).forward(IDS, 0, all_logits=True)
        got = engine.NativeEngine(cfg, g, n_ctx=64, threads=2).forward(IDS, 0, all_logits=True)
        one = engine.NativeEngine(cfg, g, n_ctx=64, threads=1, chunk=5).forward(IDS, 0, all_logits=True)
    assert np.array_equal(got, one)  # threads and chunking change no bit
    # 8-bit activations are the one intended difference (K-quant kernels take q8 only): the same thresholds
    # as SmolLM2's with q8 activations (test_engine.py::test_parity_with_reference)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    kl = (np.exp(log_softmax(ref)) * (log_softmax(ref) - log_softmax(got))).sum(-1)
    assert kl.mean() < 0.01 and kl.max() < 0.1, kl


def _mapping_view(data: np.ndarray, f: BLMFile) -> bool:
    """Whether data is memory of the file's mapping (a view, no copy)."""
    whole = f.span(list(f.tensors)[:1])
    base = whole
    while getattr(base, "base", None) is not None and isinstance(base.base, np.ndarray):
        base = base.base
    return not data.flags.writeable and np.shares_memory(data, base)


def test_kquant_blm_is_used_in_place_with_the_same_bits(kq_gguf, tmp_path):
    with GGUFFile(kq_gguf) as g:
        want = engine.NativeEngine(_cfg(g), g, n_ctx=64, threads=2).forward(IDS, 0, all_logits=True)
    out = convert(kq_gguf, tmp_path / "k.blm", layout="kernels")
    with BLMFile(out) as f:
        layouts = {n: t.layout for n, t in f.tensors.items()}
        assert layouts["token_embd.weight"] == LAYOUT_INTERLEAVE8  # tied: the output matmul's layout
        assert all(layouts[f"blk.0.{n}.weight"] == LAYOUT_INTERLEAVE8
                   for g in FUSED_GROUPS for n in g) and layouts["blk.1.ffn_down.weight"] == LAYOUT_INTERLEAVE8
        assert layouts["output_norm.weight"] == LAYOUT_ROWS
        # fused groups lie back to back: Q|K (both Q5_K) and gate|up (both Q3_K) are one matrix in the file
        assert f.span(["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"]) is not None
        assert f.span(["blk.1.ffn_gate.weight", "blk.1.ffn_up.weight"]) is not None
        e = engine.NativeEngine(_cfg(f), f, n_ctx=64, threads=2)
        assert np.array_equal(e.forward(IDS, 0, all_logits=True), want)
        for names, parts in e.weights.matrices.items():
            for type_id, layout, _rows, _cols, data in parts:
                assert type_id in (Q3_K, Q4_K, Q5_K, Q6_K) and layout == LAYOUT_INTERLEAVE8, names
                assert _mapping_view(data, f), names  # neither copied nor repacked
        qk = e.weights.matrix(("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"))
        assert [p[2] for p in qk] == [384, 128]  # Q|K fused in place, V (another type) on its own
        table = e.weights.table("token_embd.weight")
        assert table[1] == LAYOUT_INTERLEAVE8 and _mapping_view(table[4], f)  # lookups read the packed rows
        assert not e.weights.dequantized  # no float copy of anything
        # the reference engine reads the same file (layouts undone, rows in GGUF order)
        from barellm.arch.llama import ReferenceEngine

        ref = ReferenceEngine(_cfg(f), f, n_ctx=64).forward(IDS, 0, all_logits=True)
        with GGUFFile(kq_gguf) as g:
            assert np.array_equal(ref, ReferenceEngine(_cfg(g), g, n_ctx=64).forward(IDS, 0, all_logits=True))
        del e, qk, table


def test_kquant_layouts_round_trip_through_the_file(kq_gguf, tmp_path):
    """Every tensor read back as rows from the kernels' layout is the GGUF's bytes, and checksums verify."""
    from barellm.formats.blm import verify

    out = convert(kq_gguf, tmp_path / "k.blm", layout="kernels")
    verify(out)
    with GGUFFile(kq_gguf) as g, BLMFile(out) as f:
        for name in g.tensors:
            assert np.array_equal(f.rows(name), g.raw(name)), name


@pytest.mark.parametrize("name,type_id", [("q5_k", Q5_K), ("q3_k", Q3_K)])
def test_convert_writes_k_quants(tmp_path, name, type_id):
    """--type q5_k / q3_k: every matrix whose rows are whole super-blocks in that type, the rest f16 (llama.cpp's
    rule), each within the codec's bound; the native engine runs the result."""
    from tiny_model import write_tiny_llama

    src = write_tiny_llama(tmp_path / "t.gguf", dim=256, ffn=512, heads=4, kv_heads=2)
    out = convert(src, tmp_path / "k.blm", type=name, layout="kernels")
    with GGUFFile(src) as g, BLMFile(out) as f:
        for name, info in f.tensors.items():
            if len(info.shape) == 2:
                assert info.type == (type_id if info.shape[1] % 256 == 0 else 1), name
                x = g.dequantize(name)
                bound = quant.TYPES[info.type].max_error(x.reshape(-1, quant.TYPES[info.type].block_size))
                err = np.abs(f.dequantize(name) - x).reshape(bound.size, -1).max(-1)
                assert (err <= bound).all(), name
        e = engine.NativeEngine(_cfg(f), f, n_ctx=64, threads=1)
        assert np.isfinite(e.forward(IDS, 0)).all()


@pytest.mark.model
def test_gemma_cache_stores_k_quants_repacked_and_loads_without_copies(gemma_gguf):
    """The model cache holds every matrix of Gemma 3 as its kernels read it (Q5_0, Q8_0, Q4_K, Q6_K, and the
    tied Q8_0 embedding), fused groups back to back; the native engine binds every weight in place."""
    from barellm.store.converted import open_model

    f = open_model(Path(gemma_gguf))
    assert isinstance(f, BLMFile)
    for name, info in f.tensors.items():
        if len(info.shape) == 2:
            assert info.layout == kernels.matrix_layout(info.type, *info.shape) == LAYOUT_INTERLEAVE8, name
    assert {f.tensors[n].type for n in f.tensors if len(f.tensors[n].shape) == 2} >= {Q4_K, Q6_K, Q8_0}
    e = engine.NativeEngine(_cfg(f), f, n_ctx=128, threads=2)
    assert not e.weights.dequantized
    for names, parts in e.weights.matrices.items():
        for part in parts:
            assert _mapping_view(part[4], f), names
    assert _mapping_view(e.weights.table("token_embd.weight")[4], f)
    for i in range(e.cfg.n_layers):  # gate|up of one type: one matrix, in place
        assert len(e.weights.matrix((f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"))) == 1
    del e
    f.close()
