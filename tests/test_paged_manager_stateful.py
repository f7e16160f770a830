"""The paged-KV manager under any order of operations (issue 17): a Hypothesis state machine allocates
(with prefix hits), appends (copy-on-write), marks computed, forks, rolls back, preempts and readmits,
and frees, on a tensor-pool storage and on llama.cpp-style per-sequence storage, and checks after every
step (with and without a sliding window) the invariants of tests/test_paged_manager.py (reference counts, free + used = total, every
sequence reads back its own tokens, cached blocks hold what their hash says) plus: a step writes only
into blocks its sequence alone holds (shared blocks are read-only), a "no room" answer changes nothing,
and once every sequence has ended no block is held.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from edgefinfer.runtime.kv.block_pool import builtin_block_hash
from edgefinfer.runtime.kv.paged_manager import NULL_BLOCK, NoRoom
from tests.test_paged_manager import BS, Driver, check_invariants, refs, snapshot

# Three 12-token prompts over a 4-token alphabet: prompts cut from them share whole blocks.
PREFIXES = ([0, 1, 2, 3] * 3, [0, 1, 2, 3, 3, 2, 1, 0, 0, 0, 1, 1], [2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0])
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=6)


class PagedKVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.preempted: dict[int, list[int]] = {}  # seq id -> its tokens, to be recomputed on readmission
        self.counts = {"hit": 0, "cow": 0, "noroom": 0}

    @initialize(num_blocks=st.integers(3, 16), per_sequence_storage=st.booleans(), retain=st.sampled_from([0, 1, 3]),
                retain_blocks=st.sampled_from([None, 0, 2, 5]), retain_once=st.sampled_from([None, 0, 1, 3]),
                window=st.sampled_from([None, None, 5, 9]), adopt=st.booleans(), ids=st.sampled_from([None, 2, 4]))
    def pool(self, num_blocks: int, per_sequence_storage: bool, retain: int, retain_blocks: int | None,
             retain_once: int | None, window: int | None, adopt: bool, ids: int | None) -> None:
        window = None if per_sequence_storage else window  # a sliding window needs a block pool
        # llama.cpp's per-slot streams: retained prefixes are taken over, and share the streams with live ones
        adopt, ids = (adopt, ids if adopt else None) if per_sequence_storage else (False, None)
        self.ids = ids
        self.d = Driver(num_blocks, builtin_block_hash, per_sequence_storage=per_sequence_storage,
                        retain_prefixes=retain, retain_blocks=retain_blocks, retain_once_blocks=retain_once,
                        sliding_window=window, adopt_retained=adopt, max_storage_ids=ids)
        self.m = self.d.m
        self.window = window

    # ------------------------------------------------------------------ helpers
    def live(self) -> list[int]:
        return sorted(self.m.seq_ids())

    def id_free(self) -> bool:
        """A new sequence may start: the scheduler admits no more live ones than the storage has ids."""
        return self.ids is None or len(self.live()) < self.ids

    def pick(self, index: int) -> int:
        seqs = self.live()
        return seqs[index % len(seqs)]

    def planned(self, call, seq: int, new_tokens: list[int]):
        """Run an allocate/append; "no room" must leave everything as it was, and a plan may write only
        into blocks its own sequence holds alone and that no hash describes."""
        before = snapshot(self.m)
        plan = call(seq, new_tokens)
        if isinstance(plan, NoRoom):
            assert snapshot(self.m) == before
            self.counts["noroom"] += 1
            return plan
        others = {b for s in self.live() if s != seq for b in self.m.block_table(s)} - {NULL_BLOCK}
        if self.window is not None and call == self.d.append:  # nothing behind the first new token's window
            assert all(b == NULL_BLOCK for i, b in enumerate(plan.block_ids)
                       if (i + 1) * BS <= plan.start_pos - self.window + 1)
        for slot in plan.slot_mapping:
            block = slot // BS
            assert block in self.m.block_table(seq) and block not in others, f"block {block} is shared"
            assert self.m.pool.ref_count(block) == 1 and self.m.pool.block_hash(block) is None
        self.counts["hit"] += bool(plan.num_cached_tokens)
        self.counts["cow"] += bool(plan.copy_ops)
        return plan

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.id_free())
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 3), max_size=3))
    def allocate(self, prefix: list[int], cut: int, tail: list[int]) -> None:
        self.planned(self.d.allocate, self.next_id, prefix[:cut] + tail)
        self.next_id += 1

    @precondition(lambda self: any(True for _ in self.m.seq_ids()))
    @rule(index=st.integers(0, 63), new=tokens)
    def append(self, index: int, new: list[int]) -> None:
        self.planned(self.d.append, self.pick(index), new)

    @precondition(lambda self: any(True for _ in self.m.seq_ids()))
    @rule(index=st.integers(0, 63), fraction=st.floats(0, 1))
    def mark_computed(self, index: int, fraction: float) -> None:
        s = self.pick(index)
        done, total = self.m.num_computed_tokens(s), self.m.num_tokens(s)
        self.m.mark_computed(s, done + round((total - done) * fraction))

    @precondition(lambda self: any(True for _ in self.m.seq_ids()) and self.id_free())
    @rule(index=st.integers(0, 63))
    def fork(self, index: int) -> None:
        parent = self.pick(index)
        self.m.mark_computed(parent)  # a fork copies computed KV only
        used = self.m.stats().num_used
        self.d.fork(parent, self.next_id)
        assert self.m.stats().num_used == used  # the child shares every block
        self.next_id += 1

    @precondition(lambda self: any(True for _ in self.m.seq_ids()))
    @rule(index=st.integers(0, 63), keep=st.floats(0, 1))
    def rollback(self, index: int, keep: float) -> None:
        s = self.pick(index)
        n = self.m.num_tokens(s)  # a rollback never reaches behind the window (the scheduler's drafts)
        self.d.truncate(s, max(round(n * keep), min(self.m.first_stored_position(s), n)))

    @precondition(lambda self: any(True for _ in self.m.seq_ids()))
    @rule(index=st.integers(0, 63))
    def preempt(self, index: int) -> None:
        s = self.pick(index)
        self.preempted[s] = list(self.m.token_ids(s))
        self.d.free(s)

    @precondition(lambda self: bool(self.preempted) and self.id_free())
    @rule(index=st.integers(0, 63))
    def readmit(self, index: int) -> None:
        s = sorted(self.preempted)[index % len(self.preempted)]
        if not self.preempted[s]:  # rolled back to nothing: it has no KV to recompute
            del self.preempted[s]
            return
        if self.planned(self.d.allocate, s, self.preempted[s]):
            del self.preempted[s]

    @precondition(lambda self: any(True for _ in self.m.seq_ids()))
    @rule(index=st.integers(0, 63))
    def free(self, index: int) -> None:
        self.d.free(self.pick(index))

    # ------------------------------------------------------------------ checks
    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "d"):
            check_invariants(self.d)
            if self.ids is not None:  # the storage never holds more sequences than it has ids
                tags = {t for _, _, tags in self.d.storage.cells.values() for t in tags}
                assert len(self.live()) + self.m.stats().num_retained <= self.ids and len(tags) <= self.ids

    def teardown(self) -> None:
        if not hasattr(self, "d"):
            return
        for s in self.live():
            self.d.free(s)
        check_invariants(self.d)
        s = self.m.stats()
        assert s.num_used == 0 and s.num_free == s.num_blocks and refs(self.m) == [0] * s.num_blocks


PagedKVMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_paged_kv_manager_state_machine = PagedKVMachine.TestCase
