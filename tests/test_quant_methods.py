"""GPTQ, AWQ and the model-level driver on tiny models (the reference-model comparison is in
test_quant_reference.py)."""

import copy

import pytest
import torch
from torch import nn

from edgefinfer.compile.quant.apply import plan_formats, quantize_model
from edgefinfer.compile.quant.awq import fold_scale, scaling_groups, search_scale
from edgefinfer.compile.quant.gptq import gptq_quantize
from edgefinfer.compile.quant.modules import Fp8Linear, QuantEmbedding, QuantLinear, model_size_bytes
from edgefinfer.compile.quant.primitives import dequantize_int, int_error_bound, quantize_int
from edgefinfer.compile.quant.recipe import AWQSettings, GPTQSettings, WeightFormat, parse_recipe
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


def correlated_inputs(t: int, k: int, tokens_seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels and a few outlier channels, like a real residual stream.
    The channel mixing is fixed; `tokens_seed` draws different tokens from the same distribution."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(1234)) / k**0.5
    g = torch.Generator().manual_seed(tokens_seed)
    x = torch.randn(t, k, generator=g) @ mix + 0.1 * torch.randn(t, k, generator=g)
    x[:, :4] *= 12.0
    return x


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("fmt", [WeightFormat("int", 4, 32, True), WeightFormat("int", 4, 64, False),
                                 WeightFormat("int", 3, None, True)], ids=lambda f: f.label())
def test_gptq_cuts_the_layer_output_error(fmt, act_order):
    k, n = 128, 64
    x_fit, x_new = correlated_inputs(1024, k, 0), correlated_inputs(1024, k, 1)  # fit and held-out tokens
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    H = 2 * x_fit.T @ x_fit / x_fit.shape[0]
    q = gptq_quantize(w, H, fmt, GPTQSettings(act_order=act_order))
    rtn = quantize_int(w, fmt)
    err = lambda x, wq: ((x @ (w - wq).T) ** 2).mean().item()  # noqa: E731
    assert err(x_new, dequantize_int(*q)) < 0.5 * err(x_new, dequantize_int(*rtn))
    # Codes and group parameters keep the layout exporters read: contiguous groups, codes in range.
    assert q.codes.shape == (n, k) and q.scales.shape == rtn.scales.shape
    assert q.codes.min() >= -(1 << (fmt.bits - 1)) and q.codes.max() < (1 << (fmt.bits - 1))
    if fmt.symmetric:
        assert (q.zeros == 0).all()


def test_gptq_with_identity_hessian_is_round_to_nearest():
    # With H = I no column informs another: GPTQ must reduce to plain rounding (static groups).
    w = torch.randn(16, 64)
    fmt = WeightFormat("int", 4, 32, True)
    q = gptq_quantize(w, torch.eye(64), fmt, GPTQSettings(damp=0.0, act_order=True))
    assert torch.equal(q.codes, quantize_int(w, fmt).codes)


def test_gptq_ignores_dead_inputs():
    x = correlated_inputs(256, 64)
    x[:, 10] = 0.0
    H = 2 * x.T @ x / 256
    w = torch.randn(8, 64)
    q = gptq_quantize(w, H, WeightFormat("int", 4, 32, False))
    assert torch.isfinite(q.scales.float()).all()


def test_awq_fold_is_an_exact_rewrite():
    model = tiny_model(num_attention_heads=4, num_key_value_heads=4)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        before = model(ids)
        for layer in model.model.layers:
            groups = scaling_groups(layer)
            assert [g.producer for g in groups] == ["input_layernorm", "self_attn.v_proj",
                                                    "post_attention_layernorm", "mlp.up_proj"]
            for g in groups:
                k = layer.get_submodule(g.consumers[0]).in_features
                fold_scale(layer, g, torch.rand(k) * 3 + 0.2)
        after = model(ids)
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)


def test_awq_skips_v_to_o_when_heads_do_not_line_up():
    layer = tiny_model(num_attention_heads=4, num_key_value_heads=2).model.layers[0]
    assert "self_attn.v_proj" not in [g.producer for g in scaling_groups(layer)]


def test_awq_search_is_never_worse_than_rtn_on_its_objective():
    x = correlated_inputs(512, 64)
    ws = [torch.randn(32, 64), torch.randn(48, 64)]
    fmt = WeightFormat("int", 4, 32, True)
    s, loss, rtn_loss = search_scale(x, x.abs().mean(0), ws, [fmt, fmt], AWQSettings(grid=10))
    assert loss <= rtn_loss and loss < 0.9 * rtn_loss  # outlier channels make scaling pay
    assert s.shape == (64,) and (s > 0).all()
    assert s[:4].mean() > s[4:].mean()  # the high-activation channels are scaled up


