"""The KV-cache contract between attention and its storage, and the simple static cache.

Attention does not know how keys and values are stored. It hands each layer's new entries to the
cache and gets back the keys/values it may attend to, together with the absolute position of every
returned key slot. The mask is then derived from positions alone:

    allowed[q, t] = 0 <= key_pos[t] <= query_pos[q]   and   query_pos[q] - key_pos[t] < window

This one rule covers a static cache (slot t holds position t; slots beyond the current length, or
left over from rejected speculative tokens, are masked by causality), a sliding-window ring buffer
(slots hold arbitrary positions, -1 = empty) and a paged cache (keys gathered through a block
table). The sliding-window and paged caches live in `edgefinfer.runtime.kv`; they implement the
same `KVCache` protocol. A cache may also expose `window` (it keeps only that many recent positions)
and `num_sinks` (the first positions it keeps forever); attention then applies the tighter window.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from edgefinfer.model.config import ModelConfig


@runtime_checkable
class KVCache(Protocol):
    def update(self, layer: int, k: Tensor, v: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store new keys/values and return what attention may read.

        k, v:      [B, Hkv, S, D]  the new entries
        input_pos: [B, S]          their absolute positions
        returns    keys, values [B, Hkv, T, D] and key_pos [B, T] (-1 marks an empty slot)
        """
        ...


class StaticCache(nn.Module):
    """A contiguous cache of `max_seq_len` slots per sequence; slot t holds position t.

    Rolling back (e.g. after rejected speculative tokens) needs no work: the stale slots sit at
    positions greater than any future query's until they are overwritten, so causality masks them.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, trim: bool = True):
        super().__init__()
        # trim: return only the slots up to the furthest position written so far, so eager decoding
        # costs O(length) rather than O(max_seq_len). It reads a position back to Python, which
        # torch.export cannot trace: exporters pass trim=False and attend over all slots.
        self.trim = trim
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, max_seq_len, config.dim_per_head)
        self.max_seq_len = max_seq_len
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("slot_pos", torch.arange(max_seq_len, device=device), persistent=False)

    def update(self, layer: int, k: Tensor, v: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, H, S, D = k.shape
        idx = input_pos[:, None, :, None].expand(B, H, S, D)  # [B, Hkv, S, D]
        k_all = self.k[layer, :B].scatter_(2, idx, k.to(self.k.dtype))
        v_all = self.v[layer, :B].scatter_(2, idx, v.to(self.v.dtype))
        if self.trim:
            T = int(input_pos.max()) + 1
            return k_all[:, :, :T], v_all[:, :, :T], self.slot_pos[:T].expand(B, -1)
        return k_all, v_all, self.slot_pos.expand(B, -1)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()


def attention_mask(query_pos: Tensor, key_pos: Tensor, window: int | None, num_sinks: int = 0) -> Tensor:
    """Boolean mask [B, 1, S, T] (True = may attend) from query positions [B, S] and key positions [B, T]."""
    return may_attend(query_pos[:, :, None], key_pos[:, None, :], window, num_sinks)[:, None]


def may_attend(query_pos: Tensor, key_pos: Tensor, window: int | None, num_sinks: int = 0) -> Tensor:
    """The mask rule of this module's docstring on positions already shaped to broadcast (queries
    [..., S, 1], keys [..., 1, T]) -> bool [..., S, T]; exporters with their own layouts call it too.

    `window`: a query sees the keys of the last `window` positions, itself included (Mistral's rule).
    `num_sinks`: positions below it stay visible whatever the window (StreamingLLM attention sinks).
    A key position of -1 marks an empty slot.
    """
    allowed = (key_pos >= 0) & (key_pos <= query_pos)
    if window is not None:
        allowed = allowed & ((query_pos - key_pos < window) | (key_pos < num_sinks))
    return allowed


def effective_window(config_window: int | None, cache: object | None) -> tuple[int | None, int]:
    """The tighter of the model's sliding window and the cache's own (a ring cache may be smaller)."""
    cache_window = getattr(cache, "window", None)
    windows = [w for w in (config_window, cache_window) if w is not None]
    return (min(windows) if windows else None), int(getattr(cache, "num_sinks", 0))
