"""GPTQ, AWQ and the model-level driver on tiny models (the reference-model comparison is in
test_quant_reference.py)."""

import copy

import pytest
import torch
from torch import nn

from edgefinfer.compile.quant.apply import plan_formats, quantize_model
from edgefinfer.compile.quant.awq import (apply_clip, block_objective, fold_scale, scaling_groups, search_clip,
                                          search_scale, weight_mean_rel)
from edgefinfer.compile.quant.gptq import gptq_damp_sweep, gptq_quantize, output_error
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
                                 WeightFormat("int", 3, None, True),
                                 WeightFormat("int", 4, 32, False, float_zero=True)], ids=lambda f: f.label())
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
    assert q.zeros.dtype == (torch.float32 if fmt.float_zero else torch.int8)


def test_gptq_onto_k_quant_super_blocks_cuts_the_error_and_gguf_takes_them():
    """-k: GPTQ fixes the coupled scales of a super-block up front (act-order's static groups), then
    compensates as usual; the result is still Q4_K's layout. Without act-order it refuses."""
    from edgefinfer.compile.quant.layouts import to_gguf_q4_k

    k, n = 512, 64
    fmt = WeightFormat("int", 4, 32, False, float_zero=True, super_block=256)
    x_fit, x_new = correlated_inputs(2048, k, 0), correlated_inputs(1024, k, 1)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    H = 2 * x_fit.T @ x_fit / x_fit.shape[0]
    q, rtn = gptq_quantize(w, H, fmt, GPTQSettings(act_order=True)), quantize_int(w, fmt)
    err = lambda x, wq: ((x @ (w - wq).T) ** 2).mean().item()  # noqa: E731
    assert err(x_new, dequantize_int(*q)) < 0.5 * err(x_new, dequantize_int(*rtn))
    assert torch.equal(q.scales, rtn.scales) and q.scales.dtype == torch.float32  # the same super-blocks
    module = QuantLinear.from_float(nn.Linear(k, n, bias=False), fmt, q)
    assert to_gguf_q4_k(module).shape == (n, 2 * 144)
    with pytest.raises(ValueError, match="act-order"):
        gptq_quantize(w, H, fmt, GPTQSettings(act_order=False))


@pytest.mark.parametrize("fmt", [WeightFormat("int", 4, 32, True), WeightFormat("int", 4, 32, False, float_zero=True)],
                         ids=lambda f: f.label())
def test_gptq_with_identity_hessian_is_round_to_nearest(fmt):
    # With H = I no column informs another: GPTQ must reduce to plain rounding (static groups).
    w = torch.randn(16, 64)
    q = gptq_quantize(w, torch.eye(64), fmt, GPTQSettings(damp=0.0, act_order=True))
    rtn = quantize_int(w, fmt)
    assert torch.equal(q.codes, rtn.codes) and torch.equal(q.zeros, rtn.zeros)


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


# ---- the authors' refinements: AWQ clipping, true-sequential GPTQ, damping sweep, AWQ+GPTQ, head ------------

def heavy_tailed_weights(n: int, k: int, seed: int = 1) -> torch.Tensor:
    """Student-t weights: a few large ones per group stretch the RTN grid, as in trained linears."""
    torch.manual_seed(seed)
    return torch.distributions.StudentT(torch.tensor(3.0)).sample(torch.Size((n, k))) * 0.05


def test_awq_clip_search_cuts_the_error_scales_leave():
    torch.manual_seed(0)
    k, n = 128, 64
    x_fit, x_new = correlated_inputs(512, k, 0), correlated_inputs(512, k, 1)
    w = heavy_tailed_weights(n, k)
    fmt = WeightFormat("int", 4, 32, False)
    ratios, loss, unclipped = search_clip(x_fit, w, fmt, AWQSettings())
    assert ratios.shape == (n, k // 32) and ((ratios >= 0.5) & (ratios <= 1)).all() and (ratios < 1).any()
    assert loss < 0.9 * unclipped  # on its own objective
    clipped = nn.Linear(k, n, bias=False)
    clipped.weight.data.copy_(w)
    apply_clip(clipped, ratios, fmt)
    err = lambda x, wq: ((x @ (w - wq).T) ** 2).mean().item()  # noqa: E731
    rtn = dequantize_int(*quantize_int(w, fmt))
    assert err(x_new, dequantize_int(*quantize_int(clipped.weight, fmt))) < 0.95 * err(x_new, rtn)  # held out


def _layer_output_error(model, reference, ids) -> float:
    """Mean squared error of every decoder layer's output vs the float model's, on the same tokens."""
    outs = {}

    def grab(key):
        return lambda _m, _a, out: outs.setdefault(key, []).append(out[0] if isinstance(out, tuple) else out)

    handles = [layer.register_forward_hook(grab((tag, i))) for tag, m in (("q", model), ("f", reference))
               for i, layer in enumerate(m.model.layers)]
    with torch.no_grad():
        model(ids), reference(ids)
    for h in handles:
        h.remove()
    n = len(model.model.layers)
    return sum(((outs[("q", i)][0] - outs[("f", i)][0]) ** 2).mean().item() for i in range(n)) / n


def test_weight_mean_rel_is_each_channels_share_of_its_group_range():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [3.0, 3.0, -1.0, 1.0]])
    fmt = WeightFormat("int", 4, 2, True)  # groups {0, 1} and {2, 3} of each row
    rel = weight_mean_rel([w, w], [fmt, None])  # a float consumer does not count
    assert torch.allclose(rel, torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (1.0 + 1.0) / 2, (0.0 + 1.0) / 2]),
                          atol=1e-5)


