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

The engine has its weights (runtime/weights.py: their layouts, fusing, repacking) and a per-op debugger
(runtime/debug.py: the same plan one op at a time, by native kernels or NumPy implementations); the KV
cache's types and memory are runtime/kv_cache.py's.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from barellm import _native as nat
from barellm.arch.config import ModelConfig, check_tensors
from barellm.arch.llama import rope_frequencies
from barellm.arch.plan import (
    Attention,
    Embed,
    GatedAct,
    MatMul,
    MoE,
    Op,
    RMSNorm,
    RopeKV,
    SoftCap,
    buffer_widths,
    llama_plan,
)
from barellm.cpu import check_memory, default_threads
from barellm.errors import FormatError, InvalidRequest
from barellm.formats.kernels import ACTIVATIONS, layout_rows, matrix_act, matrix_bytes
from barellm.formats.kv_q8 import q8_0_join, q8_0_keys_join
from barellm.runtime.debug import DebugContext, Debugger, Hook
from barellm.runtime.kv_cache import KV_QK, KV_TYPES, check_kv_type, kv_bytes_per_token, lazy_zeros
from barellm.runtime.weights import Weights, aligned_zeros

KIND_IDS: dict[str, int] = dict(nat.OP_KINDS)  # the op kinds the executor has, and their ids (py_plan.c)
KV_TILE = nat.KV_TILE
FLOAT_ALIGN = 16  # buffer rows start on cache lines: strides are multiples of 16 floats
MOE_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # the moe op's activations (executor.h, bl_moe_act)
ROPE_FIRST = 512  # positions of the RoPE tables filled by the first forward call (see _rope_upto)
# Tokens one native call runs at most (the buffers' rows). A mixture of experts reads every expert a call's
# tokens choose, and 64 tokens choosing 8 of 128 experts each choose nearly all of them: in calls of 512 each
# expert's weights are read once for 8 times the tokens, and its matmuls run ~32 tokens instead of ~4
# (Qwen3-30B-A3B's layers, 2 threads of a Zen 4 EPYC: pp512 62 -> 84 tokens/s). Rows a call leaves
# unwritten (the logits' but the last) are never touched, so they take no memory.
CHUNK, MOE_CHUNK = 64, 512


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class NativeUnsupported(FormatError):
    """A legal model the native core refuses to plan (a combination of types or shapes it has no path for).
    engine="auto" falls back on the reference engine; engine="native" reports it."""


def unsupported_reason(cfg: ModelConfig, source: Any) -> str | None:
    """Why the native engine cannot run a model, or None if it can (Model falls back on the reference)."""
    if cfg.act not in ("silu", "gelu_tanh") and not (cfg.n_experts and cfg.act in MOE_ACTS):
        return f"activation {cfg.act!r} has no native kernel"
    return None


