"""Split int8 activations (`-split`): each token's input as a clipped part and its outliers, each
quantized per token on its own, through the same weights (`primitives.split_outliers`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgefinfer.compile.fusion import fuse_projections, stack_rows
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.primitives import CLIP_TOP, fake_quant_per_token_int8, quantize_int, split_outliers
from edgefinfer.compile.quant.recipe import QuantRecipe, parse_recipe
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


def outlier_rows(tokens: int = 64, width: int = 256, seed: int = 0) -> torch.Tensor:
    """Activations with two channels ~60x the others on every token, as Gemma 3's carry (signs vary)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, width, generator=g)
    sign = torch.randint(0, 2, (tokens, 2), generator=g) * 2 - 1
    x[:, [7, 130]] = sign * torch.tensor([60.0, 50.0])
    return x


def test_the_parts_add_up_to_the_input_and_the_clipped_part_stays_inside_its_limits():
    x = outlier_rows()
    clipped, outliers = split_outliers(x, 8)
    torch.testing.assert_close(clipped + outliers, x, rtol=1e-7, atol=0)  # float rounding of the difference only
    limit = x.abs().amax(-1, keepdim=True) / 8
    assert bool((clipped >= -limit).all()) and bool((clipped <= limit * CLIP_TOP).all())
    assert bool((outliers[:, 20:120] == 0).all())  # ordinary channels lie inside the limits: no outliers there


def test_a_row_clipped_on_both_sides_puts_its_ends_on_whole_int8_codes():
    """No rounding tie at the ends, which XNNPACK and torch would round apart (see CLIP_TOP)."""
    x = torch.tensor([[-10.0, 0.3, -0.2, 0.1, 9.5, 0.05]])
    clipped, _ = split_outliers(x, 8)
    lo, hi = clipped.min(), clipped.max()
    scale = (hi - lo) / 255
    for end in (lo, hi):
        steps = float(end / scale)
        assert abs(steps - round(steps)) < 1e-3, steps
    torch.testing.assert_close(fake_quant_per_token_int8(clipped)[0, [0, 4]], clipped[0, [0, 4]])


def test_splitting_cuts_the_int8_error_of_a_linear_on_outlier_rows():
    x = outlier_rows()
    lin = nn.Linear(x.shape[1], 48, bias=False)
    fmt = parse_recipe("8da4w-g32").weights
    q = QuantLinear.from_float(lin, fmt, quantize_int(lin.weight, fmt, "x"), act_quant=True)
    exact = nn.functional.linear(x, q.dequantized())  # the same weights, float activations
    with torch.no_grad():
        plain = (q(x) - exact).pow(2).mean()
        q.act_split = 8
        split = (q(x) - exact).pow(2).mean()
    assert split < plain / 10, (float(split), float(plain))


def test_the_recipe_splits_the_decoder_linears_and_not_the_head():
    model = tiny_model(tie_word_embeddings=True)
    quantize_model(model, parse_recipe("8da4w-g32-fzp-split"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert all(m.act_split == 8 for n, m in linears.items() if n.startswith("model.layers."))
    assert linears["lm_head"].act_split == 0
    plain = tiny_model(tie_word_embeddings=True)
    quantize_model(plain, parse_recipe("8da4w-g32-fzp"))
    assert not any(m.act_split for m in plain.modules() if isinstance(m, QuantLinear))


def test_the_recipe_carries_its_split_through_json_and_refuses_float_activations():
    recipe = parse_recipe("8da4w-g32-fzp-split")
    assert recipe.outlier_split == 8 and parse_recipe("8da4w-g32-fzp").outlier_split == 0
    assert QuantRecipe.from_dict(recipe.to_dict()) == recipe
    old = {k: v for k, v in recipe.to_dict().items() if k != "outlier_split"}  # a checkpoint from before
    assert QuantRecipe.from_dict(old).outlier_split == 0
    with pytest.raises(UserError, match="-split is for int8 activations"):
        parse_recipe("int4-g32-fzp-split")


def test_fusion_keeps_the_split_and_leaves_mixed_projections_apart():
    model = tiny_model()
    quantize_model(model, parse_recipe("8da4w-g32-split"))
    fused = fuse_projections(copy.deepcopy(model))
    assert fused.model.layers[0].self_attn.qkv_proj.act_split == 8
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), rtol=0, atol=1e-5)
    attn = model.model.layers[0].self_attn
    attn.k_proj.act_split = 0
    assert stack_rows([attn.q_proj, attn.k_proj, attn.v_proj]) is None
