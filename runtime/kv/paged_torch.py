"""Paged KV storage for torch: one pool of blocks per layer, driven by the paged-KV manager.

Pool layout per layer: `[num_blocks * block_size + 1, Hkv, D]`, indexed by flat slot
(`block_id * block_size + offset`, as `SlotPlan.slot_mapping` gives it). The extra last slot is a
trash slot that absorbs the writes of padding tokens in a ragged batch.

A forward over a ragged batch of sequences uses a `PagedBatch` as its KV cache (the `KVCache`
protocol of `edgefinfer.model.kv_cache`): it writes each row's new tokens at their slots and gathers each
row's keys through its block table. Each key slot carries its position (from its block's index in
the table), and slots at or past the row's length are marked empty, so the model's usual
position-derived mask is exactly causal (or sliding-window) attention over the sequence, with no
special kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from edgefinfer.model.config import ModelConfig
from edgefinfer.runtime.kv.paged_manager import NULL_BLOCK, CopyOp, SeqId


class PagedTensorStorage:
    """The block pools; implements `KVStorage` (only copy-on-write copies move data)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.trash_slot = num_blocks * block_size
        shape = (config.num_hidden_layers, num_blocks * block_size + 1, config.num_key_value_heads,
                 config.dim_per_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    # ---- KVStorage -----------------------------------------------------------------------------
    def copy_blocks(self, ops: Sequence[CopyOp]) -> None:
        bs = self.block_size
        for op in ops:
            src, dst = slice(op.src * bs, op.src * bs + op.num_tokens), slice(op.dst * bs, op.dst * bs + op.num_tokens)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def share_prefix(self, seq_id: SeqId, source_id: SeqId | None, block_ids: Sequence[int], num_tokens: int) -> None:
        pass  # the block table points at the cached blocks

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> None:
        pass

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        pass  # slots past the new length are masked until rewritten

    def release(self, seq_id: SeqId) -> None:
        pass

    def retain(self, seq_id: SeqId, retained_id: SeqId, num_tokens: int) -> None:
        pass  # never called: a block pool caches freed blocks itself (per_sequence_storage=False)

    def adopt(self, retained_id: SeqId, seq_id: SeqId, num_tokens: int) -> None:
        pass  # never called: no retained prefixes in a block pool

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class BatchRow:
    """One sequence's share of a forward: its new tokens' slots, its block table, its length after."""

    slot_mapping: Sequence[int]  # [S_b] flat slots of the new tokens
    block_table: Sequence[int]
    seq_len: int  # tokens in the sequence once this forward's tokens are written


class PagedBatch:
    """A `KVCache` for one forward over a ragged batch (rows padded to the longest new-token count).

    Each row gathers the blocks its table holds, in table order; a `NULL_BLOCK` (dropped behind a
    sliding window) is skipped, so the keys read, like the memory held, stay bounded by the window.
    Key positions come from each block's index in the table, so the model's position-derived mask
    (causal, and the model's own window) applies unchanged.
    """

    def __init__(self, storage: PagedTensorStorage, rows: Sequence[BatchRow], num_new: int):
        self.storage = storage
        bs = storage.block_size
        B = len(rows)
        held = [[(i, b) for i, b in enumerate(r.block_table) if b != NULL_BLOCK] for r in rows]
        max_blocks = max(len(h) for h in held)
        slots = torch.full((B, num_new), storage.trash_slot, dtype=torch.long)
        gather = torch.full((B, max_blocks * bs), storage.trash_slot, dtype=torch.long)
        key_pos = torch.full((B, max_blocks * bs), -1, dtype=torch.long)
        offsets = torch.arange(bs)
        for b, (row, blocks) in enumerate(zip(rows, held)):
            slots[b, : len(row.slot_mapping)] = torch.tensor(list(row.slot_mapping), dtype=torch.long)
            index = torch.tensor([i for i, _ in blocks], dtype=torch.long)
            table = torch.tensor([blk for _, blk in blocks], dtype=torch.long)
            flat = (table[:, None] * bs + offsets).flatten()  # [n_held * bs] in position order
            pos = (index[:, None] * bs + offsets).flatten()
            gather[b, : flat.numel()] = flat
            key_pos[b, : pos.numel()] = torch.where(pos < row.seq_len, pos, -1)
        device = storage.k.device
        self.slots = slots.to(device)  # [B, S]
        self.gather = gather.to(device)  # [B, T]
        self.key_pos = key_pos.to(device)  # [B, T]

    def update(self, layer: int, k: Tensor, v: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, S, D = k.shape
        pool_k, pool_v = self.storage.k[layer], self.storage.v[layer]  # [N, Hkv, D]
        flat = self.slots.flatten()
        pool_k[flat] = k.transpose(1, 2).reshape(B * S, H, D).to(pool_k.dtype)
        pool_v[flat] = v.transpose(1, 2).reshape(B * S, H, D).to(pool_v.dtype)
        pool_k[self.storage.trash_slot] = 0  # padding wrote here; keep it harmless
        pool_v[self.storage.trash_slot] = 0
        keys = pool_k[self.gather].permute(0, 2, 1, 3)  # [B, Hkv, T, D]
        values = pool_v[self.gather].permute(0, 2, 1, 3)
        return keys, values, self.key_pos


def pad_batch(token_rows: Sequence[Sequence[int]], start_positions: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Right-pad ragged rows of new tokens: tokens [B, S] and input_pos [B, S].

    A padding query repeats its row's last position, so it sees a valid key and never produces NaN;
    its output is ignored and its K/V goes to the trash slot.
    """
    S = max(len(r) for r in token_rows)
    tokens = torch.zeros(len(token_rows), S, dtype=torch.long)
    pos = torch.zeros(len(token_rows), S, dtype=torch.long)
    for b, (row, start) in enumerate(zip(token_rows, start_positions)):
        n = len(row)
        tokens[b, :n] = torch.tensor(list(row), dtype=torch.long)
        pos[b, :n] = torch.arange(start, start + n)
        pos[b, n:] = start + n - 1
    return tokens, pos
