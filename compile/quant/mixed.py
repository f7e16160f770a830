"""Mixed precision from measured sensitivity.

1. `measure_sensitivity`: for each unit (one decoder linear, or one whole decoder layer) and each
   candidate format, round-to-nearest quantize that unit alone and measure, on held-aside tokens, the
   KL divergence of the model's next-token distribution from the float model's, and the change in
   mean negative log-likelihood. Only the layers from the unit onwards are re-run (the residual
   stream entering the unit's layer is cached).
2. `allocate`: choose one format per unit, treating the measured costs as additive: under a size
   budget, minimise the summed KL; under a perplexity budget, minimise bytes subject to the summed
   NLL increase staying below log(1 + max increase). Both are multiple-choice knapsacks, solved by
   the classic greedy: start every unit at its smallest format and repeatedly take the upgrade with
   the best cost reduction per added byte that still fits.
3. The choice becomes per-module overrides on the base recipe (`QuantRecipe.with_overrides`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from edgefinfer.compile.quant.apply import plan_formats
from edgefinfer.compile.quant.calibrate import INPUT_GROUPS
from edgefinfer.compile.quant.modules import FLOAT_BYTES
from edgefinfer.compile.quant.primitives import dequantize_fp8, dequantize_int, quantize_fp8, quantize_int
from edgefinfer.compile.quant.recipe import QuantRecipe, WeightFormat
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

Progress = Callable[[str], None]


@dataclass
class Unit:
    name: str  # a module name, or "model.layers.N" for a whole layer
    layer: int
    modules: list[str]
    kl: dict[str, float] = field(default_factory=dict)  # format label -> mean KL (nats / token)
    dnll: dict[str, float] = field(default_factory=dict)  # format label -> NLL increase (nats / token)
    bytes: dict[str, int] = field(default_factory=dict)  # format label -> packed bytes of the unit


def format_bytes(shape: tuple[int, int], fmt: WeightFormat | None) -> int:
    n, k = shape
    if fmt is None:
        return FLOAT_BYTES * n * k
    return int(math.ceil(n * k * fmt.bits_per_weight(k) / 8))


def units_of(model: Transformer, granularity: str = "linear") -> list[Unit]:
    if granularity not in ("linear", "layer"):
        raise UserError(f"sensitivity granularity must be 'linear' or 'layer', got {granularity!r}")
    units = []
    for i in range(len(model.model.layers)):
        names = [f"model.layers.{i}.{n}" for grp in INPUT_GROUPS for n in grp]
        if granularity == "layer":
            units.append(Unit(f"model.layers.{i}", i, names))
        else:
            units += [Unit(n, i, [n]) for n in names]
    return units


def size_units(model: Transformer, units: list[Unit], formats: list[WeightFormat]) -> list[Unit]:
    """Fill each unit's packed bytes per format (no measurement needed, so budgets can be checked first)."""
    for unit in units:
        shapes = [tuple(model.get_submodule(n).weight.shape) for n in unit.modules]
        unit.bytes = {f.label(): sum(format_bytes(s, f) for s in shapes) for f in formats}
    return units


def check_budget(units: list[Unit], budget_bytes: int) -> None:
    smallest = sum(min(u.bytes.values()) for u in units)
    if budget_bytes < smallest:
        raise UserError(f"the size budget leaves {budget_bytes} bytes for the quantized layers, below the smallest "
                        f"allocation ({smallest} bytes): raise the budget or add a smaller format")


def _fake_quant(w: Tensor, fmt: WeightFormat) -> Tensor:
    if fmt.kind == "fp8":
        return dequantize_fp8(*quantize_fp8(w)).to(w.dtype)
    return dequantize_int(*quantize_int(w, fmt)).to(w.dtype)


@torch.no_grad()
def _tail_logprobs(model: Transformer, x: Tensor, start: int, positions: Tensor) -> Tensor:
    """log-softmax of the logits [B, S, V] from the residual stream entering layer `start`."""
    ropes = model.rope_tables(positions, x.dtype)
    for layer in model.model.layers[start:]:
        x = layer(x, ropes, positions, None)
    return model.lm_head(model.model.norm(x)).float().log_softmax(-1)


