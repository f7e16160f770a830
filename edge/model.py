"""One Llama-family decoder: Llama, Qwen2 (q/k/v bias), Mistral-style sliding-window attention.

Module and parameter names follow Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...), so
a HF state dict loads as is. The forward pass has no data-dependent Python control flow, so
torch.export can trace it; the KV cache is an argument (see `edgefinfer.cache`).

Shapes: B batch, S new tokens, T key slots, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefinfer.cache import KVCache, attention_mask, effective_window
from edgefinfer.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementations, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2], with the llama3 long-context scaling when the config asks for it."""
    d = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly between.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, 1, S, D] for positions [B, S] (HF's half-split layout: the two halves share a frequency)."""
    angles = positions[..., None].float() * inv_freq  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, D]
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, S, D]; rotate pairs (i, i + D/2)."""
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
        self.window = config.sliding_window
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.o_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = self.k_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

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
        y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           enable_gqa=gqa)  # [B, H, S, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def hidden_states(self, tokens: Tensor, input_pos: Tensor | None = None,
                      cache: KVCache | None = None) -> list[Tensor]:
        """The residual stream after the embedding and after every layer (the last one normalised)."""
        tokens, input_pos = _batched(tokens, input_pos)
        x = self.model.embed_tokens(tokens)  # [B, S, d]
        cos, sin = rope_cos_sin(self.inv_freq, input_pos, x.dtype)
        states = [x]
        for layer in self.model.layers:
            x = layer(x, cos, sin, input_pos, cache)
            states.append(x)
        states[-1] = self.model.norm(x)
        return states

    def forward(self, tokens: Tensor, input_pos: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """tokens [B, S] (or [S]); input_pos [B, S] or [S] (default 0..S-1) -> logits [B, S, vocab]."""
        return self.lm_head(self.hidden_states(tokens, input_pos, cache)[-1])


def _batched(tokens: Tensor, input_pos: Tensor | None) -> tuple[Tensor, Tensor]:
    if tokens.dim() == 1:
        tokens = tokens[None]
    B, S = tokens.shape
    if input_pos is None:
        input_pos = torch.arange(S, device=tokens.device)
    if input_pos.dim() == 1:
        input_pos = input_pos[None].expand(B, S)
    return tokens, input_pos
