"""The host's view of ONNX Runtime's windowed KV cache (GroupQueryAttention, `sliding_window_cache=1`).

ONNX Runtime owns this cache: the operator writes new entries and evicts old ones inside the
[1, Hkv, C, D] buffers we bind as both past and present. Its contract (the operator's schema,
ORT >= 1.31): after T tokens, rows [0, L(T)) hold positions T-L(T) .. T-1 in order, with

    G = C - W + 1;   L(T) = T if T <= C, else T - G * ceil((T - C) / G)

so the buffer is compacted by G rows at once, every G tokens. This module mirrors that layout on
the host for the one thing the operator cannot do: roll back across a compaction. Rolling back k
tokens (rejected speculative tokens) is exact by simply re-running at the shorter length when
L(T - k) == L(T) - k; when the rejected step crossed a compaction, the rows it evicted are needed
again. `WindowedKV` therefore saves the rows a multi-token step is about to evict (G per
compaction, into one buffer reused from step to step) and, on a rollback into that step, shifts the
surviving rows right and puts the saved ones back in front, re-creating the layout the operator
expects at the shorter length.

The cache itself is not a second implementation of a sliding window: eviction and masking are the
operator's; this is bookkeeping over its buffers (numpy views of the bound ORT tensors).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def resident_rows(total: int, slots: int, window: int) -> int:
    """L(T): rows of the windowed buffer that hold positions after `total` tokens."""
    if total <= slots:
        return total
    g = slots - window + 1
    return total - g * math.ceil((total - slots) / g)


class WindowedKV:
    """Tracks the resident range of GQA's windowed buffers and makes rollbacks exact.

    `buffers` are the bound numpy arrays [1, Hkv, C, D] (every layer's key and value). Call
    `before_step(start, n)` before running n tokens at position `start` and `after_step(start + n)`
    once the run succeeded.
    """

    def __init__(self, buffers: Sequence[np.ndarray], slots: int, window: int):
        if not 1 <= window <= slots:
            raise ValueError(f"a windowed cache needs 1 <= window <= slots, got window={window}, slots={slots}")
        self.buffers = list(buffers)
        self.slots, self.window = slots, window
        self.group = slots - window + 1  # rows evicted per compaction
        self.length = 0  # T: tokens the buffers describe
        self.restores = 0  # rollbacks that had to put evicted rows back
        self._saved: np.ndarray | None = None  # [2L, 1, Hkv, rows, D], allocated on the first need
        self._saved_span: tuple[int, int, int] | None = None  # (first saved position, rows, step start)

    def rows(self, total: int) -> int:
        return resident_rows(total, self.slots, self.window)

    def first_position(self, total: int) -> int:
        """The position held by row 0 after `total` tokens."""
        return total - self.rows(total)

    def before_step(self, start: int, n: int) -> None:
        if start > self.length:
            raise ValueError(f"position {start} skips tokens: the cache holds {self.length}")
        if start == 0:
            self.reset()  # a new sequence: the operator reads no past rows at T = n
        elif start < self.length:
            self._rollback(start)
        self._save_evicted(start, n)

    def after_step(self, total: int) -> None:
        self.length = total

    def reset(self) -> None:
        self.length = 0
        self._saved_span = None

    # -- internals --
    def _save_evicted(self, start: int, n: int) -> None:
        """Before a step that compacts the buffer: keep the resident rows it will evict, so that a
        rollback into the step can restore them (one copy of G rows per compaction)."""
        self._saved_span = None
        evicted = min(self.first_position(start + n) - self.first_position(start), self.rows(start))
        if start == 0 or evicted == 0 or n > self.window:
            # Nothing evicted; a prefill from 0 (a rollback to its start is a reset); or a chunk
            # longer than the window, which evicts its own tokens and is never rolled back (the
            # Engine caps speculative steps at the window, `OrtBackend.max_draft_tokens`).
            return
        if self._saved is None or self._saved.shape[3] < evicted:  # sized by the longest step seen
            b0 = self.buffers[0]
            self._saved = np.empty((len(self.buffers),) + b0.shape[:2] + (evicted, b0.shape[3]), b0.dtype)
        for buf, keep in zip(self.buffers, self._saved):
            keep[:, :, :evicted] = buf[:, :, :evicted]
        self._saved_span = (self.first_position(start), evicted, start)

    def _rollback(self, total: int) -> None:
        """Re-lay the buffers for `total` < self.length tokens: row r must hold position need_lo + r."""
        cur_lo = self.first_position(self.length)  # position in row 0 now
        need_lo = self.first_position(total)
        shift = cur_lo - need_lo  # rows of evicted positions the shorter layout needs back
        if shift == 0:
            return  # same compaction epoch: the operator re-runs at the shorter length
        span = self._saved_span
        # Positions [need_lo, min(cur_lo, total)) must come back from the saved rows.
        if shift < 0 or span is None or total < span[2] or min(cur_lo, total) > span[0] + span[1]:
            raise ValueError(f"cannot roll back from {self.length} to {total} tokens: the rows it needs were "
                             "evicted (roll back only into the last step, and not past a step longer than the cache)")
        offset = need_lo - span[0]
        from_saved = min(cur_lo, total) - need_lo
        kept = total - need_lo - from_saved  # surviving rows [0, kept) move right by `shift`
        for buf, saved in zip(self.buffers, self._saved):
            if kept:
                buf[:, :, shift:shift + kept] = buf[:, :, :kept].copy()
            buf[:, :, :from_saved] = saved[:, :, offset:offset + from_saved]
        self._saved_span = None
        self.restores += 1
