"""Import a llama.cpp GGUF file as our Transformer (fp32) and Tokenizer, or as a Hugging Face folder.

A GGUF keeps the hyper-parameters as `<arch>.*` metadata, the tokenizer as `tokenizer.ggml.*`
metadata, and the weights under llama.cpp's tensor names, usually quantized. Three things need care:

* Weights are dequantized to fp32 by gguf-py's numpy code (`gguf.quants.dequantize`), so every type it
  reads is accepted: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, the
  IQ* and TQ* types and MXFP4. tests/test_gguf_import.py compares our logits with llama.cpp's for
  F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K files; the others only
  share the code path.
* llama.cpp's architectures map onto our families (`ARCHITECTURES`): llama (Llama, and Mistral when the
  file declares a window), qwen2, qwen3, gemma3, phi3, smollm3. Each one's hard-coded features become
  config features here: Gemma 3's sandwich norms, (1 + w) gains (stored added, so 1:1), embedding
  scale, GeGLU, 5:1 sliding pattern (or the file's per-layer `sliding_window_pattern`) and local RoPE
  base; SmolLM3's no-RoPE layer every 4th; Phi-3's fused `attn_qkv` and `ffn_up` (gate | up), split
  here, and its longrope factors (`rope_factors_short/long`); Llama 3.1's `rope_freqs`; linear and YaRN
  `rope.scaling.*` keys. An architecture outside the list is refused in one line.
* llama.cpp's `llama` and `smollm3` rotate interleaved pairs (2i, 2i+1), HF's rotates halves
  (i, i + D/2). The HF -> GGUF converter therefore permutes the rows of q and k inside each head;
  `unpermute_qk` undoes it. The others run the half-split (NEOX) rotation, stored as in HF.
* The tokenizer is rebuilt as a byte-level BPE whose pre-tokenizer applies the same cascade of
  regular expressions that llama.cpp applies for the file's `tokenizer.ggml.pre`, so both produce the
  same ids.

`import_gguf(path) -> (Transformer, Tokenizer)`; `convert_gguf(path, out_dir)` writes a HF folder.
"""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from edgefinfer.model.config import FULL, SLIDING, ModelConfig, normalize_eos_ids
from edgefinfer.errors import UserError
from edgefinfer.files.untrusted import check_gguf
from edgefinfer.tokenization.tokenizer import Tokenizer, bos_eos_processor

if TYPE_CHECKING:  # torch and the model only for the weights: a GGUF's tokenizer and config load without them
    import torch

    from edgefinfer.model.transformer import Transformer

try:
    import gguf
except ImportError:  # an optional dependency: edgefinfer[data]
    gguf = None

# Bump when the conversion's output changes, so caches keyed on it (edgefinfer.model.reference) re-convert.
CONVERTER_VERSION = 3  # 3: source.json records the GGUF's type

