"""Importance scores and keep-masks for unstructured and N:M pruning (pure functions of tensors).

A weight matrix is [out, in] (nn.Linear's layout); "rows" are output channels, the "input dimension"
is the last one. A mask is a bool tensor of the weight's shape, True = keep.

- magnitude: |W|, compared across the whole matrix (the classic baseline, as the Wanda paper runs it).
- Wanda: |W_ij| * ||X_j||_2, where ||X_j||_2 is input channel j's l2 norm over the calibration tokens,
  compared within each output row (Sun et al. 2023: per-output comparison groups beat per-matrix ones
  for LLMs, and need no weight update).
- N:M: keep the N highest-scoring weights in every group of M consecutive weights along the input
  dimension (2:4 is what sparse tensor cores and some NPUs execute).
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgefinfer.errors import UserError

GROUPS = ("row", "matrix")


def check_sparsity(sparsity: float) -> float:
    if not (0.0 <= sparsity < 1.0):
        raise UserError(f"sparsity must be in [0, 1) (the fraction of weights set to zero), got {sparsity}")
    return float(sparsity)


def parse_pattern(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4): keep N of every M."""
    try:
        n, m = (int(p) for p in pattern.split(":"))
    except ValueError:
        raise UserError(f"sparsity pattern must look like N:M (e.g. 2:4), got {pattern!r}") from None
    if not 0 < n < m:
        raise UserError(f"sparsity pattern N:M needs 0 < N < M, got {pattern!r}")
    return n, m


def magnitude_scores(weight: Tensor) -> Tensor:
    return weight.detach().abs().float()  # [out, in]


def wanda_scores(weight: Tensor, input_norm: Tensor) -> Tensor:
    """|W| * ||X||_2 broadcast over rows: [out, in] x [in] -> [out, in]."""
    if input_norm.shape != weight.shape[1:]:
        raise ValueError(f"input norm {tuple(input_norm.shape)} does not match weight {tuple(weight.shape)}")
    return weight.detach().abs().float() * input_norm.float()[None, :]


def unstructured_mask(scores: Tensor, sparsity: float, group: str = "row") -> Tensor:
    """Drop exactly floor(sparsity * size) lowest scores per comparison group ("row" or "matrix").

    Ties are broken by position (topk is deterministic), so the count is exact whatever the scores.
    """
    check_sparsity(sparsity)
    if group not in GROUPS:
        raise UserError(f"comparison group must be one of {', '.join(GROUPS)}, got {group!r}")
    flat = scores if group == "row" else scores.reshape(1, -1)  # [G, n]
    return keep_all_but_lowest(flat, int(flat.shape[1] * sparsity)).reshape(scores.shape)


def keep_all_but_lowest(scores: Tensor, n_drop: int) -> Tensor:
    """Mask [G, n] dropping exactly the n_drop lowest scores of each row; ties go to the lower index.

    A k-th value threshold (O(n)) instead of topk (O(n log k), several times slower at k = n/2), with
    the ties at the threshold resolved by position, so the count is exact even on quantised weights
    whose magnitudes repeat.
    """
    if n_drop <= 0:
        return torch.ones_like(scores, dtype=torch.bool)
    thr = scores.kthvalue(n_drop, dim=1, keepdim=True).values  # [G, 1]
    below = scores < thr
    at = scores == thr
    room = n_drop - below.sum(1, keepdim=True)  # how many tied scores still to drop, per row
    return ~(below | (at & (at.cumsum(1) <= room)))


def n_m_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """Keep the n highest of every m consecutive scores along the last (input) dimension."""
    out_features, in_features = scores.shape
    if in_features % m:
        raise UserError(f"{n}:{m} sparsity needs an input dimension divisible by {m}, got {in_features}")
    groups = scores.reshape(out_features, in_features // m, m)  # [out, in/m, m]
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(n, dim=2).indices, True)
    return keep.reshape(out_features, in_features)


def n_m_violations(weight: Tensor, n: int, m: int) -> int:
    """How many groups of m along the input dimension hold more than n non-zeros (0 = valid N:M)."""
    groups = weight.reshape(weight.shape[0], -1, m)
    return int(((groups != 0).sum(-1) > n).sum())


def sparsity_of(weights: list[Tensor]) -> float:
    """Fraction of exact zeros over a list of tensors."""
    total = sum(w.numel() for w in weights)
    zeros = sum(int((w == 0).sum()) for w in weights)
    return zeros / total if total else 0.0