class NativeEngine:
    """The C executor's forward pass over a KV cache (one region per slot) allocated at load. It has its
    `weights` (runtime/weights.py) and a per-op `debugger` (runtime/debug.py)."""

    def __init__(self, cfg: ModelConfig, source: Any, n_ctx: int | None = None, threads: int | None = None,
                 n_slots: int = 1, chunk: int | None = None, pin: bool = False, kv_type: str = "f16",
                 adaptive_threads: bool = True, activations: str = "q8x2", logit_rows: int | None = None) -> None:
        """logit_rows: compute the logits of the vocabulary's first logit_rows tokens only (a prefix of the output
        matrix's rows, whole groups of 16; the calls return that many columns). For a draft model: its output
        matrix is a large share of what a token reads (Qwen2.5-0.5B's: 30%), and byte-pair vocabularies number
        their tokens roughly by frequency."""
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
        if logit_rows is not None and not 16 <= int(logit_rows):
            raise InvalidRequest(f"logit_rows must be at least 16, got {logit_rows}")
        self.n_logits = cfg.n_vocab if logit_rows is None or logit_rows >= cfg.n_vocab else int(logit_rows) // 16 * 16
        self.n_slots = int(n_slots)
        self.chunk = int(chunk if chunk is not None else MOE_CHUNK if cfg.n_experts else CHUNK)
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
        self.weights = Weights(source, self.threads)
        try:
            self._plan = self._compile(fuse=True)
        except ValueError as e:  # the C core refused an op: say which, as a BarellmError
            if isinstance(e, InvalidRequest):
                raise
            raise NativeUnsupported(f"the native engine cannot run this model: {e}") from None
        self._plan.set_adaptive(bool(adaptive_threads))
        self.debugger = Debugger(self)
        self.executor_seconds = 0.0   # time spent in the C executor so far: the engine calls' "forward" share

    # --- buffers ------------------------------------------------------------------------------

    def _check_memory(self) -> None:
        """What _alloc will take, against the machine's available memory (the weights are mapped, not counted)."""
        cfg = self.cfg
        kv = self.n_slots * kv_bytes_per_token(cfg, self.kv_type)
        bases = len({cfg.layer_rope_table(i) for i in range(cfg.n_layers)})
        rope = bases * cfg.rope_dim * 24  # the float32 table, and the float64 angles, cosines and sines it comes from
        pad = _round_up(self.n_ctx, KV_TILE) - self.n_ctx
        scratch = 4 * self.chunk * sum(_round_up(w, FLOAT_ALIGN) for w in buffer_widths(cfg).values())
        # the experts' rows, one per (token, expert) pair: gate | up, the output, and their converted inputs
        scratch += 4 * self.chunk * cfg.n_experts_used * (4 * cfg.expert_ffn_dim + 3 * cfg.dim + 8)
        check_memory("native", self.n_ctx, kv, rope, scratch + pad * (kv + rope), fixed_what="buffers")

    def _alloc(self) -> None:
        cfg, T = self.cfg, self.chunk
        self._widths = buffer_widths(cfg)
        self._bufs = {name: aligned_zeros((T, _round_up(w, FLOAT_ALIGN))) for name, w in self._widths.items()}
        self._qbufs: dict[tuple[str, int, int, int], np.ndarray] = {}
        self._moe_bufs: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}
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
        # RoPE tables [n_ctx, rope_dim]: cos then sin of position * scale * base^(-2i/rope_dim), one per (base,
        # position scale) pair of the layers (layer_rope_table; the scale is linear RoPE scaling's). Filled
        # when positions come into use (_rope_upto): all 4096 positions' cosines and sines take 7-14 ms of
        # libm, most of them for positions a short exchange never reaches. Each entry is computed on its own,
        # so a table filled in two pieces holds exactly what one filled at once does.
        self._rope_cs: dict[tuple[float, float], np.ndarray] = {}
        self._rope_inv: dict[tuple[float, float], np.ndarray] = {}
        self._rope_filled = 0
        factor_name = cfg.rope_factors(self.n_ctx)
        factors = None if factor_name is None else np.asarray(self._source.dequantize(factor_name), np.float64)
        for key in sorted({cfg.layer_rope_table(i) for i in range(L)}):
            self._rope_inv[key] = rope_frequencies(cfg.rope_dim, key[0], factors, cfg.rope_yarn_factor,
                                                   cfg.rope_original_context, key[1])
            self._rope_cs[key] = aligned_zeros((self.n_ctx_pad, cfg.rope_dim))
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
        for key, table in self._rope_cs.items():
            ang = np.outer(np.arange(lo, hi, dtype=np.float64), self._rope_inv[key])
            cs = np.concatenate([np.cos(ang), np.sin(ang)], axis=1)
            table[lo:hi] = cs * self.cfg.rope_cs_scale if self.cfg.rope_cs_scale != 1.0 else cs
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
        """The executor's dict for one op: exactly the keys its kind takes (py_plan.c refuses others), made by
        the engine's _spec_<kind> (the op table's name, executor.h)."""
        build = getattr(self, f"_spec_{op.kind}", None)
        if op.kind not in KIND_IDS or build is None:
            raise InvalidRequest(f"op {op.name}: the native engine has no kind {op.kind!r}")
        d: dict[str, Any] = {"kind": KIND_IDS[op.kind], "name": op.name, "rows_sel": int(op.rows == "selected")}
        d.update(build(op))
        return d

    def _spec_embed(self, op: Embed) -> dict[str, Any]:
        return dict(out=self._spec(op.out), out_stride=self._stride(op.out), n=self.cfg.dim,
                    table=self.weights.table(op.table), scale_embed=float(np.float32(op.scale)))

    def _spec_rmsnorm(self, op: RMSNorm) -> dict[str, Any]:
        d: dict[str, Any] = dict(x=self._spec(op.src), x_stride=self._stride(op.src), w=self.weights.norm(op.weight),
                                 eps=op.eps, n=self._widths[op.src])
        if op.accumulate:  # out += rmsnorm(x): normalize x in place, then add
            d.update(out=self._spec(op.src), out_stride=self._stride(op.src), res=self._spec(op.out),
                     res_stride=self._stride(op.out))
        else:
            d.update(out=self._spec(op.out), out_stride=self._stride(op.out))
        return d

    def _spec_matmul(self, op: MatMul) -> dict[str, Any]:
        parts = [(*p, matrix_act(p[0], self.activations)) for p in self.weights.matrix(op.matrices)]
        if op.out == "logits" and self.n_logits < self.n_vocab:   # the first rows: a prefix of the bytes
            (type_id, layout, _, cols, data, act), = parts
            parts = [(type_id, layout, self.n_logits, cols,
                      data[:matrix_bytes(type_id, layout, self.n_logits, cols)], act)]
        bias = self.weights.bias(op.bias) if op.bias else None
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
        return dict(parts=pspecs, qjobs=qjobs)

    def _spec_cache(self, layer: int) -> dict[str, Any]:
        """What the ops that read or write a layer's KV cache share."""
        cfg = self.cfg
        off = self.k_cache.itemsize * layer * self._layer_elems
        return dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, n_ctx=self.n_ctx_pad,
                    kc=(self.k_cache, off), vc=(self.v_cache, off), slot_stride=self._slot_elems,
                    kv_type=KV_TYPES[self.kv_type])

    def _spec_rope_kv(self, op: RopeKV) -> dict[str, Any]:
        cfg = self.cfg
        d = self._spec_cache(op.layer)
        if op.q_norm and op.k_norm:
            d.update(q_norm=self.weights.norm(op.q_norm), k_norm=self.weights.norm(op.k_norm))
        if op.k_bias and self.kv_type == "q8_0":
            d.update(k_shift=self.weights.norm(op.k_bias))
        d.update(out=self._spec(op.out), out_stride=self._stride(op.out), rope_dim=cfg.rope_dim if op.rope else 0,
                 eps=op.eps, rope_style=0 if cfg.rope_style == "norm" else 1,
                 rope_cs=self._rope_cs[cfg.layer_rope_table(op.layer)])
        return d

    def _spec_attention(self, op: Attention) -> dict[str, Any]:
        d = self._spec_cache(op.layer)
        d.update(x=self._spec(op.src), x_stride=self._stride(op.src), out=self._spec(op.out),
                 out_stride=self._stride(op.out), scale=float(np.float32(self.cfg.scale)), window=op.window)
        if op.softcap:
            d.update(softcap=float(np.float32(op.softcap)))
        if op.sinks:
            d.update(sinks=self.weights.norm(op.sinks))
        return d

    def _spec_softcap(self, op: SoftCap) -> dict[str, Any]:
        return dict(out=self._spec(op.out), out_stride=self._stride(op.out), softcap=float(np.float32(op.cap)),
                    n=self.n_logits if op.out == "logits" else self._widths[op.out])

    def _spec_silu_mul(self, op: GatedAct) -> dict[str, Any]:
        f = self.cfg.ffn_dim
        return dict(x=self._spec(op.src), x2=self._spec(op.src, f), x_stride=self._stride(op.src),
                    out=self._spec(op.out), out_stride=self._stride(op.out), n=f, gelu=int(op.act == "gelu_tanh"))

    def _moe_buf(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """Scratch of the moe ops, shared by every layer's (they run one after another)."""
        key = (name, shape)
        if key not in self._moe_bufs:
            self._moe_bufs[key] = aligned_zeros(shape, dtype)
        return self._moe_bufs[key]

    def _spec_moe(self, op: MoE) -> dict[str, Any]:
        cfg = self.cfg
        E, K, F, dim = cfg.n_experts, op.n_used, cfg.expert_ffn_dim, cfg.dim
        stacks = {}
        for key, name, rows in (("gate", op.gate, F), ("up", op.up, F), ("down", op.down, dim)):
            (type_id, layout, n, cols, data), = self.weights.matrix((name,))   # one tensor: one part
            if rows % layout_rows(layout):
                raise NativeUnsupported(f"the native engine cannot run this model: {name} has experts of {rows} "
                                        f"rows, not whole groups of {layout_rows(layout)}")
            stacks[key] = (type_id, layout, n, cols, data, matrix_act(type_id, self.activations))
        pairs = self.chunk * K

        def converted(name: str, w: tuple, cols: int) -> np.ndarray:
            return self._moe_buf(name, (pairs, nat.act_row_bytes(w[0], w[1], cols, w[5])), np.uint8)

        xg, aq = converted("xg", stacks["gate"], dim), converted("aq", stacks["down"], F)
        gu = self._moe_buf("gu", (pairs, _round_up(2 * F, FLOAT_ALIGN)), np.float32)
        y = self._moe_buf("y", (pairs, _round_up(dim, FLOAT_ALIGN)), np.float32)
        target = "proj" if op.accumulate else op.out
        d: dict[str, Any] = dict(
            x=self._spec(op.src), x_stride=self._stride(op.src), out=self._spec(target),
            out_stride=self._stride(target), n=dim, act=MOE_ACTS[op.act], logits=self._spec(op.logits),
            logits_stride=self._stride(op.logits), n_experts=E, n_used=K, ffn=F, norm_weights=int(op.norm),
            choice=self._moe_buf("choice", (pairs,), np.int32), weight=self._moe_buf("weight", (pairs,), np.float32),
            index=self._moe_buf("index", (E + 1 + 3 * pairs,), np.int32), xg=xg, xg_stride=xg.shape[1], gu=gu,
            gu_stride=gu.shape[1], aq=aq, aq_stride=aq.shape[1], y=y, y_stride=y.shape[1], **stacks)
        g, u = stacks["gate"], stacks["up"]
        if (g[0], g[1], g[5]) != (u[0], u[1], u[5]):   # up takes other activations: converted on their own
            xg_up = converted("xg_up", u, dim)
            d.update(xg_up=xg_up, xg_up_stride=xg_up.shape[1])
        if op.biases:
            biases = (self.weights.bias((n,)) for n in op.biases)
            d.update(zip(("gate_bias", "up_bias", "down_bias"), biases, strict=True))
        if op.accumulate:
            d.update(res=self._spec(op.out), res_stride=self._stride(op.out))
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
        shape = (n if all_logits else 1, self.n_logits)
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
                self._run_plan(T, n_out)
            else:
                step(T, n_out)
            if all_logits:
                out[c0:c1] = logits[:T, :self.n_logits]
            elif n_out:
                out[0] = logits[0, :self.n_logits]
        return out

    def _run_plan(self, *args: int) -> None:
        t0 = time.perf_counter()
        self._plan.run(*args)
        self.executor_seconds += time.perf_counter() - t0

    def forward_batch(self, seqs: Sequence[tuple[int, Sequence[int], int]],
                      tails: Sequence[int] | None = None) -> np.ndarray:
        """Several sequences (slot, tokens, start) in shared passes; the last logits of each
        [len(seqs), n_vocab]. Each row is bit-identical to running that sequence alone.

        tails: how many of each sequence's last positions to return logits for (default 1 each; a verification
        of drafted tokens wants all of them): the rows [sum(tails), n_vocab], sequence by sequence, in order.
        Only those rows pass through the output norm and the vocabulary matmul."""
        tok, pos, slot, lens = self._pack(seqs, "forward_batch")
        dest = np.full(len(tok), -1, np.int64)
        ends = np.cumsum(lens)
        if tails is None:
            dest[ends - 1] = np.arange(len(seqs))
            n_out = len(seqs)
        else:
            tails = [int(t) for t in tails]
            if len(tails) != len(seqs) or any(not 1 <= t <= n for t, n in zip(tails, lens, strict=True)):
                raise InvalidRequest("forward_batch: tails needs one count per sequence, each in 1..its length")
            n_out = sum(tails)
            dest[np.concatenate([np.arange(e - t, e) for e, t in zip(ends.tolist(), tails, strict=True)])] = \
                np.arange(n_out)
        out = np.empty((n_out, self.n_logits), np.float32)
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
        end = next((i for i, op in enumerate(self.ops) if op.name == "output"), 0)
        if end < 1 or self.ops[end - 1].out != "xo":
            raise InvalidRequest("this plan does not have the output norm before its output matmul")
        self._run_rows(tok, pos, slot, dest, end, self._bufs["xo"], out)  # all but the vocabulary (and its cap)
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
            self._run_plan(T, len(sel), 0, end)
            out[dest[c0:c1][sel]] = src[:len(sel), :width]

    # --- per op ---------------------------------------------------------------------------------

    def op_index(self, key: int | str) -> list[int]:
        """Indices of the ops an int index, an exact name, or a glob pattern ("blk.*.rope") picks."""
        if isinstance(key, (int, np.integer)):
            return [int(key)]
        return [i for i, op in enumerate(self.ops) if op.name == key or fnmatch.fnmatchcase(op.name, key)]

    def debug_forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0, *,
                      backend: str = "native", replace: dict[int | str, Hook] | None = None,
                      observe: Callable[[Op, np.ndarray, DebugContext], None] | None = None,
                      accumulate: str = "float32") -> np.ndarray:
        """forward(), one op at a time, with hooks: runtime/debug.py's Debugger.forward says how."""
        return self.debugger.forward(tokens, start, all_logits, slot, backend=backend, replace=replace,
                                     observe=observe, accumulate=accumulate)

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

    # --- the KV cache -------------------------------------------------------------------------

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
        dequantized, its keys turned back and shifted back: kv_q8.q8_0_keys_join): K, V [n, n_kv_heads, head_dim]."""
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
        return None if bias is None else self.weights.norm(bias).reshape(self.cfg.n_kv_heads, self.cfg.head_dim)

    def _q8_views(self, slot: int, layer: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """A q8_0 cache's parts for a slot and layer, as writable views: K's int8 values [nkv, tiles, hd, tile]
        and scales [nkv, tiles, hd / 32, tile], V's values [nkv, n_ctx, hd] and scales [nkv, n_ctx, hd / 32]."""
        nkv, hd = self.cfg.n_kv_heads, self.cfg.head_dim
        kc, vc = self.k_cache[slot, layer], self.v_cache[slot, layer]
        tiles = kc.shape[1]
        kq = kc[..., :KV_TILE * hd].view(np.int8).reshape(nkv, tiles, hd, KV_TILE)
        kd = kc[..., KV_TILE * hd:].view(np.float16).reshape(nkv, tiles, hd // KV_QK, KV_TILE)
        return (kq, kd), (vc[..., :hd].view(np.int8), vc[..., hd:].view(np.float16))