# llama.cpp's architectures we read, and the family each is (llama also covers Mistral).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3")
# Architectures llama.cpp runs with its "normal" RoPE (interleaved pairs): their q/k rows are permuted
# by convert_hf_to_gguf.py (LlamaModel.permute). The others use the half-split (NEOX) rotation, as HF.
PERMUTED_ARCHS = ("llama", "smollm3")
# llama.cpp hard-codes these: SmolLM3 skips RoPE on every 4th layer, Gemma 3 slides 5 layers of 6 with
# a local RoPE base of 10000 unless the file says otherwise.
SMOLLM3_NO_ROPE_STEP = 4
GEMMA3_SWA_PERIOD = 6
GEMMA3_LOCAL_THETA = 10000.0

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
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's sandwich norms (gguf-py's names): HF's post_attention_layernorm is the attention output's
# norm there, and the MLP's input norm is pre_feedforward_layernorm (llama.cpp's ffn_norm).
_SANDWICH_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3's fused matrices: llama.cpp's name -> our parts, stacked along the rows in this order.
FUSED_TENSORS = {
    "attn_qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "ffn_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),  # gate | up, as ggml's swiglu splits it
}
# Tensors that hold RoPE parameters, not weights (read into the config).
# Metadata edgefinfer's export adds (llama.cpp ignores it): the HF rope_scaling behind a rope_freqs tensor.
ROPE_SCALING_KEY = "edgefinfer.rope_scaling"
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def layer_tensor_names(sandwich_norms: bool = False) -> dict[str, str]:
    """llama.cpp's per-layer tensor name -> ours (the part after `blk.N.` / `model.layers.N.`)."""
    return _SANDWICH_TENSORS if sandwich_norms else _LAYER_TENSORS

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
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3",
                "smollm3": "smollm3"}


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
    hidden, n_heads = int(hp("embedding_length")), int(hp("attention.head_count"))
    n_layers = int(hp("block_count"))
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    if int(hp("attention.value_length", head_dim)) != head_dim:
        raise UserError(f"{g.path}: key and value head sizes differ, which edgefinfer does not support")
    rotary = int(hp("rope.dimension_count", head_dim))
    if rotary != head_dim and (arch in PERMUTED_ARCHS or not 0 < rotary < head_dim or rotary % 2):
        raise UserError(f"{g.path}: RoPE covers {rotary} of {head_dim} head dimensions, which edgefinfer does "
                        f"not support for {arch} (partial rotary: phi3, qwen2, qwen3, gemma3)")
    if "token_embd.weight" not in tensors:
        raise UserError(f"{g.path} has no token_embd.weight tensor; it is not a complete {arch} model")
    vocab_size = int(tensors["token_embd.weight"].shape[1])  # GGUF lists dimensions fastest first
    max_pos = int(hp("context_length", 2048))
    theta = _f32(hp("rope.freq_base", 10000.0))
    features: dict[str, Any] = {}

    # Sliding windows: the window, and which layers slide (a per-layer pattern, a period, or all).
    window = int(hp("attention.sliding_window", 0)) or None
    pattern = g.value(f"{arch}.attention.sliding_window_pattern")
    if arch == "gemma3" and window is not None and pattern is None:
        pattern = GEMMA3_SWA_PERIOD
    if window is not None:
        if isinstance(pattern, list):
            slides = [bool(p) for p in pattern]
            if len(slides) != n_layers:
                raise UserError(f"{g.path}: {arch}.attention.sliding_window_pattern lists {len(slides)} layers, "
                                f"the model has {n_layers}")
        elif pattern:  # a period: its last layer attends globally (llama_hparams::set_swa_pattern)
            slides = [i % int(pattern) < int(pattern) - 1 for i in range(n_layers)]
        else:
            slides = [True] * n_layers
        types = tuple(SLIDING if s else FULL for s in slides)
        if SLIDING not in types:
            window = None
        features.update(sliding_window=window, layer_types=None if set(types) <= {SLIDING} else types)
    model_type = _MODEL_TYPES[arch]
    if arch == "llama" and window is not None and features.get("layer_types") is None:
        model_type = "mistral"  # llama.cpp ignores it; the model is Mistral's, whose window we apply

    features["rope_scaling"] = _rope_scaling_from_gguf(g, arch, hp, theta, rotary, max_pos)
    if arch in ("qwen3", "gemma3"):
        features["qk_norm"] = True
    if arch == "gemma3":
        scale = g.value(f"{arch}.attention.scale")
        if scale:
            scalar = 1.0 / float(scale) ** 2
            scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-3 * scalar else _f32(scalar)
        else:  # llama.cpp's rule (gemma_pytorch's config): 27B scales by hidden / heads, the others by head_dim
            scalar = hidden // n_heads if n_layers == 62 else head_dim
        features.update(norm_offset=1.0, sandwich_norms=True, embedding_scale=hidden ** 0.5,
                        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                        rope_local_theta=_f32(hp("rope.freq_base_swa", GEMMA3_LOCAL_THETA)))
        if window is None:
            features["rope_local_theta"] = None
    if arch == "smollm3":
        features["no_rope_layers"] = tuple(i for i in range(n_layers) if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0)
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(hp("feed_forward_length")),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(hp("attention.head_count_kv", n_heads)),
        head_dim=head_dim if head_dim * n_heads != hidden or arch == "gemma3" or arch == "qwen3" else None,
        model_type=model_type,
        rms_norm_eps=_f32(hp("attention.layer_norm_rms_epsilon")),
        rope_theta=theta,
        partial_rotary_factor=rotary / head_dim,
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors or "blk.0.ffn_down.bias" in tensors,
        bos_token_id=g.value("tokenizer.ggml.bos_token_id"),
        eos_token_id=_eos_ids(g),
        pad_token_id=g.value("tokenizer.ggml.padding_token_id"),
        **features,
    )