@torch.no_grad()
def measure_sensitivity(model: Transformer, blocks: Tensor, formats: list[WeightFormat], granularity: str = "linear",
                        assume_lossless_bits: int = 8, progress: Progress | None = None) -> list[Unit]:
    """KL and NLL increase of quantizing each unit alone, for every format in `formats` (formats with
    at least `assume_lossless_bits` integer bits are taken as lossless and not measured; fp8 is measured)."""
    if blocks.dim() != 2 or blocks.numel() == 0:
        raise UserError("sensitivity needs a non-empty set of token blocks")
    say = progress or (lambda _m: None)
    units = size_units(model, units_of(model, granularity), formats)
    B, S = blocks.shape
    positions = torch.arange(S)[None].expand(B, S)
    states = model.hidden_states(blocks)  # L+1 tensors [B, S, D]; the last is normalised
    ref = model.lm_head(states[-1]).float().log_softmax(-1)  # [B, S, V]
    targets = blocks[:, 1:]
    ref_nll = -ref[:, :-1].gather(-1, targets[..., None]).mean().item()
    p_ref = ref.exp()
    for u_idx, unit in enumerate(units):
        modules: list[nn.Linear] = [model.get_submodule(n) for n in unit.modules]
        originals = [m.weight.detach().clone() for m in modules]
        for fmt in formats:
            label = fmt.label()
            if fmt.kind == "int" and fmt.bits >= assume_lossless_bits:
                unit.kl[label], unit.dnll[label] = 0.0, 0.0
                continue
            for m in modules:
                m.weight.copy_(_fake_quant(m.weight, fmt))
            logp = _tail_logprobs(model, states[unit.layer], unit.layer, positions)
            unit.kl[label] = (p_ref * (ref - logp)).sum(-1).mean().item()
            unit.dnll[label] = -logp[:, :-1].gather(-1, targets[..., None]).mean().item() - ref_nll
            for m, w in zip(modules, originals):
                m.weight.copy_(w)
        say(f"[sensitivity] {u_idx + 1:4d}/{len(units)} {unit.name:40s} " +
            "  ".join(f"{k}: KL {v:.4f}" for k, v in unit.kl.items()))
    return units


@dataclass
class Allocation:
    choice: dict[str, str]  # unit name -> format label
    overrides: dict[str, WeightFormat]  # module name -> format
    bytes: int  # packed bytes of all units
    predicted_kl: float
    predicted_dnll: float


def allocate(units: list[Unit], formats: list[WeightFormat], budget_bytes: int | None = None,
             max_ppl_increase: float | None = None) -> Allocation:
    """One format per unit under a byte budget for the units (minimising summed KL) or a maximum
    relative perplexity increase (minimising bytes)."""
    if (budget_bytes is None) == (max_ppl_increase is None):
        raise UserError("give exactly one of a size budget (bytes) or a maximum perplexity increase")
    by_label = {f.label(): f for f in formats}
    cost_of = (lambda u, lab: u.kl[lab]) if budget_bytes is not None else (lambda u, lab: max(u.dnll[lab], 0.0))
    if budget_bytes is not None:
        check_budget(units, budget_bytes)
    choice = {u.name: min(by_label, key=lambda lab: (u.bytes[lab], cost_of(u, lab))) for u in units}
    total = sum(u.bytes[choice[u.name]] for u in units)
    limit = None if max_ppl_increase is None else math.log1p(max_ppl_increase)

    def cost() -> float:
        return sum(cost_of(u, choice[u.name]) for u in units)

    while limit is None or cost() > limit:
        best, best_gain = None, 0.0
        for u in units:
            cur = choice[u.name]
            for lab in by_label:
                extra = u.bytes[lab] - u.bytes[cur]
                saved = cost_of(u, cur) - cost_of(u, lab)
                if extra <= 0 or saved <= 0 or (budget_bytes is not None and total + extra > budget_bytes):
                    continue
                if saved / extra > best_gain:
                    best, best_gain = (u, lab, extra), saved / extra
        if best is None:
            break
        u, lab, extra = best
        choice[u.name] = lab
        total += extra
    overrides = {m: by_label[choice[u.name]] for u in units for m in u.modules}
    return Allocation(choice, overrides, total, sum(u.kl[choice[u.name]] for u in units),
                      sum(u.dnll[choice[u.name]] for u in units))


def mixed_recipe(base: QuantRecipe, allocation: Allocation, name: str | None = None) -> QuantRecipe:
    return base.with_overrides(allocation.overrides, name or f"{base.name}-mixed")


def uniform_size(model: Transformer, recipe: QuantRecipe) -> int:
    """Packed bytes the recipe would give the model (without quantizing it)."""
    total = 0
    plan = plan_formats(model, recipe)
    seen: set[int] = set()
    for name, fmt in plan.items():
        module = model.get_submodule(name)
        if module.weight.data_ptr() in seen:
            continue
        seen.add(module.weight.data_ptr())
        total += format_bytes(tuple(module.weight.shape), fmt)
        if getattr(module, "bias", None) is not None:
            total += FLOAT_BYTES * module.bias.numel()
    for pname, p in model.named_parameters():
        owner = pname.rsplit(".", 1)[0]
        if owner not in plan and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += FLOAT_BYTES * p.numel()
    return total


def sensitivity_table(units: list[Unit], allocation: Allocation | None = None) -> str:
    labels = list(units[0].kl) if units else []
    head = f"{'unit':40s} " + " ".join(f"{'KL ' + lab:>22s}" for lab in labels) + ("  chosen" if allocation else "")
    lines = [head, "-" * len(head)]
    for u in units:
        row = f"{u.name:40s} " + " ".join(f"{u.kl[lab]:22.5f}" for lab in labels)
        if allocation:
            row += f"  {allocation.choice[u.name]}"
        lines.append(row)
    return "\n".join(lines)
