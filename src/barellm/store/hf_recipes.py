"""The recipes of the Hugging Face checkpoint families (store/hf_families.py): how one tensor of the converted
model (GGUF's name) is made from the checkpoint's tensors, and what a recipe reads (`Stored`, through a
`Checkpoint`) and makes (`Made`: its type, its bytes or float32 values on request).

A recipe takes a tensor as it is (`Same`: float types kept, or the query and key rows permuted for the "norm"
RoPE by `permute_qk`), stacks per-expert matrices into one 3-D tensor (`Experts`), splits a fused matrix into
its halves (`Fused`), repacks OCP MXFP4 experts into ggml's MXFP4 blocks (`Mxfp4`), takes the first of several
that the checkpoint has (`OneOf`), or makes a tensor from config.json's values (`FromConfig`). llama.cpp's
convert_hf_to_gguf.py is the reference for each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from barellm.errors import FormatError
from barellm.formats import quant

F32, F16, BF16 = 0, 1, 30
# What the checkpoints' MXFP4 experts are stored as: ggml's MXFP4 blocks, as the GGUF path keeps them. The one
# place to change should the engines want another type for them (`_mxfp4_rows` makes the blocks).
MXFP4 = quant.by_name("mxfp4").id
FLOAT_DTYPES = {"F32": F32, "F16": F16, "BF16": BF16}
_ELEMENT = {"F32": "<u4", "F16": "<u2", "BF16": "<u2", "U8": "u1"}  # one element's bits, moved as they are


# --- what the recipes read and make ----------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint."""

    name: str
    dtype: str                       # safetensors' dtype name
    shape: tuple[int, ...]
    raw: Callable[[], np.ndarray]    # its bytes (uint8)

    def elements(self) -> np.ndarray:
        """The tensor as an array of its elements' bits (shape `shape`): whatever moves them keeps them exact."""
        return self.raw().view(_ELEMENT[self.dtype]).reshape(self.shape)


@dataclass(frozen=True)
class Made:
    """One tensor of the converted model: its type, and its bytes or float32 values on request."""

    name: str
    type: int
    shape: tuple[int, ...]
    rows: Callable[[], np.ndarray]
    floats: Callable[[], np.ndarray]
    sources: tuple[str, ...]         # the checkpoint's tensors it comes from (for messages)


class Checkpoint(Protocol):
    """What a recipe sees of the checkpoint being converted."""

    where: str                                   # the directory, for messages
    metadata: Mapping[str, Any]                  # the metadata made so far (the architecture's prefix included)
    config: Mapping[str, Any]                    # config.json

    def has(self, name: str) -> bool: ...
    def get(self, name: str, needed_for: str) -> Stored: ...   # FormatError naming what is missing
    def meta(self, key: str) -> Any: ...                        # metadata[<arch>.<key>]
    def permutation(self, gguf_name: str) -> int: ...           # heads to permute a Q/K tensor by, or 0
    def norm_shift(self) -> float: ...


def _decode(bits: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    bits = np.ascontiguousarray(bits)
    if type_id == F32:
        return bits.view("<f4").astype(np.float32).reshape(shape)
    if type_id == F16:
        return bits.view("<f2").astype(np.float32).reshape(shape)
    if type_id == BF16:
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return quant.dequantize(bits.view(np.uint8).reshape(-1), type_id, shape)


def _made(name: str, type_id: int, shape: tuple[int, ...], bits: Callable[[], np.ndarray],
          sources: tuple[str, ...]) -> Made:
    def rows() -> np.ndarray:
        return np.ascontiguousarray(bits()).view(np.uint8).reshape(-1)

    return Made(name, type_id, tuple(int(s) for s in shape), rows, lambda: _decode(bits(), type_id, shape), sources)


def _float_tensor(ck: Checkpoint, name: str, needed_for: str) -> Stored:
    t = ck.get(name, needed_for)
    if t.dtype not in FLOAT_DTYPES:
        raise FormatError(f"{ck.where}: tensor {name!r} is {t.dtype}; only F32, F16 and BF16 convert")
    return t


def _shape_error(ck: Checkpoint, t: Stored, what: str) -> FormatError:
    return FormatError(f"{ck.where}: tensor {t.name!r} has shape {t.shape}, {what}")


# --- recipes: how one tensor of the model is made ------------------------------------------------------------


class Recipe(Protocol):
    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]: ...   # every tensor it may read
    def ready(self, prefix: str, ck: Checkpoint) -> bool: ...              # whether they are all there
    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made: ...


