"""What a KV storage implements to follow the paged-KV manager's decisions.

The manager (`paged_manager.PagedKVManager`) decides which block holds which token; a storage holds
the keys and values. Two kinds of storage follow the same decisions:

**A block-tensor pool** (torch / ONNX Runtime / ExecuTorch): `k, v` of shape
`[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. Attention writes each new token at
its flat slot from `SlotPlan.slot_mapping` (`block_id * block_size + offset`) and reads through the
block table. The block table already expresses sharing, so of the hooks below only `copy_blocks`
does work; the others are no-ops:

    copy_blocks   k[:, dst, :n] = k[:, src, :n] (same for v), for every op, before the forward
    share_prefix  no-op: the block table points at the cached blocks
    fork          no-op: both tables point at the same blocks
    truncate      no-op: the stale slots are past the sequence's length, masked, overwritten later
    release       no-op

**llama.cpp sequences** (llama-cpp-python's `llama_memory_*`): cells are tagged with sequence ids
and positions; a cell tagged with several sequences is shared, and `llama_decode` writes a
sequence's new tokens into fresh cells. The storage maps each manager `SeqId` to a llama seq id;
the manager's blocks only do the accounting. Then:

    copy_blocks   no-op: writing a new token adds a cell tagged only with the writer, so the shared
                  cells stay intact for the other holders (llama.cpp's tags are the copy-on-write)
    share_prefix  the manager names a live source sequence that has computed that whole prefix.
                  With a unified KV cache: llama_memory_seq_cp(mem, source, seq, 0, num_tokens).
                  With one KV stream per sequence (kv_unified=False, what makes batched decoding
                  equal to decoding alone), llama.cpp copies whole streams only, so: seq_cp(source,
                  seq, -1, -1), then seq_rm(seq, num_tokens, -1); a partial-range copy aborts there
    fork          llama_memory_seq_cp(mem, parent, child, -1, -1)
    truncate      llama_memory_seq_rm(mem, seq, num_tokens, -1)
    release       llama_memory_seq_rm(mem, seq, -1, -1), and the llama seq id returns to its pool
    retain        the llama seq id now stands for a retained prefix; seq_rm(seq, num_tokens, -1)
    adopt         the retained prefix's llama seq id now stands for the new sequence; seq_rm(seq,
                  num_tokens, -1): no copy (one stream per sequence, as llama-server's slots)

A llama cell lives only as long as a sequence tags it, so build the manager with
`per_sequence_storage=True`: it then keeps no block cached once its last holder is gone (unless a
retained prefix, `retain_prefixes`, keeps its cells tagged), serves prefix hits only from a live
sequence or retained prefix that holds the whole prefix (`SlotPlan.prefix_source`),
and `fork` requires the parent's tokens computed, since `seq_cp` copies only existing cells.
Sizing: give the manager `n_ctx // block_size` blocks. Its count is conservative (llama.cpp shares
the cells of a copied partial block and packs tokens without block rounding), so the manager
answers "no room" before `llama_decode` fails.

Ordering, for both: run `SlotPlan.apply_to(storage)` for every plan of a step before that step's
forward, and `TruncateEvent` / `FreeEvent` / `ForkEvent.apply_to(storage)` right after the manager
call. A copy's source may be written by the same step's forward (after a copy-on-write, the other
holder of a forked block writes it in place), so every copy of a step runs before its forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from edgefinfer.runtime.kv.paged_manager import CopyOp, SeqId


@runtime_checkable
class KVStorage(Protocol):
    """The storage side of the paged-KV manager. Every method is called after the manager has
    already updated its tables; none may fail for lack of room (the manager checked)."""

    def copy_blocks(self, ops: Sequence[CopyOp]) -> None:
        """Copy-on-write: copy the first `op.num_tokens` slots of `op.src` into `op.dst`, for each
        op in order, before the forward that writes the new tokens."""
        ...

    def share_prefix(self, seq_id: SeqId, source_id: SeqId | None, block_ids: Sequence[int],
                     num_tokens: int) -> None:
        """A new sequence starts with its first `num_tokens` tokens already stored in the cached
        `block_ids` (block i at positions [i * block_size, (i + 1) * block_size)). `source_id` is a
        live sequence holding that prefix (always set with `per_sequence_storage`, else None); there,
        `num_tokens` may go on past `block_ids` into the sequence's next (new) block, whose leading
        tokens `source_id` holds too."""
        ...

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> None:
        """`child_id` now has the same first `num_tokens` tokens as `parent_id`."""
        ...

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """`seq_id` keeps only its first `num_tokens` tokens; later positions will be rewritten."""
        ...

    def release(self, seq_id: SeqId) -> None:
        """`seq_id` is gone. Blocks the manager still caches must keep their contents."""
        ...

    def retain(self, seq_id: SeqId, retained_id: SeqId, num_tokens: int) -> None:
        """`seq_id` is gone, but its first `num_tokens` tokens stay stored under `retained_id`
        (a `RetainedPrefix`; per-sequence storages only). llama.cpp: the llama seq id moves to
        `retained_id`, then seq_rm(seq, num_tokens, -1)."""
        ...

    def adopt(self, retained_id: SeqId, seq_id: SeqId, num_tokens: int) -> None:
        """A new sequence takes over the storage of the retained prefix `retained_id`, which is gone,
        and keeps its first `num_tokens` tokens (`adopt_retained` managers only). llama.cpp: the llama
        seq id moves to `seq_id`, then seq_rm(seq, num_tokens, -1)."""
        ...
