"""Recipe names, the registry, JSON round trips and per-module format resolution."""

import pytest

from edgefinfer.compile.quant.recipe import RECIPE_NAMES, RECIPES, GPTQSettings, QuantRecipe, WeightFormat, parse_recipe
from edgefinfer.errors import UserError


def test_names_parse_to_the_documented_schemes():
    r = parse_recipe("int4-awq-g64")
    assert (r.method, r.weights, r.activations) == ("awq", WeightFormat("int", 4, 64, False), "none")
    r = parse_recipe("int4-gptq-g128-sym")
    assert (r.method, r.weights.group_size, r.weights.symmetric, r.gptq.act_order) == ("gptq", 128, True, True)
    assert not parse_recipe("int4-gptq-noact-g64").gptq.act_order
    r = parse_recipe("int8")
    assert r.weights == WeightFormat("int", 8, None, True) and r.embedding == WeightFormat("int", 8, None, True)
    r = parse_recipe("8da4w-g32")
    assert r.activations == "int8-per-token" and r.weights == WeightFormat("int", 4, 32, True, "bfloat16")
    assert r.embedding == WeightFormat("int", 8, None, True)  # what XNNPACK runs as a tied head (qc8w)
    assert parse_recipe("8da4w-g32-emb4").lm_head == WeightFormat("int", 4, 32, True, "bfloat16")
    r = parse_recipe("fp8")
    assert r.weights.kind == "fp8" and r.embedding is None and r.lm_head is None
    assert parse_recipe("int4-g32-embf").embedding is None
    assert parse_recipe("int4-g32-emb4").lm_head == WeightFormat("int", 4, 32, True)
    assert parse_recipe("int4-pc-sym").weights.group_size is None


def test_method_spellings_of_the_authors_refinements():
    r = parse_recipe("int4-awq-gptq-g32")
    assert (r.method, r.weights.group_size, r.weights.symmetric, r.gptq.act_order) == ("awq-gptq", 32, False, True)
    assert parse_recipe("int4-awq-g32").awq.clip and not parse_recipe("int4-awq-noclip-g32").awq.clip
    assert parse_recipe("int4-awq-noclip-g32").method == "awq"
    assert parse_recipe("8da4w-awq-gptq-g32-emb8").activations == "int8-per-token"
    r = parse_recipe("int4-gptq-g32")
    assert r.gptq.true_sequential and r.gptq.act_order and r.gptq.damp_grid == ()
    swept = r.replace(gptq=GPTQSettings(damp_grid=[0.01, 0.1]))  # a JSON list becomes a tuple
    assert swept.gptq.damp_grid == (0.01, 0.1) and QuantRecipe.from_dict(swept.to_dict()) == swept


@pytest.mark.parametrize("name", ["int4-gptq-awq-g32", "int4-awq-gptq-noclip-g32", "int4-noclip-g32",
                                  "int4-gptq-sweep-g32", "fp8-awq-gptq"])
def test_bad_method_spellings_raise_one_line_user_errors(name):
    with pytest.raises(UserError) as e:
        parse_recipe(name)
    assert "\n" not in str(e.value) and name in str(e.value)


def test_registry_holds_every_canonical_name():
    assert set(RECIPES) == set(RECIPE_NAMES)
    assert all(RECIPES[n].name == n for n in RECIPE_NAMES)


@pytest.mark.parametrize("name", ["int5", "int4-g48", "int4-fancy", "fp8-g32", "8da4w-asym", "fp8-gptq", ""])
def test_bad_names_raise_one_line_user_errors(name):
    with pytest.raises(UserError) as e:
        parse_recipe(name)
    assert "\n" not in str(e.value)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(UserError, match="int4-awq-g64.*8da4w-g32.*grammar"):
        parse_recipe("int3-magic")


def test_group_size_must_divide_the_input_dimension():
    fmt = WeightFormat("int", 4, 128, True)
    assert fmt.group_for(1536) == 128
    with pytest.raises(UserError, match=r"group size 128 does not divide the input dimension 576 of q_proj.*32, 64"):
        fmt.group_for(576, "q_proj")
    assert WeightFormat("int", 8, None, True).group_for(576) == 576


