"""Export-time attention for ExecuTorch: our Transformer with ExecuTorch's LLM custom ops.

ExecuTorch ships two CPU kernels that make decoding ~3x faster than the same model written with
plain ops (measured in the probe): `llama::update_cache` (an in-place copy of the new keys into a
cache buffer, instead of a functionalised `index_put` that copies the whole cache) and
`llama::custom_sdpa` (attention over a cache in [B, T, Hkv, D] layout, grouped-query aware, causal
from a start position or under an explicit additive mask). Both want the sequence dimension second.

This module is a *source transformation*, applied to a copy of the model at export time only:
`swap_attention` replaces every `Attention` by a `CustomOpAttention` that reuses the original
module's `project_qkv` (projections, q/k norms, full / partial / no RoPE: every family's features)
and hands the attention core to an export cache, with the layer's attention scale:

* `EtStaticCache`   slot t holds position t; causal attention from `start_pos`
                    (`custom_sdpa(..., is_causal=True)`), or an explicit mask for a layer with its
                    own sliding window shorter than the cache.
* `EtRingCache`     the sliding-window ring with attention sinks (the layout and masking rule of
                    `edgefinfer.runtime.kv.window.SlidingWindowCache`), written with
                    `llama::update_cache_with_indices` and read with `custom_sdpa` under a mask
                    computed from the slots' positions.

Windows are per layer (Gemma 3 interleaves sliding and global layers): `begin` builds one mask per
distinct window of the forward and each layer attends under its own. Under the ring cache a layer
applies the tighter of its own window and the ring's, so a global layer sees the ring's window
(`edgefinfer.model.kv_cache.effective_window`, the runtime's `--kv window:N` policy).

The ring cache writes a chunk before attending, so a chunk must not overwrite history its own
first query still needs: a chunk holds at most `lookahead + 1` tokens (`max_chunk`), enforced by
the exported graph's dynamic-shape bound; the runtime splits longer prompts. (Our eager
`SlidingWindowCache` attends over `cache ++ chunk` instead and takes any chunk length, at the cost
of a copy of the whole cache per step.)

Rollback and reset need no call on either cache: entries at positions >= the chunk's first
position are invisible (causality for the static cache, the `slot_pos >= start` rule for the
ring), exactly the contract of `edgefinfer.model.kv_cache`.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import Tensor, nn

from edgefinfer.model.kv_cache import effective_window, may_attend
from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Attention, RopeTables, Transformer


def load_custom_ops() -> None:
    """Register `llama::*` with torch (meta kernels for export, CPU kernels for eager checks)."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401


def _additive_mask(query_pos: Tensor, key_pos: Tensor, window: int | None, num_sinks: int) -> Tensor:
    """query positions [S], key positions [T] (-1 = empty slot) -> float32 [S, T] in custom_sdpa's form:
    0 where `edgefinfer.model.kv_cache.may_attend` lets a query see a key, -inf elsewhere."""
    allowed = may_attend(query_pos[:, None], key_pos[None, :], window, num_sinks)  # [S, T]
    return torch.where(allowed, 0.0, float("-inf"))


class Call(NamedTuple):
    """Per-forward state shared by every layer, handed to attention in place of the cache argument
    (so no tensor is stashed on a module during export)."""

    cache: "EtStaticCache | EtRingCache"
    start: int | torch.SymInt  # position of the chunk's first token
    masks: dict[int | None, Tensor | None]  # per window: additive [S, T], or None = causal from `start`
    slots: Tensor | None  # ring slots [1, S] of the chunk's tokens

    def mask(self, layer: int) -> Tensor | None:
        return self.masks[self.cache.windows[layer]]


def _layer_windows(config: ModelConfig) -> list[int | None]:
    return [config.window_of(i) for i in range(config.num_hidden_layers)]


