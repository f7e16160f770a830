"""GGUF out and in for every family, checked against llama.cpp itself.

Each tiny family model (tests/families.py; a variant where llama.cpp hard-codes something else, see
`llamacpp_config`) is exported as an F32 GGUF; llama-cpp-python reads it under llama.cpp's own
architecture name, computes our logits on a 12-token sequence to float noise (F32 KV cache) and the
same greedy continuation; our import of the file gives our model back.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgefinfer.model.checkpoint import load_model
from edgefinfer.compile.gguf_export import export_gguf
from edgefinfer.model.config import FULL, SLIDING
from edgefinfer.errors import UserError
from edgefinfer.model.gguf_import import import_gguf
from tests.families import NAMES, WINDOW, byte_tokenizer, family_gguf, llamacpp_config, random_hf_model

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

TOKENS = [1, 17, 33, 5, 99, 64, 12, 7, 81, 40, 3, 120]  # 12 > 2 x WINDOW positions
N_CTX = 64
# max |logit difference| with llama.cpp. Its CPU GELU reads a table at fp16-rounded inputs (Gemma's
# GeGLU), the rest is float32 summation order.
TOLERANCE = {"gemma3": 1e-2}  # measured 1.4e-3 .. 1.9e-3
DEFAULT_TOLERANCE = 1e-3


def llama(path, **kw):
    return llama_cpp.Llama(str(path), n_ctx=N_CTX, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                           type_v=llama_cpp.GGML_TYPE_F32, n_threads=1, verbose=False, **kw)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def our_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].numpy()


@pytest.fixture(scope="module", params=NAMES)
def exported(request, tmp_path_factory):
    """(name, our model, its F32 GGUF)."""
    name = request.param
    return (name, *family_gguf(name, tmp_path_factory.mktemp(name)))


@pytest.fixture(scope="module")
def llm(exported):
    model = llama(exported[2])
    yield model
    model.close()


def test_llamacpp_reads_its_own_architecture(exported, llm):
    _, ours, _ = exported
    assert llm.metadata["general.architecture"] == ours.config.family.gguf_arch


def test_logits_match_llamacpp(exported, llm):
    name, ours, _ = exported
    want, got = our_logits(ours, TOKENS), llama_logits(llm, TOKENS)
    assert np.abs(want).max() > 1  # not near-zero numbers
    err = np.abs(got - want).max()
    assert err < TOLERANCE.get(name, DEFAULT_TOLERANCE), f"{name}: max |logit difference| {err:.2e}"


def test_greedy_tokens_equal(exported, llm):
    """Greedy continuation, incremental in llama.cpp (its KV cache, its windows), full forwards here."""
    _, ours, _ = exported
    ids, theirs = list(TOKENS), list(TOKENS)
    llm.reset()
    llm.eval(theirs)
    for _ in range(16):
        ids.append(int(our_logits(ours, ids)[-1].argmax()))
        theirs.append(int(np.argmax(llm.scores[len(theirs) - 1])))
        llm.eval([theirs[-1]])
    assert theirs == ids


def test_import_gives_our_model_back(exported):
    name, ours, path = exported
    back, _ = import_gguf(path)
    assert back.config.family.gguf_arch == ours.config.family.gguf_arch
    for feature in ("qk_norm", "sandwich_norms", "norm_offset", "no_rope_layers", "partial_rotary_factor",
                    "hidden_act", "tie_word_embeddings", "qkv_bias", "num_key_value_heads", "dim_per_head"):
        assert getattr(back.config, feature) == getattr(ours.config, feature), feature
    assert [back.config.window_of(i) for i in range(ours.config.num_hidden_layers)] == \
        [ours.config.window_of(i) for i in range(ours.config.num_hidden_layers)]
    for key, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    err = np.abs(our_logits(back, TOKENS) - our_logits(ours, TOKENS)).max()
    assert err < 1e-5, f"{name}: {err:.2e}"  # llama3's scaling is re-derived from float32 factors


def test_window_is_kept_through_gguf(tmp_path):
    """Gemma 3's interleaved windows and local RoPE base, as the tiny config has them, come back."""
    random_hf_model(llamacpp_config("gemma3"), gemma=True).save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    export_gguf(ours, byte_tokenizer(), tmp_path / "g.gguf", "f32")
    back, _ = import_gguf(tmp_path / "g.gguf")
    assert back.config.layer_types == (SLIDING, FULL, SLIDING) and back.config.sliding_window == WINDOW
    assert back.config.rope_local_theta == ours.config.rope_local_theta
    assert back.config.query_pre_attn_scalar == ours.config.query_pre_attn_scalar


