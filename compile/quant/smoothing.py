"""Activation smoothing for int8-activation recipes, by powers of two over whole weight groups.

    factors = smoothing_exponents(model, calib, plan)   # {layer: int exponents per group of down_proj's input}
    smooth_mlp_inputs(model, factors)                   # in place; in float the model is unchanged, bit for bit

Dynamic int8 activations (8da4w, 8da8w: XNNPACK's dynamically quantized linear) quantize each token's
row with one step, so a few large channels set the step for all the others. The input of a gated
MLP's down projection is the worst: Gemma 3 270M's reaches 5-9x its median group in most layers, and
the int8 rounding of it alone costs +2.3 points of its +5.2% bible perplexity (eager, 8da4w-g32-fzp).
SmoothQuant (Xiao et al., 2022) divides such channels by s and multiplies the next linear's columns by
s. Here s is a power of two and constant over each quantization group of the down projection's input:
- the division folds into the rows of the up projection (act(gate) * up is linear in up), and a power
  of two scales exactly, so the float model computes what it did, bit for bit;
- a weight group scaled by 2^e keeps its grid (its scale and bottom scale exactly): weights converted
  from a GGUF stay on their source grid, and a group's rounding error is the same relative to its
  weights, so only the activations' rounding changes;
- down projections quantized per channel (one group: the whole row) are left alone, and so are layers
  whose up projection is fp8 (a row scaled down could fall below its smallest normal).

    e_g = round(alpha * log2(a_g / median_g a_g)), clamped at 0,  a_g = max |x| over group g on `calib`

alpha is chosen per layer, as AWQ chooses its scales: from 0 (no smoothing) to 1, the one whose down
projection, quantized as the recipe says with its int8 activations, comes closest to the float
output on the calibration inputs (per-token relative error); a layer where no alpha beats 0 is left
alone.

An opt-in recipe suffix (`-smooth`), not a default, because it does not help every model. Measured
(bench/results/gemma3.json `smoothing`, eager, 8da4w-g32-fzp vs 8da4w-g32-fzp-smooth, test / plays /
bible / code): Gemma 3 270M +2.54 / +2.53 / +5.15 / +4.01% -> +2.29 / +4.14 / +3.26 / +2.35% (9 of 18
layers smoothed); SmolLM2-135M +0.05 / +3.67 / +1.71 / +0.99% -> +1.14 / +5.13 / +0.65 / +0.91% (3 of
30). SmolLM2's largest input channel (3170x the median group in layer 11) is a few tokens' massive
activation, not a channel that is large on every token: SmoothQuant's fixed alpha 0.5 gave it test
+1.03% / plays +5.32%, and this search on absolute rather than relative error +2.65% on test (one-off
eager runs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edgefinfer.compile.quant.calibrate import observe_inputs
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.primitives import quantize_int
from edgefinfer.compile.quant.recipe import WeightFormat
from edgefinfer.model.transformer import Transformer

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)  # the per-layer search (0: unsmoothed)
MAX_EXPONENT = 12  # 4096x: far beyond any measured outlier, and safe from fp16 underflow of the scales
SAMPLED_TOKENS = 1024  # calibration inputs kept per layer for the search


def down_proj_group(plan: dict[str, WeightFormat | None], layer: int, in_features: int) -> int | None:
    """The group size of layer `layer`'s down projection input, when it is quantized in integer groups
    (the only case a per-group power of two leaves exact); None otherwise."""
    fmt = plan.get(f"model.layers.{layer}.mlp.down_proj")
    if fmt is None or fmt.kind != "int" or fmt.group_size is None or fmt.group_size >= in_features:
        return None
    up = plan.get(f"model.layers.{layer}.mlp.up_proj")
    if up is not None and up.kind != "int":
        return None  # an fp8 row scaled by 2^-e could fall below its smallest normal
    return fmt.group_size


@torch.no_grad()
def sampled_inputs(model: Transformer, calib: Tensor, layers: list[int], tokens: int = SAMPLED_TOKENS,
                   batch_size: int = 8) -> dict[int, Tensor]:
    """Per layer in `layers`, up to `tokens` rows [T, F] of the down projection's input over `calib`
    [N, S] (the float model), sampled with a fixed seed."""
    seen: dict[int, list[Tensor]] = {i: [] for i in layers}
    observe_inputs(model, calib, {i: model.model.layers[i].mlp.down_proj for i in layers},
                   lambda i, x: seen[i].append(x), batch_size)
    out = {}
    for i, parts in seen.items():
        x = torch.cat(parts)
        if x.shape[0] > tokens:
            x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))[:tokens]]
        out[i] = x
    return out


def exponents(absmax: Tensor, group: int, alpha: float) -> Tensor:
    """[F] channel maxima -> int [F / group] exponents: e_g = round(alpha * log2(a_g / median)), >= 0."""
    a = absmax.reshape(-1, group).amax(1).clamp(min=torch.finfo(torch.float32).tiny)  # [G]
    e = torch.round(alpha * torch.log2(a / a.median()))
    return e.clamp(0, MAX_EXPONENT).to(torch.int64)


def powers(e: Tensor, group: int) -> Tensor:
    """int exponents [G] -> float factors 2^e repeated over each group's channels [G * group]."""
    return torch.ldexp(torch.ones(e.numel()), e.to(torch.int32)).repeat_interleave(group)


