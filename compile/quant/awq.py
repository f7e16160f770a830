"""AWQ (Lin et al., 2023): activation-aware per-input-channel scaling before round-to-nearest.

Channels that carry large activations matter most; scaling weight column c up by s_c (and its input
down by s_c) shrinks that column's relative rounding error. The input scaling is folded into the
operation that produces the input, so the model stays a plain Llama with no extra ops:

    input_layernorm           -> q_proj, k_proj, v_proj     (RMSNorm weight / s)
    post_attention_layernorm  -> gate_proj, up_proj         (RMSNorm weight / s)
    v_proj                    -> o_proj                     (v rows / s; only when every query head
                                                             has its own value head, so one scale per
                                                             channel is consistent)
    up_proj                   -> down_proj                  (up rows / s; silu(gate) * up is linear in up)

For each group, s = mean|x|^alpha (normalised so max * min = 1), alpha searched on a grid over
[0, 1) to minimise the squared error of the group's linear outputs on calibration activations.
s = 1 (plain RTN) is always a candidate, so the search never does worse than RTN on its own objective.

AutoAWQ departs from the paper in two ways, both here as options (AWQSettings), off by default:
* `duo`: s = mean|x|^alpha / mean|w|^(1 - alpha), where mean|w| is each input channel's magnitude
  relative to its quantization group's maximum, averaged over the consumers' rows;
* `objective="block"`: the q/k/v scales scored on the attention block's output (whole calibration
  sequences through RoPE and the softmax, o_proj float) and gate/up on the MLP's output, instead of
  each linear's own output.
Together (bench/quantize.py's `int4-awq-g32 autoawq` rows, increase over float on test / plays /
bible / code): the reference model +7.6 / +11.9 / +15.0 / +14.5% against the paper's +7.4 / +9.0 /
+16.9 / +10.8% (mixed), the student +8.1 / +7.9 / +5.3 / +2.9% against +6.6 / +4.3 / -3.4 / -0.6%
(worse on every domain). Each alone, on 2048 tokens per domain, was worse than the paper's on both
models as well.

Clipping search (the second half of AutoAWQ's `auto_clip`): after the scales are folded, each
group of each output row may round a narrower range than its own [min, max]: both ends shrink by a
ratio r in {1, 1 - 1/grid, ..., 1 - max_shrink}, the weights outside are clamped, and per (row,
group) the r with the least squared error of that group's contribution to the output, on sampled
calibration inputs, wins. r = 1 is plain RTN, so the clip never does worse on its objective. Like
AutoAWQ, q_proj and k_proj keep their full range: their error reaches the output through the
softmax, which a per-output-element squared error does not model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgefinfer.compile.quant.primitives import dequantize_int, quantize_int
from edgefinfer.compile.quant.recipe import AWQSettings, WeightFormat


@dataclass(frozen=True)
class ScalingGroup:
    producer: str  # the submodule whose output is the consumers' input (an RMSNorm or a Linear)
    consumers: tuple[str, ...]  # linears reading that input
    inputs: str  # the consumer whose captured input stands for the group's input


def scaling_groups(layer: nn.Module) -> list[ScalingGroup]:
    attn = layer.self_attn
    groups = [ScalingGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                           "self_attn.q_proj")]
    if attn.n_heads == attn.n_kv_heads:
        groups.append(ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    groups += [
        ScalingGroup(layer.mlp_norm_name, ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    return groups


def _fake_quant(w: Tensor, fmt: WeightFormat) -> Tensor:
    return dequantize_int(*quantize_int(w, fmt))


@torch.no_grad()
def weight_mean_rel(weights: list[Tensor], formats: list[WeightFormat | None]) -> Tensor:
    """Per input channel [K]: the mean over the quantized consumers' rows of |w| / max|w| of its
    quantization group, i.e. how much of its group's range the channel uses (AutoAWQ's w_mean)."""
    rel = []
    for w, fmt in zip(weights, formats):
        if fmt is None:
            continue
        n, k = w.shape
        g = fmt.group_size or k
        a = w.float().abs().reshape(n, k // g, g)
        rel.append((a / (a.amax(-1, keepdim=True) + 1e-6)).reshape(n, k))
    return torch.cat(rel).mean(0)


def linear_objective(x: Tensor, weights: list[Tensor], formats: list[WeightFormat | None]) -> Callable[[Tensor], float]:
    """loss(s): mean squared error of the consumers' own outputs on inputs x [T, K] when their weights
    are w * s rounded and their input is x / s (the paper's objective)."""
    x = x.float()
    quantized = [(w.float(), f) for w, f in zip(weights, formats) if f is not None]
    reference = [x @ w.T for w, _ in quantized]  # [T, N_i]
    size = x.shape[0] * sum(r.shape[1] for r in reference)

    def loss(s: Tensor) -> float:
        xs = x / s
        return sum(((xs @ _fake_quant(w * s, f).T - ref) ** 2).sum().item()
                   for (w, f), ref in zip(quantized, reference)) / size

    return loss


def block_objective(forward: Callable[[Tensor], Tensor], x: Tensor, consumers: list[nn.Linear],
                    formats: list[WeightFormat | None]) -> Callable[[Tensor], float]:
    """loss(s): mean squared error of a whole block's output, forward(x / s), when the consumers inside
    it hold their weights w * s rounded and everything else in it stays float (AutoAWQ scores the
    q/k/v scales on the attention output and the gate/up scales on the MLP output, so the error that
    passes through the softmax or the gate is what is measured)."""
    originals = [lin.weight.detach().clone() for lin in consumers]
    with torch.no_grad():
        reference = forward(x)

    @torch.no_grad()
    def loss(s: Tensor) -> float:
        try:
            for lin, w, f in zip(consumers, originals, formats):
                if f is not None:
                    lin.weight.copy_(_fake_quant(w.float() * s, f).to(w.dtype))
            out = forward(x / s)
        finally:
            for lin, w in zip(consumers, originals):
                lin.weight.copy_(w)
        return ((out.float() - reference.float()) ** 2).mean().item()

    return loss


@torch.no_grad()
def search_scale(x: Tensor, x_mean_abs: Tensor, weights: list[Tensor], formats: list[WeightFormat | None],
                 settings: AWQSettings, loss: Callable[[Tensor], float] | None = None) -> tuple[Tensor, float, float]:
    """Best per-channel scale s [K] for inputs x [T, K] feeding `weights` [N_i, K], scored by `loss`
    (default: `linear_objective`).

    Returns (s, loss with s, loss without scaling)."""
    loss = loss or linear_objective(x, weights, formats)
    best_s = torch.ones_like(x_mean_abs, dtype=torch.float32)
    rtn_loss = best_loss = loss(best_s)
    x_mean = x_mean_abs.float().clamp(min=1e-4)
    w_mean = weight_mean_rel(weights, formats) if settings.duo else None
    for i in range(settings.grid):
        alpha = i / settings.grid
        if w_mean is None:
            s = x_mean.pow(alpha)
        else:
            s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales so neither side drifts out of range
        current = loss(s)
        if current < best_loss:
            best_s, best_loss = s, current
    return best_s, best_loss, rtn_loss


@torch.no_grad()
def fold_scale(layer: nn.Module, group: ScalingGroup, s: Tensor) -> None:
    """Divide the producer's output channels by s and multiply the consumers' input columns by s
    (an exact rewrite of the float model)."""
    producer = layer.get_submodule(group.producer)
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s[:, None].to(producer.weight.dtype))
        if producer.bias is not None:
            producer.bias.div_(s.to(producer.bias.dtype))
    else:  # RMSNorm: y = weight * normalised(x)
        producer.weight.div_(s.to(producer.weight.dtype))
    for name in group.consumers:
        consumer = layer.get_submodule(name)
        consumer.weight.mul_(s[None, :].to(consumer.weight.dtype))


