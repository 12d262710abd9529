"""Op-by-op comparison of an engine with the NumPy float32 reference, to find where they part.

Both sides run the forward pass with a hook called after every named op (token_embd, blk.<i>.attn_norm,
blk.<i>.rope, blk.<i>.attn, ..., output_norm, output). The hook sees each op's output and may replace it.
For every op the report gives the candidate's mean, std and max |x|, and its max absolute difference from
the reference, also relative to the reference's max |x|; the first op past its tolerance is marked.

By default each candidate op is fed the reference's outputs (isolated): after an op is recorded, its output
is replaced by the reference's, so every difference is that op's own and does not pile up from earlier ops.
With free=True the candidate runs on its own outputs and the table shows how differences grow.

The command exits 0 when every op is within tolerance and 1 when one drifts (usable in scripts).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from barellm.errors import BarellmError, InvalidRequest

# hook(op name, op output, row0) -> a replacement output, or None to keep it. An engine that runs a long
# prompt in chunks calls it once per chunk: row0 is the chunk's first token row within the call.
Hook = Callable[[str, np.ndarray, int], "np.ndarray | None"]

# Relative max-abs difference allowed per op (fnmatch patterns, the first match wins). Isolated, a quantized
# matmul on quantized activations differs from float32 by ~1% and a wrong op by ~100%; free-running, the
# differences of 30 layers pile up to ~5% on SmolLM2, so the default is looser there.
ISOLATED_TOLERANCE = 0.05
FREE_TOLERANCE = 0.2


class OpTracer(Protocol):
    """An engine that can run its forward pass op by op."""

    def op_names(self) -> list[str]: ...

    def forward_ops(self, tokens: Sequence[int], start: int = 0, hook: Hook | None = None) -> np.ndarray: ...


class ReferenceOps:
    """The reference forward pass op by op, built from a ReferenceEngine's weights and steps.

    The steps are arch/llama.py's own functions (rmsnorm, rope, attention, the activation), called in the
    order ReferenceEngine.forward calls them, so the last op's output equals its logits (a test checks it).
    Ops and their outputs follow the native engine's plan (plan.py), so both sides compare name by name:

        token_embd                    [T, dim]
        blk.i.attn_norm               [T, dim]
        blk.i.qkv                     [T, q_dim + 2 kv_dim]   q | k | v
        blk.i.rope                    [T, q_dim + 2 kv_dim]   q, k rotated (gemma: normed per head first);
                                                              v as is (k and v go to the cache)
        blk.i.attn                    [T, q_dim]              attention output, before its projection
        blk.i.attn_out                [T, dim]                the residual stream after attention
                                                              (gemma: the projection alone)
        blk.i.post_attn_norm (gemma)  [T, dim]                the residual stream after attention
        blk.i.ffn_norm                [T, dim]
        blk.i.ffn_gate_up             [T, 2 ffn_dim]          gate | up
        blk.i.ffn_act                 [T, ffn_dim]            act(gate) * up
        blk.i.ffn_down                [T, dim]                the residual stream after the feed-forward
                                                              (gemma: the down projection alone)
        blk.i.post_ffn_norm (gemma)   [T, dim]                the residual stream after the feed-forward
        output_norm                   [T, dim]
        output                        [T, n_vocab]            logits of every position
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.cfg = engine.cfg

    def op_names(self) -> list[str]:
        cfg = self.cfg
        names = ["token_embd"]
        for i in range(cfg.n_layers):
            b = f"blk.{i}."
            names += [b + "attn_norm", b + "qkv", b + "rope", b + "attn", b + "attn_out"]
            names += [b + "post_attn_norm"] if cfg.post_norms else []
            names += [b + "ffn_norm", b + "ffn_gate_up", b + "ffn_act", b + "ffn_down"]
            names += [b + "post_ffn_norm"] if cfg.post_norms else []
        return names + ["output_norm", "output"]

    def forward_ops(self, tokens: Sequence[int], start: int = 0, hook: Hook | None = None) -> np.ndarray:
        """Logits [T, n_vocab] of every position; hook sees (and may replace) each op's output."""
        from barellm.arch.llama import attention, gated, rmsnorm, rope

        e, cfg = self.engine, self.cfg
        ids = np.asarray(tokens, dtype=np.int64)
        T = len(ids)
        if T == 0 or start < 0 or start + T > e.n_ctx:
            raise InvalidRequest(f"{T} tokens at {start} do not fit the context of {e.n_ctx}")
        if ids.min() < 0 or ids.max() >= cfg.n_vocab:
            raise InvalidRequest(f"token id out of range 0..{cfg.n_vocab - 1}")

        def op(name: str, out: np.ndarray) -> np.ndarray:
            if hook is None:
                return out
            new = hook(name, out, 0)
            if new is None:
                return out
            new = np.asarray(new, dtype=np.float32)
            if new.shape != out.shape:
                raise InvalidRequest(f"the hook replaced {name} {out.shape} with {new.shape}")
            return new

        k_cache, v_cache = e.k_cache[0], e.v_cache[0]
        end = start + T
        eps = cfg.norm_eps
        qd, kd, hd = cfg.q_dim, cfg.kv_dim, cfg.head_dim

        def split(qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return (qkv[:, :qd].reshape(T, cfg.n_heads, hd), qkv[:, qd:qd + kd].reshape(T, cfg.n_kv_heads, hd),
                    qkv[:, qd + kd:].reshape(T, cfg.n_kv_heads, hd))

        def join(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            return np.concatenate([q.reshape(T, qd), k.reshape(T, kd), v.reshape(T, kd)], axis=1)

        x = e.token_embd[ids]
        if cfg.embed_scale != 1.0:
            x = x * np.float32(cfg.embed_scale)
        x = op("token_embd", x)
        for i, L in enumerate(e.layers):
            b = f"blk.{i}."
            xn = op(b + "attn_norm", rmsnorm(x, L.attn_norm, eps))
            q, k, v = xn @ L.wq, xn @ L.wk, xn @ L.wv
            if L.bq is not None and L.bk is not None and L.bv is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q, k, v = split(op(b + "qkv", join(q, k, v)))
            if L.q_norm is not None and L.k_norm is not None:   # inside the engine's rope op
                q, k = rmsnorm(q, L.q_norm, eps), rmsnorm(k, L.k_norm, eps)
            cos, sin = (table[start:end] for table in e.rope[i])
            q, k, v = split(op(b + "rope", join(rope(q, cos, sin, cfg.rope_style), rope(k, cos, sin, cfg.rope_style),
                                                v)))
            k_cache[i, start:end] = k
            v_cache[i, start:end] = v
            att = op(b + "attn", attention(q, k_cache[i, :end], v_cache[i, :end], start, cfg.scale,
                                           cfg.layer_window(i)))
            if L.post_attn_norm is not None:   # the engine's plan: projection, then norm and residual add
                att = op(b + "attn_out", att @ L.wo)
                x = op(b + "post_attn_norm", x + rmsnorm(att, L.post_attn_norm, eps))
            else:
                x = op(b + "attn_out", x + att @ L.wo)
            xn = op(b + "ffn_norm", rmsnorm(x, L.ffn_norm, eps))
            gu = op(b + "ffn_gate_up", np.concatenate([xn @ L.w_gate, xn @ L.w_up], axis=1))
            f = cfg.ffn_dim
            act = op(b + "ffn_act", gated(cfg.act, gu[:, :f], gu[:, f:]))
            if L.post_ffn_norm is not None:
                ffn = op(b + "ffn_down", act @ L.w_down)
                x = op(b + "post_ffn_norm", x + rmsnorm(ffn, L.post_ffn_norm, eps))
            else:
                x = op(b + "ffn_down", x + act @ L.w_down)
        xn = op("output_norm", rmsnorm(x, e.output_norm, eps))
        return op("output", xn @ e.output.T)


class Overridden:
    """A tracer with some ops replaced: overrides[name](output, seen) -> the output to use instead, where
    seen holds the outputs of the ops run so far in this chunk (as fed forward). For experiments ("what if
    this op were exact / wrong?") and for testing that the comparison finds a broken op."""

    def __init__(self, tracer: OpTracer,
                 overrides: dict[str, Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]]) -> None:
        self.tracer = tracer
        self.overrides = overrides

    def op_names(self) -> list[str]:
        return self.tracer.op_names()

    def forward_ops(self, tokens: Sequence[int], start: int = 0, hook: Hook | None = None) -> np.ndarray:
        seen: dict[str, np.ndarray] = {}

        def inner(name: str, out: np.ndarray, row0: int) -> np.ndarray:
            if name in self.overrides:
                out = np.asarray(self.overrides[name](out, seen), dtype=np.float32)
            if hook is not None:
                new = hook(name, out, row0)
                out = out if new is None else np.asarray(new, dtype=np.float32).reshape(out.shape)
            seen[name] = out
            return out

        return self.tracer.forward_ops(tokens, start, inner)


class NativeOps:
    """The native engine's op-by-op debug mode (NativeEngine.debug_forward) as an OpTracer.

    Outputs are observed after each op and, when the hook returns a replacement, overwritten in the
    engine's buffer before the next op reads it. One leak remains when isolating: the RoPE op stores its
    own rotation of K in the KV cache, so attention sees the engine's K even after the hook replaced the
    op's visible output (V, which comes straight from the replaced qkv buffer, is the reference's)."""

    def __init__(self, engine: Any, backend: str = "native") -> None:
        if not hasattr(engine, "debug_forward"):
            raise BarellmError("this build's native engine has no op-by-op debug mode (debug_forward)")
        self.engine = engine
        self.backend = backend

    def op_names(self) -> list[str]:
        return [op.name for op in self.engine.ops]

    def forward_ops(self, tokens: Sequence[int], start: int = 0, hook: Hook | None = None) -> np.ndarray:
        def observe(op: Any, out: np.ndarray, ctx: Any) -> None:
            if hook is None:
                return
            row0 = int(ctx.positions[0]) - start
            new = hook(op.name, np.array(out, copy=True), row0)   # the view is live: copy what we keep
            if new is not None:
                out[...] = np.asarray(new, dtype=np.float32).reshape(out.shape)

        return self.engine.debug_forward(tokens, start, all_logits=True, backend=self.backend, observe=observe)


# --- the comparison -------------------------------------------------------------------------------


def parse_tolerances(spec: str | None, default: float = ISOLATED_TOLERANCE) -> list[tuple[str, float]]:
    """ "0.01" or "rope=1e-4,blk.*.attn=0.02,*=0.05" -> [(pattern, tolerance)], the default last."""
    out: list[tuple[str, float]] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        pat, _, val = part.rpartition("=")
        try:
            tol = float(val)
        except ValueError:
            raise InvalidRequest(f"--tolerance: {part!r} is not NUMBER or OP=NUMBER") from None
        if not tol >= 0:
            raise InvalidRequest(f"--tolerance: {part!r} must be >= 0")
        if pat and "*" not in pat and "." not in pat:
            pat = "*." + pat   # "rope" means that op in every layer
        out.append((pat or "*", tol))
    return out + [("*", default)]


def tolerance_for(name: str, tolerances: Sequence[tuple[str, float]]) -> float:
    for pat, tol in tolerances:
        if fnmatch.fnmatchcase(name, pat):
            return tol
    return ISOLATED_TOLERANCE


@dataclass
class OpDiff:
    name: str
    shape: tuple[int, ...]
    mean: float
    std: float
    max_abs: float
    max_abs_diff: float    # max |candidate - reference|
    rel_diff: float        # max_abs_diff / max |reference|
    tolerance: float
    drift: bool


def op_diff(name: str, ref: np.ndarray, got: np.ndarray, tolerance: float) -> OpDiff:
    """Statistics of got and its difference from ref (a shape mismatch or a non-finite value is a drift)."""
    g = np.asarray(got, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    finite = bool(np.isfinite(g).all())
    mean, std = (float(g.mean()), float(g.std())) if g.size else (0.0, 0.0)
    max_abs = float(np.abs(g).max()) if g.size else 0.0
    if g.size != r.size:
        return OpDiff(name, tuple(g.shape), mean, std, max_abs, math.inf, math.inf, tolerance, True)
    d = float(np.abs(g.reshape(r.shape) - r).max()) if g.size else 0.0
    scale = float(np.abs(r).max()) if r.size else 0.0
    rel = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
    if not finite:
        d = rel = math.inf
    return OpDiff(name, tuple(g.shape), mean, std, max_abs, d, rel, tolerance, not finite or rel > tolerance)


@dataclass
class DebugReport:
    ops: list[OpDiff]
    missing: list[str]            # reference ops the candidate did not report
    unmatched: list[str]          # candidate ops the reference has no counterpart for

    @property
    def first_drift(self) -> OpDiff | None:
        return next((o for o in self.ops if o.drift), None)

    def as_dict(self) -> dict[str, Any]:
        fd = self.first_drift
        return {"ops": [asdict(o) for o in self.ops], "missing": self.missing, "unmatched": self.unmatched,
                "first_drift": fd.name if fd else None}


def run_debug(candidate: OpTracer, reference: OpTracer, tokens: Sequence[int], *,
              tolerances: Sequence[tuple[str, float]] | None = None, free: bool = False,
              keep: dict[str, dict[str, np.ndarray]] | None = None) -> DebugReport:
    """Runs reference then candidate over tokens (positions 0..) and compares op by op.

    tolerances default to one for every op, looser when free-running; keep, when given, receives
    {"reference": {...}, "candidate": {...}} with every op's output."""
    if tolerances is None:
        tolerances = [("*", FREE_TOLERANCE if free else ISOLATED_TOLERANCE)]
    ref: dict[str, np.ndarray] = {}

    def record_ref(name: str, out: np.ndarray, row0: int) -> None:
        ref[name] = _put(ref.get(name), out, row0)

    reference.forward_ops(tokens, 0, record_ref)
    got: dict[str, np.ndarray] = {}

    def record(name: str, out: np.ndarray, row0: int) -> np.ndarray | None:
        got[name] = _put(got.get(name), out, row0)
        r = ref.get(name)
        if free or r is None or r.ndim != 2 or row0 + len(out) > len(r):
            return None
        rows = r[row0:row0 + len(out)]
        # isolate: the next op starts from the reference's input
        return rows.reshape(out.shape) if rows.size == out.size else None

    candidate.forward_ops(tokens, 0, record)
    ops = [op_diff(n, ref[n], got[n], tolerance_for(n, tolerances)) for n in got if n in ref]
    if keep is not None:
        keep["reference"], keep["candidate"] = ref, got
    return DebugReport(ops, [n for n in ref if n not in got], [n for n in got if n not in ref])


def _put(acc: np.ndarray | None, out: np.ndarray, row0: int) -> np.ndarray:
    """acc with out's rows written at row0 (an engine may report a long prompt chunk by chunk)."""
    out = np.array(out, dtype=np.float32, copy=True)
    if out.ndim < 2:
        out = out.reshape(1, -1)
    if acc is None and row0 == 0:
        return out
    n = max(row0 + len(out), 0 if acc is None else len(acc))
    grown = np.zeros((n, *out.shape[1:]), np.float32)
    if acc is not None:
        grown[:len(acc)] = acc
    grown[row0:row0 + len(out)] = out
    return grown


def format_report(report: DebugReport, only_drift: bool = False) -> str:
    fd = report.first_drift
    lines = [f"{'op':<24} {'shape':>12} {'mean':>10} {'std':>10} {'max|x|':>10} {'max|d|':>10} {'rel':>9}  tol"]
    for o in report.ops:
        if only_drift and not o.drift:
            continue
        mark = "  <-- first drift" if o is fd else ("  drift" if o.drift else "")
        shape = "x".join(map(str, o.shape))
        lines.append(f"{o.name:<24} {shape:>12} {o.mean:>10.4g} {o.std:>10.4g} {o.max_abs:>10.4g} "
                     f"{o.max_abs_diff:>10.3g} {o.rel_diff:>9.2e}  {o.tolerance:g}{mark}")
    if report.missing:
        lines.append(f"ops the engine did not report: {', '.join(report.missing[:8])}"
                     + (" ..." if len(report.missing) > 8 else ""))
    if report.unmatched:
        lines.append(f"engine ops without a reference counterpart: {', '.join(report.unmatched[:8])}"
                     + (" ..." if len(report.unmatched) > 8 else ""))
    if fd:
        lines.append(f"first drift: {fd.name} (max |d| {fd.max_abs_diff:.3g}, relative {fd.rel_diff:.2e} > "
                     f"tolerance {fd.tolerance:g})")
    else:
        lines.append(f"no drift: all {len(report.ops)} ops within tolerance")
    return "\n".join(lines)


def dump(dirpath: Path, kept: dict[str, dict[str, np.ndarray]], report: DebugReport, engine: str) -> None:
    """DIR/reference.npz, DIR/<engine>.npz (one array per op, keyed by op name) and DIR/report.json."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True)
        np.savez(dirpath / "reference.npz", **kept["reference"])
        np.savez(dirpath / f"{engine}.npz", **kept["candidate"])
        (dirpath / "report.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    except OSError as e:
        raise BarellmError(f"{dirpath}: cannot write the dump: {e.strerror}") from e


# --- the command ---------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("debug", help="run an engine op by op beside the float32 reference; find where they part",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="+", metavar="[MODEL] PROMPT", help="model name or path (default smollm2-135m), "
                                                                      "then the prompt")
    p.add_argument("--engine", choices=["native", "reference"], default="native",
                   help="the engine to check (default native; reference checks the comparison itself)")
    p.add_argument("-t", "--threads", type=int, default=None, help="worker threads (default: physical cores)")
    p.add_argument("--tolerance", default=None, metavar="SPEC",
                   help="relative max-abs difference allowed: a number for every op, or OP=NUMBER,... with "
                        f"fnmatch patterns ('rope=1e-4,blk.2*.attn=0.01'); default {ISOLATED_TOLERANCE}, "
                        f"{FREE_TOLERANCE} with --free")
    p.add_argument("--free", action="store_true",
                   help="let the engine run on its own outputs (differences accumulate) instead of isolating ops")
    p.add_argument("--numpy-ops", action="store_true",
                   help="run the native engine's plan with its NumPy op implementations (checks the plan, not the "
                        "kernels)")
    p.add_argument("--dump", default=None, metavar="DIR", help="write every op's output of both sides (npz)")
    p.add_argument("--drift-only", action="store_true", help="list only the ops past their tolerance")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_debug)


def cmd_debug(args: argparse.Namespace) -> int:
    import barellm
    from barellm.arch import reference_engine

    if len(args.words) > 2:
        raise InvalidRequest("debug takes [MODEL] PROMPT; quote the prompt")
    name, prompt = (args.words if len(args.words) == 2 else (None, args.words[0]))
    tolerances = parse_tolerances(args.tolerance, FREE_TOLERANCE if args.free else ISOLATED_TOLERANCE)
    model = barellm.load(name, threads=args.threads, engine=args.engine, context=256)
    tokens = model.tokenize(prompt)
    if not tokens:
        raise InvalidRequest("the prompt has no tokens")
    if len(tokens) > model.n_ctx:
        raise InvalidRequest(f"the prompt has {len(tokens)} tokens; debug takes at most {model.n_ctx}")
    reference = ReferenceOps(reference_engine(model.config, model.source, model.n_ctx))
    candidate = (ReferenceOps(model.engine) if args.engine == "reference"
                 else NativeOps(model.engine, "numpy" if args.numpy_ops else "native"))
    kept: dict[str, dict[str, np.ndarray]] = {}
    report = run_debug(candidate, reference, tokens, tolerances=tolerances, free=args.free, keep=kept)
    model.reset()
    if args.dump:
        dump(Path(args.dump), kept, report, args.engine)
    if args.json:
        print(json.dumps({"model": model.path.name, "engine": args.engine, "tokens": tokens,
                          "isolated": not args.free, **report.as_dict()}))
    else:
        print(f"{model.path.name}: {len(tokens)} tokens, engine {args.engine} against the float32 reference, "
              f"ops {'free-running' if args.free else 'isolated'}", file=sys.stderr)
        print(format_report(report, args.drift_only))
    return 1 if report.first_drift else 0
