"""Conversion into barellm's own format: GGUF files and Hugging Face safetensors checkpoints -> .blm.

    barellm convert SRC -o OUT.blm [--type f32|f16|bf16|q8_0|q4_0|q4_1|q3_k|q5_k] [--layout rows|kernels]
    barellm verify FILE

A GGUF file keeps its tensors' types and bytes unless --type asks for another type, so a model converted
from GGUF computes exactly what the GGUF computes. A checkpoint directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json) of a family of store/hf_families.py (llama, qwen2, qwen3, qwen3_moe,
phi3, smollm3, gemma2, gpt_oss) is mapped onto GGUF's tensor names and metadata keys the way llama.cpp's
converter does it (the permutation of llama's query and key rows, `permute_qk`, stacked experts, fused
matrices, MXFP4 experts repacked), so that it holds what llama.cpp's GGUF of it would hold.

Types (llama.cpp's conventions): 1-D tensors (the norms) are always float32; with --type every 2-D weight,
the embedding and the output projection included, takes the type (and every stack of experts), except a
matrix whose rows are not a whole number of the type's blocks, which falls back to f16. A checkpoint's
F32, F16 and BF16 tensors keep their type without --type; its MXFP4 experts become ggml's MXFP4.

Reading a checkpoint is store/checkpoint.py's. The model store (store/converted.py) uses `convert` to turn a
GGUF file or a checkpoint into a .blm once, and maps that afterwards (docs/format.md, "Cache").
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import sys
from pathlib import Path

import numpy as np

from barellm.errors import FormatError
from barellm.files import sha256_file
from barellm.formats import blm, blm_writer, kernels, quant, sniff
from barellm.progress import Progress
from barellm.store.checkpoint import SafetensorsFile, _from_hf, _hf_files, _Model, _Tensor
from barellm.store.hf_recipes import permute_qk

__all__ = ["convert", "permute_qk", "SafetensorsFile", "CONVERTER_REVISION", "TYPE_CHOICES", "LAYOUT_CHOICES",
           "source_files", "sha256_files"]

# Bumped whenever the conversion rules change what a file holds; the cache converts again on a mismatch.
# 2: every matrix with a kernel layout stored in it (the K-quants too, and a tied embedding), fused groups
#    back to back.
# Not bumped when the experts' stacks (3-D) took their kernel layout too: a cache from before holds them in rows,
# which the engine repacks at load into the same bytes, and a bump would leave the models pulled without their
# GGUF unusable until downloaded again.
CONVERTER_REVISION = 2
TYPE_CHOICES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q3_k", "q5_k")
LAYOUT_CHOICES = ("rows", "kernels")
# llama.cpp's llama_ftype for the types --type offers, for general.file_type
_FILE_TYPES = {0: 0, 1: 1, 2: 2, 3: 3, 8: 7, 11: 11, 13: 16, 30: 32}
F32, F16, BF16 = 0, 1, 30


# --- GGUF ------------------------------------------------------------------------------------------------


# a GGUF split into parts (llama.cpp's gguf-split): NAME-00001-of-00003.gguf, each part a GGUF file of its own
_SPLIT_PART = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf", re.IGNORECASE)


def split_parts(path: Path) -> list[Path]:
    """The parts of the split GGUF whose first part is path, in order (they must lie beside it); [path]
    for a file that is not the first part of a split."""
    m = _SPLIT_PART.fullmatch(path.name)
    if m is None or int(m["i"]) != 1 or int(m["n"]) == 1:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['n']}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FormatError(f"{path}: the first of {n} parts of a split GGUF, but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not beside it")
    return parts


class _Merged:
    """The parts of a split GGUF read as one model: the first part's metadata (the split's own keys left
    out), every part's tensors."""

    def __init__(self, files: list) -> None:
        self.files = files
        self.metadata = {k: v for k, v in files[0].metadata.items() if not k.startswith("split.")}
        self.metadata_types = files[0].metadata_types
        self.tensors: dict[str, object] = {}
        self.owner: dict[str, object] = {}
        for f in files:
            for name, t in f.tensors.items():
                if name in self.tensors:
                    raise FormatError(f"tensor {name!r} is in two parts of the split GGUF")
                self.tensors[name] = t
                self.owner[name] = f

    def close(self) -> None:
        for f in self.files:
            f.close()


