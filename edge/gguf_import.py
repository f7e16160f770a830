"""Import a llama.cpp GGUF file as our Transformer (fp32) and Tokenizer, or as a Hugging Face folder.

A GGUF keeps the hyper-parameters as `<arch>.*` metadata, the tokenizer as `tokenizer.ggml.*`
metadata, and the weights under llama.cpp's tensor names, usually quantized. Three things need care:

* Weights are dequantized to fp32 by gguf-py's numpy code (`gguf.quants.dequantize`), so every type it
  reads is accepted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, the
  IQ* and TQ* types and MXFP4. tests/test_gguf_import.py compares our logits with llama.cpp's for
  F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K files; the others only
  share the code path.
* llama.cpp's `llama` architecture rotates interleaved pairs (2i, 2i+1), HF's rotates halves
  (i, i + D/2). The HF -> GGUF converter therefore permutes the rows of q and k inside each head;
  `unpermute_qk` undoes it. llama.cpp runs `qwen2` with the half-split (NEOX) rotation, so its
  weights are stored as in HF and left alone.
* The tokenizer is rebuilt as a byte-level BPE whose pre-tokenizer applies the same cascade of
  regular expressions that llama.cpp applies for the file's `tokenizer.ggml.pre`, so both produce the
  same ids.

`import_gguf(path) -> (Transformer, Tokenizer)`; `convert_gguf(path, out_dir)` writes a HF folder.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from edgefinfer.checkpoint import save_model
from edgefinfer.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model import Transformer
from edgefinfer.model_files import check_gguf
from edgefinfer.tokenizer import Tokenizer

try:
    import gguf
except ImportError:  # an optional dependency: edgefinfer[data]
    gguf = None

# Bump when the conversion's output changes, so caches keyed on it (edgefinfer.reference) re-convert.
CONVERTER_VERSION = 2

ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp token types (tokenizer.ggml.token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Control tokens llama.cpp (llama-vocab.cpp) treats as end of generation whatever the metadata says.
_END_OF_GENERATION = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|end_of_text|>"}

# The regular expressions llama.cpp (src/llama-vocab.cpp, llm_tokenizer_bpe) applies one after the
# other for each `tokenizer.ggml.pre`; each splits the pieces the previous one produced.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_SPLIT,), "phi-2": (_GPT2_SPLIT,), "mpt": (_GPT2_SPLIT,), "olmo": (_GPT2_SPLIT,),
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "llama-bpe": (_LLAMA3_SPLIT,), "llama3": (_LLAMA3_SPLIT,), "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging, and adds BOS unless the file
# says otherwise, for these (its LLAMA3 pre-tokenizer type).
_LLAMA3_PRES = {"llama-bpe", "llama3", "llama-v3"}


# ---- reading the file ----------------------------------------------------------------------------
@dataclass
class GGUFFile:
    """A parsed GGUF: metadata and tensors (memory-mapped, not yet dequantized)."""
    path: Path
    reader: Any  # gguf.GGUFReader

    @cached_property
    def tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self.reader.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise UserError(f"{self.path}: metadata {key!r} is unreadable ({e}); the file is corrupt") from None

    def require(self, key: str) -> Any:
        value = self.value(key)
        if value is None:
            raise UserError(f"{self.path} lacks the metadata key {key!r}; re-convert it with llama.cpp's "
                            f"convert_hf_to_gguf.py")
        return value


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF's header; bad input (missing, not GGUF, truncated) raises a one-line UserError."""
    if gguf is None:
        raise UserError("reading GGUF files needs the gguf package: pip install 'edgefinfer[data]'")
    file = Path(path)
    check_gguf(file)  # bounds, counts and offsets first: gguf-py's own errors on damage are numpy's
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError):
        # gguf-py reports a short file as numpy shape errors; the cause for the user is one.
        raise UserError(f"{file} is truncated or corrupt: its header or tensor data ends early or does not parse "
                        f"({file.stat().st_size} bytes); re-download it") from None
    return GGUFFile(file, reader)


