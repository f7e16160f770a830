"""GGUF import: tiny random models written with gguf-py, checked against llama.cpp on the same file.

Each file is written here the way llama.cpp's convert_hf_to_gguf.py writes one (q/k rows permuted for
the `llama` architecture), imported with edgefinfer.model.gguf_import, and compared with llama-cpp-python
running the very same file: logits, dequantized weights and token ids.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from edgefinfer.model import gguf_import
from edgefinfer.model.checkpoint import load_model
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.gguf_import import convert_gguf, import_gguf, source_gguf_type, source_tensor_types, unpermute_qk
from edgefinfer.model.transformer import Transformer
from edgefinfer.tokenization.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Rows of 256 and 512 values, so llama.cpp can also quantize every matrix to the K-quants (QK_K = 256).
TINY = dict(vocab_size=0, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>"]
N_CTX = 64

# A few thousand characters of everything a pre-tokenizer must get right.
VARIED_TEXT = (
    inspect.getsource(textwrap.dedent)
    + "\nDigits 1234567 and 3.14159, 2024-11-30, 10,000,000; x1y22z333 ١٢٣ ½ Ⅻ ²³.\n"
    + "Whitespace:\n\n\n   three\t\ttabs  two  \r\n trailing   \n"
    + "Unicode: é à ü ß Ωμέγα Привет мир 中文字符 日本語のテキスト 한국어 🙂🚀👍🏽 e\u0301\n"
    + "Contractions: don't I'll WE'RE they've it's you'd SHE'S. Whole words: zzyzx, zzyzx.\n"
    + "Specials: <|im_start|>user\nhi<|im_end|>\n<think>hmm</think><|endoftext|>"
) * 2


# ---- writing GGUF files the way llama.cpp's converter does ------------------------------------------
def train_vocab() -> dict:
    """A byte-level BPE trained on a few KB of stdlib source: tokens, merges and llama.cpp token types."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    text = inspect.getsource(textwrap) + inspect.getsource(json.decoder)
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=SPECIAL + USER_DEFINED, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    tokens.append("Ġzzyzx")  # no merge makes it: only llama3's ignore_merges finds it whole
    types = [3 if t in SPECIAL else 4 if t in USER_DEFINED else 1 for t in tokens]
    return {"tokens": tokens, "types": types, "merges": [" ".join(m) for m in model["merges"]]}


@pytest.fixture(scope="module")
def vocab() -> dict:
    return train_vocab()


def tiny_model(n_vocab: int, seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, "vocab_size": n_vocab, **changes})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not all ones, so a misplaced norm shows
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
        for layer in model.model.layers:  # peaked attention, so that positions (RoPE) matter
            layer.self_attn.q_proj.weight.mul_(3)
            layer.self_attn.k_proj.weight.mul_(3)
        # Logits of a few units, like a trained model's (the N(0, 1) embedding alone gives ~16 when tied).
        model.lm_head.weight.mul_(0.25 if model.config.tie_word_embeddings else 4)
    return model


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotary halves -> llama.cpp interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, *rest = hf.split(".")
    part = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    return f"blk.{layer}.{part['.'.join(rest[:-1])]}.{rest[-1]}"


# general.file_type as llama.cpp's converter records it for a file of one tensor type.
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


def write_gguf(path: Path, model: Transformer, vocab: dict, qtype: Q = Q.F32, pre: str = "gpt-2",
               add_bos: bool | None = False, arch: str | None = None, tokenizer_model: str = "gpt2") -> Path:
    c = model.config
    arch = arch or c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.dim_per_head)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    if qtype in FILE_TYPES:
        w.add_file_type(FILE_TYPES[qtype])
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            a = permute_qk(a, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = permute_qk(a, c.num_key_value_heads)
        if a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), a)
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- llama.cpp as the reference -------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


def llama_logits(llama_cpp, path: Path, ids: list[int]) -> np.ndarray:
    # F32 KV cache: the default F16 cache alone costs ~1e-2 on the logits.
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32, n_threads=1, verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)])
    llm.close()
    return out


