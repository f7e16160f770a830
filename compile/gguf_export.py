"""GGUF exporter: our model (float or quantized) and tokenizer -> a file llama.cpp loads.

An explicit state machine, like gguf-py's writer it drives: a file is described in a fixed order
and each call refuses to run out of it.

    NEW --add_config--> CONFIG --add_tokenizer--> TOKENIZER --add_weights--> WEIGHTS --write--> WRITTEN

Weight types: F32, F16, BF16, Q8_0, Q4_0 written by gguf-py; K-quants (Q4_K_M, Q5_K_M, Q6_K, ...)
by a second pass through llama.cpp's own quantizer (`llama_model_quantize`) over an F32 file.
A layer already quantized by `edgefinfer.compile.quant` keeps its codes: group-32 symmetric int4 is
re-packed bit for bit into Q4_0, asymmetric int4 into Q4_1, symmetric int5 into Q5_0 (a source GGUF's
Q5_0 matrices, which `build` keeps), symmetric int8 into Q8_0, and K-quant super-blocks (`-k` recipes,
a source's Q5_K and Q6_K matrices) into Q4_K, Q5_K and Q6_K, whatever the
requested type (so a mixed-precision model stays mixed). A quantized layer with no exact GGUF type
(another group size, per-channel, int8 activations, fp8) is refused with the recipes that work:
re-quantizing it would ship a file whose weights are neither ours nor llama.cpp's best. The
requested type applies to float matrices.

Each family is written as llama.cpp's own architecture (`config.family.gguf_arch`) with its metadata
keys and tensor names: qwen3 and gemma3 q/k norms, gemma3's four norms per layer, window, per-layer
sliding pattern and local RoPE base, phi3's fused q|k|v and gate|up with partial rotary and longrope
(rope_factors tensors), smollm3. RoPE scaling: linear and YaRN as `rope.scaling.*` keys, llama3 as a
`rope_freqs` tensor (as convert_hf_to_gguf.py does), longrope for phi3. What llama.cpp hard-codes
differently (SmolLM3's no-RoPE period, Gemma 3's attention scale and embedding scale, ...) is refused in
one line (`gguf_expressible`) rather than written as a file that would compute another model.

llama.cpp's `llama` and `smollm3` architectures rotate interleaved pairs where HF rotates halves, so q
and k rows are permuted inside each head (the inverse of `edgefinfer.model.gguf_import.unpermute_qk`). The
file is written to a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgefinfer.model.config import FULL, SLIDING, ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.gguf_import import (_CONTROL, _PRE_SPLITS, _USER_DEFINED, FUSED_TENSORS, GEMMA3_LOCAL_THETA,
                                    GEMMA3_SWA_PERIOD, PERMUTED_ARCHS, ROPE_SCALING_KEY, SMOLLM3_NO_ROPE_STEP,
                                    layer_tensor_names, llama3_rope_freqs)
from edgefinfer.model.transformer import Transformer
from edgefinfer.tokenization.tokenizer import Tokenizer, prepends_space, sentencepiece_style

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# llama.cpp ftypes reached by re-quantizing an F32 file with llama_model_quantize (its own rounding:
# Q4_1 there keeps a float block minimum, which our integer zero points cannot express).
LLAMA_FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
                "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
                "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K"}
_HF_TO_GGUF_LAYER = {v: k for k, v in layer_tensor_names(False).items()}
_HF_TO_GGUF_SANDWICH = {v: k for k, v in layer_tensor_names(True).items()}
# What the pinned llama.cpp (llama-cpp-python 0.3.36) reads for gemma3 beyond convert_hf_to_gguf.py's
# keys, measured in tests/test_families_gguf.py: the per-layer sliding pattern
# (`attention.sliding_window_pattern`, bools) and the local RoPE base (`rope.freq_base_swa`), but not
# `attention.scale`: it scales scores by 1/sqrt(head_dim) whatever query_pre_attn_scalar was.
GEMMA3_PATTERN_KEY = True
GEMMA3_LOCAL_KEYS = True
GEMMA3_SCALE_KEY = False


class State(Enum):
    NEW = 0
    CONFIG = 1
    TOKENIZER = 2
    WEIGHTS = 3
    WRITTEN = 4


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split rows (i, i + D/2) -> llama.cpp interleaved rows (2i, 2i + 1), per head."""
    rows = w.shape[0]
    per_head = w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])  # [H, 2, D/2, ...]
    return np.ascontiguousarray(per_head.swapaxes(1, 2)).reshape(w.shape)