def _rewrite_architecture(src, dst, arch: str):
    """A copy of the GGUF `src` whose general.architecture and `<arch>.*` keys say `arch`."""
    reader = gguf.GGUFReader(src)
    old = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        key = field.name.replace(f"{old}.", f"{arch}.", 1) if field.name.startswith(f"{old}.") else field.name
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_unsupported_architecture_is_refused(tmp_path):
    random_hf_model(llamacpp_config("mistral"), gemma=False).save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    export_gguf(ours, byte_tokenizer(), tmp_path / "m.gguf", "f32")
    path = _rewrite_architecture(tmp_path / "m.gguf", tmp_path / "x.gguf", "gpt2")
    with pytest.raises(UserError) as e:
        import_gguf(path)
    text = str(e.value)
    assert "'gpt2' is not supported" in text and "gemma3" in text and "smollm3" in text and "\n" not in text


@pytest.mark.parametrize("family, change, message", [
    ("smollm3", dict(no_rope_layers=(1, 3)), "skips RoPE on every 4th layer"),
    ("smollm3", dict(model_type="llama", qk_norm=True, no_rope_layers=()), "has no q/k norms"),
    ("smollm3", dict(model_type="qwen3", qk_norm=True, no_rope_layers=(),
                     rope_scaling={"rope_type": "llama3", "factor": 8.0}), "takes no rope_freqs tensor"),
    ("gemma3", dict(query_pre_attn_scalar=24), "scales attention by 1/sqrt\\(head_dim\\)"),
    ("gemma3", dict(embedding_scale=3.0), "scales embeddings by sqrt\\(hidden_size\\) only"),
    ("mistral", dict(partial_rotary_factor=0.5), "partial rotary"),
])
def test_what_llamacpp_cannot_run_is_refused_in_one_line(tmp_path, family, change, message):
    from edgefinfer.model.transformer import Transformer

    random_hf_model(llamacpp_config(family), gemma=family == "gemma3").save_pretrained(tmp_path / "hf")
    cfg = load_model(tmp_path / "hf").config.replace(**change)
    with pytest.raises(UserError, match=message) as e:
        export_gguf(Transformer(cfg), byte_tokenizer(), tmp_path / "x.gguf", "f32")
    assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*"))


def test_quantized_fused_phi3_repacks_and_reads_back(tmp_path):
    """Phi-3's q|k|v and gate|up of a quantized model go into one Q8_0 tensor each, row blocks stacked;
    the import splits them back to our codes exactly and llama.cpp runs the file."""
    from edgefinfer.compile.quant.apply import quantize_model
    from edgefinfer.compile.quant.recipe import parse_recipe

    random_hf_model(llamacpp_config("phi3"), gemma=False).save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    quantize_model(ours, parse_recipe("int8-g32-emb8"))
    meta = export_gguf(ours, byte_tokenizer(), tmp_path / "q.gguf", "f16")
    assert meta["gguf_type"] == "q8_0"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors}
    assert types["blk.0.attn_qkv.weight"] == types["blk.1.ffn_up.weight"] == "Q8_0"
    back, _ = import_gguf(tmp_path / "q.gguf")
    want = our_logits(ours, TOKENS)
    assert np.abs(our_logits(back, TOKENS) - want).max() < 1e-5
    model = llama(tmp_path / "q.gguf")
    # llama.cpp also rounds the activations of quantized matmuls to 8 bits (tests/test_gguf_export.py)
    assert np.abs(llama_logits(model, TOKENS) - want).max() < 0.3  # measured 0.09
    model.close()
