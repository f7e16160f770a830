"""One decoder for every supported family, parameterised by the features of `ModelConfig`.

Llama is the base; the features add Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k norms,
Gemma's sandwich norms, embedding scale, GELU-tanh MLP and `query_pre_attn_scalar`, sliding-window
layers (all of them, Mistral; interleaved with global ones and a RoPE base per layer type, Gemma 3),
no-RoPE layers (SmolLM3), partial rotary and RoPE scaling (Phi-4-mini's longrope, Llama 3's llama3,
linear, YaRN). No code here tests a family's name.

Module and parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so
a HF state dict loads as is (Phi-3's fused projections and Gemma's norm offset are converted at the
checkpoint boundary, `edgefinfer.model.checkpoint`). The forward pass has no data-dependent Python control
flow, so torch.export can trace it; the KV cache is an argument (see `edgefinfer.model.kv_cache`).

Shapes: B batch, S new tokens, T key slots, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefinfer.model.kv_cache import KVCache, attention_mask, effective_window
from edgefinfer.model.config import ModelConfig, Rope

# cos, sin [B, 1, S, R] of each distinct RoPE of the model, for this forward's positions.
RopeTables = dict[Rope, tuple[Tensor, Tensor]]


class RMSNorm(nn.Module):
    """x / rms(x) * weight; `weight` is the gain itself (Gemma's 1 + w is added at load)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementations, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig, rope: Rope | None = None) -> Tensor:
    """Inverse frequencies [R/2] of `rope` (default: the first RoPE of the model)."""
    rope = rope or (config.ropes() or [config.rope_of(0)])[0]
    return rope.inv_freq_and_factor(config.max_position_embeddings)[0]


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, S, R] for positions [B, S] (HF's half-split layout: the two halves share a
    frequency), times the RoPE's attention factor (YaRN, longrope)."""
    angles = positions[..., None].float() * inv_freq  # [B, S, R/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, R]
    cos, sin = angles.cos(), angles.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., D]; rotate pairs (i, i + R/2) of the first R = cos.shape[-1] dimensions, keep the rest."""
    r = cos.shape[-1]
    if r != x.shape[-1]:  # partial rotary (Phi-4-mini): the tail of each head passes through
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.dim_per_head
        self.window = config.window_of(layer_idx)
        self.rope = config.rope_of(layer_idx)  # None: a no-RoPE layer
        self.scale = config.attention_scale
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # An exporter may set one linear computing q|k|v (`edgefinfer.compile.fusion`): one kernel
        # call and one activation quantization instead of three. The checkpoint keeps q/k/v apart.
        self.qkv_proj: nn.Module | None = None

    def projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, d] -> q [B, S, H*D], k and v [B, S, Hkv*D]."""
        if self.qkv_proj is not None:
            kv = self.n_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_qkv(self, x: Tensor, ropes: RopeTables) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, d] -> q [B, S, H, D], k and v [B, S, Hkv, D]: projections, q/k norms, RoPE."""
        B, S, _ = x.shape
        q, k, v = self.projections(x)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = ropes[self.rope]  # [B, 1, S, R] -> [B, S, 1, R] to meet heads in [B, S, H, D]
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: Tensor, ropes: RopeTables, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        B, S, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project_qkv(x, ropes))  # [B, H|Hkv, S, D]

        if cache is None:
            key_pos = input_pos
        else:
            k, v, key_pos = cache.update(self.layer_idx, k, v, input_pos)  # [B, Hkv, T, D], [B, T]
        window, num_sinks = effective_window(self.window, cache)
        mask = attention_mask(input_pos, key_pos, window, num_sinks)  # [B, 1, S, T]

        # Grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads.
        # Eager uses SDPA's GQA (no copies of K/V); tracing for export gets the plain repeat.
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            n_rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)  # [B, H, T, D]
            gqa = False
        else:
            gqa = self.n_heads != self.n_kv_heads
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=self.scale,
                                           enable_gqa=gqa)  # [B, H, S, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


def activation(name: str):
    """The gate's activation of a gated MLP: silu (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma)."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)
        self.act_name = config.hidden_act
        self.act = activation(config.hidden_act)
        self.gate_up_proj: nn.Module | None = None  # gate|up in one linear, set by an exporter (as qkv_proj)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks on a residual stream; with sandwich norms (Gemma) each
    block's output is normalised too before it is added.

    Hugging Face's names differ by family: Llama's `post_attention_layernorm` is the MLP's input norm,
    Gemma's is the attention output's (its MLP input norm is `pre_feedforward_layernorm`). Code that
    walks a layer uses the role names `attn_norm`, `attn_out_norm`, `mlp_norm` and `mlp_out_norm`.
    """

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)

    @property
    def attn_norm(self) -> RMSNorm:
        return self.input_layernorm

    @property
    def attn_out_norm(self) -> RMSNorm | None:
        return self.post_attention_layernorm if self.sandwich else None

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    @property
    def mlp_out_norm(self) -> RMSNorm | None:
        return self.post_feedforward_layernorm if self.sandwich else None

    @property
    def mlp_norm_name(self) -> str:
        return "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"

    def forward(self, x: Tensor, ropes: RopeTables, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        h = self.self_attn(self.attn_norm(x), ropes, input_pos, cache)
        x = x + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        h = self.mlp(self.mlp_norm(x))
        return x + (h if self.mlp_out_norm is None else self.mlp_out_norm(h))


class DecoderStack(nn.Module):
    """HF's `model.model`: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the RoPE buffers: `inv_freq` of the first RoPE and one `inv_freq_{i}` per
        distinct RoPE (a model built on the meta device calls this after loading its weights)."""
        self.ropes = self.config.ropes()
        self.rope_factors = [r.inv_freq_and_factor(self.config.max_position_embeddings)[1] for r in self.ropes]
        for i, rope in enumerate(self.ropes):
            self.register_buffer(f"inv_freq_{i}", rope.inv_freq_and_factor(self.config.max_position_embeddings)[0],
                                 persistent=False)
        first = self.ropes[0] if self.ropes else Rope(self.config.rope_theta, self.config.rotary_dim)
        self.register_buffer("inv_freq", first.inv_freq_and_factor(self.config.max_position_embeddings)[0],
                             persistent=False)

    def rope_tables(self, input_pos: Tensor, dtype: torch.dtype) -> RopeTables:
        """cos/sin of every distinct RoPE for positions [B, S] (computed once, shared by its layers)."""
        return {rope: rope_cos_sin(getattr(self, f"inv_freq_{i}"), input_pos, dtype, self.rope_factors[i])
                for i, rope in enumerate(self.ropes)}

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.model.embed_tokens(tokens)  # [B, S, d]
        if self.config.embedding_scale is not None:  # Gemma: the scale rounded to the weights' dtype
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def hidden_states(self, tokens: Tensor, input_pos: Tensor | None = None,
                      cache: KVCache | None = None) -> list[Tensor]:
        """The residual stream after the embedding and after every layer (the last one normalised)."""
        tokens, input_pos = _batched(tokens, input_pos)
        x = self.embed(tokens)
        ropes = self.rope_tables(input_pos, x.dtype)
        states = [x]
        for layer in self.model.layers:
            x = layer(x, ropes, input_pos, cache)
            states.append(x)
        states[-1] = self.model.norm(x)
        return states

    def forward(self, tokens: Tensor, input_pos: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """tokens [B, S] (or [S]); input_pos [B, S] or [S] (default 0..S-1) -> logits [B, S, vocab]."""
        return self.lm_head(self.hidden_states(tokens, input_pos, cache)[-1])


def first_rows(ropes: RopeTables, b: int) -> RopeTables:
    """The tables of the first `b` sequences (calibration runs a batch smaller than its tables)."""
    return {rope: (cos[:b], sin[:b]) for rope, (cos, sin) in ropes.items()}


def _batched(tokens: Tensor, input_pos: Tensor | None) -> tuple[Tensor, Tensor]:
    if tokens.dim() == 1:
        tokens = tokens[None]
    B, S = tokens.shape
    if input_pos is None:
        input_pos = torch.arange(S, device=tokens.device)
    if input_pos.dim() == 1:
        input_pos = input_pos[None].expand(B, S)
    return tokens, input_pos