@dataclass(frozen=True)
class _Tensors:
    """What the recipes below share: the checkpoint tensors they read are named from `hf` (one by default),
    and a recipe is ready when every one of them is there."""

    hf: str

    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]:
        return (prefix + self.hf,)

    def ready(self, prefix: str, ck: Checkpoint) -> bool:
        return all(ck.has(n) for n in self.names(prefix, ck))


@dataclass(frozen=True)
class Same(_Tensors):
    """A tensor as the checkpoint has it: permuted for the "norm" RoPE if the architecture wants that of its
    queries and keys, a norm weight shifted if the family stores them less one (Gemma)."""

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        t = _float_tensor(ck, prefix + self.hf, name)
        heads, shift = ck.permutation(name), ck.norm_shift() if name.endswith("norm.weight") else 0.0
        type_id = FLOAT_DTYPES[t.dtype]
        if heads and t.shape[0] % (2 * heads):
            raise _shape_error(ck, t, f"whose {t.shape[0]} rows are not {heads} heads of pairs")
        if shift:  # in float32, as Hugging Face computes 1 + w
            return _made(name, F32, t.shape, lambda: _decode(t.elements(), type_id, t.shape) + np.float32(shift),
                         (t.name,))

        def bits() -> np.ndarray:
            e = t.elements()
            return permute_qk(e, heads) if heads else e

        return _made(name, type_id, t.shape, bits, (t.name,))


@dataclass(frozen=True)
class Experts(_Tensors):
    """Each expert's matrix (`hf` with {} for the expert's number) stacked into one 3-D tensor (Qwen3-MoE)."""

    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]:
        return tuple(prefix + self.hf.format(e) for e in range(ck.meta("expert_count")))

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        parts = [_float_tensor(ck, n, name) for n in self.names(prefix, ck)]
        first = parts[0]
        for p in parts:
            if len(p.shape) != 2 or p.shape != first.shape or p.dtype != first.dtype:
                raise FormatError(f"{ck.where}: tensor {p.name!r} is {p.dtype} of shape {p.shape}, but "
                                  f"{first.name!r} is {first.dtype} of shape {first.shape}; every expert's must match")
        return _made(name, FLOAT_DTYPES[first.dtype], (len(parts), *first.shape),
                     lambda: np.stack([p.elements() for p in parts]), tuple(p.name for p in parts))


@dataclass(frozen=True)
class Fused(_Tensors):
    """A tensor of stacked experts stored the other way round (experts, in, out) and transposed, or one half of
    a fused gate|up tensor whose outputs interleave (gpt-oss: gate at the even outputs, up at the odd ones)."""

    half: int | None = None   # 0: the even outputs, 1: the odd ones, None: all
    transpose: bool = False   # the stored matrix is (..., in, out)

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        t = _float_tensor(ck, prefix + self.hf, name)
        axis = -2 if self.transpose else -1   # the outputs' axis once transposed
        if len(t.shape) < (2 if self.transpose else 1) or (self.half is not None and t.shape[-1] % 2):
            raise _shape_error(ck, t, "not a fused gate|up tensor of interleaved outputs" if self.half is not None
                               else "not a stack of matrices")

        def bits() -> np.ndarray:
            e = t.elements()
            if self.transpose:
                e = np.swapaxes(e, -1, -2)
            if self.half is not None:
                e = e[..., self.half::2, :] if axis == -2 else e[..., self.half::2]
            return e

        shape = list(t.shape)
        if self.transpose:
            shape[-1], shape[-2] = shape[-2], shape[-1]
        if self.half is not None:
            shape[axis] //= 2
        return _made(name, FLOAT_DTYPES[t.dtype], tuple(shape), bits, (t.name,))


