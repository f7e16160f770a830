"""The project's one binding to llama.cpp (llama-cpp-python's low-level API).

A loaded GGUF (`LlamaModel`), a context with its reusable `llama_batch` (`LlamaContext`: batch
filling, `llama_decode`, and the memory operations on llama sequence ids); the import guard, the log
silencing and an early start of the model load are in `llamacpp_lib`, which imports no numpy. Two clients sit on top:

* the runtime's `LlamaCppBackend`: one sequence (llama seq id 0) in a one-sequence context;
* the server's `LlamaCppExecutor` and `LlamaDraft` (`edgefinfer.server_gpu.executor_llamacpp`):
  many sequences in one context, placed on llama seq ids by the paged-KV manager's storage.

llama-cpp-python's high-level `Llama` is not used: its `eval` needs `logits_all=True` for the
logits of every fed token, which keeps an [n_ctx, vocab] float32 score table (400 MB for SmolLM2
at n_ctx 2048), and it knows one sequence only.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edgefinfer.errors import UserError
from edgefinfer.files.untrusted import GgufHeader, check_gguf
from edgefinfer.libraries.cpus import usable_cores
from edgefinfer.runtime.backends.llamacpp_lib import llama_cpp_lib, silence, take_early_load

KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids


@dataclass(frozen=True)
class CellFormat:
    """How llama.cpp holds and attends to a model's KV cells: their type and whether flash attention
    reads them (which also lays V out untransposed; llama.cpp restores a saved sequence only into a
    cache of the same format)."""

    dtype: str  # a KV_TYPES key
    flash_attn: bool

    def describe(self) -> str:
        return f"{self.dtype} K/V {'with' if self.flash_attn else 'without'} flash attention"


def runtime_cells(header: GgufHeader) -> CellFormat:
    """The cells `edgefinfer run` keeps for a GGUF, which the server's --batch-invariant and --session follow.

    Float weights: f32 K/V, so the logits stay within float noise of the checkpoint's. Quantized
    weights: f16 K/V (llama.cpp's own cell type: half the cache to clear at start and to hold), whose
    rounding is far below the weights' own. Plain attention for both, not flash attention: llama.cpp's
    CPU flash attention decodes faster at a short context but slower at a long one and prefills a chat
    turn on top of a long conversation slower (bench/results/llamacpp_cells.json, SmolLM2 Q4_1, 2
    threads: decode at 850 cached tokens 92 vs 79 tok/s, 44 new tokens on 813 cached 0.21 vs 0.29 s;
    at 64 cached tokens 126 vs 143 tok/s), and casts f32 K/V to f16 first (~1e-2 on the tiny float
    models). An on-device conversation is the long case. No format makes a position's logits
    independent of how the sequence was split into batches (a token decoded alone equals itself inside
    a prefill batch of up to 8-48 tokens, `split_equal_up_to`), because quantized matmuls round their
    activations to 8 bits and a last-bit difference can flip a code."""
    return CellFormat("f32", False) if header.float_weights else CellFormat("f16", False)

# (llama seq id, start position, tokens, how many trailing tokens want logits)
DecodeRow = tuple[int, int, Sequence[int], int]


class LlamaModel:
    """A loaded GGUF; freed by `close` or when it is garbage (after every context made from it)."""

    def __init__(self, path: str | Path, gpu_layers: int = 0, native_load: Callable[[], None] | None = None,
                 vocab_only: bool = False):
        """native_load: called right before the native load (ctypes releases the GIL there); vocab_only:
        the vocabulary and metadata without the weights (tokenizing only: no context can be made)."""
        self.lib = lib = llama_cpp_lib()
        silence(lib)
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"GGUF file {self.path} does not exist")
        # llama.cpp aborts the whole process on some hostile headers (edgefinfer.files.untrusted): the one
        # place that hands a GGUF to llama.cpp checks it first, for the runtime and the server alike.
        self.header = check_gguf(self.path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        params.vocab_only = vocab_only
        if native_load is not None:
            native_load()
        self.ptr = (take_early_load(self.path) if gpu_layers == 0 and not vocab_only else None) or \
            lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise UserError(f"llama.cpp could not load {self.path}; is it a GGUF file of a supported model?")
        # Not at interpreter exit: a daemon thread may still be inside llama_decode then.
        self._free = weakref.finalize(self, lib.llama_model_free, self.ptr)
        self._free.atexit = False
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self._entries: dict[str, int] | None = None  # vocabulary entry -> id, built on demand (`token_id`)
        self._pieces: tuple[dict[int, bytes], dict[int, bytes]] = ({}, {})  # `piece`'s, by render_special
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.ptr)
        # A window the GGUF declares but llama.cpp does not apply: the pinned llama.cpp reads
        # `<arch>.attention.sliding_window` only for architectures with their own windowed layers
        # (gemma2/3, cohere2, ...), never for `llama`, so a Mistral-style model would attend to the
        # whole context there.
        declared = self.meta("general.architecture")
        window = self.meta(f"{declared}.attention.sliding_window") if declared else None
        self.ignored_window = (int(window) if window and window.isdigit() and int(window) > 0
                               and lib.llama_model_n_swa(self.ptr) == 0 else None)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text (None if absent), however long (a chat template)."""
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self.lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:  # snprintf's count: the whole value fitted
                return buf.value.decode(errors="replace")
            size = n + 1

    def check_window(self, n_ctx: int, option: str) -> None:
        """Refuse a context longer than a window llama.cpp would ignore: past it, the outputs would
        no longer be the model's."""
        if self.ignored_window is not None and n_ctx > self.ignored_window:
            raise UserError(f"{self.path.name} has a sliding window of {self.ignored_window} tokens, which "
                            f"llama.cpp does not apply to this architecture (it would attend to the whole "
                            f"context); pass {option} {self.ignored_window} or less, --kv window:"
                            f"{self.ignored_window} (applied by removing cells), or run the checkpoint on the "
                            f"torch backend")

    # ---- the GGUF's own vocabulary, as llama.cpp splits and joins text --------------------------------
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """llama.cpp's split of `text`, special tokens parsed; `add_special`: with the BOS / EOS the GGUF
        asks for (`tokenizer.ggml.add_bos_token`), as a tokenizer's post-processor adds them."""
        raw = text.encode()

        def call(buf, size):
            return self.lib.llama_tokenize(self.vocab, raw, len(raw), buf, size, add_special, True)
        # A token covers at least one byte, plus BOS / EOS.
        buf, n = _sized(lambda size: (self.lib.llama_token * size)(), len(raw) + 8, call)
        return list(buf[:n])

    def detokenize(self, ids: Sequence[int], render_special: bool = False) -> str:
        """The text of `ids` joined as llama.cpp joins them; special (control) tokens as their text only
        with `render_special`. Bytes that are not (yet) whole UTF-8 become U+FFFD, as a tokenizer's
        decode makes them."""
        return self.detokenize_bytes(ids, render_special).decode(errors="replace")

    def detokenize_bytes(self, ids: Sequence[int], render_special: bool = False) -> bytes:
        """`detokenize`'s bytes, before UTF-8 decoding (they may end inside a character)."""
        tokens = (self.lib.llama_token * len(ids))(*ids)

        def call(buf, size):
            return self.lib.llama_detokenize(self.vocab, tokens, len(ids), buf, size, False, render_special)
        buf, n = _sized(ctypes.create_string_buffer, 8 * len(ids) + 16, call)
        return buf.raw[:n]

    def piece(self, token: int, render_special: bool = False) -> bytes:
        """The bytes `token` adds to a text it does not start (`llama_token_to_piece`, no leading space
        stripped), as llama-server streams them; remembered per token (one ctypes call the first time)."""
        cache = self._pieces[render_special]
        data = cache.get(token)
        if data is None:
            def call(buf, size):
                return self.lib.llama_token_to_piece(self.vocab, token, buf, size, 0, render_special)
            buf, n = _sized(ctypes.create_string_buffer, 32, call)
            data = cache[token] = buf.raw[:n]
        return data

    def special_token(self, which: str) -> int | None:
        """The "bos" / "eos" / "eot" id the file names (`tokenizer.ggml.<which>_token_id`), else None:
        llama.cpp falls back to a default id of the tokenizer type (11 for byte-level BPE), which names
        nothing in a vocabulary of another origin."""
        token = getattr(self.lib, f"llama_vocab_{which}")(self.vocab)
        named = self.meta(f"tokenizer.ggml.{which}_token_id") is not None
        return token if named and 0 <= token < self.vocab_size else None

    def adds_bos(self) -> bool:
        """Whether a text's ids start with BOS (`tokenizer.ggml.add_bos_token`, or llama.cpp's default)."""
        return bool(self.lib.llama_vocab_get_add_bos(self.vocab))

    def end_of_generation(self) -> tuple[int, ...]:
        """The ids llama.cpp ends a generation on, EOS and EOT first: its EOG set, which also holds the
        control tokens it recognises by their text (SmolLM2's <|endoftext|>) and fill-in-the-middle
        tokens, but not a default EOS the file does not name. Finding them takes a pass over the
        vocabulary (~60 ms of ctypes calls for 49k tokens), so they are remembered per version of the
        file and of llama.cpp's library (`edgefinfer.files.stamped`)."""
        from edgefinfer.files.stamped import remembered

        library = Path(getattr(getattr(self.lib, "_lib", None), "_name", "") or ".")
        tag = f"{library.name}:{os.stat(library).st_mtime_ns if library.is_file() else 0}"
        return tuple(remembered(self.path, "gguf-eog-ids.json", lambda _: self._scan_eog(), tag=tag,
                                decode=lambda ids: tuple(int(i) for i in ids)))

    def _scan_eog(self) -> tuple[int, ...]:
        eos, eot = self.special_token("eos"), self.special_token("eot")
        default_eos = self.lib.llama_vocab_eos(self.vocab) if eos is None else None
        is_eog = self.lib.llama_vocab_is_eog
        found = (t for t in range(self.vocab_size) if t != default_eos and is_eog(self.vocab, t))
        return tuple(dict.fromkeys([*(t for t in (eos, eot) if t is not None), *found]))

    def token_text(self, token: int) -> str:
        """The vocabulary's entry for `token` as stored (a byte-level BPE's "Ġthe", a control token's text)."""
        return self.lib.llama_vocab_get_text(self.vocab, token).decode(errors="replace")

    def token_id(self, text: str) -> int | None:
        """The id whose vocabulary entry is `text` (a tokenizer's `token_to_id`), or None. A special
        token, which is what callers ask for (BOS, EOS), splits to itself: no table is built for it."""
        ids = self.tokenize(text)
        if len(ids) == 1 and self.token_text(ids[0]) == text:
            return ids[0]
        if self._entries is None:  # any other entry: the whole table, once
            self._entries = {self.token_text(i): i for i in range(self.vocab_size)}
        return self._entries.get(text)

    def close(self) -> None:
        self._free()
        self.ptr = None


def _free_context(lib, ctx, batch, model: LlamaModel) -> None:
    # `model` is an argument so that the model outlives every context made from it.
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


class LlamaContext:
    """One llama context holding `num_slots` sequences, and a reusable batch of `max_tokens` tokens.

    threads: for batches of several tokens and for one-token steps alike. None: one per physical core
    this process may run on (`usable_cores`; llama.cpp's own default on a whole host).
    """

    def __init__(self, model: LlamaModel, num_slots: int, cells_per_slot: int, *, unified: bool = False,
                 flash_attn: bool = False, kv_dtype: str = "f32", threads: int | None = None,
                 max_tokens: int = 512, total_cells: int | None = None):
        lib = self.lib = model.lib
        if kv_dtype not in KV_TYPES:
            raise UserError(f"unknown KV dtype {kv_dtype!r}: use one of {', '.join(KV_TYPES)}")
        limit = lib.llama_max_parallel_sequences()
        if not 1 <= num_slots <= limit:
            raise UserError(f"llama.cpp holds 1 to {limit} sequences per context, not {num_slots}")
        p = lib.llama_context_default_params()
        p.n_ctx = total_cells if total_cells is not None else num_slots * cells_per_slot
        p.n_batch = p.n_ubatch = max_tokens
        p.n_seq_max = num_slots
        # llama.cpp reserves logits for at least one output per sequence id and asserts that fits.
        p.n_outputs_max = max(max_tokens, num_slots)
        p.kv_unified = unified
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = KV_TYPES[kv_dtype]
        n = threads or usable_cores()
        p.n_threads_batch = n
        p.n_threads = n
        self.model = model
        self.ptr = lib.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise UserError(f"llama.cpp could not create a context of {p.n_ctx} cells for {num_slots} sequences; "
                            f"lower --max-num-seqs or --max-model-len")
        self.batch = lib.llama_batch_init(max_tokens, 0, 1)  # token ids, one sequence id per token
        self._free = weakref.finalize(self, _free_context, lib, self.ptr, self.batch, model)
        self._free.atexit = False  # see LlamaModel
        self.mem = lib.llama_get_memory(self.ptr)
        self.n_ctx = lib.llama_n_ctx(self.ptr)
        self.cells_per_slot = lib.llama_n_ctx_seq(self.ptr) if not unified else self.n_ctx
        self.max_tokens = max_tokens
        self.threads = n
        self._logit_views: dict[tuple[int, int], np.ndarray] = {}  # (buffer address, rows) -> view
        # llama_get_logits answering a plain address, the key of those views: llama-cpp-python's own
        # declares a POINTER(c_float) result, and a ctypes.cast to read its address costs 20 us a step
        # inside the server (cold caches). Indexing the CDLL gives a new function object to declare.
        self._logits_address = lib._lib["llama_get_logits"]
        self._logits_address.argtypes, self._logits_address.restype = [ctypes.c_void_p], ctypes.c_void_p

    def decode(self, rows: Sequence[DecodeRow], out: np.ndarray | None = None, copy: bool = True) -> np.ndarray:
        """One llama_decode of `rows` (at most `max_tokens` tokens in all) -> float32 logits
        [rows' logit count, V] in row order, copied into `out` when given, else a new array, or with
        `copy=False` a view of llama.cpp's own buffer: valid (and writable) until the next decode."""
        b, lib = self.batch, self.lib
        i = 0
        for seq, start, tokens, num_logits in rows:
            first_logit = len(tokens) - num_logits
            for j, tok in enumerate(tokens):
                b.token[i] = tok
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = j >= first_logit
                i += 1
        b.n_tokens = i
        rc = lib.llama_decode(self.ptr, b)
        if rc != 0:
            # 1: no KV slot. Callers size the context for what they feed, so this is a bug, not a user error.
            raise RuntimeError(f"llama_decode failed with code {rc} on a batch of {i} tokens")
        n_out = sum(r[3] for r in rows)
        if n_out == 0:
            return np.empty((0, self.model.vocab_size), dtype=np.float32)
        view = self._logits_view(self._logits_address(self.ptr), n_out)
        if out is None:
            return view.copy() if copy else view  # llama.cpp reuses the buffer on the next decode
        out[...] = view
        return out

    def _logits_view(self, address: int, n_out: int) -> np.ndarray:
        """[n_out, V] over llama.cpp's logits buffer at `address`. Building one costs a ctypes array type,
        80 us a decode step inside the server (cold caches); the views are kept per buffer address, so
        a buffer llama.cpp reallocates gets a new one."""
        key = (address, n_out)
        view = self._logit_views.get(key)
        if view is None:
            if len(self._logit_views) > 64:  # batch shapes come and go; keep the dictionary small
                self._logit_views.clear()
            size = n_out * self.model.vocab_size
            view = np.frombuffer((ctypes.c_float * size).from_address(address), dtype=np.float32)
            view = self._logit_views[key] = view.reshape(n_out, self.model.vocab_size)
        return view

    # ---- memory: cells are tagged with (sequence id, position) ----------------------------------
    def remove(self, seq: int, start: int = -1, end: int = -1) -> None:
        """Drop sequence `seq`'s cells at positions [start, end) (-1: open end; both -1: all of them)."""
        self.lib.llama_memory_seq_rm(self.mem, seq, start, end)

    def copy(self, src: int, dst: int, start: int = -1, end: int = -1) -> None:
        """Tag `src`'s cells at [start, end) with `dst` too. Across per-sequence streams llama.cpp copies
        whole streams only (start = end = -1); a partial range there aborts the process."""
        self.lib.llama_memory_seq_cp(self.mem, src, dst, start, end)

    def save(self, seq: int) -> ctypes.Array:
        """A host copy of sequence `seq`'s state (`llama_state_seq_*`: restores bit-exactly)."""
        size = self.lib.llama_state_seq_get_size(self.ptr, seq)
        buf = (ctypes.c_uint8 * size)()
        if self.lib.llama_state_seq_get_data(self.ptr, buf, size, seq) != size:
            raise RuntimeError(f"llama_state_seq_get_data could not save llama sequence {seq}")
        return buf

    def restore(self, seq: int, buf: ctypes.Array | bytes) -> None:
        """Replace sequence `seq`'s cells by a state from `save` (of any sequence, also of another
        context: a session file's)."""
        if not isinstance(buf, ctypes.Array):
            buf = (ctypes.c_uint8 * len(buf)).from_buffer_copy(buf)
        self.remove(seq)
        if self.lib.llama_state_seq_set_data(self.ptr, buf, len(buf), seq) != len(buf):
            raise RuntimeError(f"llama_state_seq_set_data could not restore llama sequence {seq}")

    def close(self) -> None:
        self._free()
        self.ptr = None


def _sized(make, size: int, call):
    """llama.cpp's convention for output buffers: `call(buf, size)` returns the count written, or minus
    the size it needs; (buffer, count), the buffer made again by `make(size)` until it fits."""
    while True:
        buf = make(size)
        n = call(buf, size)
        if n >= 0:
            return buf, n
        size = -n


def tokenizer_matches(model: LlamaModel, tokenizer, texts: Sequence[str]) -> bool:
    """Whether our tokenizer splits `texts` exactly like llama.cpp's own (a load-time sanity check)."""
    return all(model.tokenize(text) == tokenizer.encode(text) for text in texts)
