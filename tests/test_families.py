"""Every supported family on tiny configurations built from transformers' own classes: our import of
the Hugging Face folder gives transformers' logits, a cached decode gives the full forward's, our
save is read back by transformers unchanged, and what we cannot run is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from edgefinfer.model.kv_cache import StaticCache
from edgefinfer.model.checkpoint import load_model, save_model
from edgefinfer.model.config import FULL, SLIDING, ModelConfig
from edgefinfer.errors import UserError
from tests.families import NAMES, WINDOW, hf_model, save_hf

TOKENS = torch.tensor([[1, 17, 33, 5, 99, 64, 12, 7, 81, 40, 3, 120]])  # 12 > 2 x WINDOW positions


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    """(name, transformers model, our model loaded from its saved folder, folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    ref = save_hf(request.param, folder)
    return request.param, ref, load_model(folder), folder


def test_logits_equal_transformers(family):
    name, ref, ours, _ = family
    with torch.no_grad():
        expected = ref(TOKENS).logits
        got = ours(TOKENS)
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"{name}: max |logit difference| {err:.2e}"


def test_cached_decode_equals_full_forward(family):
    """Token by token through a static cache, past every window: the full forward's logits."""
    name, _, ours, _ = family
    cache = StaticCache(ours.config, 1, 32)
    with torch.no_grad():
        full = ours(TOKENS)
        steps = [ours(TOKENS[:, i:i + 1], torch.tensor([[i]]), cache) for i in range(TOKENS.shape[1])]
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-4


def test_saved_folder_is_read_by_transformers(family, tmp_path):
    """Our save writes the family's own config.json and tensor layout (Phi-3 fused, Gemma's norm offset)."""
    import transformers as tf

    name, ref, ours, _ = family
    save_model(ours, tmp_path / "out")
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf["architectures"] == [type(ref).__name__]
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - ref(TOKENS).logits).abs().max().item() < 1e-5


def test_features_are_read_from_the_config(family):
    name, _, ours, _ = family
    cfg = ours.config
    expected = {
        "llama": dict(qk_norm=False, tie_word_embeddings=True),
        "qwen2": dict(qkv_bias=True, layer_types=(FULL, SLIDING, SLIDING)),
        "qwen3": dict(qk_norm=True, head_dim=32),
        "gemma3": dict(qk_norm=True, sandwich_norms=True, norm_offset=1.0, hidden_act="gelu_pytorch_tanh",
                       query_pre_attn_scalar=24, rope_local_theta=10000.0, layer_types=(SLIDING, FULL, SLIDING)),
        "phi3": dict(partial_rotary_factor=0.5),
        "smollm3": dict(no_rope_layers=(1, 3)),
        "mistral": dict(sliding_window=WINDOW, layer_types=None),
    }[name]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert cfg == ModelConfig.from_hf(cfg.to_hf())  # the family's config.json says the same again


def test_interleaved_windows_and_ropes_per_layer():
    cfg = ModelConfig.from_hf(hf_model("gemma3").config.to_dict())
    assert [cfg.window_of(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert cfg.uniform_window is None and cfg.has_global_layers
    local, glob = cfg.rope_of(0), cfg.rope_of(1)
    assert local.theta == 10000.0 and glob.theta == 1e6 and glob.kind == "linear" and cfg.rope_of(2) == local
    smol = ModelConfig.from_hf(hf_model("smollm3").config.to_dict())
    assert [smol.rope_of(i) is None for i in range(4)] == [False, True, False, True]


def test_window_really_cuts_attention():
    """Changing a token more than WINDOW positions back changes nothing in a sliding-only model
    (Mistral), but does change an interleaved one's logits (Gemma 3's global layer sees it)."""
    def delta(name):
        model = hf_model(name)
        a, b = TOKENS.clone(), TOKENS.clone()
        b[0, 2] = 77
        with torch.no_grad():
            return (model(a).logits[0, -1] - model(b).logits[0, -1]).abs().max().item()

    assert delta("mistral") < 1e-6  # two layers: the receptive field is 2 x (WINDOW - 1) = 6 < 9 positions back
    assert delta("gemma3") > 1e-3


@pytest.mark.parametrize("hf, message", [
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
      "text_config": {}, "vision_config": {}}, "vision"),
    ({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2"}, "convolution"),
    ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}, "linear-attention"),
    ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}, "unsupported architecture"),
])
def test_unsupported_architectures_are_refused_naming_the_supported(hf, message):
    with pytest.raises(UserError) as e:
        ModelConfig.from_hf(hf)
    text = str(e.value)
    assert message in text and "Qwen3ForCausalLM" in text and "Gemma3ForCausalLM" in text and "\n" not in text


