"""ONNX Runtime export: the fused decoder graph, written directly, plus onnxruntime-genai's config.

The graph is the one ONNX Runtime's own model builder emits for Llama-family models, built from
our module tree instead of traced (see `onnx_graph` for why):

    input_ids [B, S] ──Gather / GatherBlockQuantized──► x
    per layer:  (Skip)SimplifiedLayerNormalization ─► packed QKV MatMul(NBits)
                ─► GroupQueryAttention (RoPE inside; past/present share one buffer; local window)
                ─► o_proj ─► SkipSimplifiedLayerNormalization ─► packed gate|up ─► SiLU·up ─► down
    final SkipSimplifiedLayerNormalization ─► lm_head ─► logits [B, S, V] (float32)

I/O names follow onnxruntime-genai (`input_ids`, `attention_mask`, `past_key_values.{i}.key/value`
-> `logits`, `present.{i}.key/value`), KV layout BNSH [B, Hkv, T, D], so `genai_config.json` lets
`onnxruntime_genai.Model(folder)` run the export as is. `attention_mask` [B, T] only tells GQA the
total length (T) and each row's valid length (its sum): with a shared past/present buffer of
`max_seq_len` slots, new keys go to slots seqlen-S .. seqlen-1, so rolling back is simply running
with a shorter mask.

`kv="window"` exports the streaming form instead: GQA's windowed cache (`sliding_window_cache=1`,
ONNX Runtime >= 1.31) keeps the last `window` positions in a buffer of `window + lookahead` slots
and evicts by itself, so memory stays flat however long the stream. That form has no
`attention_mask` (a [1, T] row would grow with the stream); it takes `position_ids` [1, S], from
which the graph derives GQA's lengths, and it applies RoPE outside GQA with cos/sin computed from
those positions (GQA's own RoPE reads a fixed table indexed by absolute position, which would bound
the stream). Batch 1 only (GQA allows multi-token steps on a cache for one sequence); onnxruntime-genai
cannot drive it, so no genai_config.json is written.

Weights: float (fp32 / fp16) or integer. Integer weights come from `edgefinfer.compile.quant`'s
quantized modules, so the graph holds the eager quantized model's codes bit for bit; a float model
exported with weights="int4"/"int8" is first quantized with that package's round-to-nearest recipe.

One emitter writes both ONNX decoders: `emit_decoder` walks the model once and a `DecoderForm`
supplies the blocks, `FusedForm` here and `onnx_static.StaticForm` for the fixed-shape NPU graph.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from edgefinfer.artefact import ArtefactSpec, KVCache, write_spec
from edgefinfer.checkpoint import TOKENIZER_FILES
from edgefinfer.compile.onnx_graph import MS_DOMAIN, GraphBuilder, ir_dtype, save_model
from edgefinfer.compile.onnx_weights import (EmbeddingSpec, FloatEmbedding, FloatLinear, LinearSpec, NBitsLinear,
                                             QuantTable, concat_linears, embedding_spec, linear_spec, shares_codes,
                                             unpacked_zero_points)
from edgefinfer.compile.quant.modules import QUANT_MODULES, QuantLinear
from edgefinfer.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model import Transformer

Weights = Literal["fp32", "fp16", "int8", "int4"]
Stream = Any  # the residual stream as a DecoderForm carries it
KVLayout = Literal["static", "window"]
WEIGHTS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"


# ---- public API -----------------------------------------------------------------------------------

def export_onnx(model: Transformer, out_dir: str | Path, *, weights: Weights | None = None, block_size: int = 32,
                symmetric: bool = True, embedding: Literal["float", "int8", "int4"] | None = None,
                kv: KVLayout = "static", window: int | None = None, lookahead: int | None = None,
                max_seq_len: int | None = None, accuracy_level: int = 4,
                pack_gate_up: bool = True, tokenizer_dir: str | Path | None = None,
                filename: str = MODEL_FILE) -> dict[str, Any]:
    """Write `out_dir/model.onnx` (+ `.onnx.data`) and `out_dir/genai_config.json`.

    weights: None keeps the model as it is (float -> fp32; a model quantized by
        `edgefinfer.compile.quant` keeps its codes). "int4"/"int8" on a float model quantizes it
        first (round to nearest, groups of `block_size`, `symmetric`), with embeddings and lm_head in
        `embedding` bits (default: the same as the linears; "float" keeps them float).
    kv: "static" (a `max_seq_len`-slot buffer, onnxruntime-genai compatible) or "window" (a
        `window + lookahead`-slot buffer that streams without a length limit; see the module doc).
    window: sliding-window attention (the query sees itself and the window-1 previous positions);
        default the model's own `sliding_window`; required for kv="window".
    lookahead: kv="window" only: slots beyond the window (default window // 4). GQA compacts the
        buffer every lookahead + 1 tokens, so more slots mean rarer compactions and more memory.
    max_seq_len: kv="static" only: positions the KV buffer and the RoPE tables cover (default
        max_position_embeddings).
    accuracy_level: MatMulNBits' activation precision (4 = int8 activations, the fast CPU path;
        0 = float activations, which reproduces the eager quantized model to float rounding).
    pack_gate_up: one MatMul(NBits) for gate|up then a Split: one kernel call fewer per layer
        (measured 4% faster decode on SmolLM2-135M int4, 1 thread).
    tokenizer_dir: copy the tokenizer files from there, so that `og.Tokenizer` works on the folder too.
    Returns the artefact metadata for the bundle manifest.
    """
    cfg = model.config
    model, recipe = _resolve_weights(model, weights, block_size, symmetric, embedding)
    io_dtype = np.float16 if weights == "fp16" else np.float32
    window = cfg.sliding_window if window is None else window
    if window is not None and window < 1:
        raise UserError(f"the attention window must be >= 1 token, got {window}")
    slots = _cache_slots(kv, window, lookahead, max_seq_len)
    max_seq_len = None if kv == "window" else max_seq_len or cfg.max_position_embeddings
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise UserError(f"accuracy_level must be 0..4 (MatMulNBits' activation precision), got {accuracy_level}")

    builder = GraphBuilder()
    emit_decoder(FusedForm(builder, model, io_dtype, window, max_seq_len, accuracy_level, pack_gate_up,
                           window_slots=slots if kv == "window" else None), model)
    kind = recipe or ("fp16" if io_dtype == np.float16 else _weights_label(model))
    streams = kv == "window"
    spec = ArtefactSpec(
        "onnx", KVCache(kv, max_seq_len=max_seq_len, window=window, slots=slots if streams else None,
                        lookahead=slots - window if streams else None),
        recipe_name=kind, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
        inputs=("input_ids", "position_ids" if streams else "attention_mask",
                *_kv_names("past_key_values", cfg.num_hidden_layers)),
        outputs=("logits", *_kv_names("present", cfg.num_hidden_layers)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = save_model(builder.model(write_spec(spec, "onnx")), out / filename)
    genai = [GENAI_CONFIG] if kv == "static" else []
    if genai:
        (out / GENAI_CONFIG).write_text(json.dumps(genai_config(cfg, filename, max_seq_len), indent=2) + "\n")
    copied = [n for n in TOKENIZER_FILES if tokenizer_dir and (Path(tokenizer_dir) / n).is_file()]
    for name in copied:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return {
        **write_spec(spec, "manifest"),  # format, recipe, kv, inputs, outputs
        "files": [f.name for f in files] + genai + copied,
        "model_file": filename,
        "weights": kind,
        "opset": builder.opset,
        "kv_layout": {"format": "BNSH", "shape": ["batch", cfg.num_key_value_heads, slots or max_seq_len, cfg.dim_per_head],
                      "dtype": np.dtype(io_dtype).name, "past_present_share_buffer": True,
                      "sliding_window_cache": kv == "window"},
        "max_seq_len": max_seq_len,
        "window": window,
        "accuracy_level": accuracy_level,
    }


def genai_config(cfg: ModelConfig, filename: str, max_seq_len: int) -> dict[str, Any]:
    """onnxruntime-genai's description of the decoder (the fields its model builder writes)."""
    eos = cfg.eos_token_ids
    config = {
        "model": {
            "context_length": max_seq_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": cfg.dim_per_head,
                "hidden_size": cfg.hidden_size,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": cfg.num_attention_heads,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_key_value_heads": cfg.num_key_value_heads,
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0),
            "type": cfg.model_type,
            "vocab_size": cfg.vocab_size,
        },
        "search": {"do_sample": False, "early_stopping": True, "max_length": max_seq_len, "min_length": 0,
                   "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": True,
                   "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }
    if cfg.bos_token_id is not None:  # genai refuses null ids; it does not need a BOS to generate
        config["model"]["bos_token_id"] = cfg.bos_token_id
    if not eos:
        del config["model"]["eos_token_id"]
    return config


def _cache_slots(kv: str, window: int | None, lookahead: int | None, max_seq_len: int | None) -> int | None:
    """KV slots of a window graph (None for a static one, whose buffer holds max_seq_len)."""
    if kv == "static":
        if lookahead is not None:
            raise UserError("lookahead applies to kv='window'; drop it for a static cache")
        return None
    if kv != "window":
        raise UserError(f"unknown kv layout {kv!r}: use 'static' or 'window'")
    if window is None:
        raise UserError("kv='window' needs window=N >= 1 (the number of recent positions kept)")
    if max_seq_len is not None:
        raise UserError("max_seq_len applies to kv='static'; a window cache has no length limit")
    lookahead = max(1, window // 4) if lookahead is None else lookahead
    if lookahead < 0:
        raise UserError(f"lookahead must be >= 0, got {lookahead}")
    return window + lookahead


def rope_tables(model: Transformer, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, D/2] computed exactly as the eager model does (float32 angles)."""
    inv_freq = model.inv_freq.detach().float().cpu()
    angles = torch.arange(max_seq_len).float()[:, None] * inv_freq  # [T, D/2]
    return angles.cos().numpy(), angles.sin().numpy()


# ---- weights -----------------------------------------------------------------------------------------

def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QUANT_MODULES) for m in model.modules())


def _weights_label(model: nn.Module) -> str:
    formats = sorted({m.fmt.label() for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(formats) if formats else "fp32"


def _resolve_weights(model: Transformer, weights: str | None, block_size: int, symmetric: bool,
                     embedding: str | None) -> tuple[Transformer, str | None]:
    """The model to export (a quantized copy when asked) and the recipe name used, if any."""
    if weights is not None and weights not in WEIGHTS:
        raise UserError(f"unknown ONNX weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    if _is_quantized(model):
        bits = {m.fmt.bits for m in model.modules() if isinstance(m, QuantLinear)}
        if weights in ("fp32", "fp16") or (weights in ("int8", "int4") and bits != {int(weights[3:])}):
            raise UserError(f"the model is already quantized ({_weights_label(model)}); export it with weights=None "
                            "or start from the float checkpoint to pick another format")
        return model, None
    if weights not in ("int8", "int4"):
        return model, None
    from edgefinfer.compile.quant import parse_recipe, quantize_model

    emb = {"float": "embf", "int8": "emb8", "int4": "emb4", None: f"emb{weights[3:]}"}.get(embedding)
    if emb is None:
        raise UserError(f"unknown embedding format {embedding!r}: use float, int8 or int4")
    name = f"{weights}-g{block_size}-{'sym' if symmetric else 'asym'}-{emb}"
    quantized = copy.deepcopy(model)
    quantize_model(quantized, parse_recipe(name))
    return quantized, name


# ---- graph -------------------------------------------------------------------------------------------

def _kv_names(prefix: str, n_layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def _declare_io(b: GraphBuilder, cfg: ModelConfig, io_dtype: np.dtype, window_slots: int | None) -> dict[str, Any]:
    """Graph inputs: genai's (static) or the window form's (batch 1, position_ids, fixed-size cache)."""
    t = ir_dtype(io_dtype)
    if window_slots is None:
        kv_shape: list = ["batch_size", cfg.num_key_value_heads, "past_sequence_length", cfg.dim_per_head]
        ids = b.input("input_ids", ir.DataType.INT64, ["batch_size", "sequence_length"])
        lengths = {"attention_mask": b.input("attention_mask", ir.DataType.INT64,
                                             ["batch_size", "total_sequence_length"])}
    else:
        kv_shape = [1, cfg.num_key_value_heads, window_slots, cfg.dim_per_head]
        ids = b.input("input_ids", ir.DataType.INT64, [1, "sequence_length"])
        lengths = {"position_ids": b.input("position_ids", ir.DataType.INT64, [1, "sequence_length"])}
    return {
        "input_ids": ids,
        **lengths,
        "past": [(b.input(f"past_key_values.{i}.key", t, kv_shape), b.input(f"past_key_values.{i}.value", t, kv_shape))
                 for i in range(cfg.num_hidden_layers)],
    }


class DecoderForm(Protocol):
    """One way of writing the decoder's blocks as ONNX ops; `emit_decoder` walks the model once and
    asks the form for each block. Two forms: `FusedForm` (below: ONNX Runtime's contrib kernels,
    dynamic shapes, what the CPU runs fastest) and `onnx_static.StaticForm` (standard ops only and
    every shape fixed, what NPU compilers take). A form declares the graph's inputs and its
    graph-wide values (sequence lengths, RoPE, masks) when it is made.

    `Stream` is the residual stream as the form carries it: a value, or (FusedForm) a value and the
    sublayer output still to be added to it, which the next norm adds inside its own kernel."""

    b: GraphBuilder

    def embed(self) -> Stream: ...
    def norm(self, stream: Stream, norm: nn.Module, name: str) -> tuple[ir.Value, Stream]: ...
    def add(self, stream: Stream, out: ir.Value, name: str) -> Stream: ...
    def final_norm(self, stream: Stream, norm: nn.Module) -> ir.Value: ...
    def attention(self, h: ir.Value, attn: nn.Module, i: int) -> ir.Value: ...
    def mlp(self, h: ir.Value, mlp: nn.Module) -> ir.Value: ...
    def lm_head(self, h: ir.Value) -> ir.Value: ...
    def finish(self, logits: ir.Value) -> None: ...


def emit_decoder(form: DecoderForm, model: Transformer) -> None:
    """The decoder, written once for both forms: embedding, pre-norm attention and MLP blocks on a
    residual stream, final norm, output head."""
    b = form.b
    stream = form.embed()
    for i, layer in enumerate(model.model.layers):
        b.scope = f"/model/layers.{i}"
        h, stream = form.norm(stream, layer.input_layernorm, "input_layernorm")
        stream = form.add(stream, form.attention(h, layer.self_attn, i), "attn_residual")
        h, stream = form.norm(stream, layer.post_attention_layernorm, "post_attention_layernorm")
        stream = form.add(stream, form.mlp(h, layer.mlp), "mlp_residual")
    b.scope = "/model"
    h = form.final_norm(stream, model.model.norm)
    b.scope = "/lm_head"
    form.finish(form.lm_head(h))


class FusedForm:
    """ONNX Runtime's fused decoder: GroupQueryAttention, (Skip)SimplifiedLayerNormalization,
    MatMulNBits / GatherBlockQuantized for integer weights; batch and lengths dynamic."""

    def __init__(self, b: GraphBuilder, model: Transformer, io_dtype: np.dtype, window: int | None,
                 max_seq_len: int | None, accuracy_level: int, pack_gate_up: bool, window_slots: int | None):
        """max_seq_len None: the window form (RoPE from positions, GQA's windowed cache of `window_slots`)."""
        self.b, self.model, self.cfg = b, model, model.config
        self.dtype = np.dtype(io_dtype)
        self.window = window
        self.max_seq_len = max_seq_len
        self.accuracy_level = accuracy_level
        self.pack_gate_up = pack_gate_up
        self.presents: list[tuple[ir.Value, str, list]] = []
        self.io = _declare_io(b, self.cfg, self.dtype, window_slots)
        if "attention_mask" in self.io:
            self.seqlens_k, self.total_len, self.rope = self.lengths_from_mask(self.io["attention_mask"])
        else:
            self.seqlens_k, self.total_len, self.rope = self.lengths_from_positions(self.io["position_ids"])
        self.emb: EmbeddingSpec | None = None

    # -- building blocks --
    def linear(self, x: ir.Value, spec: LinearSpec, name: str) -> ir.Value:
        b = self.b
        if isinstance(spec, FloatLinear):
            y = b.op("MatMul", [x, b.const(f"{b.scope}/{name}.weight", spec.w_t)], f"{name}/MatMul")
            if spec.bias is not None:
                y = b.op("Add", [y, b.const(f"{b.scope}/{name}.bias", spec.bias)], f"{name}/Add")
            return y
        return self.nbits(x, spec, name, f"{b.scope}/{name}")

    def nbits(self, x: ir.Value, spec: NBitsLinear, name: str, weight_name: str) -> ir.Value:
        b, mm = self.b, spec.mm
        inputs = [x, b.const(f"{weight_name}.qweight", mm.B), b.const(f"{weight_name}.scales", mm.scales),
                  None if mm.zero_points is None else b.const(f"{weight_name}.zero_points", mm.zero_points), None,
                  None if spec.bias is None else b.const(f"{weight_name}.bias", spec.bias)]
        while inputs[-1] is None:
            inputs.pop()
        y = b.op("MatMulNBits", inputs, f"{name}/MatMulNBits", domain=MS_DOMAIN, K=mm.K, N=mm.N, bits=mm.bits,
                 block_size=mm.block_size, accuracy_level=self.accuracy_level)
        if spec.offsets is None:
            return y
        # A float zero point: + group_sums(x) [B, S, G] @ m^T [G, N] (see onnx_weights.NBitsLinear).
        G = spec.offsets.shape[1]
        groups = b.op("Reshape", [x, b.scalar_i64(0, 0, G, mm.K // G)], f"{name}/GroupReshape")
        sums = b.op("ReduceSum", [groups, b.scalar_i64(-1)], f"{name}/GroupSum", keepdims=0)
        m_t = b.const(f"{weight_name}.group_offsets", np.ascontiguousarray(spec.offsets.T))
        return b.op("Add", [y, b.op("MatMul", [sums, m_t], f"{name}/OffsetMatMul")], f"{name}/AddOffsets")

    def spec(self, module: nn.Module, name: str) -> LinearSpec:
        return linear_spec(module, self.dtype, name)

    def skip_norm(self, x: ir.Value, skip: ir.Value, weight: nn.Parameter, name: str,
                  with_sum: bool = True) -> tuple[ir.Value, ir.Value | None]:
        """(normalised x + skip, x + skip) in one kernel."""
        gamma = self.b.const(f"{self.b.scope}/{name}.weight", weight.detach().float().numpy().astype(self.dtype))
        if not with_sum:
            return self.b.op("SkipSimplifiedLayerNormalization", [x, skip, gamma], name, domain=MS_DOMAIN,
                             epsilon=self.cfg.rms_norm_eps), None
        out = self.b.op("SkipSimplifiedLayerNormalization", [x, skip, gamma], name, domain=MS_DOMAIN, num_outputs=4,
                        epsilon=self.cfg.rms_norm_eps)
        out[1].name = out[2].name = ""  # omit the training outputs: computing them costs ~40% of the kernel
        return out[0], out[3]

    # -- the form's blocks (see DecoderForm) --
    def embed(self) -> tuple[ir.Value, None]:
        self.b.scope = "/model/embed_tokens"
        self.emb = embedding_spec(self.model.model.embed_tokens, self.dtype)
        return self.token_embedding(self.io["input_ids"], self.emb), None

    def norm(self, stream: tuple[ir.Value, ir.Value | None], norm: nn.Module,
             name: str) -> tuple[ir.Value, tuple[ir.Value, None]]:
        residual, pending = stream
        if pending is None:  # the first block: nothing to add yet
            gamma = self.b.const(f"{self.b.scope}/{name}.weight",
                                 norm.weight.detach().float().numpy().astype(self.dtype))
            return self.b.op("SimplifiedLayerNormalization", [residual, gamma], name, axis=-1,
                             epsilon=self.cfg.rms_norm_eps, stash_type=1), (residual, None)
        h, residual = self.skip_norm(residual, pending, norm.weight, name)
        return h, (residual, None)

    def add(self, stream: tuple[ir.Value, ir.Value | None], out: ir.Value, name: str) -> tuple[ir.Value, ir.Value]:
        return stream[0], out  # deferred: the next norm adds it inside its kernel

    def final_norm(self, stream: tuple[ir.Value, ir.Value], norm: nn.Module) -> ir.Value:
        h, _ = self.skip_norm(stream[0], stream[1], norm.weight, "norm", with_sum=False)
        return h

    def lm_head(self, h: ir.Value) -> ir.Value:
        b, cfg, m, emb = self.b, self.cfg, self.model, self.emb
        if isinstance(emb, QuantTable) and shares_codes(m.lm_head, m.model.embed_tokens):
            # a tied quantized head reads the embedding's codes: one copy in the file
            logits = self.nbits(h, NBitsLinear(emb.mm, None), "lm_head", "/model/embed_tokens/table")
        elif cfg.tie_word_embeddings and isinstance(emb, FloatEmbedding) and not isinstance(m.lm_head, QuantLinear):
            # ORT folds the Transpose into a constant at load time; the file keeps one copy.
            table = b.const("/model/embed_tokens/table", emb.table)
            logits = b.op("MatMul", [h, b.op("Transpose", [table], "Transpose", perm=[1, 0])], "MatMul")
        else:
            logits = self.linear(h, self.spec(m.lm_head, "lm_head"), "lm_head")
        if self.dtype != np.float32:
            logits = b.op("Cast", [logits], "Cast", to=ir.DataType.FLOAT)
        return logits

    def finish(self, logits: ir.Value) -> None:
        self.b.output(logits, "logits", ir.DataType.FLOAT, ["batch_size", "sequence_length", self.cfg.vocab_size])
        for value, name, shape in self.presents:  # after logits, in layer order (key, value)
            self.b.output(value, name, ir_dtype(self.dtype), shape)

    def lengths_from_mask(self, mask: ir.Value) -> tuple[ir.Value, ir.Value, tuple[ir.Value, ir.Value]]:
        """GQA reads lengths, not a mask: seqlens_k = valid length - 1, total_sequence_length = T.
        RoPE runs inside GQA from the [max_seq_len, D/2] tables."""
        b = self.b
        b.scope = "/attn_mask"
        seqlens = b.op("ReduceSum", [mask, b.scalar_i64(1)], "ReduceSum", keepdims=0)
        seqlens_k = b.op("Cast", [b.op("Sub", [seqlens, b.scalar_i64(1)], "Sub")], "seqlens_k", to=ir.DataType.INT32)
        total = b.op("Gather", [b.op("Shape", [mask], "Shape"), b.const("const_i64_scalar_1", np.array(1, np.int64))],
                     "Gather", axis=0)
        total_len = b.op("Cast", [total], "total_sequence_length", to=ir.DataType.INT32)
        cos, sin = rope_tables(self.model, self.max_seq_len)
        return seqlens_k, total_len, (b.const("cos_cache", cos.astype(self.dtype)),
                                      b.const("sin_cache", sin.astype(self.dtype)))

    def lengths_from_positions(self, positions: ir.Value) -> tuple[ir.Value, ir.Value, tuple[ir.Value, ir.Value]]:
        """The window form: the last position p gives seqlens_k = p and total_sequence_length = p + 1
        (batch 1); cos/sin [S, D/2] for exactly these positions, computed as the eager model does
        (float32 angles), so no table bounds the stream."""
        b = self.b
        b.scope = "/positions"
        last = b.op("ReduceMax", [positions, b.scalar_i64(1)], "ReduceMax", keepdims=0)  # [1]
        seqlens_k = b.op("Cast", [last], "seqlens_k", to=ir.DataType.INT32)
        total = b.op("Add", [b.op("Squeeze", [last, b.scalar_i64(0)], "Squeeze"),
                             b.const("const_i64_scalar_1", np.array(1, np.int64))], "Add")
        total_len = b.op("Cast", [total], "total_sequence_length", to=ir.DataType.INT32)
        inv_freq = self.model.inv_freq.detach().float().cpu().numpy()
        flat = b.op("Reshape", [b.op("Cast", [positions], "Cast", to=ir.DataType.FLOAT), b.scalar_i64(-1, 1)],
                    "Reshape")  # [S, 1]
        angles = b.op("Mul", [flat, b.const("rope_inv_freq", inv_freq)], "angles")  # [S, D/2]
        cos, sin = b.op("Cos", [angles], "Cos"), b.op("Sin", [angles], "Sin")
        if self.dtype != np.float32:
            cos = b.op("Cast", [cos], "CastCos", to=ir_dtype(self.dtype))
            sin = b.op("Cast", [sin], "CastSin", to=ir_dtype(self.dtype))
        return seqlens_k, total_len, (cos, sin)

    def token_embedding(self, ids: ir.Value, emb: EmbeddingSpec) -> ir.Value:
        b = self.b
        if isinstance(emb, FloatEmbedding):
            return b.op("Gather", [b.const("/model/embed_tokens/table", emb.table), ids], "Gather", axis=0)
        mm = emb.mm
        # The table is MatMulNBits' B [V, k_blocks, blob] itself (a tied head shares it): gather rows,
        # dequantize each [k_blocks, block] row block-wise along its last axis, flatten to [.., D].
        # Unsqueeze, not a second initializer: the [V, k_blocks] scales are shared with a tied head.
        scales = b.op("Unsqueeze", [b.const("/model/embed_tokens/table.scales", mm.scales), b.scalar_i64(2)],
                      "Unsqueeze")
        inputs = [b.const("/model/embed_tokens/table.qweight", mm.B), ids, scales]
        if mm.zero_points is not None:
            # GatherBlockQuantized packs zero points along the quantized axis, one block per row here.
            zero_points = unpacked_zero_points(mm)[..., None]  # [V, k_blocks, 1]
            inputs.append(b.const("/model/embed_tokens/table.zero_points3d", zero_points))
        rows = b.op("GatherBlockQuantized", inputs, "GatherBlockQuantized", domain=MS_DOMAIN, bits=mm.bits,
                    block_size=mm.block_size, gather_axis=0, quantize_axis=2)
        return b.op("Reshape", [rows, b.scalar_i64(0, 0, self.cfg.hidden_size)], "Reshape")

    def attention(self, h: ir.Value, attn: nn.Module, i: int) -> ir.Value:
        b, cfg, past, rope = self.b, self.cfg, self.io["past"][i], self.rope
        specs = [self.spec(attn.q_proj, f"layers.{i}.q_proj"), self.spec(attn.k_proj, f"layers.{i}.k_proj"),
                 self.spec(attn.v_proj, f"layers.{i}.v_proj")]
        packed = concat_linears(specs)
        if packed is not None:
            qkv: list[ir.Value | None] = [self.linear(h, packed, "attn/qkv_proj"), None, None]
        else:  # mixed formats (a mixed-precision recipe): three projections feed GQA separately
            qkv = [self.linear(h, s, f"attn/{n}") for s, n in zip(specs, ("q_proj", "k_proj", "v_proj"))]
        local = -1 if self.window is None else self.window  # keys visible to a query, itself included (measured)
        streaming = self.max_seq_len is None
        if streaming:  # RoPE outside GQA: its internal RoPE indexes a bounded table by absolute position
            qkv = self.rotary(qkv, rope)
        out, present_k, present_v = b.op(
            "GroupQueryAttention", [*qkv, past[0], past[1], self.seqlens_k, self.total_len,
                                    *((None, None) if streaming else rope)],
            "attn/GroupQueryAttention", domain=MS_DOMAIN, num_outputs=3, num_heads=cfg.num_attention_heads,
            kv_num_heads=cfg.num_key_value_heads, local_window_size=local, do_rotary=int(not streaming),
            rotary_interleaved=0, sliding_window_cache=1 if streaming else None)
        present_shape = (["batch_size", cfg.num_key_value_heads, "total_sequence_length", cfg.dim_per_head]
                         if not streaming else list(past[0].shape.dims))
        self.presents += [(present_k, f"present.{i}.key", present_shape),
                          (present_v, f"present.{i}.value", present_shape)]
        return self.linear(out, self.spec(attn.o_proj, f"layers.{i}.o_proj"), "attn/o_proj")

    def rotary(self, qkv: list[ir.Value | None], rope: tuple[ir.Value, ir.Value]) -> list[ir.Value]:
        """RoPE on q and k with cos/sin rows for this step's positions (row s = token s: offset 0)."""
        b, cfg = self.b, self.cfg
        D, H, Hkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        q, k, v = qkv if qkv[1] is not None else b.op(
            "Split", [qkv[0], b.scalar_i64(H * D, Hkv * D, Hkv * D)], "attn/SplitQKV", num_outputs=3, axis=-1)
        offset = b.scalar_i64(0)
        q = b.op("RotaryEmbedding", [q, offset, *rope], "attn/q_rotary", domain=MS_DOMAIN, num_heads=H,
                 rotary_embedding_dim=D, interleaved=0)
        k = b.op("RotaryEmbedding", [k, offset, *rope], "attn/k_rotary", domain=MS_DOMAIN, num_heads=Hkv,
                 rotary_embedding_dim=D, interleaved=0)
        return [q, k, v]

    def mlp(self, h: ir.Value, mlp: nn.Module) -> ir.Value:
        b = self.b
        gate_s, up_s = self.spec(mlp.gate_proj, "gate_proj"), self.spec(mlp.up_proj, "up_proj")
        packed = concat_linears([gate_s, up_s]) if self.pack_gate_up else None
        if packed is not None:
            f = self.cfg.intermediate_size
            gate, up = b.op("Split", [self.linear(h, packed, "mlp/gate_up_proj"), b.scalar_i64(f, f)], "mlp/Split",
                            num_outputs=2, axis=-1)
        else:
            gate, up = self.linear(h, gate_s, "mlp/gate_proj"), self.linear(h, up_s, "mlp/up_proj")
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate], "mlp/Sigmoid")], "mlp/SiLU")
        return self.linear(b.op("Mul", [act, up], "mlp/Mul"), self.spec(mlp.down_proj, "down_proj"), "mlp/down_proj")