def gguf_tensor_name(hf_name: str, config: ModelConfig | None = None) -> str:
    """llama.cpp's name of our parameter `hf_name` (for Phi-3's fused matrices, of the tensor holding it)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if config is not None and config.family.fused_qkv:
            for fused, members in FUSED_TENSORS.items():
                if rest in members:
                    return f"blk.{parts[2]}.{fused}"
        names = _HF_TO_GGUF_SANDWICH if config is not None and config.sandwich_norms else _HF_TO_GGUF_LAYER
        if rest in names:
            return f"blk.{parts[2]}.{names[rest]}"
    raise UserError(f"parameter {hf_name} has no llama.cpp tensor name")


def gguf_expressible(config: ModelConfig) -> None:
    """A one-line UserError if llama.cpp's architecture for `config` would compute something else.

    llama.cpp hard-codes some of what our config holds as features: per architecture, which norms,
    activation and RoPE layout exist, SmolLM3's no-RoPE period, Gemma 3's embedding scale, and the
    RoPE scalings it implements (linear and YaRN by metadata, llama3 by a rope_freqs tensor, longrope
    by Phi-3's rope_factors tensors)."""
    arch = config.family.gguf_arch
    what = f"llama.cpp's {arch} architecture"
    act = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    if config.hidden_act != act:
        raise UserError(f"{what} uses the {act} MLP activation, this model {config.hidden_act}")
    if config.qk_norm != (arch in ("qwen3", "gemma3")):
        raise UserError(f"{what} {'has' if arch in ('qwen3', 'gemma3') else 'has no'} q/k norms, "
                        f"this model {'has' if config.qk_norm else 'has none'}")
    gemma = config.sandwich_norms and config.norm_offset == 1.0 and config.embedding_scale is not None
    if (arch == "gemma3") != gemma or arch != "gemma3" and (config.sandwich_norms or config.norm_offset
                                                             or config.embedding_scale is not None):
        raise UserError(f"{what} {'needs' if arch == 'gemma3' else 'has no'} Gemma's sandwich norms, (1 + w) "
                        f"gains and embedding scale")
    if gemma and abs(config.embedding_scale - config.hidden_size ** 0.5) > 1e-6 * config.embedding_scale:
        raise UserError(f"{what} scales embeddings by sqrt(hidden_size) only, this model by {config.embedding_scale}")
    if config.qkv_bias and arch not in ("llama", "qwen2") or arch == "qwen2" and not config.qkv_bias:
        raise UserError(f"{what} {'needs' if arch == 'qwen2' else 'has no'} q/k/v biases")
    if (config.o_bias or config.mlp_bias) and arch != "llama":
        raise UserError(f"{what} has no output-projection or MLP biases")
    if config.partial_rotary_factor != 1.0 and arch != "phi3":
        raise UserError(f"{what}: edgefinfer exports partial rotary (partial_rotary_factor "
                        f"{config.partial_rotary_factor}) for phi3 only")
    if arch == "smollm3":
        expected = tuple(i for i in range(config.num_hidden_layers) if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0)
        if config.no_rope_layers != expected:
            raise UserError(f"{what} skips RoPE on every {SMOLLM3_NO_ROPE_STEP}th layer {list(expected)}, "
                            f"this model on {list(config.no_rope_layers)}")
    elif config.no_rope_layers:
        raise UserError(f"{what} applies RoPE on every layer; no-RoPE layers need smollm3")
    if config.rope_local_theta is not None and arch != "gemma3":
        raise UserError(f"{what} has one RoPE base; a local RoPE base needs gemma3")
    if arch == "gemma3":
        if config.window_of(0) is None and config.sliding_window is None:
            raise UserError(f"{what}: edgefinfer exports Gemma 3 with its sliding-window layers only")
        local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
        if config.sliding_window is not None and abs(local - GEMMA3_LOCAL_THETA) > 1e-3 and not GEMMA3_LOCAL_KEYS:
            raise UserError(f"{what} uses RoPE base {GEMMA3_LOCAL_THETA:g} on sliding layers, this model {local:g}")
        if not GEMMA3_PATTERN_KEY and [config.layer_type(i) for i in range(config.num_hidden_layers)] != \
                [SLIDING if i % GEMMA3_SWA_PERIOD < GEMMA3_SWA_PERIOD - 1 else FULL
                 for i in range(config.num_hidden_layers)]:
            raise UserError(f"{what} slides 5 layers of every 6; this model's layer_types differ")
        if not GEMMA3_SCALE_KEY and abs(config.attention_scale - _gemma3_scale(config)) > 1e-6:
            raise UserError(f"{what} scales attention by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for 62 layers), "
                            f"this model by query_pre_attn_scalar {config.query_pre_attn_scalar}")
    kind = (config.rope_scaling or {}).get("rope_type", (config.rope_scaling or {}).get("type", "default")) \
        if config.rope_scaling else "default"
    if kind == "llama3" and arch not in ("llama",):
        raise UserError(f"{what} takes no rope_freqs tensor; llama3 RoPE scaling exports for llama models")
    if kind == "longrope" and arch != "phi3":
        raise UserError(f"{what} has no longrope scaling; it exports for phi3 models")
    if kind == "yarn":
        p = config.rope_scaling or {}
        bad = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if p.get(k) not in (None, 1.0)]
        if bad or p.get("truncate", True) is False:
            raise UserError(f"YaRN with {', '.join(bad) or 'truncate=False'} has no llama.cpp metadata; "
                            f"GGUF export writes YaRN's factor, original context and beta_fast / beta_slow")
    if kind == "longrope":
        p = config.rope_scaling or {}
        old = p.get("original_max_position_embeddings", config.max_position_embeddings)
        if len(p.get("short_factor") or ()) != config.rotary_dim // 2 or \
                len(p.get("long_factor") or ()) != config.rotary_dim // 2:
            raise UserError(f"longrope needs short_factor and long_factor of {config.rotary_dim // 2} values each")
        if p.get("factor") not in (None, config.max_position_embeddings / old):
            raise UserError("llama.cpp derives longrope's factor from the context lengths; this model gives another")


