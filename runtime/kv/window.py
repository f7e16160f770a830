"""Sliding-window ring cache with optional attention sinks: constant memory for unbounded streams.

Layout per layer and sequence (C = num_sinks + ring + 1 slots):

    [ sink 0 .. sink S-1 | ring slot 0 .. ring slot R-1 | trash ]

Position p < S lives in sink slot p forever (StreamingLLM's attention sinks). Any later position lives
in ring slot (p - S) % R, with R = window + lookahead. A query at position q sees the sinks and the
positions q-window+1 .. q; the ring keeps `lookahead` extra slots so that speculative tokens which are
later rejected never overwrite history still inside the window.

`update` returns the cache contents *before* the write concatenated with the new entries, so a
prefill chunk longer than the ring still attends within itself; then it writes the chunk's sink
positions and its last R positions. Everything is tensor arithmetic with no data-dependent Python
branches, so the module exports with torch.export (the slot of each token is computed, and tokens
that are not kept are routed to the trash slot, whose position stays -1).

Rollback needs no call: entries at positions >= the first new position are stale (rejected
speculation) and are masked on read until they are overwritten.

Keys are stored after RoPE at their absolute positions, which is exactly Mistral's sliding-window
attention. (StreamingLLM's re-numbering of positions inside the cache, for streams far beyond the
trained context, would need pre-RoPE keys; not implemented.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError


class SlidingWindowCache(nn.Module):
    def __init__(self, config: ModelConfig, batch_size: int, window: int, num_sinks: int = 0,
                 lookahead: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        if window < 1:
            raise UserError(f"the window must hold at least 1 token, got {window}")
        if num_sinks < 0 or lookahead < 0:
            raise UserError("num_sinks and lookahead must be >= 0")
        self.window = window
        self.num_sinks = num_sinks
        self.ring = window + lookahead
        self.capacity = num_sinks + self.ring + 1  # + the trash slot
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, self.capacity, config.dim_per_head)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        # Absolute position held by each slot, per layer and row; -1 = empty.
        self.register_buffer("pos", torch.full(shape[:2] + (self.capacity,), -1, dtype=torch.long, device=device),
                             persistent=False)

    def slots(self, input_pos: Tensor) -> Tensor:
        """Slot index [B, S] for each new position; tokens that will not be kept go to the trash slot."""
        S = input_pos.shape[1]
        sink = input_pos < self.num_sinks
        ring_slot = self.num_sinks + (input_pos - self.num_sinks).remainder(self.ring)
        # Of a chunk longer than the ring only the last `ring` tokens survive.
        kept = torch.arange(S, device=input_pos.device) >= S - self.ring
        trash = torch.full_like(input_pos, self.capacity - 1)
        return torch.where(sink, input_pos, torch.where(kept[None], ring_slot, trash))

    def update(self, layer: int, k: Tensor, v: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, S, D = k.shape
        old_k, old_v, old_pos = self.k[layer, :B], self.v[layer, :B], self.pos[layer, :B]
        # Entries at or after the chunk's first position are left over from rejected tokens: hide them.
        stale = old_pos >= input_pos[:, :1]
        keys = torch.cat([old_k, k.to(old_k.dtype)], dim=2)  # [B, Hkv, C + S, D]
        values = torch.cat([old_v, v.to(old_v.dtype)], dim=2)
        key_pos = torch.cat([torch.where(stale, -1, old_pos), input_pos], dim=1)  # [B, C + S]

        slots = self.slots(input_pos)  # [B, S]
        idx = slots[:, None, :, None].expand(B, H, S, D)
        # `keys`/`values` above are copies (torch.cat), so the buffers can be written in place now.
        old_k.scatter_(2, idx, k.to(old_k.dtype))
        old_v.scatter_(2, idx, v.to(old_v.dtype))
        trash = slots == self.capacity - 1
        new_pos = torch.where(stale, -1, old_pos).scatter(1, slots, torch.where(trash, -1, input_pos))
        new_pos[:, -1] = -1  # the trash slot never holds a visible position
        old_pos.copy_(new_pos)
        return keys, values, key_pos

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()
        self.pos.fill_(-1)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.k, self.v, self.pos))
