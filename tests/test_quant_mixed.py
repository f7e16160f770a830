"""Sensitivity measurement and bit allocation (the reference-model comparison with uniform
quantization is in test_quant_reference.py)."""

import copy

import pytest
import torch

from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.mixed import (Unit, allocate, format_bytes, measure_sensitivity, mixed_recipe,
                                            sensitivity_table, uniform_size)
from edgefinfer.compile.quant.recipe import WeightFormat, parse_recipe
from edgefinfer.errors import UserError
from tests.helpers import tiny_model

LOW, HIGH = WeightFormat("int", 4, 32, True), WeightFormat("int", 8, 32, True)


def synthetic_units() -> list[Unit]:
    """Four units of 100 (low) / 200 (high) bytes; b and d are sensitive, d the most per byte."""
    kls = {"a": 0.01, "b": 0.30, "c": 0.02, "d": 0.50}
    return [Unit(n, 0, [f"m.{n}"], kl={LOW.label(): kl, HIGH.label(): 0.0}, dnll={LOW.label(): kl, HIGH.label(): 0.0},
                 bytes={LOW.label(): 100, HIGH.label(): 200}) for n, kl in kls.items()]


def test_size_budget_upgrades_the_most_sensitive_units_that_fit():
    units = synthetic_units()
    alloc = allocate(units, [LOW, HIGH], budget_bytes=600)
    assert alloc.choice == {"a": LOW.label(), "b": HIGH.label(), "c": LOW.label(), "d": HIGH.label()}
    assert alloc.bytes == 600 and alloc.predicted_kl == pytest.approx(0.03)
    assert alloc.overrides["m.d"] == HIGH
    assert allocate(units, [LOW, HIGH], budget_bytes=599).choice["b"] == LOW.label()  # b no longer fits
    assert set(allocate(units, [LOW, HIGH], budget_bytes=400).choice.values()) == {LOW.label()}


def test_ppl_budget_buys_the_cheapest_model_under_the_limit():
    units = synthetic_units()
    alloc = allocate(units, [LOW, HIGH], max_ppl_increase=0.5)  # log(1.5) = 0.405 nats
    assert alloc.choice["d"] == HIGH.label() and alloc.choice["b"] == LOW.label()
    assert alloc.predicted_dnll <= 0.405
    assert all(c == HIGH.label() for c in allocate(units, [LOW, HIGH], max_ppl_increase=0.0).choice.values())


def test_allocation_errors():
    with pytest.raises(UserError, match="below the smallest allocation"):
        allocate(synthetic_units(), [LOW, HIGH], budget_bytes=100)
    with pytest.raises(UserError, match="exactly one"):
        allocate(synthetic_units(), [LOW, HIGH])


def test_sensitivity_is_measured_per_unit_and_leaves_the_model_unchanged():
    model = tiny_model(intermediate_size=128)
    before = copy.deepcopy(model.state_dict())
    blocks = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    fmts = [WeightFormat("int", 2, 32, True), LOW, HIGH]
    units = measure_sensitivity(model, blocks, fmts, "linear")
    assert len(units) == 14 and all(set(u.kl) == {f.label() for f in fmts} for u in units)
    for u in units:
        assert u.kl[fmts[0].label()] > u.kl[LOW.label()] > 0 and u.kl[HIGH.label()] == 0.0
        n, k = model.get_submodule(u.modules[0]).weight.shape
        assert u.bytes[LOW.label()] == format_bytes((n, k), LOW) == n * k // 2 + 2 * n * k // 32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # A layer is the sum of its linears (not of their KL, which is not additive; of the bytes).
    layers = measure_sensitivity(model, blocks, [LOW], "layer")
    assert len(layers) == 2
    assert layers[0].bytes[LOW.label()] == sum(u.bytes[LOW.label()] for u in units[:7])
    assert "model.layers.1" in sensitivity_table(layers)


def test_the_measured_kl_is_what_quantizing_the_unit_alone_gives():
    model = tiny_model(intermediate_size=128)
    blocks = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    unit = measure_sensitivity(model, blocks, [LOW], "linear")[3]  # layer 0's o_proj
    alone = copy.deepcopy(model)
    recipe = parse_recipe("int4-g32-sym-embf").with_overrides({"*": None}).with_overrides({unit.modules[0]: LOW})
    quantize_model(alone, recipe)
    with torch.no_grad():
        p, q = model(blocks).log_softmax(-1), alone(blocks).log_softmax(-1)
    assert unit.kl[LOW.label()] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4)


def test_mixed_recipe_fits_the_budget():
    model = tiny_model(intermediate_size=128)
    blocks = torch.randint(0, 97, (2, 24))
    base = parse_recipe("int4-g32-sym")
    units = measure_sensitivity(model, blocks, [LOW, HIGH], "linear")
    fixed = uniform_size(model, base) - sum(u.bytes[LOW.label()] for u in units)
    budget = uniform_size(model, base.replace(weights=WeightFormat("int", 4, 16, True)))
    alloc = allocate(units, [LOW, HIGH], budget_bytes=budget - fixed)
    recipe = mixed_recipe(base, alloc)
    result = quantize_model(copy.deepcopy(model), recipe)
    assert result.size_bytes == uniform_size(model, recipe) <= budget
    assert 0 < sum(c == HIGH.label() for c in alloc.choice.values()) < len(units)
