"""Float outlier channels (`-outliersN`): the N largest calibration input channels of each decoder linear
bypass the int8 row and meet their weight columns in float (`compile/quant/outliers.py`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from edgefinfer.compile.fusion import fuse_projections, stack_rows
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.checkpoint import load_quantized, save_quantized
from edgefinfer.compile.quant.layouts import FloatChannelsLinear
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.primitives import quantize_int
from edgefinfer.compile.quant.recipe import QuantRecipe, parse_recipe
from edgefinfer.errors import UserError
from tests.helpers import tiny_model
from tests.test_quant_split import outlier_rows

CALIB = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))


def quantized_linear(width: int = 256, cols: list[int] | None = None, recipe: str = "8da4w-g32-fzp") -> QuantLinear:
    lin = nn.Linear(width, 48, bias=True)
    fmt = parse_recipe(recipe).weights
    q = QuantLinear.from_float(lin, fmt, quantize_int(lin.weight, fmt, "x"), act_quant=True)
    if cols is not None:
        q.register_buffer("float_cols", torch.tensor(cols))
    return q


def test_float_channels_take_the_outliers_out_of_the_int8_error():
    x = outlier_rows()  # channels 7 and 130 ~60x the rest
    q = quantized_linear()
    exact = nn.functional.linear(x, q.dequantized(), q.bias)  # the same weights, float activations
    with torch.no_grad():
        plain = (q(x) - exact).pow(2).mean()
        q.register_buffer("float_cols", torch.tensor([7, 130]))
        kept = (q(x) - exact).pow(2).mean()
        wrong = copy.deepcopy(q)
        wrong.float_cols = torch.tensor([8, 131])
        missed = (wrong(x) - exact).pow(2).mean()
    assert kept < plain / 10, (float(kept), float(plain))
    assert missed > plain / 2  # ordinary channels kept float do not help: the outliers still set the step


def test_only_the_kept_channels_are_exact_in_float():
    """An input that is zero outside the float channels goes through without any int8 rounding."""
    q = quantized_linear(cols=[3, 40, 200])
    x = torch.zeros(5, 256)
    x[:, [3, 40, 200]] = torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(q(x), nn.functional.linear(x, q.dequantized(), q.bias), rtol=1e-5, atol=1e-5)


def test_the_export_layout_computes_what_the_eager_module_computes():
    """FloatChannelsLinear (mask, one-hot pick, float columns) around a float stand-in for XNNPACK's
    int8 linear equals QuantLinear's forward with its fake-quantized int8 row."""
    from edgefinfer.compile.quant.primitives import fake_quant_per_token_int8

    q = quantized_linear(cols=[7, 130])
    w_sym, offsets = q.offset_split()

    class Int8Row(nn.Module):  # what the torchao tensor computes: per-token int8 x, symmetric codes
        def forward(self, x):
            return nn.functional.linear(fake_quant_per_token_int8(x), w_sym, q.bias)

    from edgefinfer.compile.quant.layouts import OffsetLinear

    layout = OffsetLinear(FloatChannelsLinear(Int8Row(), q.float_cols, w_sym), offsets, q.group_size)
    x = outlier_rows()[None]
    with torch.no_grad():
        torch.testing.assert_close(layout(x), q(x), rtol=1e-5, atol=1e-4)


def test_the_recipe_picks_the_largest_calibration_channels_of_decoder_linears_only():
    model = tiny_model(tie_word_embeddings=True)
    recipe = parse_recipe("8da4w-g32-fzp-outliers4")
    assert recipe.needs_calibration and recipe.outlier_channels == 4
    quantize_model(model, recipe, CALIB)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert linears["lm_head"].float_cols is None
    decoder = {n: m for n, m in linears.items() if n.startswith("model.layers.")}
    assert decoder and all(m.float_cols.tolist() == sorted(m.float_cols.tolist()) and m.float_cols.numel() == 4
                           for m in decoder.values())
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.float_cols.tolist() == attn.k_proj.float_cols.tolist() == attn.v_proj.float_cols.tolist()
    # They are the channels with the largest |x| over the calibration text, on the model as quantized.
    picked = {n: m.float_cols.tolist() for n, m in decoder.items()}
    seen: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_module, args):
            a = args[0].abs().reshape(-1, args[0].shape[-1]).amax(0)
            seen[name] = torch.maximum(seen[name], a) if name in seen else a
        return hook

    for m in decoder.values():
        m.float_cols = None
    hooks = [m.register_forward_pre_hook(record(n)) for n, m in decoder.items()]
    with torch.no_grad():
        model(CALIB)
    for h in hooks:
        h.remove()
    assert picked == {n: sorted(seen[n].topk(4).indices.tolist()) for n in decoder}


def test_the_recipe_needs_calibration_and_int8_activations():
    with pytest.raises(UserError, match="picks its channels on calibration text"):
        quantize_model(tiny_model(), parse_recipe("8da4w-g32-outliers4"))
    with pytest.raises(UserError, match="-outliers4 is for int8 activations"):
        parse_recipe("int4-g32-outliers4")
    with pytest.raises(UserError, match="1 to 64 channels"):
        parse_recipe("8da4w-g32-outliers0")
    with pytest.raises(UserError, match="more channels than"):
        quantize_model(tiny_model(), parse_recipe("8da4w-g32-outliers64"), CALIB)


def test_the_recipe_round_trips_through_json_and_older_configs_read_as_none():
    recipe = parse_recipe("8da4w-g32-fzp-split-outliers16")
    assert recipe.outlier_channels == 16 and recipe.outlier_split == 8
    assert QuantRecipe.from_dict(recipe.to_dict()) == recipe
    old = {k: v for k, v in recipe.to_dict().items() if k != "outlier_channels"}
    assert QuantRecipe.from_dict(old).outlier_channels == 0


def test_a_checkpoint_keeps_the_channels_and_an_older_one_still_loads(tmp_path):
    model = tiny_model()
    recipe = parse_recipe("8da4w-g32-fzp-outliers4")
    quantize_model(model, recipe, CALIB)
    save_quantized(model, recipe, tmp_path / "q")
    loaded, got = load_quantized(tmp_path / "q")
    assert got == recipe
    cols = {n: m.float_cols.tolist() for n, m in model.named_modules() if isinstance(m, QuantLinear)
            and m.float_cols is not None}
    assert cols and cols == {n: m.float_cols.tolist() for n, m in loaded.named_modules()
                             if isinstance(m, QuantLinear) and m.float_cols is not None}
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    plain = tiny_model()  # no float channels: no buffer, no entry, the checkpoint as before
    quantize_model(plain, parse_recipe("8da4w-g32-fzp"))
    save_quantized(plain, parse_recipe("8da4w-g32-fzp"), tmp_path / "plain")
    assert not any(k.endswith("float_cols") for k in load_quantized(tmp_path / "plain")[0].state_dict())


def test_fusion_keeps_the_channels_and_leaves_different_ones_apart():
    model = tiny_model()
    quantize_model(model, parse_recipe("8da4w-g32-outliers4"), CALIB)
    fused = fuse_projections(copy.deepcopy(model))
    attn = model.model.layers[0].self_attn
    assert torch.equal(fused.model.layers[0].self_attn.qkv_proj.float_cols, attn.q_proj.float_cols)
    ids = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), rtol=0, atol=1e-5)
    attn.k_proj.float_cols = attn.k_proj.float_cols + 1
    assert stack_rows([attn.q_proj, attn.k_proj, attn.v_proj]) is None