def _rope_scaling_from_gguf(g: GGUFFile, arch: str, hp, theta: float, rotary: int,
                            max_pos: int) -> dict[str, Any] | None:
    """HF rope_scaling from llama.cpp's keys (linear, yarn), its rope_freqs tensor (Llama 3.1's llama3
    scaling, as frequency divisors) or Phi-3's rope_factors_short/long tensors (longrope)."""
    tensors = g.tensors
    kind = hp("rope.scaling.type", "none") or "none"
    original = int(hp("rope.scaling.original_context_length", 0)) or None
    if "rope_factors_short.weight" in tensors or "rope_factors_long.weight" in tensors:
        if arch != "phi3" or not {"rope_factors_short.weight", "rope_factors_long.weight"} <= set(tensors):
            raise UserError(f"{g.path}: rope_factors tensors are Phi-3's longrope; {arch} files do not have them")
        short = [_f32(x) for x in dequantize(tensors["rope_factors_short.weight"]).reshape(-1)]
        long = [_f32(x) for x in dequantize(tensors["rope_factors_long.weight"]).reshape(-1)]
        if len(short) != rotary // 2 or len(long) != rotary // 2:
            raise UserError(f"{g.path}: rope_factors hold {len(short)} factors, RoPE has {rotary // 2} frequencies")
        old = original or max_pos
        scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                                   "original_max_position_embeddings": old}
        factor = max_pos / old
        default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
        attention = float(hp("rope.scaling.attn_factor", default))
        if abs(attention - default) > 1e-6:
            scaling["attention_factor"] = _f32(attention)
        return scaling
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", ""):
            raise UserError(f"{g.path} has both rope_freqs and rope.scaling.type {kind}; edgefinfer reads one")
        return _llama3_from_factors(g, dequantize(tensors["rope_freqs.weight"]).reshape(-1), theta, rotary)
    if kind in ("none", ""):
        return None
    factor = float(hp("rope.scaling.factor", 0.0))
    if not factor and float(g.value(f"{arch}.rope.scale_linear", 0.0) or 0.0):
        factor = float(g.value(f"{arch}.rope.scale_linear"))
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor:
        scaling = {"rope_type": "yarn", "factor": _f32(factor)}
        if original:
            scaling["original_max_position_embeddings"] = original
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = g.value(f"{arch}.rope.scaling.{key}")
            if value is not None:
                scaling[ours] = _f32(value)
        for key, neutral in (("yarn_ext_factor", (1.0, -1.0)), ("yarn_attn_factor", (1.0,)),
                             ("yarn_log_multiplier", (0.0,)), ("attn_factor", (1.0,))):
            value = g.value(f"{arch}.rope.scaling.{key}")
            if value is not None and float(value) not in neutral:
                raise UserError(f"{g.path}: YaRN with rope.scaling.{key} = {value} is not supported; edgefinfer "
                                f"reads the factor, original context and beta_fast / beta_slow")
        return scaling
    raise UserError(f"{g.path}: RoPE scaling {kind!r} is not supported; edgefinfer reads linear and yarn "
                    f"scaling, rope_freqs (llama3) and Phi-3's rope_factors (longrope)")


