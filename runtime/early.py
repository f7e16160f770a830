"""Start-up work `edgefinfer run` and `chat` begin before they import the runtime (numpy and the rest).

A GGUF (a gpu-server bundle's or a bare one): llama.cpp starts loading its weights in a thread
(`llamacpp_lib.start_early_load`), so that the imports run beside the native load, which releases the
GIL, instead of before it. Anything wrong with the path or the bundle is left for `Engine.load` to
report, in its own words.
"""

from __future__ import annotations

from edgefinfer.errors import UserError


def start_loading(model: str, backend: str | None) -> None:
    from edgefinfer.bundle.resolve import resolve

    try:
        src = resolve(model, backend)
        if src.backend == "llamacpp" and src.is_gguf:
            from edgefinfer.runtime.backends.llamacpp_lib import start_early_load

            start_early_load(src.path)
    except UserError:
        return
