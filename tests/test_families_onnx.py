"""The ONNX Runtime exports of every supported family (tests/families.py): the fused GQA graph against
our eager model (prefill + decode, greedy tokens), the features visible in the graph, onnxruntime-genai
running the folder, the windowed-cache form past the window (interleaved Gemma 3, sliding-only
Mistral), the fixed-shape NPU graph, and an int4 export."""

from __future__ import annotations

import collections
import copy
import json

import numpy as np
import onnx
import pytest

from edgefinfer.model.checkpoint import load_model
from edgefinfer.compile.onnx_export import GENAI_TYPES, export_onnx, gqa_rotates
from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.compile.quant import parse_recipe, quantize_model
from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.ort import OrtBackend, OrtStaticBackend
from edgefinfer.runtime.backends.torch_eager import TorchBackend
from tests.families import NAMES, WINDOW, save_hf
from tests.test_onnx_export import compare as compare_backends

PROMPT = [1, 17, 33, 5, 99, 64, 12, 7, 81, 40, 3, 120]  # 12 tokens: 3x the families' windows
MAX_SEQ = 32
DECODE_STEPS = 6


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    """(name, our model loaded from the family's HF folder, folder of its fp32 static export)."""
    root = tmp_path_factory.mktemp(f"onnx-{request.param}")
    save_hf(request.param, root / "hf")
    model = load_model(root / "hf")
    export_onnx(model, root / "onnx", max_seq_len=MAX_SEQ)
    return request.param, model, root / "onnx"


def compare(ours, ref, steps=DECODE_STEPS):
    """tests/test_onnx_export.compare on this file's prompt (3x the families' windows)."""
    return compare_backends(ours, ref, PROMPT, steps)


def test_float_export_matches_eager(family):
    name, model, folder = family
    diffs, got, want = compare(OrtBackend(folder, threads=1), TorchBackend(model, max_seq_len=MAX_SEQ))
    assert diffs.max() < 1e-4, f"{name}: {diffs}"  # measured 3e-6 .. 6e-6
    assert got == want


def test_graph_carries_the_features(family):
    """Per layer: GQA's window, RoPE inside (or RotaryEmbedding before it, or none) and scale; q/k and
    sandwich norms, GELU, the embedding scale; genai_config's model type."""
    name, model, folder = family
    cfg = model.config
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in gqa]
    assert len(gqa) == cfg.num_hidden_layers
    rotary_outside = 0
    for i, (node, a) in enumerate(zip(gqa, attrs)):
        assert a["local_window_size"] == (cfg.window_of(i) or -1)
        rope = cfg.rope_of(i)
        inside = rope is not None and gqa_rotates(rope.dim, cfg.dim_per_head)
        assert a["do_rotary"] == int(inside)
        rotary_outside += rope is not None and not inside
        if inside:  # this layer's RoPE table: R/2 columns
            cos = next(t for t in proto.graph.initializer if t.name == node.input[7])
            assert list(cos.dims) == [MAX_SEQ, rope.dim // 2]
        if cfg.query_pre_attn_scalar is not None:
            assert abs(a["scale"] - cfg.query_pre_attn_scalar ** -0.5) < 1e-7
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    L = cfg.num_hidden_layers
    assert ops["RotaryEmbedding"] == 2 * rotary_outside
    assert ops["SimplifiedLayerNormalization"] == 1 + 2 * L * cfg.qk_norm + 2 * L * cfg.sandwich_norms
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * L
    assert ops["Gelu"] == (L if cfg.hidden_act == "gelu_pytorch_tanh" else 0)
    scaled = any(t.name == "embedding_scale" for t in proto.graph.initializer)
    assert scaled == (cfg.embedding_scale is not None)
    assert len({n.input[7] for n in gqa if n.input[7:8] and n.input[7]}) == len(
        {r for r in cfg.ropes() if gqa_rotates(r.dim, cfg.dim_per_head)})  # one table per distinct RoPE
    genai = json.loads((folder / "genai_config.json").read_text())
    assert genai["model"]["type"] == GENAI_TYPES[cfg.model_type]


def test_onnxruntime_genai_runs_the_folder(family):
    og = pytest.importorskip("onnxruntime_genai")
    name, model, folder = family
    config = og.Config(str(folder))
    config.overlay('{"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}')
    genai = og.Model(config)
    params = og.GeneratorParams(genai)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + 8)
    gen = og.Generator(genai, params)
    gen.append_tokens(PROMPT)
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    ref = TorchBackend(model, max_seq_len=MAX_SEQ)
    _, _, want = compare(ref, ref, steps=len(got) - 1)
    eos = model.config.eos_token_ids
    first_eos = next((i for i, t in enumerate(want) if t in eos), None)
    want = want if first_eos is None else want[: first_eos + 1]
    assert got == want[: len(got)] and len(got) >= min(len(want), 5), (name, got, want)