def llama_requantize(llama_cpp, src: Path, dst: Path, ftype: int) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # also lets ALL_F32 dequantize a quantized file with llama.cpp's code
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    return dst


def our_logits(model: Transformer, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).numpy()[0]


@pytest.fixture(scope="module")
def ids(vocab) -> list[int]:
    return torch.randint(0, len(vocab["tokens"]), (40,), generator=torch.Generator().manual_seed(1)).tolist()


# ---- the rotary permutation ------------------------------------------------------------------------
def test_unpermute_qk_restores_hf_row_order():
    # One head of D=4 stored by llama.cpp as HF rows (0, 2, 1, 3): pairs (i, i + D/2) made adjacent.
    stored = np.array([[0.0], [2.0], [1.0], [3.0], [4.0], [6.0], [5.0], [7.0]])
    assert unpermute_qk(stored, n_heads=2)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    w = np.random.default_rng(0).normal(size=(3 * 64, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    b = np.arange(3 * 64, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, 3), 3), b)


@pytest.mark.llamacpp
def test_f32_file_matches_llama_cpp_and_round_trips_weights(tmp_path, vocab, ids, llama_cpp):
    source = tiny_model(len(vocab["tokens"]))
    path = write_gguf(tmp_path / "f32.gguf", source, vocab)
    model, _ = import_gguf(path)
    assert model.config == source.config.replace(eos_token_id=[2, 0])  # <|endoftext|> ends generation too
    for name, t in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0, msg=name)
    ours, ref = our_logits(model, ids), llama_logits(llama_cpp, path, ids)
    assert np.abs(ref).max() > 3  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)  # measured 7.6e-6


@pytest.mark.llamacpp
def test_without_unpermute_logits_disagree_with_llama_cpp(tmp_path, vocab, ids, llama_cpp, monkeypatch):
    path = write_gguf(tmp_path / "f32.gguf", tiny_model(len(vocab["tokens"])), vocab)
    ref = llama_logits(llama_cpp, path, ids)
    monkeypatch.setattr(gguf_import, "unpermute_qk", lambda w, n_heads: w)
    wrong, _ = import_gguf(path)
    assert np.abs(our_logits(wrong, ids) - ref).max() > 1.0  # measured 3.7-4.2: the test sees a wrong permutation


