"""barellm bench: prefill and decode speed in llama-bench's layout, thread scaling, the memory-bandwidth
roofline, where a token's time goes, and speculative decoding against plain.

command: the command's options and what each test measures; measure: the timed runs, their statistics, the
model's sizes and the bandwidth; report: the tables and the plot; draft: `bench --draft`'s tasks (workloads/).
"""

from barellm.cli.bench.command import cmd_bench, register
from barellm.cli.bench.measure import (
    BenchRow,
    Stats,
    huge_share,
    make_row,
    measure_bandwidth,
    model_size,
    parse_int_list,
    run_bench,
    summarize,
    weight_bytes_per_token,
)
from barellm.cli.bench.report import format_breakdown, format_scaling, format_table, plot_scaling, scaling_threads

__all__ = ["BenchRow", "Stats", "cmd_bench", "format_breakdown", "format_scaling", "format_table", "huge_share",
           "make_row", "measure_bandwidth", "model_size", "parse_int_list", "plot_scaling", "register", "run_bench",
           "scaling_threads", "summarize", "weight_bytes_per_token"]