def test_bits_per_weight_counts_scales_and_zero_points():
    assert WeightFormat("int", 4, 32, True).bits_per_weight(4096) == 4.5
    assert WeightFormat("int", 4, 32, False).bits_per_weight(4096) == 4.625
    assert WeightFormat("int", 4, 32, False, float_zero=True).bits_per_weight(4096) == 5.0  # fp16 d and m


def test_float_zero_point_recipes():
    r = parse_recipe("int4-gptq-g32-fzp")
    assert (r.method, r.weights) == ("gptq", WeightFormat("int", 4, 32, False, float_zero=True))
    assert r.weights.label() == "int4-g32-fzp" and r.embedding == WeightFormat("int", 8, 32, True)
    assert parse_recipe("int8-g32-fzp").weights.float_zero
    assert QuantRecipe.from_dict(r.to_dict()) == r
    r = parse_recipe("8da4w-g32-fzp")  # XNNPACK: the symmetric part on qb4w, offsets as a float linear
    assert r.activations == "int8-per-token"
    assert r.weights == WeightFormat("int", 4, 32, False, "bfloat16", float_zero=True)
    with pytest.raises(UserError, match="symmetric"):
        parse_recipe("8da8w-fzp")
    with pytest.raises(UserError, match="-fzp"):
        parse_recipe("8da4w-g32-asym")
    with pytest.raises(UserError, match="asymmetric"):
        WeightFormat("int", 4, 32, True, float_zero=True)
    assert WeightFormat("fp8").bits_per_weight(512) == 8 + 32 / 512


def test_k_quant_recipes_are_q4_k_super_blocks_with_a_fallback_for_other_widths():
    """-k: GGUF's Q4_K, 4.5 bits a weight (Q4_1 takes 5.0); rows that are no whole super-blocks fall back
    as llama.cpp's do (Q4_K -> the same groups without super-blocks, Q6_K -> Q8_0)."""
    r = parse_recipe("int4-gptq-g32-fzp-k")
    assert (r.method, r.weights.super_block, r.weights.label()) == ("gptq", 256, "int4-g32-fzp-k256")
    assert QuantRecipe.from_dict(r.to_dict()) == r
    assert "super_block" not in parse_recipe("int4-g32-fzp").to_dict()["weights"]  # older files unchanged
    assert r.weights.bits_per_weight(1024) == 4.5
    q6_k = WeightFormat("int", 6, 16, True, super_block=256)
    assert q6_k.bits_per_weight(2048) == 6.5625  # GGUF's own block size: 210 bytes per 256 weights
    assert r.weights.for_width(640) == WeightFormat("int", 4, 32, False, float_zero=True)
    assert q6_k.for_width(640) == WeightFormat("int", 8, 32, True) and q6_k.for_width(512) == q6_k
    for name in ("int4-g32-sym-k", "int4-g64-fzp-k", "8da4w-g32-fzp-k", "int4-gptq-noact-g32-fzp-k"):
        with pytest.raises(UserError, match="-k .*g32-fzp-k") as e:
            parse_recipe(name)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="K-quants only"):
        WeightFormat("int", 4, 32, True, super_block=256)


def test_resolution_order_keep_float_then_overrides_then_role():
    r = parse_recipe("int4-g32").replace(keep_float=("*.down_proj",))
    r = r.with_overrides({"model.layers.0.self_attn.q_proj": WeightFormat("int", 8, 32, True),
                          "model.layers.0.mlp.down_proj": WeightFormat("int", 8, 32, True)})
    assert r.format_for("model.layers.0.self_attn.q_proj", "linear").bits == 8
    assert r.format_for("model.layers.0.mlp.down_proj", "linear") is None  # keep_float wins
    assert r.format_for("model.layers.1.self_attn.q_proj", "linear") == r.weights
    assert r.format_for("model.embed_tokens", "embedding") == r.embedding


def test_json_round_trip():
    r = parse_recipe("int4-gptq-g64-sym").with_overrides({"model.layers.3.mlp.up_proj": None}, "mixed")
    assert QuantRecipe.from_dict(r.to_dict()) == r
    with pytest.raises(UserError, match="malformed"):
        QuantRecipe.from_dict({"weights": {}})


def test_methods_need_integer_weights():
    with pytest.raises(UserError, match="fp8 is round-to-nearest only"):
        QuantRecipe("x", WeightFormat("fp8"), method="gptq")
