"""How many CPUs this process may run on: the default for every thread count edgefinfer picks.

`os.cpu_count()` counts the host's CPUs, not the ones this process is allowed on. Under a cpuset
(`taskset`, Docker's `--cpuset-cpus`, Kubernetes' static CPU manager, a pinned benchmark worker)
llama.cpp started with that many threads runs more spinning OpenMP threads than it has cores, and
every barrier waits for a thread that is not running. The affinity mask is what Python 3.13's
`os.process_cpu_count()` reads; this is that, for 3.11. (A CFS quota, Docker's `--cpus`, does not
narrow the mask and is not read here, as neither Python nor llama.cpp reads it.)
"""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (all of the host's where the platform has no mask), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return os.cpu_count() or 1


def affinity_cap() -> int | None:
    """`usable_cpus()` where the mask is narrower than the host (a cpuset), else None. For libraries that
    size their pools by the host's CPUs whatever the mask (ONNX Runtime's intra-op pool, ExecuTorch's
    threadpool: 2 threads under `taskset -c 0` here): on a whole host their own default (ONNX Runtime's
    is the physical cores) stays theirs."""
    n = usable_cpus()
    return n if n < (os.cpu_count() or n) else None
