"""What barellm knows about the machine it runs on: cores, and the kernel path the native core uses."""

from __future__ import annotations

import os


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


def default_threads() -> int:
    """The worker threads a model gets unless told otherwise: $BARELLM_THREADS, else the physical cores."""
    env = os.environ.get("BARELLM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return physical_cores()


def cpu_info() -> dict[str, object]:
    """CPU features found and the kernel path in use (BARELLM_ISA=scalar forces the portable one)."""
    from barellm import _native

    return dict(_native.cpu_info())
