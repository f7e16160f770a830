"""The paged-KV manager: block ids, ref counts, prefix hits, copy-on-write, eviction order, atomic
"no room", truncation, and a randomized run checked against fake storages after every operation.

Tiny pools (block_size 4, about ten blocks) so that every block id and eviction can be asserted.
"""

from __future__ import annotations

import random

import pytest

from edgefinfer.errors import UserError
from edgefinfer.runtime.kv.block_pool import builtin_block_hash, sha256_block_hash
from edgefinfer.runtime.kv.paged_manager import NULL_BLOCK, CopyOp, NoRoom, PagedKVManager, RetainedPrefix, SlotPlan
from edgefinfer.runtime.kv.storage import KVStorage

BS = 4
P = list(range(8))  # a two-block prompt prefix


class RecordingHash:
    """Wraps a hash function and remembers what each hash covers (to check cached contents)."""

    def __init__(self, fn):
        self.fn, self.seen = fn, {}

    def __call__(self, parent, token_ids):
        h = self.fn(parent, token_ids)
        assert self.seen.setdefault(h, (parent, token_ids)) == (parent, token_ids), "hash collision"
        return h


class BlockStorage:
    """A tensor pool with one token id per slot instead of keys/values."""

    def __init__(self, num_blocks: int):
        self.data = [[None] * BS for _ in range(num_blocks)]
        self.copies: list[CopyOp] = []

    def copy_blocks(self, ops):
        for op in ops:
            self.data[op.dst][:op.num_tokens] = self.data[op.src][:op.num_tokens]
        self.copies.extend(ops)

    def share_prefix(self, seq_id, source_id, block_ids, num_tokens): pass
    def fork(self, parent_id, child_id, num_tokens): pass
    def truncate(self, seq_id, num_tokens): pass
    def release(self, seq_id): pass
    def retain(self, seq_id, retained_id, num_tokens): raise AssertionError("a block pool caches by itself")
    def adopt(self, retained_id, seq_id, num_tokens): raise AssertionError("a block pool retains nothing")

    def forward(self, plan: SlotPlan, new_tokens):
        for slot, tok in zip(plan.slot_mapping, new_tokens, strict=True):
            self.data[slot // BS][slot % BS] = tok

    def tokens_of(self, m: PagedKVManager, seq) -> list:
        """The tokens the sequence still stores (from its first position a sliding window kept)."""
        table = m.block_table(seq)
        return [self.data[table[p // BS]][p % BS] for p in range(m.first_stored_position(seq), m.num_tokens(seq))]


class LlamaStorage:
    """llama.cpp's per-sequence cells, following the mapping documented in storage.py: a cell is
    (position, token, the sequence ids that tag it), so shared cells are stored once, as in a
    unified llama.cpp cache, and `len(cells)` is the memory really in use."""

    def __init__(self, num_blocks: int):
        self.cells: dict[int, tuple[int, int, set]] = {}  # cell id -> (pos, token, tags)
        self._next = 0

    def _of(self, seq) -> dict[int, int]:
        """pos -> cell id of the cells tagged `seq`."""
        return {c[0]: i for i, c in self.cells.items() if seq in c[2]}

    def _untag(self, seq, keep_below: int = 0) -> None:
        for i, (pos, _, tags) in list(self.cells.items()):
            if seq in tags and pos >= keep_below:
                tags.discard(seq)
                if not tags:
                    del self.cells[i]

    def copy_blocks(self, ops): pass  # cells are shared by tag; new tokens get new cells

    def share_prefix(self, seq_id, source_id, block_ids, num_tokens):  # seq_cp(src, dst, 0, n)
        src = self._of(source_id)
        assert all(p in src for p in range(num_tokens)), "the source does not hold the prefix"
        for p in range(num_tokens):
            self.cells[src[p]][2].add(seq_id)

    def fork(self, parent_id, child_id, num_tokens):  # seq_cp(parent, child, -1, -1)
        for i in self._of(parent_id).values():
            self.cells[i][2].add(child_id)

    def truncate(self, seq_id, num_tokens):  # seq_rm(seq, n, -1)
        self._untag(seq_id, num_tokens)

    def release(self, seq_id):  # seq_rm(seq, -1, -1)
        self._untag(seq_id)

    def retain(self, seq_id, retained_id, num_tokens):  # the slot lives on under another name
        for _, _, tags in self.cells.values():
            if seq_id in tags:
                tags.discard(seq_id)
                tags.add(retained_id)
        self._untag(retained_id, num_tokens)

    def adopt(self, retained_id, seq_id, num_tokens):  # the retained slot serves a new sequence
        assert not self._of(seq_id), "the adopting sequence already has cells"
        self.retain(retained_id, seq_id, num_tokens)

    def forward(self, plan: SlotPlan, new_tokens):
        mine = self._of(plan.seq_id)
        for pos, tok in enumerate(new_tokens, plan.start_pos):
            assert pos not in mine, f"llama_decode would duplicate position {pos}"
            self.cells[self._next] = (pos, tok, {plan.seq_id})
            self._next += 1

    def tokens_of(self, m: PagedKVManager, seq) -> list:
        cells = self._of(seq)
        return [self.cells[cells[p]][1] if p in cells else None for p in range(max(cells, default=-1) + 1)]


class Driver:
    """Runs manager calls and makes the storage follow them, as a scheduler would."""

    def __init__(self, num_blocks, hash_fn, per_sequence_storage=False, **kw):
        self.hash = RecordingHash(hash_fn)
        self.m = PagedKVManager(num_blocks, BS, hash_fn=self.hash, per_sequence_storage=per_sequence_storage, **kw)
        self.storage = (LlamaStorage if per_sequence_storage else BlockStorage)(num_blocks)
        assert isinstance(self.storage, KVStorage)

    def _run(self, plan, new_tokens):
        if plan:
            plan.apply_to(self.storage)
            self.storage.forward(plan, new_tokens[len(new_tokens) - plan.num_new_tokens:])
        return plan

    def allocate(self, seq, tokens):
        return self._run(self.m.allocate(seq, tokens), tokens)

    def append(self, seq, tokens):
        return self._run(self.m.append(seq, tokens), tokens)

    def fork(self, parent, child):
        return self.m.fork(parent, child).apply_to(self.storage)

    def truncate(self, seq, n):
        event = self.m.truncate(seq, n)
        event.apply_to(self.storage)
        return event

    def free(self, seq):
        event = self.m.free(seq)
        event.apply_to(self.storage)
        if self.m.retain_prefixes and self.m.retain_blocks is not None:  # the caps hold after every free
            assert self.m.stats().num_cached <= self.m.retain_blocks
        if self.m.retain_prefixes and self.m.retain_once_blocks is not None:
            assert self.m.pool.num_cached_once <= self.m.retain_once_blocks
        return event


def refs(m: PagedKVManager) -> list[int]:
    return [m.pool.ref_count(b) for b in range(m.num_blocks)]


def snapshot(m: PagedKVManager):
    seqs = {s: (m.block_table(s), m.token_ids(s), m.num_computed_tokens(s)) for s in m.seq_ids()}
    return (seqs, refs(m), m.pool.free_block_ids(), sorted(m.pool.cached_items(), key=lambda x: x[1]), m.stats())


hash_fns = pytest.mark.parametrize("hash_fn", [sha256_block_hash, builtin_block_hash], ids=["sha256", "builtin"])


@hash_fns
def test_scenario_share_fork_evict_no_room(hash_fn):
    d = Driver(10, hash_fn)
    m, st = d.m, d.storage

    # Two sequences with a shared two-block prefix.
    a = d.allocate("A", P + [100, 101])
    assert (a.block_ids, a.slot_mapping, a.num_cached_tokens) == ((0, 1, 2), tuple(range(10)), 0)
    assert m.mark_computed("A") == 2  # blocks 0 and 1 are full; block 2 is not
    b = d.allocate("B", P + [200])
    assert (b.block_ids, b.cached_block_ids, b.num_cached_tokens, b.slot_mapping) == ((0, 1, 3), (0, 1), 8, (12,))
    assert refs(m)[:4] == [2, 2, 1, 1]

    # A prompt of exactly two full blocks reuses only one: its last token must be computed.
    c = d.allocate("C", P)
    assert (c.block_ids, c.num_cached_tokens, c.slot_mapping) == ((0, 4), 4, (16, 17, 18, 19))
    assert m.mark_computed("C") == 0  # block 4 repeats block 1's content: the first registration wins
    assert d.free("C").cached_block_ids == ()
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 8, 9]  # the empty block goes first

    # Decode fills A's block 2; computing it registers its chained hash.
    assert d.append("A", [102]).slot_mapping == (10,)
    assert d.append("A", [103]).slot_mapping == (11,)
    assert m.pool.block_hash(2) is None
    assert m.mark_computed("A") == 1
    h0 = hash_fn(None, tuple(P[:4]))
    h2 = hash_fn(hash_fn(h0, tuple(P[4:])), (100, 101, 102, 103))
    assert m.pool.lookup(h2) == 2 and m.pool.block_hash(2) == h2
    plan = d.append("A", [104])
    assert (plan.block_ids, plan.new_block_ids, plan.slot_mapping) == ((0, 1, 2, 4), (4,), (16,))
    m.mark_computed("A")

    # Fork shares everything, the partial block 4 too; the first writer into it copies.
    d.fork("A", "A2")
    assert refs(m)[:6] == [3, 3, 2, 1, 2, 0]
    cow = d.append("A2", [300])
    assert cow.copy_ops == (CopyOp(src=4, dst=5, num_tokens=1),)
    assert (cow.block_ids, cow.slot_mapping) == ((0, 1, 2, 5), (21,))
    in_place = d.append("A", [105])  # A is block 4's only holder now
    assert (in_place.copy_ops, in_place.slot_mapping) == ((), (17,))
    assert st.data[4][:2] == [104, 105] and st.data[5][:2] == [104, 300]

    # Freeing releases tail first: cached blocks join the LRU tail as 2, 1, 0; empty ones go first.
    d.free("B")
    assert m.pool.free_block_ids() == [3, 6, 7, 8, 9]
    d.free("A")
    assert m.pool.free_block_ids() == [4, 3, 6, 7, 8, 9]
    assert d.free("A2").cached_block_ids == (2, 1, 0)
    assert m.pool.free_block_ids() == [5, 4, 3, 6, 7, 8, 9, 2, 1, 0]
    assert refs(m) == [0] * 10
    s = m.stats()
    assert (s.num_used, s.num_free, s.num_cached) == (0, 10, 3)

    # A prompt whose three full blocks are cached hits all of them.
    dd = d.allocate("D", P + [100, 101, 102, 103, 7])
    assert (dd.block_ids, dd.num_cached_tokens, dd.new_block_ids) == ((0, 1, 2, 5), 12, (5,))
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (10 + 9 + 8 + 13, 0 + 8 + 4 + 12)
    assert s.hit_rate == pytest.approx(24 / 40)

    # Under pressure, cached blocks are evicted least recently freed first: the end of D's prefix first.
    d.free("D")
    e = d.allocate("E", list(range(1000, 1028)))  # seven blocks: all the empty ones
    assert (e.block_ids, e.evicted_block_ids) == ((5, 4, 3, 6, 7, 8, 9), ())
    f = d.allocate("F", list(range(2000, 2008)))
    assert (f.block_ids, f.evicted_block_ids) == ((2, 1), (2, 1))
    assert m.pool.lookup(h2) is None and m.pool.lookup(h0) == 0 and m.stats().num_cached == 1

    # Out of blocks: NoRoom, and nothing changed (one free block left, cached block 0).
    before = snapshot(m)
    assert m.allocate("G", list(range(3000, 3009))) == NoRoom(num_blocks_needed=3, num_blocks_free=1)
    assert m.append("E", [1, 2, 3, 4, 5]) == NoRoom(2, 1)
    # A hit on the cached block 0 takes it off the free queue as well: 1 new + 1 hit > 1 free.
    assert m.allocate("G", P[:4] + [9]) == NoRoom(2, 1)
    assert not m.allocate("G", P[:4] + [9])
    assert (m.can_allocate(4), m.can_allocate(5), m.can_append("E", 4), m.can_append("E", 5)) == (
        True, False, True, False)
    assert snapshot(m) == before and "G" not in m

    # Free everything: the pool is whole again and no reference is left.
    d.free("E"), d.free("F")
    s = m.stats()
    assert (s.num_used, s.num_free, s.num_cached, s.num_blocks) == (0, 10, 1, 10)
    assert refs(m) == [0] * 10 and sorted(m.pool.free_block_ids()) == list(range(10))
    assert list(m.seq_ids()) == []


@hash_fns
def test_truncate_rejected_draft_tokens(hash_fn):
    d = Driver(8, hash_fn)
    m, st = d.m, d.storage
    d.allocate("S", [1, 2, 3, 4, 5, 6])
    m.mark_computed("S")
    spec = d.append("S", [7, 70, 71, 72, 73])  # the sampled token and four draft tokens
    assert (spec.block_ids, spec.slot_mapping) == ((0, 1, 2), (6, 7, 8, 9, 10))
    assert m.mark_computed("S") == 1  # block 1; block 2 holds three tokens
    h1 = m.pool.block_hash(1)
    assert h1 == hash_fn(hash_fn(None, (1, 2, 3, 4)), (5, 6, 7, 70))

    # One draft token rejected at position 7: block 1 is partial again and leaves the cache.
    ev = d.truncate("S", 7)
    assert (ev.dropped_block_ids, ev.cached_block_ids) == ((2,), ())
    assert m.block_table("S") == (0, 1) and m.num_computed_tokens("S") == 7
    assert m.pool.block_hash(1) is None and m.pool.lookup(h1) is None and m.pool.block_hash(0) is not None
    assert m.pool.free_block_ids()[0] == 2
    bonus = d.append("S", [80])
    assert (bonus.slot_mapping, bonus.copy_ops) == ((7,), ())  # sole holder, unhashed: in place
    assert m.mark_computed("S") == 1 and m.pool.block_hash(1) == hash_fn(m.pool.block_hash(0), (5, 6, 7, 80))
    assert st.tokens_of(m, "S") == [1, 2, 3, 4, 5, 6, 7, 80]

    # Truncating into a block another sequence still reads whole: it keeps its hash, and it stays
    # immutable even once this sequence is its last holder, so the next append copies it.
    d.fork("S", "T")
    d.append("S", [90, 91])
    d.truncate("S", 6)
    assert m.pool.block_hash(1) is not None and refs(m)[:3] == [2, 2, 0]
    d.free("T")
    cow = d.append("S", [92])
    assert cow.copy_ops == (CopyOp(src=1, dst=cow.block_ids[1], num_tokens=2),)
    assert st.tokens_of(m, "S") == [1, 2, 3, 4, 5, 6, 92]
    assert st.data[1] == [5, 6, 7, 80] and m.stats().num_cached == 1  # block 1 still serves its hash

    # Truncating to a block boundary or to nothing.
    assert d.truncate("S", 4).dropped_block_ids == (cow.block_ids[1],)
    assert m.block_table("S") == (0,) and m.pool.block_hash(0) is not None
    assert d.truncate("S", 0).dropped_block_ids == (0,) and m.block_table("S") == ()
    assert d.append("S", [5]).block_ids != ()
    d.free("S")
    assert refs(m) == [0] * 8


@hash_fns
def test_per_sequence_storage_hits_only_live_computed_holders(hash_fn):
    d = Driver(10, hash_fn, per_sequence_storage=True)
    m, st = d.m, d.storage
    d.allocate("A", P + [1])
    assert d.allocate("X", P + [2]).num_cached_tokens == 0  # A is not computed yet
    m.mark_computed("A")
    b = d.allocate("B", P + [3])
    assert (b.num_cached_tokens, b.prefix_source) == (8, "A")
    assert st.tokens_of(m, "B") == P + [3]

    # A sequence truncated into block 1 holds it only in part: block 0 as a hit, then its 2 computed
    # tokens of block 1 token by token (C's own block 1 is new).
    m.mark_computed("B")
    d.fork("B", "T")
    d.truncate("T", 6)
    d.free("A"), d.free("B"), d.free("X")
    c = d.allocate("C", P + [4])
    assert (c.num_cached_tokens, c.prefix_source, c.cached_block_ids) == (6, "T", (m.block_table("T")[0],))
    assert c.block_ids[1] != m.block_table("T")[1] and c.slot_mapping[0] == c.block_ids[1] * 4 + 2
    assert st.tokens_of(m, "C") == P + [4]
    d.free("C"), d.free("T")
    s = m.stats()
    assert (s.num_used, s.num_cached) == (0, 0) and m.pool.cached_items() == []  # data died with its holders


@hash_fns
def test_retained_prefix_outlives_its_sequence_until_evicted(hash_fn):
    """A per-sequence storage keeps a freed sequence's computed tokens (vLLM's prefix cache, for
    llama.cpp, to the token as llama-server's slots): a later prompt hits them, its partial last block
    included, a redundant one is not kept twice, eviction cuts them tail first."""
    d = Driver(8, hash_fn, per_sequence_storage=True, retain_prefixes=2)
    m, st = d.m, d.storage
    d.allocate(0, P + [8])  # blocks 0, 1 full, block 2 partial
    m.mark_computed(0)
    ev = d.free(0)
    rid = ev.retained_as
    assert (ev.retained_tokens, m.retained()) == (9, {rid: (0, 1, 2)})
    assert st.tokens_of(m, rid) == P + [8] and len(st.cells) == 9  # the partial block's cell stays too
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0] and m.stats().num_cached == 3

    # The partial block serves the next prompt to the token: only its own last token is computed.
    hit = d.allocate(1, P + [8, 9])
    assert (hit.num_cached_tokens, hit.prefix_source, hit.block_ids, hit.slot_mapping) == (9, rid, (0, 1, 3), (13,))
    assert st.tokens_of(m, 1) == P + [8, 9] and len(st.cells) == 10  # the prefix is stored once
    m.mark_computed(1)
    rid1 = d.free(1).retained_as  # its tail differs: kept beside rid, over the same two blocks
    assert m.retained() == {rid: (0, 1, 2), rid1: (0, 1, 3)} and len(st.cells) == 10

    # The same prompt as sequence 0: its last token is computed again (the logits of the next one);
    # what it would keep, rid holds already.
    again = d.allocate(2, P + [8])
    assert (again.num_cached_tokens, again.block_ids) == (8, (0, 1, 4))
    m.mark_computed(2)
    assert d.free(2).retained_as is None
    assert m.retained() == {rid: (0, 1, 2), rid1: (0, 1, 3)}

    # Four fresh blocks take the empty ones; the next two evict the tails first (rid1's, then rid's):
    # rid1 would be left holding what rid holds, so it goes whole.
    d.allocate(3, list(range(100, 116)))
    plan = d.allocate(4, [50, 51, 52, 53, 54, 55, 56, 57])
    assert plan.evicted_block_ids == (3, 2)
    assert [(type(op).__name__, op.seq_id) for op in plan.retained_ops] == [("FreeEvent", rid1), ("TruncateEvent", rid)]
    assert plan.retained_ops[1].num_tokens == 8
    assert m.retained() == {rid: (0, 1)} and st.tokens_of(m, rid) == P and len(st.cells) == 32
    plan = d.allocate(5, [60, 61, 62, 63, 64, 65, 66, 67])
    assert plan.evicted_block_ids == (1, 0) and m.retained() == {} and st.tokens_of(m, rid) == []
    assert m.stats().num_retained == 0


def test_per_slot_streams_take_over_retained_prefixes():
    """adopt_retained with max_storage_ids (llama.cpp's per-slot streams, as llama-server's slots): a hit
    on a retained prefix takes its storage over instead of copying it, to the token; a new sequence
    beyond the ids drops the least recently used."""
    d = Driver(32, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True,
               max_storage_ids=2)
    m, st = d.m, d.storage
    d.allocate("A", P + [1, 2, 3])
    m.mark_computed("A")
    d.free("A")  # retained: every computed token, the partial last block's too
    (ra, table), = m.retained().items()
    assert len(table) == 3 and st.tokens_of(m, ra) == P + [1, 2, 3]

    b = d.allocate("B", P + [1, 9])  # 9 tokens hit, to the token: taken over
    assert (b.adopted, b.prefix_source, b.num_cached_tokens) == (True, ra, 9)
    assert m.retained() == {} and st.tokens_of(m, "B") == P + [1, 9]
    m.mark_computed("B")
    d.free("B")
    (rb, _), = m.retained().items()

    c = d.allocate("C", P[:4] + [7, 7, 7, 7, 7])  # 4 of rb's 10 tokens and of its own 9: under half,
    assert (c.adopted, c.prefix_source, c.num_cached_tokens) == (False, rb, 4)  # copied, rb kept
    assert st.tokens_of(m, "C") == P[:4] + [7] * 5 and st.tokens_of(m, rb) == P + [1, 9]
    m.mark_computed("C")
    d.free("C")  # its first block is block 0, shared: C's table names it, its own stream holds a copy
    rb_, rc = m.retained()
    assert rb_ == rb and st.tokens_of(m, rb) == P + [1, 9] and st.tokens_of(m, rc) == P[:4] + [7] * 5
    assert m.retained()[rc][0] == m.retained()[rb][0] == 0
    again = d.allocate("C2", P[:4] + [7, 7, 7, 7, 7])  # the same prompt again: all but its last token
    assert (again.adopted, again.prefix_source, again.num_cached_tokens) == (True, rc, 8)
    d.free("C2")
    rc = list(m.retained())[-1]

    # 4 of its own 5 tokens: over half, taken over; of the two equal holders, the least recently used
    e = d.allocate("E", P[:4] + [5])  # (taking one over ends the rest of what it holds)
    assert e.adopted and e.prefix_source == rb and e.num_cached_tokens == 4
    d.free("E")  # its one block starts rc's table: nothing new to keep
    (re, _), = m.retained().items()
    assert re == rc and st.tokens_of(m, re) == P[:4] + [7] * 4

    # ids: two live sequences use both; a new one beyond them drops the least recently used prefix.
    d.allocate("F", [9, 9, 9, 9, 9, 9, 9, 9, 1])
    m.mark_computed("F")
    g = d.allocate("G", [8, 8, 8, 8, 8, 8, 8, 8, 1])  # F and E's prefix hold both ids: E's goes
    assert [op.seq_id for op in g.retained_ops] == [re] and m.retained() == {}
    m.mark_computed("G")
    d.free("F"), d.free("G")
    rf, rg = m.retained()
    h = d.allocate("H", [6, 6, 6, 6, 6])  # no hit: needs an id, the least recently used (F's) goes
    assert not h.adopted and h.num_cached_tokens == 0 and list(m.retained()) == [rg]
    assert [type(op).__name__ for op in h.retained_ops] == ["FreeEvent"] and h.retained_ops[0].seq_id == rf
    short = d.allocate("S", [8, 8, 8, 8, 2])  # 4 of rg's 8 tokens: half, taken over (ids: H + S)
    assert short.adopted and m.retained() == {}
    d.free("S"), d.free("H")
    tiny = d.allocate("T", [6, 6, 6, 6, 6, 6, 6, 6, 6])  # H's computed nothing: no hit at all
    assert tiny.num_cached_tokens == 0
    d.free("T")


def test_a_similar_prompt_takes_over_the_oldest_kept_prompt_not_the_closest():
    """Taking a kept prompt over ends it beyond the hit, so of the prompts that share a chat header, a
    request that completes none of them takes the least recently used, even where a newer one matches
    a token more; the newer chat, sent again, still finds all of itself."""
    d = Driver(32, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True)
    m = d.m
    header = [1, 2, 3, 4, 5, 6]  # a whole block and two tokens
    old, recent = header + [50, 51, 52], header + [9, 8, 8]
    d.allocate("A", old)
    m.mark_computed("A")
    d.allocate("B", recent)
    m.mark_computed("B")
    ro, rr = d.free("A").retained_as, d.free("B").retained_as
    n = d.allocate("N", header + [9, 7, 7])  # 6 tokens in common with `old`, 7 with `recent`
    assert (n.adopted, n.prefix_source, n.num_cached_tokens) == (True, ro, 6)
    again = d.allocate("R", recent)
    assert (again.adopted, again.prefix_source, again.num_cached_tokens) == (True, rr, 8)


def test_a_hit_on_little_of_a_retained_prefix_is_copied_not_taken_over():
    """Under half of the new prompt and of what the retained prefix holds: the hit is copied (a chat
    header is not computed again), the prefix kept whole."""
    d = Driver(32, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True)
    m, st = d.m, d.storage
    long = list(range(20, 40))
    d.allocate("A", P[:4] + long)  # 24 tokens: six whole blocks retained
    m.mark_computed("A")
    d.free("A")
    (ra, table), = m.retained().items()
    other = list(range(50, 60))
    b = d.allocate("B", P[:4] + other)  # its first block only: 4 of its 14 tokens and of ra's 24, copied
    assert (b.adopted, b.prefix_source, b.num_cached_tokens, list(m.retained())) == (False, ra, 4, [ra])
    assert b.cached_block_ids == (table[0],) and b.start_pos == 4
    assert st.tokens_of(m, ra) == P[:4] + long and st.tokens_of(m, "B") == P[:4] + other
    d.free("B")
    c = d.allocate("C", P[:4] + [1, 2])  # 4 of its 6 tokens: most of the prompt, taken over
    assert (c.adopted, c.num_cached_tokens) == (True, 4) and st.tokens_of(m, "C") == P[:4] + [1, 2]


def test_a_little_hit_takes_the_prefix_over_where_its_storage_id_is_the_only_one_left():
    """A copy needs a storage id of its own; where only dropping the source would free one (llama.cpp's
    per-slot streams all in use), the source is taken over instead of dropped and computed again."""
    d = Driver(32, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True,
               max_storage_ids=2)
    m = d.m
    d.allocate("L", [9] * 8 + [1])  # a live sequence holds one id
    d.allocate("A", P[:4] + list(range(20, 40)))
    m.mark_computed("A")
    ra = d.free("A").retained_as
    b = d.allocate("B", P[:4] + list(range(50, 60)))  # 4 of 14: under half, but ra holds the other id
    assert (b.adopted, b.prefix_source, b.num_cached_tokens, m.retained()) == (True, ra, 4, {})


def test_a_little_hit_takes_over_the_prefix_its_storage_id_would_drop_where_that_holds_the_hit_too():
    """Every storage id in use: the copy's id would drop the least recently used other prefix. Where that
    one starts with the same chat header, it is taken over instead (no stream copy, the same prefixes
    kept); where it does not, the source is copied and it is dropped."""
    d = Driver(64, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True,
               max_storage_ids=3)
    m, st = d.m, d.storage
    header = P[:4]
    d.allocate("L", [9] * 8 + [1])  # a live sequence holds one id
    rids = []
    for name, tail in (("A", range(20, 40)), ("B", range(40, 60))):
        d.allocate(name, header + list(tail))
        m.mark_computed(name)
        rids.append(d.free(name).retained_as)
    ra, rb = rids
    c = d.allocate("C", header + list(range(60, 70)))  # 4 of 14: under half; ra the source, rb the victim
    assert (c.adopted, c.prefix_source, c.num_cached_tokens, c.retained_ops) == (True, rb, 4, ())
    assert list(m.retained()) == [ra] and st.tokens_of(m, ra) == header + list(range(20, 40))
    # The least recently used other prefix shares nothing with the next prompt: copied from the source.
    d = Driver(64, builtin_block_hash, per_sequence_storage=True, retain_prefixes=4, adopt_retained=True,
               max_storage_ids=3)
    m = d.m
    d.allocate("L", [9] * 8 + [1])
    rids = []
    for name, prompt in (("X", [5] * 8 + [1]), ("A", header + list(range(20, 40)))):
        d.allocate(name, prompt)
        m.mark_computed(name)
        rids.append(d.free(name).retained_as)
    rx, ra = rids
    e = d.allocate("E", header + list(range(80, 90)))
    assert (e.adopted, e.prefix_source, e.num_cached_tokens) == (False, ra, 4)
    assert [op.seq_id for op in e.retained_ops] == [rx] and list(m.retained()) == [ra]


def test_retained_prefixes_are_capped_least_recently_used_first():
    d = Driver(16, builtin_block_hash, per_sequence_storage=True, retain_prefixes=2)
    m = d.m
    rids = []
    for s, first in enumerate([10, 20, 30]):
        d.allocate(s, [first] * 4 + [1])
        m.mark_computed(s, 4)  # the last token, sampled, never computed: whole blocks only here
        rids.append(d.free(s).retained_as)
        if s == 1:  # a hit makes the first prefix the most recently used
            assert d.allocate("hit", [10] * 4 + [2]).prefix_source == rids[0]
            d.free("hit")
    assert list(m.retained()) == [rids[0], rids[2]]  # rids[1] was the least recently used
    assert d.storage.tokens_of(m, rids[1]) == [] and m.stats().num_cached == 2
    # A longer prefix that starts with a retained one replaces it.
    d.allocate("long", [10] * 8 + [3])
    m.mark_computed("long", 8)
    ev = d.free("long")
    assert [op.seq_id for op in ev.dropped] == [rids[0]]
    assert list(m.retained()) == [rids[2], ev.retained_as] and len(m.retained()[ev.retained_as]) == 2


def test_retained_blocks_are_capped():
    """`retain_blocks` caps the cached blocks, those only retained prefixes hold: past it the pool's next
    victim goes (a freed sequence's tail first), cutting the retained prefixes that hold it there.
    Blocks a running sequence holds cost no extra storage and do not count."""
    d = Driver(16, builtin_block_hash, per_sequence_storage=True, retain_prefixes=8, retain_blocks=3)
    m = d.m

    def done(seq, tokens):
        d.allocate(seq, tokens)
        m.mark_computed(seq, len(tokens) - 1)  # the last token, sampled, never computed: whole blocks here

    done("a", [1] * 8 + [0])  # blocks 0, 1 retained, 2 (holding nothing computed) freed empty
    a = d.free("a").retained_as
    done("b", [2] * 4 + [0])  # block 2 retained: 3 cached, within the cap
    b = d.free("b").retained_as
    assert m.retained() == {a: (0, 1), b: (2,)} and m.pool.free_block_ids()[-3:] == [1, 0, 2]
    done("c", [3] * 4 + [0])  # block 3: a 4th cached block; a's tail (1) goes, a keeps its head
    ev = d.free("c")
    c = ev.retained_as
    assert [(type(op).__name__, op.seq_id, op.num_tokens) for op in ev.dropped] == [("TruncateEvent", a, 4)]
    assert m.retained() == {a: (0,), b: (2,), c: (3,)} and m.stats().num_cached == 3
    assert d.allocate("x", [2] * 4 + [9]).prefix_source == b  # x runs on b's block 2: it no longer counts
    m.mark_computed("x")
    done("dd", [5] * 8 + [0])
    assert m.block_table("dd") == (4, 5, 6)
    ev = d.free("dd")  # cached: 0, 3, then 5, 4: a's last block goes, b's block stays (x holds it)
    assert [(type(op).__name__, op.seq_id) for op in ev.dropped] == [("FreeEvent", a)]
    assert m.retained() == {b: (2,), c: (3,), ev.retained_as: (4, 5)} and m.stats().num_cached == 3
    check_invariants(d)
    done("big", [4] * 16 + [0])  # 4 full blocks alone: its first 3 stay (the tail goes first), the rest go
    big_blocks = m.block_table("big")
    ev = d.free("big")
    assert ev.retained_tokens == 3 * BS and m.retained() == {b: (2,), ev.retained_as: big_blocks[:3]}
    assert m.stats().num_cached == 3 and m.pool.free_block_ids()[-3:] == list(big_blocks[2::-1])
    check_invariants(d)


def test_retained_system_prompts_outlive_the_requests_after_them():
    """bench/server_scale.py's miss, small: chats over 3 system prompts with a retain budget that holds
    the 3 prompts but not every chat's question and answer beside them. Each chat's unique tail must go
    before any system prompt that a second chat used, so every later chat hits its whole system prompt.
    (The budget used to count whole retained prefixes, tails included, least recently used first: a
    system prompt was dropped at once when two others' chats finished after it.)"""
    d = Driver(64, builtin_block_hash, per_sequence_storage=True, retain_prefixes=8, retain_blocks=6)
    m = d.m
    systems = [[10 * k + i for i in range(8)] for k in range(3)]  # 2 blocks each
    chats = iter(range(100, 1000))

    def chat(k: int) -> int:
        """A chat: system prompt k, a one-block question and a one-block answer; prefix tokens reused."""
        seq = next(chats)
        plan = d.allocate(seq, systems[k] + [seq] * 4 + [0])
        m.mark_computed(seq)
        d.append(seq, [seq + 1000] * 4)
        m.mark_computed(seq)
        d.free(seq)
        assert m.stats().num_cached <= 6
        return plan.num_cached_tokens

    assert [chat(k) for k in (0, 0, 1, 1, 2, 2)] == [0, 8, 0, 8, 0, 8]  # each prompt computed once
    assert [chat(k) for k in (0, 1, 2) * 3] == [8] * 9
    # Exactly the three system prompts stay, each once (the cut chats' prefixes were redundant).
    assert sorted(m.retained().values()) == sorted(tuple(m.pool.lookup(h) for h in _hashes(d, s)) for s in systems)
    assert all(m.pool.is_reused(b) for t in m.retained().values() for b in t)
    check_invariants(d)


def test_prompts_nothing_shares_get_the_smaller_cap():
    """`retain_once_blocks` (2Q's split): blocks no second sequence used stay within it, while prefixes
    that one did may fill `retain_blocks`; the once-used go first."""
    d = Driver(64, builtin_block_hash, per_sequence_storage=True, retain_prefixes=16, retain_blocks=6,
               retain_once_blocks=2)
    m = d.m
    for i in range(4):  # unique 2-block prompts: only the last one's 2 blocks stay
        d.allocate(i, [i] * 8 + [99])
        m.mark_computed(i)
        d.free(i)
    assert (m.stats().num_cached, m.pool.num_cached_once, len(m.retained())) == (2, 2, 1)
    for k in range(3):  # shared 2-block prefixes, each used by two requests: 6 reused blocks stay
        for q in (0, 1):
            seq = f"s{k}{q}"
            plan = d.allocate(seq, [10 + k] * 8 + [q])
            assert plan.num_cached_tokens == 8 * q
            m.mark_computed(seq)
            d.free(seq)
    assert (m.stats().num_cached, m.pool.num_cached_once) == (6, 0)
    assert all(d.allocate(f"again{k}", [10 + k] * 8 + [5]).num_cached_tokens == 8 for k in range(3))
    check_invariants(d)


def _hashes(d: Driver, tokens: list[int]) -> list:
    out, parent = [], None
    for i in range(0, len(tokens), BS):
        parent = d.hash(parent, tuple(tokens[i:i + BS]))
        out.append(parent)
    return out


def test_pool_evicts_blocks_no_second_sequence_used_first():
    """The free queue: empty blocks, then cached ones used once, then reused ones (a prefix hit
    touched them while cached or held), each least recently used first and a sequence's tail first."""
    d = Driver(8, builtin_block_hash)
    m = d.m
    d.allocate("a", P + [1])  # blocks 0, 1 (P) and 2
    m.mark_computed("a")
    assert d.allocate("b", P + [2]).block_ids == (0, 1, 3)  # a prefix hit: 0 and 1 are reused now
    d.allocate("c", [7] * 8 + [3])  # blocks 4, 5 (used once) and 6
    m.mark_computed("b"), m.mark_computed("c")
    d.free("a"), d.free("b"), d.free("c")
    assert m.pool.free_block_ids() == [6, 3, 2, 7, 5, 4, 1, 0]
    assert [m.pool.is_reused(b) for b in (0, 1, 4, 5)] == [True, True, False, False]
    assert d.allocate("d", [9] * 24).evicted_block_ids == (5, 4)  # after the empty 6, 3, 2, 7
    assert m.pool.free_block_ids() == [1, 0] and m.pool.oldest_cached() == 1


def test_prefix_caching_disabled_and_errors():
    m = PagedKVManager(8, BS, enable_prefix_caching=False)
    m.allocate("a", P + [1])
    assert m.mark_computed("a") == 0
    assert m.allocate("b", P + [1]).num_cached_tokens == 0
    assert (m.stats().prefix_queries, m.stats().hit_rate) == (0, 0.0)

    with pytest.raises(ValueError, match="already exists"):
        m.allocate("a", [1])
    with pytest.raises(ValueError, match="unknown sequence 'z'"):
        m.append("z", [1])
    with pytest.raises(ValueError, match="at least one token"):
        PagedKVManager(4, BS).allocate("a", [])
    with pytest.raises(ValueError, match=r"truncate\(10\) outside \[0, 9\]"):
        m.truncate("a", 10)
    m.append("a", [5])
    with pytest.raises(ValueError, match="fork after its 10 tokens are computed"):
        m.fork("a", "c")
    with pytest.raises(ValueError, match=r"mark_computed\(11\) outside \[9, 10\]"):
        m.mark_computed("a", 11)
    with pytest.raises(UserError, match="num_blocks must be at least 1, got 0"):
        PagedKVManager(0, BS)
    with pytest.raises(UserError, match="block_size must be at least 1 token, got 0"):
        PagedKVManager(4, 0)


def test_hash_functions_chain_and_differ():
    for fn in (sha256_block_hash, builtin_block_hash):
        h = fn(None, (1, 2))
        assert h == fn(None, (1, 2)) and h != fn(None, (2, 1)) and fn(h, (3,)) != fn(None, (3,))
    assert sha256_block_hash(None, (1,)).hex()[:16] == "51b09ceccfbec445"  # stable across processes


# ------------------------------------------------------------------------------------------ stress
def check_invariants(d: Driver):
    m, pool = d.m, d.m.pool
    holders = [0] * m.num_blocks
    for s in m.seq_ids():
        table, tokens = m.block_table(s), m.token_ids(s)
        first = m.first_stored_position(s)
        held = [b for b in table if b != NULL_BLOCK]
        assert len(table) == -(-len(tokens) // BS) and len(set(held)) == len(held)
        assert table[:first // BS] == (NULL_BLOCK,) * (first // BS) and len(held) == len(table) - first // BS
        for b in held:
            holders[b] += 1
        assert d.storage.tokens_of(m, s) == list(tokens)[first:], f"sequence {s} reads wrong KV"
    assert refs(m) == holders
    retained_blocks = {b for t in m.retained().values() for b in t}
    if m.per_sequence_storage:
        for rid, table in m.retained().items():  # a retained prefix holds what its blocks' hashes say
            want = [t for b in table for t in d.hash.seen[pool.block_hash(b)][1]]
            assert d.storage.tokens_of(m, rid) == want, f"{rid} holds wrong KV"
        # The manager's count is the storage's real memory (what sizes llama.cpp's unified cell pool):
        # cells never outnumber its used + cached slots. Per-slot streams (`adopt_retained`) are each
        # memory of their own, and a retained prefix there may name another's copy of a block.
        if not m.adopt_retained:
            assert len(d.storage.cells) <= (m.stats().num_used + m.stats().num_cached) * BS
    free = pool.free_block_ids()
    assert len(set(free)) == len(free) and set(free) == {b for b in range(m.num_blocks) if holders[b] == 0}
    s = m.stats()
    assert s.num_free + s.num_used == s.num_blocks and s.num_free == len(free)
    assert s.num_cached == sum(pool.block_hash(b) is not None for b in free)
    for h, b in pool.cached_items():
        assert pool.block_hash(b) == h
        if m.per_sequence_storage:
            assert holders[b] > 0 or b in retained_blocks, f"cached block {b} is held by no one"
        else:
            assert d.storage.data[b] == list(d.hash.seen[h][1]), f"block {b} does not hold what its hash says"


@hash_fns
@pytest.mark.parametrize("per_sequence_storage,retain,retain_blocks",
                         [(False, 0, None), (True, 0, None), (True, 3, None), (True, 3, 3)],
                         ids=["tensor_pool", "llama_seqs", "llama_retained", "llama_retained_capped"])
def test_random_ops_keep_invariants(hash_fn, per_sequence_storage, retain, retain_blocks):
    rng = random.Random(1234)
    d = Driver(16, hash_fn, per_sequence_storage=per_sequence_storage, retain_prefixes=retain,
               retain_blocks=retain_blocks, retain_once_blocks=retain_blocks and retain_blocks - 1)
    m = d.m
    prefixes = [[rng.randrange(4) for _ in range(12)] for _ in range(3)]
    next_id, counts = 0, dict.fromkeys(["hit", "noroom", "cow", "evict", "retained_hit"], 0)
    for _ in range(2500):
        seqs = list(m.seq_ids())
        op = rng.choices(["alloc", "append", "compute", "fork", "truncate", "free"], [3, 5, 4, 1, 2, 2])[0]
        before = snapshot(m)
        if op == "alloc" or not seqs:
            prompt = rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(4) for _ in range(rng.randrange(4))]
            plan = d.allocate(next_id, prompt)
            next_id += 1
            counts["hit"] += bool(plan and plan.num_cached_tokens)
            counts["retained_hit"] += bool(plan and isinstance(plan.prefix_source, RetainedPrefix))
        elif op == "append":
            plan = d.append(s := rng.choice(seqs), [rng.randrange(4) for _ in range(rng.randrange(1, 6))])
            counts["cow"] += bool(plan and plan.copy_ops)
        elif op == "compute":
            s = rng.choice(seqs)
            m.mark_computed(s, rng.randint(m.num_computed_tokens(s), m.num_tokens(s)))
            plan = None
        elif op == "fork":
            parent = rng.choice(seqs)
            m.mark_computed(parent)
            d.fork(parent, next_id)
            next_id, plan = next_id + 1, None
        elif op == "truncate":
            s = rng.choice(seqs)
            d.truncate(s, rng.randint(0, m.num_tokens(s)))
            plan = None
        else:
            d.free(rng.choice(seqs))
            plan = None
        if isinstance(plan, NoRoom):
            counts["noroom"] += 1
            assert snapshot(m) == before
            d.free(rng.choice(seqs))  # preempt, as a scheduler would
        elif plan is not None:
            counts["evict"] += len(plan.evicted_block_ids)
        check_invariants(d)
    for s in list(m.seq_ids()):
        d.free(s)
    check_invariants(d)
    assert m.stats().num_used == 0 and refs(m) == [0] * m.num_blocks
    # The run exercised every path it is meant to check.
    assert all(counts[k] > 20 for k in ("hit", "noroom", "cow")), counts
    # A per-sequence storage evicts only what it retains.
    assert (counts["evict"] > 20) == (not per_sequence_storage or retain > 0), counts
    assert (counts["retained_hit"] > 20) == (retain > 0), counts


# ------------------------------------------------------------------------------- sliding window
W = 6  # a query at position q sees q-5 .. q


def window_bound(start: int) -> set[int]:
    """Block indices a sequence may hold right after an append whose first new token is at `start`:
    every block that still overlaps the window of that token, [start - W + 1, start]."""
    return {i for i in range(start // BS + 8) if (i + 1) * BS > start - W + 1}


def test_window_drops_blocks_behind_it_and_holds_a_flat_number():
    d = Driver(8, builtin_block_hash, sliding_window=W)
    m = d.m
    assert d.allocate("A", [1, 2, 3, 4, 5]).block_ids == (0, 1)
    m.mark_computed("A")
    held = []
    for t in range(40):
        start = m.num_tokens("A")
        plan = d.append("A", [t])
        m.mark_computed("A")
        table = plan.block_ids
        assert {i for i, b in enumerate(table) if b != NULL_BLOCK} <= window_bound(start)
        held.append(m.num_held_blocks("A"))
    # Positions 4..8 need blocks 1 and 2; block 0 (positions 0..3) goes when the query reaches 9.
    assert m.block_table("A")[:3] == (NULL_BLOCK,) * 3
    assert max(held) == 3 == -(-(W - 1) // BS) + 1 and held[-1] <= 3
    assert m.stats().num_used == m.num_held_blocks("A")  # the pool agrees: nothing else is held
    assert d.storage.tokens_of(m, "A") == list(m.token_ids("A"))[m.first_stored_position("A"):]


def test_window_exact_block_ids_and_cached_blocks_still_hit():
    d = Driver(6, builtin_block_hash, sliding_window=W)
    m = d.m
    prompt = list(range(100, 109))  # 9 tokens: blocks 0, 1 full, block 2 partial
    assert d.allocate("A", prompt).block_ids == (0, 1, 2)
    assert m.mark_computed("A") == 2
    # The next query sits at 9 and sees 4..9: block 0 (0..3) is dropped, and stays cached.
    plan = d.append("A", [109])
    assert plan.block_ids == (NULL_BLOCK, 1, 2) and plan.slot_mapping == (9,)
    assert m.pool.ref_count(0) == 0 and m.stats().num_cached == 1 and m.first_stored_position("A") == 4
    # Another prompt with the same first block takes it from the cache (its own window needs it).
    b = d.allocate("B", prompt[:4] + [7, 7])
    assert (b.cached_block_ids, b.num_cached_tokens) == ((0,), 4)
    d.free("B")
    d.free("A")
    assert m.stats().num_used == 0 and m.stats().num_free == 6


def test_window_room_counts_the_blocks_an_append_drops():
    # Three blocks are all a window of 6 ever needs: the sequence runs forever in them.
    d = Driver(3, builtin_block_hash, sliding_window=W)
    m = d.m
    d.allocate("A", [1, 2, 3])
    m.mark_computed("A")
    for t in range(30):
        assert m.can_append("A", 1)
        assert d.append("A", [t]), f"no room at token {t}"
        m.mark_computed("A")
    # A dropped block that another sequence still holds is no room.
    d2 = Driver(3, builtin_block_hash, sliding_window=W)
    d2.allocate("A", list(range(8)))
    d2.m.mark_computed("A")
    d2.append("A", [8])
    d2.m.mark_computed("A")
    d2.fork("A", "B")  # B shares blocks 0, 1 and the partial block 2: the pool is full
    # A's query at 9 no longer needs block 0, but B holds it; the shared block 2 needs a copy: no room.
    assert d2.append("A", [9]) == NoRoom(1, 0)
    d2.free("B")
    assert d2.append("A", [9]).block_ids == (NULL_BLOCK, 1, 2) and d2.m.stats().num_used == 2


def test_window_truncate_behind_it_is_refused_and_fork_keeps_nulls():
    d = Driver(8, builtin_block_hash, sliding_window=W)
    m = d.m
    d.allocate("A", list(range(12)))
    m.mark_computed("A")
    d.append("A", [12])  # query at 12 sees 7..12: blocks 0 is dropped (0..3); block 1 (4..7) stays
    m.mark_computed("A")
    assert m.block_table("A")[0] == NULL_BLOCK and m.first_stored_position("A") == 4
    with pytest.raises(ValueError, match="behind the sliding window"):
        m.truncate("A", 3)
    assert d.truncate("A", 10).num_tokens == 10  # within what is stored: fine
    d.fork("A", "B")
    assert m.block_table("B") == m.block_table("A") and m.pool.ref_count(m.block_table("A")[1]) == 2
    d.free("A")
    d.free("B")
    assert m.stats().num_used == 0


def test_window_needs_a_block_pool_storage():
    with pytest.raises(UserError, match="sliding window needs a block-tensor storage"):
        PagedKVManager(8, BS, per_sequence_storage=True, sliding_window=W)
    with pytest.raises(UserError, match="at least 1 token"):
        PagedKVManager(8, BS, sliding_window=0)