def test_duo_scaling_searches_other_scales_and_is_never_worse_than_rtn():
    x = correlated_inputs(512, 64)
    ws = [torch.randn(32, 64), torch.randn(48, 64)]
    fmt = WeightFormat("int", 4, 32, True)
    s_paper, _, rtn = search_scale(x, x.abs().mean(0), ws, [fmt, fmt], AWQSettings(grid=10))
    s_duo, loss, rtn_duo = search_scale(x, x.abs().mean(0), ws, [fmt, fmt], AWQSettings(grid=10, duo=True))
    assert rtn_duo == rtn and loss <= rtn
    assert not torch.allclose(s_duo, s_paper)


def test_block_objective_scores_the_attention_output_and_restores_the_weights():
    model = tiny_model()
    attn = model.model.layers[0].self_attn
    x = correlated_inputs(2 * 16, 64).reshape(2, 16, 64)
    positions = torch.arange(16)[None].expand(2, 16)
    ropes = model.rope_tables(positions, x.dtype)
    forward = lambda h: attn(h, ropes, positions, None)  # noqa: E731
    consumers = [attn.q_proj, attn.k_proj, attn.v_proj]
    before = [c.weight.clone() for c in consumers]
    fmt = WeightFormat("int", 4, 32, True)
    loss = block_objective(forward, x, consumers, [fmt, fmt, fmt])
    quantized = copy.deepcopy(attn)
    for c in (quantized.q_proj, quantized.k_proj, quantized.v_proj):
        c.weight.data = dequantize_int(*quantize_int(c.weight.data, fmt))
    with torch.no_grad():
        expected = ((quantized(x, ropes, positions, None) - forward(x)) ** 2).mean().item()
    assert loss(torch.ones(64)) == pytest.approx(expected, rel=1e-5)
    assert all(torch.equal(c.weight, b) for c, b in zip(consumers, before))  # each call puts the float weights back
    s, best, rtn = search_scale(x.reshape(-1, 64), x.reshape(-1, 64).abs().mean(0), [c.weight for c in consumers],
                                [fmt] * 3, AWQSettings(grid=10), loss)
    assert best <= rtn and rtn == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("settings", [dict(duo=True), dict(objective="block")], ids=["duo", "block"])
def test_autoawq_variants_quantize_a_model_and_beat_rtn(settings):
    reference = tiny_model(intermediate_size=128)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    recipe = parse_recipe("int4-awq-g32")
    model = copy.deepcopy(reference)
    result = quantize_model(model, recipe.replace(awq=AWQSettings(**settings)), calib)
    assert result.awq_gain and all(g >= 1.0 for g in result.awq_gain)  # never worse than RTN on its objective
    rtn = copy.deepcopy(reference)
    quantize_model(rtn, parse_recipe("int4-g32"))
    assert _layer_output_error(model, reference, ids) < _layer_output_error(rtn, reference, ids)


def test_awq_clip_lowers_the_model_layer_error_vs_scales_only():
    reference = tiny_model(intermediate_size=128)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    errors = {}
    for name in ("int4-awq-noclip-g32", "int4-awq-g32"):
        model = copy.deepcopy(reference)
        result = quantize_model(model, parse_recipe(name), calib)
        errors[name] = _layer_output_error(model, reference, ids)
        assert bool(result.clip_gain) == (name == "int4-awq-g32")
    assert errors["int4-awq-g32"] < errors["int4-awq-noclip-g32"]


