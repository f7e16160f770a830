"""The contract between the runtime (generation loop, speculative decoding) and an artefact's runtime.

A backend owns one sequence's KV cache inside its own runtime (ExecuTorch buffers, ONNX Runtime
tensors, a llama.cpp context, torch tensors) and exposes a single call: feed tokens at a position,
get their logits. Everything else (sampling, stop strings, speculative decoding, streaming) is
written once, above this line.

Rollback after rejected speculative tokens is positional: the next `forward` starts at the first
rejected position, and the backend must make the stale entries invisible (a static cache overwrites
them and causality hides the rest; the ring cache masks entries at positions >= the new start;
llama.cpp removes them with `llama_memory_seq_rm`). `rollback(length)` is the explicit hook for
backends that need it.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

UNBOUNDED = 1 << 30  # the max_seq_len a window cache reports: it streams without a length limit


@runtime_checkable
class Backend(Protocol):
    name: str  # "torch" | "executorch" | "onnxruntime" | "llamacpp"
    vocab_size: int
    max_seq_len: int  # positions the cache can address (a window cache: unbounded, report a large number)
    window: int | None  # a sliding-window cache keeps only this many recent positions (None: full context)
    # Optional: a window cache that can roll back at most this many rejected tokens of one step
    # exactly declares `max_draft_tokens: int`; the Engine refuses a larger speculative K.
    # Optional: `prefill_grid: int | None`. G declares that a prompt's rows inside whole aligned chunks
    # [k*G, (k+1)*G) come out bit for bit the same however the prompt was cut into `forward` calls that
    # start on the grid (G = 1: any cut), while one-token calls may round differently; sessions then
    # prefill decoded replies again (`runtime.session`). None: no such promise.
    # Optional: `rows_depend_on_calls: bool`. True declares that a row's logits depend on where the call
    # that computed it starts and ends; without a grid, sessions then feed a conversation in
    # turn-aligned calls, as a stateless run with `conversation_cuts` does (`runtime.session`).

    def forward(self, tokens: Sequence[int], start_pos: int) -> np.ndarray:
        """Feed `tokens` at positions start_pos.. and return their logits, float32 [len(tokens), vocab]."""
        ...

    def rollback(self, length: int) -> None:
        """Forget every cached position >= `length`."""
        ...

    def reset(self) -> None:
        """Forget everything (a new sequence)."""
        ...


def last_logits(backend: Backend, tokens: Sequence[int], start_pos: int) -> np.ndarray:
    """Feed `tokens` and return the last one's logits [V]: what a prefill needs. A backend that can skip
    the other rows declares `forward_last` (llama.cpp computes and copies logits only where asked); the
    others compute every row in their graph anyway."""
    last = getattr(backend, "forward_last", None)
    return last(tokens, start_pos) if last is not None else backend.forward(tokens, start_pos)[-1]