def _gemma3_scale(config: ModelConfig) -> float:
    """The attention scale llama.cpp's gemma3 uses (gemma_pytorch: the 27B model scales by hidden / heads)."""
    if config.num_hidden_layers == 62:
        return (config.hidden_size // config.num_attention_heads) ** -0.5
    return config.dim_per_head ** -0.5


def pre_tokenizer_name(tokenizer: Tokenizer) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for our tokenizer's pre-tokenization rules."""
    pre = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits, digits, byte_regex = [], False, False
    for step in steps:
        if step.get("type") == "Split":
            splits.append(step["pattern"].get("Regex"))
        elif step.get("type") == "Digits" and step.get("individual_digits"):
            digits = True
        elif step.get("type") == "ByteLevel":
            byte_regex = step.get("use_regex", True)
    if byte_regex and not splits:
        splits = [_PRE_SPLITS["gpt-2"][0]]
    if digits:
        splits = [r"\p{N}", *splits]
    for name, rules in _PRE_SPLITS.items():
        if tuple(splits) == tuple(rules):
            return name
    raise UserError("the tokenizer's pre-tokenizer has no llama.cpp equivalent edgefinfer knows; GGUF export "
                    f"supports {', '.join(sorted(_PRE_SPLITS))}")


class GGUFExporter:
    def __init__(self, path: str | Path, arch: str | None = None):
        """`arch`: llama.cpp's architecture; None takes the one of the config given to add_config."""
        try:
            import gguf
        except ImportError:
            raise UserError("GGUF export needs the gguf package: pip install gguf==0.19.0") from None
        self._gguf = gguf
        self.path = Path(path)
        self.state = State.NEW
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.writer = None
        self.arch = arch
        self.config: ModelConfig | None = None
        self.notes: list[str] = []
        self.tensor_types: dict[str, str] = {}

    def _open(self, arch: str) -> None:
        self.arch = arch
        self.writer = self._gguf.GGUFWriter(str(self.tmp), arch)

    def _expect(self, state: State, action: str) -> None:
        if self.state is not state:
            raise RuntimeError(f"GGUFExporter.{action} needs state {state.name}, the exporter is in {self.state.name}")

    def add_config(self, config: ModelConfig) -> "GGUFExporter":
        self._expect(State.NEW, "add_config")
        arch = config.family.gguf_arch
        if self.arch is not None and self.arch != arch:
            raise UserError(f"a {config.model_type} model is llama.cpp's {arch} architecture, not {self.arch}")
        gguf_expressible(config)
        self._open(arch)
        w = self.writer
        w.add_name("edgefinfer export")
        w.add_context_length(config.max_position_embeddings)
        w.add_embedding_length(config.hidden_size)
        w.add_block_count(config.num_hidden_layers)
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count(config.num_attention_heads)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_key_length(config.dim_per_head)
        w.add_value_length(config.dim_per_head)
        w.add_rope_dimension_count(config.rotary_dim)
        w.add_rope_freq_base(config.rope_theta)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_vocab_size(config.vocab_size)
        if config.sliding_window is not None:
            # llama.cpp applies it for gemma3 only; for the others the runtimes refuse contexts past it.
            w.add_sliding_window(config.sliding_window)
            types = [config.layer_type(i) for i in range(config.num_hidden_layers)]
            if len(set(types)) > 1 or arch == "gemma3":
                w.add_sliding_window_pattern([t == SLIDING for t in types])
        if arch == "gemma3":
            local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
            if GEMMA3_LOCAL_KEYS:
                w.add_rope_freq_base_swa(local)
        self._add_rope_scaling(config)
        self.config = config
        self.state = State.CONFIG
        return self

    def _add_rope_scaling(self, config: ModelConfig) -> None:
        """llama.cpp's rope.scaling.* keys (linear, yarn); llama3 and longrope go in as tensors (add_weights)."""
        p = dict(config.rope_scaling or {})
        kind = p.get("rope_type", p.get("type", "default"))
        w, gguf = self.writer, self._gguf
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(p["factor"])
        elif kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(p["factor"])
            w.add_rope_scaling_orig_ctx_len(int(p.get("original_max_position_embeddings")
                                                or config.max_position_embeddings))
            if p.get("beta_fast") is not None:
                w.add_rope_scaling_yarn_beta_fast(p["beta_fast"])
            if p.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(p["beta_slow"])
        elif kind == "llama3":  # the rope_freqs tensor; its parameters for our import (llama.cpp ignores them)
            w.add_string(ROPE_SCALING_KEY, json.dumps(p, sort_keys=True))
        elif kind == "longrope":  # Phi-3: rope_factors_short/long tensors and the attention factor
            old = int(p.get("original_max_position_embeddings") or config.max_position_embeddings)
            w.add_rope_scaling_orig_ctx_len(old)
            w.add_rope_scaling_attn_factors(config.rope_of(0).inv_freq_and_factor(config.max_position_embeddings)[1])

    def _rope_tensors(self, config: ModelConfig) -> list[tuple[str, np.ndarray]]:
        """llama3 scaling as convert_hf_to_gguf.py writes it: rope_freqs, the divisor of each frequency;
        longrope as Phi-3's rope_factors_long / rope_factors_short."""
        p = dict(config.rope_scaling or {})
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "llama3":
            return [("rope_freqs.weight", llama3_rope_freqs(config.rope_theta, config.rotary_dim, p))]
        if kind == "longrope":
            return [("rope_factors_long.weight", np.asarray(p["long_factor"], dtype=np.float32)),
                    ("rope_factors_short.weight", np.asarray(p["short_factor"], dtype=np.float32))]
        return []

    def add_tokenizer(self, tokenizer: Tokenizer) -> "GGUFExporter":
        self._expect(State.CONFIG, "add_tokenizer")
        assert self.config is not None
        raw = json.loads(tokenizer.backend.to_str())
        if raw["model"]["type"] != "BPE":
            raise UserError("GGUF export supports byte-level BPE and SentencePiece-style BPE tokenizers only")
        if sentencepiece_style(raw):
            return self._add_spm_tokenizer(tokenizer, raw)
        vocab: dict[str, int] = tokenizer.backend.get_vocab(with_added_tokens=True)
        size = max(self.config.vocab_size, max(vocab.values()) + 1)
        tokens = [f"[PAD{i}]" for i in range(size)]
        types = [self._gguf.TokenType.UNUSED] * size
        for text, i in vocab.items():
            tokens[i], types[i] = text, self._gguf.TokenType.NORMAL
        for added in raw.get("added_tokens", []):
            types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
        merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"].get("merges", [])]
        w = self.writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
        w.add_token_list(tokens)
        w.add_token_types([int(t) for t in types])
        w.add_token_merges(merges)
        return self._finish_tokenizer(tokenizer)

    def _finish_tokenizer(self, tokenizer: Tokenizer) -> "GGUFExporter":
        """What both vocabularies carry after their tokens: BOS / EOS ids, add_bos, the chat template."""
        w = self.writer
        for token, setter in ((tokenizer.bos_token, w.add_bos_token_id), (tokenizer.eos_token, w.add_eos_token_id)):
            if token is not None and tokenizer.token_id(token) is not None:
                setter(tokenizer.token_id(token))
        w.add_add_bos_token(bool(tokenizer.add_bos_token))
        if tokenizer.chat_template:
            w.add_chat_template(tokenizer.chat_template)
        self.state = State.TOKENIZER
        return self

    def _add_spm_tokenizer(self, tokenizer: Tokenizer, raw: dict) -> "GGUFExporter":
        """A SentencePiece-style BPE (Gemma: "▁" for spaces, byte fallback) as llama.cpp's `llama`
        vocabulary. llama.cpp merges the adjacent pair whose concatenation scores highest, so each
        token's score is minus the rank of the first merge that makes it: the same order as ours
        (`edgefinfer.tokenization.gguf_spm` orders merges by the scores it reads)."""
        gguf = self._gguf
        vocab: dict[str, int] = tokenizer.backend.get_vocab(with_added_tokens=True)
        size = max(self.config.vocab_size, max(vocab.values()) + 1)
        tokens = [f"[PAD{i}]" for i in range(size)]
        types = [gguf.TokenType.UNUSED] * size
        scores = [-1e9] * size  # never made by a merge: llama.cpp cannot form it from two pieces either
        for text, i in vocab.items():
            tokens[i] = text
            types[i] = gguf.TokenType.BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", text) else gguf.TokenType.NORMAL
        for rank, merge in enumerate(raw["model"].get("merges", [])):
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            i = vocab.get(a + b)
            if i is not None and scores[i] == -1e9:
                scores[i] = -float(rank)
        unk = raw["model"].get("unk_token")
        if unk in vocab:
            types[vocab[unk]] = gguf.TokenType.UNKNOWN
        for added in raw.get("added_tokens", []):
            if added["content"] != unk:
                types[added["id"]] = _CONTROL if added.get("special") else _USER_DEFINED
        w = self.writer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types([int(t) for t in types])
        w.add_add_space_prefix(prepends_space(raw))
        if unk in vocab:
            w.add_unk_token_id(vocab[unk])
        return self._finish_tokenizer(tokenizer)

    def add_weights(self, model: Transformer, dtype: str = "f16") -> "GGUFExporter":
        """Every parameter under llama.cpp's names; 2-D matrices in `dtype`, norms and biases in F32.
        Phi-3's q|k|v and gate|up go into one tensor each, rows stacked in that order."""
        self._expect(State.TOKENIZER, "add_weights")
        if dtype not in GGUF_TYPES:
            raise UserError(f"unknown GGUF tensor type {dtype!r}: gguf-py writes {', '.join(GGUF_TYPES)}; "
                            f"K-quants come from export_gguf(..., dtype='q4_k_m' etc.)")
        config = self.config
        assert config is not None
        for gname, data in self._rope_tensors(config):
            self.writer.add_tensor(gname, data)
            self.tensor_types[gname] = "F32"
        groups: dict[str, list[tuple[str, nn.Module | None, torch.Tensor | None]]] = {}
        for name, module, tensor in _named_tensors(model):
            gname = gguf_tensor_name(name, config)
            if config.tie_word_embeddings and gname == "output.weight":
                continue
            groups.setdefault(gname, []).append((name, module, tensor))
        for gname, parts in groups.items():
            if len(parts) > 1:  # a fused tensor: its parts in llama.cpp's order
                order = FUSED_TENSORS[gname.split(".", 2)[2]]
                parts.sort(key=lambda part: order.index(part[0].split(".", 3)[3]))
            encoded = [self._encode(*part, dtype) for part in parts]
            qtypes = {q for _, q in encoded}
            if len(qtypes) > 1:
                raise UserError(f"{gname} fuses {', '.join(p[0] for p in parts)}, which are stored as "
                                f"{', '.join(sorted(q.name for q in qtypes))}; llama.cpp needs one type per tensor: "
                                f"quantize them alike")
            data = encoded[0][0] if len(encoded) == 1 else np.concatenate([d for d, _ in encoded], axis=0)
            qtype = encoded[0][1]
            self.writer.add_tensor(gname, data, raw_dtype=qtype)
            self.tensor_types[gname] = qtype.name
        self.state = State.WEIGHTS
        return self

    def _encode(self, name: str, module: nn.Module | None, tensor: torch.Tensor | None, dtype: str):
        gguf = self._gguf
        config = self.config
        assert config is not None
        heads = (config.num_attention_heads if ".q_proj." in name else
                 config.num_key_value_heads if ".k_proj." in name else None)
        permute = heads is not None and config.family.gguf_arch in PERMUTED_ARCHS
        want = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
                "q4_0": gguf.GGMLQuantizationType.Q4_0}[dtype]
        if module is not None:  # an edgefinfer quantized layer keeps its own codes
            return _repack(name, module, heads if permute else None)
        w = tensor.detach().float().numpy()
        if permute:
            w = permute_qk(w, heads)
        if w.ndim == 1 or name.endswith("norm.weight"):
            return np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.F32
        if want in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0) and w.shape[-1] % 32:
            self.notes.append(f"{name}: {w.shape[-1]} columns are not a multiple of 32, kept F16")
            return w.astype(np.float16), gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(w, want), want

    def write(self) -> Path:
        self._expect(State.WEIGHTS, "write")
        from edgefinfer.files.atomic import atomic_file

        with atomic_file(self.path) as tmp:  # the writer opens its file here, at the temporary path
            self.writer.write_header_to_file(tmp)
            self.writer.write_kv_data_to_file()
            self.writer.write_tensors_to_file()
            self.writer.close()
        self.state = State.WRITTEN
        return self.path


