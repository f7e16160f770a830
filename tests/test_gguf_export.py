"""GGUF export: llama.cpp runs what we write and agrees with eager torch; quantized layers re-pack
bit for bit; the exporter refuses out-of-order calls; the llama.cpp runtime backend decodes exactly."""

import numpy as np
import pytest
import torch

from edgefinfer.compile.gguf_export import GGUFExporter, export_gguf
from edgefinfer.compile.quant.apply import quantize_model
from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.compile.quant.recipe import parse_recipe
from edgefinfer.errors import UserError
from edgefinfer.model.gguf_import import import_gguf, open_gguf
from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
from edgefinfer.runtime.backends.llamacpp_binding import CellFormat
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
        from edgefinfer.decoding.eager import generate_ids
        assert plain == list(generate_ids(model, ids, 24))


@pytest.mark.llamacpp
@pytest.mark.parametrize("recipe, linears, embedding", [("int4-g32-sym", "Q4_0", "Q8_0"),
                                                        ("int4-g32", "Q4_1", "Q8_0"),
                                                        ("int4-g32-fzp", "Q4_1", "Q8_0"),
                                                        ("int4-g32-sym-emb4", "Q4_0", "Q4_0"),
                                                        ("int8-g32-emb8", "Q8_0", "Q8_0")])
def test_quantized_model_repacks_bit_for_bit(tmp_path, tok, recipe, linears, embedding):
    """Our codes go into their exact GGUF type (sym int4 g32 -> Q4_0, asym -> Q4_1, int8 g32 -> Q8_0),
    the file holds our weights bit for bit, and llama.cpp computes our eager quantized model's logits."""
    model = model_for(tok)
    float_logits = eager_logits(model, tok.encode(PROMPT))
    quantize_model(model, parse_recipe(recipe))
    meta = export_gguf(model, tok, tmp_path / "q.gguf", "f16")
    types = {t.name: t.tensor_type.name for t in open_gguf(tmp_path / "q.gguf").reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == linears
    assert types["token_embd.weight"] == types["output.weight"] == embedding
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert meta["gguf_type"] == linears.lower() and meta["tensor_types"][linears] >= 14
    imported, _ = import_gguf(tmp_path / "q.gguf")
    ref = dict(model.named_modules())
    quantized = [n for n, m in ref.items() if hasattr(m, "dequantized")]
    assert len(quantized) == 2 * 7 + 2  # every linear, the embedding and the head
    for name in quantized:
        got_w, want_w = imported.get_submodule(name).weight, ref[name].dequantized()
        if ref[name].fmt.float_zero:  # d * nibble + m16 against (q - z) * d: float32 rounding apart
            assert (got_w - want_w).abs().max() <= 1e-6 * want_w.abs().max(), name
        else:
            assert torch.equal(got_w, want_w), name
    ids = tok.encode(PROMPT)
    # Exact f32 cells (the runtime's default for quantized weights is f16, whose rounding this
    # float-noise comparison would see: runtime_cells).
    got = LlamaCppBackend(tmp_path / "q.gguf", n_ctx=128, threads=1, cells=CellFormat("f32", False)).forward(ids, 0)
    want = eager_logits(model, ids)
    # llama.cpp rounds the activations of quantized matmuls to 8 bits (Q8_0 / Q8_1 blocks of 32), a small
    # part of what quantizing the weights did; with that rounding restated in eager torch, the
    # logits agree to float noise: the file computes exactly our quantized model.
    assert np.abs(got - want).mean() < 0.1 * np.abs(want - float_logits).mean() or linears == "Q8_0"
    hooks = [m.register_forward_hook(llamacpp_matmul) for m in model.modules() if isinstance(m, QuantLinear)]
    diff = np.abs(got - eager_logits(model, ids))
    if "fzp" in recipe:
        # Weights equal to float32 rounding, not bit for bit: an activation lying on a Q8_1 rounding tie
        # can round the other way at one position (measured once: 0.02, everywhere else ~1e-7).
        assert np.median(diff.max(-1)) < 1e-5 and diff.max() < 0.1, diff.max(-1)
    else:
        assert diff.max() < 1e-4
    for h in hooks:
        h.remove()


def test_q5_0_holds_llamacpps_own_blocks_byte_for_byte():
    """int5 in symmetric groups of 32 takes Q5_0's sign convention (a group whose largest magnitude is
    positive gets a negative scale), so weights read from a Q5_0 file quantize back to their codes and
    re-pack into the very bytes gguf-py's reference quantizer wrote."""
    import gguf

    from edgefinfer.bundle.quant_recipe import WeightFormat
    from edgefinfer.compile.quant.layouts import to_gguf_q5_0
    from edgefinfer.compile.quant.primitives import dequantize_int, quantize_int

    w = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
    w[0, :32] = np.abs(w[0, :32])  # one group all positive
    source = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)  # [8, 4 * 22]
    weights = gguf.quants.dequantize(source, gguf.GGMLQuantizationType.Q5_0).reshape(8, 128)
    fmt = WeightFormat(kind="int", bits=5, group_size=32, symmetric=True)
    q = quantize_int(torch.from_numpy(weights), fmt)
    assert (q.scales < 0).sum() >= 8 and q.scales[0, 0] < 0  # about half the groups, and the positive one
    assert torch.equal(dequantize_int(q.codes, q.scales, q.zeros), torch.from_numpy(weights))
    module = QuantLinear.from_float(torch.nn.Linear(128, 8, bias=False), fmt, q)
    assert np.array_equal(to_gguf_q5_0(module), source)


