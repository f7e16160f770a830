"""Power-of-two smoothing of the int8 activations (compile/quant/smoothing.py): exact in float, weights
kept on their grids, less activation rounding where a group of channels dominates."""

from __future__ import annotations

import copy

import pytest
import torch

from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.recipe import QuantRecipe, parse_recipe
from edgefinfer.compile.quant.smoothing import exponents, output_error, smooth_mlp_inputs, smoothing_exponents
from edgefinfer.compile.quant.apply import plan_formats
from edgefinfer.errors import UserError
from tests.helpers import tiny_model

OUTLIER = 64.0  # group 1 of every down projection's input (channels 32..63 of 96) runs this much larger


@pytest.fixture(scope="module")
def model():
    """A tiny model whose MLP input has one dominant group, as Gemma 3's and SmolLM2's do."""
    m = tiny_model(seed=3)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.up_proj.weight[32:64] *= OUTLIER
            layer.mlp.down_proj.weight[:, 32:64] /= OUTLIER
    return m


@pytest.fixture(scope="module")
def calib():
    return torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))


def test_exponents_round_alpha_log2_of_the_ratio_to_the_median_group():
    absmax = torch.tensor([1.0] * 32 + [16.0] * 32 + [2.0] * 32 + [0.25] * 32)  # groups 1, 16, 2, 0.25
    # median of [1, 16, 2, 0.25] is torch's lower median 1; alpha 0.5: log2 ratios 0, 4, 1, -2 -> 0, 2, 0.5->0, 0
    assert exponents(absmax, 32, 0.5).tolist() == [0, 2, 0, 0]
    assert exponents(absmax, 32, 1.0).tolist() == [0, 4, 1, 0]  # groups only shrink
    assert exponents(absmax, 32, 0.0).tolist() == [0, 0, 0, 0]  # the search's "unsmoothed" candidate


def test_the_search_shrinks_the_dominant_group_and_keeps_the_float_bits(model, calib):
    smoothed = copy.deepcopy(model)
    plan = plan_formats(smoothed, parse_recipe("8da4w-g32-fzp"))
    factors = smoothing_exponents(smoothed, calib, plan)
    assert set(factors) == {0, 1}
    for group, e in factors.values():  # only group 1 (channels 32..63) runs large; 64x = 2^6
        assert group == 32 and e[0] == 0 and e[2] == 0 and 1 <= e[1] <= 6, e
    smooth_mlp_inputs(smoothed, factors)
    assert not torch.equal(smoothed.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    with torch.no_grad():
        assert torch.equal(smoothed(calib), model(calib))


def test_a_layer_without_a_dominant_group_is_left_alone(calib):
    plain = tiny_model(seed=3)  # no planted outlier: the search keeps alpha 0 where nothing beats it
    plan = plan_formats(plain, parse_recipe("8da4w-g32-fzp"))
    x = torch.randn(256, 96)
    down = plain.model.layers[0].mlp.down_proj
    fmt = plan["model.layers.0.mlp.down_proj"]
    zero = torch.zeros(3, dtype=torch.int64)
    # a factor on a group that is not large only coarsens that group's weights' share of the rounding
    assert output_error(down, fmt, x, zero, 32) < output_error(down, fmt, x, torch.tensor([0, 4, 0]), 32)


@pytest.mark.parametrize("name", ["8da4w-g32-fzp-smooth", "8da4w-g32-smooth"])
def test_group_codes_are_unchanged_and_scales_move_by_the_power_of_two(model, calib, name):
    """A weight group scaled by 2^e keeps its grid: the same codes, its scale (and bottom) times 2^e."""
    plain, smoothed = copy.deepcopy(model), copy.deepcopy(model)
    recipe = parse_recipe(name)
    quantize_model(plain, recipe.replace(smoothing=False))
    result = quantize_model(smoothed, recipe, calib)
    assert set(result.smoothing) == {0, 1}
    for i, (a, b) in enumerate(zip(plain.model.layers, smoothed.model.layers)):
        down_a, down_b = a.mlp.down_proj, b.mlp.down_proj
        assert isinstance(down_b, QuantLinear)
        assert torch.equal(down_a.qweight, down_b.qweight)
        factor = torch.tensor([1.0, float(result.smoothing[i]), 1.0])  # per group of 32 input channels
        assert torch.equal(down_a.scales.float() * factor, down_b.scales.float())
        assert torch.equal(a.mlp.up_proj.qweight, b.mlp.up_proj.qweight)  # a row scaled by 2^-e: same codes


def test_smoothing_lowers_the_int8_activation_error(model, calib):
    recipe = parse_recipe("8da4w-g32-fzp-smooth")
    plain, smoothed = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(plain, recipe.replace(smoothing=False))
    quantize_model(smoothed, recipe, calib)
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        err_plain = (plain(tokens) - want).abs().mean()
        err_smoothed = (smoothed(tokens) - want).abs().mean()
    assert err_smoothed < 0.8 * err_plain, (err_smoothed, err_plain)


def test_per_channel_down_projections_and_weight_only_recipes_are_left_alone(model, calib):
    result = quantize_model(copy.deepcopy(model), parse_recipe("8da8w-smooth"), calib)  # one group per row
    assert result.smoothing == {}
    with pytest.raises(UserError, match="only 8da4w and 8da8w have"):
        parse_recipe("int4-g32-fzp-smooth")  # float activations: nothing to smooth


def test_without_calibration_the_recipe_says_it_skipped(model):
    lines: list[str] = []
    result = quantize_model(copy.deepcopy(model), parse_recipe("8da4w-g32-smooth"), progress=lines.append)
    assert result.smoothing == {}
    assert any(line.startswith("[smooth] no calibration blocks") for line in lines), lines


def test_the_recipe_carries_its_smoothing_through_json():
    assert parse_recipe("8da4w-g32-fzp").smoothing is False
    recipe = parse_recipe("8da4w-g32-fzp-smooth")
    assert recipe.smoothing is True and recipe.needs_calibration
    assert QuantRecipe.from_dict(recipe.to_dict()) == recipe
    old = {k: v for k, v in recipe.to_dict().items() if k != "smoothing"}  # a checkpoint from before smoothing
    assert QuantRecipe.from_dict(old).smoothing is False
