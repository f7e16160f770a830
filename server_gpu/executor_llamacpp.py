"""The llama.cpp executor: one llama context, many sequences, one `llama_batch` per forward.

The paged-KV manager decides; llama.cpp's memory holds the data. `LlamaSeqStorage` follows the
manager's decisions with `llama_memory_*` calls on llama sequence ids ("slots"), as
`edgefinfer.runtime.kv.storage` describes: prefix sharing and forks copy a sequence
(`seq_cp`), rollback and release remove cells (`seq_rm`).

Two memory layouts (`kv_unified`):

* False (default): one KV stream per slot, each `max_model_len` cells. Attention of a sequence
  then runs over its own stream with kernels chosen by its own token count, so its logits do not
  depend on its batch neighbours (`batch_invariant`): 16 concurrent greedy requests return
  exactly what each returns alone. A cross-stream `seq_cp` copies the whole stream (llama.cpp only
  copies full streams), then `seq_rm` cuts it to the shared prefix.
* True: one pool of cells for all sequences; `seq_cp` shares cells (a prefix costs memory once),
  and any mix of sequences fits as long as the total does. llama.cpp's kernels then see the whole
  batch as one attention problem and pick their paths from its size, so a sequence's logits change
  with its neighbours: not batch-invariant (reference model, 16 concurrent greedy requests: logprobs
  off by up to 0.12, and 9 of 16 continuations diverged within 32 tokens; see docs/SERVER.md).

Batch invariance also needs each sequence's tokens to reach llama.cpp as the same runs: llama.cpp
splits a multi-stream batch into micro-batches of equal tokens per sequence, so a 16-token chunk
next to 1-token decodes would be cut into 1 + 15. `execute` therefore runs one `llama_decode` per
group of sequences feeding the same number of tokens.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path

import numpy as np
import torch

from edgefinfer.errors import UserError
from edgefinfer.runtime.kv.paged_manager import CopyOp, SeqId
from edgefinfer.runtime.speculative.proposers import DraftModelProposer
from edgefinfer.server_gpu.interface import SeqWork, StepPlan, StepResult

_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids


def llama_cpp_lib():
    try:
        import llama_cpp
    except ImportError:
        raise UserError("llama-cpp-python is not installed: pip install 'edgefinfer[llamacpp]' (it builds "
                        "from source; see the README for CUDA)") from None
    return llama_cpp


_log_callback = None


def _silence(lib) -> None:
    """Route llama.cpp's log lines nowhere (they go to stderr by default). Kept alive globally: the C
    side holds the pointer."""
    global _log_callback
    if _log_callback is None:
        _log_callback = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(_log_callback, None)
        lib.llama_backend_init()


class LlamaModel:
    """A loaded GGUF; freed with `close`."""

    def __init__(self, path: str | Path, gpu_layers: int = 0):
        self.lib = lib = llama_cpp_lib()
        _silence(lib)
        self.path = Path(path)
        if not self.path.is_file():
            raise UserError(f"GGUF file {self.path} does not exist")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise UserError(f"llama.cpp could not load {self.path}; is it a GGUF file of a supported model?")
        self.vocab = lib.llama_model_get_vocab(self.ptr)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.ptr)

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_model_free(self.ptr)
            self.ptr = None


class LlamaContext:
    """One llama context with `num_slots` sequences and a reusable batch of `max_tokens` tokens."""

    def __init__(self, model: LlamaModel, num_slots: int, cells_per_slot: int, unified: bool, flash_attn: bool,
                 kv_dtype: str, threads: int | None, max_tokens: int, total_cells: int | None = None):
        lib = self.lib = model.lib
        if kv_dtype not in _KV_TYPES:
            raise UserError(f"unknown KV dtype {kv_dtype!r}: use one of {', '.join(_KV_TYPES)}")
        limit = lib.llama_max_parallel_sequences()
        if not 1 <= num_slots <= limit:
            raise UserError(f"llama.cpp holds 1 to {limit} sequences per context, not {num_slots}")
        p = lib.llama_context_default_params()
        p.n_ctx = total_cells if total_cells is not None else num_slots * cells_per_slot
        p.n_batch = p.n_ubatch = max_tokens
        p.n_seq_max = num_slots
        p.kv_unified = unified
        p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = _KV_TYPES[kv_dtype]
        n = threads or os.cpu_count() or 1
        p.n_threads = p.n_threads_batch = n
        self.model = model
        self.ptr = lib.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise UserError(f"llama.cpp could not create a context of {p.n_ctx} cells for {num_slots} sequences; "
                            f"lower --max-num-seqs or --max-model-len")
        self.mem = lib.llama_get_memory(self.ptr)
        self.n_ctx = lib.llama_n_ctx(self.ptr)
        self.cells_per_slot = lib.llama_n_ctx_seq(self.ptr) if not unified else self.n_ctx
        self.max_tokens = max_tokens
        self.batch = lib.llama_batch_init(max_tokens, 0, 1)
        self.threads = n

    def decode(self, rows: Sequence[tuple[int, int, Sequence[int], int]]) -> np.ndarray:
        """rows: (llama seq id, start position, tokens, how many trailing tokens want logits), at most
        `max_tokens` tokens in all -> float32 logits [rows that wanted them, V], in row order."""
        b, lib = self.batch, self.lib
        i = 0
        for seq, start, tokens, num_logits in rows:
            first_logit = len(tokens) - num_logits
            for j, tok in enumerate(tokens):
                b.token[i] = tok
                b.pos[i] = start + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = seq
                b.logits[i] = j >= first_logit
                i += 1
        b.n_tokens = i
        rc = lib.llama_decode(self.ptr, b)
        if rc != 0:
            # 1: no KV slot. The manager sizes conservatively, so this is a bug, not a user error.
            raise RuntimeError(f"llama_decode failed with code {rc} on a batch of {i} tokens")
        n_out = sum(r[3] for r in rows)
        if n_out == 0:
            return np.empty((0, self.model.vocab_size), dtype=np.float32)
        return np.ctypeslib.as_array(lib.llama_get_logits(self.ptr), shape=(n_out, self.model.vocab_size)).copy()

    def close(self) -> None:
        if self.ptr:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ptr)
            self.ptr = None


class LlamaSeqStorage:
    """`KVStorage` over llama.cpp sequences: maps manager sequence ids to llama seq ids (slots)."""

    def __init__(self, ctx: LlamaContext, unified: bool, num_slots: int):
        self.ctx, self.lib, self.unified = ctx, ctx.lib, unified
        self._free = list(range(num_slots))  # lowest slot first: keeps running sequences contiguous
        self._slots: dict[SeqId, int] = {}
        self._swapped: dict[SeqId, ctypes.Array] = {}  # host copies of preempted sequences

    def slot(self, seq_id: SeqId) -> int:
        """The llama seq id of a sequence; a new sequence takes the lowest free one."""
        s = self._slots.get(seq_id)
        if s is None:
            if not self._free:
                raise RuntimeError("no free llama sequence slot: the scheduler admitted too many sequences")
            self._free.sort()
            s = self._slots[seq_id] = self._free.pop(0)
        return s

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
        self.lib.llama_memory_seq_rm(self.ctx.mem, self.slot(seq_id), num_tokens, -1)

    def release(self, seq_id: SeqId) -> None:
        s = self._slots.pop(seq_id, None)
        if s is not None:
            self.lib.llama_memory_seq_rm(self.ctx.mem, s, -1, -1)
            self._free.append(s)

    # ---- SwappableStorage (llama_state_seq_*: restores bit-exactly into any slot) -----------------
    def swap_out(self, seq_id: SeqId) -> None:
        slot, lib = self.slot(seq_id), self.lib
        size = lib.llama_state_seq_get_size(self.ctx.ptr, slot)
        buf = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(self.ctx.ptr, buf, size, slot) != size:
            raise RuntimeError(f"llama_state_seq_get_data could not save sequence {seq_id!r}")
        self._swapped[seq_id] = buf

    def swap_in(self, seq_id: SeqId) -> None:
        buf = self._swapped.pop(seq_id)
        slot = self.slot(seq_id)
        self.lib.llama_memory_seq_rm(self.ctx.mem, slot, -1, -1)
        if self.lib.llama_state_seq_set_data(self.ctx.ptr, buf, len(buf), slot) != len(buf):
            raise RuntimeError(f"llama_state_seq_set_data could not restore sequence {seq_id!r}")

    def drop_swapped(self, seq_id: SeqId) -> None:
        self._swapped.pop(seq_id, None)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def _copy(self, src: SeqId, dst: SeqId, num_tokens: int) -> None:
        s, d = self.slot(src), self.slot(dst)
        if self.unified:
            self.lib.llama_memory_seq_cp(self.ctx.mem, s, d, 0, num_tokens)  # shares the cells
        else:
            # Across streams llama.cpp copies whole streams only (a partial range aborts the process).
            self.lib.llama_memory_seq_cp(self.ctx.mem, s, d, -1, -1)
            self.lib.llama_memory_seq_rm(self.ctx.mem, d, num_tokens, -1)


class LlamaCppExecutor:
    name = "llamacpp"
    per_sequence_storage = True

    def __init__(self, gguf_path: str | Path, max_num_seqs: int = 32, max_model_len: int = 2048,
                 max_batch_tokens: int = 512, block_size: int = 16, kv_unified: bool = False,
                 kv_cells: int | None = None, flash_attn: bool = False, kv_dtype: str = "f32",
                 threads: int | None = None, gpu_layers: int = 0, num_blocks: int | None = None):
        self.model = LlamaModel(gguf_path, gpu_layers)
        max_model_len = min(max_model_len, self.model.n_ctx_train)
        if kv_cells is not None and not kv_unified:
            raise UserError("--kv-cells sizes the shared pool of --kv-unified; without it each sequence gets "
                            "--max-model-len cells")
        self.ctx = LlamaContext(self.model, max_num_seqs, max_model_len, kv_unified, flash_attn, kv_dtype, threads,
                                max_batch_tokens, total_cells=kv_cells)
        self.kv_unified = kv_unified
        self.batch_invariant = not kv_unified
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
        self.storage = LlamaSeqStorage(self.ctx, kv_unified, max_num_seqs)
        self.settings = {"kv_unified": kv_unified, "flash_attn": flash_attn, "kv_dtype": kv_dtype,
                         "threads": self.ctx.threads, "n_ctx": self.ctx.n_ctx, "gpu_layers": gpu_layers}

    def execute(self, plan: StepPlan) -> StepResult:
        for op in plan.kv_ops:
            op.apply_to(self.storage)
        t0 = time.perf_counter()
        logits: dict[int, np.ndarray] = {}
        for call in self._calls(plan.work):
            rows = [(self.storage.slot(w.seq_id), w.start_pos, w.token_ids, w.num_logits) for w in call]
            out = self.ctx.decode(rows)
            i = 0
            for w in call:
                if w.num_logits:
                    logits[w.seq_id] = out[i:i + w.num_logits]
                    i += w.num_logits
        return StepResult(logits, time.perf_counter() - t0)

    def _calls(self, work: Sequence[SeqWork]) -> list[list[SeqWork]]:
        """Split a step into llama_decode calls of at most max_tokens tokens, never splitting one
        sequence's tokens; per-stream layouts also group sequences by token count (see module doc)."""
        if self.kv_unified:
            groups = [list(work)]
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
        self.ctx = LlamaContext(self.model, max_num_seqs, max_model_len, False, False, "f16", threads, 512)
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


def tokenizer_matches(model: LlamaModel, tokenizer, texts: Sequence[str]) -> bool:
    """Whether our tokenizer splits `texts` exactly like llama.cpp's own (a load-time sanity check)."""
    lib = model.lib
    for text in texts:
        raw = text.encode()
        buf = (lib.llama_token * (len(raw) + 8))()
        n = lib.llama_tokenize(model.vocab, raw, len(raw), buf, len(buf), False, True)
        if n < 0 or list(buf[:n]) != tokenizer.encode(text):
            return False
    return True

