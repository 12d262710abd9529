"""Mixtures of experts (the qwen3moe and gpt-oss rows): the router, the stacked expert tensors, the moe op.

llama.cpp's logits on tiny qwen3moe and gpt-oss files (tests/data/README.md) hold both engines to the model, on
every kernel tier; random models with the experts in every weight type hold the native op to the NumPy one, and
the native engine's results to the same bits whatever the threads, the chunking and the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_kernels_kquants import UNIT_BYTES, make_weights

from barellm.arch import llama as ref
from barellm.arch import reference_engine
from barellm.arch.config import config_of
from barellm.formats import kernels
from barellm.formats.gguf import GGUFFile
from barellm.runtime.engine import NativeEngine

from conftest import DATA
from gguf_writer import write_gguf
from tiny_model import tiny_llama_metadata

# (file, top-1 agreement at least, max |logit - llama.cpp's| at most). The F32 file: the float model (the native
# engine's f16 KV cache and 15-bit activations cost ~1e-3); the Q8_0 experts: llama.cpp rounds the activations
# that meet them to 8 bits, the engines do not (4e-2 apart: tests/data/README.md).
GOLDEN = {"qwen3moe-tiny": (1.0, 1e-2), "qwen3moe-q8_0-tiny": (0.95, 0.5), "gpt-oss-tiny": (1.0, 1e-2),
          "gpt-oss-mxfp4-tiny": (0.95, 0.5)}

# expert weight types (ggml ids) and a (dim, expert ffn) of whole blocks for each, with tails past the SIMD
# widths where the type allows: f32, f16, q4_0, q4_1, q5_0, q5_1 and bf16 (no kernels: float32 rows), q8_0,
# q3_k, q4_k, q5_k, q6_k, mxfp4
EXPERT_TYPES = {0: (72, 40), 1: (72, 40), 2: (96, 64), 3: (96, 64), 6: (96, 64), 7: (96, 64), 8: (96, 64),
                30: (72, 40), 11: (256, 256), 12: (256, 256), 13: (256, 256), 14: (256, 256), 39: (96, 64)}
MXFP4 = 39
KQUANT_TYPES = (11, 12, 13, 14)
KQUANT_SCALES = {11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}   # where each block's f16 scales are


@pytest.fixture(scope="module", params=list(GOLDEN))
def golden(request):
    src = GGUFFile(DATA / f"{request.param}.gguf")
    gold = np.load(DATA / f"{request.param}.logits.npz")
    yield request.param, src, gold["ids"].tolist(), gold["logits"]
    src.close()


def _agreement(name: str, engine: str, got: np.ndarray, want: np.ndarray) -> None:
    top1, worst = GOLDEN[name]
    agree = float(np.mean(got.argmax(1) == want.argmax(1)))
    err = float(np.abs(got - want).max())
    print(f"{name} {engine}: top-1 {100 * agree:.2f} %, max |dlogit| {err:.2e}")
    assert agree >= top1 and err <= worst


def test_reference_matches_llamacpp(golden):
    name, src, ids, want = golden
    cfg = config_of(src)
    assert cfg.arch in ("qwen3moe", "gpt-oss") and (cfg.n_experts, cfg.n_experts_used, cfg.expert_ffn_dim) == (8, 2, 32)
    assert cfg.expert_weights_norm
    _agreement(name, "reference", reference_engine(cfg, src, 256).forward(ids, 0, all_logits=True), want)


def test_native_matches_llamacpp(golden, isa):
    name, src, ids, want = golden
    e = NativeEngine(config_of(src), src, n_ctx=256, threads=2, chunk=32)
    _agreement(name, f"native {isa}", e.forward(ids, 0, all_logits=True), want)


def test_mxfp4_experts_stay_mxfp4():
    """gpt-oss's MXFP4 expert stacks run on the MXFP4 kernels in their interleaved layout: 17 bytes per 32
    values, as the file holds them (they were float32 copies, 7.5x the file's bytes, before the kernels)."""
    src = GGUFFile(DATA / "gpt-oss-mxfp4-tiny.gguf")
    e = NativeEngine(config_of(src), src, n_ctx=64, threads=1, chunk=8)
    stacks = [n for n, t in src.tensors.items() if t.type == MXFP4]
    assert stacks
    for name in stacks:
        (type_id, layout, rows, cols, data), = e.weights.matrix((name,))
        assert (type_id, layout) == (MXFP4, kernels.LAYOUT_INTERLEAVE8)
        # each group of 8 rows padded to whole cache lines: under 64 bytes a group over the file's 17 / 32
        groups = -(-rows // 8)
        assert data.nbytes == kernels.matrix_bytes(MXFP4, layout, rows, cols)
        assert rows * cols // 32 * 17 <= data.nbytes < rows * cols // 32 * 17 + 64 * groups
    src.close()


def test_mxfp4_converted_stays_4bit(tmp_path):
    """A model with MXFP4 experts converted for the kernels: each stack stored as the moe op reads it, 17 bytes per
    32 values (so the .blm is the GGUF's size), and used in place, a view of the file's mapping: the resident
    weights are the file, not float32 copies 7.5x its size. Its logits are those of the GGUF, repacked at load."""
    from barellm.formats.blm import BLMFile
    from barellm.store.convert import convert

    gguf = write_tiny_moe(tmp_path / "moe.gguf", MXFP4, 256, 256, n_experts=4, n_used=2)
    out = convert(gguf, tmp_path / "moe.blm", layout="kernels")
    assert abs(out.stat().st_size / gguf.stat().st_size - 1) < 0.02
    f = BLMFile(out)
    stacks = [n for n, t in f.tensors.items() if t.type == MXFP4]
    assert len(stacks) == 6
    for name in stacks:
        info = f.tensors[name]
        assert info.layout == kernels.LAYOUT_INTERLEAVE8 and len(info.shape) == 3
        assert info.nbytes == np.prod(info.shape) // 32 * 17   # 8 rows of 8 blocks: whole cache lines, no padding
    e = NativeEngine(config_of(f), f, n_ctx=64, threads=2, chunk=8)
    for name in stacks:
        (type_id, layout, _, _, data), = e.weights.matrix((name,))
        assert (type_id, layout) == (MXFP4, kernels.LAYOUT_INTERLEAVE8)
        assert np.shares_memory(data, np.asarray(f.stored(name)))   # the mapping itself, no copy
    src = GGUFFile(gguf)
    want = NativeEngine(config_of(src), src, n_ctx=64, threads=2, chunk=8).forward(PROMPT, 0, all_logits=True)
    assert np.array_equal(e.forward(PROMPT, 0, all_logits=True), want)
    src.close()
    f.close()


def test_mxfp4_dense_matrices(tmp_path, isa):
    """Dense matrices stored as MXFP4 (attention's, here) run on the MXFP4 kernels too, fused Q|K|V included,
    and the model's logits stay those of the NumPy reference on the dequantized weights."""
    src = GGUFFile(write_tiny_moe(tmp_path / "dense.gguf", MXFP4, 96, 64, dense_mxfp4=True))
    assert src.tensors["blk.0.attn_q.weight"].type == MXFP4
    e = NativeEngine(config_of(src), src, n_ctx=64, threads=2, chunk=8)
    parts = e.weights.matrix(("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"))
    assert [(p[0], p[1]) for p in parts] == [(MXFP4, kernels.LAYOUT_INTERLEAVE8)]
    got = e.forward(PROMPT, 0, all_logits=True)
    want = reference_engine(config_of(src), src, 64).forward(PROMPT, 0, all_logits=True)
    src.close()
    assert np.array_equal(got.argmax(1), want.argmax(1))
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()


def test_mxfp4_greedy_independent_of_threads_and_tier():
    """gpt-oss with MXFP4 experts: the same logits, bit for bit, with 1 or 2 threads on every tier this machine
    runs (the amx kernels' emulation included); the same greedy tokens on all of them, and the same bits on the
    SIMD tiers (their MXFP4 matmuls give scalar's bits; scalar's exp, in the clamped SwiGLU, is not theirs)."""
    from kernel_tiers import RUN, using

    src = GGUFFile(DATA / "gpt-oss-mxfp4-tiny.gguf")
    ids = np.load(DATA / "gpt-oss-mxfp4-tiny.logits.npz")["ids"].tolist()[:24]
    results = []
    for tier in RUN:
        with using(tier):
            for threads in (1, 2):
                e = NativeEngine(config_of(src), src, n_ctx=64, threads=threads, chunk=16)
                results.append((tier, threads, e.forward(ids, 0, all_logits=True)))
    src.close()
    first = {}
    for tier, threads, got in results:
        assert np.array_equal(got, first.setdefault(tier, got)), (tier, threads)
        assert np.array_equal(got.argmax(1), results[0][2].argmax(1)), tier
    simd = [first[t] for t in first if t != "scalar"]
    assert all(np.array_equal(got, simd[0]) for got in simd)


def test_route_is_llamacpps():
    """Softmax over the experts, the top n_used, renormalized (llama.cpp's order of steps), or not."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    logits[0, 3] = logits[0, 9]   # a tie goes to the lower id
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :4]
    chosen = np.take_along_axis(p, top, 1)
    for norm, want in ((True, chosen / chosen.sum(1, keepdims=True)), (False, chosen)):
        choice, weight = ref.route(logits, 4, norm)
        assert np.array_equal(choice, top)
        assert np.allclose(weight, want, rtol=1e-6, atol=0)


def mxfp4_blocks(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Random MXFP4 rows (uint8 [rows, cols / 32 * 17]): random codes, scales 2^(e - 128) that give values about
    std apart (the codes' values kv spread ~5.6)."""
    blocks = rng.integers(0, 256, (rows * cols // 32, 17), dtype=np.uint8)
    e = 128 + round(float(np.log2(std / 5.6)))
    blocks[:, 0] = rng.integers(e - 1, e + 2, len(blocks))
    return blocks.reshape(rows, -1)


def write_tiny_moe(path, expert_type: int, dim: int, ffn: int, n_experts: int = 6, n_used: int = 3,
                   seed: int = 0, dense_mxfp4: bool = False):
    """A random qwen3moe file: two layers, the three expert stacks in expert_type, everything else F32 (with
    dense_mxfp4: the attention's matrices and the output MXFP4, as a file may store dense matrices)."""
    heads, kv_heads = 4, 2
    md, n_vocab = tiny_llama_metadata(dim=dim, ffn=ffn, heads=heads, kv_heads=kv_heads)
    md = {("qwen3moe." + k[len("llama."):] if k.startswith("llama.") else k): v for k, v in md.items()}
    hd = dim // heads
    md.update({"general.architecture": "qwen3moe", "qwen3moe.expert_count": n_experts,
               "qwen3moe.expert_used_count": n_used, "qwen3moe.expert_feed_forward_length": ffn,
               "qwen3moe.attention.key_length": hd, "qwen3moe.rope.dimension_count": hd})
    rng = np.random.default_rng(seed)

    def mat(*shape: int, scale: float = 1.0):
        if dense_mxfp4 and len(shape) == 2 and shape[0] != n_vocab and shape[0] != n_experts:
            return mxfp4_blocks(rng, *shape, scale / np.sqrt(shape[-1])), MXFP4, shape
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def stack(name: str, rows: int, cols: int) -> tuple:
        if expert_type in KQUANT_TYPES:  # no encoder: the kernel tests' random blocks, their scales / 16 (unit rows)
            raw = make_weights(expert_type, n_experts * rows, cols, rng)
            blocks = raw.reshape(-1, UNIT_BYTES[expert_type])
            for at in KQUANT_SCALES[expert_type]:
                blocks[:, at:at + 2] = (blocks[:, at:at + 2].copy().view("<f2") / 16).view(np.uint8)
            return (name, raw, expert_type, (n_experts, rows, cols))
        if expert_type == MXFP4:  # no encoder either: random codes, scales near mat's spread
            blocks = mxfp4_blocks(rng, n_experts * rows, cols, 2.0 / np.sqrt(cols))
            return (name, blocks, expert_type, (n_experts, rows, cols))
        return (name, mat(n_experts, rows, cols, scale=2.0), expert_type)

    def t(name: str, m, type_id: int = 0) -> tuple:  # a dense tensor: float32, or mat's MXFP4 (rows, type, shape)
        return (name, m[0], m[1], m[2]) if isinstance(m, tuple) else (name, m, type_id)

    tensors: list[tuple] = [("token_embd.weight", mat(n_vocab, dim, scale=2.0), 0),
                            ("output_norm.weight", norm(dim), 0), ("output.weight", mat(n_vocab, dim, scale=4.0), 0)]
    for i in range(2):
        b = f"blk.{i}."
        tensors += [
            (b + "attn_norm.weight", norm(dim), 0), t(b + "attn_q.weight", mat(heads * hd, dim, scale=2.0)),
            t(b + "attn_k.weight", mat(kv_heads * hd, dim, scale=2.0)),
            t(b + "attn_v.weight", mat(kv_heads * hd, dim)),
            t(b + "attn_output.weight", mat(dim, heads * hd)), (b + "attn_q_norm.weight", norm(hd), 0),
            (b + "attn_k_norm.weight", norm(hd), 0), (b + "ffn_norm.weight", norm(dim), 0),
            (b + "ffn_gate_inp.weight", mat(n_experts, dim, scale=4.0), 0),
            stack(b + "ffn_gate_exps.weight", ffn, dim), stack(b + "ffn_up_exps.weight", ffn, dim),
            stack(b + "ffn_down_exps.weight", dim, ffn),
        ]
    write_gguf(path, md, tensors)
    return path


@pytest.fixture(scope="module", params=list(EXPERT_TYPES), ids=lambda t: f"type{t}")
def tiny_moe(request, tmp_path_factory):
    dim, ffn = EXPERT_TYPES[request.param]
    path = write_tiny_moe(tmp_path_factory.mktemp("moe") / "moe.gguf", request.param, dim, ffn)
    src = GGUFFile(path)
    yield src
    src.close()


PROMPT = [5, 77, 131, 9, 200, 45, 61, 17, 250, 33, 3, 99, 140]


def test_moe_op_matches_numpy(tiny_moe, isa):
    """Each layer's moe op, on the inputs the engine gives it, against the NumPy moe on the dequantized stacks:
    the same experts and weights, and outputs apart by the rounding of the activations only (15 bits, or 8 for
    the types whose kernels take int8 blocks alone)."""
    e = NativeEngine(config_of(tiny_moe), tiny_moe, n_ctx=64, threads=2, chunk=8, kv_type="f32")
    stack = tiny_moe.tensors["blk.0.ffn_gate_exps.weight"].type
    info = kernels.traits(stack)
    int8 = info is not None and info.int_acts and kernels.matrix_act(stack, e.activations) == kernels.ACT_Q8
    worst = []

    def both(op, ctx):
        want = ref.moe(ctx.buf(op.src), ctx.buf(op.logits), e.weights.dequant(op.gate), e.weights.dequant(op.up),
                       e.weights.dequant(op.down), op.n_used, op.norm, op.act)
        i = e.op_index(op.name)[0]
        e.debugger.plan.run(ctx.T, ctx.n_out, i, i + 1)
        got = ctx.buf("proj")
        worst.append(float(np.abs(got - want).max() / np.abs(want).max()))

    e.debug_forward(PROMPT, 0, all_logits=True, replace={"*.ffn_moe": both})
    assert len(worst) == 4 and max(worst) < (3e-2 if int8 else 2e-3), worst


def test_biased_clamped_moe_op_matches_numpy(isa):
    """gpt-oss's moe op (expert biases, clamped SwiGLU, both clamps reached in its file) against the NumPy one."""
    src = GGUFFile(DATA / "gpt-oss-tiny.gguf")
    e = NativeEngine(config_of(src), src, n_ctx=64, threads=2, chunk=8, kv_type="f32")
    worst = []

    def both(op, ctx):
        biases = tuple(e.weights.dequant(n) for n in op.biases)
        want = ref.moe(ctx.buf(op.src), ctx.buf(op.logits), e.weights.dequant(op.gate), e.weights.dequant(op.up),
                       e.weights.dequant(op.down), op.n_used, op.norm, op.act, biases)
        i = e.op_index(op.name)[0]
        e.debugger.plan.run(ctx.T, ctx.n_out, i, i + 1)
        worst.append(float(np.abs(ctx.buf("proj") - want).max() / np.abs(want).max()))

    e.debug_forward(PROMPT, 0, all_logits=True, replace={"*.ffn_moe": both})
    src.close()
    assert len(worst) == 4 and max(worst) < 1e-5, worst


def test_moe_results_independent_of_threads_chunks_and_batch(tiny_moe):
    """The same bits for a token whatever runs beside it: one thread or two, chunks of 64 or 3 or 1 tokens
    (decode reads only its experts), alone or batched with another sequence."""
    cfg = config_of(tiny_moe)
    alone = NativeEngine(cfg, tiny_moe, n_ctx=64, threads=1, chunk=64).forward(PROMPT, 0, all_logits=True)
    for threads, chunk in ((2, 3), (2, 1)):
        e = NativeEngine(cfg, tiny_moe, n_ctx=64, threads=threads, chunk=chunk, n_slots=2)
        assert np.array_equal(e.forward(PROMPT, 0, all_logits=True), alone)
        other = [7, 8, 9, 10, 11]
        batched = e.forward_batch([(0, PROMPT, 0), (1, other, 0)], tails=[len(PROMPT), len(other)])
        assert np.array_equal(batched[:len(PROMPT)], alone)


@pytest.mark.parametrize("expert_type", [8, 12])
def test_moe_schedules_give_the_same_bits(expert_type, tmp_path):
    """The moe op's schedules: up to 4 tokens a call (chunk 1, 4) one thread routes and converts them, more
    (chunk 5, 64) are routed in parallel; with each expert's gate and up going whole to one thread (1 thread;
    2 threads decoding 4 experts), that thread applies the activation right away, else (3, 4 threads; a few
    experts over many threads) after a barrier; down goes by rows, split unevenly over 3 threads. 16
    experts, 4 a token: every schedule gives the 1-thread, 64-token bits, alone or batched."""
    dim, ffn = EXPERT_TYPES[expert_type]
    src = GGUFFile(write_tiny_moe(tmp_path / "moe.gguf", expert_type, dim, ffn, n_experts=16, n_used=4, seed=3))
    cfg = config_of(src)
    alone = NativeEngine(cfg, src, n_ctx=64, threads=1, chunk=64).forward(PROMPT, 0, all_logits=True)
    other = [7, 8, 9, 10, 11]
    for threads in (1, 2, 3, 4):
        for chunk in (64, 5, 4, 1):
            e = NativeEngine(cfg, src, n_ctx=64, threads=threads, chunk=chunk, n_slots=2)
            assert np.array_equal(e.forward(PROMPT, 0, all_logits=True), alone), (threads, chunk)
            batched = e.forward_batch([(0, PROMPT, 0), (1, other, 0)], tails=[len(PROMPT), len(other)])
            assert np.array_equal(batched[:len(PROMPT)], alone), (threads, chunk)
    src.close()


def test_greedy_output_independent_of_tier(tiny_moe):
    """Every kernel tier picks the same tokens (the matmuls give the scalar kernels' bits; the routing is
    plain C on every tier)."""
    from kernel_tiers import PRESENT, using

    cfg = config_of(tiny_moe)
    picks = []
    for tier in PRESENT:
        with using(tier):
            e = NativeEngine(cfg, tiny_moe, n_ctx=64, threads=2, chunk=4)
            picks.append(e.forward(PROMPT, 0, all_logits=True).argmax(1))
    assert all(np.array_equal(p, picks[0]) for p in picks)


def test_mxfp4_codec_is_ggufs():
    """The MXFP4 decoder (formats/quant.py) against gguf-py's, on the gpt-oss file's expert blocks."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from barellm.formats import quant

    src = GGUFFile(DATA / "gpt-oss-mxfp4-tiny.gguf")
    for name in ("blk.0.ffn_gate_exps.weight", "blk.1.ffn_down_exps.weight"):
        raw = np.asarray(src.raw(name)).view(np.uint8).reshape(-1)
        want = dequantize(raw.reshape(-1, 17), GGMLQuantizationType.MXFP4).reshape(-1)
        assert np.array_equal(quant.TYPES[39].to_float(raw).reshape(-1), want)
    src.close()


@pytest.mark.parametrize("off", [
    {"rope_yarn_factor": 0.0, "rope_cs_scale": 1.0},   # plain RoPE
    {"act": "silu"},                                   # SwiGLU without the clamps
    {"sliding_window": 0},                             # every layer global
])
def test_gpt_oss_features_matter(off):
    """Switching a gpt-oss feature off moves the reference's logits far from llama.cpp's."""
    import dataclasses

    src = GGUFFile(DATA / "gpt-oss-tiny.gguf")
    gold = np.load(DATA / "gpt-oss-tiny.logits.npz")
    cfg = dataclasses.replace(config_of(src), **off)
    got = reference_engine(cfg, src, 256).forward(gold["ids"].tolist(), 0, all_logits=True)
    src.close()
    assert np.abs(got - gold["logits"]).max() > 0.1


def test_gpt_oss_sinks_matter():
    src = GGUFFile(DATA / "gpt-oss-tiny.gguf")
    gold = np.load(DATA / "gpt-oss-tiny.logits.npz")
    e = reference_engine(config_of(src), src, 256)
    for layer in e.layers:
        layer.sinks = None
    got = e.forward(gold["ids"].tolist(), 0, all_logits=True)
    src.close()
    assert np.abs(got - gold["logits"]).max() > 0.1
