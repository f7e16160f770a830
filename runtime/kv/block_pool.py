"""The physical side of the paged KV cache: a pool of fixed-size blocks, their reference counts, the
prefix-cache index, and the free queue that doubles as the LRU of cached blocks.

A block is only an id here (0 .. num_blocks-1); the storage behind it (a tensor pool, llama.cpp
cells) lives elsewhere. Each block is in exactly one of three states:

    used     ref_count > 0, held by at least one sequence's block table
    cached   ref_count == 0, still registered under a content hash, so a later sequence can reuse it
    empty    ref_count == 0, no hash: its contents are worthless

The free queue holds every block with ref_count == 0 (cached and empty), in eviction order: the
head is taken first. Taking a cached block evicts it (its hash entry is dropped). Blocks are
released to the tail in the order the caller gives, so the least recently freed block is evicted
first; empty blocks go to the head instead, because reusing them destroys nothing. (vLLM v1 sends
every freed block to the tail; placing empty ones at the head only spares cached blocks.)

Cached blocks that no second sequence has used since they were computed (a request's own question
and answer) are evicted before those that one has (a shared system prompt): a block becomes *reused*
when `touch` takes a reference to it while it holds a hash (a prefix hit, a fork). Without that a
finished request's unique tail, the most recently used block, pushes out a system prompt that the
next request would hit, whenever the cache is small against the traffic (a retained-prefix budget).
This is the two-queue idea of 2Q (Johnson and Shasha, 1994) and SGLang's LFU radix eviction cut to
two classes; within a class the order stays vLLM's LRU, so a stale system prompt still ages out.
A block's parent is used whenever it is and released no earlier, so no block is evicted before a
block that extends it. So the queue is every empty block, then the cached ones used once, then the
reused ones, each least recently used first; `oldest_cached` is the one the next eviction takes.

Content hashes chain: a full block's hash covers its parent block's hash and its own token ids, so
equal hashes mean equal prefixes, and a block is reused only at the same block index it was
computed at, which keeps its positions (and RoPE) valid.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from edgefinfer.errors import UserError

BlockHash = Hashable
# (parent block's hash or None for the first block, this block's token ids) -> hash
BlockHashFn = Callable[[BlockHash | None, tuple[int, ...]], BlockHash]


def sha256_block_hash(parent: BlockHash | None, token_ids: tuple[int, ...]) -> bytes:
    """A collision-resistant hash, stable across processes and Python versions (the default).

    Encoding: a tag byte (0 = no parent, 1 = parent follows), the 32-byte parent digest, then each
    token id as a little-endian int64. The fixed widths make the encoding unambiguous.
    """
    h = hashlib.sha256()
    if parent is None:
        h.update(b"\x00")
    else:
        assert isinstance(parent, bytes) and len(parent) == 32, "parent must come from sha256_block_hash"
        h.update(b"\x01")
        h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def builtin_block_hash(parent: BlockHash | None, token_ids: tuple[int, ...]) -> int:
    """Python's built-in hash of (parent, tokens): several times faster than sha256.

    Tuples of ints hash the same in every process (PYTHONHASHSEED only salts str/bytes), but the
    value is 64 bits and not collision-resistant: two different prefixes that collide would
    silently share KV. Use it for trusted single-tenant workloads and tests, not a public server.
    """
    return hash((parent, token_ids))


class BlockPool:
    """Reference-counted blocks, the hash -> block index, and the free/LRU queue.

    Mutating methods assume the caller already checked that enough blocks are free; they raise
    AssertionError on misuse (a bug in the caller, not a user error).
    """

    def __init__(self, num_blocks: int, *, cache_freed_blocks: bool = True):
        if num_blocks < 1:
            raise UserError(f"num_blocks must be at least 1, got {num_blocks}; give the KV cache more blocks")
        self.num_blocks = num_blocks
        # False: a block loses its hash as soon as no sequence holds it. For storages that keep data
        # per sequence (llama.cpp): once the last sequence is gone, so is the data.
        self.cache_freed_blocks = cache_freed_blocks
        self._ref_counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._hash_to_block: dict[BlockHash, int] = {}
        # The free queue as two ordered sets of blocks with ref_count 0, taken from the head: the empty
        # ones, then the cached ones (least recently used first). OrderedDict gives O(1) pop-front,
        # push-back, push-front and removal from the middle (a prefix hit).
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._once: OrderedDict[int, None] = OrderedDict()  # cached, never reused
        self._reused: OrderedDict[int, None] = OrderedDict()  # cached, touched while hashed
        self._is_reused = [False] * num_blocks  # since its hash was registered

    # ---------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: empty ones and cached ones (taking those evicts them)."""
        return len(self._empty) + len(self._once) + len(self._reused)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks that still hold a hash (reusable until evicted)."""
        return len(self._once) + len(self._reused)

    @property
    def num_cached_once(self) -> int:
        """Cached blocks that no second sequence has used (evicted first)."""
        return len(self._once)

    def oldest_cached(self) -> int | None:
        """The cached block the next eviction takes (see the module doc), or None."""
        return next(iter(self._once or self._reused), None)

    def is_reused(self, block_id: int) -> bool:
        """Whether a second sequence took this block since it was registered (see the module doc)."""
        return self._is_reused[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hashes[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block registered under `block_hash`, used or cached, or None."""
        return self._hash_to_block.get(block_hash)

    def free_block_ids(self) -> list[int]:
        """Blocks with ref_count 0 in the order they would be taken (the eviction order)."""
        return [*self._empty, *self._once, *self._reused]

    def cached_items(self) -> list[tuple[BlockHash, int]]:
        """Every (hash, block) registration, used and cached."""
        return list(self._hash_to_block.items())

    # ---------------------------------------------------------------- mutations
    def take(self, n: int) -> tuple[list[int], list[int]]:
        """Take `n` blocks from the head of the free queue, each with ref_count 1.

        Returns (blocks, evicted): `evicted` lists, in order, the taken blocks that were cached and
        have just lost their hash entry (their old contents are dead).
        """
        assert n <= self.num_free, f"take({n}) with {self.num_free} free blocks"
        blocks, evicted = [], []
        for _ in range(n):
            if self._empty:
                b, _ = self._empty.popitem(last=False)
            else:
                b, _ = (self._once or self._reused).popitem(last=False)
                self.unregister(b)
                evicted.append(b)
            self._ref_counts[b] = 1
            blocks.append(b)
        return blocks, evicted

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix hit or a fork); cached blocks leave the queue."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._queue_of(b)[b]
            if self._hashes[b] is not None:
                self._is_reused[b] = True
            self._ref_counts[b] += 1

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference from each block, in the order given.

        Blocks that reach ref_count 0 join the free queue: cached ones at the tail in the given
        order (so the first given is evicted first), empty ones at the head in the given order.
        Returns the released blocks that stayed cached.
        """
        kept, emptied = [], []
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"block {b} released more often than it was taken"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] > 0:
                continue
            if self._hashes[b] is not None and not self.cache_freed_blocks:
                self.unregister(b)
            if self._hashes[b] is None:
                emptied.append(b)
            else:
                self._queue_of(b)[b] = None
                kept.append(b)
        for b in reversed(emptied):
            self._empty[b] = None
            self._empty.move_to_end(b, last=False)
        return kept

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Index a full, computed block under its content hash. Returns whether it was indexed.

        A block already holding this hash (a prefix hit, a forked block) is left alone. If another
        block already holds the same content (two identical prompts computed independently), the
        first registration wins and this block stays unhashed; it is freed as empty later.
        """
        current = self._hashes[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} re-registered under a different hash"
            return False
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def forget(self, block_id: int) -> None:
        """A cached block's contents are gone (its storage dropped them): unhash it and move it to the
        head of the free queue, where an empty block belongs."""
        assert self._ref_counts[block_id] == 0 and self._hashes[block_id] is not None, \
            f"block {block_id} is not cached"
        block_hash = self._hashes[block_id]
        del self._hash_to_block[block_hash]
        del self._queue_of(block_id)[block_id]
        self._hashes[block_id] = None
        self._is_reused[block_id] = False
        self._empty[block_id] = None
        self._empty.move_to_end(block_id, last=False)

    def unregister(self, block_id: int) -> None:
        """Drop the hash entry of a block that is in use or was just taken (its contents change)."""
        block_hash = self._hashes[block_id]
        assert block_hash is not None, f"block {block_id} is not registered"
        assert block_id not in self._queue_of(block_id), f"block {block_id} is cached; take it instead of unregistering"
        del self._hash_to_block[block_hash]
        self._hashes[block_id] = None
        self._is_reused[block_id] = False

    def _queue_of(self, block_id: int) -> OrderedDict[int, None]:
        """The part of the free queue a block with ref_count 0 belongs in, by its state."""
        if self._hashes[block_id] is None:
            return self._empty
        return self._reused if self._is_reused[block_id] else self._once
