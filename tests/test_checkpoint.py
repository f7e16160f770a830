"""HF folders in and out: bit-exact round trips, transformers compatibility, clear errors on bad input."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from edgefinfer.model.checkpoint import load_model, save_model
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"model_type": "qwen2", "qkv_bias": True}])
def test_save_load_round_trip_is_bit_exact(tmp_path, overrides):
    model = tiny_model(**overrides)
    save_model(model, tmp_path / "m")
    again = load_model(tmp_path / "m")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    if model.config.tie_word_embeddings:
        assert again.lm_head.weight is again.model.embed_tokens.weight


def test_sharded_save_loads_back(tmp_path):
    model = tiny_model()
    save_model(model, tmp_path / "m", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_model(tmp_path / "m")
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"model_type": "qwen2", "qkv_bias": True},
                                       {"model_type": "mistral", "sliding_window": 5}])
def test_transformers_loads_our_folder_with_the_same_logits(tmp_path, overrides):
    model = tiny_model(**overrides)
    save_model(model, tmp_path / "m")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").eval()
    tokens = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        assert (ref(tokens).logits - model(tokens)).abs().max() < 1e-4


def test_save_is_atomic_and_replaces(tmp_path):
    dest = tmp_path / "m"
    save_model(tiny_model(seed=1), dest)

    class Boom(Exception):
        pass

    model = tiny_model(seed=2)
    original = model.state_dict

    def failing_state_dict(*a, **k):
        raise Boom

    model.state_dict = failing_state_dict
    with pytest.raises(Boom):
        save_model(model, dest)
    model.state_dict = original
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left behind
    assert torch.equal(load_model(dest).lm_head.weight, tiny_model(seed=1).lm_head.weight)  # old copy intact
    save_model(model, dest)
    assert torch.equal(load_model(dest).lm_head.weight, model.lm_head.weight)


def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_weights(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors"):
        load_model(tmp_path / "m")


def test_truncated_safetensors(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or corrupt"):
        load_model(tmp_path / "m")


def test_config_that_does_not_match_the_weights(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="has shape .* config.json implies"):
        load_model(tmp_path / "m")


def test_unsupported_architecture_in_folder(tmp_path):
    save_model(tiny_model(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model(tmp_path / "m")
