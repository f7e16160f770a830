"""Iteration-level continuous batching over the shared paged-KV manager.

Each step (`schedule` -> executor -> `update`):

1. Every running sequence that is decoding gets KV room for its next token (plus its draft tokens
   when it speculates). When the manager answers `NoRoom`, the lowest-priority running sequence is
   preempted: its blocks are freed and it waits at the head of the queue. When readmitted it is
   recomputed from its tokens, or (preemption "swap") its KV, saved to host memory when it was
   preempted, is restored exactly.
2. Sequences still prefilling get their next prompt chunk while the step's token budget lasts
   (chunked prefill: a long prompt takes several steps, and decoding goes on meanwhile).
3. Waiting sequences are admitted in arrival order while there are free sequence slots, token
   budget and KV blocks (the first that lacks one stops admission: a long prompt is not overtaken
   forever by short ones). A prompt whose leading whole blocks a running sequence is still
   computing waits for them (`_prefix_in_flight`): sixteen chats that arrive together with one
   system prompt compute it once, not sixteen times. Such a prompt steps aside rather than holding
   the queue, and it waits only for blocks it will really take: requests behind it that share
   nothing with it are not starved behind the shared prefix.

A chunk holds at most `prefill_chunk` tokens of what the step's budget has left, from wherever the
prompt's computed part ends. With a batch-invariant executor (`edgefinfer serve --batch-invariant`:
llama.cpp with one KV stream per sequence) chunks are aligned instead, split at multiples of
`prefill_chunk` counted from position 0, and a chunk runs whole or waits, so how a sequence's tokens
are grouped into forwards depends only on the sequence, never on its neighbours, and its logits are
exactly those it gets alone. For the same reason a prefix-cache hit is then cut back to what the
lending sequence computed as aligned prompt chunks.

Priority is arrival order (request arrival, then choice index); cancellation frees a request's
blocks at once. KV operations decided between forwards (frees, forks, rollbacks) ride on the next
`StepPlan`, in order, so the storage always sees them before the next write.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from edgefinfer.errors import UserError
from edgefinfer.decoding.generation import finish_reason
from edgefinfer.runtime.decode import pick_token, verify_draft
from edgefinfer.runtime.kv.paged_manager import NoRoom, PagedKVManager, SlotPlan
from edgefinfer.runtime.speculative.proposers import Draft
from edgefinfer.server_gpu import sampler
from edgefinfer.server_gpu.interface import KVOp, SeqWork, StepPlan, StepResult, SwapOp
from edgefinfer.server_gpu.request import ChoiceDelta, Request, RequestOutput, Seq, Status, TextStream
from edgefinfer.server_gpu.batched_speculation import (AcceptanceEstimate, SpeculationConfig, StepCostModel,
                                                       initial_state, next_state)
from edgefinfer.decoding.structured import trim_draft
from edgefinfer.tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # running sequences (choices) at once
    max_num_batched_tokens: int = 512  # tokens per forward
    prefill_chunk: int = 256  # prompt tokens per sequence and step at most (batch-invariant: aligned chunks)
    max_model_len: int = 2048
    preemption: str = "recompute"  # or "swap": park the victim's KV in host memory, restore it exactly

    def __post_init__(self) -> None:
        if self.preemption not in ("recompute", "swap"):
            raise UserError(f"preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        if self.max_num_seqs < 1 or self.prefill_chunk < 1:
            raise UserError(f"max_num_seqs and prefill_chunk must be >= 1, got {self.max_num_seqs} "
                            f"and {self.prefill_chunk}")
        if self.max_num_batched_tokens < max(self.prefill_chunk, self.max_num_seqs):
            raise UserError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold a whole prefill "
                            f"chunk ({self.prefill_chunk}) and one token per sequence ({self.max_num_seqs})")


@dataclass
class StepStats:
    """What happened in one step, for the metrics."""

    prompt_tokens: int = 0  # prompt (or recomputed) tokens computed
    generated: int = 0  # tokens emitted
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    drafted: int = 0
    accepted: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests


@dataclass
class _Scheduled:
    seq: Seq
    work: SeqWork
    draft: Draft | None = None
    prefill: bool = False  # a prompt (or recompute) chunk rather than a decode token


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: PagedKVManager, tokenizer: Tokenizer,
                 stop_ids: tuple[int, ...], batch_invariant: bool = False,
                 speculation: SpeculationConfig | None = None, supports_swap: bool = False):
        if config.preemption == "swap" and not supports_swap:
            raise UserError("this executor cannot swap sequences out (torch, or llama.cpp's unified "
                            "layout); use --preemption recompute, or --kv-layout per-slot")
        self.config = config
        self.manager = manager
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(stop_ids)
        self.batch_invariant = batch_invariant
        self.speculation = speculation
        self.cost = StepCostModel()
        self.acceptance = AcceptanceEstimate()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # by priority, highest first
        self.requests: dict[str, Request] = {}
        self._seqs: dict[int, Seq] = {}  # running sequences by id
        self._pending_ops: list[KVOp] = []
        self._scheduled: list[_Scheduled] = []
        self._failed: list[RequestOutput] = []  # requests refused at admission, reported by update()
        self._stats = StepStats()

    # ------------------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        p = request.params
        seq = Seq(request, 0, list(request.prompt_ids), TextStream(self.tokenizer, p.stop),
                  sampler.make_generator(p.sampling, 0))
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone); its blocks are freed now. False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if seq.status is Status.RUNNING:
                self._release(seq)
            elif seq.status is Status.WAITING:
                self.waiting.remove(seq)
                if seq.swapped is not None:
                    self._pending_ops.append(SwapOp(seq.seq_id, "drop"))
            seq.status, seq.finish_reason, seq.matcher = Status.FINISHED, "abort", None
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_ops)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        ops, self._pending_ops = self._pending_ops, []
        self._stats = StepStats()
        budget = self.config.max_num_batched_tokens
        decoding = self._reserve_decodes(ops)
        budget -= sum(1 + (len(d) if d else 0) for _, d in decoding)
        scheduled = [self._work(seq, [seq.tokens[-1], *(d.tokens if d else [])], len(seq.tokens) - 1, d)
                     for seq, d in decoding]
        decoding_ids = {seq.seq_id for seq, _ in decoding}  # their appends made them look unfinished
        for seq in self.running:
            if seq.seq_id not in decoding_ids and self._prefilling(seq) and (chunk := self._chunk(seq, budget)):
                budget -= chunk
                scheduled.append(self._prefill_work(seq, chunk))
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if self.manager.enable_prefix_caching and self._prefix_in_flight(seq):
                continue  # its prefix is being computed: it takes it when done, and lets the others pass
            if not self._admit(seq, ops, budget):
                break
            chunk = self._chunk(seq, budget)
            budget -= chunk
            scheduled.append(self._prefill_work(seq, chunk))
        self._scheduled = scheduled
        return StepPlan(tuple(ops), tuple(s.work for s in scheduled))

    def _reserve_decodes(self, ops: list[KVOp]) -> list[tuple[Seq, Draft | None]]:
        """KV room for every decoding sequence's next token (and drafts), preempting from the tail."""
        out = []
        num_decoding = spare = 0
        if self.speculation is not None:  # what drafts may add
            prefilling = sum(self._prefilling(s) for s in self.running)
            num_decoding = len(self.running) - prefilling
            spare = self.config.max_num_batched_tokens - num_decoding
            if prefilling or self.waiting:
                spare -= self.config.prefill_chunk  # keep prompts moving
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if self._prefilling(seq):
                i += 1
                continue
            draft = self._draft(seq, spare, num_decoding)
            while not (plan := self.manager.append(seq.seq_id, [seq.tokens[-1], *(draft.tokens if draft else [])])):
                if draft is not None:  # first give up the drafts, then someone's blocks
                    draft = None
                    continue
                victim = self.running[-1]
                self._preempt(victim, ops)
                if victim is seq:
                    if not self.running:  # alone and still no room: it can never fit
                        self.waiting.remove(seq)
                        self._fail(seq, f"the sequence outgrew the KV pool ({self.manager.num_blocks} blocks of "
                                        f"{self.manager.block_size} tokens); lower max_tokens or enlarge the pool")
                    break
            if seq.status is not Status.RUNNING:
                continue  # preempted itself; the list shifted
            ops.append(plan)
            spare -= len(draft) if draft else 0
            out.append((seq, draft))
            i += 1
        return out

    def _prefilling(self, seq: Seq) -> bool:
        """Planned tokens are not all computed yet (a prompt, a recompute, a restored sequence's last
        token). Otherwise the sequence decodes: its last token is sampled but not yet planned."""
        return seq.num_computed < self.manager.num_tokens(seq.seq_id)

    def _draft(self, seq: Seq, spare: int, num_decoding: int) -> Draft | None:
        if self.speculation is None or seq.k_state is None or seq.k_state.k == 0:
            return None
        p = seq.request.params
        k = min(seq.k_state.k, p.max_tokens - seq.num_output - 1,
                self.config.max_model_len - len(seq.tokens) - 1, spare)
        if k <= 0:
            return None
        t0 = time.perf_counter()
        draft = seq.proposer.propose(seq.tokens, k)
        self.cost.observe_draft(len(draft), time.perf_counter() - t0)
        draft = trim_draft(seq.matcher, draft)  # a draft the grammar rejects is cut where it breaks
        return draft if draft is not None and draft.tokens else None

    def _chunk(self, seq: Seq, budget: int) -> int:
        """Tokens of the next prompt chunk to run now (0: wait for a later step).

        Batch-invariant, a chunk ends at the next multiple of `prefill_chunk` and runs whole or waits.
        Otherwise it starts wherever the prompt's computed part ends (after a prefix hit: anywhere) and
        takes up to `prefill_chunk` tokens of what the budget has left: aligned, the 25 tokens after a
        501-token cached system prompt ran as 11 + 14 in two steps, each a forward over sixteen
        streams of 500 cells (bench/server.py's shared-system: first tokens a step later)."""
        c = self.config.prefill_chunk
        start = seq.num_computed
        if not self.batch_invariant:
            return min(len(seq.tokens) - start, c, budget)
        size = min(len(seq.tokens), (start // c + 1) * c) - start
        return size if size <= budget else 0

    def _prefill_work(self, seq: Seq, chunk: int) -> _Scheduled:
        start = seq.num_computed
        return self._work(seq, seq.tokens[start:start + chunk], start, None, prefill=True)

    def _work(self, seq: Seq, tokens: list[int], start: int, draft: Draft | None,
              prefill: bool = False) -> _Scheduled:
        end = start + len(tokens)
        num_logits = (1 + len(draft)) if draft else int(end == len(seq.tokens))
        work = SeqWork(seq.seq_id, tuple(tokens), start, num_logits, self.manager.block_table(seq.seq_id))
        return _Scheduled(seq, work, draft, prefill)

    def _admit(self, seq: Seq, ops: list[KVOp], budget: int) -> bool:
        """Admit a waiting sequence; False if it must wait (and with it those behind it)."""
        request = seq.request
        slots = 1 if request.forked else request.params.n
        if self._slots_in_use() + slots > self.config.max_num_seqs:
            return False
        if self.batch_invariant and min(self.config.prefill_chunk, len(seq.tokens)) > budget:
            return False  # its first chunk (at most this long) cannot run whole in this step
        plan = self.manager.allocate(seq.seq_id, seq.tokens)
        if isinstance(plan, NoRoom):
            if plan.num_blocks_needed > self.manager.num_blocks:
                self.waiting.remove(seq)
                self._fail(seq, f"the request needs {plan.num_blocks_needed} KV blocks but the server has "
                                f"{self.manager.num_blocks}; shorten the prompt or max_tokens")
            return False
        if seq.swapped is not None and plan.num_cached_tokens <= seq.swapped:
            ops.append(SwapOp(seq.seq_id, "in"))  # its KV exactly as it was, instead of any prefix copy
            start, seq.swapped = seq.swapped, None
            self.manager.mark_computed(seq.seq_id, start)
        else:
            if seq.swapped is not None:  # the prefix cache now holds more than the saved copy
                ops.append(SwapOp(seq.seq_id, "drop"))
                seq.swapped, seq.chunked_len = None, 0
            ops.append(plan)
            start = self._aligned_start(seq, plan, ops)
            if start is None:
                return False
        self.waiting.remove(seq)
        seq.num_computed = start
        if seq.chunked_len == 0:
            seq.chunked_len = len(seq.tokens)
        seq.status = Status.RUNNING
        self._insert_running(seq)
        if self.speculation is not None and seq.proposer is None:
            seq.proposer = self.speculation.make_proposer(seq.seq_id)
            seq.k_state = initial_state(self.speculation, self.cost.cost(len(self.running)), self.acceptance.rate)
        return True

    def _prefix_in_flight(self, seq: Seq) -> bool:
        """Whether a running sequence is still computing whole blocks that `seq`'s prompt starts with
        (beyond what is already computed): admitting `seq` now would compute them a second time.
        Batch-invariant mode takes only a lender's whole aligned chunks (`_aligned_start`): waiting for
        blocks past them would serialise the chats behind one system prompt, each recomputing the same
        tail while the next one waits for it."""
        bs = self.manager.block_size
        tokens = seq.tokens
        for other in self.running:
            if not self._prefilling(other) or other.num_computed >= len(tokens) - 1:
                continue
            # The blocks `seq` could take from `other` once computed: shared whole blocks, last token excluded.
            limit = min(len(tokens) - 1, len(other.tokens)) // bs * bs
            if self.batch_invariant:
                c = self.config.prefill_chunk
                limit = min(limit, other.chunked_len or len(other.tokens)) // c * c // bs * bs
            n = 0
            while n < limit and tokens[n:n + bs] == other.tokens[n:n + bs]:
                n += bs
            if n > other.num_computed // bs * bs:
                return True
        return False

    def _aligned_start(self, seq: Seq, plan: SlotPlan, ops: list[KVOp]) -> int | None:
        """Where computing starts after a prefix hit; in batch-invariant mode cut back to what the lender
        computed as aligned prompt chunks. None: no room for that (the sequence was freed again)."""
        start = plan.num_cached_tokens
        if self.batch_invariant and start > 0:
            lender = self._seqs.get(plan.prefix_source)  # a retained prefix: no aligned chunks to trust
            aligned = min(start, lender.chunked_len if lender else 0)
            aligned -= aligned % self.config.prefill_chunk
            if aligned < start:
                ops.append(self.manager.truncate(seq.seq_id, aligned))
                again = self.manager.append(seq.seq_id, seq.tokens[aligned:])
                if not again:
                    ops.append(self.manager.free(seq.seq_id))
                    return None
                ops.append(again)
                start = aligned
        return start

    def _slots_in_use(self) -> int:
        return sum(1 if s.request.forked else s.request.params.n for s in self.running)

    # ------------------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult) -> tuple[list[RequestOutput], StepStats]:
        """Record the forward, then sample, fork and finish; returns the outputs of touched requests."""
        stats = self._stats
        num_decoding = 0
        if self.speculation is not None:  # the cost model and the draft lengths it sets
            num_decoding = sum(not s.prefill for s in self._scheduled)
            if plan.work:
                self.cost.observe(plan.num_tokens, result.elapsed_s)
        now = time.perf_counter()
        touched: dict[str, tuple[Request, list[ChoiceDelta]]] = {}
        for item in self._scheduled:
            seq, work = item.seq, item.work
            if item.draft is not None:
                self._speculative_update(item, result.logits[seq.seq_id], num_decoding, now, touched)
                continue
            self.manager.mark_computed(seq.seq_id, work.end_pos)
            seq.num_computed = work.end_pos
            if item.prefill:
                stats.prompt_tokens += len(work.token_ids)
            elif self.speculation is not None and seq.k_state is not None:
                seq.k_state = next_state(self.speculation, self.cost.cost(num_decoding), seq.k_state, 0, 0)
            if work.num_logits == 0:
                continue
            row = result.logits[seq.seq_id][-1:]  # [1, V]
            samplers = [seq]
            if not seq.request.forked:  # choice 0 computed the prompt: fork the others, all sample from it
                self._fork_children(seq)
                samplers = list(seq.request.seqs)
            # The executor's logits are this step's own; only logprobs read the raw row again.
            biased = sampler.apply_bias(row[0], seq.request.params.logit_bias,
                                        in_place=seq.request.params.logprobs is None)
            for s in samplers:
                token = pick_token(biased, s.request.params.sampling, s.tokens, s.generator, s.matcher)
                self._emit(s, [token], row, now, touched)
        outputs = [RequestOutput(r.request_id, d, r.finished, r.num_prompt, r.num_output_tokens())
                   for r, d in touched.values()]
        self._scheduled = []
        return self._early_outputs() + outputs, stats

    def _speculative_update(self, item: _Scheduled, rows: np.ndarray, num_decoding: int, now: float,
                            touched: dict[str, tuple[Request, list[ChoiceDelta]]]) -> None:
        seq, draft = item.seq, item.draft
        p = seq.request.params
        rows_biased = sampler.apply_bias(rows, p.logit_bias)
        if seq.matcher is not None:
            rows_biased = seq.matcher.mask_rows(rows_biased, draft.tokens)
        result = verify_draft(rows_biased, draft, p.sampling, seq.generator)
        keep = len(seq.tokens) + result.num_accepted_draft  # the KV of [last, accepted drafts] stays valid
        self._pending_ops.append(self.manager.truncate(seq.seq_id, keep))
        self.manager.mark_computed(seq.seq_id)
        seq.num_computed = keep
        self._stats.drafted += len(draft)
        self._stats.accepted += result.num_accepted_draft
        self.acceptance.observe(len(draft), result.num_accepted_draft)
        seq.k_state = next_state(self.speculation, self.cost.cost(num_decoding), seq.k_state,
                                 len(draft), result.num_accepted_draft)
        tokens = list(result.tokens)
        if seq.matcher is not None:  # the output ends where its grammar does
            tokens = tokens[:seq.matcher.accept_until_finished(tokens)]
        self._emit(seq, tokens, rows, now, touched)

    def _fork_children(self, seq0: Seq) -> None:
        """The prompt is computed: create choices 1..n-1, sharing its blocks."""
        request = seq0.request
        request.forked = True
        p = request.params
        for i in range(1, p.n):
            child = Seq(request, i, list(seq0.tokens), TextStream(self.tokenizer, p.stop),
                        sampler.make_generator(p.sampling, i))
            self._pending_ops.append(self.manager.fork(seq0.seq_id, child.seq_id))
            child.num_computed, child.chunked_len = seq0.num_computed, seq0.chunked_len
            child.status = Status.RUNNING
            request.seqs.append(child)
            self._insert_running(child)
            if self.speculation is not None:
                child.proposer = self.speculation.make_proposer(child.seq_id)
                child.k_state = seq0.k_state

    def _emit(self, seq: Seq, tokens: list[int], rows: np.ndarray, now: float,
              touched: dict[str, tuple[Request, list[ChoiceDelta]]]) -> None:
        """Append sampled tokens (rows [len(tokens), V] scored them) to a sequence, stopping where
        `finish_reason` says (a stop id, a stop string, a complete grammar, a length limit)."""
        request, p = seq.request, seq.request.params
        self._time_tokens(seq, len(tokens), now)
        text, emitted, finish, stop_string = self._append(seq, tokens)
        if finish is not None and not stop_string:
            text += seq.text.flush()  # text held back for a possible stop string or a split character
        logprobs = sampler.logprobs(rows[:len(emitted)], emitted, p.logprobs) if p.logprobs is not None else None
        touched.setdefault(request.request_id, (request, []))[1].append(
            ChoiceDelta(seq.index, text, emitted, logprobs, finish))
        if finish is not None:
            self._finish(seq, finish)

    def _time_tokens(self, seq: Seq, n: int, now: float) -> None:
        """The request's time to first token and the gaps between its tokens (`n` arrived at `now`)."""
        request, stats = seq.request, self._stats
        if request.first_token_time is None:
            request.first_token_time = now
            stats.ttft_s.append(now - request.arrival_time)
        if seq.last_emit_time is not None:
            stats.itl_s.extend([(now - seq.last_emit_time) / n] * n)
        seq.last_emit_time = now

    def _append(self, seq: Seq, tokens: list[int]) -> tuple[str, list[int], str | None, bool]:
        """(text, tokens taken, finish reason or None, ended on a stop string): `tokens` appended to
        `seq` up to the first that ends it; a stop id is taken but never becomes text."""
        p = seq.request.params
        text, emitted = "", []
        for tok in tokens:
            seq.tokens.append(tok)
            emitted.append(tok)
            self._stats.generated += 1
            if tok in self.stop_ids and not p.ignore_eos:
                return text, emitted, finish_reason(stop_id=True), False
            out, stop_string = seq.text.push(tok)
            text += out
            # The grammar is judged after the step's last token (the runtime, too, ends it without an EOS step).
            grammar_done = seq.matcher is not None and len(emitted) == len(tokens) and seq.matcher.finished
            at_limit = seq.num_output >= p.max_tokens or len(seq.tokens) >= self.config.max_model_len
            if stop_string or grammar_done or at_limit:  # (`finish_reason` says which it is)
                return text, emitted, finish_reason(stop_string=stop_string, grammar_done=grammar_done,
                                                    at_limit=at_limit), stop_string
        return text, emitted, None, False

    def _finish(self, seq: Seq, reason: str) -> None:
        self._release(seq)
        seq.status, seq.finish_reason, seq.matcher = Status.FINISHED, reason, None
        request = seq.request
        request.num_finished += 1
        if request.finished:
            self.requests.pop(request.request_id, None)
            self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1

    def _fail(self, seq: Seq, message: str) -> None:
        """End `seq`'s whole request with an error (the caller already took `seq` off its queue)."""
        request = seq.request
        for s in request.seqs:
            if s.status is Status.RUNNING:
                self._release(s)
            elif s.status is Status.WAITING and s is not seq and s in self.waiting:
                self.waiting.remove(s)
            if s.swapped is not None:
                self._pending_ops.append(SwapOp(s.seq_id, "drop"))
                s.swapped = None
            s.status, s.finish_reason, s.matcher = Status.FINISHED, "error", None
        self.requests.pop(request.request_id, None)
        self._failed.append(RequestOutput(request.request_id, [], True, request.num_prompt, 0, error=message))
        self._stats.finished["error"] = self._stats.finished.get("error", 0) + 1

    def _early_outputs(self) -> list[RequestOutput]:
        out, self._failed = self._failed, []
        return out

    # ------------------------------------------------------------------------------ internals
    def _insert_running(self, seq: Seq) -> None:
        keys = [(s.request.arrival_time, s.index) for s in self.running]
        self.running.insert(bisect.bisect(keys, (seq.request.arrival_time, seq.index)), seq)
        self._seqs[seq.seq_id] = seq

    def _release(self, seq: Seq) -> None:
        """Free a running sequence's blocks; the storage follows on the next step."""
        self._pending_ops.append(self.manager.free(seq.seq_id))
        self.running.remove(seq)
        del self._seqs[seq.seq_id]
        if self.speculation is not None and self.speculation.release is not None:
            self.speculation.release(seq.seq_id)

    def _preempt(self, seq: Seq, ops: list[KVOp]) -> None:
        """Free a running sequence's blocks and put it at the head of the queue. Swap mode saves its KV
        first (restored bit-exactly on readmission); recompute mode recomputes it from its tokens."""
        if self.config.preemption == "swap" and seq.num_computed > 0:
            ops.append(SwapOp(seq.seq_id, "out"))
            seq.swapped = seq.num_computed
        else:
            seq.num_computed = seq.chunked_len = 0
        ops.append(self.manager.free(seq.seq_id))
        self.running.remove(seq)
        del self._seqs[seq.seq_id]
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self._stats.preemptions += 1
        if self.speculation is not None and seq.proposer is not None:
            if self.speculation.release is not None:
                self.speculation.release(seq.seq_id)  # a draft model's slot; it resyncs when readmitted
            getattr(seq.proposer, "reset", lambda: None)()
        self.waiting.appendleft(seq)