class EtStaticCache(nn.Module):
    """One [1, T, Hkv, D] key and value buffer per layer; slot t holds position t."""

    def __init__(self, config: ModelConfig, max_seq_len: int):
        super().__init__()
        self.n_layers = config.num_hidden_layers
        self.max_seq_len = max_seq_len
        # A layer's sliding window shorter than the cache needs an explicit mask; a longer one (or
        # none) is plain causal attention.
        self.windows = [w if w is not None and w < max_seq_len else None for w in _layer_windows(config)]
        distinct = set(self.windows)
        self.window = distinct.pop() if len(distinct) == 1 else None  # the window all layers share, if any
        self.max_chunk = max_seq_len
        shape = (1, max_seq_len, config.num_key_value_heads, config.dim_per_head)
        for i in range(self.n_layers):
            # Separate buffers per layer: update_cache mutates a whole tensor, and ExecuTorch plans
            # each mutable buffer as one state tensor.
            self.register_buffer(f"k_{i}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros(shape), persistent=False)

    def begin(self, positions: Tensor) -> Call:
        """positions: [S], consecutive from the chunk's start position."""
        start = positions[0].item()
        torch._check(start >= 0)
        torch._check(start + positions.shape[0] <= self.max_seq_len)
        masks: dict[int | None, Tensor | None] = {}
        slots = torch.arange(self.max_seq_len, device=positions.device)
        for w in sorted(set(self.windows), key=lambda w: -1 if w is None else w):
            masks[w] = None if w is None else _additive_mask(positions, slots, w, 0)  # [S, T]
        return Call(self, start, masks, None)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: Call, scale: float | None = None) -> Tensor:
        """q [1, S, H, D], k/v [1, S, Hkv, D] (after RoPE) -> [1, S, H, D]; `scale` multiplies q.k
        (None: 1 / sqrt(D))."""
        k_cache, v_cache = getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")
        torch.ops.llama.update_cache(k, k_cache, call.start)
        torch.ops.llama.update_cache(v, v_cache, call.start)
        mask = call.mask(layer)
        if mask is None:
            return torch.ops.llama.custom_sdpa(q, k_cache, v_cache, call.start, None, 0, True, scale)
        return torch.ops.llama.custom_sdpa(q, k_cache, v_cache, 0, mask, 0, False, scale)


class EtRingCache(nn.Module):
    """Sliding-window ring with sinks: [sink 0..N-1 | ring 0..R-1] slots per layer, R = window + lookahead."""

    def __init__(self, config: ModelConfig, window: int, num_sinks: int = 0, lookahead: int | None = None):
        super().__init__()
        if window < 1:
            raise UserError(f"the window must hold at least 1 token, got {window}")
        if num_sinks < 0:
            raise UserError(f"num_sinks must be >= 0, got {num_sinks}")
        lookahead = window if lookahead is None else lookahead
        if lookahead < 0:
            raise UserError(f"lookahead must be >= 0, got {lookahead}")
        self.n_layers = config.num_hidden_layers
        # Each layer: the tighter of its own window and the ring's (a global layer gets the ring's).
        self.windows = [effective_window(w, _RingWindow(window))[0] for w in _layer_windows(config)]
        self.window = window  # what the ring keeps (the runtime's --kv window:N)
        self.num_sinks = num_sinks
        self.lookahead = lookahead
        self.ring = window + lookahead
        self.capacity = num_sinks + self.ring
        self.max_chunk = lookahead + 1  # see the module docstring
        shape = (1, self.capacity, config.num_key_value_heads, config.dim_per_head)
        for i in range(self.n_layers):
            self.register_buffer(f"k_{i}", torch.zeros(shape), persistent=False)
            self.register_buffer(f"v_{i}", torch.zeros(shape), persistent=False)
        # Absolute position held by each slot; -1 = empty. Shared by all layers.
        self.register_buffer("slot_pos", torch.full((self.capacity,), -1, dtype=torch.long), persistent=False)

    def slots(self, positions: Tensor) -> Tensor:
        """Slot [S] of each position: sinks keep theirs, later positions cycle through the ring."""
        ring_slot = self.num_sinks + (positions - self.num_sinks).remainder(self.ring)
        return torch.where(positions < self.num_sinks, positions, ring_slot)

    def begin(self, positions: Tensor) -> Call:
        slots = self.slots(positions)  # [S]
        # Stale entries (rejected speculation, or a previous sequence) sit at positions >= start.
        held = torch.where(self.slot_pos >= positions[:1], -1, self.slot_pos)
        held = held.index_put((slots,), positions)  # [C]
        self.slot_pos.copy_(held)
        masks = {w: _additive_mask(positions, held, w, self.num_sinks) for w in sorted(set(self.windows))}  # [S, C]
        return Call(self, 0, masks, slots[None])  # update_cache_with_indices wants slots [B, S]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: Call, scale: float | None = None) -> Tensor:
        k_cache, v_cache = getattr(self, f"k_{layer}"), getattr(self, f"v_{layer}")
        torch.ops.llama.update_cache_with_indices(k, k_cache, 0, call.slots)
        torch.ops.llama.update_cache_with_indices(v, v_cache, 0, call.slots)
        return torch.ops.llama.custom_sdpa(q, k_cache, v_cache, 0, call.mask(layer), 0, False, scale)


