"""The per-op debugger of the native engine: the plan (arch/plan.py) run one op at a time, each op by its own
native kernel or by a NumPy implementation of its kind (built from the reference forward's primitives,
arch/llama.py: rmsnorm, rope, attention), with hooks that replace any op and observe every op's output.
`barellm debug` (cli/debug.py) runs a prompt through it beside the reference and names the first op that
drifts.

NativeEngine (runtime/engine.py) has one `Debugger`, which works on the engine's buffers, weights and KV cache;
`engine.debug_forward` is its `forward`.
"""

from __future__ import annotations

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

    def write(self, op: MatMul | MoE, y: np.ndarray) -> None:
        """An op's result y: added to its output (the residual) and kept in proj where the op accumulates,
        else its output."""
        if op.accumulate:
            self.buf("proj")[:] = y
            self.output(op)[:] += y
        else:
            self.output(op)[:] = y


Hook = Callable[[Op, DebugContext], None]


class Debugger:
    """The per-op debugger of one NativeEngine (see the module docstring). `plan`: the engine's plan compiled
    without fusing, so that each op can run alone (compiled at the first native debug_forward)."""

    def __init__(self, engine: Any) -> None:   # a NativeEngine
        self.engine = engine
        self.plan: Any = None

    def forward(self, tokens: Sequence[int], start: int, all_logits: bool = False, slot: int = 0, *,
                backend: str = "native", replace: dict[int | str, Hook] | None = None,
                observe: Callable[[Op, np.ndarray, DebugContext], None] | None = None,
                accumulate: str = "float32") -> np.ndarray:
        """The engine's forward(), one op at a time.

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
        e = self.engine
        hooks: dict[int, Hook] = {}
        for key, fn in (replace or {}).items():
            idx = e.op_index(key)
            if not idx:
                raise InvalidRequest(f"no op matches {key!r}")
            for i in idx:
                hooks[i] = fn
        if backend == "native" and self.plan is None:
            self.plan = e._compile(fuse=False)

        def step(T: int, n_out: int) -> None:
            ctx = DebugContext(e, T, n_out, accumulate)
            for i, op in enumerate(e.ops):
                if i in hooks:
                    hooks[i](op, ctx)
                elif backend == "numpy":
                    self.numpy_op(op, ctx)
                else:
                    self.plan.run(T, n_out, i, i + 1)
                if observe is not None:
                    observe(op, ctx.output(op), ctx)

        return e._forward(tokens, start, all_logits, slot, None, step)

    def numpy_op(self, op: Op, ctx: DebugContext) -> None:
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
        x = self.engine.weights.table_rows(op.table, ctx.tokens)
        ctx.output(op)[:] = x * np.float32(op.scale) if op.scale != 1.0 else x

    def _numpy_rmsnorm(self, op: RMSNorm, ctx: DebugContext) -> None:
        x = ctx.buf(op.src)
        if op.selected:
            x = x[ctx.selected]
        y = ref.rmsnorm(x, self.engine.weights.norm(op.weight), op.eps)
        if op.accumulate:
            x[:] = y
            ctx.output(op)[:] += y
        else:
            ctx.output(op)[:] = y

    def _numpy_matmul(self, op: MatMul, ctx: DebugContext) -> None:
        weights, key = self.engine.weights, "|".join(op.matrices)
        if key not in weights.dequantized:
            weights.dequantized[key] = np.concatenate([weights.dequant(n) for n in op.matrices])
        x = ctx.buf(op.src, ctx.rows(op))
        y = self._matmul(ctx)(x, weights.dequantized[key].T).astype(np.float32, copy=False)
        if op.bias:
            y += weights.bias(op.bias)
        ctx.write(op, y)

    def _numpy_rope_kv(self, op: RopeKV, ctx: DebugContext) -> None:
        e, T = self.engine, ctx.T
        cfg, norm = e.cfg, e.weights.norm
        qkv = ctx.buf(op.out)
        hd, qd, kd = cfg.head_dim, cfg.q_dim, cfg.kv_dim
        half = cfg.rope_dim // 2
        cs = e._rope_cs[cfg.layer_rope_table(op.layer)][ctx.positions]
        cos, sin = cs[:, :half], cs[:, half:]
        q = qkv[:, :qd].reshape(T, cfg.n_heads, hd)
        k = qkv[:, qd:qd + kd].reshape(T, cfg.n_kv_heads, hd)
        if op.q_norm and op.k_norm:
            q = ref.rmsnorm(q, norm(op.q_norm), op.eps)
            k = ref.rmsnorm(k, norm(op.k_norm), op.eps)
        if op.rope:
            q = ref.rope(q, cos, sin, cfg.rope_style)
            k = ref.rope(k, cos, sin, cfg.rope_style)
        qkv[:, :qd] = q.reshape(T, qd)
        qkv[:, qd:qd + kd] = k.reshape(T, kd)
        v = qkv[:, qd + kd:qd + 2 * kd].reshape(T, cfg.n_kv_heads, hd)
        for t in range(T):
            s, p = int(ctx.slots[t]), int(ctx.positions[t])
            if e.kv_type == "q8_0":
                (kq, kd_), (vq, vd) = e._q8_views(s, op.layer)
                kq[:, p // KV_TILE, :, p % KV_TILE], kd_[:, p // KV_TILE, :, p % KV_TILE] = q8_0_keys(
                    k[t], e._k_shift(op.layer))
                vq[:, p], vd[:, p] = q8_0_split(v[t])
                continue
            e.k_cache[s, op.layer, :, p // KV_TILE, :, p % KV_TILE] = k[t]
            e.v_cache[s, op.layer, :, p] = v[t]

    def _numpy_attention(self, op: Attention, ctx: DebugContext) -> None:
        e = self.engine
        cfg = e.cfg
        qkv, out = ctx.buf(op.src), ctx.output(op)
        for t in range(ctx.T):
            s, p = int(ctx.slots[t]), int(ctx.positions[t])
            k, v = e.kv(s, op.layer, p + 1)
            q = qkv[t:t + 1, :cfg.q_dim].reshape(1, cfg.n_heads, cfg.head_dim)
            sinks = e.weights.norm(op.sinks) if op.sinks else None
            out[t] = ref.attention(q, k, v, p, cfg.scale, op.window, op.softcap, sinks, self._matmul(ctx))[0]

    def _numpy_silu_mul(self, op: GatedAct, ctx: DebugContext) -> None:
        gu, f = ctx.buf(op.src), self.engine.cfg.ffn_dim
        ctx.output(op)[:] = ref.ACTIVATIONS[op.act](gu[:, :f]) * gu[:, f:2 * f]

    def _numpy_moe(self, op: MoE, ctx: DebugContext) -> None:
        dequant = self.engine.weights.dequant
        biases = tuple(dequant(n) for n in op.biases) if op.biases else None
        y = ref.moe(ctx.buf(op.src), ctx.buf(op.logits), dequant(op.gate), dequant(op.up), dequant(op.down),
                    op.n_used, op.norm, op.act, biases)  # type: ignore[arg-type]
        ctx.write(op, y)

    def _numpy_softcap(self, op: SoftCap, ctx: DebugContext) -> None:
        out = ctx.output(op)
        out[:] = ref.softcap(out, op.cap)