def test_inconsistent_layer_types_are_refused():
    hf = hf_model("gemma3").config.to_dict()
    hf["layer_types"] = hf["layer_types"][:2]
    with pytest.raises(UserError, match="layer_types lists 2 layers but num_hidden_layers is 3"):
        ModelConfig.from_hf(hf)
    hf["layer_types"] = ["sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(UserError, match="linear_attention"):
        ModelConfig.from_hf(hf)


# ---- compression on every family ----------------------------------------------------------------------

def _calib(vocab: int = 128, n: int = 4, length: int = 16) -> torch.Tensor:
    return torch.randint(3, vocab, (n, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("recipe", ["int8-g32", "int4-g32-fzp", "int4-gptq-g32", "int4-awq-g32", "8da4w-g32"])
def test_quantize_recipes_apply_to_every_family(family, recipe):
    """Data-aware recipes calibrate through each family's layers (q/k norms, sandwich norms, per-layer
    RoPE); the quantized model stays close to the float one and keeps its greedy choice mostly."""
    import copy

    from edgefinfer.compile.quant import parse_recipe, quantize_model

    name, _, ours, _ = family

    def error(r: str) -> float:
        q = copy.deepcopy(ours)
        quantize_model(q, parse_recipe(r), _calib())
        with torch.no_grad():
            ref, got = ours(TOKENS), q(TOKENS)
        return ((got - ref).norm() / ref.norm()).item()

    rel, rtn4 = error(recipe), error("int4-g32")
    # int8 is near lossless; 4-bit recipes land where plain 4-bit rounding does (random weights, 64
    # calibration tokens: no recipe is expected to beat it by much, a broken calibration path is far off)
    assert rel < (0.2 * rtn4 if recipe.startswith("int8") else 1.5 * rtn4), f"{name} {recipe}: {rel:.3f} vs {rtn4:.3f}"


def test_rotation_where_the_features_allow_it(family):
    """A fused rotation (QuaRot R1 + R2) keeps the float logits, except where norms sit on block outputs
    (Gemma's sandwich norms): refused in one line."""
    import copy

    from edgefinfer.compile.quant.rotation import rotate_model

    name, _, ours, _ = family
    r = copy.deepcopy(ours)
    if ours.config.sandwich_norms:
        with pytest.raises(UserError, match="sandwich norms"):
            rotate_model(r)
        return
    rotate_model(r)
    with torch.no_grad():
        assert (r(TOKENS) - ours(TOKENS)).abs().max().item() < 1e-3


@pytest.mark.parametrize("method", ["wanda", "2:4"])
def test_unstructured_pruning_on_every_family(family, method):
    import copy

    from edgefinfer.prune.unstructured import UnstructuredSpec, layer_sparsities, prune_unstructured

    _, _, ours, _ = family
    p = copy.deepcopy(ours)
    spec = UnstructuredSpec("wanda", pattern=(2, 4)) if method == "2:4" else UnstructuredSpec("wanda", 0.5)
    prune_unstructured(p, spec, _calib())
    assert all(abs(s - 0.5) < 1e-6 for s in layer_sparsities(p))
    with torch.no_grad():
        assert torch.isfinite(p(TOKENS)).all()


def test_structured_pruning_keeps_per_layer_features(family, tmp_path):
    """Dropping a layer, a KV group's heads and MLP channels: the kept layers keep their attention type
    and RoPE, and transformers reads the pruned folder with the same logits."""
    import transformers as tf

    from edgefinfer.prune.structured import Shape, prune_structured

    name, _, ours, _ = family
    cfg = ours.config
    # every head kept: transformers' Gemma 3 and Phi-3 configs require hidden_size % heads == 0
    shape = Shape(cfg.num_hidden_layers - 1, cfg.num_key_value_heads, cfg.num_attention_heads, 64)
    pruned, kept = prune_structured(ours, _calib(), shape)
    assert [pruned.config.layer_type(i) for i in range(shape.layers)] == [cfg.layer_type(i) for i in kept.layers]
    assert [pruned.config.rope_of(i) for i in range(shape.layers)] == [cfg.rope_of(i) for i in kept.layers]
    save_model(pruned, tmp_path / "p")
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "p", dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        assert (back(TOKENS).logits - pruned(TOKENS)).abs().max().item() < 1e-4


def test_distillation_student_from_a_depth_override(family):
    """`edgefinfer distill --student '{"num_hidden_layers": 2}'` on any family: the family's own layer
    pattern for the new depth."""
    from edgefinfer.distill.student import config_from_json, student_from_config

    _, _, ours, _ = family
    student = student_from_config(config_from_json({"num_hidden_layers": 2}, ours.config))
    assert student.config.model_type == ours.config.model_type and student.config.num_hidden_layers == 2
    with torch.no_grad():
        assert student(TOKENS).shape == (1, TOKENS.shape[1], 128)


def test_perplexity_windows_start_with_the_scoring_prefix(family):
    """A model trained to see BOS first (Gemma) is scored with BOS before every window, unscored, and a
    window keeps `window` positions in all."""
    import math

    import torch.nn.functional as F

    from edgefinfer.data.evaluate import perplexity

    _, _, ours, _ = family
    ids = TOKENS[0, 1:].tolist() * 3  # 33 tokens, windows of 8 (7 text tokens after the prefix)
    seen = []

    def fn(t):
        seen.append(t[0].tolist())
        return ours(t)

    with torch.no_grad():
        got = perplexity(fn, ids, window=8, stride=8, prefix=[1])
        nll, n = 0.0, 0
        for begin in range(0, len(ids), 7):
            chunk = ids[begin:begin + 7]
            logits = ours(torch.tensor([[1] + chunk]))[0, 1:]
            nll += F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
            n += len(chunk) - 1
    assert all(s[0] == 1 and len(s) <= 8 for s in seen)
    assert got.tokens == n and abs(got.ppl - math.exp(nll / n)) < 1e-4 * got.ppl
