"""llama.cpp backend (llama-cpp-python): one sequence in one context.

`forward` decodes through llama.cpp's own batch API (`llama_decode` with a logits flag per token)
and copies out only this call's rows. The high-level `Llama.eval` would need `logits_all=True`,
which keeps an [n_ctx, vocab] float32 score table (400 MB for SmolLM2 at n_ctx 2048) filling up
as the sequence grows.

Rollback is explicit here: llama.cpp appends new tokens after its own count, so `forward` at a
position before that count first removes the stale cells (`llama_memory_seq_rm`) and rewinds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from edgefinfer.errors import UserError


class LlamaCppBackend:
    name = "llamacpp"
    N_BATCH = 512  # tokens per llama_decode call

    def __init__(self, gguf_path: str | Path, n_ctx: int = 2048, threads: int | None = None,
                 window: int | None = None):
        try:
            import llama_cpp
        except ImportError:
            raise UserError("llama-cpp-python is not installed: pip install 'edgefinfer[llamacpp]' "
                            "(it builds from source, about 7 minutes)") from None
        path = Path(gguf_path)
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist")
        self._llama_cpp = llama_cpp
        kw = {} if threads is None else {"n_threads": threads, "n_threads_batch": threads}
        try:
            # F32 KV keeps llama.cpp's cache from adding f16 rounding on top of the weights' own.
            self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=self.N_BATCH, verbose=False,
                                       type_k=0, type_v=0, **kw)
        except ValueError as e:
            raise UserError(f"llama.cpp could not load {path}: {e}") from None
        if window is not None:
            raise UserError("the llama.cpp backend has no sliding-window cache here; use the torch, "
                            "ExecuTorch or ONNX backend for --kv window")
        self.window = None
        self.vocab_size = self.llm.n_vocab()
        self.max_seq_len = n_ctx
        self._batch = llama_cpp.llama_batch_init(self.N_BATCH, 0, 1)  # token ids, one sequence

    def __del__(self):
        batch = getattr(self, "_batch", None)
        if batch is not None:
            self._llama_cpp.llama_batch_free(batch)
            self._batch = None

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        if start_pos + len(tokens) > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + len(tokens)} tokens but the llama.cpp "
                            f"context holds {self.max_seq_len}")
        if start_pos != self.llm.n_tokens:
            self.rollback(start_pos)
        out = np.empty((len(tokens), self.vocab_size), np.float32)
        for i in range(0, len(tokens), self.N_BATCH):
            chunk = tokens[i:i + self.N_BATCH]
            out[i:i + len(chunk)] = self._decode(chunk, start_pos + i)
        return out

    def _decode(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """One llama_decode of up to N_BATCH tokens at start_pos..; a view of their logits [S, V]."""
        lib, b = self._llama_cpp, self._batch
        b.n_tokens = len(tokens)
        for j, token in enumerate(tokens):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = int(token), start_pos + j, 1, True
            b.seq_id[j][0] = 0
        status = lib.llama_decode(self.llm.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} at position {start_pos}")
        self.llm.n_tokens = start_pos + len(tokens)
        return np.ctypeslib.as_array(lib.llama_get_logits(self.llm.ctx), shape=(len(tokens), self.vocab_size))

    def rollback(self, length: int) -> None:
        if length < self.llm.n_tokens:
            mem = self._llama_cpp.llama_get_memory(self.llm.ctx)
            self._llama_cpp.llama_memory_seq_rm(mem, 0, length, -1)
            self.llm.n_tokens = length

    def reset(self) -> None:
        self.rollback(0)
