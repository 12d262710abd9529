"""NativeEngine: the forward plan (plan.py) bound to preallocated buffers and run by the C executor.

At load, the engine
  - decides each weight matrix's layout (`matrix_layout`, the one place that choice is made), fuses
    Q|K|V and gate|up into single matrices where their types agree, and repacks what the kernels want
    repacked;
  - allocates every buffer once, for `chunk` tokens: activations, quantized activations, the KV cache of
    each slot, the logits;
  - compiles the plan into an array of C op structs pointing at those buffers.
A forward call then only writes the token ids, positions and slots into small preallocated arrays and
makes one native call per chunk of up to `chunk` tokens; the worker threads run all layers with a
barrier between ops. Nothing is allocated in the token loop except the returned logits array (pass
`out=` to avoid even that).

Invariance: every op computes a row (a token) with the same float operations whatever the chunk, the
batch or the thread split, so greedy output is the same for any thread count, prefill chunking, or
batch composition (see ops.h, kernels.h).

Debug: `debug_forward` runs the same plan one op at a time, each op either by its native kernel or by
a NumPy implementation, with hooks to replace any op and to observe every op's output.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from barellm import _native as nat
from barellm import kernels
from barellm.arch.config import ModelConfig, check_tensors
from barellm.arch.llama import rope_frequencies
from barellm.cpu import check_memory, default_threads
from barellm.errors import FormatError, InvalidRequest
from barellm.kernels import (
    ACT_Q8,
    ACTIVATIONS,
    LAYOUT_ROWS,
    matmul_supported,
    matrix_act,
    matrix_layout,
)
from barellm.plan import Attention, Embed, GatedAct, MatMul, Op, RMSNorm, RopeKV, buffer_widths, llama_plan
from barellm.quant import q8_0_join, q8_0_keys, q8_0_keys_join, q8_0_split

F32 = 0  # ggml type id of float32
KIND_IDS: dict[str, int] = dict(nat.OP_KINDS)  # the op kinds the executor has, and their ids (py_engine.c)
KV_TILE = nat.KV_TILE
KV_TYPES: dict[str, int] = {"f32": 0, "f16": 1, "q8_0": nat.KV_Q8_0}  # the cache element types (ops.h, bl_kv_type)
KV_QK = 32  # values per block of a q8_0 cache
FLOAT_ALIGN = 16  # buffer rows start on cache lines: strides are multiples of 16 floats
ROPE_FIRST = 512  # positions of the RoPE tables filled by the first forward call (see _rope_upto)


def aligned_zeros(shape: tuple[int, ...] | int, dtype: Any = np.float32, align: int = 64) -> np.ndarray:
    """A zeroed C-contiguous array whose data starts on an `align`-byte boundary."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def lazy_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed array in its own anonymous mapping of small pages, resident only where it has been written.

    For the KV cache: it is sized for the whole context, but a conversation fills it from position 0 on. NumPy
    asks for transparent huge pages on big arrays, and a 2 MB page becomes resident at its first write: a
    cache whose every (layer, head) region had one token written would then be resident whole (SmolLM2 at
    context 2048: 44 of its 47 MB after a 36-token chat), and the first forward pass would have the kernel
    zero (and, on a fragmented machine, compact memory for) those 2 MB pages: 10-100 ms of the first token.
    """
    import mmap

    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass
    return np.frombuffer(m, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class NativeUnsupported(FormatError):
    """A legal model the native core refuses to plan (a combination of types or shapes it has no path for).
    engine="auto" falls back on the reference engine; engine="native" reports it."""


def check_kv_type(kv_type: str, cfg: ModelConfig) -> None:
    if kv_type not in KV_TYPES:
        raise InvalidRequest(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    if kv_type == "q8_0" and cfg.head_dim % KV_QK:
        raise InvalidRequest(f"kv_type q8_0 needs a head_dim that is a multiple of {KV_QK}; this model's is "
                             f"{cfg.head_dim}")


def kv_bytes_per_token(cfg: ModelConfig, kv_type: str) -> int:
    """Bytes a position takes in one slot's cache, K and V of every layer (q8_0: 34 bytes per 32 values)."""
    hd = cfg.head_dim
    per_head = {"f32": 4 * hd, "f16": 2 * hd, "q8_0": hd + hd // KV_QK * 2}[kv_type]
    return 2 * cfg.n_layers * cfg.n_kv_heads * per_head


def unsupported_reason(cfg: ModelConfig, source: Any) -> str | None:
    """Why the native engine cannot run a model, or None if it can (Model falls back on the reference)."""
    if cfg.act not in ("silu", "gelu_tanh"):
        return f"activation {cfg.act!r} has no native kernel"
    return None


def _release_pages(views: list[np.ndarray]) -> None:
    """Drops this process's mapping of the file pages under views (read-only mmap views of the model
    file that were copied into repacked matrices): they would otherwise stay resident for nothing. The
    kernel reads them back from the file if anything touches them again."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    def file_mapped(v: Any) -> bool:  # a read-only view whose memory is an mmap (of the model file)
        if v.flags.writeable:
            return False
        b = v
        while b is not None and not isinstance(b, mmap.mmap):
            b = b.obj if isinstance(b, memoryview) else getattr(b, "base", None)
        return b is not None

    page = mmap.PAGESIZE
    for v in views:
        if not file_mapped(v):  # anonymous memory would come back as zeros
            continue
        lo = -(-v.ctypes.data // page) * page
        hi = (v.ctypes.data + v.nbytes) // page * page
        if hi > lo:
            libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


class DebugContext:
    """What a replacement op or an observer sees: the engine's buffers for the current chunk."""

    def __init__(self, engine: NativeEngine, T: int, n_out: int) -> None:
        self.engine = engine
        self.T = T
        self.n_out = n_out
        self.tokens = engine._tok[:T]
        self.positions = engine._pos[:T]
        self.slots = engine._slot[:T]
        self.selected = engine._rows[:n_out]   # rows of x whose logits are wanted

    def rows(self, op: Op) -> int:
        return self.n_out if op.rows == "selected" else self.T

    def buf(self, name: str, rows: int | None = None) -> np.ndarray:
        """A writable view [rows, width] of buffer `name` (rows defaults to T)."""
        return self.engine._view(name, self.T if rows is None else rows)

    def output(self, op: Op) -> np.ndarray:
        return self.buf(op.out, self.rows(op))


Hook = Callable[[Op, DebugContext], None]


class NativeEngine:
    """The C executor's forward pass over a KV cache (one region per slot) allocated at load."""

    def __init__(self, cfg: ModelConfig, source: Any, n_ctx: int | None = None, threads: int | None = None,
                 n_slots: int = 1, chunk: int = 64, pin: bool = False, kv_type: str = "f16",
                 adaptive_threads: bool = True, activations: str = "q8x2") -> None:
        check_kv_type(kv_type, cfg)
        check_tensors(cfg, source.tensors)
        reason = unsupported_reason(cfg, source)
        if reason is not None:
            raise FormatError(f"the native engine cannot run this model: {reason}")
        if cfg.n_heads % cfg.n_kv_heads:
            raise InvalidRequest("n_heads must be a multiple of n_kv_heads")
        self.cfg = cfg
        self.n_ctx = int(n_ctx or cfg.context_length)
        self.n_vocab = cfg.n_vocab
        self.n_slots = int(n_slots)
        self.chunk = int(chunk)
        self.threads = int(threads or default_threads())
        if self.n_ctx < 1 or self.n_slots < 1 or not 1 <= self.chunk <= 4096 or not 1 <= self.threads <= 256:
            raise InvalidRequest(f"bad engine sizes: n_ctx={n_ctx} n_slots={n_slots} chunk={chunk} threads={threads}")
        self.kv_type = kv_type
        if activations not in ACTIVATIONS:
            raise InvalidRequest(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
        self.activations = activations
        self._source = source
        self._pool = nat.Pool(self.threads, bool(pin))
        self.ops: list[Op] = llama_plan(cfg)
        self._check_memory()
        self._alloc()
        self._matrices: dict[tuple[str, ...], list[tuple[int, int, int, int, np.ndarray]]] = {}
        self._norms: dict[str, np.ndarray] = {}
        self._dequantized: dict[str, np.ndarray] = {}
        try:
            self._plan = self._compile(fuse=True)
        except ValueError as e:  # the C core refused an op: say which, as a BarellmError
            if isinstance(e, InvalidRequest):
                raise
            raise NativeUnsupported(f"the native engine cannot run this model: {e}") from None
        self._plan.set_adaptive(bool(adaptive_threads))
        self._debug_plan: Any = None

    # --- buffers ------------------------------------------------------------------------------

    def _check_memory(self) -> None:
        """What _alloc will take, against the machine's available memory (the weights are mapped, not counted)."""
        cfg = self.cfg
        kv = self.n_slots * kv_bytes_per_token(cfg, self.kv_type)
        bases = len({cfg.layer_rope_theta(i) for i in range(cfg.n_layers)})
        rope = bases * cfg.rope_dim * 24  # the float32 table, and the float64 angles, cosines and sines it comes from
        pad = _round_up(self.n_ctx, KV_TILE) - self.n_ctx
        scratch = 4 * self.chunk * sum(_round_up(w, FLOAT_ALIGN) for w in buffer_widths(cfg).values())
        check_memory("native", self.n_ctx, kv, rope, scratch + pad * (kv + rope), fixed_what="buffers")

    def _alloc(self) -> None:
        cfg, T = self.cfg, self.chunk
        self._widths = buffer_widths(cfg)
        self._bufs = {name: aligned_zeros((T, _round_up(w, FLOAT_ALIGN))) for name, w in self._widths.items()}
        self._qbufs: dict[tuple[str, int, int, int], np.ndarray] = {}
        self.n_ctx_pad = _round_up(self.n_ctx, KV_TILE)
        hd, nkv, L = cfg.head_dim, cfg.n_kv_heads, cfg.n_layers
        # K: [slot][layer][kv head][n_ctx / tile][head_dim][tile]; V: [slot][layer][kv head][n_ctx][head_dim];
        # q8_0 (bytes): K [slot][layer][kv head][n_ctx / tile][tile's int8 values, then its f16 scales],
        # V [slot][layer][kv head][n_ctx][a row's int8 values, then its scales] (ops.h)
        tiles = self.n_ctx_pad // KV_TILE
        if self.kv_type == "q8_0":
            per_pos = hd + hd // KV_QK * 2
            self.k_cache = lazy_zeros((self.n_slots, L, nkv, tiles, KV_TILE * per_pos), np.uint8)
            self.v_cache = lazy_zeros((self.n_slots, L, nkv, self.n_ctx_pad, per_pos), np.uint8)
        else:
            per_pos = hd
            kv_dtype = np.float16 if self.kv_type == "f16" else np.float32
            self.k_cache = lazy_zeros((self.n_slots, L, nkv, tiles, hd, KV_TILE), kv_dtype)
            self.v_cache = lazy_zeros((self.n_slots, L, nkv, self.n_ctx_pad, hd), kv_dtype)
        self._layer_elems = nkv * self.n_ctx_pad * per_pos  # in the cache's elements (q8_0: bytes)
        self._slot_elems = L * self._layer_elems
        # RoPE tables [n_ctx, rope_dim]: cos then sin of position * base^(-2i/rope_dim), one per base. Filled
        # when positions come into use (_rope_upto): all 4096 positions' cosines and sines take 7-14 ms of
        # libm, most of them for positions a short exchange never reaches. Each entry is computed on its own,
        # so a table filled in two pieces holds exactly what one filled at once does.
        self._rope_cs: dict[float, np.ndarray] = {}
        self._rope_inv: dict[float, np.ndarray] = {}
        self._rope_filled = 0
        factors = np.asarray(self._source.dequantize("rope_freqs.weight"), np.float64) if cfg.rope_freqs else None
        for base in sorted({cfg.layer_rope_theta(i) for i in range(L)}):
            self._rope_inv[base] = rope_frequencies(cfg.rope_dim, base, factors)
            self._rope_cs[base] = aligned_zeros((self.n_ctx_pad, cfg.rope_dim))
        # per-call inputs the plan reads
        self._tok = aligned_zeros(T, np.int32)
        self._pos = aligned_zeros(T, np.int32)
        self._slot = aligned_zeros(T, np.int32)
        self._rows = aligned_zeros(T, np.int32)
        self._iota = np.arange(T, dtype=np.int32)

    def _rope_upto(self, n: int) -> None:
        """Fills the RoPE tables for positions below n: the first ROPE_FIRST positions at the first call that
        needs no more, and all the rest at the call that needs any of them (once: the token loop allocates
        nothing after)."""
        if n <= self._rope_filled:
            return
        lo = self._rope_filled
        hi = min(self.n_ctx_pad, ROPE_FIRST) if n <= ROPE_FIRST else self.n_ctx_pad
        for base, table in self._rope_cs.items():
            ang = np.outer(np.arange(lo, hi, dtype=np.float64), self._rope_inv[base])
            table[lo:hi] = np.concatenate([np.cos(ang), np.sin(ang)], axis=1)
        self._rope_filled = hi

    def _view(self, name: str, rows: int) -> np.ndarray:
        return self._bufs[name][:rows, :self._widths[name]]

    def _spec(self, name: str, col: int = 0) -> tuple[np.ndarray, int]:
        """C buffer spec of buffer `name` starting at column col."""
        return (self._bufs[name], 4 * col)

    def _stride(self, name: str) -> int:
        return self._bufs[name].shape[1]

    def _qbuf(self, src: str, mat: tuple) -> np.ndarray:
        """Quantized-activation buffer for rows of `src` converted for matrices like `mat`."""
        type_id, layout, _, cols, _, act = mat
        key = (src, type_id, layout, act)
        if key not in self._qbufs:
            rb = nat.act_row_bytes(type_id, layout, cols, act)
            self._qbufs[key] = aligned_zeros((self.chunk, rb), np.uint8)
        return self._qbufs[key]

    # --- weights ------------------------------------------------------------------------------

    def _stored(self, name: str) -> tuple[int, int, np.ndarray]:
        """A tensor's (type, layout, bytes) as the file stores them: a read-only view of the mapping, no copy.
        A GGUF file stores rows; a .blm file the layout its table names (the model cache: the kernels')."""
        info = self._source.tensors[name]
        layout = int(getattr(info, "layout", LAYOUT_ROWS))
        data = self._source.stored(name) if hasattr(self._source, "stored") else self._source.raw(name)
        return int(info.type), layout, np.asarray(data).view(np.uint8).reshape(-1)

    def _shape2(self, name: str) -> tuple[int, int]:
        shape = tuple(self._source.tensors[name].shape)
        cols = int(shape[-1]) if shape else 1
        return (int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1), cols

    def _stored_as(self, group: tuple[str, ...], type_id: int, layout: int, rows: int, cols: int) -> np.ndarray | None:
        """The group's matrix straight from the file when the file stores it in `layout` already: a view of the
        mapping when its parts lie back to back there (the model cache writes fused groups so: no copy, no
        repacking), else one concatenation of the parts' views; None when the file stores them otherwise."""
        nbytes = kernels.matrix_bytes(type_id, layout, rows, cols)
        infos = [self._source.tensors[n] for n in group]
        if layout == LAYOUT_ROWS and len(group) == 1:  # GGUF rows used as they are
            data = self._stored(group[0])[2]
            return data if data.ctypes.data % 32 == 0 and data.size == nbytes else None
        if any(int(getattr(i, "layout", LAYOUT_ROWS)) != layout for i in infos):
            return None
        if any(int(i.shape[0]) % kernels.layout_rows(layout) for i in infos[:-1]):  # parts end on whole groups
            return None
        span = self._source.span(group) if hasattr(self._source, "span") else None
        if span is not None and span.size == nbytes:
            return span
        views = [self._stored(n)[2] for n in group]
        if sum(v.size for v in views) != nbytes:
            return None
        if len(views) == 1:
            return views[0]
        data = aligned_zeros(nbytes, np.uint8)
        np.concatenate(views, out=data)
        return data

    def _dequant(self, name: str) -> np.ndarray:
        """float32 copy of a tensor (debug path and types the kernels lack)."""
        if name not in self._dequantized:
            shape = tuple(self._source.tensors[name].shape)
            rows, cols = self._shape2(name)
            type_id, layout, data = self._stored(name)
            out = aligned_zeros((rows, cols))
            if kernels.matrix_bytes(type_id, layout, rows, cols) == data.size and kernels.row_bytes(type_id, cols):
                kernels.dequantize_rows(type_id, layout, rows, cols, data, out=out)
            else:  # a type the native table does not know: the NumPy codec
                out[:] = np.asarray(self._source.dequantize(name), dtype=np.float32).reshape(rows, cols)
            self._dequantized[name] = out.reshape(shape)
        return self._dequantized[name]

    def _table_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """float32 rows of a matrix (embedding lookups on the debug path, without dequantizing it all)."""
        if name in self._dequantized:
            return self._dequantized[name][rows]
        type_id, layout, n, cols, data = self._table(name)
        return kernels.dequantize_rows(type_id, layout, n, cols, data, which=rows)

    def _norm(self, name: str) -> np.ndarray:
        if name not in self._norms:
            type_id, layout, data = self._stored(name)
            w = data.view(np.float32) if type_id == F32 and layout == LAYOUT_ROWS else self._dequant(name).reshape(-1)
            self._norms[name] = np.ascontiguousarray(w, dtype=np.float32)
        return self._norms[name]

    def _bias(self, names: tuple[str, ...]) -> np.ndarray:
        """The biases of a fused matmul, concatenated as its rows are (float32, read once at load)."""
        key = "|".join(names)
        if key not in self._norms:
            self._norms[key] = np.ascontiguousarray(np.concatenate([self._norm(n) for n in names]), np.float32)
        return self._norms[key]

    def _matrix(self, names: tuple[str, ...]) -> list[tuple[int, int, int, int, np.ndarray]]:
        """The matmul parts for the row-concatenation of `names`: one fused matrix when their types agree,
        else one part per tensor. Each part is (type, layout, rows, cols, data)."""
        if names in self._matrices:
            return self._matrices[names]
        cols = int(self._source.tensors[names[0]].shape[1])
        groups: list[tuple[str, ...]] = []  # runs of consecutive tensors of one type are fused
        for n in names:
            if groups and self._source.tensors[groups[-1][0]].type == self._source.tensors[n].type:
                groups[-1] = (*groups[-1], n)
            else:
                groups.append((n,))
        parts = []
        for group in groups:
            type_id = int(self._source.tensors[group[0]].type)
            rows = sum(int(self._source.tensors[n].shape[0]) for n in group)
            if matmul_supported(type_id, rows, cols):
                layout = matrix_layout(type_id, rows, cols)
                stored = self._stored_as(group, type_id, layout, rows, cols)
                if stored is not None:
                    parts.append((type_id, layout, rows, cols, stored))
                    continue
                raw = [self._rows_of(n) for n in group]
                src = raw[0] if len(raw) == 1 else np.concatenate(raw)
            else:  # a type the kernels lack: exact float32 rows
                type_id = F32
                src = np.concatenate([self._dequant(n).reshape(-1, cols) for n in group]).view(np.uint8)
            layout = matrix_layout(type_id, rows, cols)
            data = aligned_zeros(kernels.matrix_bytes(type_id, layout, rows, cols), np.uint8)
            kernels.repack(type_id, layout, rows, cols, src, out=data, threads=self.threads)
            _release_pages([self._stored(n)[2] for n in group])  # (embedding lookups fault rows back in)
            parts.append((type_id, layout, rows, cols, data))
        self._matrices[names] = parts
        return parts

    def _rows_of(self, name: str) -> np.ndarray:
        """A tensor's bytes in GGUF rows: the file's view, or a converted copy of another stored layout."""
        type_id, layout, data = self._stored(name)
        if layout == LAYOUT_ROWS:
            return data
        rows, cols = self._shape2(name)
        return kernels.unrepack(type_id, layout, rows, cols, data, threads=self.threads)

    def _table(self, name: str) -> tuple[int, int, int, int, np.ndarray]:
        """The embedding table as the embed op reads it: the matrix as stored (any layout the kernels know,
        so a tied table stored in the kernels' layout serves the lookups and the output matmul from one
        mapping), or exact float32 rows for a type without kernels."""
        rows, cols = self._shape2(name)
        type_id, layout, data = self._stored(name)
        readable = kernels.matrix_bytes(type_id, layout, rows, cols) == data.size
        if not (kernels.act_supported(type_id, ACT_Q8) and readable):
            type_id, layout, data = F32, LAYOUT_ROWS, self._dequant(name).reshape(-1).view(np.uint8)
        return type_id, layout, rows, cols, data

    # --- compiling ----------------------------------------------------------------------------

    def _compile(self, fuse: bool) -> Any:
        specs = [self._op_spec(op) for op in self.ops]
        if fuse:  # quantize a matmul's input in the epilogue of the op that produced it (saves a barrier)
            for k in range(1, len(self.ops)):
                op, prev = self.ops[k], self.ops[k - 1]
                if (isinstance(op, MatMul) and isinstance(prev, (RMSNorm, GatedAct)) and prev.out == op.x
                        and prev.rows == op.rows and specs[k].get("qjobs")):
                    specs[k - 1]["qjobs"] = [dict(j, x=None) for j in specs[k]["qjobs"]]
                    specs[k]["prequantized"] = 1
        return nat.Plan(self._pool, specs, self._tok, self._pos, self._slot, self._rows, self.chunk, self.chunk,
                        self.n_vocab, self.n_ctx, self.n_slots)

    def _op_spec(self, op: Op) -> dict[str, Any]:
        """The executor's dict for one op: exactly the keys its kind takes (py_engine.c refuses others)."""
        cfg = self.cfg
        d: dict[str, Any] = {"kind": KIND_IDS[op.kind], "name": op.name, "rows_sel": int(op.rows == "selected")}
        if isinstance(op, Embed):
            table = self._table(op.table)
            d.update(out=self._spec(op.out), out_stride=self._stride(op.out), n=cfg.dim, table=table,
                     scale_embed=float(np.float32(op.scale)))
        elif isinstance(op, RMSNorm):
            d.update(x=self._spec(op.src), x_stride=self._stride(op.src), w=self._norm(op.weight), eps=op.eps,
                     n=self._widths[op.src])
            if op.accumulate:  # out += rmsnorm(x): normalize x in place, then add
                d.update(out=self._spec(op.src), out_stride=self._stride(op.src), res=self._spec(op.out),
                         res_stride=self._stride(op.out))
            else:
                d.update(out=self._spec(op.out), out_stride=self._stride(op.out))
        elif isinstance(op, MatMul):
            parts = [(*p, matrix_act(p[0], self.activations)) for p in self._matrix(op.matrices)]
            bias = self._bias(op.bias) if op.bias else None
            qjobs, qmap, pspecs = [], {}, []
            col = 0
            for p in parts:
                key = (p[0], p[1], p[5])
                if key not in qmap:
                    qb = self._qbuf(op.src, p)
                    qmap[key] = qb
                    qjobs.append({"w": (p[0], p[1], p[2], p[3], None, p[5]), "x": self._spec(op.src),
                                  "x_stride": self._stride(op.src), "dst": qb, "dst_stride": qb.shape[1]})
                target = "proj" if op.accumulate else op.out
                ps = {"w": p, "xq": qmap[key], "out": self._spec(target, col), "ldo": self._stride(target)}
                if bias is not None:
                    ps["bias"] = bias[col:col + p[2]]
                if op.accumulate:
                    ps.update(res=self._spec(op.out, col), res_stride=self._stride(op.out))
                pspecs.append(ps)
                col += p[2]
            d.update(parts=pspecs, qjobs=qjobs)
        elif isinstance(op, (RopeKV, Attention)):
            off = self.k_cache.itemsize * op.layer * self._layer_elems
            d.update(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, n_ctx=self.n_ctx_pad,
                     kc=(self.k_cache, off), vc=(self.v_cache, off), slot_stride=self._slot_elems,
                     kv_type=KV_TYPES[self.kv_type])
            if isinstance(op, RopeKV):
                if op.q_norm and op.k_norm:
                    d.update(q_norm=self._norm(op.q_norm), k_norm=self._norm(op.k_norm))
                if op.k_bias and self.kv_type == "q8_0":
                    d.update(k_shift=self._norm(op.k_bias))
                d.update(out=self._spec(op.out), out_stride=self._stride(op.out), rope_dim=cfg.rope_dim,
                         eps=op.eps, rope_style=0 if cfg.rope_style == "norm" else 1,
                         rope_cs=self._rope_cs[cfg.layer_rope_theta(op.layer)])
            else:
                d.update(x=self._spec(op.src), x_stride=self._stride(op.src), out=self._spec(op.out),
                         out_stride=self._stride(op.out), scale=float(np.float32(cfg.scale)), window=op.window)
        elif isinstance(op, GatedAct):
            f = cfg.ffn_dim
            d.update(x=self._spec(op.src), x2=self._spec(op.src, f), x_stride=self._stride(op.src),
                     out=self._spec(op.out), out_stride=self._stride(op.out), n=f, gelu=int(op.act == "gelu_tanh"))
        else:
            raise InvalidRequest(f"op {op.name}: the native engine has no kind {op.kind!r}")
        return d

    # --- running ------------------------------------------------------------------------------

    def _check(self, tokens: Sequence[int], start: int, slot: int) -> np.ndarray:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or len(ids) == 0:
            raise InvalidRequest("forward needs a non-empty sequence of token ids")
        if ids.dtype.kind not in "iu":
            raise InvalidRequest(f"token ids must be integers, got {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.n_vocab:
            raise InvalidRequest(f"token id out of range 0..{self.n_vocab - 1}")
        if not isinstance(start, (int, np.integer)) or start < 0 or start + len(ids) > self.n_ctx:
            raise InvalidRequest(f"positions {start}..{start + len(ids) - 1} do not fit the context of {self.n_ctx}")
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise InvalidRequest(f"slot {slot} out of range 0..{self.n_slots - 1}")
        return ids

    def forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0,
                out: np.ndarray | None = None) -> np.ndarray:
        """Feeds tokens at positions start.. of a slot's cache; returns float32 logits [len, n_vocab] if
        all_logits, else [1, n_vocab] for the last token. `out`, if given, receives them (no allocation)."""
        return self._forward(tokens, start, all_logits, slot, out, None)

    def _forward(self, tokens, start, all_logits, slot, out, step) -> np.ndarray:
        ids = self._check(tokens, start, slot)
        n = len(ids)
        shape = (n if all_logits else 1, self.n_vocab)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32:
            raise InvalidRequest(f"out must be float32 {shape}")
        self._rope_upto(start + n)
        logits = self._bufs["logits"]
        for c0 in range(0, n, self.chunk):
            c1 = min(n, c0 + self.chunk)
            T = c1 - c0
            self._tok[:T] = ids[c0:c1]
            np.add(self._iota[:T], start + c0, out=self._pos[:T])
            self._slot[:T] = slot
            if all_logits:
                self._rows[:T] = self._iota[:T]
                n_out = T
            elif c1 == n:
                self._rows[0] = T - 1
                n_out = 1
            else:
                n_out = 0
            if step is None:
                self._plan.run(T, n_out)
            else:
                step(T, n_out)
            if all_logits:
                out[c0:c1] = logits[:T, :self.n_vocab]
            elif n_out:
                out[0] = logits[0, :self.n_vocab]
        return out

    def forward_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> np.ndarray:
        """Several sequences (slot, tokens, start) in shared passes; the last logits of each
        [len(seqs), n_vocab]. Each row is bit-identical to running that sequence alone."""
        tok, pos, slot, lens = self._pack(seqs, "forward_batch")
        dest = np.full(len(tok), -1, np.int64)
        dest[np.cumsum(lens) - 1] = np.arange(len(seqs))
        out = np.empty((len(seqs), self.n_vocab), np.float32)
        self._run_rows(tok, pos, slot, dest, len(self.ops), self._bufs["logits"], out)
        return out

    def hidden_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]], last_only: bool = False,
                     out: np.ndarray | None = None) -> np.ndarray:
        """The final normed hidden states (the output norm's result, what the logits are made from) of
        several sequences (slot, tokens, start), fed into their slots' caches as forward_batch feeds them:
        every token's row in order, [sum of lengths, dim], or with last_only each sequence's last,
        [len(seqs), dim]. The plan runs to the output norm and stops before the vocabulary matmul; nothing is
        allocated but the result (pass `out` to avoid even that). Each row is bit-identical however the
        sequences are batched or chunked."""
        tok, pos, slot, lens = self._pack(seqs, "hidden_batch")
        if last_only:
            dest = np.full(len(tok), -1, np.int64)
            dest[np.cumsum(lens) - 1] = np.arange(len(seqs))
        else:
            dest = np.arange(len(tok), dtype=np.int64)
        shape = (len(seqs) if last_only else len(tok), self.cfg.dim)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32:
            raise InvalidRequest(f"out must be float32 {shape}")
        if self.ops[-1].name != "output" or self.ops[-2].out != "xo":
            raise InvalidRequest("this plan does not end with the output norm and matmul")
        self._run_rows(tok, pos, slot, dest, len(self.ops) - 1, self._bufs["xo"], out)  # all but the vocabulary
        return out

    def _pack(self, seqs: Sequence[tuple[int, Sequence[int], int]], what: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """Checks sequences (slot, tokens, start), each in its own slot, and lays their token ids, positions and
        slots end to end, with each one's length; fills the RoPE tables as far as their positions go."""
        if not seqs:
            raise InvalidRequest(f"{what} needs at least one sequence")
        slots = [s for s, _, _ in seqs]
        if len(set(slots)) != len(slots):
            raise InvalidRequest(f"{what}: each sequence needs its own slot")
        ids = [self._check(tokens, start, slot) for slot, tokens, start in seqs]
        tok = np.concatenate([i.astype(np.int32) for i in ids])
        pos = np.concatenate([np.arange(start, start + len(i), dtype=np.int32)
                              for (_, _, start), i in zip(seqs, ids, strict=True)])
        slot = np.concatenate([np.full(len(i), s, np.int32) for s, i in zip(slots, ids, strict=True)])
        self._rope_upto(int(pos.max()) + 1)
        return tok, pos, slot, [len(i) for i in ids]

    def _run_rows(self, tok: np.ndarray, pos: np.ndarray, slot: np.ndarray, dest: np.ndarray, end: int,
                  src: np.ndarray, out: np.ndarray) -> None:
        """Runs ops [0, end) over the packed tokens a chunk at a time; the result row of token t (in `src`, the
        buffer the last op writes) goes to out[dest[t]] where dest[t] >= 0, and only those rows are computed
        past the ops that select rows."""
        width = out.shape[1]
        for c0 in range(0, len(tok), self.chunk):
            c1 = min(len(tok), c0 + self.chunk)
            T = c1 - c0
            self._tok[:T] = tok[c0:c1]
            self._pos[:T] = pos[c0:c1]
            self._slot[:T] = slot[c0:c1]
            sel = np.nonzero(dest[c0:c1] >= 0)[0]
            self._rows[:len(sel)] = sel
            self._plan.run(T, len(sel), 0, end)
            out[dest[c0:c1][sel]] = src[:len(sel), :width]

    # --- introspection and debugging ----------------------------------------------------------

    def op_index(self, key: int | str) -> list[int]:
        """Indices of the ops an int index, an exact name, or a glob pattern ("blk.*.rope") picks."""
        if isinstance(key, (int, np.integer)):
            return [int(key)]
        return [i for i, op in enumerate(self.ops) if op.name == key or fnmatch.fnmatchcase(op.name, key)]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copies the KV entries of positions 0..n-1 from slot src to slot dst (n choices of one prompt share
        its prefill). Whole tiles of K are copied: the positions past n in the last one are never read before
        dst writes them."""
        if not (0 <= src < self.n_slots and 0 <= dst < self.n_slots and 0 <= n <= self.n_ctx):
            raise InvalidRequest(f"copy_prefix: slots {src}, {dst} of {self.n_slots}, {n} positions of {self.n_ctx}")
        if src != dst and n:
            tiles = -(-n // KV_TILE)
            self.k_cache[dst, :, :, :tiles] = self.k_cache[src, :, :, :tiles]
            self.v_cache[dst, :, :, :n] = self.v_cache[src, :, :, :n]

    def kv(self, slot: int, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the first n cached positions of a slot and layer, as float32 values (a q8_0 cache's
        dequantized, its keys turned back and shifted back: quant.q8_0_keys_join): K, V [n, n_kv_heads, head_dim]."""
        nkv, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        if self.kv_type == "q8_0":
            (kq, kd), (vq, vd) = self._q8_views(slot, layer)
            kq = kq.transpose(0, 1, 3, 2).reshape(nkv, self.n_ctx_pad, hd)[:, :n].transpose(1, 0, 2)
            kd = kd.transpose(0, 1, 3, 2).reshape(nkv, self.n_ctx_pad, hd // KV_QK)[:, :n].transpose(1, 0, 2)
            k = q8_0_keys_join(kq, kd, self._k_shift(layer))
            return k, q8_0_join(vq[:, :n], vd[:, :n]).transpose(1, 0, 2)
        kc = self.k_cache[slot, layer]  # [nkv, tiles, hd, tile]
        k = kc.transpose(0, 1, 3, 2).reshape(nkv, self.n_ctx_pad, hd)[:, :n]
        v = self.v_cache[slot, layer][:, :n]
        return k.transpose(1, 0, 2).astype(np.float32), v.transpose(1, 0, 2).astype(np.float32)

    def _k_shift(self, layer: int) -> np.ndarray | None:
        """What a q8_0 cache subtracts from the keys of a layer [n_kv_heads, head_dim] (the K projection's bias),
        or None."""
        bias = next((op.k_bias for op in self.ops if isinstance(op, RopeKV) and op.layer == layer), None)
        return None if bias is None else self._norm(bias).reshape(self.cfg.n_kv_heads, self.cfg.head_dim)

    def _q8_views(self, slot: int, layer: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """A q8_0 cache's parts for a slot and layer, as writable views: K's int8 values [nkv, tiles, hd, tile]
        and scales [nkv, tiles, hd / 32, tile], V's values [nkv, n_ctx, hd] and scales [nkv, n_ctx, hd / 32]."""
        nkv, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        kc, vc = self.k_cache[slot, layer], self.v_cache[slot, layer]
        tiles = kc.shape[1]
        kq = kc[..., :KV_TILE * hd].view(np.int8).reshape(nkv, tiles, hd, KV_TILE)
        kd = kc[..., KV_TILE * hd:].view(np.float16).reshape(nkv, tiles, hd // KV_QK, KV_TILE)
        return (kq, kd), (vc[..., :hd].view(np.int8), vc[..., hd:].view(np.float16))

    def debug_forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0, *,
                      backend: str = "native", replace: dict[int | str, Hook] | None = None,
                      observe: Callable[[Op, np.ndarray, DebugContext], None] | None = None) -> np.ndarray:
        """forward(), one op at a time.

        backend: "native" runs each op's C kernel, "numpy" runs NumPy implementations of the ops.
        replace: {op index | name | glob: fn(op, ctx)}: fn computes that op instead (writes ctx.output(op)
            and whatever else the op writes, e.g. the KV cache for rope_kv).
        observe: fn(op, output_view, ctx) after every op (output_view is live: copy to keep it).
        """
        if backend not in ("native", "numpy"):
            raise InvalidRequest("backend must be 'native' or 'numpy'")
        hooks: dict[int, Hook] = {}
        for key, fn in (replace or {}).items():
            idx = self.op_index(key)
            if not idx:
                raise InvalidRequest(f"no op matches {key!r}")
            for i in idx:
                hooks[i] = fn
        if backend == "native" and self._debug_plan is None:
            self._debug_plan = self._compile(fuse=False)

        def step(T: int, n_out: int) -> None:
            ctx = DebugContext(self, T, n_out)
            for i, op in enumerate(self.ops):
                if i in hooks:
                    hooks[i](op, ctx)
                elif backend == "numpy":
                    self._numpy_op(op, ctx)
                else:
                    self._debug_plan.run(T, n_out, i, i + 1)
                if observe is not None:
                    observe(op, ctx.output(op), ctx)

        return self._forward(tokens, start, all_logits, slot, None, step)

    def profile(self, tokens: Sequence[int], start: int, slot: int = 0, repeat: int = 1) -> dict[str, float]:
        """TSC cycles spent per op by the calling thread (its work plus the barrier wait), summed over
        `repeat` forward calls of tokens at start; keyed by op name. profile_threads() has every thread's."""
        return dict(zip([op.name for op in self.ops], self.profile_threads(tokens, start, slot, repeat)[0].tolist(),
                        strict=True))

    def read_pass(self, data: np.ndarray) -> float:
        """Seconds for this engine's threads to read `data` once, each its contiguous share (as bench/roofline.c
        reads): the ceiling of a decode that streams those bytes, measured with the same threads and pages."""
        return float(self._pool.read(data)[0])

    def profile_threads(self, tokens: Sequence[int], start: int, slot: int = 0, repeat: int = 1) -> np.ndarray:
        """Cycles [thread, op] (work plus barrier wait), summed over `repeat` calls."""
        cycles = np.zeros((self.threads, len(self.ops)), np.uint64)
        self._plan.set_profile(cycles)
        try:
            for _ in range(repeat):
                self.forward(tokens, start, slot=slot)
        finally:
            self._plan.set_profile(None)
        return cycles

    # NumPy implementations of the op kinds (the debug backend; slow and plain)

    def _numpy_op(self, op: Op, ctx: DebugContext) -> None:
        from barellm.arch import llama as ref

        cfg, T = self.cfg, ctx.T
        if isinstance(op, Embed):
            x = self._table_rows(op.table, ctx.tokens)
            ctx.output(op)[:] = x * np.float32(op.scale) if op.scale != 1.0 else x
        elif isinstance(op, RMSNorm):
            x = ctx.buf(op.src)
            if op.selected:
                x = x[ctx.selected]
            y = ref.rmsnorm(x, self._norm(op.weight), op.eps)
            if op.accumulate:
                x[:] = y
                ctx.output(op)[:] += y
            else:
                ctx.output(op)[:] = y
        elif isinstance(op, MatMul):
            key = "|".join(op.matrices)
            if key not in self._dequantized:
                self._dequantized[key] = np.concatenate([self._dequant(n) for n in op.matrices])
            w = self._dequantized[key]
            x = ctx.buf(op.src, ctx.rows(op))
            y = (x @ w.T).astype(np.float32)
            if op.bias:
                y += self._bias(op.bias)
            if op.accumulate:
                ctx.buf("proj")[:] = y
                ctx.output(op)[:] += y
            else:
                ctx.output(op)[:] = y
        elif isinstance(op, RopeKV):
            qkv = ctx.buf(op.out)
            hd, qd, kd = cfg.head_dim, cfg.q_dim, cfg.kv_dim
            half = cfg.rope_dim // 2
            cs = self._rope_cs[cfg.layer_rope_theta(op.layer)][ctx.positions]
            cos, sin = cs[:, :half], cs[:, half:]
            q = qkv[:, :qd].reshape(T, cfg.n_heads, hd)
            k = qkv[:, qd:qd + kd].reshape(T, cfg.n_kv_heads, hd)
            if op.q_norm and op.k_norm:
                q = ref.rmsnorm(q, self._norm(op.q_norm), op.eps)
                k = ref.rmsnorm(k, self._norm(op.k_norm), op.eps)
            q = ref.rope(q, cos, sin, cfg.rope_style)
            k = ref.rope(k, cos, sin, cfg.rope_style)
            qkv[:, :qd] = q.reshape(T, qd)
            qkv[:, qd:qd + kd] = k.reshape(T, kd)
            v = qkv[:, qd + kd:qd + 2 * kd].reshape(T, cfg.n_kv_heads, hd)
            for t in range(T):
                s, p = int(ctx.slots[t]), int(ctx.positions[t])
                if self.kv_type == "q8_0":
                    (kq, kd), (vq, vd) = self._q8_views(s, op.layer)
                    kq[:, p // KV_TILE, :, p % KV_TILE], kd[:, p // KV_TILE, :, p % KV_TILE] = q8_0_keys(
                        k[t], self._k_shift(op.layer))
                    vq[:, p], vd[:, p] = q8_0_split(v[t])
                    continue
                self.k_cache[s, op.layer, :, p // KV_TILE, :, p % KV_TILE] = k[t]
                self.v_cache[s, op.layer, :, p] = v[t]
        elif isinstance(op, Attention):
            qkv, out = ctx.buf(op.src), ctx.output(op)
            for t in range(T):
                s, p = int(ctx.slots[t]), int(ctx.positions[t])
                k, v = self.kv(s, op.layer, p + 1)
                q = qkv[t:t + 1, :cfg.q_dim].reshape(1, cfg.n_heads, cfg.head_dim)
                out[t] = ref.attention(q, k, v, p, cfg.scale, op.window)[0]
        elif isinstance(op, GatedAct):
            gu, f = ctx.buf(op.src), cfg.ffn_dim
            ctx.output(op)[:] = ref.ACTIVATIONS[op.act](gu[:, :f]) * gu[:, f:2 * f]
        else:
            raise InvalidRequest(f"op {op.name}: no NumPy implementation of kind {op.kind!r}")
