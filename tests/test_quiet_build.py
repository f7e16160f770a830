"""A quiet build: third-party log lines that tell the user nothing are dropped, the build's own
progress and summary stay, and `--verbose` brings the libraries' lines back. Bundle files get the
user's normal file mode."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_model, tiny_tokenizer

# Lines a newcomer used to see from torchao, torch, ExecuTorch, ONNX Runtime / QNN (see edgefinfer.libraries.quiet).
NOISE = ("Failed to load", "_pytree.py", "LeafSpec", "cpuinfo_utils.cpp", "threadpool.cpp", "W:onnxruntime",
         "WARNING:root", "LIBNATIVE")

# Imports torchao, starts ExecuTorch's thread pool (C++ lines on fd 2) and writes like Qualcomm's
# libraries (fd 1), then prints progress of its own on both.
SCRIPT = """
import os, sys
from edgefinfer.libraries.quiet import quiet
with quiet({enabled}):
    import torchao
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    _unsafe_reset_threadpool(1)
    os.write(1, b" # LIBNATIVE: No alternate configuration present in libnative_tls.conf\\n")
    print("[build 1/5] progress", file=sys.stderr)
    print("summary")
"""


def _user_mode(directory: bool = False) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


@pytest.mark.skipif(importlib.util.find_spec("executorch") is None, reason="needs executorch")
@pytest.mark.parametrize("enabled", [True, False])
def test_quiet_drops_library_lines_and_keeps_ours(enabled):
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(enabled=enabled)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert "[build 1/5] progress" in proc.stderr and proc.stdout.strip().endswith("summary")
    noisy = [line for line in (proc.stderr + proc.stdout).splitlines() if any(n in line for n in NOISE)]
    if enabled:
        assert noisy == []
    else:  # the libraries really do print these here (else the check above would prove nothing)
        assert any("cpuinfo_utils.cpp" in line for line in noisy) and any("LIBNATIVE" in line for line in noisy)


@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_qnn") is None, reason="needs onnxruntime-qnn")
def test_cli_build_and_run_are_quiet_and_the_bundle_readable(tmp_path):
    """The qnn target is the fastest build that goes through noisy libraries (ONNX Runtime's QNN EP
    and quantizer, Qualcomm's libraries on stdout); its quantizer also writes 0600 files. `run` on
    the HTP emulator loads the same libraries."""
    from edgefinfer.model.checkpoint import save_model

    tok = tiny_tokenizer(320)
    tok.eos_token = None  # a random model would stop at a random EOS
    save_model(tiny_model(vocab_size=tok.vocab_size, max_position_embeddings=256, eos_token_id=None), tmp_path / "m")
    tok.save(tmp_path / "m")
    args = ["build", "--target", "qnn", "-m", str(tmp_path / "m"), "-o", str(tmp_path / "b"), "--max-seq-len", "32",
            "--eval-tokens", "64"]
    # An empty artefact cache (the corpora shared): a hit left by another test would skip the noisy libraries.
    from edgefinfer.files.user_cache import cache_dir

    (cache_dir() / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "data").symlink_to(cache_dir() / "data")
    env = {**os.environ, "EDGEFINFER_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in (proc.stderr + proc.stdout).splitlines() if any(n in line for n in NOISE)] == []
    assert all(f"[build {i}/5]" in proc.stderr for i in range(1, 6)) and "[qnn] context binaries" in proc.stderr
    assert "vs float" in proc.stdout  # the summary table
    run = subprocess.run([sys.executable, "-m", "edgefinfer", "run", str(tmp_path / "b"), "-p", "It is", "-n", "4"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "EDGEFINFER_QNN_EP": "qnn"})
    assert run.returncode == 0, run.stderr
    assert [line for line in (run.stderr + run.stdout).splitlines() if any(n in line for n in NOISE)] == []
    assert "4 generated" in run.stderr
    bundle = tmp_path / "b"
    assert bundle.stat().st_mode & 0o777 == _user_mode(directory=True)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in bundle.iterdir()} == \
        {p.name: oct(_user_mode()) for p in bundle.iterdir()}


@pytest.mark.llamacpp
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama-cpp-python")
def test_gpu_server_build_hides_llama_cpp_quantizer_lines_unless_verbose(tmp_path):
    """llama.cpp's quantizer prints its loader dump and a line a tensor (C stderr); --verbose keeps them."""
    from edgefinfer.model.checkpoint import save_model

    tok = tiny_tokenizer(320)
    save_model(tiny_model(vocab_size=tok.vocab_size, max_position_embeddings=256, hidden_size=64,
                          intermediate_size=128), tmp_path / "m")
    tok.save(tmp_path / "m")
    llama_lines = ("llama_model_loader:", "llama_model_quantize_impl:", "converting to q4_1")
    for verbose in (False, True):
        args = ["build", "--target", "gpu-server", "-m", str(tmp_path / "m"), "-o", str(tmp_path / f"b{verbose}"),
                "--eval-tokens", "0", *(["--verbose"] if verbose else [])]
        proc = subprocess.run([sys.executable, "-m", "edgefinfer", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        shown = [line for line in (proc.stderr + proc.stdout).splitlines() if any(n in line for n in llama_lines)]
        assert bool(shown) == verbose, shown[:3]
        assert "[build 4/5] compile gguf" in proc.stderr