def _named_tensors(model: Transformer):
    """(HF name, quantized module or None, float tensor or None) for every weight of the model."""
    from edgefinfer.compile.quant.modules import QUANT_MODULES

    seen = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, QUANT_MODULES):
            yield f"{mod_name}.weight", module, None
            if getattr(module, "bias", None) is not None:
                yield f"{mod_name}.bias", None, module.bias
            seen.add(mod_name)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.rsplit(".", 1)[0] not in seen:
            yield name, None, param


# Recipes whose every layer has an exact GGUF type (named in refusals).
GGUF_RECIPES = ("int4-g32-sym (Q4_0)", "int4[-gptq|-awq]-g32[-fzp] (asym, Q4_1)", "int4[-gptq|-awq]-g32-fzp-k (Q4_K)", "int8-g32-emb8 (Q8_0)",
                "with -emb8 or -emb4 embeddings")


def no_gguf_type(what: str, label: str, why: str = "") -> UserError:
    return UserError(f"{what} is {label}{why}, which has no exact GGUF type (llama.cpp would run other weights "
                     f"than ours); GGUF takes group-32 recipes: {', '.join(GGUF_RECIPES)}")


def gguf_types_for(model: Transformer, recipe) -> dict[str, str]:
    """Layer -> GGUF type that `recipe` (a QuantRecipe) gives each quantized layer of `model`; a
    one-line UserError, before any work, if one has no exact type."""
    from edgefinfer.compile.quant.apply import plan_formats
    from edgefinfer.compile.quant.layouts import gguf_type_of

    if recipe.activations != "none":
        raise no_gguf_type(f"recipe {recipe.name}", "8-bit dynamic activations (XNNPACK's scheme)",
                           "; llama.cpp quantizes activations its own way")
    types = {}
    for name, fmt in plan_formats(model, recipe).items():
        if fmt is None:
            continue
        k = model.get_submodule(name).weight.shape[1]
        types[name] = gguf_type_of(fmt, fmt.group_for(k, name) if fmt.kind == "int" else None)
        if types[name] is None:
            raise no_gguf_type(f"recipe {recipe.name}: {name}", fmt.label())
    return types


