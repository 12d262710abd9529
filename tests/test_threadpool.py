"""The thread pool and the executor's op loop: correctness under many ops and thread counts.

A chain of ops where every op reads what all threads wrote in the op before (a matmul spreads each
output over all input rows) catches a missing or broken barrier; running the chain with 1..4 threads
must give the same bits (each output row is computed by one thread, with the same arithmetic).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from barellm import _native as nat
from barellm.runtime.engine import KIND_IDS, aligned_zeros

F32, ROWS = 0, 0


def chain_plan(pool, n_layers, T, n, seed=0):
    """x -> [matmul W_k, rmsnorm] * n_layers, alternating two buffers. Returns (plan, io arrays, numpy ref)."""
    rng = np.random.default_rng(seed)
    a, b = aligned_zeros((T, n)), aligned_zeros((T, n))
    a[:] = rng.standard_normal((T, n))
    x0 = a.copy()
    ones = np.ones(n, np.float32)
    rb = nat.act_row_bytes(F32, ROWS, n)
    qb = aligned_zeros((T, rb), np.uint8)
    ops, ws = [], []
    for _ in range(n_layers):
        w = aligned_zeros((n, n))
        w[:] = rng.standard_normal((n, n)) / np.sqrt(n)
        ws.append(w)
        mat = (F32, ROWS, n, n, w)
        ops.append({"kind": KIND_IDS["matmul"],
                    "qjobs": [{"w": (F32, ROWS, n, n, None), "x": a, "x_stride": n, "dst": qb, "dst_stride": rb}],
                    "parts": [{"w": mat, "xq": qb, "out": b, "ldo": n}]})
        ops.append({"kind": KIND_IDS["rmsnorm"], "x": b, "x_stride": n, "out": a, "out_stride": n, "w": ones,
                    "eps": 1e-6, "n": n})
    z = aligned_zeros(T, np.int32)
    plan = nat.Plan(pool, ops, z, z, z, z, T, T, 1, 1, 1)

    def ref():
        x = x0.astype(np.float64)
        for w in ws:
            y = x @ w.T.astype(np.float64)
            x = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-6)
        return x

    return plan, a, x0, ref


@pytest.mark.parametrize("n", [96, 200])
def test_chain_threads_bitwise(n):
    T, L = 5, 60
    results = {}
    for threads in (1, 2, 3, 4):
        pool = nat.Pool(threads)
        plan, a, x0, ref = chain_plan(pool, L, T, n)
        for rep in range(3):  # repeated runs reuse the same workers
            a[:] = x0
            plan.run(T, 0)
            if rep == 0:
                first = a.copy()
            else:
                assert np.array_equal(a, first)
        results[threads] = first
        np.testing.assert_allclose(first, ref(), rtol=1e-3, atol=1e-3)
    for threads in (2, 3, 4):
        assert np.array_equal(results[threads], results[1]), threads


def test_many_runs_and_partial_ranges():
    pool = nat.Pool(2)
    plan, a, x0, _ = chain_plan(pool, 20, 3, 64, seed=1)
    a[:] = x0
    plan.run(3, 0)
    want = a.copy()
    for _ in range(300):
        a[:] = x0
        plan.run(3, 0)
        assert np.array_equal(a, want)
    # op by op gives the same as all at once
    a[:] = x0
    for i in range(plan.n_ops):
        plan.run(3, 0, i, i + 1)
    assert np.array_equal(a, want)


def test_pool_from_several_python_threads():
    """Plans on one pool, called from different Python threads in turn (the GIL is released)."""
    pool = nat.Pool(3)
    plan, a, x0, _ = chain_plan(pool, 10, 4, 64, seed=2)
    a[:] = x0
    plan.run(4, 0)
    want = a.copy()
    errors = []
    lock = threading.Lock()

    def worker():
        for _ in range(20):
            with lock:
                a[:] = x0
                plan.run(4, 0)
                if not np.array_equal(a, want):
                    errors.append("mismatch")

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_idle_workers_sleep_and_wake():
    """After the spin window, workers sleep on the futex; the next run wakes them."""
    pool = nat.Pool(2)
    pool.set_spin_us(0)
    plan, a, x0, _ = chain_plan(pool, 4, 2, 32, seed=3)
    a[:] = x0
    plan.run(2, 0)
    want = a.copy()
    for _ in range(20):
        time.sleep(0.002)
        a[:] = x0
        plan.run(2, 0)
        assert np.array_equal(a, want)


def test_barrier_overhead():
    """Per-op cost of the op loop (tiny ops, so it is mostly the barrier) with 2 threads."""
    pool = nat.Pool(2)
    n, T = 16, 1
    x, y = aligned_zeros((T, n)), aligned_zeros((T, n))
    ones = np.ones(n, np.float32)
    ops = [{"kind": KIND_IDS["rmsnorm"], "x": y, "x_stride": n, "out": x, "out_stride": n, "w": ones, "eps": 1e-6,
            "n": n}] * 300
    z = aligned_zeros(T, np.int32)
    plan = nat.Plan(pool, ops, z, z, z, z, T, T, 1, 1, 1)
    best = 1e9
    for _ in range(30):
        t0 = time.perf_counter()
        plan.run(1, 0)
        best = min(best, time.perf_counter() - t0)
    per_op_us = best / 300 * 1e6
    print(f"op loop: {per_op_us:.3f} us per op with 2 threads")
    if os.getloadavg()[0] < (os.cpu_count() or 1):  # meaningless when other processes hold the cores
        assert per_op_us < 5.0  # generous; typically ~0.1 us


def test_pool_arguments():
    with pytest.raises(ValueError):
        nat.Pool(0)
    with pytest.raises(ValueError):
        nat.Pool(1000)
    assert nat.Pool(3).size == 3


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nbytes", [0, 8, 255, 256, 4096 + 64, 1 << 20])
def test_pool_read_covers_each_thread_share(threads, nbytes):
    """Pool.read (the bandwidth pass): the threads' shares together read every whole 256-byte piece once, so
    the checksum (a sum of 64-bit words, mod 2**64) is the buffer's over those pieces, whatever the split."""
    rng = np.random.default_rng(nbytes + threads)
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    seconds, checksum = nat.Pool(threads).read(data)
    words = data[:nbytes // 256 * 256].view(np.uint64)
    assert checksum == int(words.sum(dtype=np.uint64))
    assert seconds >= 0.0
    with pytest.raises(TypeError):
        nat.Pool(1).read(3)


def test_pinned_pool_in_subprocess():
    """pin=True binds the threads (the calling one too), so it runs in its own process."""
    code = (
        "import os, numpy as np\n"
        "from barellm import _native as nat\n"
        "p = nat.Pool(2, pin=True)\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len(eval(out.stdout.strip())) == 1


def test_forked_child_runs_on_its_own_thread():
    """After fork() the child has no workers: its runs use the calling thread instead of waiting forever."""
    pool = nat.Pool(2)
    plan, a, x0, _ = chain_plan(pool, 6, 3, 64, seed=4)
    a[:] = x0
    plan.run(3, 0)
    want = a.copy()
    pid = os.fork()
    if pid == 0:  # child
        ok = False
        try:
            a[:] = x0
            plan.run(3, 0)
            ok = bool(np.array_equal(a, want))
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_plan_refuses_unknown_and_missing_keys():
    """A mistyped or forgotten key is an error naming the op and the key, never a silent zero."""
    pool = nat.Pool(1)
    n = 16
    x, y = aligned_zeros((1, n)), aligned_zeros((1, n))
    good = {"kind": KIND_IDS["rmsnorm"], "name": "blk.0.attn_norm", "x": y, "x_stride": n, "out": x,
            "out_stride": n, "w": np.ones(n, np.float32), "eps": 1e-6, "n": n}
    z = aligned_zeros(1, np.int32)
    nat.Plan(pool, [good], z, z, z, z, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match=r"op 0 \(blk.0.attn_norm\): rmsnorm: unknown key 'epsilon'"):
        nat.Plan(pool, [dict(good, epsilon=1e-6)], z, z, z, z, 1, 1, 1, 1, 1)
    missing = dict(good)
    del missing["eps"]
    with pytest.raises(ValueError, match=r"op 0 \(blk.0.attn_norm\): rmsnorm: missing key 'eps'"):
        nat.Plan(pool, [missing], z, z, z, z, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown op kind 99"):
        nat.Plan(pool, [dict(good, kind=99)], z, z, z, z, 1, 1, 1, 1, 1)


def test_op_kinds_come_from_the_executor():
    assert {"embed", "rmsnorm", "matmul", "rope_kv", "attention", "silu_mul"} <= set(KIND_IDS)
    assert KIND_IDS == nat.OP_KINDS


def test_every_op_kind_has_each_representation():
    """An op kind is a row of the executor's table (executor.h); the plan's dataclass, the engine's dict builder
    and the debugger's NumPy implementation are found by its name: none may be missing on either side."""
    from barellm.arch.plan import OP_TYPES
    from barellm.runtime.debug import Debugger
    from barellm.runtime.engine import NativeEngine

    kinds = {t.kind for t in OP_TYPES}
    assert kinds == set(nat.OP_KINDS)
    for kind in kinds:
        assert callable(getattr(NativeEngine, f"_spec_{kind}", None)), kind
        assert callable(getattr(Debugger, f"_numpy_{kind}", None)), kind
