"""Decode with the weights in 4 KB pages against 2 MB pages, interleaved in one process.

    PYTHONPATH=src python bench/page_sizes.py MODEL [-t 1] [-r 40]

The page cache holds a file in 2 MB pages only where it read the file in through a mapping that asks for them
(formats.mapped.hugepages) while memory had free 2 MB blocks; elsewhere it holds 4 KB pages, and a mapping of
them takes a TLB miss every 4 KB. A load reads such pieces back in 2 MB pages (formats.mapped.rehuge); this
measures what that is worth. The model's .blm is copied beside itself; one copy is read into the page cache in
4 KB pages (a mapping without the advice, random access: no large readahead), the other in 2 MB pages, both are
loaded (the first with the read-back turned off) and tokens are decoded on each in turn, 8 a turn, so a busy
spell of a shared machine hits both alike. Prints the medians and the median ratio of adjacent turns.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import time
from pathlib import Path


def cache_in(path: Path, huge: bool) -> None:
    """Drops the file from the page cache and reads it back in 2 MB or 4 KB pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        if not huge:
            m.madvise(mmap.MADV_RANDOM)
        for at in range(0, len(m), mmap.PAGESIZE):
            m[at]
        m.close()
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", type=int, default=1, help="threads")
    ap.add_argument("-r", type=int, default=40, help="turns of 8 tokens on each")
    args = ap.parse_args()
    import barellm
    from barellm.formats import mapped

    first = barellm.load(args.model, threads=1)
    blm_path = Path(first.source.path)
    del first
    copy = blm_path.with_name(blm_path.stem + ".pages-copy.tmp")
    try:
        shutil.copyfile(blm_path, copy)
        os.sync()  # (dirty pages stay in the cache whatever is asked)
        cache_in(copy, huge=False)
        cache_in(blm_path, huge=True)
        real = mapped.rehuge
        mapped.rehuge = lambda *a, **k: 0
        try:
            small = barellm.load(copy, threads=args.t)
            if small.source.prefetching:
                small.source.prefetching.join()
        finally:
            mapped.rehuge = real
        huge = barellm.load(blm_path, threads=args.t)
        if huge.source.prefetching:
            huge.source.prefetching.join()
        print(f"2 MB pieces mapped in 4 KB pages: {small.source.small_pieces()} (the 4 KB copy), "
              f"{huge.source.small_pieces()} (the 2 MB one)")
        engines = {"4 KB": small.engine, "2 MB": huge.engine}
        for e in engines.values():
            e.forward(list(range(100, 108)), 0)
            for i in range(3):
                e.forward([1000 + i], 8)
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for r in range(args.r):
            for k in (("4 KB", "2 MB") if r % 2 == 0 else ("2 MB", "4 KB")):
                e = engines[k]
                t0 = time.perf_counter()
                for i in range(8):
                    e.forward([1000 + i], 8)
                rates[k].append(8 / (time.perf_counter() - t0))
        for k, v in rates.items():
            print(f"{args.model}, {args.t} thread(s), weights in {k} pages: {statistics.median(v):.2f} tok/s")
        ratio = statistics.median(a / b for a, b in zip(rates["2 MB"], rates["4 KB"], strict=True))
        print(f"2 MB / 4 KB, median of adjacent turns: {ratio:.3f}")
    finally:
        copy.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
