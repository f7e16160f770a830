"""Quantized checkpoints reload bit-exactly and refuse what they cannot read."""

import json

import pytest
import torch
from safetensors.torch import load_file

from edgefinfer.model.checkpoint import save_model
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.checkpoint import load_quantized, read_quantization_config, save_quantized
from edgefinfer.compile.quant.recipe import WeightFormat, parse_recipe
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


@pytest.mark.parametrize("name,tied", [("int4-g32", True), ("int4-gptq-g32-sym", False), ("8da4w-g32", True),
                                       ("int8", False), ("fp8", True), ("int4-g32-embf", False),
                                       ("int4-gptq-g32-fzp", False), ("8da4w-g32-fzp", True),
                                       ("8da4w-g32-fzp-split", False)])
def test_round_trip_is_bit_exact(tmp_path, name, tied):
    model = tiny_model(tie_word_embeddings=tied)
    recipe = parse_recipe(name).with_overrides({"model.layers.1.mlp.up_proj": WeightFormat("int", 8, 32, True)})
    quantize_model(model, recipe, torch.randint(0, 97, (2, 32)))
    save_quantized(model, recipe, tmp_path / "q", extra_files={"note.txt": "hi"})
    loaded, loaded_recipe = load_quantized(tmp_path / "q")
    assert loaded_recipe == recipe
    assert (tmp_path / "q" / "note.txt").read_text() == "hi"
    want, got = model.state_dict(), loaded.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert want[key].dtype == got[key].dtype, key
        assert torch.equal(want[key].float(), got[key].float()), key
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert type(loaded.lm_head) is type(model.lm_head)
    if tied and recipe.embedding is not None:
        assert loaded.lm_head.qweight is loaded.model.embed_tokens.qweight


def test_files_hold_the_documented_tensors(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    recipe = parse_recipe("int4-g32")
    quantize_model(model, recipe)
    save_quantized(model, recipe, tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{name}.qweight"].dtype == torch.int8 and tensors[f"{name}.qweight"].shape == (64, 64)
    assert tensors[f"{name}.scales"].dtype == torch.float16 and tensors[f"{name}.scales"].shape == (64, 2)
    assert tensors[f"{name}.zeros"].dtype == torch.int8
    assert not any(k.startswith("lm_head.") for k in tensors)  # tied: rebuilt from the embedding
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "edgefinfer" and qc["tied_head"] is True
    assert qc["modules"][name] == {"kind": "int", "bits": 4, "group_size": 32, "symmetric": False,
                                   "scale_dtype": "float16", "act_quant": False, "group": 32}
    assert qc["modules"]["model.embed_tokens"]["bits"] == 8


def test_float_and_foreign_checkpoints_are_refused(tmp_path):
    save_model(tiny_model(), tmp_path / "float")
    assert read_quantization_config(tmp_path / "float") is None
    with pytest.raises(UserError, match="not a quantized checkpoint"):
        load_quantized(tmp_path / "float")
    cfg = json.loads((tmp_path / "float" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "float" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="quantized with 'gptq'"):
        load_quantized(tmp_path / "float")


def test_mismatched_tensors_are_refused(tmp_path):
    model = tiny_model()
    recipe = parse_recipe("int4-g32")
    quantize_model(model, recipe)
    save_quantized(model, recipe, tmp_path / "q")
    cfg_file = tmp_path / "q" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"]  # the file still holds its codes
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="do not match its quantization_config"):
        load_quantized(tmp_path / "q")


def test_k_quant_checkpoints_keep_their_float32_scales_and_super_blocks(tmp_path):
    """-k super-blocks store d * level as float32 scales: a checkpoint reloads them bit for bit, with the
    formats (a Q6_K tied embedding, as a Q4_K_M source keeps one) that the GGUF writer reads."""
    from edgefinfer.compile.quant.layouts import to_gguf_q4_k, to_gguf_q6_k

    model = tiny_model(hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    q6_k = WeightFormat("int", 6, 16, True, super_block=256)
    recipe = parse_recipe("int4-gptq-g32-fzp-k").with_overrides({"model.embed_tokens": q6_k, "lm_head": q6_k})
    quantize_model(model, recipe, torch.randint(0, 97, (2, 32)))
    save_quantized(model, recipe, tmp_path / "q")
    loaded, loaded_recipe = load_quantized(tmp_path / "q")
    assert loaded_recipe == recipe
    want, got = model.state_dict(), loaded.state_dict()
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    down = loaded.get_submodule("model.layers.0.mlp.down_proj")
    assert down.scales.dtype == torch.float32 and down.fmt.super_block == 256
    assert (to_gguf_q4_k(down) == to_gguf_q4_k(model.get_submodule("model.layers.0.mlp.down_proj"))).all()
    assert to_gguf_q6_k(loaded.model.embed_tokens).shape == (97, 210)
    assert loaded.lm_head.qweight is loaded.model.embed_tokens.qweight