def llama3_rope_freqs(theta: float, rotary: int, scaling: dict[str, Any]) -> np.ndarray:
    """The rope_freqs tensor of llama3 `scaling`: each frequency's divisor (convert_hf_to_gguf.py's)."""
    from edgefinfer.model.config import Rope

    rope = Rope(float(theta), rotary, tuple(sorted((k, v) for k, v in scaling.items())))
    base = Rope(float(theta), rotary).inv_freq_and_factor(0)[0].double()
    return (base / rope.inv_freq_and_factor(0)[0].double()).float().numpy()


def _llama3_from_factors(g: GGUFFile, factors: np.ndarray, theta: float, rotary: int) -> dict[str, Any]:
    """Llama 3.1's rope_scaling from the per-frequency divisors convert_hf_to_gguf.py writes as rope_freqs:
    1 for short wavelengths, `factor` for long ones, 1 / ((1 - s) / factor + s) between, with
    s = (old / wavelength - low) / (high - low). Only old / (high - low) and low / (high - low) are
    determined; low_freq_factor is taken as 1 (as every Llama 3.x has it)."""
    f = factors.astype(np.float64)
    if len(f) != rotary // 2:
        raise UserError(f"{g.path}: rope_freqs holds {len(f)} factors, RoPE has {rotary // 2} frequencies")
    ours = g.value(ROPE_SCALING_KEY)  # edgefinfer's export records the parameters; used if they give these factors
    if ours:
        scaling = json.loads(ours)
        if scaling.get("rope_type") == "llama3" and np.allclose(
                llama3_rope_freqs(theta, rotary, scaling), f, rtol=1e-6, atol=0):
            return scaling
    wavelen = 2 * math.pi * theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary)
    factor = float(f.max())
    fail = UserError(f"{g.path}: its rope_freqs are not Llama 3.1's llama3 scaling (1, a smooth blend, then a "
                     f"constant factor with the wavelength), which is the only rope_freqs edgefinfer reads")
    if factor <= 1.0 or np.any(np.diff(f) < -1e-6 * factor) or abs(f[0] - 1.0) > 1e-6:
        raise fail
    blend = (f > 1.0 + 1e-6) & (f < factor * (1 - 1e-6))
    if blend.sum() < 2:
        raise fail
    s = (1.0 / f[blend] - 1.0 / factor) / (1.0 - 1.0 / factor)  # = a / wavelength - b
    a, minus_b = np.polyfit(1.0 / wavelen[blend], s, 1)
    b = -minus_b
    if b <= 0 or a <= 0:
        raise fail
    low = 1.0
    high = low + 1.0 / b
    old = a / b
    if abs(old - round(old)) < 1e-3 * old:
        old = round(old)
    if abs(high - round(high, 4)) < 1e-5 * high:
        high = round(high, 4)
    return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low, "high_freq_factor": float(high),
            "original_max_position_embeddings": int(old) if isinstance(old, int) else float(old)}


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


def gguf_vocabulary(path: str | Path) -> tuple[Tokenizer, tuple[int, ...]]:
    """(the file's tokenizer, the ids llama.cpp ends generation on), read once per file version:
    parsing a GGUF's metadata takes seconds, and the runtime, the server and its replicas all ask."""
    path = Path(path)
    return _vocabulary(path, path.stat().st_mtime)


@functools.lru_cache(maxsize=4)
def _vocabulary(path: Path, mtime: float) -> tuple[Tokenizer, tuple[int, ...]]:
    g = open_gguf(path)
    return tokenizer_from_gguf(g), normalize_eos_ids(_eos_ids(g))


