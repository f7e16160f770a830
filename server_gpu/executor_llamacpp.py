"""The llama.cpp executor: one llama context, many sequences, one `llama_batch` per forward.

The model, the context and its memory operations are the runtime's binding
(`edgefinfer.runtime.backends.llamacpp_binding`); this module is the server's scheduling glue.
The paged-KV manager decides; llama.cpp's memory holds the data. `LlamaSeqStorage` follows the
manager's decisions with `llama_memory_*` calls on llama sequence ids ("slots"), as
`edgefinfer.runtime.kv.storage` describes: prefix sharing and forks copy a sequence
(`seq_cp`), rollback and release remove cells (`seq_rm`).

Two memory layouts (`kv_unified`):

* True: one pool of cells for all sequences; `seq_cp` shares cells (a prefix costs
  memory once), and any mix of sequences fits as long as the total does. The paged-KV manager's
  blocks then are the memory: its pool is the cell pool, and what it reports free is free in
  llama.cpp. Finished requests' prompts stay as retained prefixes (`retain_prefixes`, on llama seq
  ids beyond the live ones) until the manager needs their blocks, so a later request with the same
  system prompt, or the same prompt again, copies its cells instead of computing them (llama-server's
  slots keep each finished prompt the same way). llama.cpp's kernels see the whole batch as one
  attention problem and pick their paths from its size, so a sequence's logits change with its
  neighbours: not batch-invariant (reference model, 16 concurrent greedy requests: logprobs off by up
  to 0.12, and 9 of 16 continuations diverged within 32 tokens; see docs/SERVER.md).
  Every token also attends (masked) over the pool up to its highest used cell: at 16 sequences a
  decode step costs 81 ms against 73 ms per-slot (docs/SERVER.md).
* False (the server's default, as llama-server's --parallel): one KV stream per slot, each
  `max_model_len` cells. Attention of a sequence then runs over its own stream with kernels chosen by
  its own token count. A cross-stream `seq_cp` copies the whole stream (llama.cpp only copies full
  streams), then `seq_rm` cuts it to the shared prefix. A finished prompt stays in its stream, taken
  over by the next request that starts with it (`adopt_retained`). llama.cpp runs sequences of
  consecutive ids in one micro-batch only, so a step feeds them in slot order (`_calls`) and a new
  sequence takes the slot that joins running neighbours (`LlamaSeqStorage._place`).

`batch_invariant` (`edgefinfer serve --batch-invariant`, per-slot only) makes a request's logits
independent of its batch neighbours: 16 concurrent greedy requests return exactly what each returns
alone. That also needs each sequence's tokens to reach llama.cpp as the same runs: llama.cpp splits a
multi-stream batch into micro-batches of equal tokens per sequence, so a 16-token chunk next to
1-token decodes would be cut into 1 + 15. `execute` then runs one `llama_decode` per group of
sequences feeding the same number of tokens; without the flag a step is one `llama_decode` (as
llama-server's), several calls costing a new-prompt step at 16 requests several forwards.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path

import numpy as np
import torch

from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.llamacpp_binding import LlamaContext, LlamaModel
from edgefinfer.runtime.kv.paged_manager import CopyOp, RetainedPrefix, SeqId
from edgefinfer.runtime.speculative.proposers import DraftModelProposer
from edgefinfer.server_gpu.interface import SeqWork, StepPlan, StepResult


class LlamaSeqStorage:
    """`KVStorage` over llama.cpp sequences: maps manager sequence ids to llama seq ids (slots)."""

    def __init__(self, ctx: LlamaContext, unified: bool, num_slots: int):
        self.ctx, self.unified = ctx, unified
        self._free = set(range(num_slots))
        self._slots: dict[SeqId, int] = {}
        self._swapped: dict[SeqId, ctypes.Array] = {}  # host copies of preempted sequences
        self.moves = 0  # retained prefixes moved to another stream to make room (`_place`)

    def slot(self, seq_id: SeqId) -> int:
        """The llama seq id of a sequence; a new one is placed by `_place`."""
        s = self._slots.get(seq_id)
        if s is None:
            if not self._free:
                raise RuntimeError("no free llama sequence slot: the scheduler admitted too many sequences")
            s = self._slots[seq_id] = self._place()
        return s

    def _place(self) -> int:
        """A slot for a new live sequence, taken out of the free set.

        Per-slot, llama.cpp decodes each run of consecutive live slots as its own micro-batch
        (`_calls`), and every micro-batch reads all the weights again: 8 one-token decodes took 40 ms in
        adjacent streams and 64-68 ms in every other one (one-off probe). Finished prompts stay in their
        streams (retained prefixes), so the streams that requests free come back scattered. The new
        sequence takes the slot that joins the most live neighbours, the lowest on a tie; where that is
        a retained prefix's slot, the prefix first moves to a free stream that borders no live one (a
        whole-stream copy, which llama.cpp runs before the next decode: ~50 MB, ~7 ms for SmolLM2 at
        2048 cells, once per request, against a micro-batch saved on each of its steps). Which
        prefixes stay retained is the manager's choice; only where they sit changes. (A swap-in
        writes a stream at once, before such a copy would run; per slot the executor keeps no
        retained prefixes with swap preemption, so nothing moves there.) In a unified pool (one
        stream) the slot is only a sequence id: the lowest free one."""
        if self.unified:
            s = min(self._free)
            self._free.discard(s)
            return s
        live = {s for k, s in self._slots.items() if not isinstance(k, RetainedPrefix)}

        def joined(s: int) -> int:
            return (s - 1 in live) + (s + 1 in live)

        best = min(self._free, key=lambda s: (-joined(s), s))
        retained = {s: k for k, s in self._slots.items() if isinstance(k, RetainedPrefix)}
        better = [s for s in retained if joined(s) > joined(best)]
        if not better:
            self._free.discard(best)
            return best
        target = min(better, key=lambda s: (-joined(s), s))
        refuge = min(self._free, key=lambda s: (joined(s), -s))  # out of the live runs' way
        self.ctx.copy(target, refuge)  # whole stream; llama.cpp copies the buffers before the next decode
        self.ctx.remove(target)
        self._slots[retained[target]] = refuge
        self._free.discard(refuge)
        self.moves += 1
        return target

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    # ---- KVStorage -----------------------------------------------------------------------------
    def copy_blocks(self, ops: Sequence[CopyOp]) -> None:
        pass  # llama.cpp writes new tokens into cells tagged only with the writer: shared cells never change

    def share_prefix(self, seq_id: SeqId, source_id: SeqId | None, block_ids: Sequence[int], num_tokens: int) -> None:
        if source_id is None:
            raise RuntimeError("llama.cpp storage needs a live source sequence for a prefix hit "
                               "(build the manager with per_sequence_storage=True)")
        self._copy(source_id, seq_id, num_tokens)

    def fork(self, parent_id: SeqId, child_id: SeqId, num_tokens: int) -> None:
        self._copy(parent_id, child_id, num_tokens)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        self.ctx.remove(self.slot(seq_id), num_tokens)

    def release(self, seq_id: SeqId) -> None:
        s = self._slots.pop(seq_id, None)
        if s is not None:
            self.ctx.remove(s)
            self._free.add(s)

    def retain(self, seq_id: SeqId, retained_id: SeqId, num_tokens: int) -> None:
        s = self._slots.pop(seq_id)
        self._slots[retained_id] = s
        self.ctx.remove(s, num_tokens)

    def adopt(self, retained_id: SeqId, seq_id: SeqId, num_tokens: int) -> None:
        self.retain(retained_id, seq_id, num_tokens)  # the same move, the other way

    # ---- SwappableStorage (llama_state_seq_*: restores bit-exactly into any slot) -----------------
    def swap_out(self, seq_id: SeqId) -> None:
        self._swapped[seq_id] = self.ctx.save(self.slot(seq_id))

    def swap_in(self, seq_id: SeqId) -> None:
        self.ctx.restore(self.slot(seq_id), self._swapped.pop(seq_id))

    def drop_swapped(self, seq_id: SeqId) -> None:
        self._swapped.pop(seq_id, None)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def _copy(self, src: SeqId, dst: SeqId, num_tokens: int) -> None:
        d = self.slot(dst)  # first: placing it may move `src` itself (a retained prefix) to another stream,
        s = self.slot(src)  # whose copy llama.cpp runs first, in the order they were asked for
        if self.unified:
            self.ctx.copy(s, d, 0, num_tokens)  # shares the cells
        else:
            self.ctx.copy(s, d)  # across streams: whole streams only
            self.ctx.remove(d, num_tokens)


DEFAULT_RETAIN_TOKENS = 512  # unified layout: tokens only retained prefixes keep, unless --retain-tokens says
# ... of prompts no second request used; with those that one did, this many times as much (2Q: a
# quarter of the cache for what was seen once). Four 512-token system prompts at the defaults.
RETAIN_SHARED_FACTOR = 4


class LlamaCppExecutor:
    name = "llamacpp"
    per_sequence_storage = True
    # llama.cpp's `llama` architecture has no windowed cache; a model declaring a window is served only
    # within it (`LlamaModel.check_window`), where the window never bites.
    sliding_window = None

    def __init__(self, gguf_path: str | Path, max_num_seqs: int = 32, max_model_len: int = 2048,
                 max_batch_tokens: int = 512, block_size: int = 16, kv_unified: bool = False,
                 kv_cells: int | None = None, flash_attn: bool = True, kv_dtype: str = "f16",
                 batch_invariant: bool = False,
                 threads: int | None = None, gpu_layers: int = 0, num_blocks: int | None = None,
                 retain_prefixes: int | None = None, retain_tokens: int | None = None, swap: bool = False):
        self.model = LlamaModel(gguf_path, gpu_layers)
        max_model_len = min(max_model_len, self.model.n_ctx_train)
        self.model.check_window(max_model_len, "--max-model-len")
        if batch_invariant and kv_unified:
            raise UserError("a unified KV pool is not batch-invariant (its kernels see the whole batch); use "
                            "--kv-layout per-slot with --batch-invariant")
        if kv_cells is not None and not kv_unified:
            raise UserError("--kv-cells sizes the unified pool; with --kv-layout per-slot each sequence gets "
                            "--max-model-len cells")
        # Retained prefixes in a unified pool need llama seq ids of their own. Per-slot, they stay in the
        # streams that their requests leave free (llama-server's slots keep each finished prompt), and a
        # request that starts with one takes its stream over (`adopt_retained`); not with swap
        # preemption (a stream restored from host memory must be empty) nor batch invariance (an adopted
        # prefix was computed in other chunks than the request's own).
        limit = self.model.lib.llama_max_parallel_sequences() - max_num_seqs
        if retain_prefixes is None:
            retain_prefixes = min(64, limit) if kv_unified else (0 if batch_invariant or swap else max_num_seqs)
        if retain_prefixes and not kv_unified and (batch_invariant or swap):
            raise UserError("per-slot streams keep finished prompts only without --batch-invariant and --preemption "
                            "swap; drop --retain-prefixes")
        if kv_unified and retain_prefixes > max(limit, 0):
            raise UserError(f"llama.cpp holds {limit + max_num_seqs} sequences per context: --max-num-seqs "
                            f"{max_num_seqs} leaves room for {max(limit, 0)} retained prefixes, not {retain_prefixes}")
        self.retain_prefixes = retain_prefixes
        self.adopt_retained = bool(retain_prefixes) and not kv_unified
        self.max_storage_ids = max_num_seqs if self.adopt_retained else None
        # Every token attends (masked) over the unified pool up to its highest used cell, so retained
        # cells cost every step compute, and more than their number: one kept high in the pool keeps
        # the attended extent there. Uncapped, bench/server.py's workloads ran at half speed after six
        # runs (docs/SERVER.md); one system prompt's worth stays cheap. The cap counts the cells only
        # retained prefixes hold (PagedKVManager's `retain_blocks`): running requests' are there anyway.
        # It holds for prompts that nothing shares; prefixes that a second request used may take
        # RETAIN_SHARED_FACTOR times as much (2Q's split), since each hit saves a whole prefill.
        if retain_tokens is None and retain_prefixes and kv_unified:  # per-slot: other streams cost nothing
            retain_tokens = DEFAULT_RETAIN_TOKENS
        self.retain_once_blocks = None if retain_tokens is None else retain_tokens // block_size
        self.retain_blocks = None if retain_tokens is None else RETAIN_SHARED_FACTOR * retain_tokens // block_size
        num_slots = max_num_seqs + (retain_prefixes if kv_unified else 0)
        self.ctx = LlamaContext(self.model, num_slots, max_model_len, unified=kv_unified, flash_attn=flash_attn,
                                kv_dtype=kv_dtype, threads=threads, max_tokens=max_batch_tokens,
                                total_cells=kv_cells if kv_cells is not None or not kv_unified
                                else max_num_seqs * max_model_len)
        self.kv_unified = kv_unified
        self.batch_invariant = batch_invariant
        self.vocab_size = self.model.vocab_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len, self.ctx.cells_per_slot)
        self.block_size = block_size
        # Per-slot streams hold max_model_len cells each: the manager's pool is their sum, so it never
        # runs out before the slots do, unless `num_blocks` budgets less. A unified pool is the context.
        self.num_blocks = min(num_blocks or self.ctx.n_ctx // block_size, self.ctx.n_ctx // block_size)
        # A restored sequence is bit-exact only where its cells do not mix with others' (one stream
        # each); in a unified pool the manager's block sharing would also no longer match the cells.
        self.supports_swap = not kv_unified
        self.storage = LlamaSeqStorage(self.ctx, kv_unified, num_slots)
        self.settings = {"kv_unified": kv_unified, "retain_prefixes": retain_prefixes, "retain_tokens": retain_tokens,
                         "flash_attn": flash_attn,
                         "kv_dtype": kv_dtype,
                         "threads": self.ctx.threads, "n_ctx": self.ctx.n_ctx, "gpu_layers": gpu_layers}

    def execute(self, plan: StepPlan) -> StepResult:
        for op in plan.kv_ops:
            op.apply_to(self.storage)
        t0 = time.perf_counter()
        logits: dict[int, np.ndarray] = {}
        calls = self._calls(plan.work)
        for n, call in enumerate(calls, 1):
            rows = [(self.storage.slot(w.seq_id), w.start_pos, w.token_ids, w.num_logits) for w in call]
            # The last call's logits stay in llama.cpp's buffer (StepResult: valid until the next
            # execute); at 16 sequences a copy is 3 MB a step. Earlier calls' are overwritten by later ones.
            out = self.ctx.decode(rows, copy=n < len(calls))
            i = 0
            for w in call:
                if w.num_logits:
                    logits[w.seq_id] = out[i:i + w.num_logits]
                    i += w.num_logits
        return StepResult(logits, time.perf_counter() - t0)

    def _calls(self, work: Sequence[SeqWork]) -> list[list[SeqWork]]:
        """Split a step into llama_decode calls of at most max_tokens tokens, never splitting one
        sequence's tokens; batch-invariant mode also groups sequences by token count (see module doc)."""
        if len(work) == 1:  # one sequence (every step at concurrency 1): one call
            return [list(work)]
        if not self.batch_invariant:
            # Per-slot, llama.cpp puts into one micro-batch only sequences whose ids follow each other
            # in batch order (`split_equal(sequential=true)`): 16 one-token decodes in another order
            # took 1.4-1.7x a step in several graphs. In slot order they are one.
            groups = [list(work) if self.kv_unified else sorted(work, key=lambda w: self.storage.slot(w.seq_id))]
        else:
            by_len = sorted(work, key=lambda w: (len(w.token_ids), self.storage.slot(w.seq_id)))
            groups = [list(g) for _, g in groupby(by_len, key=lambda w: len(w.token_ids))]
        calls: list[list[SeqWork]] = []
        for group in groups:
            current: list[SeqWork] = []
            size = 0
            for w in group:
                if current and size + len(w.token_ids) > self.ctx.max_tokens:
                    calls.append(current)
                    current, size = [], 0
                current.append(w)
                size += len(w.token_ids)
            if current:
                calls.append(current)
        return calls

    def describe(self) -> dict:
        return {"backend": self.name, "model": str(self.model.path), "max_num_seqs": self.max_num_seqs,
                "max_model_len": self.max_model_len, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "batch_invariant": self.batch_invariant, **self.settings}

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class LlamaDraft:
    """A draft GGUF for speculative decoding: one slot per target sequence, stepped one sequence at a
    time (`DraftModelProposer` drives it; `AdaptiveK` switches it off when its cost does not pay)."""

    def __init__(self, gguf_path: str | Path, max_num_seqs: int, max_model_len: int, threads: int | None = None):
        self.model = LlamaModel(gguf_path)
        self.ctx = LlamaContext(self.model, max_num_seqs, max_model_len, kv_dtype="f16", threads=threads)
        self.storage = LlamaSeqStorage(self.ctx, False, max_num_seqs)
        self.max_model_len = min(max_model_len, self.ctx.cells_per_slot)

    def proposer(self, seq_id: int) -> DraftModelProposer:
        def step(tokens: list[int], start_pos: int) -> torch.Tensor:
            out = self.ctx.decode([(self.storage.slot(seq_id), start_pos, tokens, 1)])
            return torch.from_numpy(out)  # [1, V]

        def rollback(length: int) -> None:
            self.storage.truncate(seq_id, length)

        return DraftModelProposer(step, rollback=rollback, max_len=self.max_model_len)

    def release(self, seq_id: int) -> None:
        self.storage.release(seq_id)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