def test_true_sequential_gptq_differs_from_and_beats_the_parallel_one():
    reference = tiny_model(intermediate_size=128)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    errors, codes = {}, {}
    for sequential in (False, True):
        model = copy.deepcopy(reference)
        recipe = parse_recipe("int4-gptq-g32")
        quantize_model(model, recipe.replace(gptq=GPTQSettings(true_sequential=sequential)), calib)
        errors[sequential] = _layer_output_error(model, reference, ids)
        codes[sequential] = model.model.layers[1].mlp.down_proj.qweight.clone()
    assert not torch.equal(codes[True], codes[False])  # down_proj saw inputs through quantized q/k/v/o/gate/up
    assert errors[True] <= errors[False]


def test_damp_sweep_picks_the_damp_that_generalises():
    k, n = 64, 32
    fmt = WeightFormat("int", 4, 32, True)
    w = heavy_tailed_weights(n, k)
    x_fit, x_val = correlated_inputs(48, k, 0), correlated_inputs(48, k, 1)  # fewer tokens than channels
    hessian = lambda x: 2 * x.T @ x / x.shape[0]  # noqa: E731
    fit, val = hessian(x_fit), hessian(x_val)
    full = hessian(torch.cat([x_fit, x_val]))
    grid = (1e-4, 0.01, 0.1, 1.0)
    q, best = gptq_damp_sweep(w, fit, val, full, fmt, GPTQSettings(damp_grid=grid))
    scores = {d: output_error(w, gptq_quantize(w, fit, fmt, GPTQSettings(damp=d)), val) for d in grid}
    assert best == min(scores, key=scores.__getitem__) and best > grid[0]  # the least damp overfits 48 tokens
    assert torch.equal(q.codes, gptq_quantize(w, full, fmt, GPTQSettings(damp=best)).codes)  # re-run on all


def test_damp_sweep_on_a_model_records_one_damp_per_matrix():
    model = tiny_model(intermediate_size=128)
    calib = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = parse_recipe("int4-gptq-g32").replace(gptq=GPTQSettings(damp_grid=(0.01, 0.1, 1.0)))
    result = quantize_model(model, recipe, calib)
    assert set(result.gptq_damp) == {n for n, m in model.named_modules() if type(m) is QuantLinear}  # 14 + lm_head
    assert len(result.gptq_damp) == 15 and set(result.gptq_damp.values()) <= {0.01, 0.1, 1.0}


def test_awq_then_gptq_folds_scales_and_rounds_with_gptq():
    reference = tiny_model(intermediate_size=128)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    models, results = {}, {}
    for name in ("int4-gptq-g32", "int4-awq-gptq-g32"):
        models[name] = copy.deepcopy(reference)
        results[name] = quantize_model(models[name], parse_recipe(name), calib)
    both = results["int4-awq-gptq-g32"]
    assert both.awq_gain and len(both.gptq_damp) == 15 and not both.clip_gain  # no clip before GPTQ
    norm = models["int4-awq-gptq-g32"].model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, reference.model.layers[0].input_layernorm.weight)  # AWQ's scales folded
    error = _layer_output_error(models["int4-awq-gptq-g32"], reference, ids)
    rtn = copy.deepcopy(reference)
    quantize_model(rtn, parse_recipe("int4-g32"))
    assert error < _layer_output_error(rtn, reference, ids)


@pytest.mark.parametrize("tied", [False, True])
def test_untied_head_is_quantized_by_gptq_on_the_final_hidden_states(tied):
    reference = tiny_model(tie_word_embeddings=tied, intermediate_size=128)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(reference)
    result = quantize_model(model, parse_recipe("int4-gptq-g32-emb4"), calib)
    assert result.head_method == ("rtn" if tied else "gptq")
    if tied:
        return
    assert "lm_head" in result.gptq_damp
    with torch.no_grad():  # the head's own error, on what it reads at inference, for tokens not calibrated on
        ids = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(1))
        h = _final_hidden(model, ids).reshape(-1, 64)
        w = reference.lm_head.weight
        rtn = dequantize_int(*quantize_int(w, WeightFormat("int", 4, 32, True)))
        gptq = model.lm_head.dequantized()
        err = lambda wq: ((h @ (w - wq).T) ** 2).mean().item()  # noqa: E731
    assert not torch.equal(gptq, rtn) and err(gptq) < err(rtn)


def _final_hidden(model, ids):
    out = []
    handle = model.model.norm.register_forward_hook(lambda _m, _a, o: out.append(o))
    model(ids)
    handle.remove()
    return out[0]