# ---- weights ---------------------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str, sandwich_norms: bool = False) -> str | None:
    """Our (HF) parameter name for a llama.cpp tensor name, None if it has none (see also FUSED_TENSORS)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_NAME.fullmatch(gguf_name)
    names = layer_tensor_names(sandwich_norms)
    if m and m[2] in names:
        return f"model.layers.{m[1]}.{names[m[2]]}"
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


def _fused_parts(g: GGUFFile, config: ModelConfig, m: re.Match | None) -> tuple[str, ...]:
    """Our parameter names inside Phi-3's fused tensor matched by `m` (blk.N.NAME); () for any other."""
    if config.family.gguf_arch != "phi3" or m is None or m[2] not in FUSED_TENSORS:
        return ()
    if m[2] == "ffn_up.weight" and f"blk.{m[1]}.ffn_gate.weight" in g.tensors:
        return ()  # gate and up stored apart
    return FUSED_TENSORS[m[2]]


def state_dict_from_gguf(g: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All weights as fp32 tensors under our parameter names: q/k un-permuted for the architectures
    llama.cpp rotates in interleaved pairs, Phi-3's fused qkv and gate|up split into their parts."""
    import torch

    arch = config.family.gguf_arch
    permuted = arch in PERMUTED_ARCHS
    state: dict[str, torch.Tensor] = {}
    for tensor in g.reader.tensors:
        if tensor.name in _ROPE_TENSORS:
            continue  # read into the config's rope_scaling
        m = _LAYER_NAME.fullmatch(tensor.name)
        if _fused_parts(g, config, m):
            w = dequantize(tensor)
            q, kv = config.num_attention_heads * config.dim_per_head, config.num_key_value_heads * config.dim_per_head
            sizes = (q, kv, kv) if m[2] == "attn_qkv.weight" else (config.intermediate_size,) * 2
            if w.shape[0] != sum(sizes):
                raise UserError(f"{g.path}: {tensor.name} has {w.shape[0]} rows, the metadata implies {sum(sizes)}")
            for part, rows in zip(FUSED_TENSORS[m[2]], np.split(w, np.cumsum(sizes)[:-1]), strict=True):
                state[f"model.layers.{m[1]}.{part}"] = torch.from_numpy(np.ascontiguousarray(rows))
            continue
        name = hf_tensor_name(tensor.name, config.sandwich_norms)
        if name is None:
            raise UserError(f"{g.path}: tensor {tensor.name!r} has no counterpart in edgefinfer's "
                            f"{config.model_type} model")
        w = dequantize(tensor)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config.num_key_value_heads)
        state[name] = torch.from_numpy(w)
    return state


def model_from_state(config: ModelConfig, state: dict[str, torch.Tensor], source: Path) -> Transformer:
    import torch

    from edgefinfer.model.transformer import Transformer

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
    """The file's tokenizer, splitting text exactly as llama.cpp does: byte-level BPE ('gpt2') here,
    SentencePiece ('llama', Gemma 3) in `edgefinfer.tokenization.gguf_spm`."""
    kind = g.value("tokenizer.ggml.model")
    if kind is None:
        raise UserError(f"{g.path} has no tokenizer (tokenizer.ggml.model); edgefinfer needs one in the file")
    if kind == "llama":  # SentencePiece (Gemma 3): edgefinfer.tokenization.gguf_spm
        from edgefinfer.tokenization.gguf_spm import spm_tokenizer_from_gguf

        return spm_tokenizer_from_gguf(g)
    if kind != "gpt2":
        raise UserError(f"{g.path}: tokenizer model {kind!r} is not supported; GGUF import reads byte-level BPE "
                        f"('gpt2') and SentencePiece ('llama') tokenizers")
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
        backend.post_processor = bos_eos_processor(bos if add_bos else None, eos if add_eos else None, backend)
    return Tokenizer(backend, bos_token=bos, eos_token=eos, chat_template=g.value("tokenizer.chat_template"),
                     add_bos_token=add_bos)


def _merge_pair(merge: str) -> tuple[str, str]:
    # Like llama.cpp: split at the first space after the first character.
    cut = merge.find(" ", 1)
    if cut < 0:
        raise UserError(f"tokenizer merge {merge!r} has no space; the GGUF's tokenizer is corrupt")
    return merge[:cut], merge[cut + 1:]


