"""Loading llama.cpp: llama-cpp-python's ctypes module, its log silenced, and a model load that starts early.

Nothing here imports numpy (or the runtime's other modules): `start_early_load` runs before them.
`edgefinfer run` on a GGUF starts llama.cpp's load of the weights in a thread as soon as its command
line is parsed; the native load releases the GIL, so numpy and the runtime import beside it instead of
before it (on this 2-core host: imports and load 0.33-0.40 s one after the other, 0.27-0.29 s side by
side), and `LlamaModel` takes the loaded model (`take_early_load`) instead of loading the file again.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from pathlib import Path

from edgefinfer.errors import UserError


def llama_cpp_lib():
    """llama-cpp-python's ctypes bindings (`llama_cpp.llama_cpp`), or a UserError saying how to install it.

    Only the bindings are loaded: the package's `__init__` also imports its high-level `Llama` (and
    with it jinja2 and its chat formats), 0.1 s of a 0.5 s start that this module never uses. Where
    nothing has imported the package yet, it is registered with its `__init__` deferred until another
    name of it is asked for (`from llama_cpp import Llama` elsewhere in the process still works)."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.loader is None:
            raise UserError("llama-cpp-python is not installed: pip install 'edgefinfer[llamacpp]' (it builds "
                            "from source, about 7 minutes; see the README for CUDA)")
        sys.modules["llama_cpp"] = _deferred_package(spec)
    return importlib.import_module("llama_cpp.llama_cpp")


def _deferred_package(spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
    """The package module of `spec` whose own `__init__` runs on the first lookup of a name it defines
    (PEP 562's module `__getattr__`); importing its submodules does not run it."""
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        del package.__getattr__  # the package's own names from here on
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = __getattr__
    return package


_log_callback = None


def silence(lib) -> None:
    """Route llama.cpp's log lines nowhere (they go to stderr by default). Kept alive globally: the C
    side holds the pointer."""
    global _log_callback
    if _log_callback is None:
        _log_callback = _native_discard(lib) or lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_log_callback, None)
        lib.llama_backend_init()


def _native_discard(lib):
    """A log callback that never enters Python: the C library's `abs`, or None where it cannot be found.

    A Python callback takes the GIL on every line, and loading a model logs about 1,200 of them: while
    another thread holds the GIL (a tokenizer.json parse, which holds it throughout) the load stalls at
    the next line, so a parse beside it made it 0.29 -> 0.57-0.71 s instead of overlapping. `abs(level)`
    reads the level argument and nothing else; the callback's return value and its two other arguments
    are ignored, which the x86-64 and AArch64 calling conventions allow (the caller owns the argument
    registers and discards the result)."""
    try:
        return ctypes.cast(ctypes.CDLL(None).abs, lib.llama_log_callback)
    except (OSError, AttributeError, TypeError):  # no C library to open by name (Windows)
        return None


_early: dict[Path, tuple[threading.Thread, list]] = {}  # resolved path -> (its loading thread, [model pointer])


def start_early_load(path: Path) -> None:
    """Start llama.cpp's load of the GGUF at `path` (the default model parameters: CPU, mapped) in a
    thread. Whatever goes wrong there is left for `LlamaModel` to report: the thread only loads a file
    whose header passed `check_gguf` (llama.cpp aborts the process on some hostile ones)."""
    from edgefinfer.files.untrusted import check_gguf

    lib = llama_cpp_lib()
    silence(lib)
    key, box = path.resolve(), []

    def load() -> None:
        try:
            check_gguf(key)
        except UserError:
            return
        box.append(lib.llama_model_load_from_file(str(key).encode(), lib.llama_model_default_params()) or None)

    thread = threading.Thread(target=load, daemon=True)
    _early[key] = (thread, box)
    thread.start()


def take_early_load(path: Path):
    """The model pointer an early load of `path` made (waiting for it to finish), or None where none
    was started or it failed. Taken once: the caller owns and frees it."""
    thread, box = _early.pop(path.resolve(), (None, None))
    if thread is None:
        return None
    thread.join()
    return box[0] if box else None
