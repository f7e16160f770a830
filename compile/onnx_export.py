"""ONNX Runtime export: the fused decoder graph, written directly, plus onnxruntime-genai's config.

The graph is the one ONNX Runtime's own model builder emits for Llama-family models, built from
our module tree instead of traced (see `onnx_graph` for why):

    input_ids [B, S] ──Gather / GatherBlockQuantized──► x (× embedding scale)
    per layer:  (Skip)SimplifiedLayerNormalization ─► packed QKV MatMul(NBits)
                [─► Split, per-head q/k SimplifiedLayerNormalization]
                ─► GroupQueryAttention (RoPE inside; past/present share one buffer; local window)
                ─► o_proj [─► SimplifiedLayerNormalization (sandwich)]
                ─► SkipSimplifiedLayerNormalization ─► packed gate|up ─► SiLU|GELU-tanh·up ─► down
                [─► SimplifiedLayerNormalization (sandwich)]
    final SkipSimplifiedLayerNormalization ─► lm_head ─► logits [B, S, V] (float32)

The model's features map to per-layer attributes and inputs: each layer's GQA has its own
`local_window_size` (`cfg.window_of(i)`), its RoPE's cos/sin tables (one pair per distinct `Rope`,
the attention factor folded in) or `do_rotary=0` (a no-RoPE layer), and `scale`
(`query_pre_attn_scalar`). GQA rotates the first R dims itself when its kernel takes that table
width (R/2 a multiple of 8); otherwise RoPE runs before GQA as `RotaryEmbedding` with
`rotary_embedding_dim`, on positions derived from `attention_mask`.

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

from edgefinfer.bundle.artefact import ArtefactSpec, KVSpec, Layout, write_spec
from edgefinfer.model.checkpoint import TOKENIZER_FILES
from edgefinfer.compile.artefact_cache import cached_export
from edgefinfer.compile import quant
from edgefinfer.compile.onnx_graph import MS_DOMAIN, GraphBuilder, ir_dtype, save_model
from edgefinfer.compile.onnx_weights import (EmbeddingSpec, FloatEmbedding, FloatLinear, LinearSpec, NBitsLinear,
                                             QuantTable, concat_linears, embedding_spec, linear_spec, shares_codes,
                                             unpacked_zero_points)
from edgefinfer.compile.quant.modules import QUANT_MODULES, QuantLinear
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserChoice, UserError
from edgefinfer.model.transformer import Transformer



class Weights(UserChoice):
    """What `export_onnx` writes the linear layers as: float (fp32; fp16, whose graph also takes and
    returns float16) or integer (int8 / int4: a float model is quantized first, round to nearest).
    A StrEnum: written (metadata, manifest, cache key) as its name."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def refusal(cls, text: object) -> str:
        return f"unknown ONNX weights {text!r}: use one of {', '.join(cls)}"

    @property
    def bits(self) -> int | None:
        """The integer width; None for float weights."""
        return {Weights.INT8: 8, Weights.INT4: 4}.get(self)


Stream = Any  # the residual stream as a DecoderForm carries it
WEIGHTS: tuple[Weights, ...] = tuple(Weights)
MODEL_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
# onnxruntime-genai's `model.type` for each family: what its model builder writes (the architecture
# name without ForCausalLM, Gemma 3's text decoder as gemma3_text); every one is a decoder type
# onnxruntime-genai 0.18 accepts.
GENAI_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3_text": "gemma3_text", "phi3": "phi3", "smollm3": "smollm3"}


# ---- public API -----------------------------------------------------------------------------------

# The modules whose source is part of the artefact cache's key (weights="int4" quantizes with compile/quant).
CACHE_SOURCES = (Path(__file__), Path(__file__).with_name("onnx_graph.py"), Path(__file__).with_name("onnx_weights.py"),
                 *quant.SOURCES)


