"""Eager torch over the shared paged KV: one sequence through the same manager and block pool the
server uses (`edgefinfer.runtime.kv`), so `edgefinfer generate --kv paged:16` exercises them end to end."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.runtime.kv.paged_manager import PagedKVManager
from edgefinfer.runtime.kv.paged_torch import BatchRow, PagedBatch, PagedTensorStorage

SEQ = "engine"  # the single sequence this backend holds


class PagedTorchBackend:
    name = "torch"
    window = None

    def __init__(self, model: Transformer, block_size: int = 16, max_seq_len: int | None = None):
        self.model = model.eval()
        self.vocab_size = model.config.vocab_size
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        num_blocks = -(-self.max_seq_len // block_size)
        # A model whose every layer slides: the manager drops the blocks behind the window as the sequence
        # grows (with global layers, e.g. Gemma 3, every block stays: those layers read them all).
        self.manager = PagedKVManager(num_blocks, block_size, sliding_window=model.config.uniform_window)
        self.storage = PagedTensorStorage(model.config, num_blocks, block_size,
                                          dtype=next(model.parameters()).dtype)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        tokens = list(tokens)
        if SEQ not in self.manager:
            if start_pos != 0:
                raise ValueError("a new sequence starts at position 0")
            plan = self.manager.allocate(SEQ, tokens)
        else:
            self.rollback(start_pos)
            plan = self.manager.append(SEQ, tokens)
        if not plan:
            raise UserError(f"the paged KV pool ({self.max_seq_len} tokens) is full; raise the context "
                            f"or use --kv window:N")
        plan.apply_to(self.storage)
        row = BatchRow(plan.slot_mapping, plan.block_ids, start_pos + len(tokens))
        # A prefix-cache hit leaves the cached tokens out of the plan: feed only the new ones.
        new = tokens[plan.start_pos - start_pos:]
        ids = torch.tensor([new])
        pos = torch.arange(plan.start_pos, plan.start_pos + len(new))[None]
        logits = self.model(ids, pos, PagedBatch(self.storage, [row], len(new)))[0]
        self.manager.mark_computed(SEQ)
        if plan.start_pos > start_pos:  # rows for cached tokens were not computed; callers read the tail
            pad = np.full((plan.start_pos - start_pos, self.vocab_size), np.nan, np.float32)
            return np.concatenate([pad, logits.float().numpy()])
        return logits.float().numpy()

    def rollback(self, length: int) -> None:
        if SEQ not in self.manager or length >= self.manager.num_tokens(SEQ):
            return
        if length < self.manager.first_stored_position(SEQ):
            # The window dropped positions this prefix needs: recompute it (the manager kept the ids).
            kept = list(self.manager.token_ids(SEQ)[:length])
            self.reset()
            if kept:
                self.forward(kept, 0)
            return
        self.manager.truncate(SEQ, length).apply_to(self.storage)

    def reset(self) -> None:
        if SEQ in self.manager:
            self.manager.free(SEQ).apply_to(self.storage)