# Linears whose output error does not measure what matters (it passes through the attention softmax).
CLIP_SKIP: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")


@torch.no_grad()
def search_clip(x: Tensor, weight: Tensor, fmt: WeightFormat, settings: AWQSettings,
                chunk_rows: int = 256) -> tuple[Tensor, float, float]:
    """Per (output row, group) clip ratios [N, G] for `weight` [N, K] fed by inputs x [T, K].

    Returns (ratios, loss with them, loss without clipping), mean squared output errors."""
    N, K = weight.shape
    g = fmt.group_for(K)
    G = K // g
    xg = x.float().reshape(-1, G, g)  # [T, G, g]
    ratios = torch.ones(N, G)
    best_total, rtn_total = 0.0, 0.0
    candidates = [1 - i / settings.clip_grid for i in range(int(settings.clip_max_shrink * settings.clip_grid) + 1)]
    for r0 in range(0, N, chunk_rows):  # bounded memory: [T, G, rows] per candidate
        w = weight[r0: r0 + chunk_rows].float().reshape(-1, G, g)  # [n, G, g]
        reference = torch.einsum("tgk,ngk->tgn", xg, w)
        lo, hi = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
        best = torch.full((w.shape[0], G), float("inf"))
        for i, r in enumerate(candidates):
            clipped = torch.maximum(torch.minimum(w, hi * r), lo * r).reshape(-1, K)
            wq = dequantize_int(*quantize_int(clipped, fmt)).reshape(-1, G, g)
            err = (torch.einsum("tgk,ngk->tgn", xg, wq) - reference).pow(2).mean(0).T  # [n, G]
            if i == 0:
                rtn_total += err.sum().item()
            better = err < best
            best = torch.where(better, err, best)
            ratios[r0: r0 + chunk_rows][better] = r
        best_total += best.sum().item()
    return ratios, best_total / (N * G), rtn_total / (N * G)


@torch.no_grad()
def apply_clip(linear: nn.Module, ratios: Tensor, fmt: WeightFormat) -> None:
    """Clamp each group of each row of `linear.weight` to its shrunken [min, max] (in place)."""
    w = linear.weight
    N, K = w.shape
    G = ratios.shape[1]
    groups = w.data.float().reshape(N, G, K // G)
    r = ratios[..., None]
    lo, hi = groups.amin(-1, keepdim=True).clamp(max=0) * r, groups.amax(-1, keepdim=True).clamp(min=0) * r
    w.data.copy_(torch.maximum(torch.minimum(groups, hi), lo).reshape(N, K).to(w.dtype))