def quantized_gguf_types(model: Transformer) -> dict[str, str]:
    """Layer -> GGUF type of every layer an already quantized `model` holds (a checkpoint from
    `edgefinfer quantize`); a one-line UserError for the first that has no exact type."""
    from edgefinfer.compile.quant.modules import QUANT_MODULES

    return {name: layer_gguf_type(f"{name}.weight", module) for name, module in model.named_modules()
            if isinstance(module, QUANT_MODULES)}


def layer_gguf_type(name: str, module) -> str:
    """The GGUF type holding quantized layer `module` bit for bit; a one-line UserError naming `name` if none."""
    from edgefinfer.compile.quant.layouts import gguf_type_of

    if getattr(module, "act_quant", False):
        raise no_gguf_type(name, f"{module.fmt.label()} with int8 dynamic activations")
    qtype = gguf_type_of(module.fmt, getattr(module, "group_size", None))
    if qtype is None:
        raise no_gguf_type(name, module.fmt.label())
    return qtype


def _repack(name: str, module, permute_heads: int | None):
    """(bytes, type) of a group-32 int4 / int5 / int8 layer as Q4_0 (sym), Q4_1 (asym), Q5_0 (sym) or
    Q8_0 (sym), or of a K-quant layer as Q4_K / Q5_K / Q6_K."""
    import gguf

    from edgefinfer.compile.quant.layouts import (to_gguf_q4_0, to_gguf_q4_1, to_gguf_q4_k, to_gguf_q5_0, to_gguf_q5_k,
                                                  to_gguf_q6_k, to_gguf_q8_0)

    qtype = layer_gguf_type(name, module)
    data = {"Q4_0": to_gguf_q4_0, "Q4_1": to_gguf_q4_1, "Q5_0": to_gguf_q5_0, "Q8_0": to_gguf_q8_0,
            "Q4_K": to_gguf_q4_k, "Q5_K": to_gguf_q5_k, "Q6_K": to_gguf_q6_k}[qtype](module)  # [N, bytes per row]
    if permute_heads is not None:  # rows are independent: permuting them commutes with quantization
        data = permute_qk(data, permute_heads)
    return data, gguf.GGMLQuantizationType[qtype]


