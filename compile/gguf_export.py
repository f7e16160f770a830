"""GGUF exporter: our model (float or quantized) and tokenizer -> a file llama.cpp loads.

An explicit state machine, like gguf-py's writer it drives: a file is described in a fixed order
and each call refuses to run out of it.

    NEW --add_config--> CONFIG --add_tokenizer--> TOKENIZER --add_weights--> WEIGHTS --write--> WRITTEN

Weight types: F32, F16, BF16, Q8_0, Q4_0 written by gguf-py; K-quants (Q4_K_M, Q5_K_M, Q6_K, ...)
by a second pass through llama.cpp's own quantizer (`llama_model_quantize`) over an F32 file.
A layer already quantized by `edgefinfer.compile.quant` keeps its codes: group-32 symmetric int4 is
re-packed bit for bit into Q4_0, asymmetric int4 into Q4_1, symmetric int8 into Q8_0, whatever the
requested type (so a mixed-precision model stays mixed). A quantized layer with no exact GGUF type
(another group size, per-channel, int8 activations, fp8) is refused with the recipes that work:
re-quantizing it would ship a file whose weights are neither ours nor llama.cpp's best. The
requested type applies to float matrices.

llama.cpp's `llama` architecture rotates interleaved pairs where HF rotates halves, so q and k rows
are permuted inside each head (the inverse of `edgefinfer.gguf_import.unpermute_qk`). The file is
written to a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edgefinfer.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.gguf_import import _CONTROL, _LAYER_TENSORS, _PRE_SPLITS, _USER_DEFINED
from edgefinfer.model import Transformer
from edgefinfer.tokenizer import Tokenizer

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
# llama.cpp ftypes reached by re-quantizing an F32 file with llama_model_quantize (its own rounding:
# Q4_1 there keeps a float block minimum, which our integer zero points cannot express).
LLAMA_FTYPES = {"q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q4_k_s": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
                "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K"}
_HF_TO_GGUF_LAYER = {v: k for k, v in _LAYER_TENSORS.items()}


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


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        rest = ".".join(parts[3:])
        if rest in _HF_TO_GGUF_LAYER:
            return f"blk.{parts[2]}.{_HF_TO_GGUF_LAYER[rest]}"
    raise UserError(f"parameter {hf_name} has no llama.cpp tensor name")


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
    def __init__(self, path: str | Path, arch: str = "llama"):
        try:
            import gguf
        except ImportError:
            raise UserError("GGUF export needs the gguf package: pip install gguf==0.19.0") from None
        self._gguf = gguf
        self.path = Path(path)
        self.state = State.NEW
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self.writer = gguf.GGUFWriter(str(self.tmp), arch)
        self.arch = arch
        self.config: ModelConfig | None = None
        self.notes: list[str] = []
        self.tensor_types: dict[str, str] = {}

    def _expect(self, state: State, action: str) -> None:
        if self.state is not state:
            raise RuntimeError(f"GGUFExporter.{action} needs state {state.name}, the exporter is in {self.state.name}")

    def add_config(self, config: ModelConfig) -> "GGUFExporter":
        self._expect(State.NEW, "add_config")
        if config.model_type not in ("llama", "qwen2", "mistral"):
            raise UserError(f"GGUF export supports llama, qwen2 and mistral models, not {config.model_type}")
        if config.rope_scaling:
            raise UserError("GGUF export of scaled RoPE (llama3 rope_scaling) is not implemented")
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
        w.add_rope_dimension_count(config.dim_per_head)
        w.add_rope_freq_base(config.rope_theta)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_vocab_size(config.vocab_size)
        if config.sliding_window is not None:
            w.add_sliding_window(config.sliding_window)
        self.config = config
        self.state = State.CONFIG
        return self

    def add_tokenizer(self, tokenizer: Tokenizer) -> "GGUFExporter":
        self._expect(State.CONFIG, "add_tokenizer")
        assert self.config is not None
        raw = json.loads(tokenizer.backend.to_str())
        if raw["model"]["type"] != "BPE":
            raise UserError("GGUF export supports byte-level BPE tokenizers only")
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
        for token, setter in ((tokenizer.bos_token, w.add_bos_token_id), (tokenizer.eos_token, w.add_eos_token_id)):
            if token is not None and tokenizer.token_id(token) is not None:
                setter(tokenizer.token_id(token))
        w.add_add_bos_token(bool(tokenizer.add_bos_token))
        if tokenizer.chat_template:
            w.add_chat_template(tokenizer.chat_template)
        self.state = State.TOKENIZER
        return self

    def add_weights(self, model: Transformer, dtype: str = "f16") -> "GGUFExporter":
        """Every parameter under llama.cpp's names; 2-D matrices in `dtype`, norms and biases in F32."""
        self._expect(State.TOKENIZER, "add_weights")
        if dtype not in GGUF_TYPES:
            raise UserError(f"unknown GGUF tensor type {dtype!r}: gguf-py writes {', '.join(GGUF_TYPES)}; "
                            f"K-quants come from export_gguf(..., dtype='q4_k_m' etc.)")
        config = self.config
        assert config is not None
        for name, module, tensor in _named_tensors(model):
            gname = gguf_tensor_name(name)
            if config.tie_word_embeddings and gname == "output.weight":
                continue
            data, qtype = self._encode(name, module, tensor, dtype)
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
        permute = heads is not None and config.model_type != "qwen2"
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
        try:
            self.writer.write_header_to_file()
            self.writer.write_kv_data_to_file()
            self.writer.write_tensors_to_file()
            self.writer.close()
            os.replace(self.tmp, self.path)
        finally:
            self.tmp.unlink(missing_ok=True)
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
GGUF_RECIPES = ("int4-g32-sym (Q4_0)", "int4[-gptq|-awq]-g32[-fzp] (asym, Q4_1)", "int8-g32-emb8 (Q8_0)",
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


def _repack(name: str, module, permute_heads: int | None):
    """(bytes, type) of a group-32 int4 / int8 layer as Q4_0 (sym), Q4_1 (asym) or Q8_0 (sym)."""
    import gguf

    from edgefinfer.compile.quant.layouts import gguf_type_of, to_gguf_q4_0, to_gguf_q4_1, to_gguf_q8_0

    if getattr(module, "act_quant", False):
        raise no_gguf_type(name, f"{module.fmt.label()} with int8 dynamic activations")
    qtype = gguf_type_of(module.fmt, getattr(module, "group_size", None))
    if qtype is None:
        raise no_gguf_type(name, module.fmt.label())
    data = {"Q4_0": to_gguf_q4_0, "Q4_1": to_gguf_q4_1, "Q8_0": to_gguf_q8_0}[qtype](module)  # [N, bytes per row]
    if permute_heads is not None:  # rows are independent: permuting them commutes with quantization
        data = permute_qk(data, permute_heads)
    return data, gguf.GGMLQuantizationType[qtype]


def export_gguf(model: Transformer, tokenizer: Tokenizer, path: str | Path, dtype: str = "f16") -> dict:
    """Write `model` as a GGUF file; returns metadata for the bundle manifest."""
    path = Path(path)
    if dtype in LLAMA_FTYPES:
        return _export_k_quant(model, tokenizer, path, dtype)
    # llama.cpp's qwen2 architecture uses the half-split (NEOX) rotation and q/k/v biases.
    exporter = GGUFExporter(path, arch="qwen2" if model.config.model_type == "qwen2" else "llama")
    exporter.add_config(model.config).add_tokenizer(tokenizer).add_weights(model, dtype).write()
    for note in exporter.notes:
        print(f"  gguf: {note}", file=sys.stderr)
    counts: dict[str, int] = {}
    for qtype in exporter.tensor_types.values():
        counts[qtype] = counts.get(qtype, 0) + 1
    # The type of the decoder's matrices (what a user calls the file's type), and every type present.
    main = exporter.tensor_types.get("blk.0.attn_q.weight", dtype.upper())
    return {"gguf_type": main.lower(), "tensor_types": dict(sorted(counts.items())), "notes": exporter.notes}


def _export_k_quant(model: Transformer, tokenizer: Tokenizer, path: Path, dtype: str) -> dict:
    try:
        import llama_cpp
    except ImportError:
        raise UserError(f"GGUF {dtype.upper()} needs llama.cpp's quantizer: pip install 'edgefinfer[llamacpp]'") from None
    f32 = path.with_name(f".{path.name}.f32-{os.getpid()}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        export_gguf(model, tokenizer, f32, "f32")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, LLAMA_FTYPES[dtype])
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise UserError(f"llama.cpp could not quantize the model to {dtype.upper()}")
        os.replace(tmp, path)
    finally:
        f32.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    from edgefinfer.gguf_import import open_gguf

    counts: dict[str, int] = {}
    for t in open_gguf(path).reader.tensors:  # what llama.cpp chose per tensor (e.g. a different head type)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return {"gguf_type": dtype, "tensor_types": dict(sorted(counts.items())),
            "notes": [f"{dtype.upper()} by llama_model_quantize from F32"]}
