"""llama.cpp backend: one sequence (llama seq id 0) in a one-sequence context of the binding.

`forward` feeds tokens through `LlamaContext.decode` with a logits flag per token and copies out
only this call's rows (see `llamacpp_binding` for why not llama-cpp-python's high-level `Llama`).

Rollback is explicit here: llama.cpp appends new tokens after its own count, so `forward` at a
position before that count first removes the stale cells and rewinds.

`--kv window:N[,sinks:S]` has the ring cache's meaning (runtime/kv/window.py): a query at position q
sees positions < S and q-N+1 .. q, keys at their absolute positions. llama.cpp masks by the cells a
sequence holds, so the window is kept by removing cells, never by a mask: positions up to S+N-1 go in
one batch (every query there sees everything before it), each later token alone, after the cells that
fell out of its window are removed (`llama_memory_seq_rm`), so the context holds S+N cells forever.
A removed cell cannot come back, so a rollback past the window's edge is impossible: the cache reports
`max_draft_tokens = 0` (no speculation) and sessions re-prefill instead of rolling back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.base import UNBOUNDED
from edgefinfer.runtime.backends.llamacpp_binding import CellFormat, LlamaContext, LlamaModel, runtime_cells

_SEQ = 0  # the llama seq id of the one sequence


class LlamaCppBackend:
    name = "llamacpp"
    N_BATCH = 512  # tokens per llama_decode call
    prefill_grid = 1  # any chunking gives the same rows; a one-token llama_decode rounds differently (tests/test_sessions.py)

    def __init__(self, gguf_path: str | Path, n_ctx: int = 2048, threads: int | None = None,
                 window: int | None = None, num_sinks: int = 0, native_load: Callable[[], None] | None = None,
                 cells: CellFormat | None = None):
        """native_load: called right before llama.cpp loads the weights (GIL released; see engine.open_backend).
        cells: the KV cells' format (None: `runtime_cells`, what `edgefinfer run` keeps for this GGUF)."""
        self.model = LlamaModel(gguf_path, native_load=native_load)
        if window is not None:
            if window < 1 or num_sinks < 0:
                raise UserError(f"bad window {window} / sinks {num_sinks}: the window holds at least 1 token")
            self.model.check_window(window, "--kv window:")
            n_ctx = num_sinks + window  # cells: never more are held
        else:
            self.model.check_window(n_ctx, "--max-seq-len")
        # The cells: exact f32 for float weights, llama.cpp's f16 for quantized ones, plain attention
        # (`runtime_cells` says why). Without `threads`, llama.cpp's own default: one thread per physical
        # core, for prompts and one-token steps alike (`LlamaContext`). It used to keep llama-cpp-python's,
        # half the CPUs for steps: a proxy for the physical cores on SMT hosts, and on a 2-core host without
        # SMT one thread for the decode that is compute-bound.
        self.cells = cells or runtime_cells(self.model.header)
        self.ctx = LlamaContext(self.model, 1, n_ctx, kv_dtype=self.cells.dtype, flash_attn=self.cells.flash_attn,
                                max_tokens=min(n_ctx, self.N_BATCH),
                                threads=threads)
        self.window = window
        self.num_sinks = num_sinks
        self.vocab_size = self.model.vocab_size
        self.max_seq_len = UNBOUNDED if window is not None else n_ctx
        if window is not None:
            self.max_draft_tokens = 0
        self._n_tokens = 0  # positions llama.cpp holds for the sequence (the next one to feed)
        self._evicted_to = 0  # with a window: cells at positions [num_sinks, this) were removed

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        return self._feed(tokens, start_pos, last_only=False)

    def forward_last(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """The last token's logits [V] only (`base.last_logits`, a prefill): llama.cpp then computes and
        hands over one row instead of [len(tokens), V] float32 twice (its buffer and our copy: 150 MB
        for a 400-token prompt of a 49k vocabulary)."""
        return self._feed(tokens, start_pos, last_only=True)[0]

    def _feed(self, tokens: Sequence[int], start_pos: int, last_only: bool) -> np.ndarray:
        if start_pos + len(tokens) > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + len(tokens)} tokens but the llama.cpp "
                            f"context holds {self.max_seq_len}")
        if start_pos != self._n_tokens:
            self.rollback(start_pos)
        out = np.empty((1 if last_only else len(tokens), self.vocab_size), np.float32)
        i = 0
        while i < len(tokens):
            n = self._chunk_len(start_pos + i, len(tokens) - i)
            chunk = tokens[i:i + n]
            if not last_only:
                self.ctx.decode([(_SEQ, start_pos + i, chunk, n)], out=out[i:i + n])
            elif i + n == len(tokens):
                self.ctx.decode([(_SEQ, start_pos + i, chunk, 1)], out=out)
            else:
                self.ctx.decode([(_SEQ, start_pos + i, chunk, 0)])
            self._n_tokens = start_pos + i + n
            i += n
        return out

    def _chunk_len(self, pos: int, remaining: int) -> int:
        """How many tokens from `pos` the next llama_decode may take; with a window, first removes the
        cells that fall out of the window of the query at `pos`."""
        n = min(remaining, self.ctx.max_tokens)
        if self.window is None:
            return n
        full = self.num_sinks + self.window  # queries before this position see every earlier one
        if pos + n <= full:
            return n
        if pos < full:
            return full - pos
        self._evicted_to = pos - self.window + 1
        self.ctx.remove(_SEQ, self.num_sinks, self._evicted_to)
        return 1

    def rollback(self, length: int) -> None:
        if length < self._n_tokens:
            if self.window is not None and length and length - self.window + 1 < self._evicted_to:
                raise UserError(f"the llama.cpp window cache no longer holds what position {length} attends "
                                "to; start the sequence again")
            if not length:
                self._evicted_to = 0
            self.ctx.remove(_SEQ, length)
            self._n_tokens = length

    def reset(self) -> None:
        self.rollback(0)

    def export_cache(self, length: int) -> dict[str, np.ndarray]:
        """llama.cpp's own serialisation of the sequence's cells (`llama_state_seq_get_data`) for
        positions < `length` (cells past it, left by rejected speculative tokens, are dropped first)."""
        self.rollback(length)
        return {"llama_state_seq": np.frombuffer(bytes(self.ctx.save(_SEQ)), np.uint8)}

    def cache_shapes(self, length: int) -> None:
        return None  # llama.cpp checks its own blob (and refuses one of another model or context)

    def import_cache(self, arrays: dict[str, np.ndarray], length: int) -> None:
        blob = arrays["llama_state_seq"]
        try:
            self.ctx.restore(_SEQ, blob.tobytes())
        except RuntimeError as e:
            self._n_tokens = 0
            self.ctx.remove(_SEQ)
            raise UserError(f"llama.cpp refused the saved cache ({e}); the file does not fit this model") from None
        self._n_tokens = length
        if self.window is not None:  # where `_chunk_len` had evicted to after feeding position length - 1
            self._evicted_to = length - self.window if length > self.num_sinks + self.window else 0
