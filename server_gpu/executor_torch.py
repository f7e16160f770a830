"""The torch executor: our `Transformer` over the shared paged tensor storage (CPU or CUDA).

It is the reference implementation of the executor contract: the attention reads each sequence's
keys through its block table (`PagedBatch`), so prefix sharing, forks and copy-on-write are exactly
what the paged-KV manager planned. A sliding-window model (Mistral-style `sliding_window`) has the
manager drop the blocks behind the window, so each sequence's KV stays bounded however long it runs.
Rows of a step are grouped by how many tokens they feed, and each group runs as one padded forward,
so a 256-token prompt chunk does not pad 31 decode rows to 256.
Only the rows that need logits go through the LM head.
"""

from __future__ import annotations

import time
from itertools import groupby

import numpy as np
import torch

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.runtime.kv.paged_torch import BatchRow, PagedBatch, PagedTensorStorage, pad_batch
from edgefinfer.server_gpu.interface import SeqWork, StepPlan, StepResult


class TorchExecutor:
    name = "torch"
    per_sequence_storage = False
    retain_prefixes = 0  # a block-tensor pool caches freed blocks by itself
    retain_blocks = None
    retain_once_blocks = None
    adopt_retained = False
    max_storage_ids = None
    batch_invariant = False  # padded shapes change with the batch, and so can the kernels' rounding
    supports_swap = False  # preemption recomputes

    def __init__(self, model: Transformer, max_num_seqs: int = 32, max_model_len: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, device: str | torch.device | None = None,
                 kv_dtype: torch.dtype | None = None):
        cfg = model.config
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda but torch sees no CUDA device; use --device cpu")
        self.model = model.to(self.device).eval()
        self.vocab_size = cfg.vocab_size
        # The model masks by its windows from key positions, so when every layer slides the blocks
        # behind the window can go (a model with global layers keeps them all).
        self.sliding_window = cfg.uniform_window
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.block_size = block_size
        self.num_blocks = num_blocks or max_num_seqs * -(-self.max_model_len // block_size)
        dtype = kv_dtype or next(model.parameters()).dtype
        self.storage = PagedTensorStorage(cfg, self.num_blocks, block_size, dtype, self.device)

    def execute(self, plan: StepPlan) -> StepResult:
        for op in plan.kv_ops:
            op.apply_to(self.storage)
        t0 = time.perf_counter()
        logits: dict[int, np.ndarray] = {}
        by_len = sorted(plan.work, key=lambda w: len(w.token_ids))
        for _, group in groupby(by_len, key=lambda w: len(w.token_ids)):
            logits.update(self._forward(list(group)))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(logits, time.perf_counter() - t0)

    @torch.inference_mode()
    def _forward(self, work: list[SeqWork]) -> dict[int, np.ndarray]:
        bs = self.block_size
        rows = [BatchRow([w.block_table[p // bs] * bs + p % bs for p in range(w.start_pos, w.end_pos)],
                         w.block_table, w.end_pos) for w in work]
        tokens, pos = pad_batch([w.token_ids for w in work], [w.start_pos for w in work])  # [B, S]
        cache = PagedBatch(self.storage, rows, tokens.shape[1])
        hidden = self.model.hidden_states(tokens.to(self.device), pos.to(self.device), cache)[-1]  # [B, S, d]
        wanted = [(b, w) for b, w in enumerate(work) if w.num_logits]
        if not wanted:
            return {}
        picked = torch.cat([hidden[b, len(w.token_ids) - w.num_logits:len(w.token_ids)] for b, w in wanted])
        out = self.model.lm_head(picked).float().cpu().numpy()  # [sum(num_logits), V]
        result, i = {}, 0
        for _, w in wanted:
            result[w.seq_id] = out[i:i + w.num_logits]
            i += w.num_logits
        return result

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "max_num_seqs": self.max_num_seqs,
                "max_model_len": self.max_model_len, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "batch_invariant": self.batch_invariant, "sliding_window": self.sliding_window}

    def close(self) -> None:
        pass
