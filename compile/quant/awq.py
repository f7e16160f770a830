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

For each group, s = mean|x|^alpha (normalised to geometric mean 1), alpha searched on a grid over
[0, 1) to minimise the squared error of the group's linear outputs on calibration activations.
alpha = 0 is plain RTN, so the search never does worse than RTN on its own objective.
"""

from __future__ import annotations

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
        ScalingGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj"),
        ScalingGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ]
    return groups


def _fake_quant(w: Tensor, fmt: WeightFormat) -> Tensor:
    return dequantize_int(*quantize_int(w, fmt))


@torch.no_grad()
def search_scale(x: Tensor, x_mean_abs: Tensor, weights: list[Tensor], formats: list[WeightFormat | None],
                 settings: AWQSettings) -> tuple[Tensor, float, float]:
    """Best per-channel scale s [K] for inputs x [T, K] feeding `weights` [N_i, K].

    Returns (s, loss with s, loss without scaling); losses are mean squared output errors."""
    x = x.float()
    quantized = [(w.float(), f) for w, f in zip(weights, formats) if f is not None]
    reference = [x @ w.T for w, _ in quantized]  # [T, N_i]

    def loss(s: Tensor) -> float:
        xs = x / s
        total = sum(((xs @ _fake_quant(w * s, f).T - ref) ** 2).sum().item()
                    for (w, f), ref in zip(quantized, reference))
        return total / (x.shape[0] * sum(r.shape[1] for r in reference))

    best_s, best_loss = torch.ones_like(x_mean_abs), float("inf")
    base = x_mean_abs.clamp(min=1e-4)
    rtn_loss = float("nan")
    for i in range(settings.grid):
        alpha = i / settings.grid
        s = base.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre the scales so neither side drifts out of range
        current = loss(s)
        if i == 0:
            rtn_loss = current
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