@pytest.mark.llamacpp
def test_tied_embeddings_when_output_is_absent(tmp_path, vocab, ids, llama_cpp):
    source = tiny_model(len(vocab["tokens"]), tie_word_embeddings=True)
    path = write_gguf(tmp_path / "tied.gguf", source, vocab)
    assert "output.weight" not in gguf_import.open_gguf(path).tensors
    model, _ = import_gguf(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    np.testing.assert_allclose(our_logits(model, ids), llama_logits(llama_cpp, path, ids), rtol=0, atol=1e-4)


@pytest.mark.llamacpp
def test_qwen2_file_with_biases_matches_llama_cpp(tmp_path, vocab, ids, llama_cpp):
    source = tiny_model(len(vocab["tokens"]), model_type="qwen2", qkv_bias=True, tie_word_embeddings=True,
                        rms_norm_eps=1e-6)
    path = write_gguf(tmp_path / "qwen2.gguf", source, vocab, pre="qwen2")
    model, _ = import_gguf(path)
    assert model.config.model_type == "qwen2" and model.config.qkv_bias
    torch.testing.assert_close(model.model.layers[1].self_attn.k_proj.bias,
                               source.model.layers[1].self_attn.k_proj.bias, rtol=0, atol=0)
    np.testing.assert_allclose(our_logits(model, ids), llama_logits(llama_cpp, path, ids), rtol=0, atol=1e-4)


# ---- quantized files ---------------------------------------------------------------------------------
# Written by gguf-py, or (K-quants, which gguf-py cannot write) by llama.cpp from an F32 file.
# Tolerances on max |logit difference| (logits span about +-10) are about twice the worst of three seeds.
# llama.cpp multiplies these weights with activations rounded to 8 bits (F16/BF16: 16 bits); that is the
# whole gap, since the weights themselves equal llama.cpp's dequantization bit for bit.
GGUF_PY_TYPES = {Q.F16: 0.01, Q.BF16: 0.06, Q.Q8_0: 0.3, Q.Q5_0: 0.3, Q.Q5_1: 0.3, Q.Q4_0: 0.3,
                 Q.Q4_1: 0.3}  # measured max: 3.3e-3, 2.7e-2, 0.15, 0.10, 0.09, 0.09, 0.09
LLAMA_FTYPES = {"Q2_K": (10, Q.Q2_K, 0.3), "Q3_K_M": (12, Q.Q3_K, 0.3), "Q4_K_M": (15, Q.Q4_K, 0.3),
                "Q5_K_M": (17, Q.Q5_K, 0.3), "Q6_K": (18, Q.Q6_K, 0.3)}  # measured max: 0.13, 0.13, 0.14, 0.13, 0.14
LLAMA_FTYPE_ALL_F32 = 0


def _check_quantized(tmp_path, path: Path, ids: list[int], llama_cpp, tol: float) -> None:
    model, _ = import_gguf(path)
    # 1. The weights: ours equal llama.cpp's own dequantization of the same file, bit for bit.
    reference, _ = import_gguf(llama_requantize(llama_cpp, path, tmp_path / "llama-f32.gguf", LLAMA_FTYPE_ALL_F32))
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, rtol=0, atol=0, msg=name)
    # 2. The logits, against llama.cpp running the quantized file.
    ours, ref = our_logits(model, ids), llama_logits(llama_cpp, path, ids)
    assert np.abs(ours - ref).max() < tol
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.llamacpp
@pytest.mark.parametrize("qtype", list(GGUF_PY_TYPES), ids=lambda q: q.name)
def test_gguf_py_quantized_file_matches_llama_cpp(tmp_path, vocab, ids, llama_cpp, qtype):
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", tiny_model(len(vocab["tokens"])), vocab, qtype)
    _check_quantized(tmp_path, path, ids, llama_cpp, GGUF_PY_TYPES[qtype])


@pytest.mark.llamacpp
@pytest.mark.parametrize("ftype", list(LLAMA_FTYPES))
def test_k_quant_file_matches_llama_cpp(tmp_path, vocab, ids, llama_cpp, ftype):
    code, main_type, tol = LLAMA_FTYPES[ftype]
    f32 = write_gguf(tmp_path / "f32.gguf", tiny_model(len(vocab["tokens"])), vocab)
    path = llama_requantize(llama_cpp, f32, tmp_path / f"{ftype}.gguf", code)
    assert main_type in {t.tensor_type for t in gguf_import.open_gguf(path).reader.tensors}
    _check_quantized(tmp_path, path, ids, llama_cpp, tol)


# ---- tokenizer -----------------------------------------------------------------------------------------
@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
@pytest.mark.parametrize("add_bos", [False, True, None])
def test_tokenizer_matches_llama_cpp(tmp_path, vocab, llama_cpp, pre, add_bos):
    path = write_gguf(tmp_path / "tok.gguf", tiny_model(len(vocab["tokens"])), vocab, pre=pre, add_bos=add_bos)
    model, tok = import_gguf(path)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    llama_vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert tok.add_bos_token == llama_cpp.llama_vocab_get_add_bos(llama_vocab)
    assert all(llama_cpp.llama_vocab_is_eog(llama_vocab, i) for i in model.config.eos_token_ids)
    text = VARIED_TEXT
    ids = tok.encode(text)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert tok.encode(text, add_special_tokens=True) == llm.tokenize(text.encode(), add_bos=True, special=True)
    assert tok.decode(ids, skip_special_tokens=False) == text
    plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "").replace("<|endoftext|>", "")
    assert tok.decode(tok.encode(plain)) == llm.detokenize(tok.encode(plain)).decode()
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.chat_template
    llm.close()