def _mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MXFP4 as gpt-oss's checkpoints hold it (per 32 values: an E8M0 scale, and 16 bytes whose low nibble
    is the even value and high nibble the odd one) -> ggml's MXFP4 blocks (the scale byte, then 16 bytes
    holding value j in the low nibble and value j + 16 in the high one), as llama.cpp's converter repacks them.
    The E2M1 codes and E8M0 scales stay as they are."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1)


@dataclass(frozen=True)
class Mxfp4(_Tensors):
    """Experts stored as MXFP4 (`hf`_blocks: experts, rows, groups, 16 bytes; `hf`_scales: experts, rows,
    groups), their rows optionally one interleaved half (gpt-oss's gate|up), repacked by `_mxfp4_rows`."""

    half: int | None = None

    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]:
        return (f"{prefix}{self.hf}_blocks", f"{prefix}{self.hf}_scales")

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        b, s = (ck.get(n, name) for n in self.names(prefix, ck))
        for t in (b, s):
            if t.dtype != "U8":
                raise FormatError(f"{ck.where}: tensor {t.name!r} is {t.dtype}; MXFP4 blocks and scales are U8")
        if len(b.shape) != 4 or b.shape[-1] != 16 or s.shape != b.shape[:-1]:
            raise _shape_error(ck, b, f"which with {s.name!r} of shape {s.shape} is not MXFP4 "
                               "(experts, rows, groups, 16) with scales (experts, rows, groups)")
        if self.half is not None and b.shape[1] % 2:
            raise _shape_error(ck, b, "whose rows are not interleaved gate and up rows")
        rows = b.shape[1] // 2 if self.half is not None else b.shape[1]

        def bits() -> np.ndarray:
            blocks, scales = b.elements(), s.elements()
            if self.half is not None:
                blocks, scales = blocks[:, self.half::2], scales[:, self.half::2]
            return _mxfp4_rows(blocks, scales)

        return _made(name, MXFP4, (b.shape[0], rows, b.shape[2] * 32), bits, (b.name, s.name))


@dataclass(frozen=True)
class OneOf:
    """The first of several ways a checkpoint may store a tensor whose tensors are all there."""

    options: tuple[Recipe, ...]

    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]:
        return tuple(n for o in self.options for n in o.names(prefix, ck))

    def ready(self, prefix: str, ck: Checkpoint) -> bool:
        return any(o.ready(prefix, ck) for o in self.options)

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        for o in self.options:
            if o.ready(prefix, ck):
                return o.make(name, prefix, ck)
        wanted = " or ".join(", ".join(repr(n) for n in o.names(prefix, ck)) for o in self.options)
        raise FormatError(f"{ck.where}: {name!r} needs the tensors {wanted}; the checkpoint has neither")


def _always(config: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class FromConfig:
    """A float32 tensor made from config.json (Phi-3's LongRoPE factors, Llama 3.1's rope_freqs), in the model
    only where `when` says config.json asks for it (the converter leaves it out otherwise)."""

    values: Callable[[Checkpoint], np.ndarray]
    when: Callable[[Mapping[str, Any]], bool] = _always

    def names(self, prefix: str, ck: Checkpoint) -> tuple[str, ...]:
        return ()

    def ready(self, prefix: str, ck: Checkpoint) -> bool:
        return True

    def make(self, name: str, prefix: str, ck: Checkpoint) -> Made:
        x = np.ascontiguousarray(self.values(ck), np.float32)
        return _made(name, F32, x.shape, lambda: x.view("<u4"), ("config.json",))


def permute_qk(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation of Q or K rows (`n_heads` heads of head_dim rows each).

    Hugging Face stores each head's rows so that RoPE rotates the pairs (i, i + head_dim/2) ("neox"); GGUF
    stores them interleaved so that it rotates (2i, 2i+1) ("norm"). Row 2i of a permuted head is row i of
    the original and row 2i+1 is row i + head_dim/2. `rows` may hold any per-row data (bytes of a quantized
    row too): only whole rows move.
    """
    n = rows.shape[0]
    return rows.reshape(n_heads, 2, n // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
