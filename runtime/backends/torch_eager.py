"""The reference backend: our eager torch model with a static or sliding-window cache."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from edgefinfer.model.kv_cache import StaticCache
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.runtime.backends.base import UNBOUNDED
from edgefinfer.runtime.kv.window import SlidingWindowCache


class TorchBackend:
    name = "torch"

    def __init__(self, model: Transformer, max_seq_len: int | None = None, window: int | None = None,
                 num_sinks: int = 0, lookahead: int = 8):
        self.model = model.eval()
        self.vocab_size = model.config.vocab_size
        self.window = window
        dtype = next(model.parameters()).dtype
        if window is None:
            self.max_seq_len = max_seq_len or model.config.max_position_embeddings
            self.cache = StaticCache(model.config, 1, self.max_seq_len, dtype=dtype)
        else:
            self.max_seq_len = UNBOUNDED
            self.cache = SlidingWindowCache(model.config, 1, window, num_sinks, lookahead, dtype=dtype)
            self.max_draft_tokens = lookahead  # rejected tokens never overwrite slots inside the window

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        n = len(tokens)
        if start_pos + n > self.max_seq_len:
            raise UserError(f"the sequence would reach {start_pos + n} tokens but the cache holds {self.max_seq_len}; "
                            f"use a sliding-window cache (--kv window:N) or a shorter prompt")
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        pos = torch.arange(start_pos, start_pos + n)[None]
        return self.model(ids, pos, self.cache)[0].float().numpy()

    def rollback(self, length: int) -> None:
        pass  # positional: stale entries are overwritten or masked (see edgefinfer.model.kv_cache)

    def export_cache(self, length: int) -> dict[str, np.ndarray]:
        """The cache contents that hold positions < `length` (a saved session), as float32 arrays:
        a static cache's first `length` slots; a window cache's whole ring with its position table."""
        if self.window is None:
            return {n: b[:, :, :, :length].float().numpy() for n, b in (("k", self.cache.k), ("v", self.cache.v))}
        return {"k": self.cache.k.float().numpy(), "v": self.cache.v.float().numpy(), "pos": self.cache.pos.numpy()}

    def import_cache(self, arrays: dict[str, np.ndarray], length: int) -> None:
        """Put back what `export_cache(length)` returned (shapes were checked against `cache_shapes`)."""
        with torch.inference_mode():
            for name, array in arrays.items():
                buf = getattr(self.cache, name)
                target = buf if self.window is not None else buf[:, :, :, :length]
                target.copy_(torch.from_numpy(np.array(array)).to(buf.dtype))  # a copy: the file's bytes are read-only

    def cache_shapes(self, length: int) -> dict[str, tuple[int, ...]]:
        shapes = {n: tuple(getattr(self.cache, n).shape) for n in (("k", "v") if self.window is None
                                                                     else ("k", "v", "pos"))}
        if self.window is None:
            shapes = {n: s[:3] + (length,) + s[4:] for n, s in shapes.items()}
        return shapes

    def reset(self) -> None:
        self.cache.reset()
