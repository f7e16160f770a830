"""The paged-KV manager: per-sequence block tables over a shared `BlockPool`, with prefix caching,
copy-on-write and atomic "no room" answers. It decides; a storage (`storage.KVStorage`) follows.

The manager never touches tensors. The scheduler drives it, one call per event of a sequence:

    plan = manager.allocate(seq, prompt)      # SlotPlan, or NoRoom -> preempt someone and retry
    plan.apply_to(storage)                    # prefix sharing, copy-on-write copies
    ... forward writes the new tokens' KV at plan.slot_mapping ...
    manager.mark_computed(seq)                # now its full blocks may serve other sequences
    plan = manager.append(seq, [token])       # decode (or [token, *draft] when speculating)
    manager.truncate(seq, n).apply_to(storage)        # drop rejected draft tokens
    manager.fork(seq, child).apply_to(storage)        # parallel sampling
    manager.free(seq).apply_to(storage)

Token regions of one sequence (block_size 4, one cached block, one new block):

    | cached (prefix hit) | computed  | planned, not yet computed |
    | t0 t1 t2 t3         | t4 t5     | t6 t7 | t8                |
    |      block 7        |        block 2    |  block 5          |

Rules, each with its reason:
- Prefix hits are whole blocks found by chained content hash, and at most `len(prompt) - 1` tokens
  come from the cache (vLLM's rule): the last prompt token is always computed, because its forward
  yields the logits of the first generated token. A prompt of exactly k full blocks reuses at most
  k - 1 blocks. With a per-sequence storage the hit goes on token by token into the next block, up to
  the last prompt token, when a live or retained sequence holds those tokens computed after the same
  hit blocks: its storage keeps cells, not blocks (llama-server's slots reuse a prompt to the token the
  same way). The sequence's own block there is new; the storage copies the leading tokens into it
  (`share_prefix` with `num_tokens` past the hit blocks).
- A block enters the prefix cache only in `mark_computed`, once its KV is really in storage. (vLLM
  caches at scheduling time and relies on one forward writing before it reads; a llama.cpp storage
  copies cells that must already exist.) Forgetting `mark_computed` only costs hits, never
  correctness.
- A block is written in place only if this sequence is its sole holder and it has no hash. Otherwise
  the manager takes a new block and returns a `CopyOp` (copy-on-write): shared blocks and cached
  content never change under their other readers.
- Every call that needs blocks checks first and returns `NoRoom` with the state untouched; nothing
  here raises for lack of memory.
- Freed blocks are released tail first, so the end of a sequence is evicted before its prefix
  (prefixes are what other prompts share).
- With a per-sequence storage, a prefix outlives its request only as a *retained prefix*
  (`retain_prefixes` > 0): a freed sequence's leading cached blocks stay in storage under a
  `RetainedPrefix` id (the storage keeps that many tokens of it, `FreeEvent.retained_as`), and its
  partial last block with them, indexed under the hash of the tokens it holds (`_register_tail`: only
  the token-by-token hit above reads it, so a prompt sent again computes its last token only), until
  the pool evicts one of their blocks (the retained prefix is cut there, `SlotPlan.retained_ops`),
  or more than `retain_prefixes` of them exist (the least recently used goes), or more than
  `retain_blocks` blocks are cached, i.e. held by retained prefixes alone (or more than
  `retain_once_blocks` of those that no second sequence used). Then the pool's next
  victim goes, as if a sequence had taken it, and the retained prefixes holding it are cut there
  (`FreeEvent.dropped`); blocks that running sequences hold cost no extra storage and never count.
  The pool's eviction order (block_pool.py) takes blocks that no second sequence used before those
  that one did, each least recently used first and a freed sequence's tail first: the question and
  answer after a shared system prompt go before it, and a system prompt that requests hit is not
  pushed out by the tails of the requests that finish after it. (The cap used to count whole
  prefixes, tails and running sequences' blocks included, and to drop the least recently used prefix
  whole: replayed through the scheduler, bench/server_scale.py's replica with three system prompts
  lost one that way about once a run.) A retained prefix that another one starts with is dropped at
  once, and so is one that an eviction would leave holding what another holds. So
  every cached block is held by a retained prefix and every block of a retained prefix is cached or
  in use: the manager's free count stays the storage's real free memory, which is what lets
  llama.cpp's unified cell pool be sized and admitted by the manager alone. (With `adopt_retained`,
  per-slot streams that are memory of their own each, a retained prefix may name the cache's copy of
  a block that its own stream computed again: `_registered_run`.)
- With a sliding window of W tokens (`sliding_window`, Mistral's rule: a query at position q sees
  q-W+1 .. q), `append` first drops the blocks that lie wholly before the window of its first new
  token (vLLM's `remove_skipped_blocks`): their block-table entries become `NULL_BLOCK`, and the
  blocks go back to the pool (a cached one stays cached, so other prompts can still hit it). Every
  token before `append`'s first new position is committed (rejected drafts were truncated first),
  and every later query sits at or after it, so a dropped block is never read again; a sequence
  therefore holds at most ceil((W - 1) / block_size) + 1 blocks plus those of its new tokens, however
  long it grows. `truncate` into the dropped part raises: those positions must be recomputed.
  A whole prompt is allocated before its first forward, so a prompt longer than the window holds
  its blocks until its first decode step.

Calling a method with an unknown or duplicate sequence id, or out-of-range lengths, is a bug in the
caller and raises ValueError.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgefinfer.errors import UserError
from edgefinfer.runtime.kv.block_pool import BlockHash, BlockHashFn, BlockPool, sha256_block_hash

if TYPE_CHECKING:
    from edgefinfer.runtime.kv.storage import KVStorage

SeqId = Hashable
# The block-table entry of a block dropped behind a sliding window: its positions keep their index
# (block i still stands for positions [i * block_size, (i + 1) * block_size)), no storage behind it.
NULL_BLOCK = -1


@dataclass(frozen=True, slots=True)
class RetainedPrefix:
    """The storage id of a freed sequence's kept prefix (never a live sequence's id)."""

    number: int

    def __repr__(self) -> str:
        return f"retained#{self.number}"


# ------------------------------------------------------------------------------------------ results
@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy the first `num_tokens` slots of block `src` into block `dst` before anything writes `dst`."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """Where the new tokens of one sequence go, and what the storage must do before writing them.

    block_ids:       the sequence's whole block table after this call
    start_pos:       position of the first new token (the tokens before it are in storage or planned)
    slot_mapping:    [num_new_tokens] flat slot of each new token: block_id * block_size + offset
    num_cached_tokens / cached_block_ids: the prefix reused from the cache (allocate only); with
                     per-sequence storage, up to a block's worth of tokens more than the cached
                     blocks hold, from `prefix_source`'s cells (the first new block's leading tokens)
    prefix_source:   with `per_sequence_storage`, a live sequence (or a `RetainedPrefix`) whose
                     storage holds that prefix
    new_block_ids:   blocks taken from the pool by this call (copy-on-write targets included)
    evicted_block_ids: those of the new blocks whose cached contents were evicted to make room
    copy_ops:        copy-on-write copies to run before the forward that writes slot_mapping
    retained_ops:    retained prefixes cut or dropped because their blocks were evicted, or for a
                     storage id (`max_storage_ids`) (first)
    adopted:         `prefix_source` is a retained prefix whose storage this sequence takes over
                     (`adopt_retained`): `storage.adopt` instead of `share_prefix`
    """

    seq_id: SeqId
    block_ids: tuple[int, ...]
    start_pos: int
    slot_mapping: tuple[int, ...]
    num_cached_tokens: int = 0
    cached_block_ids: tuple[int, ...] = ()
    prefix_source: SeqId | None = None
    new_block_ids: tuple[int, ...] = ()
    evicted_block_ids: tuple[int, ...] = ()
    copy_ops: tuple[CopyOp, ...] = ()
    retained_ops: tuple[TruncateEvent | FreeEvent, ...] = ()
    adopted: bool = False

    @property
    def num_new_tokens(self) -> int:
        return len(self.slot_mapping)

    def apply_to(self, storage: KVStorage) -> None:
        """Make the storage ready for the forward that writes `slot_mapping`."""
        for op in self.retained_ops:
            op.apply_to(storage)
        if self.adopted:
            storage.adopt(self.prefix_source, self.seq_id, self.num_cached_tokens)
        elif self.num_cached_tokens:
            storage.share_prefix(self.seq_id, self.prefix_source, self.cached_block_ids, self.num_cached_tokens)
        if self.copy_ops:
            storage.copy_blocks(self.copy_ops)


@dataclass(frozen=True, slots=True)
class NoRoom:
    """Not enough free blocks; nothing changed. Preempt (free) a sequence and retry.

    Falsy, so `if not plan:` reads as "no room". If `num_blocks_needed` exceeds the pool's
    `num_blocks`, the request can never fit.
    """

    num_blocks_needed: int
    num_blocks_free: int

    def __bool__(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class ForkEvent:
    """`child_id` now shares every block of `parent_id`, the partial last block included."""

    parent_id: SeqId
    child_id: SeqId
    block_ids: tuple[int, ...]
    num_tokens: int
    dropped: tuple[FreeEvent, ...] = ()  # retained prefixes dropped for a storage id (`max_storage_ids`)

    def apply_to(self, storage: KVStorage) -> None:
        for op in self.dropped:
            op.apply_to(storage)
        storage.fork(self.parent_id, self.child_id, self.num_tokens)


@dataclass(frozen=True, slots=True)
class TruncateEvent:
    """`seq_id` keeps its first `num_tokens` tokens; `dropped_block_ids` left its table (tail
    first), and of those `cached_block_ids` stayed in the prefix cache."""

    seq_id: SeqId
    num_tokens: int
    dropped_block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...]

    def apply_to(self, storage: KVStorage) -> None:
        storage.truncate(self.seq_id, self.num_tokens)


@dataclass(frozen=True, slots=True)
class FreeEvent:
    """`seq_id` is gone; `block_ids` was its table, `cached_block_ids` stayed in the prefix cache.

    With retained prefixes: `retained_as`, when set, keeps the first `retained_tokens` tokens of
    `seq_id` in storage under that id, and `dropped` drops or cuts the other retained prefixes this
    made redundant or pushed out (over `retain_prefixes` or `retain_blocks`), after that.
    """

    seq_id: SeqId
    block_ids: tuple[int, ...]
    cached_block_ids: tuple[int, ...]
    retained_as: RetainedPrefix | None = None
    retained_tokens: int = 0
    dropped: tuple[TruncateEvent | FreeEvent, ...] = ()

    def apply_to(self, storage: KVStorage) -> None:
        if self.retained_as is not None:
            storage.retain(self.seq_id, self.retained_as, self.retained_tokens)
        else:
            storage.release(self.seq_id)
        for op in self.dropped:  # after: a dropped prefix's cells may be the ones just retained
            op.apply_to(storage)


@dataclass(frozen=True, slots=True)
class KVStats:
    """Block counts (num_free includes num_cached: taking a cached block evicts it, so
    num_free + num_used == num_blocks) and token-level prefix-cache counters over `allocate`."""

    num_blocks: int
    num_used: int
    num_free: int
    num_cached: int
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # of those, tokens served from the cache
    num_retained: int = 0  # retained prefixes (per-sequence storage only)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


# ------------------------------------------------------------------------------------------ manager
@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    block_ids: list[int]  # block i holds positions [i * block_size, (i + 1) * block_size)
    num_computed: int
    # Chained hashes of the leading full, computed blocks already offered to the prefix cache.
    block_hashes: list[BlockHash] = field(default_factory=list)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVManager:
    """Block tables for many sequences over one pool of `num_blocks` blocks of `block_size` tokens.

    enable_prefix_caching: reuse full blocks across sequences by content hash.
    per_sequence_storage:  the storage holds KV per sequence (llama.cpp), not per block (a tensor
                           pool). A block's data then dies with its last holder, so freed blocks are
                           not kept in the cache, and a prefix hit must be copied from a live
                           sequence that has computed it all (`SlotPlan.prefix_source`); see storage.py.
    hash_fn:               the chained block hash; `sha256_block_hash` or `builtin_block_hash`.
    retain_prefixes:       with `per_sequence_storage`, how many freed sequences' cached prefixes
                           the storage keeps (see the module doc); 0 keeps none.
    retain_blocks:         at most this many cached blocks, those that only retained prefixes hold
                           (None: no limit but the pool); past it the pool's next victims go, and a
                           prefix longer than that alone keeps its head. For storages whose reads
                           cost grows with what they hold (llama.cpp's unified cache attends over
                           every cell, masked): cells that a running sequence holds are there anyway.
    retain_once_blocks:    and at most this many of them that no second sequence used (None: only
                           `retain_blocks`): 2Q's split (Johnson and Shasha: a quarter of the cache
                           for blocks seen once), so prompts that nothing shares cost at most this,
                           while prefixes that requests do share may use the rest.
    sliding_window:        the model attends to the last this many positions only; blocks behind
                           every future query's window are dropped (see the module doc).
    adopt_retained:        a storage whose sequences each own their storage (llama.cpp's per-slot
                           streams), where copying a prefix copies a whole stream but taking over one
                           costs nothing: a hit on a retained prefix takes its storage over
                           (`SlotPlan.adopted`; llama-server's slots keep each finished prompt and
                           hand it to the next request that starts with it), if the hit is at least
                           half of the new prompt or of what the prefix holds; a shorter hit is
                           copied (`share_prefix`) and the prefix stays: a short shared header must
                           not cost a long prompt another's system prompt, nor be computed again (a
                           stream copy, ~7 ms for SmolLM2 at 2048 cells, against ~26 header tokens
                           of prefill: 0.1-0.2 s on 2 CPU cores). Retained prefixes are preferred
                           over live sequences as sources.
    max_storage_ids:       live sequences and retained prefixes together at most (the storage's ids:
                           llama.cpp's streams); a new sequence that needs one drops the least
                           recently used retained prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 per_sequence_storage: bool = False, hash_fn: BlockHashFn = sha256_block_hash,
                 retain_prefixes: int = 0, retain_blocks: int | None = None,
                 retain_once_blocks: int | None = None, sliding_window: int | None = None,
                 adopt_retained: bool = False, max_storage_ids: int | None = None):
        if block_size < 1:
            raise UserError(f"block_size must be at least 1 token, got {block_size}; 16 is a common choice")
        if retain_prefixes < 0 or any(n is not None and n < 0 for n in (retain_blocks, retain_once_blocks)):
            raise UserError(f"retain_prefixes, retain_blocks and retain_once_blocks must be >= 0, got "
                            f"{retain_prefixes}, {retain_blocks} and {retain_once_blocks}")
        if sliding_window is not None and sliding_window < 1:
            raise UserError(f"sliding_window must be at least 1 token, got {sliding_window}")
        if sliding_window is not None and per_sequence_storage:
            # llama.cpp keeps a sequence's cells itself; its own windowed cache would have to drop them.
            raise UserError("a sliding window needs a block-tensor storage (the torch executor); "
                            "a per-sequence storage (llama.cpp) keeps every cell of a sequence")
        if (adopt_retained or max_storage_ids is not None) and not per_sequence_storage:
            raise UserError("adopt_retained and max_storage_ids need a per-sequence storage (llama.cpp)")
        if max_storage_ids is not None and not adopt_retained:
            # a retained prefix that a hit copies from would need an id beside the new sequence's
            raise UserError("max_storage_ids needs adopt_retained (llama.cpp's per-slot streams)")
        if max_storage_ids is not None and max_storage_ids < 1:
            raise UserError(f"max_storage_ids must be at least 1, got {max_storage_ids}")
        self.adopt_retained = adopt_retained
        self.max_storage_ids = max_storage_ids
        self.sliding_window = sliding_window
        self.retain_blocks = retain_blocks
        self.retain_once_blocks = retain_once_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.per_sequence_storage = per_sequence_storage
        # A block-tensor pool keeps freed blocks' data anyway; retaining matters for per-sequence storage.
        self.retain_prefixes = retain_prefixes if per_sequence_storage and enable_prefix_caching else 0
        self.pool = BlockPool(num_blocks, cache_freed_blocks=not per_sequence_storage or self.retain_prefixes > 0)
        self._hash_fn = hash_fn
        self._seqs: dict[SeqId, _Seq] = {}
        self._retained: OrderedDict[RetainedPrefix, list[int]] = OrderedDict()  # least recently used first
        self._retained_tokens: dict[RetainedPrefix, tuple[int, ...]] = {}  # the token ids its blocks hold
        self._coverage: Counter[int] = Counter()  # block -> retained prefixes holding it
        self._retained_ids = itertools.count()
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def seq_ids(self) -> Iterator[SeqId]:
        return iter(self._seqs)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq_id).block_ids)

    def token_ids(self, seq_id: SeqId) -> tuple[int, ...]:
        return tuple(self._get(seq_id).token_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._get(seq_id).token_ids)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_computed

    def num_held_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds (its table less the `NULL_BLOCK`s a sliding window dropped)."""
        return sum(b != NULL_BLOCK for b in self._get(seq_id).block_ids)

    def first_stored_position(self, seq_id: SeqId) -> int:
        """The first position whose KV the sequence still holds (0 unless a sliding window dropped
        blocks); truncating below it is refused."""
        table = self._get(seq_id).block_ids
        n = 0
        while n < len(table) and table[n] == NULL_BLOCK:
            n += 1
        return n * self.block_size

    def stats(self) -> KVStats:
        p = self.pool
        return KVStats(p.num_blocks, p.num_used, p.num_free, p.num_cached, self._prefix_queries, self._prefix_hits,
                       len(self._retained))

    def retained(self) -> dict[RetainedPrefix, tuple[int, ...]]:
        """Each retained prefix's block table, least recently used first."""
        return {rid: tuple(t) for rid, t in self._retained.items()}

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of `num_tokens` tokens fits even with no prefix hit (hits never
        need more blocks: each hit saves one new block and takes at most one free one)."""
        return _cdiv(num_tokens, self.block_size) <= self.pool.num_free

    def can_append(self, seq_id: SeqId, num_tokens: int) -> bool:
        seq = self._get(seq_id)
        return (self._append_cost(seq, num_tokens)[0]
                <= self.pool.num_free + self._num_reclaimable(seq, self._behind_window(seq)))

    # ---------------------------------------------------------------- events
    def allocate(self, seq_id: SeqId, token_ids: Sequence[int]) -> SlotPlan | NoRoom:
        """Start a sequence: reuse its longest cached prefix, plan slots for the rest."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists; free it before allocating it again")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r}: allocate needs at least one token")
        tokens = list(token_ids)
        hashes, hits = self._longest_cached_prefix(tokens) if self.enable_prefix_caching else ([], [])
        source, extra = None, 0
        if hits and self.per_sequence_storage:
            source, n = self._prefix_source(hits)
            del hashes[n:], hits[n:]
        whole_blocks_source = source
        if self.per_sequence_storage and self.enable_prefix_caching:
            holder, extra = self._partial_block(tokens, hits)
            source = holder if extra else source
        source, adopted = self._reuse(source, tokens, hits, extra)
        num_new = _cdiv(len(tokens), self.block_size) - len(hits)
        # A hit on a cached (unreferenced) block takes it out of the free queue too.
        needed = num_new + sum(self.pool.ref_count(b) == 0 for b in hits)
        if needed > self.pool.num_free:
            return NoRoom(needed, self.pool.num_free)
        # A retained holder's block after the hits is cached, not held: this very call must not evict
        # it, so it is held while blocks are taken (where there is room for that; else no partial hit).
        guard = []
        if extra and isinstance(source, RetainedPrefix):
            block = self._retained[source][len(hits)]
            guard = [block] if self.pool.ref_count(block) == 0 else []
            if guard and needed + 1 > self.pool.num_free:
                guard, extra = [], 0
                source, adopted = self._reuse(whole_blocks_source, tokens, hits, extra)

        self.pool.touch(hits + guard)  # before take(): a hit block must not be evicted for this very sequence
        if isinstance(source, RetainedPrefix):
            self._retained.move_to_end(source)
        id_ops = [] if adopted else self._free_storage_id(keep=source)
        new, evicted, retained_ops = self._take(num_new)
        self.pool.release(guard)  # back in the queue, as recently used
        if adopted:  # the retained prefix is gone: its storage is this sequence's now
            self._cut_retained(source, 0)
        num_cached = len(hits) * self.block_size + extra
        seq = _Seq(tokens, hits + new, num_computed=num_cached, block_hashes=hashes)
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self._prefix_queries += len(tokens)
            self._prefix_hits += num_cached
        return SlotPlan(seq_id, tuple(seq.block_ids), num_cached, self._slots(seq, num_cached, len(tokens)),
                        num_cached, tuple(hits), source, tuple(new), tuple(evicted),
                        retained_ops=(*id_ops, *retained_ops), adopted=adopted)

    def append(self, seq_id: SeqId, token_ids: Sequence[int]) -> SlotPlan | NoRoom:
        """Plan slots for tokens that extend a sequence (a decode token, or it and draft tokens)."""
        seq = self._get(seq_id)
        cost, cow = self._append_cost(seq, len(token_ids))
        behind = self._behind_window(seq)
        reclaimable = self._num_reclaimable(seq, behind) if behind else 0
        if cost > self.pool.num_free + reclaimable:
            return NoRoom(cost, self.pool.num_free + reclaimable)

        start = len(seq.token_ids)
        if behind:  # before take(): the dropped blocks are free room for this very append
            self.pool.release([seq.block_ids[i] for i in behind])
            for i in behind:
                seq.block_ids[i] = NULL_BLOCK
        new, evicted, retained_ops = self._take(cost)
        copy_ops: tuple[CopyOp, ...] = ()
        if cow:
            src, dst = seq.block_ids[-1], new[0]
            copy_ops = (CopyOp(src, dst, start % self.block_size),)
            seq.block_ids[-1] = dst
            self._forget_unheld(self.pool.release([src]))  # after take(), so src cannot come back as a new block
            seq.block_ids.extend(new[1:])
        else:
            seq.block_ids.extend(new)
        seq.token_ids.extend(token_ids)
        return SlotPlan(seq_id, tuple(seq.block_ids), start, self._slots(seq, start, len(seq.token_ids)),
                        new_block_ids=tuple(new), evicted_block_ids=tuple(evicted), copy_ops=copy_ops,
                        retained_ops=retained_ops)

    def mark_computed(self, seq_id: SeqId, num_tokens: int | None = None) -> int:
        """Record that storage now holds the KV of the first `num_tokens` tokens (default: all) and
        register the full blocks among them in the prefix cache. Returns how many got registered."""
        seq = self._get(seq_id)
        n = len(seq.token_ids) if num_tokens is None else num_tokens
        if not seq.num_computed <= n <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: mark_computed({n}) outside "
                             f"[{seq.num_computed}, {len(seq.token_ids)}] (computed so far, planned)")
        seq.num_computed = n
        if not self.enable_prefix_caching:
            return 0
        registered = 0
        bs = self.block_size
        for i in range(len(seq.block_hashes), n // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = self._hash_fn(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            if seq.block_ids[i] != NULL_BLOCK:  # (only if appended before being marked computed)
                registered += self.pool.register(seq.block_ids[i], h)
            seq.block_hashes.append(h)
        return registered

    def fork(self, parent_id: SeqId, child_id: SeqId) -> ForkEvent:
        """Share every block of the parent with a new child (parallel sampling); never needs room.
        Whichever of the two first appends into the shared partial block gets a copy-on-write.

        The parent's tokens must all be computed: a per-sequence storage copies only what exists.
        """
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists; fork into a new id")
        if parent.num_computed < len(parent.token_ids):
            raise ValueError(f"sequence {parent_id!r}: fork after its {len(parent.token_ids)} tokens are "
                             f"computed (mark_computed), not at {parent.num_computed}")
        self.pool.touch([b for b in parent.block_ids if b != NULL_BLOCK])
        dropped = self._free_storage_id()
        self._seqs[child_id] = _Seq(list(parent.token_ids), list(parent.block_ids), parent.num_computed,
                                    list(parent.block_hashes))
        return ForkEvent(parent_id, child_id, tuple(parent.block_ids), len(parent.token_ids), tuple(dropped))

    def truncate(self, seq_id: SeqId, num_tokens: int) -> TruncateEvent:
        """Keep the first `num_tokens` tokens (drop rejected draft tokens), like
        `llama_memory_seq_rm(seq, num_tokens, -1)`. Blocks past the end are released tail first.

        If the last kept block becomes partial, its tail will be overwritten: when this sequence is
        its only holder it leaves the prefix cache now; when it is shared it keeps its hash (others
        still read it whole) and the next append copies it first.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: truncate({num_tokens}) outside [0, {len(seq.token_ids)}]")
        if num_tokens < len(seq.token_ids) and num_tokens < self.first_stored_position(seq_id):
            raise ValueError(f"sequence {seq_id!r}: truncate({num_tokens}) reaches behind the sliding window "
                             f"(positions before {self.first_stored_position(seq_id)} were dropped); free it "
                             f"and allocate it again to recompute them")
        bs = self.block_size
        keep = _cdiv(num_tokens, bs)
        dropped = seq.block_ids[keep:]
        del seq.block_ids[keep:], seq.token_ids[num_tokens:], seq.block_hashes[num_tokens // bs:]
        seq.num_computed = min(seq.num_computed, num_tokens)
        cached = self._forget_unheld(self.pool.release(dropped[::-1]))
        if num_tokens % bs:
            last = seq.block_ids[-1]
            if (self.pool.block_hash(last) is not None and self.pool.ref_count(last) == 1
                    and not self._coverage[last]):
                self.pool.unregister(last)
        return TruncateEvent(seq_id, num_tokens, tuple(dropped[::-1]), tuple(cached))

    def free(self, seq_id: SeqId) -> FreeEvent:
        """Drop a finished or preempted sequence; its blocks are released tail first."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        held = [b for b in seq.block_ids if b != NULL_BLOCK]
        tail = self._register_tail(seq) if self.retain_prefixes else None  # before release: it stays cached
        cached = self.pool.release(held[::-1])
        if not self.retain_prefixes:
            return FreeEvent(seq_id, tuple(held), tuple(cached))
        run = self._registered_run(seq)
        num_tokens = len(run) * self.block_size
        if tail is not None and len(run) == seq.num_computed // self.block_size:
            run, num_tokens = run + [tail], seq.num_computed
        retained_as, dropped = None, []
        if self.retain_blocks is not None and len(run) > self.retain_blocks:
            run = run[:self.retain_blocks]  # over the cap alone: its head stays (tails go first, as in the pool)
            num_tokens = len(run) * self.block_size
        if run and not any(t[:len(run)] == run for t in self._retained.values()):
            retained_as = RetainedPrefix(next(self._retained_ids))
            self._retained[retained_as] = run
            self._retained_tokens[retained_as] = tuple(seq.token_ids[:num_tokens])
            self._coverage.update(run)
            # Prefixes the new one starts with are redundant; then the least recently used go.
            dropped += [self._cut_retained(r, 0) for r, t in list(self._retained.items())
                        if r != retained_as and run[:len(t)] == t]
            while len(self._retained) > self.retain_prefixes:
                dropped.append(self._cut_retained(next(iter(self._retained)), 0))
        self._forget_unheld(cached)
        dropped += self._evict_over_cap()
        kept_tokens = 0
        if retained_as in self._retained:  # (the cap may have cut it too)
            kept_tokens = len(self._retained_tokens[retained_as])
        if retained_as is not None:  # the storage keeps it at its final length at once
            dropped = [op for op in dropped if op.seq_id != retained_as]
            if retained_as not in self._retained:  # the cap took all of it: nothing is kept after all
                retained_as = None
        cached = [b for b in cached if self.pool.block_hash(b) is not None and not self.pool.ref_count(b)]
        return FreeEvent(seq_id, tuple(seq.block_ids), tuple(cached), retained_as, kept_tokens, tuple(dropped))

    # ---------------------------------------------------------------- internals
    def _take(self, n: int) -> tuple[list[int], list[int], tuple[TruncateEvent | FreeEvent, ...]]:
        """`pool.take`, and cut every retained prefix at the first block that was evicted from it."""
        new, evicted = self.pool.take(n)
        ops: list[TruncateEvent | FreeEvent] = []
        for b in evicted:
            if not self._coverage[b]:
                continue
            ops += [self._cut_before(rid, b) for rid, table in list(self._retained.items()) if b in table]
        return new, evicted, tuple(ops)

    def _evict_over_cap(self) -> list[TruncateEvent | FreeEvent]:
        """While more than `retain_blocks` blocks are cached, evict the pool's next victim
        (`BlockPool.oldest_cached`): cut every retained prefix that holds it at that block (their later
        blocks that no one else holds go with it), and drop one that another now starts with."""
        ops: list[TruncateEvent | FreeEvent] = []
        while self._over_cap():
            b = self.pool.oldest_cached()  # one used once, while any is cached
            assert self._coverage[b], f"cached block {b} is held by no retained prefix"
            ops += [self._cut_before(rid, b) for rid, table in list(self._retained.items()) if b in table]
        return ops

    def _cut_before(self, rid: RetainedPrefix, block: int) -> TruncateEvent | FreeEvent:
        """Cut retained prefix `rid` before `block`, or drop it whole where another retained prefix holds
        what would be left (two chats' partial tails after one system prompt, say)."""
        table = self._retained[rid]
        keep = table.index(block)
        if keep and any(r != rid and t[:keep] == table[:keep] for r, t in self._retained.items()):
            keep = 0
        return self._cut_retained(rid, keep)

    def _over_cap(self) -> bool:
        return ((self.retain_blocks is not None and self.pool.num_cached > self.retain_blocks) or
                (self.retain_once_blocks is not None and self.pool.num_cached_once > self.retain_once_blocks))

    def _register_tail(self, seq: _Seq) -> int | None:
        """Per-sequence storage: index a freed sequence's last, partial block under the hash of its computed
        tokens, so that a retained prefix keeps them (to the token, as llama-server's slots keep a prompt:
        the same prompt again then computes its last token only, not up to a block). Full-block lookups
        never match it (their hashes cover `block_size` tokens); only `_partial_block` reads it, through the
        retained table. None where there is no such block or another sequence holds it too."""
        k, r = divmod(seq.num_computed, self.block_size)
        if not (self.per_sequence_storage and r and k < len(seq.block_ids) and len(seq.block_hashes) >= k):
            return None
        b = seq.block_ids[k]
        if b == NULL_BLOCK or self.pool.ref_count(b) != 1 or self.pool.block_hash(b) is not None:
            return None
        parent = seq.block_hashes[k - 1] if k else None
        start = k * self.block_size
        return b if self.pool.register(b, self._hash_fn(parent, tuple(seq.token_ids[start:start + r]))) else None

    def _registered_run(self, seq: _Seq) -> list[int]:
        """The leading blocks of `seq` that the cache indexes: what a retained prefix of it can keep.

        A block computed twice is indexed under its first copy. Where each sequence owns its storage
        (`adopt_retained`: llama.cpp's per-slot streams), the retained prefix's table names that copy
        and its own stream holds the tokens, so a prompt computed afresh beside a shared header is
        kept too; elsewhere the run stops at the first block that is not the cache's own copy. (Per
        slot, a prompt that was not kept cost the next run of the same chats a full prefill each: their
        misses took other chats' streams in turn, bench/server.py's `repeated` after `chat-header`.)"""
        run = []
        for b, h in zip(seq.block_ids[:seq.num_computed // self.block_size], seq.block_hashes):
            if self.pool.block_hash(b) != h:
                b = self.pool.lookup(h) if self.adopt_retained else None
                if b is None:
                    break
            run.append(b)
        return run

    def _cut_retained(self, rid: RetainedPrefix, keep: int) -> TruncateEvent | FreeEvent:
        """Keep the first `keep` blocks of a retained prefix (0: drop it); its other blocks that no
        one holds any more leave the cache."""
        table = self._retained[rid]
        gone = table[keep:]
        del table[keep:]
        for blk in gone:
            self._coverage[blk] -= 1
            if not self._coverage[blk]:
                del self._coverage[blk]
        self._forget_unheld(gone)
        if keep == 0:
            del self._retained[rid]
            del self._retained_tokens[rid]
            return FreeEvent(rid, tuple(gone), ())
        self._retained_tokens[rid] = self._retained_tokens[rid][:keep * self.block_size]
        return TruncateEvent(rid, keep * self.block_size, tuple(gone[::-1]), ())

    def _forget_unheld(self, blocks: Sequence[int]) -> list[int]:
        """Of `blocks`, unhash the cached ones that no retained prefix holds (per-sequence storage:
        their data is gone); returns those that stay cached."""
        kept = []
        for b in blocks:
            if self.pool.ref_count(b) or self.pool.block_hash(b) is None:
                continue
            if self._coverage[b] > 0 or not self.per_sequence_storage:
                kept.append(b)
            else:
                self.pool.forget(b)
        return kept

    def _get(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}; allocate it first") from None

    def _longest_cached_prefix(self, tokens: list[int]) -> tuple[list[BlockHash], list[int]]:
        """Hashes and blocks of the longest run of cached full blocks, capped at len(tokens) - 1
        tokens so that the last token is always computed (it yields the next token's logits)."""
        bs = self.block_size
        hashes: list[BlockHash] = []
        blocks: list[int] = []
        parent = None
        for i in range((len(tokens) - 1) // bs):
            h = self._hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            b = self.pool.lookup(h)
            if b is None:
                break
            hashes.append(h)
            blocks.append(b)
            parent = h
        return hashes, blocks

    def _reuse(self, source: SeqId | None, tokens: list[int], hits: list[int], extra: int) -> tuple[SeqId | None, bool]:
        """(source, adopted): where a new sequence's hit of `hits` blocks and `extra` tokens comes from.

        Only with `adopt_retained`, and a retained `source`, is there a choice (see its doc): most of
        the prompt or of the prefix in common, take it over; less, copy it (a stream copy) and keep
        it. But a copy needs a storage id, and where every id is in use the least recently used other
        prefix is dropped for it (`_free_storage_id`): if that one holds the hit too, it is taken over
        instead (the same hit, no copy, the same prefixes kept: llama-server's slots each hold a chat
        header, and a request takes the least recently used one and its header with it); if there is
        no other, the source is."""
        if not (self.adopt_retained and isinstance(source, RetainedPrefix)):
            return source, False
        num_cached = len(hits) * self.block_size + extra
        if 2 * num_cached >= min(len(tokens), len(self._retained_tokens[source])):
            return source, True
        if not self._storage_ids_full():
            return source, False
        victim = self._oldest_retained(keep=source)
        if victim is None:
            return source, True
        if (list(self._retained[victim][:len(hits)]) == hits  # (its kept tokens lie in its blocks)
                and tuple(self._retained_tokens[victim][:num_cached]) == tuple(tokens[:num_cached])):
            return victim, True
        return source, False

    def _storage_ids_full(self) -> bool:
        """Whether a new sequence's storage id (`max_storage_ids`) must come from a retained prefix."""
        return self.max_storage_ids is not None and len(self._seqs) + len(self._retained) >= self.max_storage_ids

    def _oldest_retained(self, keep: SeqId | None) -> RetainedPrefix | None:
        """The least recently used retained prefix other than `keep`: the next one a storage id drops."""
        return next((r for r in self._retained if r != keep), None)

    def _free_storage_id(self, keep: SeqId | None = None) -> list[FreeEvent]:
        """Drop least recently used retained prefixes (never `keep`) until a new sequence has a storage
        id within `max_storage_ids`."""
        ops: list[FreeEvent] = []
        while self._storage_ids_full():
            victim = self._oldest_retained(keep)
            if victim is None:
                raise ValueError(f"{len(self._seqs)} live sequences hold every one of the storage's "
                                 f"{self.max_storage_ids} ids; admit fewer")
            ops.append(self._cut_retained(victim, 0))
        return ops

    def _holders(self) -> Iterator[tuple[SeqId, list[int], int, Sequence[int]]]:
        """(id, block table, computed tokens, token ids) of every sequence whose storage may serve a
        prefix: live ones, then retained ones most recently used first. With `adopt_retained`,
        retained ones first (taking one over is free, copying from a live one is not) and least
        recently used first: callers keep the first of equal holders, and taking one over ends it
        beyond the hit, so of prompts that share only a chat header the oldest goes, not the one
        that just finished (which the same chat, sent again, would have found whole)."""
        live = ((sid, s.block_ids, s.num_computed, s.token_ids) for sid, s in self._seqs.items())
        order = self._retained.items() if self.adopt_retained else reversed(self._retained.items())
        kept = ((rid, t, len(self._retained_tokens[rid]), self._retained_tokens[rid]) for rid, t in order)
        return itertools.chain(kept, live) if self.adopt_retained else itertools.chain(live, kept)

    def _partial_block(self, tokens: list[int], hits: list[int]) -> tuple[SeqId | None, int]:
        """Per-sequence storage: (holder, m), a sequence (live, or a retained prefix) whose first blocks
        are `hits` and whose storage holds, computed, the next m tokens of `tokens` too, m as large as
        possible; (None, 0) if none. The block after the hits is not in the cache (only full blocks are),
        but a sequence's storage holds its cells token by token: a repeated prompt then computes its
        last token only, as llama-server's slots do, instead of up to a block of tokens.

        With `adopt_retained` the holder is taken over, which ends what it holds beyond the hit, so a
        few more tokens matched are not worth another prompt: the first holder (`_holders`: least
        recently used first) with any match is chosen, unless one matches the whole rest of the
        prompt. Prompts that share a chat header and the question's first words then take over the
        oldest kept prompt, not the one of their kind that finished last (bench/server.py's
        `repeated`: a request admitted one step after others took over what they had just kept)."""
        bs, k = self.block_size, len(hits)
        start = k * bs
        limit = min(bs, len(tokens) - 1 - start)  # the last prompt token is always computed
        if limit <= 0:
            return None, 0
        want = tokens[start:start + limit]
        best, best_m = None, 0
        for sid, table, num_computed, held in self._holders():
            if num_computed <= start or table[:k] != hits or len(table) <= k or table[k] == NULL_BLOCK:
                continue
            m, stop = 0, min(limit, num_computed - start)
            while m < stop and held[start + m] == want[m]:
                m += 1
            if m == limit or (m > best_m and not (self.adopt_retained and best_m)):
                best, best_m = sid, m
                if m == limit:
                    break
        return best, best_m

    def _prefix_source(self, hits: list[int]) -> tuple[SeqId | None, int]:
        """The live sequence that holds, computed and whole, the longest run of `hits`, and that
        run's length in blocks. A sequence truncated into a shared block holds it only in part, so
        holding the block id is not enough."""
        best, best_n = None, 0
        for sid, table, num_computed, _ in self._holders():
            limit = min(len(hits), num_computed // self.block_size)
            n = 0
            while n < limit and table[n] == hits[n]:
                n += 1
            if n > best_n:
                best, best_n = sid, n
                if n == len(hits):
                    break
        return best, best_n

    def _behind_window(self, seq: _Seq) -> list[int]:
        """Indices of held blocks wholly before the window of the next query (position
        len(token_ids)): block i ends at (i + 1) * block_size - 1 < len - W + 1."""
        if self.sliding_window is None:
            return []
        first_needed = len(seq.token_ids) - self.sliding_window + 1
        n = max(first_needed, 0) // self.block_size
        return [i for i in range(min(n, len(seq.block_ids))) if seq.block_ids[i] != NULL_BLOCK]

    def _num_reclaimable(self, seq: _Seq, behind: list[int]) -> int:
        """Of the blocks behind the window (`_behind_window`), those dropping them frees: the ones
        this sequence alone holds."""
        return sum(self.pool.ref_count(seq.block_ids[i]) == 1 for i in behind)

    def _append_cost(self, seq: _Seq, num_new: int) -> tuple[int, bool]:
        """(blocks to take, whether the first of them is a copy-on-write of the partial last block)."""
        start = len(seq.token_ids)
        last = seq.block_ids[-1] if seq.block_ids else None
        cow = (num_new > 0 and start % self.block_size != 0 and
               (self.pool.ref_count(last) > 1 or self.pool.block_hash(last) is not None))
        grow = _cdiv(start + num_new, self.block_size) - len(seq.block_ids)
        return grow + cow, cow

    def _slots(self, seq: _Seq, start: int, stop: int) -> tuple[int, ...]:
        bs, table = self.block_size, seq.block_ids
        return tuple(table[p // bs] * bs + p % bs for p in range(start, stop))
