"""Keep third-party chatter out of a command's output, so that its own progress lines stay readable.

What a newcomer's `edgefinfer build` used to print besides its own lines, and where each comes from:

    Failed to load .../torchao/_C_mxfp8...so       torchao's optional CUDA kernels (logger "torchao")
    W... torch/utils/_pytree.py:630] <enum ...>    torch's pytree deprecation notes (logger "torch.utils._pytree")
    FutureWarning: LeafSpec is deprecated ...      the same, through `warnings`
    WARNING:root:Please consider to run pre-...    onnxruntime.quantization, on the root logger
    [W:onnxruntime:, qnn_execution_provider...]    ONNX Runtime's own C++ logger (severity warning)
    [cpuinfo_utils.cpp:71] Reading file /sys/...   ExecuTorch's C++ thread pool, straight to file descriptor 2
    # LIBNATIVE: No alternate configuration ...    Qualcomm's QNN libraries, straight to file descriptor 1

None of it tells the user anything they can act on. `quiet()` silences the Python-side sources at
their loggers and warning filters, and passes file descriptors 1 and 2 through filter threads for
the lines C++ libraries write directly (ExecuTorch's log level is fixed when its wheel is compiled, so
no setting reaches them). Everything else, errors included, goes through unchanged and in order.
`edgefinfer build --verbose` skips all of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from typing import Iterator

# Lines written by native code that are dropped (matched anywhere in the line).
NATIVE_NOISE = re.compile(r"^\[(cpuinfo_utils|threadpool)\.cpp:\d+\] |^\s*# LIBNATIVE: No alternate configuration"
                          r"|^Failed to load .*torchao/_C|torch/utils/_pytree\.py:\d+\]"
                          # llama.cpp's quantizer (the gpu-server build): its loader dump, one line a tensor
                          r"|^llama_model_(loader|quantize_impl): |^\[\s*\d+/\s*\d+\] \S+\s+- \["
                          r"|^warning: \S+\s+- ncols .* falling back to")
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "onnxscript", "onnx_ir")


class _DropThirdPartyWarnings(logging.Filter):
    """onnxruntime.quantization logs its advice through the root logger: drop its warnings by origin."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname


_ort_quiet = False  # set by silence_python_noise: `quiet_ort` then turns ONNX Runtime's logger down on import


def quiet_ort(ort) -> None:
    """ONNX Runtime's C++ warnings (the QNN EP's notes on features this host lacks): errors only, once a
    command asked for quiet. Called where ONNX Runtime is imported for the runtime (`ort_ep.import_ort`),
    so a command that never runs it (a GGUF) never loads it."""
    if _ort_quiet:
        ort.set_default_logger_severity(3)


def silence_python_noise(load_ort: bool = True) -> None:
    """Logger levels and warning filters for the sources above (before or after they are imported).
    load_ort: import ONNX Runtime now to quiet it (the build, whose exporters import it directly);
    False: quiet it when it is imported through `ort_ep.import_ort`, or now if it already is."""
    global _ort_quiet
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    root = logging.getLogger()
    if not any(isinstance(f, _DropThirdPartyWarnings) for f in root.filters):
        root.addFilter(_DropThirdPartyWarnings())
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|torchao|executorch|onnxscript)\b")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|torchao|executorch|coremltools)\b")
    _ort_quiet = True
    if not load_ort and "onnxruntime" not in sys.modules:
        return
    try:
        import onnxruntime

        quiet_ort(onnxruntime)
    except ImportError:
        pass


@contextlib.contextmanager
def filtered_fd(fd: int, noise: re.Pattern[str] = NATIVE_NOISE) -> Iterator[None]:
    """Route file descriptor `fd` (1 or 2: Python's and native code's output) through a thread that
    drops lines matching `noise`.

    Lines are passed on as they complete, so progress stays live; on exit the pipe is drained and
    the original descriptor restored."""
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.flush()
    original = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def pump() -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                kept = [line + b"\n" for line in lines if not noise.search(line.decode("utf-8", "replace"))]
                if kept:
                    os.write(original, b"".join(kept))
            if pending and not noise.search(pending.decode("utf-8", "replace")):
                os.write(original, pending)

    thread = threading.Thread(target=pump, name=f"fd{fd}-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stream.flush()
        os.dup2(original, fd)  # closes the pipe's last write end: the pump sees EOF and drains
        thread.join(timeout=5)
        os.close(original)


@contextlib.contextmanager
def quiet(enabled: bool = True, load_ort: bool = True) -> Iterator[None]:
    """Silence third-party noise for the duration of a command (no-op when not `enabled`); `load_ort`:
    see `silence_python_noise` (the runtime's commands pass False: a GGUF run never loads ONNX Runtime)."""
    if not enabled:
        yield
        return
    silence_python_noise(load_ort)
    with filtered_fd(1), filtered_fd(2):  # Qualcomm's libraries write to stdout, ExecuTorch's to stderr
        yield
