"""The typed boundary between the scheduler and an executor (vLLM v1 style).

Every engine step is one `StepPlan` in and one `StepResult` out:

    plan = scheduler.schedule()        # which sequences run, which tokens they feed, KV bookkeeping
    result = executor.execute(plan)    # applies plan.kv_ops to its storage, runs ONE forward
    outputs = scheduler.update(plan, result)

The scheduler owns the paged-KV manager (`edgefinfer.runtime.kv.paged_manager`) and therefore every
decision about memory; the executor owns the storage that follows those decisions (llama.cpp
sequences, or a torch block pool) and the model. Nothing else crosses this line, so an executor can
be swapped (llama.cpp on CPU or CUDA, torch) without touching the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

import numpy as np

from edgefinfer.runtime.kv.paged_manager import ForkEvent, FreeEvent, SlotPlan, TruncateEvent
from edgefinfer.runtime.kv.storage import KVStorage

@runtime_checkable
class SwappableStorage(KVStorage, Protocol):
    """A storage that can park a sequence's KV in host memory (swap-out preemption)."""

    def swap_out(self, seq_id: int) -> None:
        """Copy the sequence's KV to host memory (its `FreeEvent` follows)."""
        ...

    def swap_in(self, seq_id: int) -> None:
        """Restore the saved KV into the sequence's (new) slot, exactly as it was."""
        ...

    def drop_swapped(self, seq_id: int) -> None:
        """Forget a saved sequence (aborted while swapped out)."""
        ...


@dataclass(frozen=True, slots=True)
class SwapOp:
    """Swap a sequence's KV out to the host, back in, or drop the host copy."""

    seq_id: int
    action: str  # "out" | "in" | "drop"

    def apply_to(self, storage: SwappableStorage) -> None:
        {"out": storage.swap_out, "in": storage.swap_in, "drop": storage.drop_swapped}[self.action](self.seq_id)


# A decision the storage must follow; each has `apply_to(storage)`.
KVOp = Union[SlotPlan, ForkEvent, TruncateEvent, FreeEvent, SwapOp]


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's share of a step: feed `token_ids` at positions start_pos.. and return the
    logits of the last `num_logits` of them (0 for a prompt chunk that is not the last one)."""

    seq_id: int
    token_ids: tuple[int, ...]  # [S]
    start_pos: int
    num_logits: int
    block_table: tuple[int, ...]  # the sequence's blocks once these tokens are written

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """kv_ops run on the storage in order, before the forward; then every `work` item in one forward."""

    kv_ops: tuple[KVOp, ...]
    work: tuple[SeqWork, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)


@dataclass(frozen=True, slots=True)
class StepResult:
    # seq_id -> float32 [num_logits, V]; valid until the executor's next `execute` (they may be views of
    # the backend's own buffer), and the caller may modify them in place (logit_bias, grammar masks).
    logits: dict[int, np.ndarray]
    elapsed_s: float  # wall time of the forward (the scheduler's speculation cost model reads it)


@runtime_checkable
class Executor(Protocol):
    """What the engine needs from a model runner."""

    name: str  # "llamacpp" | "torch"
    vocab_size: int
    max_model_len: int  # tokens (prompt + output) one sequence may reach
    max_num_seqs: int  # sequences the storage holds at once
    num_blocks: int  # size of the paged-KV manager to build over this storage
    block_size: int
    per_sequence_storage: bool  # see `edgefinfer.runtime.kv.storage`
    retain_prefixes: int  # freed sequences' prefixes a per-sequence storage keeps (PagedKVManager)
    retain_blocks: int | None  # and at most this many blocks that only they hold
    retain_once_blocks: int | None  # and of those, this many that no second sequence used
    adopt_retained: bool  # a hit on a retained prefix takes its storage over (PagedKVManager)
    max_storage_ids: int | None  # live sequences and retained prefixes together at most
    # True when a sequence's logits do not depend on which other sequences share its forward, as long
    # as its own tokens are split into the same chunks (llama.cpp with one KV stream per sequence).
    batch_invariant: bool
    supports_swap: bool  # the storage is a `SwappableStorage` and swapping keeps results exact
    # The model attends to this many recent positions only; the manager drops blocks behind it
    # (None: every block stays until its sequence ends).
    sliding_window: int | None
    storage: KVStorage

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply `plan.kv_ops`, run the forward, return the requested logits."""
        ...

    def describe(self) -> dict:
        """Settings worth reporting (/v1/models, benchmarks)."""
        ...

    def close(self) -> None:
        ...
