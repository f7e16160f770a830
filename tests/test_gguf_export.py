"""GGUF export: llama.cpp runs what we write and agrees with eager torch; quantized layers re-pack
bit for bit; the exporter refuses out-of-order calls; the llama.cpp runtime backend decodes exactly."""

import numpy as np
import pytest
import torch

from edgefinfer.compile.gguf_export import GGUFExporter, export_gguf
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.recipe import parse_recipe
from edgefinfer.errors import UserError
from edgefinfer.gguf_import import import_gguf, open_gguf
from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
from edgefinfer.runtime.decode import Speculation, generate_tokens
from edgefinfer.runtime.speculative.proposers import PromptLookupProposer
from tests.helpers import tiny_model, tiny_tokenizer

PROMPT = "It is a truth universally acknowledged, that a single man in possession"


@pytest.fixture(scope="module")
def tok():
    t = tiny_tokenizer(vocab_size=320)
    t.eos_token = None
    return t


def model_for(tok, **kw):
    # head_dim 32 and widths that are multiples of 32, so every matrix fits GGUF's 32-wide blocks.
    return tiny_model(vocab_size=tok.vocab_size, eos_token_id=None, hidden_size=64, intermediate_size=128,
                      max_position_embeddings=256, **kw)


def eager_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].numpy()


@pytest.mark.parametrize("dtype, tol", [("f32", 1e-3), ("f16", 0.03), ("q8_0", 0.3)])
@pytest.mark.parametrize("arch", [{}, {"tie_word_embeddings": True}, {"model_type": "qwen2", "qkv_bias": True}])
def test_llamacpp_runs_our_export(tmp_path, tok, dtype, tol, arch):
    model = model_for(tok, **arch)
    path = tmp_path / "m.gguf"
    export_gguf(model, tok, path, dtype)
    ids = tok.encode(PROMPT)
    backend = LlamaCppBackend(path, n_ctx=128, threads=1)
    got = backend.forward(ids, 0)
    want = eager_logits(model, ids)
    assert np.abs(got - want).max() < tol
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    if dtype == "f32":  # greedy continuation token for token, incremental on both sides
        plain = list(generate_tokens(backend, ids, 24))
        from edgefinfer.generate import generate_ids
        assert plain == list(generate_ids(model, ids, 24))


def test_quantized_model_repacks_bit_for_bit_into_q4_0(tmp_path, tok):
    model = model_for(tok)
    quantize_model(model, parse_recipe("int4-g32-sym"))
    export_gguf(model, tok, tmp_path / "q.gguf", "q4_0")
    types = {t.name: t.tensor_type.name for t in open_gguf(tmp_path / "q.gguf").reader.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.0.attn_norm.weight"] == "F32"
    imported, _ = import_gguf(tmp_path / "q.gguf")
    ref = dict(model.named_modules())
    quantized = [n for n, m in ref.items() if hasattr(m, "dequantized")]
    assert len(quantized) == 2 * 7 + 2  # every linear, the embedding and the head
    for name in quantized:
        assert torch.equal(imported.get_submodule(name).weight, ref[name].dequantized()), name
    ids = tok.encode(PROMPT)
    got = LlamaCppBackend(tmp_path / "q.gguf", n_ctx=128, threads=1).forward(ids, 0)
    want = eager_logits(model, ids)
    # llama.cpp quantizes activations to 8 bits for Q4_0 matmuls; the weights themselves are exact,
    # so the remaining error is a small fraction of the logits' spread.
    assert np.abs(got - want).mean() < 0.1 * want.std()


def test_k_quant_goes_through_llamacpp_quantizer(tmp_path, tok):
    model = tiny_model(vocab_size=tok.vocab_size, eos_token_id=None, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, num_key_value_heads=2)
    export_gguf(model, tok, tmp_path / "k.gguf", "q4_k_m")
    types = {t.tensor_type.name for t in open_gguf(tmp_path / "k.gguf").reader.tensors}
    assert "Q4_K" in types
    assert not list(tmp_path.glob(".*"))  # temporaries removed


def test_tokenizer_in_the_file_matches_ours(tmp_path, tok):
    import llama_cpp

    export_gguf(model_for(tok), tok, tmp_path / "m.gguf", "f16")
    vocab = llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)
    text = "It is a truth, 12 naïve café ✓ 你好.\n  indented"
    assert vocab.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text)


def test_exporter_refuses_out_of_order_calls(tmp_path, tok):
    exporter = GGUFExporter(tmp_path / "x.gguf")
    with pytest.raises(RuntimeError, match="add_weights needs state TOKENIZER, the exporter is in NEW"):
        exporter.add_weights(model_for(tok))
    exporter.add_config(model_for(tok).config)
    with pytest.raises(RuntimeError, match="add_config needs state NEW"):
        exporter.add_config(model_for(tok).config)
    with pytest.raises(RuntimeError, match="write needs state WEIGHTS"):
        exporter.write()
    with pytest.raises(UserError, match="unknown GGUF tensor type 'q3'"):
        exporter.add_tokenizer(tok).add_weights(model_for(tok), "q3")
    assert not (tmp_path / "x.gguf").exists()


def test_speculative_decoding_on_llamacpp_is_exact(tmp_path, tok):
    model = model_for(tok)
    export_gguf(model, tok, tmp_path / "m.gguf", "f32")
    backend = LlamaCppBackend(tmp_path / "m.gguf", n_ctx=256, threads=1)
    ids = tok.encode(PROMPT * 2)
    plain = list(generate_tokens(backend, ids, 40))
    spec = Speculation(PromptLookupProposer(max_ngram=2), k=4)
    fast = list(generate_tokens(backend, ids, 40, speculation=spec))
    assert fast == plain and spec.stats.proposed > 0