def _from_gguf(path: Path) -> _Model:
    from barellm.formats.gguf import GGUFFile

    parts = split_parts(path)
    files = []
    try:
        for part in parts:
            files.append(GGUFFile(part))
        g = _Merged(files)
        # refuse what the engines would refuse at load, before anything is written
        from barellm.arch.config import check_tensors, config_of

        check_tensors(config_of(g), g.tensors)
    except BaseException:
        for f in files:
            f.close()
        raise
    # general.alignment describes the GGUF file's own layout, not the model
    md = {k: v for k, v in g.metadata.items() if k != "general.alignment"}
    types = {k: g.metadata_types[k] for k in md}
    owner = g.owner
    tensors = [
        _Tensor(t.name, t.type, t.shape, (lambda n=t.name: owner[n].raw(n)),
                (lambda n=t.name: owner[n].dequantize(n)))
        for t in g.tensors.values()
    ]
    return _Model(md, types, tensors, "gguf", parts, g.close)


# --- conversion ------------------------------------------------------------------------------------------


def target_type(name: str, src_type: int, shape: tuple[int, ...], requested: int | None,
                norms_f32: bool = False) -> int:
    """The type a tensor is stored in (llama.cpp's rules; see the module docstring).

    norms_f32: 1-D tensors become float32 even without a requested type (checkpoints store them in f16 or
    bf16; GGUF files already have them as llama.cpp wants them and keep them as they are).
    """
    if len(shape) <= 1 or name.endswith("_norm.weight"):
        return F32 if requested is not None or norms_f32 else src_type
    if requested is None:
        return src_type
    if shape[-1] % quant.get(requested).block_size:
        return F16
    return requested


def sha256_files(files: list[Path], progress: Progress | None = None) -> tuple[str, int]:
    """SHA256 of one file, or of the lines "<sha256>  <name>" of several; and the bytes read."""
    digests = [(p.name, sha256_file(p, progress)) for p in files]
    size = sum(p.stat().st_size for p in files)
    if len(files) == 1:
        return digests[0][1], size
    listing = "".join(f"{d}  {n}\n" for n, d in sorted(digests))
    return hashlib.sha256(listing.encode()).hexdigest(), size


def source_files(src: Path) -> list[Path]:
    """The files a conversion of src reads (what identifies the source's current state): every part of a
    split GGUF."""
    return _hf_files(src)[1] if src.is_dir() else split_parts(src)


def _open_source(src: Path) -> _Model:
    kind = sniff(src)
    if kind == "gguf":
        return _from_gguf(src)
    if kind == "hf":
        return _from_hf(src)
    raise FormatError(f"{src}: already a .blm file; nothing to convert")


