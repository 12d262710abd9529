"""The type-traits table: codecs against their error bounds, and against the `gguf` package bit for bit."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from barellm.errors import FormatError
from barellm.formats import quant
from barellm.formats.gguf import GGUFFile

ENCODABLE = [t for t in quant.TYPES.values() if t.from_float is not None]
DECODABLE = list(quant.SUPPORTED.values())
# Types whose encoder the gguf package also has (its F32/F16 paths are plain NumPy casts).
ORACLE_ENCODERS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]

# Tensors beyond this many values are compared on their leading rows only: every row goes through the
# same code, and the whole of a 170M-value embedding would dominate the test time.
COMPARE_VALUES = 1 << 22


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns, so equality is exact (and NaN == NaN)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def sample(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Gaussian data with the awkward cases ggml's encoders branch on mixed in."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size >= 128:
        flat[:32] = 0  # an all-zero block: d = 0 and the inverse scale must be 0, not inf
        flat[32:64] = scale  # a constant block: max == min for q4_1
        flat[64:96] = np.where(np.arange(32) % 2, scale, -scale)  # tied extremes of both signs
        flat[96:128] = -np.abs(flat[96:128])  # one-signed block: q4_0/q5_0 clip on the other side
    return x


# --- the table itself ------------------------------------------------------------------------------------


def test_table_matches_ggml_ids_names_and_sizes():
    for t in GGMLQuantizationType:
        row = quant.TYPES[t.value]
        assert row.name == t.name.lower()
        if t.name == "Q8_1":
            # ggml shrank block_q8_1 to two halves + 32 bytes; the package still lists the old float pair
            assert (row.block_size, row.block_bytes) == (32, 36)
            continue
        assert (row.block_size, row.block_bytes) == GGML_QUANT_SIZES[t], row.name
    assert len({t.name for t in quant.TYPES.values()}) == len(quant.TYPES)
    for row in quant.TYPES.values():
        assert quant.BY_NAME[row.name] is row
        assert row.supported == (row.id in quant.SUPPORTED)


def test_required_types_are_supported():
    for name in ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q3_k", "q4_k", "q5_k", "q6_k"]:
        assert quant.by_name(name.upper()).supported
    assert {t.name for t in ENCODABLE} == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q3_k",
                                           "q5_k"}
    assert all(t.max_error is not None for t in ENCODABLE)


def test_unknown_and_unsupported_types_are_named_in_errors():
    with pytest.raises(FormatError, match="unknown ggml type id 99"):
        quant.get(99)
    with pytest.raises(FormatError, match="q2_k"):
        quant.dequantize(np.zeros(84, np.uint8), 10, (256,))
    with pytest.raises(FormatError, match="iq2_xxs"):
        quant.get(16)
    with pytest.raises(FormatError, match="q4_2.*removed"):
        quant.row_bytes(4, 32)
    with pytest.raises(FormatError, match="encoding to ggml type q4_k"):
        quant.quantize(np.zeros((1, 256), np.float32), 12)
    with pytest.raises(FormatError, match="unknown ggml type 'q9_9'"):
        quant.by_name("q9_9")
    assert quant.type_name(99) == "type 99"


def test_row_bytes():
    assert quant.row_bytes(8, 576) == 18 * 34
    assert quant.row_bytes(12, 512) == 2 * 144
    assert quant.row_bytes(0, 7) == 28
    assert quant.row_bytes(10, 512) == 168  # layout known though not decodable
    assert quant.nbytes(14, (3, 256)) == 3 * 210
    assert quant.nbytes(0, ()) == 4
    with pytest.raises(FormatError, match="not a whole number of q4_1 blocks"):
        quant.row_bytes(3, 33)
    with pytest.raises(FormatError, match="not a whole number"):
        quant.row_bytes(3, -32)


# --- round trips against the documented bounds ------------------------------------------------------------


def row_shapes(t: quant.QuantType) -> list[tuple[int, ...]]:
    b = t.block_size
    shapes = [(b,), (3, 4 * b), (2, 5, 7 * b), (1, 33 * b)]
    if b == 1:
        shapes += [(7,), (3, 5), (1,), ()]  # any size is whole blocks for the float types
    return shapes


@pytest.mark.parametrize("t", ENCODABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [1.0, 3e-3, 250.0])
def test_round_trip_within_bound(t: quant.QuantType, scale: float):
    rng = np.random.default_rng(t.id * 1000 + int(scale * 1000))
    for shape in row_shapes(t):
        x = sample(rng, shape, scale)
        q = quant.quantize(x, t.id)
        assert q.dtype == np.uint8
        row = x.shape[-1] if x.ndim else 1
        assert q.shape == (*x.shape[:-1], quant.row_bytes(t.id, row))
        y = quant.dequantize(q, t.id, x.shape)
        assert y.shape == x.shape and y.dtype == np.float32
        blocks = x.reshape(-1, t.block_size)
        err = np.abs(y.reshape(-1, t.block_size) - blocks).max(axis=-1)
        bound = t.max_error(blocks)
        worst = int(np.argmax(err - bound))
        assert (err <= bound).all(), f"{t.name} {shape}: block {worst} error {err[worst]} > {bound[worst]}"


def test_bounds_are_tight_enough_to_mean_something():
    # A bound that is never approached would pass any codec; the worst block should come close.
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 256)).astype(np.float32)
    for t in ENCODABLE:
        if t.name == "f32":
            continue
        blocks = x.reshape(-1, t.block_size)
        y = quant.dequantize(quant.quantize(x, t.id), t.id, x.shape).reshape(blocks.shape)
        ratio = (np.abs(y - blocks).max(axis=-1) / t.max_error(blocks)).max()
        assert 0.5 < ratio <= 1.0, t.name


def test_f32_round_trip_is_exact_including_specials():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38], np.float32)
    y = quant.dequantize(quant.quantize(x, 0), 0, x.shape)
    assert np.array_equal(bits(x), bits(y))


@pytest.mark.parametrize("t", ENCODABLE, ids=lambda t: t.name)
def test_rows_must_be_whole_blocks(t: quant.QuantType):
    if t.block_size == 1:
        pytest.skip("every length is whole blocks")
    with pytest.raises(FormatError, match=f"not a whole number of {t.name} blocks"):
        quant.quantize(np.zeros((2, t.block_size + 1), np.float32), t.id)
    with pytest.raises(FormatError, match=f"not a whole number of {t.name} blocks"):
        quant.dequantize(np.zeros(t.block_bytes, np.uint8), t.id, (t.block_size - 1,))


@pytest.mark.parametrize("t", DECODABLE, ids=lambda t: t.name)
def test_dequantize_checks_the_byte_count(t: quant.QuantType):
    shape = (2, t.block_size * 2)
    need = quant.nbytes(t.id, shape)
    for wrong in (need - 1, need + 1, 0):
        with pytest.raises(FormatError, match=f"needs {need} bytes, got {wrong}"):
            quant.dequantize(np.zeros(wrong, np.uint8), t.id, shape)
    assert quant.dequantize(np.zeros(need, np.uint8), t.id, shape).shape == shape
    assert quant.dequantize(b"", t.id, (0, t.block_size)).shape == (0, t.block_size)


def test_dequantize_accepts_bytes_and_returns_a_fresh_array():
    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    q = quant.quantize(x, 8)
    assert np.array_equal(quant.dequantize(q.tobytes(), 8, (2, 32)), quant.dequantize(q, 8, (2, 32)))
    raw = x.reshape(-1).view(np.uint8)
    f = quant.dequantize(raw, 0, (2, 32))
    assert np.array_equal(f, x)
    f[0, 0] = 99  # even f32 is a copy: writing must not reach the caller's (or a mapped file's) bytes
    assert x[0, 0] == 0


# --- bit-exact against ggml's reference (through the gguf package) ---------------------------------------


def test_roundf_goes_away_from_zero_on_ties():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 126.5, 3.0], np.float32)
    assert quant._roundf(x).tolist() == [1, 2, 3, -1, -3, 0, 0, 127, 3]


def oracle_quantize(x: np.ndarray, name: str) -> np.ndarray:
    out = gguf.quants.quantize(x, GGMLQuantizationType[name.upper()])
    return np.ascontiguousarray(out).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("name", ORACLE_ENCODERS)
def test_quantize_matches_reference_bit_for_bit(name: str):
    t = quant.BY_NAME[name]
    rng = np.random.default_rng(t.id)
    cases = [sample(rng, (64, 256), s) for s in (1.0, 1e-4, 5e3)]
    # exact ties: with amax = 127 the q8_0 scale is 1, so x.5 must round away from zero (rint would not)
    ties = np.tile(np.array([127.0, -2.5, 2.5, 0.5, -0.5, 1.5] + [0.0] * 26, np.float32), (2, 8))
    cases += [ties, np.zeros((1, 256), np.float32), np.full((1, 256), -1.0, np.float32)]
    for x in cases:
        assert np.array_equal(quant.quantize(x, t.id).reshape(-1), oracle_quantize(x, name)), name


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    x = np.array([1.0, np.nan, -np.inf, 3.4e38, 1.00390625, 1.01171875, -1e-40], np.float32)
    ours = quant.quantize(x, 30)
    assert np.array_equal(ours.reshape(-1), oracle_quantize(x, "bf16"))
    y = quant.dequantize(ours, 30, x.shape)
    assert y[4] == 1.0 and y[5] == 1.015625  # ties to even in both directions
    assert np.isnan(y[1])


@pytest.mark.parametrize("t", [t for t in DECODABLE if t.block_size > 1], ids=lambda t: t.name)
def test_dequantize_matches_reference_on_random_blocks(t: quant.QuantType):
    # Every bit pattern of the quants, including types no test model uses (q4_0, q5_1, q5_k); the
    # float16 fields are set to finite values so the comparison is of arithmetic, not of NaN payloads.
    rng = np.random.default_rng(t.id)
    raw = rng.integers(0, 256, (300, t.block_bytes), dtype=np.uint8)
    layout = {
        "q8_0": quant._BLOCK_Q8_0,
        "q4_0": quant._BLOCK_Q4_0,
        "q4_1": quant._BLOCK_Q4_1,
        "q5_0": quant._BLOCK_Q5_0,
        "q5_1": quant._BLOCK_Q5_1,
        "q3_k": quant._BLOCK_Q3_K,
        "q4_k": quant._BLOCK_Q4_K,
        "q5_k": quant._BLOCK_Q5_K,
        "q6_k": quant._BLOCK_Q6_K,
        "mxfp4": quant._BLOCK_MXFP4,
    }[t.name]
    blocks = raw.reshape(-1).view(layout)
    assert layout.itemsize == t.block_bytes
    for name in ("d", "m", "dmin"):
        if name in layout.names:
            blocks[name] = rng.standard_normal(len(blocks)).astype(np.float16) * np.float16(0.1)
    ours = quant.dequantize(raw, t.id, (300, t.block_size))
    ref = gguf.quants.dequantize(raw, GGMLQuantizationType(t.id)).reshape(300, t.block_size)
    assert np.array_equal(bits(ours), bits(ref))


@pytest.fixture(scope="module")
def real_models(smollm_gguf, gemma_gguf):
    with GGUFFile(smollm_gguf) as smol, GGUFFile(gemma_gguf) as gemma:
        yield {"smollm2": smol, "gemma3": gemma}


EXPECTED_TYPES = {"smollm2": {"q4_1", "q8_0", "f32"}, "gemma3": {"q5_0", "q4_k", "q6_k", "q8_0", "f32"}}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_dequantize_matches_reference_on_real_tensors(real_models, model: str):
    f = real_models[model]
    seen = set()
    for info in f.tensors.values():
        raw = f.raw(info.name)
        shape = info.shape
        if info.n_elements > COMPARE_VALUES:
            rows = COMPARE_VALUES // shape[-1]
            shape = (rows, shape[-1])
            raw = raw[: quant.nbytes(info.type, shape)]
        ours = quant.dequantize(raw, info.type, shape)
        ref = gguf.quants.dequantize(raw, GGMLQuantizationType(info.type))
        assert np.array_equal(bits(ours), bits(np.asarray(ref).reshape(shape))), info.name
        seen.add(info.type_name)
    assert seen == EXPECTED_TYPES[model]


def test_requantizing_real_weights_matches_reference(real_models):
    # Real weight distributions (heavy tails, exact grid values from an earlier quantization) exercise
    # the ties and clipping paths more than Gaussian noise does.
    f = real_models["smollm2"]
    x = f.dequantize("blk.0.attn_q.weight")
    for name in ORACLE_ENCODERS:
        assert np.array_equal(quant.quantize(x, quant.BY_NAME[name].id).reshape(-1), oracle_quantize(x, name))


def test_whole_model_dequantizes_quickly(real_models):
    f = real_models["smollm2"]
    start = time.perf_counter()
    n = sum(f.dequantize(name).size for name in f.tensors)
    elapsed = time.perf_counter() - start
    assert n == 134_515_008
    assert elapsed < 15, f"dequantizing SmolLM2-135M took {elapsed:.1f}s"
