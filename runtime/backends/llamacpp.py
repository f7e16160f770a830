"""llama.cpp backend (llama-cpp-python): one sequence in one context, all logits kept.

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
            self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, logits_all=True, verbose=False,
                                       type_k=0, type_v=0, **kw)
        except ValueError as e:
            raise UserError(f"llama.cpp could not load {path}: {e}") from None
        if window is not None:
            raise UserError("the llama.cpp backend has no sliding-window cache here; use the torch, "
                            "ExecuTorch or ONNX backend for --kv window")
        self.window = None
        self.vocab_size = self.llm.n_vocab()
        self.max_seq_len = n_ctx

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        if start_pos + len(tokens) > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + len(tokens)} tokens but the llama.cpp "
                            f"context holds {self.max_seq_len}")
        if start_pos != self.llm.n_tokens:
            self.rollback(start_pos)
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[start_pos:start_pos + len(tokens)], dtype=np.float32)

    def rollback(self, length: int) -> None:
        if length < self.llm.n_tokens:
            mem = self._llama_cpp.llama_get_memory(self.llm.ctx)
            self._llama_cpp.llama_memory_seq_rm(mem, 0, length, -1)
            self.llm.n_tokens = length

    def reset(self) -> None:
        self.rollback(0)
