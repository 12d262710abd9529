"""barellm bench's measuring: the runs' statistics, the model's sizes, the memory bandwidth, the timed prefill,
decode and complete runs, and the rows they make (the command's docstring, command.py, says what each test is)."""

from __future__ import annotations

import math
import mmap
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from barellm.errors import InvalidRequest

DECODE_PROMPT = 8        # tokens fed before a tg test at depth 0
BANDWIDTH_BYTES = 256 * 1024 * 1024
HUGE_PAGE = 2 * 1024 * 1024


@dataclass
class Stats:
    mean: float
    std: float            # sample standard deviation (n - 1), 0 for one sample
    median: float
    n: int
    samples: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.mean:.2f} ± {self.std:.2f}"


def summarize(xs: Sequence[float]) -> Stats:
    """mean, sample standard deviation and median of xs."""
    xs = [float(x) for x in xs]
    if not xs:
        raise InvalidRequest("no samples")
    return Stats(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, statistics.median(xs),
                 len(xs), xs)


@dataclass
class BenchRow:
    model: str
    engine: str
    threads: int
    test: str               # "pp512", "tg128", "tg128@d512"
    n_tokens: int
    tps: Stats              # tokens per second over the repetitions
    ttft_ms: Stats | None   # prefill tests: milliseconds to the first token (prefill + picking it)
    peak_rss_mb: float      # the process's peak so far (models loaded earlier count)
    size_bytes: int
    n_params: int
    roofline: dict[str, Any] | None = None
    breakdown: dict[str, float] | None = None   # complete<N>: milliseconds per token by phase

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tps"].pop("samples")
        d["tps_samples"] = self.tps.samples
        if self.ttft_ms is not None:
            d["ttft_ms"].pop("samples")
        return d


def parse_int_list(s: str, what: str, lo: int = 1) -> list[int]:
    """ "128,512" -> [128, 512]; refuses anything else with a one-line message."""
    try:
        out = [int(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise InvalidRequest(f"{what} must be comma-separated integers, got {s!r}") from None
    if not out or any(x < lo for x in out):
        raise InvalidRequest(f"{what} must be integers >= {lo}, got {s!r}")
    return out


def peak_rss_mb() -> float:
    # ru_maxrss is in kilobytes on Linux (bytes on macOS)
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def model_size(source: Any) -> tuple[int, int]:
    """(bytes, parameters) of every tensor in the file."""
    nbytes = sum(int(t.nbytes) for t in source.tensors.values())
    params = sum(math.prod(t.shape) for t in source.tensors.values())
    return nbytes, params


def weight_bytes_per_token(source: Any, experts_used: int = 0) -> int:
    """Bytes of weights one decoded token reads: every layer tensor, the final norm and the output matrix
    (the token embedding when it is tied); the embedding lookup itself reads one row, which is negligible.
    In a mixture of experts (experts_used > 0) a token reads only its experts' share of each stacked expert
    tensor (`*_exps.*`, experts first): experts_used of them (Qwen3-30B-A3B Q4_K_M: 1.92 of 18.4 GB)."""
    t = source.tensors

    def read(name: str, v: Any) -> int:
        if experts_used and "_exps." in name:
            return int(v.nbytes) * min(experts_used, int(v.shape[0])) // int(v.shape[0])
        return int(v.nbytes)

    total = sum(read(k, v) for k, v in t.items() if k.startswith("blk."))
    total += int(t["output_norm.weight"].nbytes) if "output_norm.weight" in t else 0
    out = t["output.weight"] if "output.weight" in t else t.get("token_embd.weight")
    return total + (int(out.nbytes) if out is not None else 0)


# --- memory bandwidth -----------------------------------------------------------------------------


def measure_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> tuple[float, str]:
    """Memory read bandwidth in bytes/s with `threads` threads (the best of `reps` passes), and how it was
    measured.

    The native core's thread pool reads its shares of an anonymous buffer asking for 2 MB pages, the pages
    the engine maps its weights in (bench/roofline.c's loop and pages; in 4 KB pages every 4 KB of a stream
    is a TLB miss, and reads came 5-25% slower here). Without the native core: a NumPy reduction over the
    buffer split across threads (NumPy releases the GIL in reductions), a lower bound, since the reduction's
    own arithmetic can be slower than memory."""
    try:
        from barellm import _native
    except ImportError:
        _native = None
    if _native is not None:
        # private (a shared anonymous mapping is shmem, which gets no 2 MB pages here), and 2 MB more than
        # asked for, so that the bytes read start on a 2 MB boundary
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
        try:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)   # before the first touch; a no-op where THP is off
            whole = np.frombuffer(buf, np.uint8)
            skip = -whole.ctypes.data % HUGE_PAGE
            data = whole[skip:skip + nbytes]
            data.fill(1)
            huge = huge_share(data)
            pool = _native.Pool(threads)
            best = min(pool.read(data)[0] for _ in range(reps))
            del data, whole
        finally:
            buf.close()
        pages = "" if huge is None else f", {100 * huge:.0f}% in 2 MB pages"
        return nbytes / best, f"native streaming read{pages}"
    arr = np.ones(nbytes // 8, dtype=np.int64)
    parts = np.array_split(arr, threads)
    best = math.inf
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.bitwise_or.reduce, parts))
            best = min(best, time.perf_counter() - t0)
    return arr.nbytes / best, "NumPy reduction (lower bound)"


def huge_share(data: np.ndarray) -> float | None:
    """The share of an anonymous buffer's bytes mapped in 2 MB pages (its mapping's AnonHugePages in
    /proc/self/smaps); None where the kernel does not say."""
    lo = data.ctypes.data
    hi = lo + data.nbytes
    try:
        with open("/proc/self/smaps") as f:
            inside, kb = False, 0
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and line.startswith("AnonHugePages:"):
                    kb += int(line.split()[1])
    except (OSError, ValueError):
        return None
    return min(1.0, kb * 1024 / data.nbytes)