# ---- config ----------------------------------------------------------------------------------------
def config_from_gguf(g: GGUFFile) -> ModelConfig:
    arch = g.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{g.path}: GGUF architecture {arch!r} is not supported; edgefinfer imports "
                        f"{', '.join(ARCHITECTURES)}")
    tensors = g.tensors

    def hp(key: str, default: Any = None) -> Any:
        value = g.value(f"{arch}.{key}", default) if default is not None else g.require(f"{arch}.{key}")
        if isinstance(value, list):
            raise UserError(f"{g.path}: {arch}.{key} differs per layer, which edgefinfer does not support")
        return value

    if hp("expert_count", 0):
        raise UserError(f"{g.path} is a mixture-of-experts model, which edgefinfer does not support")
    if "rope_freqs.weight" in tensors or hp("rope.scaling.type", "none") not in ("none", ""):
        raise UserError(f"{g.path} uses scaled RoPE (rope_freqs / rope.scaling), which GGUF import does not "
                        f"support; convert the original Hugging Face checkpoint instead")
    hidden, n_heads = int(hp("embedding_length")), int(hp("attention.head_count"))
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    if int(hp("attention.value_length", head_dim)) != head_dim:
        raise UserError(f"{g.path}: key and value head sizes differ, which edgefinfer does not support")
    if int(hp("rope.dimension_count", head_dim)) != head_dim:
        raise UserError(f"{g.path}: RoPE covers {hp('rope.dimension_count')} of {head_dim} head dimensions; "
                        f"edgefinfer rotates whole heads")
    if "token_embd.weight" not in tensors:
        raise UserError(f"{g.path} has no token_embd.weight tensor; it is not a complete {arch} model")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF lists dimensions fastest first
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(hp("feed_forward_length")),
        num_hidden_layers=int(hp("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(hp("attention.head_count_kv", n_heads)),
        head_dim=head_dim if head_dim * n_heads != hidden else None,
        model_type=arch,
        rms_norm_eps=_f32(hp("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(hp("rope.freq_base", 10000.0)),
        max_position_embeddings=int(hp("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        bos_token_id=g.value("tokenizer.ggml.bos_token_id"),
        eos_token_id=_eos_ids(g),
        pad_token_id=g.value("tokenizer.ggml.padding_token_id"),
    )


def _f32(x: float) -> float:
    # GGUF stores float32; keep its shortest decimal (9.99999974e-06 -> 1e-05) so config.json reads well.
    return float(str(np.float32(x)))


def _eos_ids(g: GGUFFile) -> int | list[int] | None:
    """EOS first, then the other ids llama.cpp ends generation on: the eot/eom keys, and control tokens
    it recognises by their text (SmolLM2: <|im_end|> = 2, then <|endoftext|> = 0)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = g.value(f"tokenizer.ggml.{key}")
        if token is not None:
            ids.append(int(token))
    tokens = g.value("tokenizer.ggml.tokens") or []
    types = g.value("tokenizer.ggml.token_type") or []
    ids += [i for i, (t, k) in enumerate(zip(tokens, types, strict=False))
            if k == _CONTROL and t in _END_OF_GENERATION]
    ids = list(dict.fromkeys(ids))
    return None if not ids else ids[0] if len(ids) == 1 else ids


# ---- weights ---------------------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str) -> str | None:
    """Our (HF) parameter name for a llama.cpp tensor name, None if it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m and m[2] in _LAYER_TENSORS:
        return f"model.layers.{m[1]}.{_LAYER_TENSORS[m[2]]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `LlamaModel.permute` on q or k weights/biases [n_heads * D, ...].

    The converter reshapes each head's rows to (2, D/2), i.e. (half, pair index), and transposes to
    (D/2, 2), so HF rows (i, i + D/2) become llama.cpp rows (2i, 2i + 1). We transpose back.
    For k, `n_heads` is the number of key/value heads.
    """
    rows = w.shape[0]
    per_head = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(w.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as a writable float32 array in torch layout [out, in] (GGUF lists dims reversed)."""
    try:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UserError(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, which gguf "
                        f"{_gguf_version()} cannot dequantize; use a file quantized to e.g. Q8_0 or Q4_K_M") from None
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # The reader's arrays view a read-only memmap; torch needs memory it may write.
    return np.require(np.asarray(data, dtype=np.float32), requirements=["C", "W"]).reshape(shape)


def state_dict_from_gguf(g: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights as fp32 tensors under our parameter names, q/k un-permuted for llama."""
    state: dict[str, torch.Tensor] = {}
    for tensor in g.reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise UserError(f"{g.path}: tensor {tensor.name!r} has no counterpart in edgefinfer's "
                            f"{config.model_type} model")
        w = dequantize(tensor)
        if config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config.num_attention_heads)
        elif config.model_type == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config.num_key_value_heads)
        state[name] = torch.from_numpy(w)
    return state


def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor], source: Path) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"{source}: tensors do not match its metadata: {what}")
    for name, tensor in state.items():
        if tensor.shape != expected[name]:
            raise UserError(f"{source}: {name} has shape {tuple(tensor.shape)}, the metadata implies "
                            f"{tuple(expected[name])}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope()  # buffers were created on the meta device
    return model.eval()


# ---- tokenizer -------------------------------------------------------------------------------------
def tokenizer_from_gguf(g: GGUFFile) -> Tokenizer:
    """The file's byte-level BPE tokenizer, splitting text exactly as llama.cpp does."""
    kind = g.value("tokenizer.ggml.model")
    if kind is None:
        raise UserError(f"{g.path} has no tokenizer (tokenizer.ggml.model); edgefinfer needs one in the file")
    if kind != "gpt2":
        raise UserError(f"{g.path}: tokenizer model {kind!r} is not supported; GGUF import reads byte-level BPE "
                        f"('gpt2') tokenizers only")
    pre = g.value("tokenizer.ggml.pre")
    if pre not in _PRE_SPLITS:
        raise UserError(f"{g.path}: pre-tokenizer {pre!r} is not supported; edgefinfer reproduces "
                        f"{', '.join(sorted(_PRE_SPLITS))}")
    tokens: list[str] = g.require("tokenizer.ggml.tokens")
    types: list[int] = g.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(f"{g.path}: {len(tokens)} tokens but {len(types)} token types; the tokenizer is corrupt")
    merges = [_merge_pair(m) for m in g.require("tokenizer.ggml.merges")]

    # llama.cpp maps text -> id with the last id of a duplicated token; a dict does the same.
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     ignore_merges=pre in _LLAMA3_PRES)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # Control and unknown tokens match whole in the text when llama.cpp parses specials; user-defined
    # ones always do. Both exist in the vocabulary, so they keep their ids.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k in (_CONTROL, _UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])

    def token(key: str) -> str | None:
        i = g.value(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(g.value("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES)) and bos is not None
    add_eos = bool(g.value("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        backend.post_processor = _bos_eos_processor(bos if add_bos else None, eos if add_eos else None, backend)
    return Tokenizer(backend, bos_token=bos, eos_token=eos, chat_template=g.value("tokenizer.chat_template"),
                     add_bos_token=add_bos)


def _merge_pair(merge: str) -> tuple[str, str]:
    # Like llama.cpp: split at the first space after the first character.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise UserError(f"tokenizer merge {merge!r} has no space; the GGUF's tokenizer is corrupt")
    return merge[:cut], merge[cut + 1:]


def _bos_eos_processor(bos: str | None, eos: str | None, backend: HFTokenizer) -> processors.TemplateProcessing:
    def wrap(seq: str) -> str:
        return " ".join(p for p in (bos, seq, eos) if p is not None)

    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(p for p in (bos, eos) if p is not None)]
    return processors.TemplateProcessing(single=wrap("$A"), pair=f"{wrap('$A')} {wrap('$B:1')}",
                                         special_tokens=specials)


# ---- entry points ----------------------------------------------------------------------------------
def import_gguf(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """Read a GGUF file: our model with fp32 weights (eval mode) and its tokenizer."""
    g = open_gguf(path)
    config = config_from_gguf(g)
    tokenizer = tokenizer_from_gguf(g)
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(f"{g.path}: the tokenizer has {tokenizer.vocab_size} tokens but token_embd only "
                        f"{config.vocab_size} rows")
    model = model_from_state(config, state_dict_from_gguf(g, config), g.path)
    return model, tokenizer


def convert_gguf(path: str | Path, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Write a GGUF file as a Hugging Face folder (fp32 safetensors, tokenizer.json), atomically."""
    model, tokenizer = import_gguf(path)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save(tok_dir)
        return save_model(model, out_dir, tokenizer_dir=tok_dir, extra_files=extra_files)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
