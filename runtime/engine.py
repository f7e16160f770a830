"""The on-device engine: load a bundle (or a single artefact), generate and stream text.

    engine = Engine.load("dist/android")                 # picks the backend from manifest.json
    for delta in engine.stream("Hello", max_tokens=64):   # or engine.generate(...)
        print(delta, end="")
    engine.generate("A user record:", response_format={"type": "json_schema", "json_schema": {"schema": s}})

`Engine.load` accepts a bundle folder, a `.pte`, an ONNX folder or `.onnx`, a `.gguf`, or a Hugging
Face folder (eager torch, the reference path). Bundles are verified against their manifest's hashes
before anything is loaded. The runtime never imports the exporters (`edgefinfer.compile`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from edgefinfer.bundle.artefact import Layout
from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import Generation, detokenize, encode_prompt, finish_reason, stop_token_ids
from edgefinfer.bundle.resolve import ModelSource, resolve
from edgefinfer.runtime.backends.base import Backend
from edgefinfer.runtime.decode import Speculation, generate_tokens
from edgefinfer.decoding.sampling import SamplingParams
from edgefinfer.decoding.structured import Constraint, Grammar, GrammarCompiler
from edgefinfer.tokenization.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgefinfer.runtime.session import Session

# What `response_format` accepts: OpenAI's dict, a Constraint, or an already compiled Grammar.
ResponseFormat = dict | Constraint | Grammar | None


@dataclass(frozen=True)
class KVOption:
    """`--kv` option: static (default) | window:N[,sinks:S] | paged:BLOCK (the shared paged-KV manager).

    layout: the exported layout this option asks for; None for the paged manager (chosen when
    running, never built into an artefact)."""

    layout: Layout | None = Layout.STATIC
    window: int | None = None
    sinks: int = 0
    block_size: int | None = None

    @property
    def paged(self) -> bool:
        return self.layout is None

    @classmethod
    def parse(cls, text: str | None) -> "KVOption":
        if not text or text == "static":
            return cls()
        head, _, rest = text.partition(":")
        try:
            if head == "window":
                parts = rest.split(",")
                window = int(parts[0])
                sinks = 0
                for extra in parts[1:]:
                    key, _, value = extra.partition(":")
                    if key != "sinks":
                        raise ValueError(extra)
                    sinks = int(value)
                if window < 1 or sinks < 0:
                    raise ValueError(text)
                return cls(Layout.WINDOW, window=window, sinks=sinks)
            if head == "paged":
                block = int(rest or 16)
                if block < 1:
                    raise ValueError(text)
                return cls(None, block_size=block)
        except ValueError:
            pass
        raise UserError(f"bad --kv {text!r}: use static, window:N[,sinks:S] or paged:BLOCK_SIZE")


@dataclass(frozen=True)
class SpeculativeOption:
    """`--speculative` option: draft:PATH[,K] | lookup[:N][,K]."""

    kind: str
    path: str | None = None
    ngram: int = 3
    k: int = 4

    @classmethod
    def parse(cls, text: str | None) -> "SpeculativeOption | None":
        if not text:
            return None
        head, _, rest = text.partition(":")
        try:
            if head == "draft" and rest:
                path, _, k = rest.partition(",")
                return cls("draft", path=path, k=int(k or 4))
            if head == "lookup":
                ngram, _, k = rest.partition(",")
                return cls("lookup", ngram=int(ngram or 3), k=int(k or 4))
        except ValueError:
            pass
        raise UserError(f"bad --speculative {text!r}: use draft:PATH[,K] or lookup[:NGRAM][,K]")


def open_backend(path: str | Path, kind: str | None = None, kv: KVOption = KVOption(), threads: int | None = None,
                 max_seq_len: int | None = None, prefill_grid: int | None = None) -> tuple[Backend, Tokenizer, dict]:
    """The backend and tokenizer for an artefact path (see `edgefinfer.bundle.resolve`); `kind` forces a backend."""
    src = resolve(path, kind)
    if src.kind == "bundle":
        # On llama.cpp the GGUF's own vocabulary, read with the weights, tokenizes (llamacpp_tokenizer).
        # Elsewhere tokenizer.json (3.5 MB of JSON for SmolLM2: 0.1-0.3 s) parses while the runtime loads
        # the weights, which ONNX Runtime does in native code with the GIL released. The parse holds the GIL
        # (tokenizers' from_file) from start to end, so whatever Python the main thread has left waits for
        # it: the imports come first, and the parse starts only when the backend calls `native_load` right
        # before its native load (or when it returns, for one that has none).
        _import_runtime(src.backend)
        native_load = threading.Event()
        tokenizer = None if src.llama_vocab else _Background(_after, native_load, src.tokenizer)
        try:
            if src.entry.format == "qnn-context":  # static graphs: QNN EP (HTP / emulator) or CPU EP, see open_qnn
                from edgefinfer.runtime.backends.ort import open_qnn

                if kv.layout is not Layout.STATIC:
                    raise UserError("a QNN bundle's cache is fixed at build time (a window of --max-seq-len "
                                    "slots); drop --kv")
                if prefill_grid is not None:
                    raise UserError("--prefill-grid is for ExecuTorch programs; a QNN bundle's prompt graph "
                                    "takes fixed chunks already")
                backend = open_qnn(src.folder, src.entry.meta, threads=threads)
            else:
                backend = _open(src.path, src.backend, kv, threads, max_seq_len, native_load.set,
                                prefill_grid=prefill_grid)
        finally:
            native_load.set()  # a backend that failed or never called it: the parse is not left waiting
        info = {"bundle": src.manifest.target, "artefact": src.entry.path, "sha256": src.entry.sha256}
        tokenizer = _llama_vocab(src, backend) if tokenizer is None else tokenizer.result()
    else:
        backend = _open(src.path, src.backend, kv, threads, max_seq_len, prefill_grid=prefill_grid)
        info = {"artefact": str(src.path)}
        # A bare GGUF: its own vocabulary, special tokens and template, as llama.cpp read them.
        tokenizer = _llama_vocab(src, backend) if src.llama_vocab else src.tokenizer()
    eog = backend.model.end_of_generation() if backend.name == "llamacpp" and src.eos_ids is None else None
    return backend, tokenizer, {**info, "eos_ids": src.stop_ids(tokenizer, eog), "path": str(src.path)}


def _llama_vocab(src: ModelSource, backend: Backend) -> Tokenizer:
    from edgefinfer.runtime.backends.llamacpp_tokenizer import LlamaVocabTokenizer

    return LlamaVocabTokenizer.for_source(src, backend.model)


def _import_runtime(kind: str | None) -> None:
    """Import a backend's module and its runtime's Python package (what `_open` would import first)."""
    if kind == "llamacpp":
        from edgefinfer.runtime.backends.llamacpp_binding import llama_cpp_lib

        llama_cpp_lib()
    elif kind == "onnxruntime":
        import edgefinfer.runtime.backends.ort  # noqa: F401
        from edgefinfer.libraries.ort_ep import import_ort

        import_ort()
    elif kind == "executorch":  # torch (seconds of GIL-bound imports), ExecuTorch's runtime and kernel libraries
        from edgefinfer.runtime.backends.executorch import register_kernels

        register_kernels()


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a backend's packages import and its weights load,
    then restored as it was. torch's import (a .pte's runtime) allocates enough objects to trigger several
    full collections that free nothing: 0.14 s of its 1.8 s of CPU on the 2-core host."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _after(event: threading.Event, fn: Callable):
    """`fn()` once `event` is set."""
    event.wait()
    return fn()


class _Background:
    """`fn(*args)` in a thread; `result()` joins it and returns its value or raises its exception."""

    def __init__(self, fn: Callable, *args):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _open(path: Path, kind: str | None, kv: KVOption, threads: int | None, max_seq_len: int | None,
          native_load: Callable[[], None] | None = None, prefill_grid: int | None = None) -> Backend:
    """The backend for `path`. `native_load` is called right before the weights load in native code with the
    GIL released (llama.cpp, ONNX Runtime), where other Python threads may run beside it."""
    window = kv.window  # None unless --kv window:N
    if prefill_grid is not None and kind != "executorch":
        raise UserError(f"--prefill-grid is for ExecuTorch programs, not {kind}: llama.cpp and ONNX Runtime "
                        "compute a prompt's rows the same however it is chunked")
    if kv.paged and kind != "torch":
        raise UserError(f"--kv paged runs on the torch backend (and in `edgefinfer serve`), not on {kind}")
    if kind == "torch":
        from edgefinfer.model.checkpoint import load_model
        from edgefinfer.runtime.backends.torch_eager import TorchBackend

        if threads:
            import torch

            torch.set_num_threads(threads)
        if kv.paged:
            from edgefinfer.runtime.backends.torch_paged import PagedTorchBackend

            return PagedTorchBackend(load_model(path), kv.block_size, max_seq_len)
        return TorchBackend(load_model(path), max_seq_len=max_seq_len, window=window, num_sinks=kv.sinks)
    if kind == "llamacpp":
        from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(path, n_ctx=max_seq_len or 2048, threads=threads, window=window, num_sinks=kv.sinks,
                               native_load=native_load)
    if kind == "executorch":
        from edgefinfer.runtime.backends.executorch import ExecuTorchBackend

        return _check_cache(ExecuTorchBackend(path, threads=threads, prefill_grid=prefill_grid), kv)
    if kind == "onnxruntime":
        from edgefinfer.runtime.backends.ort import OrtBackend

        return _check_cache(OrtBackend(path, threads=threads, max_seq_len=max_seq_len, native_load=native_load), kv)
    raise UserError(f"unknown backend {kind!r}: use torch, executorch, onnxruntime or llamacpp")


def _check_cache(backend: Backend, kv: KVOption) -> Backend:
    """A compiled artefact's cache layout is fixed at export (`backend.artefact.kv`, read from the
    artefact's own metadata): `--kv window:N` must match it."""
    if kv.layout is not Layout.WINDOW:
        return backend
    have = backend.artefact.kv
    if not (have.streams and (have.window, have.sinks or 0) == (kv.window, kv.sinks)):
        raise UserError(f"{backend.name} artefacts fix their KV cache at export and this one has {have.describe()}; "
                        f"rebuild with `edgefinfer build --kv window:{kv.window}"
                        + (f",sinks:{kv.sinks}" if kv.sinks else "") + "` or drop --kv")
    return backend


