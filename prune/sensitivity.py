"""Per-layer sensitivity and the sparsity allocation it implies.

Sensitivity of decoder layer i = perplexity with only layer i pruned (at the target sparsity, by the
chosen method) minus the dense perplexity, measured on held-out calibration blocks. Layers whose
pruning hurts least then get more sparsity and the sensitive ones less:

    s_i = target + spread * (1 - 2 * r_i / (L - 1)),   r_i = rank of layer i, 0 = least sensitive

The ranks are a permutation of 0..L-1, so the s_i average exactly to the target (every layer of a
uniform config has the same number of prunable weights, so the model's sparsity is the target too).
Ranks rather than raw deltas keep one outlier layer from taking the whole budget (the same reasoning
as OWL's bounded, linear allocation).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.calibration import LINEAR_NAMES, collect_all
from edgefinfer.prune.masks import check_sparsity
from edgefinfer.prune.unstructured import UnstructuredSpec, prune_weight


@torch.no_grad()
def block_perplexity(model: Transformer, blocks: Tensor, chunk: int = 4) -> float:
    """exp(mean next-token NLL) over token blocks [N, S] (each block scored on its own)."""
    device = model.lm_head.weight.device
    nll, count = 0.0, 0
    for begin in range(0, blocks.shape[0], chunk):
        b = blocks[begin: begin + chunk].to(device)  # [n, S]
        logits = model(b)[:, :-1].float()  # [n, S-1, V]
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        count += b[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def layer_sensitivity(model: Transformer, spec: UnstructuredSpec, calib: Tensor, eval_blocks: Tensor,
                      log: Callable[[str], None] | None = None) -> list[float]:
    """Perplexity increase on `eval_blocks` when only layer i is pruned by `spec` (model left unchanged)."""
    stats = collect_all(model, calib, gram=spec.method == "sparsegpt") if spec.method != "magnitude" else None
    dense = block_perplexity(model, eval_blocks)
    deltas = []
    for i, layer in enumerate(model.model.layers):
        saved = {n: layer.get_submodule(n).weight.clone() for n in LINEAR_NAMES}
        for name in LINEAR_NAMES:
            w = layer.get_submodule(name).weight
            w.copy_(prune_weight(w, spec, spec.target_sparsity, stats[i][name] if stats else None))
        deltas.append(block_perplexity(model, eval_blocks) - dense)
        for name, w in saved.items():
            layer.get_submodule(name).weight.copy_(w)
        if log:
            log(f"  sensitivity layer {i + 1}/{len(model.model.layers)}: +{deltas[-1]:.3f} ppl")
    return deltas


def allocate_sparsity(sensitivity: list[float], target: float, spread: float = 0.1) -> tuple[float, ...]:
    """Per-layer sparsities averaging exactly to `target`: least sensitive layer target + spread, most target - spread."""
    check_sparsity(target)
    L = len(sensitivity)
    if L == 0:
        raise UserError("sensitivity allocation needs at least one layer")
    if spread < 0 or target - spread < 0 or target + spread >= 1:
        raise UserError(f"sparsity {target} +/- spread {spread} must stay within [0, 1); lower the spread")
    if L == 1:
        return (target,)
    order = sorted(range(L), key=lambda i: (sensitivity[i], i))  # stable: ties keep layer order
    rank = {layer: r for r, layer in enumerate(order)}
    return tuple(target + spread * (1 - 2 * rank[i] / (L - 1)) for i in range(L))
