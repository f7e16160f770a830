"""bench/server_gpu.sh on a machine without CUDA: it stops before doing anything, with one line that
says what is missing, and exit code 2 (issue 13: tested up to the point a GPU is needed)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "server_gpu.sh"


def _run(tools: Path, cache: Path) -> subprocess.CompletedProcess:
    """The script with a PATH of `tools` only: the few coreutils it runs before its checks, plus
    whatever a test puts there (this host's own nvcc or nvidia-smi, if any, stay out of sight)."""
    for name in ("dirname", "date", "nproc"):
        if not (tools / name).exists():
            (tools / name).symlink_to(shutil.which(name))
    env = {"PATH": str(tools), "HOME": os.environ.get("HOME", "/"), "CACHE": str(cache)}
    return subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def _fake_tool(folder: Path, name: str) -> None:
    tool = folder / name
    tool.write_text("#!/bin/sh\necho fake GPU, 1 MiB, 0.0\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def test_without_nvidia_smi_it_stops_with_one_line(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    result = _run(tools, tmp_path / "cache")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["no nvidia-smi: this script needs an NVIDIA GPU"]
    assert result.stdout == ""
    assert not (tmp_path / "cache").exists()  # nothing was created


def test_with_a_gpu_but_no_cuda_toolkit_it_names_nvcc(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    _fake_tool(tools, "nvidia-smi")
    result = _run(tools, tmp_path / "cache")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["no nvcc: install the CUDA toolkit (12.x or 13.x)"]
    assert not (tmp_path / "cache").exists()


def test_the_replica_step_passes_only_flags_that_bench_server_scale_takes():
    """The GPU-only replica step cannot run here; what it hands bench/server_scale.py can be checked."""
    line = next(x for x in SCRIPT.read_text().splitlines() if x.strip().startswith("SARGS=("))
    flags = re.findall(r"--[a-z][a-z-]+", line)
    assert {"--replicas", "--gpu-layers", "--out"} <= set(flags)
    usage = subprocess.run([sys.executable, str(SCRIPT.parent / "server_scale.py"), "--help"], capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr
    assert [f for f in flags if f not in usage.stdout] == []