RECIPES = ["int8", "int8-g32", "int4-g32", "int4-g64-sym", "int4-gptq-g32", "int4-gptq-noact-g32-sym",
           "int4-awq-g32", "8da4w-g32", "fp8", "int4-g32-emb4", "int4-g32-embf"]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_quantizes_a_model(name):
    recipe = parse_recipe(name)
    model = tiny_model(tie_word_embeddings=True, intermediate_size=128)
    reference = copy.deepcopy(model)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    result = quantize_model(model, recipe, calib)
    linears = [m for n, m in model.named_modules() if n.startswith("model.layers.") and n.count(".") == 4]
    expected = Fp8Linear if recipe.weights.kind == "fp8" else QuantLinear
    assert len(linears) == 14 and all(type(m) is expected for m in linears)
    assert not any(type(m) is nn.Linear for m in linears)
    if recipe.embedding is None:
        assert type(model.model.embed_tokens) is nn.Embedding
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert type(model.model.embed_tokens) is QuantEmbedding
        assert model.lm_head.qweight is model.model.embed_tokens.qweight  # tied: one copy of the codes
    if recipe.activations == "int8-per-token":
        assert all(m.act_quant for m in linears)
    assert result.size_bytes == model_size_bytes(model) < model_size_bytes(reference)
    ids = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        p = reference(ids).log_softmax(-1)
        q = model(ids).log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    int8 = recipe.weights == WeightFormat("int", 8, recipe.weights.group_size, True)
    assert 0 < kl < (0.01 if int8 else 0.05 if recipe.weights.kind == "fp8" else 0.5)


def test_rtn_model_weights_are_within_the_bound():
    model = tiny_model()
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_model(model, parse_recipe("int4-g32"))
    for name, w in original.items():
        m = model.get_submodule(name)
        assert ((w - m.dequantized()).abs() <= int_error_bound(m.scales, m.group_size)).all(), name


def test_eager_forward_uses_exactly_the_stored_integers():
    model = tiny_model()
    quantize_model(model, parse_recipe("int4-g32"))
    m = model.model.layers[0].mlp.up_proj
    x = torch.randn(3, 64)
    w = (m.qweight.float().view(96, 2, 32) - m.zeros.float()[..., None]) * m.scales.float()[..., None]
    assert torch.equal(m(x), x @ w.view(96, 64).T)


def test_mixed_overrides_reach_the_modules():
    int8 = WeightFormat("int", 8, 32, True)
    recipe = parse_recipe("int4-gptq-g32").with_overrides({"model.layers.1.mlp.down_proj": int8,
                                                           "model.layers.0.self_attn.q_proj": None})
    model = tiny_model()
    calib = torch.randint(0, 97, (2, 32))
    result = quantize_model(model, recipe, calib)
    assert model.model.layers[1].mlp.down_proj.fmt.bits == 8
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert result.bits_table()["model.layers.0.self_attn.q_proj"] == "float"


def test_gptq_and_awq_need_calibration_data():
    for name in ("int4-gptq-g32", "int4-awq-g32"):
        with pytest.raises(UserError, match="calibration set is empty"):
            quantize_model(tiny_model(), parse_recipe(name), torch.zeros(0, 32, dtype=torch.long))
        with pytest.raises(UserError, match="needs calibration data"):
            quantize_model(tiny_model(), parse_recipe(name), None)


def test_group_size_that_does_not_divide_fails_before_any_work():
    model = tiny_model()  # intermediate 96: g64 does not divide down_proj's input
    with pytest.raises(UserError, match="group size 64 does not divide the input dimension 96 of "
                                        "model.layers.0.mlp.down_proj"):
        plan_formats(model, parse_recipe("int4-g64"))
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear  # untouched


def test_tied_embeddings_need_one_format():
    recipe = parse_recipe("int4-g32").replace(lm_head=WeightFormat("int", 4, 32, True))
    with pytest.raises(UserError, match="ties lm_head to its embeddings"):
        plan_formats(tiny_model(tie_word_embeddings=True), recipe)
    plan_formats(tiny_model(tie_word_embeddings=False), recipe)  # untied: fine
