"""llama.cpp backend: one sequence (llama seq id 0) in a one-sequence context of the binding.

`forward` feeds tokens through `LlamaContext.decode` with a logits flag per token and copies out
only this call's rows (see `llamacpp_binding` for why not llama-cpp-python's high-level `Llama`).

Rollback is explicit here: llama.cpp appends new tokens after its own count, so `forward` at a
position before that count first removes the stale cells and rewinds.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.llamacpp_binding import LlamaContext, LlamaModel

_SEQ = 0  # the llama seq id of the one sequence


class LlamaCppBackend:
    name = "llamacpp"
    N_BATCH = 512  # tokens per llama_decode call

    def __init__(self, gguf_path: str | Path, n_ctx: int = 2048, threads: int | None = None,
                 window: int | None = None):
        if window is not None:
            raise UserError("the llama.cpp backend has no sliding-window cache here; use the torch, "
                            "ExecuTorch or ONNX backend for --kv window")
        self.model = LlamaModel(gguf_path)
        self.model.check_window(n_ctx, "--max-seq-len")
        cores = os.cpu_count() or 1
        # F32 KV keeps llama.cpp's cache from adding f16 rounding on top of the weights' own. Without
        # `threads`, llama-cpp-python's defaults (which this backend used before): half the cores for
        # one-token steps, all of them for prompts.
        self.ctx = LlamaContext(self.model, 1, n_ctx, kv_dtype="f32", max_tokens=min(n_ctx, self.N_BATCH),
                                threads=threads or cores, decode_threads=threads or max(cores // 2, 1))
        self.window = None
        self.vocab_size = self.model.vocab_size
        self.max_seq_len = n_ctx
        self._n_tokens = 0  # positions llama.cpp holds for the sequence

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        if start_pos + len(tokens) > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + len(tokens)} tokens but the llama.cpp "
                            f"context holds {self.max_seq_len}")
        if start_pos != self._n_tokens:
            self.rollback(start_pos)
        out = np.empty((len(tokens), self.vocab_size), np.float32)
        step = self.ctx.max_tokens
        for i in range(0, len(tokens), step):
            chunk = tokens[i:i + step]
            self.ctx.decode([(_SEQ, start_pos + i, chunk, len(chunk))], out=out[i:i + len(chunk)])
            self._n_tokens = start_pos + i + len(chunk)
        return out

    def rollback(self, length: int) -> None:
        if length < self._n_tokens:
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
            self.ctx.restore(_SEQ, (ctypes.c_uint8 * blob.size).from_buffer_copy(blob.tobytes()))
        except RuntimeError as e:
            self._n_tokens = 0
            self.ctx.remove(_SEQ)
            raise UserError(f"llama.cpp refused the saved cache ({e}); the file does not fit this model") from None
        self._n_tokens = length