def export_gguf(model: Transformer, tokenizer: Tokenizer, path: str | Path, dtype: str = "f16") -> dict:
    """Write `model` as a GGUF file; returns metadata for the bundle manifest."""
    path = Path(path)
    if dtype in LLAMA_FTYPES:
        return _export_k_quant(model, tokenizer, path, dtype)
    exporter = GGUFExporter(path, arch=model.config.family.gguf_arch)
    exporter.add_config(model.config).add_tokenizer(tokenizer).add_weights(model, dtype).write()
    for note in exporter.notes:
        print(f"  gguf: {note}", file=sys.stderr)
    counts: dict[str, int] = {}
    for qtype in exporter.tensor_types.values():
        counts[qtype] = counts.get(qtype, 0) + 1
    # The type of the decoder's matrices (what a user calls the file's type), and every type present.
    types = exporter.tensor_types
    main = types.get("blk.0.attn_q.weight") or types.get("blk.0.attn_qkv.weight", dtype.upper())
    return {"gguf_type": main.lower(), "tensor_types": dict(sorted(counts.items())), "notes": exporter.notes}


def _export_k_quant(model: Transformer, tokenizer: Tokenizer, path: Path, dtype: str) -> dict:
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"GGUF {dtype.upper()} needs llama.cpp's quantizer: pip install 'edgefinfer[llamacpp]'") from None
    from edgefinfer.files.atomic import atomic_file

    f32 = path.with_name(f".{path.name}.f32-{os.getpid()}")
    try:
        export_gguf(model, tokenizer, f32, "f32")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, LLAMA_FTYPES[dtype])
        with atomic_file(path) as tmp:
            if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
                raise UserError(f"llama.cpp could not quantize the model to {dtype.upper()}")
    finally:
        f32.unlink(missing_ok=True)
    from edgefinfer.model.gguf_import import open_gguf

    counts: dict[str, int] = {}
    for t in open_gguf(path).reader.tensors:  # what llama.cpp chose per tensor (e.g. a different head type)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {"gguf_type": dtype, "tensor_types": dict(sorted(counts.items())),
            "notes": [f"{dtype.upper()} by llama_model_quantize from F32"]}
