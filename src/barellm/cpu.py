"""What barellm knows about the machine it runs on: cores, memory, and the kernel path the native core uses."""

from __future__ import annotations

import os
import re
import sys

from barellm.errors import InvalidRequest


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads share the units the kernels saturate)."""
    try:
        cores = set()
        with open("/proc/cpuinfo") as f:
            phys = core = None
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        cores.add((phys, core))
                    phys = core = None
        if cores:
            return min(len(cores), len(os.sched_getaffinity(0)))
    except (OSError, AttributeError):
        pass
    return max(1, os.cpu_count() or 2)


def spare_core(threads: int) -> bool:
    """Whether this process may run more threads than the engine's `threads`: then a grammar's masks are
    computed on a worker thread beside the forward pass, else in line."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores > threads


def default_threads() -> int:
    """The worker threads a model gets unless told otherwise: $BARELLM_THREADS, else the physical cores."""
    env = os.environ.get("BARELLM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores()


def tier_names() -> tuple[str, ...] | None:
    """Every kernel tier, lowest first, as the native core names them (its list is the only one); None
    where the core is not built, and then no tier is in use to name."""
    try:
        from barellm import _native
    except ImportError:
        return None
    return tuple(_native.tier_names())


_PREFETCH_RULE = re.compile(r"none|(l1|l2|nta):(\d+)")


def check_prefetch_env() -> None:
    """Refuses a BARELLM_PREFETCH the native core would ignore: ALONE[,SHARED], each none or HINT:BYTES with
    HINT l1, l2 or nta and BYTES in 64..1048576 (the distance the decode tiles prefetch ahead). Set but
    empty means unset (`BARELLM_PREFETCH= barellm ...` restores the CPU family's rules), as in the core."""
    want = os.environ.get("BARELLM_PREFETCH")
    if not want:
        return
    parts = want.split(",")
    ok = 1 <= len(parts) <= 2
    for part in parts:
        m = _PREFETCH_RULE.fullmatch(part)
        ok = ok and m is not None and (m.group(2) is None or 64 <= int(m.group(2)) <= 1 << 20)
    if not ok:
        raise InvalidRequest(f"BARELLM_PREFETCH={want!r}: expected ALONE[,SHARED], each 'none' or HINT:BYTES "
                             "with HINT l1, l2 or nta and BYTES in 64..1048576 (e.g. l2:8192,nta:16384)")


def check_isa_env() -> None:
    """Refuses a BARELLM_ISA that names no kernel tier (the native core would take it as no cap), and a
    BARELLM_AMX_MIN_TOKENS that is not a positive count (the core would ignore it); set but empty means unset."""
    want = os.environ.get("BARELLM_ISA")
    tiers = tier_names() if want else None
    if want and tiers is not None and want not in tiers:
        raise InvalidRequest(f"BARELLM_ISA={want!r} is not a kernel tier: expected one of {', '.join(tiers)}")
    min_tokens = os.environ.get("BARELLM_AMX_MIN_TOKENS")
    if min_tokens and not (min_tokens.isdigit() and 0 < int(min_tokens) <= 1 << 20):
        raise InvalidRequest(f"BARELLM_AMX_MIN_TOKENS={min_tokens!r}: expected the fewest tokens a matmul call "
                             "runs on the AMX tiles, a whole number from 1")


def cpu_info() -> dict[str, object]:
    """The kernel tiers this CPU runs ('tiers') and the one in use ('isa'; BARELLM_ISA caps it)."""
    from barellm import _native

    return dict(_native.cpu_info())


def available_memory() -> int | None:
    """Bytes that can be allocated without swapping: the kernel's MemAvailable, or what is left under this
    process's cgroup limit if that is less; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: a container's limit is not in /proc/meminfo
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(max(0, int(limit) - int(f.read().strip())))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


MEMORY_HEADROOM = 0.9  # of the available memory, what an engine may plan to take
KV_NOTE_BYTES = 1 << 30  # a KV cache this large is mentioned on stderr before it is allocated


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def check_memory(engine: str, n_ctx: int, kv_per_token: int, other_per_token: int = 0, fixed: int = 0,
                 *, fixed_what: str = "") -> None:
    """Before an engine allocates for a context of n_ctx tokens: refuses (InvalidRequest) what the available
    memory cannot hold, naming the largest --context that fits, and notes on stderr a KV cache of a GiB or
    more. kv_per_token and other_per_token (RoPE tables, ...) grow with the context; fixed does not (the
    reference engine's float weights: fixed_what says what it is)."""
    per_token = kv_per_token + other_per_token
    kv, need = kv_per_token * n_ctx, fixed + per_token * n_ctx
    avail = available_memory()
    if avail is not None and need > MEMORY_HEADROOM * avail:
        fit = int((MEMORY_HEADROOM * avail - fixed) // max(per_token, 1))
        fit = fit // 256 * 256 if fit >= 256 else fit // 16 * 16
        hint = f"--context {fit} would fit" if fit >= 16 else "not even a context of 16 tokens fits"
        parts = f"KV cache {_gib(kv)}" + (f", {fixed_what} {_gib(fixed)}" if fixed >= 1 << 20 and fixed_what else "")
        raise InvalidRequest(f"a context of {n_ctx} tokens needs {_gib(need)} of memory ({engine} engine: {parts}), "
                             f"but {_gib(avail)} is available; {hint}")
    if kv >= KV_NOTE_BYTES:
        print(f"barellm: the KV cache for a context of {n_ctx} tokens takes {_gib(kv)}", file=sys.stderr)
