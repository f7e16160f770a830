"""The target registry: names, requirements checked up front, one-line refusals."""

import json
import subprocess
import sys
import time

import pytest

from edgefinfer.errors import UserError
from edgefinfer.bundle.targets import TARGETS, Requirement, Target, get_target


def test_every_designed_target_is_registered():
    assert set(TARGETS) == {"android", "ios", "linux-arm64", "linux-x86_64", "qnn", "coreml", "mediatek", "gpu-server"}
    assert get_target("android").backend == "executorch" and get_target("android").delegate == "xnnpack"
    assert get_target("ios").delegate == "coreml"
    assert get_target("gpu-server").format == "gguf"


def test_unknown_target():
    with pytest.raises(UserError, match="unknown target 'symbian'; choose one of: android, ios"):
        get_target("symbian")


def test_missing_sdk_names_it_and_how_to_get_it():
    t = Target("x", "", "pte", "executorch", "fp32",
               requires=(Requirement("Frobnicator SDK", "frobnicator_sdk_not_installed", how="ask Frobnicator"),))
    with pytest.raises(UserError, match=r"target 'x' cannot be built here: Frobnicator SDK is not installed \(ask"):
        t.check()


def test_mediatek_without_its_sdk_fails_fast_in_one_line():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edgefinfer", "targets", "--json"], capture_output=True,
                          text=True, timeout=60)
    rows = {r["target"]: r for r in json.loads(proc.stdout)}
    assert not rows["mediatek"]["buildable"] and "mtk_converter" in rows["mediatek"]["missing"][0]
    assert rows["android"]["buildable"]  # executorch and torchao are test dependencies
    with pytest.raises(UserError, match="mtk_converter"):
        get_target("mediatek").check()
    assert time.perf_counter() - t0 < 30  # generous for a loaded box; the check itself is a find_spec


@pytest.mark.parametrize("recorded, gpu_server", [({"gguf_type": "q4_k_m"}, "int4-g32-fzp-k"),
                                                  ({"gguf_type": "q5_k_m"}, "llamacpp-q5_k_m"),
                                                  ({"gguf_type": "q4_1"}, "llamacpp-q4_1"),
                                                  ({"gguf_type": "iq2_xs"}, "llamacpp-q4_1"),  # no such recipe
                                                  ({}, "llamacpp-q4_1"), (None, "llamacpp-q4_1")])
def test_a_llamacpp_build_keeps_the_grid_of_the_gguf_the_weights_came_from(tmp_path, recorded, gpu_server):
    from edgefinfer.app.build import default_recipe

    if recorded is not None:
        (tmp_path / "source.json").write_text(json.dumps({"name": "m", **recorded}))
    assert default_recipe(get_target("gpu-server"), tmp_path) == gpu_server
    # Other formats keep their own recipe: the grid is llama.cpp's.
    assert default_recipe(get_target("android"), tmp_path) == get_target("android").recipe


def test_a_default_recipe_keeps_the_bits_the_source_gguf_gave_each_matrix(tmp_path):
    from edgefinfer.app.build import source_precision
    from edgefinfer.bundle.recipe import Recipe

    types = {"model.layers.0.self_attn.q_proj": "Q5_0", "model.layers.0.self_attn.o_proj": "Q4_K",
             "model.layers.0.mlp.down_proj": "Q6_K", "model.embed_tokens": "Q8_0"}
    (tmp_path / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    kept = source_precision(tmp_path, Recipe.parse("8da4w-g32-fzp"))
    assert sorted(kept) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]  # 6 and 5 bits
    assert {(f.bits, f.group_size, f.symmetric) for f in kept.values()} == {(8, None, True)}
    # A GGUF keeps a Q5_0 source as Q5_0 (int5 in symmetric groups of 32), a Q6_K one as Q6_K (int6 in
    # symmetric groups of 16, super-blocks of 256) and the rest as Q8_0; the embedding in its own type
    # whatever its bits, unless the recipe keeps it float.
    kept = source_precision(tmp_path, Recipe.parse("int4-g32-fzp"), "gguf")
    assert {n: (f.bits, f.group_size, f.symmetric, f.super_block) for n, f in kept.items()} == {
        "model.layers.0.mlp.down_proj": (6, 16, True, 256), "model.layers.0.self_attn.q_proj": (5, 32, True, None),
        "model.embed_tokens": (8, 32, True, None)}
    assert "model.embed_tokens" not in source_precision(tmp_path, Recipe.parse("int4-g32-fzp-embf"), "gguf")
    types["model.embed_tokens"] = "Q4_K"  # a Q4_K_M file's 4-bit embedding stays 4-bit, not the recipe's emb8
    (tmp_path / "source.json").write_text(json.dumps({"gguf_type": "q4_k_m", "tensor_types": types}))
    assert source_precision(tmp_path, Recipe.parse("int4-g32-fzp"), "gguf")["model.embed_tokens"].label() == \
        "int4-g32-fzp-k256"
    for name, folder in (("int8", tmp_path), ("llamacpp-q4_k_m", tmp_path), ("fp32", tmp_path),
                         ("int4-g32", tmp_path / "elsewhere")):
        assert source_precision(folder, Recipe.parse(name)) == {}