class Engine:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, eos_ids: tuple[int, ...] = (),
                 speculation: Speculation | None = None, info: dict | None = None):
        self.backend = backend
        self.tokenizer = tokenizer
        self.eos_ids = stop_token_ids(eos_ids, tokenizer)
        self.speculation = speculation
        self.info = info or {}
        self._lock = threading.Lock()  # one stream at a time owns the backend's cache
        self._grammars: GrammarCompiler | None = None
        # Who filled the backend's cache last (a Session, or None for a stateless stream): a session's
        # kept prefix is valid only while it is the owner.
        self.cache_owner: object = None

    @classmethod
    def load(cls, path: str | Path, backend: str | None = None, kv: str | KVOption | None = None,
             speculative: str | SpeculativeOption | None = None, threads: int | None = None,
             max_seq_len: int | None = None, prefill_grid: int | None = None) -> "Engine":
        """prefill_grid: ExecuTorch only, prompts fed in calls aligned to this grid (`ExecuTorchBackend`)."""
        kv = kv if isinstance(kv, KVOption) else KVOption.parse(kv)
        spec = (speculative if isinstance(speculative, SpeculativeOption) or speculative is None
                else SpeculativeOption.parse(speculative))
        with _collector_paused():
            be, tok, info = open_backend(path, backend, kv, threads, max_seq_len, prefill_grid)
        limit = getattr(be, "max_draft_tokens", None)
        if spec is not None and limit is not None and spec.k > limit:
            raise UserError(f"this window cache can roll back at most {limit} speculative tokens per step "
                            f"(K={spec.k}); lower K, or rebuild with a larger window (ONNX: K < window) or lookahead "
                            "(ExecuTorch: K <= lookahead)")
        speculation = _speculation(spec, be, kv, threads) if spec is not None else None
        return cls(be, tok, info["eos_ids"], speculation, info)

    def grammar(self, response_format: ResponseFormat) -> Grammar | None:
        """Compile a structured-output constraint for this model (a bad one is a UserError, raised before
        any token is generated)."""
        if response_format is None or isinstance(response_format, Grammar):
            return response_format
        constraint = (response_format if isinstance(response_format, Constraint)
                      else Constraint.from_response_format(response_format))
        if constraint is None:
            return None
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.backend.vocab_size, self.eos_ids)
        return self._grammars.compile(constraint)

    def stream(self, prompt: str, max_tokens: int = 128, params: SamplingParams = SamplingParams(),
               stop: list[str] | None = None, chat: bool = False, on_token: Callable[[int], None] | None = None,
               cancel: threading.Event | None = None, result: Generation | None = None,
               response_format: ResponseFormat = None) -> Iterator[str]:
        """Yield text deltas; closing the iterator (or setting `cancel`) stops decoding at once.
        `response_format` constrains the output (OpenAI's {"type": "json_object"} or {"type":
        "json_schema", ...}, or a `Constraint`: a regex or a Lark/GBNF grammar)."""
        ids = encode_prompt(self.tokenizer, prompt, chat)
        yield from self.stream_ids(ids, max_tokens, params, stop, on_token, cancel, result, response_format)

    def stream_ids(self, ids: list[int], max_tokens: int = 128, params: SamplingParams = SamplingParams(),
                   stop: list[str] | None = None, on_token: Callable[[int], None] | None = None,
                   cancel: threading.Event | None = None, result: Generation | None = None,
                   response_format: ResponseFormat = None, cached: int = 0, owner: object = None,
                   cuts: Sequence[int] = ()) -> Iterator[str]:
        """`stream` from prompt token ids. `cached` leading ids are already in the backend's cache (only
        valid for the `owner` that last used it, see `cache_owner`; a session passes itself). `cuts`:
        where the prefill starts a new call (`runtime.session.conversation_cuts`: a stateless run of a
        conversation in the calls a session makes)."""
        grammar = self.grammar(response_format)
        result = result if result is not None else Generation("", [], "length")
        if not self._lock.acquire(blocking=False):
            raise UserError("this engine is already generating; use one Engine per concurrent stream "
                            "or `edgefinfer serve` for many")
        try:
            if self.cache_owner is not owner:
                cached = 0  # someone else filled the cache since: nothing in it is the owner's
            self.cache_owner = owner
            matcher = grammar.matcher() if grammar is not None else None
            tokens = generate_tokens(self.backend, ids, max_tokens, params, self.eos_ids, self.speculation,
                                     result.stats, cancel, matcher, cached, cuts)
            yield from detokenize(self.tokenizer, tokens, self.eos_ids, stop, result, on_token)
            if reason := finish_reason(grammar_done=matcher is not None and matcher.finished):
                result.finish_reason = reason  # the output is complete, even if it took the last allowed token
        finally:
            self._lock.release()
            result.stats.peak_rss_mb = peak_rss_mb()

    def session(self, exact: bool = True) -> "Session":
        """A conversation that keeps its KV cache between turns (see `edgefinfer.runtime.session`);
        `exact=False` also keeps a reply's decoded positions where they differ from a prefill's."""
        from edgefinfer.runtime.session import Session

        return Session(self, exact)

    def load_session(self, path: str | Path) -> "Session":
        """A session saved by `Session.save`; a file for another artefact, backend, cache layout or
        format version is refused with a UserError before the cache is touched."""
        from edgefinfer.runtime.session import load_session

        return load_session(self, path)

    def generate(self, prompt: str, **kw) -> Generation:
        result = Generation("", [], "length")
        for _ in self.stream(prompt, result=result, **kw):
            pass
        return result


def _speculation(spec: SpeculativeOption, target: Backend, kv: KVOption, threads: int | None) -> Speculation:
    import torch

    from edgefinfer.runtime.speculative.proposers import DraftModelProposer, PromptLookupProposer

    if spec.kind == "lookup":
        return Speculation(PromptLookupProposer(max_ngram=spec.ngram), k=spec.k)
    draft, _, _ = open_backend(spec.path, None, kv, threads, target.max_seq_len)
    if draft.vocab_size != target.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft.vocab_size}) differs from the target's "
                        f"({target.vocab_size}); a draft must share the target's tokenizer")
    def step(tokens: list[int], start: int) -> torch.Tensor:
        return torch.from_numpy(draft.forward(tokens, start))

    # The draft is greedy: a deterministic proposal keeps verification lossless for any temperature.
    proposer = DraftModelProposer(step, rollback=draft.rollback, max_len=target.max_seq_len)
    return Speculation(proposer, k=spec.k)


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MiB), from the kernel's high-water mark."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss_mb()


def rss_mb() -> float:
    import psutil  # only off Linux (peak_rss_mb reads /proc there): 30-80 ms of every start otherwise

    return psutil.Process().memory_info().rss / 2**20
