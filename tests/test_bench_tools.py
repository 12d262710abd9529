"""The C measuring tools under bench/ keep building with the kernels they include, warning-free, and print
their figures; bench/tile_cost.py finds each decode tile's hot loop in the compiled kernels; bench/act_scales.py
rounds activations as the native quantizer does and reports on a model."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "src" / "barellm" / "_native"
CC = shutil.which("cc") or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler (the native core is built with one)")


def build(src: str, out: Path, *flags: str) -> Path:
    cmd = [CC, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-pthread", *flags, str(ROOT / src), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def test_roofline_builds_and_reads(tmp_path):
    exe = build("bench/roofline.c", tmp_path / "roofline", "-mavx2", "-mfma")
    out = subprocess.run([exe, "64", "1"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert re.search(r"buffer 64 MB, \d+ MB of it in 2 MB pages", out)
    row = out.strip().splitlines()[-1].split()
    # threads, best, median, 2 streams best, 3 streams best, FMA GFLOP/s
    assert row[0] == "1" and len(row) == 6 and all(float(v) > 0 for v in row[1:])
    assert float(row[1]) >= float(row[2])


def test_tile_stream_builds_with_the_kernels_and_measures(tmp_path):
    # it includes avx2/quant_kq.c: a change of the tiles' arguments must keep it building
    exe = build("bench/tile_stream.c", tmp_path / "tile_stream", f"-I{NATIVE}", "-ffunction-sections",
                "-fdata-sections", "-Wl,--gc-sections")
    out = subprocess.run([exe, "64", "1"], capture_output=True, text=True, timeout=120, check=True).stdout
    l2 = re.findall(r"^(.+) with its data in L2: best ([\d.]+), median ([\d.]+) GB/s$", out, re.M)
    assert [name for name, _, _ in l2] == ["Q4_K tile", "Q4_K tile, two streams", "Q6_K tile",
                                           "Q6_K tile, two streams", "stand-in K = 1", "stand-in K = 2",
                                           "stand-in K = 4"]
    assert all(float(best) >= float(median) > 0 for _, best, median in l2)
    assert len(re.findall(r"^  median [\d.]+%$", out, re.M)) == 2 * len(l2)  # 1 and 2 threads each


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tile_cost_finds_each_decode_tiles_hot_loop():
    tile_cost = bench_module("tile_cost")
    asm = tile_cost.kernels_asm(CC)
    for fn in tile_cost.TILES:
        loop = tile_cost.hot_loop(asm, fn)
        assert re.match(r"\s+j\w+\s+\.L\d+$", loop[-1]), fn  # ends in its backward jump
        assert not any(x.endswith(":") for x in loop), fn  # labels and directives left out
        # every tile's hot loop serves both groups: an even number of maddubs, at least 8 a group
        n = sum("vpmaddubsw" in x for x in loop)
        assert n >= 16 and n % 2 == 0, (fn, n)


def test_act_scales_rounds_as_the_native_quantizer_and_reports(tmp_path, monkeypatch, capsys):
    from tiny_model import write_tiny_llama

    act_scales = bench_module("act_scales")
    x = np.random.default_rng(1).standard_normal((3, 96)).astype(np.float32) * np.float32(4)
    x[0, :32] = 0  # an all-zero block stays zero
    r = act_scales.round_blocks(x, 32)
    d = np.abs(x.reshape(3, 3, 32)).max(-1, keepdims=True) / np.float32(127)
    assert np.all(np.abs((r - x).reshape(3, 3, 32)) <= d * np.float32(0.5001))
    q = np.divide(r.reshape(3, 3, 32), d, out=np.zeros((3, 3, 32), np.float32), where=d > 0)
    np.testing.assert_allclose(q, np.round(q), atol=1e-3)  # int8 steps of each block's scale
    assert np.abs(np.round(q)).max() <= 127 and not r[0, :32].any()
    np.testing.assert_array_equal(act_scales.round_blocks(x, 256), r)  # 96 values: blocks of 32 instead
    np.testing.assert_array_equal(act_scales.round_blocks(r, 32), r)

    monkeypatch.setattr("sys.argv", ["act_scales", str(write_tiny_llama(tmp_path / "tiny.gguf")), "--blocks", "32,64"])
    act_scales.main()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+)% \| ([\d.e+-]+) \| ([\d.e+-]+) \|$", capsys.readouterr().out, re.M)
    assert [b for b, *_ in rows] == ["32", "64"]
    assert all(0 <= float(top1) <= 100 and float(mean) >= 0 and float(med) >= 0 for _, top1, mean, med in rows)
