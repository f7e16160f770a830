"""Pruning: exact masks, SparseGPT's compensation, structured removal against transformers, budgets, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from edgefinfer.model.checkpoint import load_model, save_model
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.prune.calibration import LINEAR_NAMES, collect_all
from edgefinfer.prune.masks import (magnitude_scores, n_m_mask, n_m_violations, unstructured_mask,
                                    wanda_scores)
from edgefinfer.prune.sensitivity import allocate_sparsity, block_perplexity, layer_sensitivity
from edgefinfer.prune.sparsegpt import sparsegpt_prune
from edgefinfer.prune.structured import (Kept, Shape, importance, parameter_count, parse_budget, prune_structured,
                                         prune_to, select, solve_budget)
from edgefinfer.prune.unstructured import UnstructuredSpec, layer_sparsities, prune_unstructured
from tests.helpers import tiny_model

GQA = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=64)


def blocks(n: int = 4, s: int = 16, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(seed))


# ---- masks ----------------------------------------------------------------------------------------

def test_wanda_weighs_magnitude_by_input_norm_per_row():
    w = torch.tensor([[1.0, -2.0, 3.0, -4.0],
                      [4.0, 3.0, -2.0, 1.0]])
    norm = torch.tensor([4.0, 1.0, 1.0, 0.5])  # channel 0 is loud, channel 3 quiet
    assert torch.equal(wanda_scores(w, norm), torch.tensor([[4.0, 2.0, 3.0, 2.0], [16.0, 3.0, 2.0, 0.5]]))
    keep = unstructured_mask(wanda_scores(w, norm), 0.5, "row")
    assert keep.tolist() == [[True, False, True, False], [True, True, False, False]]
    # Magnitude alone, per matrix, keeps the four largest |w| wherever they are.
    keep_mag = unstructured_mask(magnitude_scores(w), 0.5, "matrix")
    assert keep_mag.tolist() == [[False, False, True, True], [True, True, False, False]]


@pytest.mark.parametrize("group", ["row", "matrix"])
def test_unstructured_mask_drops_exactly_floor_of_sparsity(group):
    scores = torch.ones(5, 40)  # all ties: the count must still be exact
    for sparsity in (0.0, 0.3, 0.5, 0.77):
        keep = unstructured_mask(scores, sparsity, group)
        if group == "row":
            assert (keep.sum(1) == 40 - int(40 * sparsity)).all()
        else:
            assert int(keep.sum()) == 200 - int(200 * sparsity)


def test_two_four_keeps_the_two_largest_of_every_four():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.2, 3.0, 1.0, 2.0, 0.0]])
    assert n_m_mask(scores, 2, 4).tolist() == [[False, True, True, False, True, False, True, False]]
    with pytest.raises(UserError, match="divisible by 4"):
        n_m_mask(torch.ones(2, 6), 2, 4)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_sparsity_outside_unit_interval_is_a_user_error(bad):
    with pytest.raises(UserError, match=r"sparsity must be in \[0, 1\)"):
        UnstructuredSpec("wanda", bad)


# ---- SparseGPT ------------------------------------------------------------------------------------

def test_sparsegpt_reconstructs_better_than_wanda_and_magnitude():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(1024, 64, generator=g) @ mix * (0.2 + 2.8 * torch.rand(64, generator=g))  # correlated, uneven
    w = torch.randn(24, 64, generator=g)
    norm, hessian = x.pow(2).sum(0).sqrt(), x.T @ x / x.shape[0]

    def err(w_pruned):
        return (x @ (w - w_pruned).T).pow(2).mean().item()

    magnitude = w * unstructured_mask(magnitude_scores(w), 0.5, "row")
    wanda = w * unstructured_mask(wanda_scores(w, norm), 0.5, "row")
    sgpt = sparsegpt_prune(w, hessian, 0.5, block_size=32)  # two blocks: errors propagate across them
    assert (sgpt == 0).sum(1).tolist() == [32] * 24  # 16 of every 32-column block, per row
    assert err(sgpt) < 0.85 * err(wanda) and err(wanda) < 0.6 * err(magnitude)
    sgpt24 = sparsegpt_prune(w, hessian, pattern=(2, 4), block_size=32)
    assert n_m_violations(sgpt24, 2, 4) == 0 and ((sgpt24 != 0).reshape(24, 16, 4).sum(-1) == 2).all()
    assert err(sgpt24) < 0.7 * err(w * n_m_mask(wanda_scores(w, norm), 2, 4))
    assert err(sparsegpt_prune(w, hessian, 0.0)) == 0.0  # nothing pruned, nothing moved


def test_sparsegpt_prunes_dead_input_channels():
    x = torch.randn(64, 8)
    x[:, 3] = 0.0  # never fires
    w = torch.randn(4, 8)
    out = sparsegpt_prune(w, x.T @ x / 64, 0.25, block_size=8)
    assert (out[:, 3] == 0).all()


# ---- whole-model unstructured ------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_every_method_reaches_the_sparsity_in_every_layer(method):
    model = tiny_model(**GQA)
    calib = blocks()
    prune_unstructured(model, UnstructuredSpec(method, 0.5), calib)
    assert layer_sparsities(model) == [0.5, 0.5, 0.5]
    assert model.model.embed_tokens.weight.ne(0).all() and model.lm_head.weight.ne(0).all()
    model24 = tiny_model(**GQA)
    prune_unstructured(model24, UnstructuredSpec(method, pattern=(2, 4)), calib)
    for layer in model24.model.layers:
        for name in LINEAR_NAMES:
            w = layer.get_submodule(name).weight
            assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), name


def test_wanda_calibrates_sequentially_on_pruned_outputs():
    # Layer 1's statistics must come from layer 0 *after* pruning: compare with a dense-statistics run.
    calib = blocks()
    seq = tiny_model(**GQA)
    prune_unstructured(seq, UnstructuredSpec("wanda", 0.5), calib)
    dense_stats = collect_all(tiny_model(**GQA), calib)
    one_shot = tiny_model(**GQA)
    with torch.no_grad():
        for i, layer in enumerate(one_shot.model.layers):
            for name in LINEAR_NAMES:
                w = layer.get_submodule(name).weight
                w.mul_(unstructured_mask(wanda_scores(w, dense_stats[i][name].norm), 0.5, "row"))
    w0 = [torch.equal(a.self_attn.q_proj.weight, b.self_attn.q_proj.weight)
          for a, b in zip(seq.model.layers, one_shot.model.layers)]
    assert w0[0] and not all(w0[1:])  # same first layer, different later ones


# ---- sensitivity --------------------------------------------------------------------------------------

def test_sensitivity_allocation_averages_to_the_target():
    alloc = allocate_sparsity([0.5, 0.1, 2.0, 0.3, 0.3], 0.5, spread=0.1)
    assert alloc == pytest.approx([0.45, 0.6, 0.4, 0.55, 0.5])  # least sensitive (1) gets the most
    assert sum(alloc) / 5 == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(UserError, match="spread"):
        allocate_sparsity([1.0, 2.0], 0.95, spread=0.1)


def test_layer_sensitivity_measures_each_layer_and_restores_the_model():
    model = tiny_model(**GQA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    deltas = layer_sensitivity(model, UnstructuredSpec("wanda", 0.5), blocks(), blocks(seed=1))
    assert len(deltas) == 3 and len(set(deltas)) == 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The delta is exactly "this layer pruned alone": redo layer 2 by hand.
    stats = collect_all(model, blocks())
    dense = block_perplexity(model, blocks(seed=1))
    with torch.no_grad():
        for name in LINEAR_NAMES:
            w = model.model.layers[2].get_submodule(name).weight
            w.mul_(unstructured_mask(wanda_scores(w, stats[2][name].norm), 0.5, "row"))
    assert block_perplexity(model, blocks(seed=1)) - dense == pytest.approx(deltas[2], rel=1e-9)


# ---- structured -------------------------------------------------------------------------------------

def hf_logits(folder, tokens):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(tokens).logits


@pytest.mark.parametrize("overrides,shape", [
    ({}, Shape(2, 2, 4, 40)),  # drop a layer, a whole KV group, MLP channels
    ({}, Shape(3, 3, 3, 64)),  # one query head per group, every group kept
    ({"model_type": "qwen2", "qkv_bias": True, "tie_word_embeddings": True}, Shape(2, 1, 2, 32)),
])
def test_pruned_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path, overrides, shape):
    model = tiny_model(**GQA, **overrides)
    pruned, kept = prune_structured(model, blocks(), shape)
    assert Shape.of(pruned.config) == shape and pruned.config.head_dim == 8
    assert parameter_count(pruned) == pruned.config.num_parameters()
    save_model(pruned, tmp_path / "p")
    tokens = blocks(2, 20, seed=3)
    with torch.no_grad():
        ours = pruned(tokens)
    assert (hf_logits(tmp_path / "p", tokens) - ours).abs().max().item() < 1e-5
    reloaded = load_model(tmp_path / "p")
    with torch.no_grad():
        assert torch.equal(reloaded(tokens), ours)


def test_full_shape_is_the_identity():
    model = tiny_model(**GQA)
    same, _ = prune_structured(model, blocks(), Shape.of(model.config))
    tokens = blocks(2, 12, seed=5)
    with torch.no_grad():
        assert torch.equal(same(tokens), model(tokens))


def test_dead_structure_is_what_gets_removed_and_logits_do_not_move():
    """Zero a layer's writes, a KV group's query heads and some MLP channels: scores say they are dead,
    the prune removes exactly them, and the logits stay the same."""
    model = tiny_model(**GQA)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()  # layer 1 becomes the identity
        model.model.layers[1].mlp.down_proj.weight.zero_()
        for layer in (model.model.layers[0], model.model.layers[2]):
            layer.self_attn.o_proj.weight[:, 16:32].zero_()  # query heads 2, 3 = KV group 1
            layer.mlp.down_proj.weight[:, :8].zero_()  # MLP channels 0..7
    imp = importance(model, blocks())
    assert imp.layer_distance[1] == 0 and imp.layer_distance[0] > 0 and imp.layer_distance[2] > 0
    kept = select(model.config, imp, Shape(2, 2, 4, 56))
    assert kept.layers == [0, 2]
    assert kept.kv_heads == [[0, 2], [0, 2]] and kept.heads == [[0, 1, 4, 5], [0, 1, 4, 5]]
    assert kept.channels == [list(range(8, 64))] * 2
    tokens = blocks(2, 16, seed=7)
    with torch.no_grad():
        assert (prune_to(model, kept)(tokens) - model(tokens)).abs().max().item() < 1e-5


def test_removing_query_heads_within_groups_equals_silencing_them():
    model = tiny_model(**GQA)
    kept = Kept(layers=[0, 1, 2], kv_heads=[[0, 1, 2]] * 3, heads=[[0, 3, 5]] * 3, channels=[list(range(64))] * 3)
    pruned = prune_to(model, kept)
    with torch.no_grad():
        for layer in model.model.layers:
            for h in (1, 2, 4):  # the dropped query heads: their output columns go silent
                layer.self_attn.o_proj.weight[:, h * 8:(h + 1) * 8] = 0
        tokens = blocks(2, 16, seed=9)
        assert (pruned(tokens) - model(tokens)).abs().max().item() < 1e-5


def test_a_budget_gives_exactly_the_architecture_it_implies():
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    assert smol.num_parameters() == 134_515_008
    budget = parse_budget("0.5", smol)
    assert budget == 67_257_504
    # 20 layers x (884,736 attention + 1,152 norms) + tied embeddings 28,311,552 + final norm 576 = 46,029,888;
    # each MLP channel costs 3 x 576 x 20 = 34,560: floor(21,227,616 / 34,560) = 614 -> 608 (multiple of 32).
    shape = solve_budget(smol, budget, layers=20)
    assert shape == Shape(20, 3, 9, 608)
    cfg = smol.replace(num_hidden_layers=20, intermediate_size=608)
    assert cfg.num_parameters() == 67_042_368 <= budget < cfg.replace(intermediate_size=640).num_parameters()
    assert solve_budget(smol, budget) == Shape(30, 3, 9, 224)  # MLP-only width pruning
    assert solve_budget(smol, budget, kv_heads=2, heads=4, layers=24) == Shape(24, 2, 4, 672)
    assert solve_budget(smol, parse_budget("100M", smol)) == Shape(30, 3, 9, 864)
    with pytest.raises(UserError, match="leaves no MLP channels"):
        solve_budget(smol, parse_budget("0.3", smol))  # 30 layers of attention alone exceed 30%
    # And a real prune holds exactly that many parameters.
    tiny = tiny_model(**GQA)
    shape = solve_budget(tiny.config, parse_budget(0.75, tiny.config), layers=2, kv_heads=2, multiple_of=8)
    pruned, _ = prune_structured(tiny, blocks(), shape)
    assert parameter_count(pruned) == pruned.config.num_parameters() <= int(0.75 * tiny.config.num_parameters())
    assert Shape.of(pruned.config) == shape == Shape(2, 2, 4, 64)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(heads=7), "7 query heads break the GQA groups"),
    (dict(kv_heads=2, heads=8), "use one of 2, 4"),
    (dict(kv_heads=4), "keep between 1 and 3 KV heads"),
    (dict(layers=0), "keep between 1 and 3 layers"),
])
def test_shapes_that_break_gqa_are_user_errors(kwargs, fragment):
    model = tiny_model(**GQA)
    with pytest.raises(UserError, match=fragment) as e:
        solve_budget(model.config, model.config.num_parameters(), **kwargs)
    assert "\n" not in str(e.value)


# ---- the command --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("tiny") / "m"
    save_model(tiny_model(vocab_size=tok.vocab_size, eos_token_id=None, **GQA), folder)
    tok.save(folder)
    return folder


def invoke(*args: str):
    from click.testing import CliRunner

    from edgefinfer.app.prune_command import prune

    return CliRunner().invoke(prune, list(args))


def test_cli_two_four_writes_a_valid_checkpoint_and_report(tiny_folder, tmp_path):
    out = tmp_path / "w24"
    result = invoke(str(tiny_folder), str(out), "--method", "wanda", "--pattern", "2:4", "--calib-blocks", "4",
                    "--calib-len", "32", "--eval-tokens", "300")
    assert result.exit_code == 0, result.output
    state = load_file(out / "model.safetensors")
    for name, w in state.items():
        if any(name.endswith(f"{n}.weight") for n in LINEAR_NAMES):
            assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), name  # exactly 2 of every 4
    report = json.loads((out / "prune_report.json").read_text())
    assert report["sparsity"] == 0.5 and report["params_after"] == report["params_before"]
    assert report["test_ppl_after"] > 0 and report["eval_tokens"] == 300
    assert "Linear sparsity 0.500" in result.output


def test_cli_structured_budget(tiny_folder, tmp_path):
    result = invoke(str(tiny_folder), str(tmp_path / "s"), "--method", "structured", "--params", "0.8",
                    "--layers", "2", "--multiple-of", "8", "--calib-blocks", "2", "--calib-len", "32",
                    "--eval-tokens", "0", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["shape"] == {"layers": 2, "kv_heads": 3, "heads": 6, "intermediate_size": 64}
    assert report["params_after"] == load_model(tmp_path / "s").config.num_parameters() <= report["budget"]


def test_cli_sensitivity_allocation_spreads_sparsity_around_the_target(tiny_folder, tmp_path):
    result = invoke(str(tiny_folder), str(tmp_path / "s"), "--method", "magnitude", "--allocation", "sensitivity",
                    "--spread", "0.1", "--calib-blocks", "4", "--calib-len", "32", "--sensitivity-blocks", "2",
                    "--eval-tokens", "0", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert sorted(report["layer_sparsity"]) == pytest.approx([0.4, 0.5, 0.6])
    assert report["measured_layer_sparsity"] == pytest.approx(report["layer_sparsity"], abs=1e-3)
    assert report["sparsity"] == pytest.approx(0.5, abs=1e-3)
    # The least sensitive layer got the most sparsity.
    deltas = report["sensitivity_ppl_delta"]
    assert report["layer_sparsity"][deltas.index(min(deltas))] == pytest.approx(0.6)


def test_cli_choices_match_the_pipeline():
    from edgefinfer.app.prune_command import METHODS
    from edgefinfer.prune.pipeline import ALL_METHODS

    assert METHODS == ALL_METHODS


@pytest.mark.parametrize("args,fragment", [
    (["--sparsity", "1.0"], "sparsity must be in [0, 1)"),
    (["--method", "structured", "--params", "0.9", "--heads", "5"], "break the GQA groups"),
    (["--pattern", "4:2"], "0 < N < M"),
])
def test_cli_bad_input_is_one_line_exit_2(tiny_folder, tmp_path, monkeypatch, capsys, args, fragment):
    result = invoke(str(tiny_folder), str(tmp_path / "x"), "--eval-tokens", "0", *args)
    assert isinstance(result.exception, UserError) and fragment in str(result.exception)
    # Through the real entry point, as the user sees it.
    from edgefinfer.app import cli
    from edgefinfer.app.prune_command import prune

    monkeypatch.setitem(cli.cli.commands, "prune", prune)
    assert cli.main(["prune", str(tiny_folder), str(tmp_path / "x"), "--eval-tokens", "0", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0]
    assert not (tmp_path / "x").exists()


# ---- the reference model --------------------------------------------------------------------------------

@pytest.mark.reference
def test_wanda_beats_magnitude_at_half_sparsity_on_the_reference_model(smollm2_dir):
    """Measured (1 thread, 8 x 128 calibration tokens, 512 test tokens): see docs/COMPRESSION.md."""
    from edgefinfer.data.corpora import load_text
    from edgefinfer.data.evaluate import perplexity
    from edgefinfer.prune.calibration import calibration_blocks
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode(load_text("test")[:8000])[:512]  # one window: the three differ by 2x and 7x
    calib = calibration_blocks(tok, 8, 128)
    ppl = {}
    for method in ("dense", "magnitude", "wanda"):
        model = load_model(smollm2_dir)
        if method != "dense":
            prune_unstructured(model, UnstructuredSpec(method, 0.5), calib)
        ppl[method] = perplexity(model, ids, window=512).ppl
    print(f"reference test ppl at 50%: {ppl}")
    assert ppl["dense"] < ppl["wanda"] < ppl["magnitude"]