def test_special_and_user_defined_tokens_stay_whole(tmp_path, vocab):
    path = write_gguf(tmp_path / "tok.gguf", tiny_model(len(vocab["tokens"])), vocab)
    _, tok = import_gguf(path)
    index = vocab["tokens"].index
    assert tok.encode("<|im_start|><think>") == [index("<|im_start|>"), index("<think>")]
    assert tok.decode(tok.encode("<|im_start|>a<think>")) == "a<think>"  # control tokens are skipped, user ones not


# ---- HF folder ------------------------------------------------------------------------------------------
def test_convert_gguf_writes_a_folder_that_loads_back(tmp_path, vocab, ids):
    path = write_gguf(tmp_path / "m.gguf", tiny_model(len(vocab["tokens"])), vocab, Q.Q8_0, add_bos=True)
    model, tok = import_gguf(path)
    out = convert_gguf(path, tmp_path / "hf", source={"name": "tiny"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "source.json",
                                                      "tokenizer.json", "tokenizer_config.json"]
    # The GGUF's grid is recorded: a llama.cpp build re-quantizes onto it by default.
    recorded = json.loads((out / "source.json").read_text())
    assert {k: recorded[k] for k in ("name", "gguf_type")} == {"name": "tiny", "gguf_type": "q8_0"}
    assert source_gguf_type(out) == "q8_0" and source_gguf_type(tmp_path) is None
    # and each matrix's own type, under our module names: a re-quantization keeps at least its bits
    assert recorded["tensor_types"]["model.layers.0.self_attn.q_proj"] == "Q8_0"
    assert set(recorded["tensor_types"]) == {n.removesuffix(".weight") for n, t in model.state_dict().items()
                                             if t.dim() == 2 and not (n == "lm_head.weight"
                                                                      and model.config.tie_word_embeddings)}
    assert source_tensor_types(out)["model.layers.1.mlp.down_proj"] == "Q8_0" and source_tensor_types(tmp_path) == {}
    loaded, loaded_tok = load_model(out), Tokenizer.from_dir(out)
    np.testing.assert_array_equal(our_logits(loaded, ids), our_logits(model, ids))
    assert loaded_tok.encode(VARIED_TEXT, add_special_tokens=True) == tok.encode(VARIED_TEXT, add_special_tokens=True)
    assert loaded_tok.add_bos_token and loaded_tok.chat_template == tok.chat_template
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


# ---- bad input -------------------------------------------------------------------------------------------
def _one_line_error(path) -> str:
    with pytest.raises(UserError) as e:
        import_gguf(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_file(tmp_path):
    assert "does not exist" in _one_line_error(tmp_path / "nope.gguf")
    assert "is a folder" in _one_line_error(tmp_path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip file, not a model")
    assert "is not a GGUF file" in _one_line_error(tmp_path / "x.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "is not a GGUF file" in _one_line_error(tmp_path / "empty.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.99, 0.001])  # in the tensor data, at its very end, in the header
def test_truncated_file(tmp_path, vocab, keep):
    path = write_gguf(tmp_path / "m.gguf", tiny_model(len(vocab["tokens"])), vocab)
    data = path.read_bytes()
    path.write_bytes(data[: max(8, int(len(data) * keep))])
    assert "truncated" in _one_line_error(path)


def test_unsupported_architecture_tokenizer_and_pre(tmp_path, vocab):
    model = tiny_model(len(vocab["tokens"]))
    msg = _one_line_error(write_gguf(tmp_path / "a.gguf", model, vocab, arch="gpt2"))
    assert "'gpt2' is not supported" in msg and "llama, qwen2" in msg
    assert "tokenizer model 't5'" in _one_line_error(write_gguf(tmp_path / "b.gguf", model, vocab,
                                                                tokenizer_model="t5"))
    assert "pre-tokenizer 'falcon'" in _one_line_error(write_gguf(tmp_path / "c.gguf", model, vocab, pre="falcon"))