def test_static_npu_graph_matches_eager_window_attention(family, tmp_path):
    """The fixed-shape graph (token generator + a 4-token prompt processor) over a ring of 6 slots,
    run 3x past its window, against the torch window cache of the same window."""
    name, model, _ = family
    meta = export_static_decode(model, tmp_path / "g.onnx", cache_slots=6)
    export_static_decode(model, tmp_path / "p.onnx", cache_slots=6, chunk=4)
    assert meta["window"] == (model.config.sliding_window or 7)
    ours = OrtStaticBackend(tmp_path / "g.onnx", threads=1, prefill=tmp_path / "p.onnx")
    ref = TorchBackend(model, window=meta["window"])
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 20).tolist()
    assert np.abs(ours.forward(tokens[:15], 0) - ref.forward(tokens[:15], 0)).max() < 1e-4  # measured 7e-6
    assert np.abs(ours.forward(tokens[15:], 15) - ref.forward(tokens[15:], 15)).max() < 1e-4
    proto = onnx.load(str(tmp_path / "g.onnx"), load_external_data=False)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)  # standard ops only


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_window_form_past_the_window(tmp_path, name):
    """kv="window": GQA's windowed cache at the model's window (4) over 5 + 1 slots, 3x past it with
    compactions and a rollback, against the torch window cache. Gemma 3's global layer is windowed
    by the cache too (as the torch cache does)."""
    save_hf(name, tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    meta = export_onnx(model, tmp_path / "onnx", kv="window", lookahead=2)
    assert meta["window"] == WINDOW and meta["kv"]["layout"] == "window"
    ours = OrtBackend(tmp_path / "onnx", threads=1)
    ref = TorchBackend(model, window=WINDOW, num_sinks=0, lookahead=2)
    diffs, got, want = compare(ours, ref, steps=12)
    assert diffs.max() < 1e-4, diffs
    assert got == want
    pos = len(PROMPT) + 12
    ours.rollback(pos - 1)
    ref.rollback(pos - 1)
    assert np.abs(ours.forward([5, 6], pos - 1) - ref.forward([5, 6], pos - 1)).max() < 1e-4
    proto = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    windows = [onnx.helper.get_attribute_value(a) for n in proto.graph.node if n.op_type == "GroupQueryAttention"
               for a in n.attribute if a.name == "local_window_size"]
    assert windows == [WINDOW] * model.config.num_hidden_layers
    with pytest.raises(UserError, match="layer 0 attends to only 4"):  # one window for every layer
        export_onnx(model, tmp_path / "wide", kv="window", window=8)
    with pytest.raises(UserError, match="one attention window for every layer"):  # the NPU graph's ring too
        export_static_decode(model, tmp_path / "wide.onnx", cache_slots=8, window=8)


def test_int4_export_stays_close(tmp_path):
    """Gemma 3 (every feature but partial rotary) in int4: exact to the eager quantized model with
    float activations, close with the fast int8-activation kernel."""
    save_hf("gemma3", tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    for level in (0, 4):
        meta = export_onnx(model, tmp_path / f"int4-{level}", weights="int4", max_seq_len=MAX_SEQ,
                           accuracy_level=level)
        assert meta["weights"] == "int4-g32-sym-emb4"
        eager = copy.deepcopy(model)
        quantize_model(eager, parse_recipe(meta["weights"]))
        got = OrtBackend(tmp_path / f"int4-{level}", threads=1).forward(PROMPT, 0)
        want = TorchBackend(eager, max_seq_len=MAX_SEQ).forward(PROMPT, 0)
        err = np.abs(got - want)
        if level == 0:
            assert err.max() < 1e-4, err.max()  # measured 3e-6
        else:  # measured max 0.13, mean 0.019 (logit std 1.2)
            assert err.max() < 0.4 and err.mean() < 0.05, (err.max(), err.mean())
            assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.75


def test_partial_rotary_inside_gqa(tmp_path):
    """Phi-4-mini's shape of partial rotary (R/2 a multiple of 8): GQA rotates the first R dims itself
    from R/2-column tables (the tiny phi3 above, R/2 = 4, takes the RotaryEmbedding path instead)."""
    from tests.helpers import tiny_model

    model = tiny_model(model_type="phi3", num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.5,
                       vocab_size=128, max_position_embeddings=MAX_SEQ)
    assert (model.config.dim_per_head, model.config.rotary_dim) == (32, 16)
    export_onnx(model, tmp_path, max_seq_len=MAX_SEQ)
    proto = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert not any(n.op_type == "RotaryEmbedding" for n in proto.graph.node)
    diffs, got, want = compare(OrtBackend(tmp_path, threads=1), TorchBackend(model, max_seq_len=MAX_SEQ))
    assert diffs.max() < 1e-4, diffs
    assert got == want
