"""The per-op debugger of the native engine: the plan (arch/plan.py) run one op at a time, each op by its own
native kernel or by a NumPy implementation of its kind (built from the reference forward's primitives,
arch/llama.py: rmsnorm, rope, attention), with hooks that replace any op and observe every op's output.
`barellm debug` (cli/debug.py) runs a prompt through it beside the reference and names the first op that
drifts; profile() and profile_threads() time each op in the executor.

`EngineDebug` is this part of NativeEngine (runtime/engine.py); it uses the engine's buffers and weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from barellm import _native as nat
from barellm.arch import llama as ref
from barellm.arch.plan import Attention, Embed, GatedAct, MatMul, MoE, Op, RMSNorm, RopeKV, SoftCap
from barellm.errors import InvalidRequest
from barellm.formats.kv_q8 import q8_0_keys, q8_0_split

KV_TILE = nat.KV_TILE


class DebugContext:
    """What a replacement op or an observer sees: the engine's buffers for the current chunk."""

    def __init__(self, engine: Any, T: int, n_out: int, accumulate: str = "float32") -> None:   # a NativeEngine
        self.engine = engine
        self.accumulate = accumulate   # how the NumPy implementations' matmuls sum (debug_forward)
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


class EngineDebug:
    """The debugging side of NativeEngine (see the module docstring)."""

    ops: list[Op]
    cfg: Any
    threads: int
    kv_type: str
    _plan: Any
    _debug_plan: Any
    _pool: Any

    def op_index(self, key: int | str) -> list[int]:
        """Indices of the ops an int index, an exact name, or a glob pattern ("blk.*.rope") picks."""
        if isinstance(key, (int, np.integer)):
            return [int(key)]
        return [i for i, op in enumerate(self.ops) if op.name == key or fnmatch.fnmatchcase(op.name, key)]

    def debug_forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0, *,
                      backend: str = "native", replace: dict[int | str, Hook] | None = None,
                      observe: Callable[[Op, np.ndarray, DebugContext], None] | None = None,
                      accumulate: str = "float32") -> np.ndarray:
        """forward(), one op at a time.

        backend: "native" runs each op's C kernel, "numpy" runs NumPy implementations of the ops.
        replace: {op index | name | glob: fn(op, ctx)}: fn computes that op instead (writes ctx.output(op)
            and whatever else the op writes, e.g. the KV cache for rope_kv).
        observe: fn(op, output_view, ctx) after every op (output_view is live: copy to keep it).
        accumulate: how the NumPy implementations' matmuls (projections, attention) sum: "float32" (NumPy's
            BLAS, rounding as the kernel it picks for the CPU does) or "float64", rounded once (arch.llama's
            matmul_f64: the same on every CPU, as ReferenceEngine(accumulate="float64") computes).
        """
        if backend not in ("native", "numpy"):
            raise InvalidRequest("backend must be 'native' or 'numpy'")
        if accumulate not in ("float32", "float64"):
            raise InvalidRequest(f"accumulate must be float32 or float64, got {accumulate!r}")
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
            ctx = DebugContext(self, T, n_out, accumulate)
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

    def _numpy_op(self, op: Op, ctx: DebugContext) -> None:
        """Runs an op by its kind's NumPy implementation, _numpy_<kind> (the op table's name, executor.h)."""
        run = getattr(self, f"_numpy_{op.kind}", None)
        if run is None:
            raise InvalidRequest(f"op {op.name}: no NumPy implementation of kind {op.kind!r}")
        run(op, ctx)

    @staticmethod
    def _matmul(ctx: DebugContext) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
        """The NumPy implementations' matmul: NumPy's float32 BLAS, or float64 sums rounded once"""
        return ref.matmul_f64 if ctx.accumulate == "float64" else np.matmul

    def _numpy_embed(self, op: Embed, ctx: DebugContext) -> None:
        x = self._table_rows(op.table, ctx.tokens)
        ctx.output(op)[:] = x * np.float32(op.scale) if op.scale != 1.0 else x

    def _numpy_rmsnorm(self, op: RMSNorm, ctx: DebugContext) -> None:
        x = ctx.buf(op.src)
        if op.selected:
            x = x[ctx.selected]
        y = ref.rmsnorm(x, self._norm(op.weight), op.eps)
        if op.accumulate:
            x[:] = y
            ctx.output(op)[:] += y
        else:
            ctx.output(op)[:] = y

    def _numpy_matmul(self, op: MatMul, ctx: DebugContext) -> None:
        key = "|".join(op.matrices)
        if key not in self._dequantized:
            self._dequantized[key] = np.concatenate([self._dequant(n) for n in op.matrices])
        w = self._dequantized[key]
        x = ctx.buf(op.src, ctx.rows(op))
        y = self._matmul(ctx)(x, w.T).astype(np.float32, copy=False)
        if op.bias:
            y += self._bias(op.bias)
        if op.accumulate:
            ctx.buf("proj")[:] = y
            ctx.output(op)[:] += y
        else:
            ctx.output(op)[:] = y

    def _numpy_rope_kv(self, op: RopeKV, ctx: DebugContext) -> None:
        cfg, T = self.cfg, ctx.T
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
        if op.rope:
            q = ref.rope(q, cos, sin, cfg.rope_style)
            k = ref.rope(k, cos, sin, cfg.rope_style)
        qkv[:, :qd] = q.reshape(T, qd)
        qkv[:, qd:qd + kd] = k.reshape(T, kd)
        v = qkv[:, qd + kd:qd + 2 * kd].reshape(T, cfg.n_kv_heads, hd)
        for t in range(T):
            s, p = int(ctx.slots[t]), int(ctx.positions[t])
            if self.kv_type == "q8_0":
                (kq, kd_), (vq, vd) = self._q8_views(s, op.layer)
                kq[:, p // KV_TILE, :, p % KV_TILE], kd_[:, p // KV_TILE, :, p % KV_TILE] = q8_0_keys(
                    k[t], self._k_shift(op.layer))
                vq[:, p], vd[:, p] = q8_0_split(v[t])
                continue
            self.k_cache[s, op.layer, :, p // KV_TILE, :, p % KV_TILE] = k[t]
            self.v_cache[s, op.layer, :, p] = v[t]

    def _numpy_attention(self, op: Attention, ctx: DebugContext) -> None:
        cfg = self.cfg
        qkv, out = ctx.buf(op.src), ctx.output(op)
        for t in range(ctx.T):
            s, p = int(ctx.slots[t]), int(ctx.positions[t])
            k, v = self.kv(s, op.layer, p + 1)
            q = qkv[t:t + 1, :cfg.q_dim].reshape(1, cfg.n_heads, cfg.head_dim)
            sinks = self._norm(op.sinks) if op.sinks else None
            out[t] = ref.attention(q, k, v, p, cfg.scale, op.window, op.softcap, sinks, self._matmul(ctx))[0]

    def _numpy_silu_mul(self, op: GatedAct, ctx: DebugContext) -> None:
        gu, f = ctx.buf(op.src), self.cfg.ffn_dim
        ctx.output(op)[:] = ref.ACTIVATIONS[op.act](gu[:, :f]) * gu[:, f:2 * f]

    def _numpy_moe(self, op: MoE, ctx: DebugContext) -> None:
        biases = tuple(self._dequant(n) for n in op.biases) if op.biases else None
        y = ref.moe(ctx.buf(op.src), ctx.buf(op.logits), self._dequant(op.gate), self._dequant(op.up),
                    self._dequant(op.down), op.n_used, op.norm, op.act, biases)  # type: ignore[arg-type]
        if op.accumulate:
            ctx.buf("proj")[:] = y
            ctx.output(op)[:] += y
        else:
            ctx.output(op)[:] = y

    def _numpy_softcap(self, op: SoftCap, ctx: DebugContext) -> None:
        out = ctx.output(op)
        out[:] = ref.softcap(out, op.cap)
