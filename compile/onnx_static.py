"""A static-shape graph for NPUs (Qualcomm QNN HTP): batch 1, S tokens per call, a W-slot window cache.

NPU compilers want every shape fixed and only standard ONNX ops, so this graph has no contrib ops
and no dynamic dimension:

    input_ids [1, S] int32, position_ids [1, S] int32, attention_bias [1, 1, S, W] float,
    past_key_values.{i}.key/value [1, Hkv, W, D]
        -> logits [1, S, V], present.{i}.key/value [1, Hkv, S, D]  (only the new tokens' entries)

Like Qualcomm's Genie, a deployment exports it twice over the same weights and cache layout: a
prompt processor (S = 64 or 128: a prompt in few calls) and a token generator (S = 1). The host
owns the cache as a ring: it writes each `present` row into slot `pos % W` and passes the additive
`attention_bias` of each new token over the W slots (0 = visible, -100 = not). The bias is finite on
purpose: with finfo.min, a QDQ graph spends its whole int8/int16 range on the mask and the scores
lose their resolution (the probe measured top-1 agreement 0.43 -> 0.75). The new tokens' own
keys/values are concatenated inside the graph with a constant causal (and windowed) S x S bias, so a
query sees the cached slots plus the new tokens up to itself. A short last chunk is padded at the
end: causality keeps the padding invisible to the real tokens and the host does not cache it.

Grouped-query attention needs no repeat of the keys: the H query heads are reshaped to
[Hkv, H/Hkv * S] rows and each group multiplies its own key/value head (the bias is tiled to match),
so every tensor stays 4-D. RoPE uses HF's half-split rotation as `x * cos + swap_halves(x) *
sin_signed`, the sign of rotate_half folded into the sin table (one table per distinct RoPE of the
model, its attention factor folded in; partial rotary rotates the first R dims and passes the rest;
no-RoPE layers skip it), and the score scale (1/sqrt(D), or `query_pre_attn_scalar`'s) is folded
into the query projection, or into the q norm's gain when the model normalises q and k per head.
Gemma's embedding scale, sandwich norms and GELU-tanh (written with Tanh) are plain ops too. Only
ops whose QDQ form the HTP reproduces are used (see `rms_norm` for one that it does not).

The host keeps one ring and one attention window for every layer: each layer attends within the
tighter of its own window and the graph's (a global layer of an interleaved model is windowed by
the ring, as the torch window cache does); a graph whose layers would need different windows is
refused.

The layer walk is `onnx_export.emit_decoder`'s, shared with the fused graph; `StaticForm` supplies
the blocks.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from torch import nn

from edgefinfer.bundle.artefact import ArtefactSpec, KVSpec, Layout, write_spec
from edgefinfer.compile.onnx_export import emit_decoder, layer_windows, rope_tables
from edgefinfer.compile.onnx_graph import GraphBuilder, save_model
from edgefinfer.compile.quant.modules import QUANT_MODULES
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

MASK_OFF = -100.0  # must equal edgefinfer.runtime.backends.ort.MASK_OFF


def _w(module: nn.Module, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray | None]:
    """W^T [K, N] and bias [N] of a float linear, times `scale`."""
    w = (module.weight.detach().float() * scale).T.contiguous().numpy()
    b = None if module.bias is None else (module.bias.detach().float() * scale).numpy()
    return w, b


def causal_block(chunk: int, window: int) -> np.ndarray:
    """[1, 1, S, S] additive bias among the S new tokens: token i sees token j <= i within the window."""
    i, j = np.arange(chunk)[:, None], np.arange(chunk)[None, :]
    return np.where((j <= i) & (i - j < window), 0.0, MASK_OFF).astype(np.float32)[None, None]


def export_static_decode(model: Transformer, path, *, cache_slots: int, chunk: int = 1,
                         max_seq_len: int | None = None, window: int | None = None) -> dict:
    """Write the static graph of a float model to `path` (+ `.data`); returns its metadata.

    cache_slots: W, the key/value slots the host keeps. A query sees itself and the W cached
        positions, so a model whose `sliding_window` (or `window`) is W + 1 runs exactly.
    chunk: S, the tokens each call takes (1: the token generator; 64..128: a prompt processor).
    """
    if any(isinstance(m, QUANT_MODULES) for m in model.modules()):
        raise UserError("the static (NPU) graph is built from the float model and quantized as a QDQ graph; "
                        "pass the float checkpoint, not a weight-quantized one")
    if cache_slots < 1:
        raise UserError(f"the window cache needs at least 1 slot, got {cache_slots}")
    if not 1 <= chunk <= cache_slots:
        raise UserError(f"a call takes 1..cache_slots ({cache_slots}) tokens, got chunk={chunk}")
    cfg = model.config
    max_seq_len = max_seq_len or cfg.max_position_embeddings
    window = window if window is not None else (cfg.sliding_window or cache_slots + 1)
    windows = set(layer_windows(cfg, window))
    if windows != {window}:
        raise UserError(f"the static (NPU) graph has one attention window for every layer, but this model's layers "
                        f"attend within {sorted(windows)} positions; export with window <= {min(windows)}")
    b = GraphBuilder()
    emit_decoder(StaticForm(b, model, cache_slots, chunk, max_seq_len, window), model)
    # A ring of W slots that the host owns; max_seq_len bounds the RoPE table, not the stream.
    spec = ArtefactSpec("onnx-static", KVSpec(Layout.WINDOW, max_seq_len=max_seq_len, window=window, slots=cache_slots,
                                               max_chunk=chunk),
                        vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers)
    files = save_model(b.model(write_spec(spec, "onnx")), path)
    return {"files": [f.name for f in files], "cache_slots": cache_slots, "chunk": chunk, "window": window,
            "max_seq_len": max_seq_len,
            "kv_layout": {"format": "BNSH ring", "shape": [1, cfg.num_key_value_heads, cache_slots, cfg.dim_per_head],
                          "slot": "position % cache_slots"}}


class StaticForm:
    """The decoder's blocks in standard ONNX ops with fixed shapes (see the module docstring); a
    `DecoderForm` for `emit_decoder`."""

    def __init__(self, b: GraphBuilder, model: Transformer, cache_slots: int, chunk: int, max_seq_len: int,
                 window: int):
        cfg = self.cfg = model.config
        self.b, self.model = b, model
        self.H, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
        self.G, self.W, self.S = self.H // self.Hkv, cache_slots, chunk
        Hkv, D, G, W, S = self.Hkv, self.D, self.G, self.W, self.S
        self.ids = b.input("input_ids", ir.DataType.INT32, [1, S])
        pos = b.input("position_ids", ir.DataType.INT32, [1, S])
        bias = b.input("attention_bias", ir.DataType.FLOAT, [1, 1, S, W])
        self.past = [(b.input(f"past_key_values.{i}.key", ir.DataType.FLOAT, [1, Hkv, W, D]),
                      b.input(f"past_key_values.{i}.value", ir.DataType.FLOAT, [1, Hkv, W, D]))
                     for i in range(cfg.num_hidden_layers)]
        self.presents: list[tuple[ir.Value, ir.Value]] = []

        b.scope = "/rope"
        self.rope_rows: list[tuple[ir.Value, ir.Value]] = []  # cos, sin_signed [1, 1, S, R] per distinct RoPE
        for j, rope in enumerate(model.ropes):
            cos, sin = rope_tables(model, max_seq_len, j)  # [T, R/2], attention factor included
            R, sfx = rope.dim, "" if j == 0 else f"_{j}"
            cos_full = b.const(f"cos_table{sfx}", np.concatenate([cos, cos], -1))  # [T, R]
            sin_signed = b.const(f"sin_signed_table{sfx}", np.concatenate([-sin, sin], -1))  # rotate_half's sign
            cos_p = b.op("Gather", [cos_full, pos], f"GatherCos{sfx}", axis=0)  # [1, S, R]
            sin_p = b.op("Gather", [sin_signed, pos], f"GatherSin{sfx}", axis=0)
            self.rope_rows.append((b.op("Reshape", [cos_p, b.scalar_i64(1, 1, S, R)], f"ReshapeCos{sfx}"),
                                   b.op("Reshape", [sin_p, b.scalar_i64(1, 1, S, R)], f"ReshapeSin{sfx}")))

        # The new tokens see each other causally: append that constant block to the host's slot bias, then
        # repeat the rows once per query head of a group (rows are ordered group-major, see q/Group).
        b.scope = "/model"
        self_bias = b.const("self_bias", causal_block(S, window))
        full_bias = b.op("Concat", [bias, self_bias], "attention_bias_self", axis=-1)  # [1, 1, S, W + S]
        if G > 1:
            full_bias = b.op("Concat", [full_bias] * G, "attention_bias_groups", axis=2)  # [1, 1, G * S, W + S]
        self.full_bias = full_bias

    # -- building blocks --
    def linear(self, x: ir.Value, module: nn.Module, name: str, scale: float = 1.0) -> ir.Value:
        b = self.b
        w, bb = _w(module, scale)
        y = b.op("MatMul", [x, b.const(f"{b.scope}/{name}.weight", w)], f"{name}/MatMul")
        return y if bb is None else b.op("Add", [y, b.const(f"{b.scope}/{name}.bias", bb)], f"{name}/Add")

    def rms_norm(self, x: ir.Value, norm: nn.Module, name: str, scale: float = 1.0) -> ir.Value:
        # x / sqrt(mean(x^2) + eps) * w, as LAPACK's nrm2 computes a norm: m = max|x|, u = x / m,
        # l = ||u||_2, n = m * l = ||x||_2; then (u / l) * c * (sqrt(d) * w) with the eps term
        # c = 1 / sqrt(1 + (sqrt(d * eps) / n)^2). Two ranges force this form. A few tokens' residual
        # streams reach |x| ~ 2e4 (SmolLM2), so mean(x^2) spans ~1e8 and one 16-bit per-tensor scale
        # rounds every ordinary token's to 0 (A16W8 on the CPU EP: perplexity 2.1e5, float 40.9); and
        # the HTP's ReduceL2 saturates near 362 (measured: 670 -> 362; the HTP's logits were then
        # constant), so it only sees u (norm <= sqrt(d)). SmolLM2 A16W8 now: perplexity 48.2 on the
        # CPU EP, and the emulator's argmax equals the CPU EP's.
        # Div, not Reciprocal then Mul: the HTP's 16-bit Reciprocal was measured 7.0 off on an 8.4 value.
        # The norm runs over the last axis: the hidden size, or head_dim for q/k norms; `scale`
        # multiplies the gain (the score scale folded into the q norm).
        b, d = self.b, int(norm.weight.shape[0])
        m = b.op("ReduceMax", [b.op("Abs", [x], f"{name}/Abs"), b.scalar_i64(-1)], f"{name}/ReduceMax", keepdims=1)
        u = b.op("Div", [x, m], f"{name}/Scale1")
        l2 = b.op("ReduceL2", [u, b.scalar_i64(-1)], f"{name}/ReduceL2", keepdims=1)
        n = b.op("Mul", [m, l2], f"{name}/Norm")
        eps_name = "rms_eps_sqrt" if d == self.cfg.hidden_size else f"rms_eps_sqrt_{d}"
        r = b.op("Div", [b.const(eps_name, np.array((d * self.cfg.rms_norm_eps) ** 0.5, np.float32)), n],
                 f"{name}/EpsRatio")
        one = b.const("one", np.array(1.0, np.float32))
        c = b.op("Div", [one, b.op("Sqrt", [b.op("Add", [one, b.op("Mul", [r, r], f"{name}/EpsSquare")],
                                                     f"{name}/AddEps")], f"{name}/Sqrt")], f"{name}/EpsScale")
        unit = b.op("Mul", [b.op("Div", [u, l2], f"{name}/Normalize"), c], f"{name}/Correct")
        gamma = b.const(f"{b.scope}/{name}.weight",
                        norm.weight.detach().float().numpy() * np.float32(d ** 0.5) * np.float32(scale))
        return b.op("Mul", [unit, gamma], f"{name}/Scale")

    def rope(self, x: ir.Value, rope, name: str) -> ir.Value:  # x [1, heads, S, D]
        if rope is None:  # a no-RoPE layer
            return x
        b, D, R = self.b, self.D, rope.dim
        cos_p, sin_p = self.rope_rows[self.model.ropes.index(rope)]
        rest = None
        if R < D:  # partial rotary: the tail of each head passes through
            x, rest = b.op("Split", [x, b.scalar_i64(R, D - R)], f"{name}/SplitRotary", num_outputs=2, axis=-1)
        lo, hi = b.op("Split", [x, b.scalar_i64(R // 2, R // 2)], f"{name}/Split", num_outputs=2, axis=-1)
        swapped = b.op("Concat", [hi, lo], f"{name}/Swap", axis=-1)
        y = b.op("Add", [b.op("Mul", [x, cos_p], f"{name}/MulCos"),
                         b.op("Mul", [swapped, sin_p], f"{name}/MulSin")], f"{name}/Add")
        return y if rest is None else b.op("Concat", [y, rest], f"{name}/ConcatPass", axis=-1)

    def heads(self, x: ir.Value, n: int, name: str) -> ir.Value:  # [1, S, n * D] -> [1, n, S, D]
        b = self.b
        return b.op("Transpose", [b.op("Reshape", [x, b.scalar_i64(1, self.S, n, self.D)], f"{name}/Reshape")],
                    f"{name}/Transpose", perm=[0, 2, 1, 3])

    # -- the form's blocks (see onnx_export.DecoderForm) --
    def embed(self) -> ir.Value:
        b = self.b
        b.scope = "/model"
        table = b.const("embed_tokens.weight", self.model.model.embed_tokens.weight.detach().float().numpy())
        x = b.op("Gather", [table, self.ids], "embed_tokens", axis=0)  # [1, S, d]
        if self.cfg.embedding_scale is not None:
            x = b.op("Mul", [x, b.const("embedding_scale", np.array(self.cfg.embedding_scale, np.float32))],
                     "embed_tokens/Scale")
        return x

    def norm(self, x: ir.Value, norm: nn.Module, name: str) -> tuple[ir.Value, ir.Value]:
        return self.rms_norm(x, norm, name), x

    def out_norm(self, out: ir.Value, norm: nn.Module, name: str) -> ir.Value:
        return self.rms_norm(out, norm, name)

    def add(self, x: ir.Value, out: ir.Value, name: str) -> ir.Value:
        return self.b.op("Add", [x, out], name)

    def final_norm(self, x: ir.Value, norm: nn.Module) -> ir.Value:
        return self.rms_norm(x, norm, "norm")

    def attention(self, h: ir.Value, attn: nn.Module, i: int) -> ir.Value:
        b, H, Hkv, D, G, S = self.b, self.H, self.Hkv, self.D, self.G, self.S
        scale = self.cfg.attention_scale
        if attn.q_norm is None:
            q = self.heads(self.linear(h, attn.q_proj, "q_proj", scale=scale), H, "q")
            k = self.heads(self.linear(h, attn.k_proj, "k_proj"), Hkv, "k")
        else:  # per-head RMSNorm over D before RoPE; the score scale rides on the q norm's gain
            q = self.rms_norm(self.heads(self.linear(h, attn.q_proj, "q_proj"), H, "q"), attn.q_norm, "q_norm", scale)
            k = self.rms_norm(self.heads(self.linear(h, attn.k_proj, "k_proj"), Hkv, "k"), attn.k_norm, "k_norm")
        q, k = self.rope(q, attn.rope, "q_rope"), self.rope(k, attn.rope, "k_rope")  # [1, H|Hkv, S, D]
        v = self.heads(self.linear(h, attn.v_proj, "v_proj"), Hkv, "v")
        self.presents.append((k, v))
        keys = b.op("Concat", [self.past[i][0], k], "keys", axis=2)  # [1, Hkv, W + S, D]
        values = b.op("Concat", [self.past[i][1], v], "values", axis=2)
        qg = b.op("Reshape", [q, b.scalar_i64(1, Hkv, G * S, D)], "q/Group")  # query head h -> kv head h // G
        scores = b.op("MatMul", [qg, b.op("Transpose", [keys], "keys/Transpose", perm=[0, 1, 3, 2])], "scores")
        probs = b.op("Softmax", [b.op("Add", [scores, self.full_bias], "scores/Mask")], "Softmax", axis=-1)
        ctx = b.op("MatMul", [probs, values], "context")  # [1, Hkv, G * S, D]
        ctx = b.op("Reshape", [ctx, b.scalar_i64(1, H, S, D)], "context/Heads")
        ctx = b.op("Transpose", [ctx], "context/Transpose", perm=[0, 2, 1, 3])  # [1, S, H, D]
        ctx = b.op("Reshape", [ctx, b.scalar_i64(1, S, H * D)], "context/Reshape")
        return self.linear(ctx, attn.o_proj, "o_proj")

    def mlp(self, h: ir.Value, mlp: nn.Module) -> ir.Value:
        b = self.b
        gate = self.linear(h, mlp.gate_proj, "gate_proj")
        if self.cfg.hidden_act == "gelu_pytorch_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            cube = b.op("Mul", [b.op("Mul", [gate, gate], "Gelu/Square"), gate], "Gelu/Cube")
            inner = b.op("Add", [gate, b.op("Mul", [cube, b.const("gelu_c", np.array(0.044715, np.float32))],
                                           "Gelu/MulC")], "Gelu/Add")
            t = b.op("Tanh", [b.op("Mul", [inner, b.const("gelu_k", np.array((2 / np.pi) ** 0.5, np.float32))],
                                   "Gelu/MulK")], "Gelu/Tanh")
            half = b.op("Mul", [gate, b.const("half", np.array(0.5, np.float32))], "Gelu/Half")
            act = b.op("Mul", [half, b.op("Add", [t, b.const("one", np.array(1.0, np.float32))], "Gelu/AddOne")],
                       "Gelu")
        else:
            act = b.op("Mul", [gate, b.op("Sigmoid", [gate], "Sigmoid")], "SiLU")
        return self.linear(b.op("Mul", [act, self.linear(h, mlp.up_proj, "up_proj")], "mlp/Mul"), mlp.down_proj,
                           "down_proj")

    def lm_head(self, h: ir.Value) -> ir.Value:
        return self.linear(h, self.model.lm_head, "lm_head")

    def finish(self, logits: ir.Value) -> None:
        b, S, Hkv, D = self.b, self.S, self.Hkv, self.D
        b.output(logits, "logits", ir.DataType.FLOAT, [1, S, self.cfg.vocab_size])
        for i, (k, v) in enumerate(self.presents):
            b.output(k, f"present.{i}.key", ir.DataType.FLOAT, [1, Hkv, S, D])
            b.output(v, f"present.{i}.value", ir.DataType.FLOAT, [1, Hkv, S, D])
