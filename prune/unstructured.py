"""Unstructured and N:M pruning of a whole model: magnitude, Wanda, SparseGPT.

Every Linear inside the decoder layers is pruned (q, k, v, o, gate, up, down); embeddings, norms and
lm_head stay dense. Shapes do not change: pruned weights are stored as zeros, so the checkpoint is a
normal HF folder and a sparse kernel (or a compressor) can exploit the zeros.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.calibration import LINEAR_NAMES, InputStats, LayerwiseRunner
from edgefinfer.prune.masks import (check_sparsity, magnitude_scores, n_m_mask, unstructured_mask,
                                    wanda_scores)
from edgefinfer.prune.sparsegpt import sparsegpt_prune

METHODS = ("magnitude", "wanda", "sparsegpt")
# Where weights compete for survival: the Wanda paper's choices (per output row for Wanda; the whole
# matrix for magnitude, its strongest baseline setting).
DEFAULT_GROUP = {"magnitude": "matrix", "wanda": "row", "sparsegpt": "row"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class UnstructuredSpec:
    method: str
    sparsity: float = 0.5  # fraction of zeros; with `pattern` it is implied (1 - n/m)
    pattern: tuple[int, int] | None = None  # (n, m): keep n of every m along the input dimension
    layer_sparsity: tuple[float, ...] | None = None  # per decoder layer (from a sensitivity allocation)
    group: str | None = None  # "row" | "matrix"; None = the method's default

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown pruning method {self.method!r}; use one of {', '.join(METHODS)}")
        check_sparsity(self.sparsity)
        for s in self.layer_sparsity or ():
            check_sparsity(s)
        if self.pattern is not None and self.layer_sparsity is not None:
            raise UserError("an N:M pattern fixes the sparsity of every layer; drop the per-layer allocation")

    @property
    def target_sparsity(self) -> float:
        return 1 - self.pattern[0] / self.pattern[1] if self.pattern else self.sparsity

    def sparsity_of_layer(self, index: int, num_layers: int) -> float:
        if self.layer_sparsity is None:
            return self.target_sparsity
        if len(self.layer_sparsity) != num_layers:
            raise UserError(f"per-layer sparsity lists {len(self.layer_sparsity)} values; the model has "
                            f"{num_layers} layers")
        return self.layer_sparsity[index]


def prune_weight(weight: Tensor, spec: UnstructuredSpec, sparsity: float, stats: InputStats | None) -> Tensor:
    """The pruned version of one weight [out, in] (SparseGPT also updates the survivors)."""
    if spec.method == "sparsegpt":
        assert stats is not None
        return sparsegpt_prune(weight, stats.hessian(), sparsity, spec.pattern)
    scores = magnitude_scores(weight) if spec.method == "magnitude" else wanda_scores(weight, stats.norm)  # type: ignore[union-attr]
    if spec.pattern is not None:
        keep = n_m_mask(scores, *spec.pattern)
    else:
        keep = unstructured_mask(scores, sparsity, spec.group or DEFAULT_GROUP[spec.method])
    return weight * keep


@torch.no_grad()
def prune_unstructured(model: Transformer, spec: UnstructuredSpec, calib: Tensor | None = None,
                       chunk: int = 8, log: Log | None = None) -> Transformer:
    """Prune `model` in place. Wanda and SparseGPT need calibration blocks [N, S] (sequential, see calibration.py)."""
    layers = model.model.layers
    needs_data = spec.method != "magnitude"
    if needs_data and calib is None:
        raise UserError(f"{spec.method} pruning needs calibration data (token blocks from the calib split)")
    runner = LayerwiseRunner(model, calib, chunk) if needs_data else None
    t0 = time.perf_counter()
    for i, layer in enumerate(layers):
        sparsity = spec.sparsity_of_layer(i, len(layers))
        stats = runner.collect(layer, gram=spec.method == "sparsegpt") if runner else {}
        for name in LINEAR_NAMES:
            linear = layer.get_submodule(name)
            linear.weight.copy_(prune_weight(linear.weight, spec, sparsity, stats.get(name)))
        if runner:
            runner.advance(layer)  # the next layer sees this layer's pruned output
        if log:
            log(f"  pruned layer {i + 1}/{len(layers)} ({spec.method}, sparsity {sparsity:.3f}) "
                f"{time.perf_counter() - t0:.1f}s")
    return model


def linear_weights(model: Transformer) -> list[Tensor]:
    """The weights pruning acts on, in layer order."""
    return [layer.get_submodule(n).weight for layer in model.model.layers for n in LINEAR_NAMES]


def layer_sparsities(model: Transformer) -> list[float]:
    """Measured fraction of zeros in each decoder layer's Linear weights."""
    out = []
    for layer in model.model.layers:
        ws = [layer.get_submodule(n).weight for n in LINEAR_NAMES]
        out.append(sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws))
    return out


def nonzero_parameters(model: Transformer) -> int:
    """Parameters that are not exactly zero (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += int((p != 0).sum())
    return total


def parse_layer_sparsity(values: Sequence[float] | str) -> tuple[float, ...]:
    if isinstance(values, str):
        try:
            values = [float(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"per-layer sparsity must be comma-separated numbers, got {values!r}") from None
    return tuple(check_sparsity(float(v)) for v in values)
