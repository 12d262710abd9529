"""barellm bench's output: the llama-bench style table, the thread-scaling table, a row's breakdown, the plot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from barellm.cli.bench.measure import BenchRow
from barellm.errors import BarellmError


def format_table(rows: Sequence[BenchRow]) -> str:
    """A markdown table like llama-bench's, plus median, time to first token and peak RSS."""
    roof = any(r.roofline for r in rows)
    head = ["model", "size", "params", "engine", "threads", "test", "t/s", "median t/s", "ttft ms", "peak RSS"]
    if roof:
        head += ["bw GB/s", "limit t/s", "of limit"]
    align = ["---" if i < 4 else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        cells = [r.model, f"{r.size_bytes / 2**20:.2f} MiB", f"{r.n_params / 1e6:.2f} M", r.engine, str(r.threads),
                 r.test, str(r.tps), f"{r.tps.median:.2f}", f"{r.ttft_ms.median:.1f}" if r.ttft_ms else "",
                 f"{r.peak_rss_mb:.0f} MB"]
        if roof:
            rf = r.roofline
            cells += ([f"{rf['bandwidth_gbs']:.1f}", f"{rf['limit_tps']:.1f}", f"{100 * rf['fraction']:.1f} %"]
                      if rf else ["", "", ""])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scaling_threads(cores: int) -> list[int]:
    """1, 2, 4, ... up to `cores`, and `cores` itself: the thread counts of --scaling."""
    out, t = [], 1
    while t < cores:
        out.append(t)
        t *= 2
    return [*out, cores]


def format_scaling(rows: Sequence[BenchRow]) -> str:
    """Per test, each thread count's speed beside 1 thread's (or the fewest measured) and, for decode with a
    roofline, its share of the memory-bandwidth limit measured at that thread count: where threads stop
    paying, and whether decode stays near what the memory gives."""
    lines = ["| test | threads | median t/s | speedup | bw GB/s | limit t/s | of limit |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for test in dict.fromkeys(r.test for r in rows):
        rs = sorted((r for r in rows if r.test == test), key=lambda r: r.threads)
        base = rs[0].tps.median
        for r in rs:
            rf = r.roofline if r.roofline and "limit_tps" in r.roofline else None
            roof = ([f"{rf['bandwidth_gbs']:.1f}", f"{rf['limit_tps']:.1f}", f"{100 * rf['fraction']:.1f} %"]
                    if rf else ["", "", ""])
            speed = f"{r.tps.median / base:.2f}x" if base > 0 else ""
            lines.append("| " + " | ".join([test, str(r.threads), f"{r.tps.median:.2f}", speed, *roof]) + " |")
    return "\n".join(lines)


def format_breakdown(row: BenchRow) -> str:
    """Where a complete<N> row's milliseconds per token went, phase by phase."""
    assert row.breakdown is not None
    total = sum(row.breakdown.values())
    lines = [f"{row.test}, {row.threads} threads: milliseconds per token by phase", "",
             "| phase | ms/token | share |", "|---|---:|---:|"]
    for phase, ms in row.breakdown.items():
        if phase != "write":   # the server's: the Python API writes nothing
            lines.append(f"| {phase} | {ms:.3f} | {100 * ms / total if total else 0:.1f} % |")
    lines.append(f"| total | {total:.3f} | 100 % |")
    return "\n".join(lines)


def need_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BarellmError("--plot needs matplotlib: pip install 'barellm[plot]'") from None
    return plt


def plot_scaling(rows: Sequence[BenchRow], path: str) -> None:
    """tokens/s (median, with the std as error bars) against threads, one line per test."""
    plt = need_matplotlib()
    fig, ax = plt.subplots(figsize=(6, 4))
    for test in dict.fromkeys(r.test for r in rows):
        rs = sorted((r for r in rows if r.test == test), key=lambda r: r.threads)
        ax.errorbar([r.threads for r in rs], [r.tps.median for r in rs], yerr=[r.tps.std for r in rs],
                    marker="o", capsize=3, label=test)
    ax.set_xlabel("threads")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{rows[0].model} ({rows[0].engine})" if rows else "")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise BarellmError(f"{path}: cannot write: {e.strerror}") from e
    finally:
        plt.close(fig)
