"""Bundles run unmodified in the peers' own runners: ExecuTorch's TextLLMRunner (android), the
generator of onnxruntime-genai (linux-x86_64) and llama.cpp's tokenizer, template and generation loop
(gpu-server) give edgefinfer's greedy tokens and tokenizers' ids.

The bundles are built by the CLI from the reference model cut to its first layer: the real SmolLM2
tokenizer, vocabulary and embeddings (everything a tokenizer or runner can get wrong), at a lowering
time CI can afford. bench/deploy.py runs the same checks on the whole model."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from edgefinfer.compile.runner_tokenizer import (GPT2_PATTERN, PROBE_TEXTS, describe, load_runner_tokenizer,
                                                 runner_tokenizer)
from edgefinfer.errors import UserError

pytestmark = pytest.mark.reference


def cli(*args):
    return subprocess.run([sys.executable, "-m", "edgefinfer", *args], capture_output=True, text=True,
                          timeout=1200)


@pytest.fixture(scope="module")
def smollm2_tokenizer_json(smollm2_dir):
    return json.loads((smollm2_dir / "tokenizer.json").read_text())


@pytest.fixture(scope="module")
def one_layer_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2-135M with only its first decoder layer: same tokenizer, vocabulary and embeddings."""
    from edgefinfer.model.checkpoint import load_model, save_model

    model = load_model(smollm2_dir)
    model.model.layers = model.model.layers[:1]
    model.config = dataclasses.replace(model.config, num_hidden_layers=1)
    folder = tmp_path_factory.mktemp("peers") / "smollm2-1layer"
    save_model(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def bundles(one_layer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles")
    for target in ("android", "linux-x86_64", "gpu-server"):
        proc = cli("build", "--target", target, "--model", str(one_layer_dir), "-o", str(out / target),
                   "--eval-tokens", "128", "--max-seq-len", "256")
        assert proc.returncode == 0, proc.stderr[-2000:]
    return out


# ---- the tokenizer file -------------------------------------------------------------------------------

def test_executorch_tokenizer_drops_text_of_smollm2s_original_file(smollm2_dir):
    """The failure this module exists for: the C++ tokenizer keeps only the digit split's matches."""
    cpp = load_runner_tokenizer(smollm2_dir / "tokenizer.json")
    assert list(cpp.encode("The capital of France is", 0, 0)) == []


@pytest.mark.parametrize("dialect", ["executorch", "onnxruntime-genai"])
def test_rewritten_tokenizer_encodes_like_the_original(smollm2_tokenizer_json, dialect):
    from tokenizers import Tokenizer

    rewritten = runner_tokenizer(smollm2_tokenizer_json, dialect)
    original, ours = (Tokenizer.from_str(json.dumps(t)) for t in (smollm2_tokenizer_json, rewritten))
    assert len(PROBE_TEXTS) >= 20
    for text in PROBE_TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == original.encode(text, add_special_tokens=False).ids
    if dialect == "executorch":
        assert describe(rewritten).endswith("pre-tokenizer Digits + ByteLevel")
        cpp = load_runner_tokenizer(rewritten)
        for text in PROBE_TEXTS:
            assert list(cpp.encode(text, 0, 0)) == original.encode(text, add_special_tokens=False).ids, text
    else:
        assert rewritten["pre_tokenizer"]["pretokenizers"][1]["pattern"]["Regex"] == GPT2_PATTERN + r"|\s+"


def test_a_tokenizer_the_runner_cannot_represent_is_refused_naming_its_features(smollm2_tokenizer_json):
    broken = dict(smollm2_tokenizer_json, pre_tokenizer={"type": "Split", "pattern": {"Regex": r"\p{N}"},
                                                         "behavior": "Removed", "invert": False})
    with pytest.raises(UserError) as e:
        runner_tokenizer(broken, "executorch")
    message = str(e.value)
    assert "\n" not in message and "ExecuTorch's runner" in message and "Split({'Regex': '\\\\p{N}'}, Removed)" in message


def test_build_refuses_such_a_tokenizer_before_any_work(one_layer_dir, smollm2_tokenizer_json, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(one_layer_dir, folder)
    broken = dict(smollm2_tokenizer_json, pre_tokenizer={"type": "Split", "pattern": {"Regex": r"\p{N}"},
                                                         "behavior": "Removed", "invert": False})
    (folder / "tokenizer.json").write_text(json.dumps(broken))
    proc = cli("build", "--target", "android", "--model", str(folder), "-o", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "cannot represent this tokenizer exactly" in proc.stderr and "Traceback" not in proc.stderr
    assert "[build 2/" not in proc.stderr  # refused while loading, before the float evaluation
    assert not (tmp_path / "out").exists()


# ---- the peers' runners on built bundles ----------------------------------------------------------------

@pytest.mark.parametrize("target", ["android", "linux-x86_64", "gpu-server"])
def test_peer_runner_gives_edgefinfers_greedy_tokens_and_ids(bundles, target):
    from edgefinfer.app.peer_runners import check_bundle

    rows = check_bundle(bundles / target, max_new_tokens=12)
    assert [r.prompt for r in rows] == ["plain", "chat"]
    for row in rows:
        assert row.tokens_match and row.ids_match, row
        assert row.ours == row.theirs or target == "android"  # android compares the runner's printed bytes
        assert "probe strings 20/20" in row.detail
        assert row.ours  # something was generated to compare (a one-layer model may say only newlines)


def test_android_bundle_tells_how_to_run_it_with_executorchs_runner(bundles):
    from edgefinfer.bundle.manifest import load_manifest

    readme = (bundles / "android" / "README.txt").read_text()
    assert "TextLLMRunner(\"model.pte\", \"tokenizer.json\")" in readme and "llama_main" in readme
    assert "<|im_start|>user\n{prompt}<|im_end|>" in readme  # the chat prompt the runner must be given
    assert load_manifest(bundles / "android").artefact("readme").path == "README.txt"
