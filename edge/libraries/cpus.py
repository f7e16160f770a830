"""How many CPUs and cores this process may run on: the defaults of every thread count edgefinfer picks.

`os.cpu_count()` counts the host's CPUs, not the ones this process is allowed on. Under a cpuset
(`taskset`, Docker's `--cpuset-cpus`, Kubernetes' static CPU manager, a pinned benchmark worker)
llama.cpp started with that many threads runs more spinning OpenMP threads than it has cores, and
every barrier waits for a thread that is not running. The affinity mask is what Python 3.13's
`os.process_cpu_count()` reads; `usable_cpus` is that, for 3.11. (A CFS quota, Docker's `--cpus`, does
not narrow the mask and is not read here, as neither Python nor llama.cpp reads it.)

A compute thread per SMT sibling only makes two threads share one core's vector units: llama.cpp's
default (`common_cpu_get_num_math`: one thread per distinct `thread_siblings` set), PyTorch's and ONNX
Runtime's are one thread per physical core, which `usable_cores` counts within the mask.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSFS_CPUS = Path("/sys/devices/system/cpu")


def _mask() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return None


def usable_cpus() -> int:
    """CPUs in this process's affinity mask (all of the host's where the platform has no mask), >= 1."""
    mask = _mask()
    return max(1, len(mask)) if mask is not None else os.cpu_count() or 1


def usable_cores(cpus: set[int] | None = None, sysfs: Path = SYSFS_CPUS) -> int:
    """Physical cores among `cpus` (default: the affinity mask), >= 1: the CPUs' distinct SMT sibling
    sets, as llama.cpp counts them. Where the topology cannot be read, one core per CPU."""
    cpus = _mask() if cpus is None else cpus
    if not cpus:
        return usable_cpus()
    try:
        siblings = {(sysfs / f"cpu{c}" / "topology" / "thread_siblings_list").read_text().strip() for c in cpus}
    except OSError:
        return len(cpus)
    return max(1, len(siblings))


def affinity_cap() -> int | None:
    """`usable_cpus()` where the mask is narrower than the host (a cpuset), else None. For libraries that
    size their pools by the host's CPUs whatever the mask (ONNX Runtime's intra-op pool, ExecuTorch's
    threadpool: 2 threads under `taskset -c 0` here): on a whole host their own default (ONNX Runtime's
    is the physical cores) stays theirs."""
    n = usable_cpus()
    return n if n < (os.cpu_count() or n) else None