@pytest.mark.llamacpp
def test_int5_layers_go_into_q5_0_and_llamacpp_computes_them(tmp_path, tok):
    """Matrices kept at 5 bits (a source GGUF's Q5_0, beside a 4-bit recipe) are written as Q5_0 bit for
    bit, and llama.cpp's logits are our eager quantized model's."""
    from edgefinfer.bundle.quant_recipe import WeightFormat

    model = model_for(tok)
    ids = tok.encode(PROMPT)
    float_logits = eager_logits(model, ids)
    int5 = WeightFormat(kind="int", bits=5, group_size=32, symmetric=True)
    kept = {"model.layers.0.self_attn.q_proj": int5, "model.layers.1.mlp.up_proj": int5}
    quantize_model(model, parse_recipe("int4-g32-sym").with_overrides(kept))
    export_gguf(model, tok, tmp_path / "q.gguf", "f16")
    types = {t.name: t.tensor_type.name for t in open_gguf(tmp_path / "q.gguf").reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_up.weight"] == "Q5_0"
    assert types["blk.1.attn_q.weight"] == "Q4_0"
    imported, _ = import_gguf(tmp_path / "q.gguf")
    for name in kept:
        assert torch.equal(imported.get_submodule(name).weight, model.get_submodule(name).dequantized()), name
    got = LlamaCppBackend(tmp_path / "q.gguf", n_ctx=128, threads=1, cells=CellFormat("f32", False)).forward(ids, 0)
    want = eager_logits(model, ids)
    # As for the other types: llama.cpp's 8-bit activations are a small part of what the weights' rounding
    # did. (Restating them in eager torch matches Q5_0 to float noise up to the first activation on a
    # rounding tie, which its non-repacked quantize_row_q8_0 breaks otherwise than torch.round.)
    assert np.abs(got - want).mean() < 0.1 * np.abs(want - float_logits).mean()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def llamacpp_matmul(module, args, out):
    """A QuantLinear's output as llama.cpp's CPU kernels compute it: activations rounded per block of 32
    (d = amax / 127 stored in fp16, q = round(x / d), as quantize_row_q8_0 / q8_1 do); for Q4_1 the
    block minimum m multiplies Q8_1's fp16 s = fp16(d * sum(q)) instead of sum(q) * fp16(d)."""
    x = args[0]
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    d16 = d.half().float()
    y = torch.nn.functional.linear((q * d16).reshape(x.shape), module.dequantized())
    if not module.fmt.symmetric:
        m = (-module.scales.float() * (module.zeros.float() + 8)).half().float()  # [N, blocks]: the file's fp16 m
        s = (q.sum(-1, keepdim=True) * d).half().float()
        y = y + torch.einsum("...g,ng->...n", (s - d16 * q.sum(-1, keepdim=True))[..., 0], m)
    return y if module.bias is None else y + module.bias


@pytest.mark.parametrize("recipe, message", [("int4-g64", "int4-g64-asym, which has no exact GGUF type"),
                                             ("int8", "int8-pc-sym, which has no exact GGUF type"),
                                             ("8da4w-g32-emb8", "dynamic activations")])
def test_formats_without_an_exact_gguf_type_are_refused(tmp_path, tok, recipe, message):
    model = model_for(tok)
    quantize_model(model, parse_recipe(recipe))
    with pytest.raises(UserError, match=message) as e:
        export_gguf(model, tok, tmp_path / "q.gguf", "f16")
    assert "int4-g32-sym (Q4_0)" in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing written, not even the temporary


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


def test_a_window_llamacpp_would_ignore_is_refused_past_it(tmp_path, tok):
    # llama.cpp's `llama` architecture reads no sliding window: past 20 tokens it would attend to
    # everything, so both the runtime and the server refuse a longer context, and run within it.
    from edgefinfer.errors import UserError
    from edgefinfer.server_gpu.executor_llamacpp import LlamaCppExecutor

    model = model_for(tok, model_type="mistral", sliding_window=20)
    path = tmp_path / "w.gguf"
    export_gguf(model, tok, path, "f32")
    with pytest.raises(UserError, match="sliding window of 20 tokens.*--max-seq-len 20 or less"):
        LlamaCppBackend(path, n_ctx=128, threads=1)
    with pytest.raises(UserError, match="sliding window of 20 tokens.*--max-model-len 20 or less"):
        LlamaCppExecutor(path, max_num_seqs=1, max_model_len=128, threads=1)
    ids = tok.encode(PROMPT)[:20]
    got = LlamaCppBackend(path, n_ctx=20, threads=1).forward(ids, 0)
    assert np.abs(got - eager_logits(model, ids)).max() < 1e-3  # within the window the two agree


@pytest.mark.llamacpp
@pytest.mark.parametrize("tied, source_type", [(False, "q4_k_m"), (True, "q4_k_m"), (False, "q5_k_m")])
def test_k_quants_of_llamacpps_q4_k_m_come_back_as_its_own_blocks(tmp_path, tok, tied, source_type):
    """A model converted from llama.cpp's Q4_K_M (Q4_K beside Q6_K; a 4-bit embedding and a 6-bit head,
    or one 6-bit tied matrix) and built for gpu-server with int4-g32-fzp-k: the Q6_K matrices stay Q6_K
    (the source's precision) holding the source's weights exactly, the Q4_K ones are re-quantized by
    the recipe onto the grids llama.cpp chose (nearly every block byte for byte), so the file holds
    as many tensor bytes as the source, and llama.cpp computes the file we wrote. From Q5_K_M (Q5_K
    beside Q6_K, all above the recipe's 4 bits) every matrix keeps the source's type."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from edgefinfer.app import build as build_mod
    from edgefinfer.model.gguf_import import convert_gguf

    model = tiny_model(vocab_size=tok.vocab_size, eos_token_id=None, hidden_size=256, intermediate_size=512,
                       max_position_embeddings=256, tie_word_embeddings=tied)  # every width whole super-blocks
    source = tmp_path / "source.gguf"
    export_gguf(model, tok, source, source_type)
    convert_gguf(source, tmp_path / "folder")
    bundle = build_mod.build(build_mod.BuildOptions(target="gpu-server", model=tmp_path / "folder",
                                                    out=tmp_path / "b", eval_tokens=0, recipe="int4-g32-fzp-k"))
    theirs = {t.name: t for t in open_gguf(source).reader.tensors if t.tensor_type != Q.F32}
    ours = {t.name: t for t in open_gguf(bundle / "model.gguf").reader.tensors}
    assert {t.tensor_type for t in theirs.values()} == {Q.Q4_K if source_type == "q4_k_m" else Q.Q5_K, Q.Q6_K}
    assert ("output.weight" in theirs) != tied
    assert sum(t.n_bytes for t in ours.values()) == sum(t.n_bytes for t in open_gguf(source).reader.tensors)
    for name, t in theirs.items():
        mine = ours[name]
        assert mine.tensor_type == t.tensor_type, name
        assert np.array_equal(dequantize(mine.data, Q(mine.tensor_type)), dequantize(t.data, Q(t.tensor_type))) \
            or t.tensor_type in (Q.Q4_K, Q.Q5_K), name
        if t.tensor_type in (Q.Q4_K, Q.Q5_K):
            size = {Q.Q4_K: 144, Q.Q5_K: 176}[t.tensor_type]
            same = (np.asarray(mine.data).reshape(-1, size) == np.asarray(t.data).reshape(-1, size)).all(-1).mean()
            assert same >= 0.99, (name, same)
    # llama.cpp computes our file as faithfully as its own: its 8-bit activations (Q8_K beside K-quants)
    # move its logits off eager torch on the same weights about as much on both files.
    ids = tok.encode(PROMPT)

    def llamacpp_error(path):
        got = LlamaCppBackend(path, n_ctx=128, threads=1, cells=CellFormat("f32", False)).forward(ids, 0)
        return np.abs(got - eager_logits(import_gguf(path)[0], ids)).mean()

    ours_error, theirs_error = llamacpp_error(bundle / "model.gguf"), llamacpp_error(source)
    assert ours_error < 1.5 * theirs_error, (ours_error, theirs_error)
    assert ours_error < 0.2 * np.abs(eager_logits(model, ids) - eager_logits(import_gguf(source)[0], ids)).mean()
