"""Export-time fusion of q|k|v and gate|up: the same logits, fewer linears; mixed formats left apart."""

import copy

import pytest
import torch
from torch import nn

from edgefinfer.compile.fusion import fuse_projections, stack_rows
from edgefinfer.compile.quant import parse_recipe, quantize_model
from tests.helpers import tiny_model

TOKENS = torch.tensor([[5, 17, 33, 2, 90, 64, 12, 7]])


@pytest.mark.parametrize("recipe", [None, "8da4w-g32-fzp", "8da4w-g32", "int8-g32"])
def test_fused_model_computes_the_same_logits(recipe):
    model = tiny_model(qkv_bias=True, model_type="qwen2")
    if recipe:
        quantize_model(model, parse_recipe(recipe))
    fused = fuse_projections(copy.deepcopy(model))
    for layer in fused.model.layers:
        assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
        assert "q_proj" not in layer.self_attn._modules and "up_proj" not in layer.mlp._modules
    with torch.no_grad():
        assert (fused(TOKENS) - model(TOKENS)).abs().max().item() < 1e-5


def test_projections_of_different_formats_stay_apart():
    a, b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    assert stack_rows([a, b]) is None  # one with a bias, one without
    model = tiny_model()
    quantize_model(model, parse_recipe("int4-g32"))
    layer = model.model.layers[0]
    layer.self_attn.v_proj = nn.Linear(64, 32, bias=False)  # a float projection among int4 ones
    fuse_projections(model)
    assert model.model.layers[0].self_attn.qkv_proj is None and model.model.layers[1].self_attn.qkv_proj is not None