@torch.no_grad()
def output_error(down: nn.Linear, fmt: WeightFormat, x: Tensor, e: Tensor, group: int) -> float:
    """Mean over tokens of the squared error relative to the float output of `down` on inputs x [T, F],
    when its columns are scaled by 2^e (and x divided by it), quantized in `fmt` and fed int8
    activations. Relative, so that every token counts alike: in absolute terms the few tokens with a
    massive activation (SmolLM2's layer 11: 3170x the median group) outweigh all the others, and
    shrinking their channel 32x helped them and cost the rest (test perplexity +0.05% -> +2.65%)."""
    s = powers(e, group)
    scaled = nn.Linear(down.in_features, down.out_features, bias=down.bias is not None)
    scaled.weight.copy_(down.weight.float() * s[None, :])
    if down.bias is not None:
        scaled.bias.copy_(down.bias.float())
    q = QuantLinear.from_float(scaled, fmt, quantize_int(scaled.weight, fmt, "down_proj"), act_quant=True)
    want = down(x).float()  # [T, N]
    err = (q(x / s) - want).pow(2).sum(-1) / want.pow(2).sum(-1).clamp(min=torch.finfo(torch.float32).tiny)
    return float(err.mean())


def smoothing_exponents(model: Transformer, calib: Tensor, plan: dict[str, WeightFormat | None],
                        alphas: tuple[float, ...] = ALPHAS) -> dict[int, tuple[int, Tensor]]:
    """{layer: (group size, exponents [F / group])} for every layer whose down projection is quantized
    in integer groups and where a smoothing lowers its quantized output's error (see the module doc)."""
    wanted = {i: g for i, layer in enumerate(model.model.layers)
              if (g := down_proj_group(plan, i, layer.mlp.down_proj.in_features)) is not None}
    if not wanted:
        return {}
    inputs = sampled_inputs(model, calib, list(wanted))
    out = {}
    for i, group in wanted.items():
        down, x = model.model.layers[i].mlp.down_proj, inputs.pop(i)
        fmt = plan[f"model.layers.{i}.mlp.down_proj"]
        absmax = x.abs().amax(0)
        candidates = {tuple(e.tolist()): e for e in (exponents(absmax, group, a) for a in alphas)}
        best = min(candidates.values(), key=lambda e: output_error(down, fmt, x, e, group))
        if bool((best > 0).any()):
            out[i] = (group, best)
    return out


@torch.no_grad()
def smooth_mlp_inputs(model: Transformer, factors: dict[int, tuple[int, Tensor]]) -> None:
    """Divide up_proj's rows and multiply down_proj's columns by 2^e per group (in place, exact)."""
    for i, (group, e) in factors.items():
        mlp = model.model.layers[i].mlp
        s = powers(e, group)  # [F]
        mlp.up_proj.weight.div_(s[:, None].to(mlp.up_proj.weight.dtype))
        if mlp.up_proj.bias is not None:
            mlp.up_proj.bias.div_(s.to(mlp.up_proj.bias.dtype))
        mlp.down_proj.weight.mul_(s[None, :].to(mlp.down_proj.weight.dtype))