# ---- entry points ----------------------------------------------------------------------------------
def import_gguf(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """Read a GGUF file: our model with fp32 weights (eval mode) and its tokenizer."""
    return _import(open_gguf(path))


def file_type(g: GGUFFile) -> str | None:
    """The file's type (`general.file_type`) as llama.cpp's quantizer names it ("q4_1", "q4_k_m", "f16");
    None when the file does not record one."""
    try:
        name = gguf.LlamaFileType(int(g.value("general.file_type"))).name
    except (TypeError, ValueError):
        return None
    return None if name == "GUESSED" else name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def _import(g: GGUFFile) -> tuple[Transformer, Tokenizer]:
    config = config_from_gguf(g)
    tokenizer = tokenizer_from_gguf(g)
    if tokenizer.vocab_size > config.vocab_size:
        raise UserError(f"{g.path}: the tokenizer has {tokenizer.vocab_size} tokens but token_embd only "
                        f"{config.vocab_size} rows")
    model = model_from_state(config, state_dict_from_gguf(g, config), g.path)
    return model, tokenizer


def convert_gguf(path: str | Path, out_dir: str | Path, source: dict[str, Any] | None = None,
                 chat_template: str | None = None) -> Path:
    """Write a GGUF file as a Hugging Face folder (fp32 safetensors, tokenizer.json), atomically.

    The folder's `source.json` holds `source` (what the caller records of the file's origin) and the
    GGUF's own type (`gguf_type`, e.g. "q4_k_m"): its weights already lie on that grid, so a build
    for llama.cpp re-quantizes onto it without loss (`SOURCE_FILE`, read by `source_gguf_type`).
    `chat_template`: the template to use when the file carries none."""
    g = open_gguf(path)
    model, tokenizer = _import(g)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = chat_template
    recorded = {**(source or {}), "gguf_type": file_type(g), "tensor_types": tensor_types(g, model.config)}
    from edgefinfer.model.checkpoint import save_model

    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer.save(tok_dir)
        return save_model(model, out_dir, tokenizer_dir=tok_dir,
                          extra_files={SOURCE_FILE: json.dumps(recorded, indent=2) + "\n"})


SOURCE_FILE = "source.json"
# Bits per weight of the ggml types a converted weight can come from (the grid's own, scales aside).
TYPE_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q8_1": 8, "Q8_K": 8, "Q6_K": 6, "Q5_0": 5, "Q5_1": 5,
             "Q5_K": 5, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "IQ4_NL": 4, "IQ4_XS": 4, "Q3_K": 3, "Q2_K": 2}


def tensor_types(g: GGUFFile, config: ModelConfig) -> dict[str, str]:
    """Module name -> the ggml type its weight matrix was stored in (2-D weights only; Phi-3's fused
    tensors give each part the type of the whole)."""
    types = {}
    for tensor in g.reader.tensors:
        m = _LAYER_NAME.fullmatch(tensor.name)
        if len(tensor.shape) != 2:
            continue
        parts = _fused_parts(g, config, m)
        names = [f"model.layers.{m[1]}.{part}" for part in parts] or [hf_tensor_name(tensor.name, config.sandwich_norms)]
        for name in names:
            if name is not None and name.endswith(".weight"):
                types[name.removesuffix(".weight")] = tensor.tensor_type.name
    return types


def source_tensor_types(folder: str | Path) -> dict[str, str]:
    """Module name -> the GGUF type ("Q5_0") its matrix had in the GGUF a HF folder was converted from
    (empty: not from a GGUF, or unrecorded)."""
    try:
        types = json.loads((Path(folder) / SOURCE_FILE).read_text()).get("tensor_types") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {name: t for name, t in types.items() if isinstance(t, str)}



def source_gguf_type(folder: str | Path) -> str | None:
    """The llama.cpp type of the GGUF a HF folder was converted from (None: not from a GGUF, or unrecorded)."""
    try:
        return json.loads((Path(folder) / SOURCE_FILE).read_text()).get("gguf_type")
    except (OSError, ValueError, AttributeError):
        return None


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