class _RingWindow(NamedTuple):
    """What `effective_window` reads of a cache: its window."""

    window: int


EtCache = EtStaticCache | EtRingCache


class CustomOpAttention(nn.Module):
    """`Attention` with its core (cache write, mask, SDPA) done by ExecuTorch's custom ops.

    Projections, q/k norms and RoPE are the original module's `project_qkv` (same parameters, same
    arithmetic), which leaves heads in [B, S, H, D], the layout the custom ops read, so no transposes
    are needed around the cache. The window is the cache's per-layer choice (see `Call.mask`).
    """

    def __init__(self, attn: Attention):
        super().__init__()
        self.attn = attn  # shared with the original model: its parameters, norms and RoPE
        self.layer_idx = attn.layer_idx
        self.n_heads, self.head_dim = attn.n_heads, attn.head_dim
        self.window, self.rope, self.scale = attn.window, attn.rope, attn.scale

    # The original module's projections (shared, registered once under `attn`).
    q_proj = property(lambda self: self.attn.q_proj)
    k_proj = property(lambda self: self.attn.k_proj)
    v_proj = property(lambda self: self.attn.v_proj)
    o_proj = property(lambda self: self.attn.o_proj)

    def forward(self, x: Tensor, ropes: RopeTables, input_pos: Tensor, call: Call) -> Tensor:
        """Same signature as `Attention.forward`; `call` is the forward's `Call` (see ExportableLM)."""
        B, S, _ = x.shape
        q, k, v = self.attn.project_qkv(x, ropes)  # [B, S, H | Hkv, D]
        y = call.cache.attend(self.layer_idx, q, k, v, call, self.scale)  # [B, S, H, D]
        return self.o_proj(y.reshape(B, S, self.n_heads * self.head_dim))


class ExportableLM(nn.Module):
    """forward(tokens [1, S] int64, input_pos [1] int64 = the first position) -> logits float32.

    The signature ExecuTorch's LLM runners call. Logits are [1, S, vocab] for every new position
    (speculative verification needs them all) or [1, 1, vocab] for the last one when
    `all_logits=False` (a prefill then skips the output head for the other positions).

    `cache` is an `EtStaticCache` / `EtRingCache` (custom-op attention, `swap_attention` applied),
    or a plain `edgefinfer` cache (`StaticCache`, `SlidingWindowCache`) used by the unmodified model.
    """

    def __init__(self, model: Transformer, cache: nn.Module, all_logits: bool = True):
        super().__init__()
        self.model = model
        self.cache = cache
        self.all_logits = all_logits

    def forward(self, tokens: Tensor, input_pos: Tensor) -> Tensor:
        S = tokens.shape[1]
        positions = input_pos[:1] + torch.arange(S, device=tokens.device)  # [S]
        if isinstance(self.cache, (EtStaticCache, EtRingCache)):
            # The layers hand their cache argument to attention: here the forward's Call.
            h = self.model.hidden_states(tokens, positions[None], self.cache.begin(positions))[-1]
        else:
            h = self.model.hidden_states(tokens, positions[None], self.cache)[-1]
        if not self.all_logits:
            h = h[:, -1:]
        return self.model.lm_head(h)  # [1, S or 1, vocab]


def swap_attention(model: Transformer) -> Transformer:
    """A shallow copy of `model` whose attention modules use ExecuTorch's custom ops (they then take
    a `Call` from `EtStaticCache.begin` / `EtRingCache.begin` as their cache argument).

    Parameters are shared with `model` (nothing is copied); `model` itself is left untouched.
    """
    load_custom_ops()
    out = copy.copy(model)
    out._modules = dict(model._modules)
    out.model = copy.copy(model.model)
    out.model._modules = dict(model.model._modules)
    layers = []
    for layer in model.model.layers:
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        new.self_attn = CustomOpAttention(layer.self_attn)
        layers.append(new)
    out.model.layers = nn.ModuleList(layers)
    return out