@cached_export("onnx", CACHE_SOURCES, bypass=("tokenizer_dir",))  # the tokenizer files are not in the key
def export_onnx(model: Transformer, out_dir: str | Path, *, weights: Weights | str | None = None, block_size: int = 32,
                symmetric: bool = True, embedding: Literal["float", "int8", "int4"] | None = None,
                kv: Layout = Layout.STATIC, window: int | None = None, lookahead: int | None = None,
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
    window: sliding-window attention (the query sees itself and the window-1 previous positions).
        kv="static": default each layer's own window (`cfg.window_of(i)`: global layers of an
        interleaved model see everything); a number tightens every layer's to it. kv="window": the
        cache's window, one for every layer (default the model's `sliding_window`; a global layer is
        windowed by it too, as the torch window cache does); required when the model has none.
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
    kv = Layout.parse(kv)
    weights = None if weights is None else Weights.parse(weights)
    streams = kv is Layout.WINDOW
    model, recipe = _resolve_weights(model, weights, block_size, symmetric, embedding)
    io_dtype = np.float16 if weights is Weights.FP16 else np.float32
    if window is not None and window < 1:
        raise UserError(f"the attention window must be >= 1 token, got {window}")
    slots = _cache_slots(kv, cfg.sliding_window if window is None else window, lookahead, max_seq_len)
    max_seq_len = None if streams else max_seq_len or cfg.max_position_embeddings
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise UserError(f"accuracy_level must be 0..4 (MatMulNBits' activation precision), got {accuracy_level}")

    builder = GraphBuilder()
    form = FusedForm(builder, model, io_dtype, window, max_seq_len, accuracy_level, pack_gate_up,
                     window_slots=slots if streams else None)
    emit_decoder(form, model)
    kind = recipe or ("fp16" if io_dtype == np.float16 else _weights_label(model))
    window = form.window
    spec = ArtefactSpec(
        "onnx", KVSpec(kv, max_seq_len=max_seq_len, window=window, slots=slots if streams else None,
                        lookahead=slots - window if streams else None),
        recipe_name=kind, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
        inputs=("input_ids", "position_ids" if streams else "attention_mask",
                *_kv_names("past_key_values", cfg.num_hidden_layers)),
        outputs=("logits", *_kv_names("present", cfg.num_hidden_layers)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = save_model(builder.model(write_spec(spec, "onnx")), out / filename)
    genai = [] if streams else [GENAI_CONFIG]
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
                      "sliding_window_cache": streams},
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
            "type": GENAI_TYPES.get(cfg.model_type, cfg.model_type),
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


def _cache_slots(kv: Layout, window: int | None, lookahead: int | None, max_seq_len: int | None) -> int | None:
    """KV slots of a window graph (None for a static one, whose buffer holds max_seq_len)."""
    if kv is Layout.STATIC:
        if lookahead is not None:
            raise UserError("lookahead applies to kv='window'; drop it for a static cache")
        return None
    if window is None:
        raise UserError("kv='window' needs window=N >= 1 (the number of recent positions kept)")
    if max_seq_len is not None:
        raise UserError("max_seq_len applies to kv='static'; a window cache has no length limit")
    lookahead = max(1, window // 4) if lookahead is None else lookahead
    if lookahead < 0:
        raise UserError(f"lookahead must be >= 0, got {lookahead}")
    return window + lookahead


def rope_tables(model: Transformer, max_seq_len: int, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_seq_len, R/2] of the model's `index`-th distinct RoPE (`model.ropes`), computed
    exactly as the eager model does (float32 angles), times its attention factor."""
    inv_freq, factor = rope_inv_freq(model, index)
    angles = torch.arange(max_seq_len).float()[:, None] * torch.from_numpy(inv_freq)  # [T, R/2]
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.numpy(), sin.numpy()


def rope_inv_freq(model: Transformer, index: int = 0) -> tuple[np.ndarray, float]:
    """(inverse frequencies [R/2] float32, attention factor) of the model's `index`-th RoPE."""
    inv_freq = getattr(model, f"inv_freq_{index}", None) if model.ropes else None
    if inv_freq is None:
        inv_freq = model.inv_freq
    factor = model.rope_factors[index] if model.ropes else 1.0
    return inv_freq.detach().float().cpu().numpy(), float(factor)


def layer_windows(cfg: ModelConfig, window: int | None) -> list[int | None]:
    """Each layer's attention window: its own (`cfg.window_of`), tightened to `window` if given."""
    out = []
    for i in range(cfg.num_hidden_layers):
        own = [w for w in (cfg.window_of(i), window) if w is not None]
        out.append(min(own) if own else None)
    return out


def gqa_rotates(rotary_dim: int, head_dim: int) -> bool:
    """Whether GroupQueryAttention's own RoPE takes a table of rotary_dim / 2 columns (its kernel
    requires a multiple of 8, at most (head_dim // 16) * 8; measured on ONNX Runtime 1.31)."""
    half = rotary_dim // 2
    return half % 8 == 0 and 0 < half <= (head_dim // 16) * 8


# ---- weights -----------------------------------------------------------------------------------------

def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QUANT_MODULES) for m in model.modules())


def _weights_label(model: nn.Module) -> str:
    formats = sorted({m.fmt.label() for m in model.modules() if isinstance(m, QuantLinear)})
    return "+".join(formats) if formats else "fp32"


def _resolve_weights(model: Transformer, weights: Weights | None, block_size: int, symmetric: bool,
                     embedding: str | None) -> tuple[Transformer, str | None]:
    """The model to export (a quantized copy when asked) and the recipe name used, if any."""
    if _is_quantized(model):
        bits = {m.fmt.bits for m in model.modules() if isinstance(m, QuantLinear)}
        # A quantized model keeps its codes: only its own width (or None) describes it.
        if weights is not None and (weights.bits is None or bits != {weights.bits}):
            raise UserError(f"the model is already quantized ({_weights_label(model)}); export it with weights=None "
                            "or start from the float checkpoint to pick another format")
        return model, None
    if weights is None or weights.bits is None:
        return model, None
    from edgefinfer.compile.quant import parse_recipe, quantize_model

    emb = {"float": "embf", "int8": "emb8", "int4": "emb4", None: f"emb{weights.bits}"}.get(embedding)
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
    def out_norm(self, out: ir.Value, norm: nn.Module, name: str) -> ir.Value: ...
    def add(self, stream: Stream, out: ir.Value, name: str) -> Stream: ...
    def final_norm(self, stream: Stream, norm: nn.Module) -> ir.Value: ...
    def attention(self, h: ir.Value, attn: nn.Module, i: int) -> ir.Value: ...
    def mlp(self, h: ir.Value, mlp: nn.Module) -> ir.Value: ...
    def lm_head(self, h: ir.Value) -> ir.Value: ...
    def finish(self, logits: ir.Value) -> None: ...


def emit_decoder(form: DecoderForm, model: Transformer) -> None:
    """The decoder, written once for both forms: embedding (scaled by the form when the model says
    so), pre-norm attention and MLP blocks on a residual stream (each block's output normalised first
    with sandwich norms), final norm, output head. Norms are walked by role (`DecoderLayer.attn_norm`
    ...), never by Hugging Face name: Llama's post_attention_layernorm is Gemma's attention output norm."""
    b = form.b
    stream = form.embed()
    for i, layer in enumerate(model.model.layers):
        b.scope = f"/model/layers.{i}"
        h, stream = form.norm(stream, layer.attn_norm, "input_layernorm")
        out = form.attention(h, layer.self_attn, i)
        if layer.attn_out_norm is not None:
            out = form.out_norm(out, layer.attn_out_norm, "post_attention_layernorm")
        stream = form.add(stream, out, "attn_residual")
        h, stream = form.norm(stream, layer.mlp_norm, layer.mlp_norm_name)
        out = form.mlp(h, layer.mlp)
        if layer.mlp_out_norm is not None:
            out = form.out_norm(out, layer.mlp_out_norm, "post_feedforward_layernorm")
        stream = form.add(stream, out, "mlp_residual")
    b.scope = "/model"
    h = form.final_norm(stream, model.model.norm)
    b.scope = "/lm_head"
    form.finish(form.lm_head(h))


class FusedForm:
    """ONNX Runtime's fused decoder: GroupQueryAttention, (Skip)SimplifiedLayerNormalization,
    MatMulNBits / GatherBlockQuantized for integer weights; batch and lengths dynamic."""

    def __init__(self, b: GraphBuilder, model: Transformer, io_dtype: np.dtype, window: int | None,
                 max_seq_len: int | None, accuracy_level: int, pack_gate_up: bool, window_slots: int | None):
        """max_seq_len None: the window form (RoPE from positions, GQA's windowed cache of `window_slots`).
        window: None keeps each layer's own window (`cfg.window_of`); a number tightens every layer's
        to it (the window form's cache window: the model's `sliding_window` by default)."""
        self.b, self.model, self.cfg = b, model, model.config
        cfg = self.cfg
        self.dtype = np.dtype(io_dtype)
        self.max_seq_len = max_seq_len
        self.accuracy_level = accuracy_level
        self.pack_gate_up = pack_gate_up
        streaming = max_seq_len is None
        if streaming and window is None:
            window = cfg.sliding_window
        self.windows = layer_windows(cfg, window)
        if streaming:  # one buffer layout, evicted by GQA at one window, for every layer
            narrow = next((i for i, w in enumerate(self.windows) if w != window), None)
            if narrow is not None:
                raise UserError(f"kv='window' keeps one window of {window} positions for every layer, but layer "
                                f"{narrow} attends to only {self.windows[narrow]}; export with window <= "
                                f"{self.windows[narrow]}")
        # The window the artefact declares: the one every layer has, else None (some layer sees more).
        self.window = self.windows[0] if len(set(self.windows)) == 1 else None
        self.presents: list[tuple[ir.Value, str, list]] = []
        self.io = _declare_io(b, cfg, self.dtype, window_slots)
        self.positions: ir.Value | None = None  # [B, S] int64 or a [1] offset, for RoPE outside GQA
        if "attention_mask" in self.io:
            self.seqlens_k, self.total_len, self.ropes = self.lengths_from_mask(self.io["attention_mask"])
        else:
            self.seqlens_k, self.total_len, self.ropes = self.lengths_from_positions(self.io["position_ids"])
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

    def gamma(self, name: str, weight: nn.Parameter) -> ir.Value:
        return self.b.const(f"{self.b.scope}/{name}.weight", weight.detach().float().numpy().astype(self.dtype))

    def simple_norm(self, x: ir.Value, weight: nn.Parameter, name: str) -> ir.Value:
        """RMSNorm over the last axis (float32 inside, as the eager model)."""
        return self.b.op("SimplifiedLayerNormalization", [x, self.gamma(name, weight)], name, axis=-1,
                         epsilon=self.cfg.rms_norm_eps, stash_type=1)

    def skip_norm(self, x: ir.Value, skip: ir.Value, weight: nn.Parameter, name: str,
                  with_sum: bool = True) -> tuple[ir.Value, ir.Value | None]:
        """(normalised x + skip, x + skip) in one kernel."""
        gamma = self.gamma(name, weight)
        if not with_sum:
            return self.b.op("SkipSimplifiedLayerNormalization", [x, skip, gamma], name, domain=MS_DOMAIN,
                             epsilon=self.cfg.rms_norm_eps), None
        out = self.b.op("SkipSimplifiedLayerNormalization", [x, skip, gamma], name, domain=MS_DOMAIN, num_outputs=4,
                        epsilon=self.cfg.rms_norm_eps)
        out[1].name = out[2].name = ""  # omit the training outputs: computing them costs ~40% of the kernel
        return out[0], out[3]

    # -- the form's blocks (see DecoderForm) --
    def embed(self) -> tuple[ir.Value, None]:
        b = self.b
        b.scope = "/model/embed_tokens"
        self.emb = embedding_spec(self.model.model.embed_tokens, self.dtype)
        x = self.token_embedding(self.io["input_ids"], self.emb)
        if self.cfg.embedding_scale is not None:  # the scale rounded to the activations' dtype, as eager
            x = b.op("Mul", [x, b.const("embedding_scale", np.array(self.cfg.embedding_scale, self.dtype))], "Scale")
        return x, None

    def norm(self, stream: tuple[ir.Value, ir.Value | None], norm: nn.Module,
             name: str) -> tuple[ir.Value, tuple[ir.Value, None]]:
        residual, pending = stream
        if pending is None:  # the first block: nothing to add yet
            return self.simple_norm(residual, norm.weight, name), (residual, None)
        h, residual = self.skip_norm(residual, pending, norm.weight, name)
        return h, (residual, None)

    def out_norm(self, out: ir.Value, norm: nn.Module, name: str) -> ir.Value:
        """A sandwich norm on a block's output; the next SkipSimplifiedLayerNormalization adds the
        normalised output to the stream as before."""
        return self.simple_norm(out, norm.weight, name)

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

    def _table_name(self, kind: str, j: int) -> str:
        return f"{kind}_cache" if j == 0 else f"{kind}_cache_{j}"

    def lengths_from_mask(self, mask: ir.Value) -> tuple[ir.Value, ir.Value, list[tuple[ir.Value, ir.Value]]]:
        """GQA reads lengths, not a mask: seqlens_k = valid length - 1, total_sequence_length = T.
        RoPE uses [max_seq_len, R/2] tables, one pair per distinct RoPE of the model."""
        b = self.b
        b.scope = "/attn_mask"
        seqlens = b.op("ReduceSum", [mask, b.scalar_i64(1)], "ReduceSum", keepdims=0)
        self.valid_len = seqlens  # [B] int64
        seqlens_k = b.op("Cast", [b.op("Sub", [seqlens, b.scalar_i64(1)], "Sub")], "seqlens_k", to=ir.DataType.INT32)
        total = b.op("Gather", [b.op("Shape", [mask], "Shape"), b.const("const_i64_scalar_1", np.array(1, np.int64))],
                     "Gather", axis=0)
        total_len = b.op("Cast", [total], "total_sequence_length", to=ir.DataType.INT32)
        tables = []
        for j in range(len(self.model.ropes)):
            cos, sin = rope_tables(self.model, self.max_seq_len, j)
            tables.append((b.const(self._table_name("cos", j), cos.astype(self.dtype)),
                           b.const(self._table_name("sin", j), sin.astype(self.dtype))))
        return seqlens_k, total_len, tables

    def positions_from_mask(self) -> ir.Value:
        """position_ids [B, S] of this call's tokens (valid length - S + s), for RoPE outside GQA;
        made once, on first need."""
        if self.positions is None:
            b, scope = self.b, self.b.scope
            b.scope = "/attn_mask"
            ids = self.io["input_ids"]
            s = b.op("Gather", [b.op("Shape", [ids], "ShapeIds"), b.const("const_i64_scalar_1", np.array(1, np.int64))],
                     "SeqLen", axis=0)  # scalar S
            steps = b.op("Range", [b.const("const_i64_scalar_0", np.array(0, np.int64)), s,
                                   b.const("const_i64_scalar_1", np.array(1, np.int64))], "Range")  # [S]
            first = b.op("Sub", [b.op("Unsqueeze", [self.valid_len, b.scalar_i64(1)], "UnsqueezeLen"), s],
                         "FirstPosition")  # [B, 1]
            self.positions = b.op("Add", [first, steps], "position_ids")  # [B, S]
            b.scope = scope
        return self.positions

    def lengths_from_positions(self, positions: ir.Value
                               ) -> tuple[ir.Value, ir.Value, list[tuple[ir.Value, ir.Value]]]:
        """The window form: the last position p gives seqlens_k = p and total_sequence_length = p + 1
        (batch 1); cos/sin [S, R/2] of each RoPE for exactly these positions, computed as the eager
        model does (float32 angles, times the attention factor), so no table bounds the stream."""
        b = self.b
        b.scope = "/positions"
        last = b.op("ReduceMax", [positions, b.scalar_i64(1)], "ReduceMax", keepdims=0)  # [1]
        seqlens_k = b.op("Cast", [last], "seqlens_k", to=ir.DataType.INT32)
        total = b.op("Add", [b.op("Squeeze", [last, b.scalar_i64(0)], "Squeeze"),
                             b.const("const_i64_scalar_1", np.array(1, np.int64))], "Add")
        total_len = b.op("Cast", [total], "total_sequence_length", to=ir.DataType.INT32)
        flat = b.op("Reshape", [b.op("Cast", [positions], "Cast", to=ir.DataType.FLOAT), b.scalar_i64(-1, 1)],
                    "Reshape")  # [S, 1]
        self.positions = b.scalar_i64(0)  # row s of the tables is token s
        tables = []
        for j in range(len(self.model.ropes)):
            inv_freq, factor = rope_inv_freq(self.model, j)
            sfx = "" if j == 0 else f"_{j}"
            angles = b.op("Mul", [flat, b.const(f"rope_inv_freq{sfx}", inv_freq)], f"angles{sfx}")  # [S, R/2]
            cos, sin = b.op("Cos", [angles], f"Cos{sfx}"), b.op("Sin", [angles], f"Sin{sfx}")
            if factor != 1.0:
                f = b.const(f"rope_attention_factor{sfx}", np.array(factor, np.float32))
                cos, sin = b.op("Mul", [cos, f], f"CosFactor{sfx}"), b.op("Mul", [sin, f], f"SinFactor{sfx}")
            if self.dtype != np.float32:
                cos = b.op("Cast", [cos], f"CastCos{sfx}", to=ir_dtype(self.dtype))
                sin = b.op("Cast", [sin], f"CastSin{sfx}", to=ir_dtype(self.dtype))
            tables.append((cos, sin))
        return seqlens_k, total_len, tables

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
        b, cfg, past = self.b, self.cfg, self.io["past"][i]
        specs = [self.spec(attn.q_proj, f"layers.{i}.q_proj"), self.spec(attn.k_proj, f"layers.{i}.k_proj"),
                 self.spec(attn.v_proj, f"layers.{i}.v_proj")]
        packed = concat_linears(specs)
        if packed is not None:
            qkv: list[ir.Value | None] = [self.linear(h, packed, "attn/qkv_proj"), None, None]
        else:  # mixed formats (a mixed-precision recipe): three projections feed GQA separately
            qkv = [self.linear(h, s, f"attn/{n}") for s, n in zip(specs, ("q_proj", "k_proj", "v_proj"))]
        rope = attn.rope  # None: a no-RoPE layer
        tables = self.ropes[self.model.ropes.index(rope)] if rope is not None else None
        streaming = self.max_seq_len is None
        # GQA's own RoPE indexes a [max_seq_len, R/2] table by absolute position; the window form
        # (unbounded positions) and table widths its kernel refuses rotate outside it.
        inside = rope is not None and not streaming and gqa_rotates(rope.dim, cfg.dim_per_head)
        if attn.q_norm is not None or (rope is not None and not inside):
            q, k, v = self.split_qkv(qkv)
            if attn.q_norm is not None:  # per-head RMSNorm on q and k, before RoPE
                q = self.head_norm(q, attn.q_norm, cfg.num_attention_heads, "attn/q_norm")
                k = self.head_norm(k, attn.k_norm, cfg.num_key_value_heads, "attn/k_norm")
            if rope is not None and not inside:
                q, k = self.rotary(q, k, tables, rope.dim)
            qkv = [q, k, v]
        local = self.windows[i] or -1  # keys visible to a query, itself included (measured)
        scale = cfg.attention_scale if cfg.query_pre_attn_scalar is not None else None
        out, present_k, present_v = b.op(
            "GroupQueryAttention", [*qkv, past[0], past[1], self.seqlens_k, self.total_len,
                                    *(tables if inside else (None, None))],
            "attn/GroupQueryAttention", domain=MS_DOMAIN, num_outputs=3, num_heads=cfg.num_attention_heads,
            kv_num_heads=cfg.num_key_value_heads, local_window_size=local, do_rotary=int(inside),
            rotary_interleaved=0, scale=scale, sliding_window_cache=1 if streaming else None)
        present_shape = (["batch_size", cfg.num_key_value_heads, "total_sequence_length", cfg.dim_per_head]
                         if not streaming else list(past[0].shape.dims))
        self.presents += [(present_k, f"present.{i}.key", present_shape),
                          (present_v, f"present.{i}.value", present_shape)]
        return self.linear(out, self.spec(attn.o_proj, f"layers.{i}.o_proj"), "attn/o_proj")

    def split_qkv(self, qkv: list[ir.Value | None]) -> list[ir.Value]:
        if qkv[1] is not None:
            return list(qkv)
        cfg, b = self.cfg, self.b
        D, H, Hkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        return list(b.op("Split", [qkv[0], b.scalar_i64(H * D, Hkv * D, Hkv * D)], "attn/SplitQKV", num_outputs=3,
                         axis=-1))

    def head_norm(self, x: ir.Value, norm: nn.Module, heads: int, name: str) -> ir.Value:
        """RMSNorm of each head: [B, S, n * D] -> [B, S, n, D], normalised over D, and back."""
        b, D = self.b, self.cfg.dim_per_head
        x = b.op("Reshape", [x, b.scalar_i64(0, 0, heads, D)], f"{name}/Reshape_1")
        x = self.simple_norm(x, norm.weight, f"{name}/SimplifiedLayerNormalization")
        return b.op("Reshape", [x, b.scalar_i64(0, 0, heads * D)], f"{name}/Reshape_2")

    def rotary(self, q: ir.Value, k: ir.Value, tables: tuple[ir.Value, ir.Value],
               rotary_dim: int) -> tuple[ir.Value, ir.Value]:
        """RoPE on q and k before GQA, on the first `rotary_dim` dims of each head. The window form's
        tables hold this step's rows (position input: offset 0); the static form's are indexed by
        positions derived from the mask."""
        b, cfg = self.b, self.cfg
        pos = self.positions if self.max_seq_len is None else self.positions_from_mask()
        q = b.op("RotaryEmbedding", [q, pos, *tables], "attn/q_rotary", domain=MS_DOMAIN,
                 num_heads=cfg.num_attention_heads, rotary_embedding_dim=rotary_dim, interleaved=0)
        k = b.op("RotaryEmbedding", [k, pos, *tables], "attn/k_rotary", domain=MS_DOMAIN,
                 num_heads=cfg.num_key_value_heads, rotary_embedding_dim=rotary_dim, interleaved=0)
        return q, k

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
        if self.cfg.hidden_act == "gelu_pytorch_tanh":
            act = b.op("Gelu", [gate], "mlp/Gelu", approximate="tanh")
        else:
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate], "mlp/Sigmoid")], "mlp/SiLU")
        return self.linear(b.op("Mul", [act, up], "mlp/Mul"), self.spec(mlp.down_proj, "down_proj"), "mlp/down_proj")