def convert(src: str | os.PathLike[str], out: str | os.PathLike[str], *, type: str | None = None,
            layout: str = "rows", progress: bool | None = None, source_sha256: str | None = None) -> Path:
    """Converts a GGUF file or a safetensors checkpoint directory into a .blm file at `out` (atomically).

    type: None keeps the source's types; else one of TYPE_CHOICES for every 2-D weight.
    layout: "rows" (GGUF's row layout everywhere) or "kernels" (the layouts `kernel_layout` picks, with each
        fused group's parts back to back: see `fused_order`).
    progress: draw a progress bar on stderr (default: when stderr is a terminal).
    """
    src, out = Path(src), Path(out)
    if type is not None and type not in TYPE_CHOICES:
        raise FormatError(f"--type must be one of {', '.join(TYPE_CHOICES)}, not {type!r}")
    if layout not in LAYOUT_CHOICES:
        raise FormatError(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, not {layout!r}")
    requested = quant.by_name(type).id if type else None
    show = sys.stderr.isatty() if progress is None else progress
    model = _open_source(src)
    try:
        if source_sha256 is None:
            with Progress(sum(p.stat().st_size for p in model.source_files), f"hashing {src.name}",
                          enabled=show) as bar:
                source_sha256, size = sha256_files(model.source_files, bar)
        else:
            size = sum(p.stat().st_size for p in model.source_files)
        md, md_types = dict(model.metadata), dict(model.metadata_types)
        if requested is not None and "general.file_type" in md and requested in _FILE_TYPES:
            md["general.file_type"] = _FILE_TYPES[requested]
            md_types["general.file_type"] = "uint32"
        names = {t.name for t in model.tensors}
        tied = "output.weight" not in names
        tensors = fused_order(model.tensors) if layout == "kernels" else model.tensors
        specs = [_spec(t, requested, layout, model.norms_f32, tied) for t in tensors]
        provenance = {
            "source.name": src.resolve().name,
            "source.format": model.source_format,
            "source.sha256": source_sha256,
            "source.size": size,
            "converter.name": "barellm",
            "converter.version": _version(),
            "converter.revision": CONVERTER_REVISION,
            "convert.type": type or "keep",
            "convert.layout": layout,
        }
        prov_types = {"source.size": "uint64", "converter.revision": "uint32"}
        total = sum(blm.LAYOUTS[s.layout].nbytes(s.type, s.shape) for s in specs)
        with Progress(total, f"converting {src.name}", enabled=show) as bar:
            return blm_writer.write_blm(out, md, specs, metadata_types=md_types, provenance=provenance,
                                 provenance_types=prov_types, progress=bar)
    finally:
        model.close()


def _version() -> str:
    from barellm import __version__

    return __version__


# The matmuls the native engine fuses (plan.py: Q|K|V of a layer, gate|up): GGUF's names within a block.
FUSED_GROUPS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def fused_order(tensors: list[_Tensor]) -> list[_Tensor]:
    """The tensors with each fused group's parts moved together, in the group's order, where the first of them
    was: written so (in the kernels' layout, whose groups of rows are whole cache lines), a group's parts lie
    back to back in the file, and their span is the fused matrix itself (BLMFile.span)."""
    by_name = {t.name: t for t in tensors}
    groups: dict[str, list[str]] = {}
    for t in tensors:
        m = re.fullmatch(r"(blk\.\d+\.)(\w+)\.weight", t.name)
        for group in FUSED_GROUPS:
            if m and m.group(2) in group:
                names = [f"{m.group(1)}{part}.weight" for part in group]
                if all(n in by_name for n in names):
                    for n in names:
                        groups[n] = names
    out, done = [], set()
    for t in tensors:
        if t.name in done:
            continue
        for n in groups.get(t.name, [t.name]):
            out.append(by_name[n])
            done.add(n)
    return out


def kernel_layout(name: str, type_id: int, shape: tuple[int, ...], tied: bool) -> int:
    """The layout `convert --layout kernels` stores a tensor in.

    Weight matrices take the layout the native engine's matmuls want (`kernels.matrix_layout`, the one place
    for that decision). The token embedding does too when the output projection is tied to it (the engine
    then uses one mapping for both the lookups and the output matmul); an untied one stays in rows, since it
    is only looked up a row at a time by token id; so does everything that is not a matrix. A mixture's stack of
    experts' matrices (3-D) takes the layout of the matrix of its rows, as the engine's moe op reads it, where each
    expert's rows are whole groups of it (else the engine cannot run the stack, and it stays in rows).
    """
    shape = tuple(shape)
    if len(shape) not in (2, 3) or (name == "token_embd.weight" and not tied):
        return blm.LAYOUT_ROWS
    tag = kernels.matrix_layout(type_id, math.prod(shape[:-1]), shape[-1])
    if len(shape) == 3 and shape[1] % kernels.layout_rows(tag):
        return blm.LAYOUT_ROWS
    return tag if tag in blm.LAYOUTS and blm.LAYOUTS[tag].check(type_id, shape) is None else blm.LAYOUT_ROWS


def _spec(t: _Tensor, requested: int | None, layout_mode: str, norms_f32: bool, tied: bool) -> blm_writer.TensorSpec:
    dst = target_type(t.name, t.type, t.shape, requested, norms_f32)
    if dst not in quant.TYPES or not quant.TYPES[dst].has_layout:
        raise FormatError(f"tensor {t.name!r}: cannot store type {dst}")
    layout = kernel_layout(t.name, dst, t.shape, tied) if layout_mode == "kernels" else blm.LAYOUT_ROWS

    def data() -> np.ndarray:
        if dst == t.type:
            rows = t.rows()
        else:
            try:
                rows = quant.quantize(t.floats(), dst).reshape(-1)
            except FormatError as e:
                raise FormatError(f"tensor {t.name!r} ({quant.type_name(t.type)} -> {quant.type_name(dst)}): {e}") \
                    from None
        if layout != blm.LAYOUT_ROWS:
            rows = blm.LAYOUTS[layout].from_rows(np.ascontiguousarray(rows).view(np.uint8).reshape(-1), dst, t.shape)
        return rows

    return blm_writer.TensorSpec(t.name, dst, t.shape, data, layout)
