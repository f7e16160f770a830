"""Shared pieces of the benchmarks: machine description, versions, timing, JSON output, a table."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import psutil

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        # The affinity mask, which thread defaults follow (edgefinfer.libraries.cpus; read here without the
        # package, which bench/first_run.py runs before installing).
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_model() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo): kernels such as XNNPACK's and llama.cpp's are picked
    by CPU, so two runs on hosts of the same size but another CPU are not the same measurement."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def uptime() -> str:
    """`uptime`'s line: the host's load, recorded before and after a measurement (a busy host makes every
    figure noisy, and flatters whichever engine suffers less from sharing the cores)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def versions(*packages: str) -> dict:
    out = {}
    for name in ("edgefinfer", "torch", *packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """Median of what `repeats` calls return (runs that time their own inner part); no warm-up."""
    return sorted(fn() for _ in range(repeats))[repeats // 2]


def result_stem(name: str, quick: bool) -> str:
    """File stem of a benchmark's results: a --quick run writes beside the committed full run's
    files (`<name>-quick.*`, ignored by git) instead of over them."""
    return f"{name}-quick" if quick else name


def write_results(name: str, payload: dict, quick: bool = False) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{result_stem(name, quick)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return "-" if v is None else str(v)
