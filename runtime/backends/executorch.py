"""Run an edgefinfer .pte with ExecuTorch's Python runtime (the same C++ runtime phones link).

The program holds its KV cache in mutable buffers that persist between calls, so a backend is one
sequence. The cache layout and limits are read from the program's own constant methods
(`edgefinfer.bundle.artefact` writes and reads them): no side file is needed.

Rollback and reset are positional and cost nothing: a forward at `start_pos` hides every cached
entry at a position >= start_pos (causality in the static cache; the ring cache marks those slots
empty before writing), so starting again at 0 is a reset and starting at the first rejected
speculative position is a rollback. Reloading the method is never needed.

Loading: the C++ runtime's `_load_program(path)` maps the file (ExecuTorch's MmapDataLoader; constant
weights are read from the mapping, not copied, except what a delegate repacks at init, e.g. XNNPACK's
weight packing). Kernel libraries are registered before loading: the quantized kernels
(`quantized_decomposed::embedding_4bit`, ...) and the LLM custom ops (`llama::update_cache`,
`llama::custom_sdpa`); without them loading fails with "Missing operator".

Start-up: the runtime is ExecuTorch's C++ extension (`executorch.extension.pybindings._C`, which needs
libtorch, hence `import torch`) and the kernel libraries' shared objects, nothing else. ExecuTorch's own
Python wrappers import its exporter: `portable_lib` (and `executorch.runtime`, built on it) imports
`executorch.exir` for a warning class, and the kernel modules register the ops for torch.export as well
(`torch._inductor`, exir's edge.yaml): 5-15 s and about 100 MiB of a start, none of it used to run a
program. So this module calls `_C` directly and loads the libraries as their modules would
(`torch.ops.load_library`: the libraries' static initializers register the kernels with ExecuTorch).

This module must not import `edgefinfer.compile` (a phone has no exporter).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edgefinfer.bundle.artefact import PTE_SLOT_POSITIONS, pte_kv_buffers, read_spec
from edgefinfer.errors import UserError
from edgefinfer.libraries.cpus import affinity_cap
from edgefinfer.runtime.backends.base import UNBOUNDED

# The kernel libraries an edgefinfer .pte may use: the Python module ExecuTorch registers each with, and
# the shared object that module loads (its folder in the executorch package, its name without `lib` and
# suffix). The module is the fallback where the shared object is not found (another build's layout).
KERNEL_LIBRARIES = (("executorch.kernels.quantized", "kernels/quantized", "quantized_ops_aot_lib"),
                    ("executorch.extension.llm.custom_ops.custom_ops", "extension/llm/custom_ops",
                     "custom_ops_aot_lib"))
KERNEL_MODULES = tuple(module for module, _, _ in KERNEL_LIBRARIES)
_registered = False


def runtime_module():
    """ExecuTorch's C++ runtime extension (`_C`: load_program, the thread pool, the backend registry)."""
    try:  # torch (imported above) has loaded libtorch, which _C links against, as portable_lib does first
        from executorch.extension.pybindings import _C
    except ImportError as e:
        raise UserError(f"ExecuTorch is not installed or incomplete ({e}); pip install executorch==1.5.1") from None
    return _C


def package_dirs() -> list[Path]:
    """The executorch package's folders (a namespace package may have several), without importing it."""
    spec = importlib.util.find_spec("executorch")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []


def kernel_library(folder: str, stem: str, roots: Sequence[Path]) -> Path | None:
    """The shared object `lib{stem}.so` (or .dylib) in `folder` of the first package root holding it."""
    for root in roots:
        for path in sorted((root / folder).glob(f"lib{stem}.*")):
            if path.suffix in (".so", ".dylib"):
                return path
    return None


def register_kernels() -> None:
    """Register the kernel libraries an edgefinfer .pte may use with ExecuTorch (idempotent)."""
    global _registered
    if _registered:
        return
    runtime_module()  # the libraries link against _C: it is loaded first
    roots = package_dirs()
    for module, folder, stem in KERNEL_LIBRARIES:
        library = kernel_library(folder, stem, roots)
        try:
            if library is not None:
                torch.ops.load_library(str(library))
            else:
                importlib.import_module(module)
        except (ImportError, OSError) as e:
            raise UserError(f"ExecuTorch is not installed or incomplete ({module}: {e}); "
                            "pip install executorch==1.5.1") from None
    _registered = True


