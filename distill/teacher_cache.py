"""The teacher's top-k logits (and optionally some hidden states), computed once and memory-mapped from disk.

Layout of a cache folder (numpy .npy files, so `np.load(mmap_mode="r")` reads any row without loading
the rest; the trainer touches only the rows of its current batch):

    meta.json        key (fingerprint of teacher weights + tokens + k + T + layers), shapes, top-k coverage
    tokens.npy       int32   [N, S]      the token blocks the teacher saw
    values.npy       float32 [N, S, k]   the k largest raw logits z, descending
    indices.npy      int32   [N, S, k]   their token ids
    lse.npy          float32 [N, S]      logsumexp(z / T) over all V logits, at the run's temperature T
    hidden_<i>.npy   float32 [N, S, d]   hidden state i of `Transformer.hidden_states` (0 = embeddings)

Everything is float32: float16 would round a logit near 20 by up to 0.008, i.e. a probability by
0.8 %, and residual streams carry outliers beyond float16's range. How the top k and the lse become a
target distribution (the tail bucket, or renormalising over the top k) is `losses.forward_kl_topk`'s
business. The folder is written to a temporary sibling and renamed into place, so a half-built cache
is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from edgefinfer.files.atomic import atomic_dir
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CacheMeta:
    version: int
    key: str
    num_blocks: int
    block_len: int
    top_k: int
    temperature: float
    hidden_layers: tuple[int, ...]
    hidden_size: int
    coverage: float  # mean probability mass of the top k at the cache's temperature
    seconds: float


def fingerprint(teacher: Transformer, blocks: Tensor, top_k: int, hidden_layers: tuple[int, ...] = (),
                temperature: float = 1.0) -> str:
    """sha256 of everything the cache content depends on."""
    h = hashlib.sha256()
    h.update(json.dumps({"v": FORMAT_VERSION, "k": top_k, "T": float(temperature), "layers": list(hidden_layers),
                         "config": teacher.config.to_hf()}, sort_keys=True).encode())
    for name, tensor in sorted(teacher.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(blocks.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


class TeacherCache:
    """Read side: memory-mapped arrays, rows fetched per batch."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise UserError(f"{self.path} is not a teacher cache (no meta.json); delete it and rerun to rebuild")
        raw = json.loads(meta_file.read_text())
        raw["hidden_layers"] = tuple(raw["hidden_layers"])
        self.meta = CacheMeta(**raw)
        load = lambda name: np.load(self.path / f"{name}.npy", mmap_mode="r")  # noqa: E731
        self.tokens, self.values, self.indices, self.lse = load("tokens"), load("values"), load("indices"), load("lse")
        self.hidden = {i: load(f"hidden_{i}") for i in self.meta.hidden_layers}

    def __len__(self) -> int:
        return self.meta.num_blocks

    def batch(self, rows: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """tokens [b, S] int64, values [b, S, k], indices [b, S, k] int64, lse [b, S], hidden_<i> [b, S, d]."""
        idx = np.asarray(rows)
        out = {
            "tokens": torch.from_numpy(self.tokens[idx].astype(np.int64)),
            "values": torch.from_numpy(np.ascontiguousarray(self.values[idx])),
            "indices": torch.from_numpy(self.indices[idx].astype(np.int64)),
            "lse": torch.from_numpy(np.ascontiguousarray(self.lse[idx])),
        }
        for i, arr in self.hidden.items():
            out[f"hidden_{i}"] = torch.from_numpy(arr[idx].astype(np.float32))
        return {k: v.to(device) for k, v in out.items()}


def _check_layers(teacher: Transformer, hidden_layers: tuple[int, ...]) -> None:
    n = teacher.config.num_hidden_layers
    for i in hidden_layers:
        if not 0 <= i <= n:
            raise UserError(f"teacher hidden state {i} does not exist: use 0 (embeddings) to {n} (final, normalised)")


@torch.inference_mode()
def build_teacher_cache(teacher: Transformer, blocks: Tensor, path: str | Path, top_k: int = 64,
                        hidden_layers: tuple[int, ...] = (), temperature: float = 1.0, batch_size: int | None = None,
                        log: Callable[[str], None] | None = None, key: str | None = None) -> TeacherCache:
    """Run the teacher once over `blocks` [N, S] and store its top-k logits at `path` (reused when it matches).

    `key` is `fingerprint(teacher, blocks, top_k, hidden_layers, temperature)` when the caller has it already.
    """
    path = Path(path)
    V = teacher.config.vocab_size
    if not 0 < top_k <= V:
        raise UserError(f"top-k must be in 1..{V} (the vocabulary), got {top_k}")
    if temperature <= 0:
        raise UserError(f"temperature must be positive, got {temperature}")
    _check_layers(teacher, hidden_layers)
    key = key or fingerprint(teacher, blocks, top_k, hidden_layers, temperature)
    if (path / "meta.json").is_file():
        existing = TeacherCache(path)
        if existing.meta.key == key:
            if log:
                log(f"teacher cache: reusing {path} ({existing.meta.num_blocks} blocks, top-{top_k})")
            return existing
        if log:
            log(f"teacher cache: {path} was made from another teacher or corpus; rebuilding")
    N, S = blocks.shape
    d = teacher.config.hidden_size
    # Blocks per teacher forward: as many as keep the float32 logits [b, S, V] near 256 MB.
    batch_size = batch_size or max(1, min(64, 2**28 // (S * V * 4)))
    device = teacher.lm_head.weight.device
    t0 = time.perf_counter()
    with atomic_dir(path) as tmp:
        create = lambda name, dtype, shape: np.lib.format.open_memmap(tmp / f"{name}.npy", "w+", dtype, shape)  # noqa: E731
        tokens = create("tokens", np.int32, (N, S))
        values = create("values", np.float32, (N, S, top_k))
        indices = create("indices", np.int32, (N, S, top_k))
        lse = create("lse", np.float32, (N, S))
        hidden = {i: create(f"hidden_{i}", np.float32, (N, S, d)) for i in hidden_layers}
        mass, last_log = 0.0, t0
        for begin in range(0, N, batch_size):
            b = blocks[begin: begin + batch_size].to(device)  # [b, S]
            states = teacher.hidden_states(b)
            logits = teacher.lm_head(states[-1]).float()  # [b, S, V]
            top = logits.topk(top_k, dim=-1)
            end = begin + b.shape[0]
            tokens[begin:end] = b.cpu().numpy()
            values[begin:end] = top.values.cpu().numpy()
            indices[begin:end] = top.indices.cpu().numpy()
            z = torch.logsumexp(logits / temperature, dim=-1)  # [b, S]
            lse[begin:end] = z.cpu().numpy()
            mass += (top.values / temperature - z[..., None]).exp().sum(-1).sum().item()
            for i, arr in hidden.items():
                arr[begin:end] = states[i].float().cpu().numpy()
            now = time.perf_counter()
            if log and (end == N or now - last_log > 10):
                last_log = now
                log(f"teacher cache: {end}/{N} blocks  {end * S / (now - t0):.0f} tok/s")
        for arr in (tokens, values, indices, lse, *hidden.values()):
            arr.flush()
        del tokens, values, indices, lse, hidden
        meta = CacheMeta(FORMAT_VERSION, key, N, S, top_k, float(temperature), tuple(hidden_layers), d, mass / (N * S),
                         round(time.perf_counter() - t0, 2))
        (tmp / "meta.json").write_text(json.dumps(asdict(meta), indent=2) + "\n")
    return TeacherCache(path)