# --- the runs -------------------------------------------------------------------------------------


def time_runs(fn: Callable[[], float | None], reps: int) -> list[float]:
    """Runs fn once untimed, then reps times; each run's seconds (fn may return its own timing)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        own = fn()
        out.append(own if own is not None else time.perf_counter() - t0)
    return out


def bench_prefill(engine: Any, tokens: Sequence[int], reps: int) -> tuple[list[float], list[float]]:
    """(tokens/s, seconds to the first token) per repetition of a fresh-cache prefill of tokens."""
    def run() -> float:
        t0 = time.perf_counter()
        logits = engine.forward(list(tokens), 0)
        int(np.argmax(logits[-1]))   # the first token is picked: time to first token includes it
        return time.perf_counter() - t0

    secs = time_runs(run, reps)
    ttft = [s * 1000 for s in secs]
    return [len(tokens) / s for s in secs], ttft


def bench_decode(engine: Any, prompt: Sequence[int], tokens: Sequence[int], reps: int) -> list[float]:
    """tokens/s per repetition of len(tokens) single-token forwards after the prompt (prompt not timed)."""
    def run() -> float:
        engine.forward(list(prompt), 0)
        pos = len(prompt)
        t0 = time.perf_counter()
        for i, t in enumerate(tokens):
            engine.forward([int(t)], pos + i)
        return time.perf_counter() - t0

    return [len(tokens) / s for s in time_runs(run, reps)]


SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 40}


def bench_complete(model: Any, prompt: Sequence[int], n: int, reps: int, seed: int = 1) -> tuple[list[float], Any]:
    """tokens/s per repetition of model.complete making n tokens with sampling (decode only), and where the
    time went over all repetitions (a timings.Timings)."""
    from barellm.generate.timings import Timings

    kw: dict[str, Any] = dict(SAMPLING, max_tokens=n, logit_bias={i: -100.0 for i in model.tokenizer.eog_ids})
    model.reset()
    model.complete(list(prompt), seed=seed, **kw)   # warm-up
    timings = Timings()
    tps = []
    for r in range(reps):
        model.reset()
        c = model.complete(list(prompt), seed=seed + r, timings=timings, **kw)
        tps.append(max(len(c.token_ids) - 1, 1) / max(c.decode_seconds, 1e-9))
    return tps, timings


def make_row(base: dict[str, Any], test: str, n: int, tps: list[float], ttft: list[float] | None,
             roofline: dict[str, Any] | None = None, breakdown: dict[str, float] | None = None) -> BenchRow:
    return BenchRow(base["model"], base["engine"], base["threads"], test, n, summarize(tps),
                    summarize(ttft) if ttft else None, peak_rss_mb(), base["size_bytes"], base["n_params"], roofline,
                    breakdown)


def run_bench(model_name: str | None, prompts: Sequence[int], gens: Sequence[int], threads: Sequence[int],
              reps: int, engine: str = "native", depths: Sequence[int] = (0,), roofline: bool = False,
              bandwidth: float | None = None, seed: int = 1234,
              on_row: Callable[[BenchRow], None] | None = None, activations: str = "q8x2",
              breakdown: bool = False, kv_type: str | None = None) -> list[BenchRow]:
    """Every (threads, test) combination; rows come in the order they were measured."""
    import barellm

    rows: list[BenchRow] = []

    def emit(row: BenchRow) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    need = max([*prompts, *(d + g for d in depths for g in gens), DECODE_PROMPT + max(gens, default=0)], default=16)
    for nt in threads:
        model = barellm.load(model_name, threads=nt, engine=engine, context=max(16, need), activations=activations,
                             kv_type=kv_type)
        rng = np.random.default_rng(seed)   # the same tokens for every thread count
        size, params = model_size(model.source)
        name = engine if engine != "native" or activations == "q8x2" else f"{engine}-{activations}"
        if kv_type not in (None, "f16"):
            name += f"-kv-{kv_type}"
        base = {"model": model.name, "engine": name, "threads": nt, "size_bytes": size, "n_params": params}
        per_token = weight_bytes_per_token(model.source, model.config.n_experts_used)
        vocab = model.config.n_vocab
        for p in prompts:
            tps, ttft = bench_prefill(model.engine, rng.integers(0, vocab, p).tolist(), reps)
            emit(make_row(base, f"pp{p}", p, tps, ttft))
        for d in depths:
            for g in gens:
                prompt = rng.integers(0, vocab, d or DECODE_PROMPT).tolist()
                tps = bench_decode(model.engine, prompt, rng.integers(0, vocab, g).tolist(), reps)
                emit(make_row(base, f"tg{g}" + (f"@d{d}" if d else ""), g, tps, None,
                              {"weight_bytes_per_token": per_token} if roofline else None))
                if breakdown and not d:
                    tps, timings = bench_complete(model, prompt, g, reps, seed)
                    emit(make_row(base, f"complete{g}", g, tps, None, breakdown=timings.per_token_ms()))
        model.reset()
        del model
    if roofline:
        # measured last: the 256 MB buffer would otherwise count in every row's peak RSS
        for nt in dict.fromkeys(r.threads for r in rows if r.roofline):
            bw, how = (bandwidth * 1e9, "given") if bandwidth else measure_bandwidth(nt)
            for r in rows:
                if r.roofline and r.threads == nt:
                    limit = bw / r.roofline["weight_bytes_per_token"]
                    r.roofline.update(bandwidth_gbs=bw / 1e9, bandwidth_method=how, limit_tps=limit,
                                      fraction=r.tps.median / limit)
    return rows