def set_threads(threads: int) -> None:
    """Size ExecuTorch's (process-wide) thread pool, used by XNNPACK and the custom ops, and libtorch's
    OpenMP pool the same: the kernel libraries link libtorch, and kernels running there leave that pool's
    workers (one per core by default) spinning after every parallel region. At --threads 1 on a 2-core
    host the spinning took the first 36-token prefill of the android bundle from 0.08 to 0.4-0.95 s of
    CPU (the logits bit-identical either way)."""
    runtime_module()._unsafe_reset_threadpool(int(threads))
    torch.set_num_threads(int(threads))


class ExecuTorchBackend:
    name = "executorch"
    # XNNPACK's and custom_sdpa's rows change with where a call starts and how long it is (up to ~1 logit
    # on the android default): a session feeds a conversation in turn-aligned calls (`runtime.session`).
    rows_depend_on_calls = True

    def __init__(self, pte_path: str | Path, threads: int | None = None, prefill_grid: int | None = None):
        """prefill_grid: feed prompts in calls that start and end on multiples of this many positions
        (`prefill_grid` in `backends.base`): XNNPACK's and custom_sdpa's rows change with where a call
        starts and how long it is, so only a fixed grid makes a prompt's logits a function of its ids
        (sessions then equal stateless runs). Costs prefill speed: more, shorter calls."""
        path = Path(pte_path)
        if not path.is_file():
            raise UserError(f"ExecuTorch program {path} does not exist (export one with `edgefinfer build`)")
        register_kernels()
        runtime = runtime_module()
        threads = threads or affinity_cap()  # None: ExecuTorch's pool, one thread per host CPU
        if threads is not None:
            set_threads(threads)
        try:
            # Minimal verification (the default) segfaults on a damaged flatbuffer; this refuses it.
            self._program = runtime._load_program(str(path),
                                                  program_verification=runtime.Verification.InternalConsistency)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"{path} is not a loadable ExecuTorch program ({e}); re-export it") from None
        self.path = path
        names = [self._program.get_method_name(i) for i in range(self._program.num_methods())]
        self.methods = {n: self._constant(n) for n in names if n != "forward"}
        if "get_vocab_size" not in self.methods or "get_max_seq_len" not in self.methods:
            raise UserError(f"{path} lacks the LLM metadata methods (get_vocab_size, get_max_seq_len): "
                            "it was not exported by edgefinfer or ExecuTorch's LLM exporter")
        try:
            self._forward = self._program.load_method("forward")
        except RuntimeError as e:
            # Typically a delegate this runtime lacks (a Core ML program on Linux); the reason is in
            # ExecuTorch's log line ("Backend CoreMLBackend is not registered").
            have = ", ".join(runtime._get_registered_backend_names())
            raise UserError(f"cannot load {path.name}: its forward method needs a delegate or kernel this "
                            f"ExecuTorch runtime lacks (it has {have}); Core ML programs run on Apple devices "
                            f"only ({e})") from None
        self.artefact = spec = read_spec("pte", self.methods)
        self.vocab_size = spec.vocab_size
        self.max_chunk = spec.kv.max_chunk  # tokens per call (the graph's bound)
        if prefill_grid is not None and not 1 <= prefill_grid <= self.max_chunk:
            raise UserError(f"--prefill-grid must be between 1 and {self.max_chunk} (the tokens {path.name} "
                            f"takes per call), got {prefill_grid}")
        self.prefill_grid = prefill_grid
        self.window = spec.kv.window
        self.num_sinks = spec.kv.sinks
        self.lookahead = spec.kv.lookahead
        if spec.kv.streams:  # rejected tokens must not have overwritten ring slots still inside the window
            self.max_draft_tokens = self.lookahead or 0
        self.max_seq_len = UNBOUNDED if spec.kv.streams else spec.kv.max_seq_len
        self.all_logits = spec.all_logits
        self.eos_ids = list(spec.eos_ids)
        self.bos_id = spec.bos_id
        self.kv_buffers, self._slot_pos = self._cache_views(spec.num_layers)

    def _cache_views(self, num_layers: int | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The program's K/V buffers (and a ring's slot positions) as tensors over its own memory, or
        ([], None) for a program exported without their names (its sessions then save token ids only)."""
        if not num_layers:
            return [], None
        try:
            buffers = [self._forward.get_attribute(name) for name in pte_kv_buffers(num_layers)]
            slot_pos = self._forward.get_attribute(PTE_SLOT_POSITIONS) if self.window is not None else None
        except RuntimeError:  # "Failed to get attribute": exported before edgefinfer emitted the names
            return [], None
        return buffers, slot_pos

    def _constant(self, name: str):
        out = self._program.load_method(name)([])
        value = out[0] if len(out) == 1 else list(out)
        return value.tolist() if isinstance(value, torch.Tensor) else value

    def _run(self, tokens: Sequence[int], start_pos: int) -> torch.Tensor:
        """One call: at most max_chunk tokens -> logits [S or 1, V]."""
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        pos = torch.tensor([start_pos], dtype=torch.long)
        return self._forward([ids, pos])[0][0]

    def _chunks(self, tokens: Sequence[int], start_pos: int) -> list[tuple[Sequence[int], int]]:
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if start_pos + n > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + n} tokens but {self.path.name} holds "
                            f"{self.max_seq_len}; export with a larger max_seq_len or a window cache")
        if self.prefill_grid is None:
            return [(tokens[i:i + self.max_chunk], start_pos + i) for i in range(0, n, self.max_chunk)]
        g, chunks, i = self.prefill_grid, [], 0
        while i < n:  # up to the next multiple of the grid, then whole grid chunks
            end = min(n, (start_pos + i) // g * g + g - start_pos)
            chunks.append((tokens[i:end], start_pos + i))
            i = end
        return chunks

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Logits float32 [len(tokens), vocab]; prompts longer than max_chunk are fed in pieces."""
        if not self.all_logits and len(tokens) > 1:
            raise UserError(f"{self.path.name} returns the last position's logits only (exported with "
                            "all_logits=False); use forward_last, or re-export with all_logits=True")
        rows = [self._run(chunk, pos) for chunk, pos in self._chunks(tokens, start_pos)]
        return torch.cat(rows).float().numpy()

    def forward_last(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Logits float32 [vocab] of the last token only (a prefill that does not need the others)."""
        last = None
        for chunk, pos in self._chunks(tokens, start_pos):
            last = self._run(chunk, pos)
        return last[-1].float().numpy()

    # ---- a saved session's cache (runtime/session.py) ----
    def _ring_holds(self, length: int) -> bool:
        """A ring describes exactly positions < `length` (not after rejected speculative tokens, whose
        writes may have evicted rows still in the window: those cannot be restored from a file)."""
        return int(self._slot_pos.max()) == length - 1

    def export_cache(self, length: int) -> dict[str, np.ndarray] | None:
        """Copies of the buffers that hold positions < `length`: a static buffer's first `length` slots,
        a ring whole with its slot positions; None where this program cannot give them."""
        if not self.kv_buffers:
            return None
        if self._slot_pos is None:
            return {f"kv{i}": b[:, :length].numpy().copy() for i, b in enumerate(self.kv_buffers)}
        if not self._ring_holds(length):
            return None
        return {**{f"kv{i}": b.numpy().copy() for i, b in enumerate(self.kv_buffers)},
                "slot_pos": self._slot_pos.numpy().copy()}

    def cache_shapes(self, length: int) -> dict[str, tuple[int, ...]]:
        if self._slot_pos is None:
            return {f"kv{i}": (b.shape[0], length, *b.shape[2:]) for i, b in enumerate(self.kv_buffers)}
        return {**{f"kv{i}": tuple(b.shape) for i, b in enumerate(self.kv_buffers)},
                "slot_pos": tuple(self._slot_pos.shape)}

    def import_cache(self, arrays: dict[str, np.ndarray], length: int) -> None:
        """Put back what `export_cache(length)` returned, into the program's own buffers."""
        for i, b in enumerate(self.kv_buffers):
            b[:, :arrays[f"kv{i}"].shape[1]] = torch.from_numpy(np.array(arrays[f"kv{i}"]))
        if self._slot_pos is not None:
            self._slot_pos.copy_(torch.from_numpy(np.array(arrays["slot_pos"])))

    def rollback(self, length: int) -> None:
        pass  # positional: the next forward at `length` hides everything at positions >= length

    def reset(self) -> None:
        pass  # positional: a forward at position 0 hides the whole previous sequence
