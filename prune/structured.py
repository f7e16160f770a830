"""Structured pruning: physically remove attention heads, MLP channels and whole decoder layers.

The result is a smaller model of the same family with a new config, saved as an ordinary HF folder.

**Importance** (one dense calibration pass, activation-based as in Minitron):
- a query head's score is the squared norm, summed over calibration tokens, of its contribution to the
  attention output, ||Y_h W_o[:, h]^T||^2 (Y_h: the head's attention output, W_o[:, h]: its o_proj
  columns); a KV group's score is the sum over the query heads that read it;
- an MLP channel's score is the squared norm of its contribution to the MLP output,
  ||a_c||^2 * ||W_down[:, c]||^2 (a_c = silu(gate_c) * up_c over all tokens): exact, since the
  contribution is the outer product a_c W_down[:, c]^T;
- a layer's score is the mean angular distance angle(x_in, x_out) / pi between the residual
  stream before and after it (per token): a layer that barely turns the stream is the cheapest to drop
  (Gromov et al. 2024; "block influence" 1 - cos in ShortGPT orders layers almost the same way).

**GQA**: HF configs are uniform across layers and every KV head must serve the same number of query
heads, so the pruned shape is (kv_heads, heads_per_group) for all layers. Both ways to shrink are
supported and may be combined: drop whole groups (a KV head with its query heads) and drop query heads
within each group, keeping groups equal. Each layer picks its own groups, heads and channels.

**Budget**: `solve_budget` turns a parameter budget into an exact architecture: layers and heads are
whatever the caller fixes (default: all kept) and the MLP width is the largest multiple of
`multiple_of` that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edgefinfer.model.config import ModelConfig
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.calibration import LayerwiseRunner


# ---- architecture ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """What a structured prune keeps (uniform over layers, as HF configs require)."""

    layers: int
    kv_heads: int
    heads: int  # query heads; a multiple of kv_heads
    intermediate_size: int

    @classmethod
    def of(cls, config: ModelConfig) -> "Shape":
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads,
                   config.intermediate_size)


def check_shape(config: ModelConfig, shape: Shape) -> None:
    """Raise a one-line UserError unless `shape` is reachable from `config` by removing structure."""
    full = Shape.of(config)
    group = config.num_attention_heads // config.num_key_value_heads
    if not 1 <= shape.layers <= full.layers:
        raise UserError(f"keep between 1 and {full.layers} layers, got {shape.layers}")
    if not 1 <= shape.kv_heads <= full.kv_heads:
        raise UserError(f"keep between 1 and {full.kv_heads} KV heads, got {shape.kv_heads}")
    if shape.heads % shape.kv_heads or not shape.kv_heads <= shape.heads <= shape.kv_heads * group:
        allowed = ", ".join(str(shape.kv_heads * r) for r in range(1, group + 1))
        raise UserError(
            f"{shape.heads} query heads break the GQA groups: each of the {shape.kv_heads} kept KV heads must "
            f"keep the same number of its {group} query heads, so use one of {allowed}")
    if not 1 <= shape.intermediate_size <= full.intermediate_size:
        raise UserError(f"keep between 1 and {full.intermediate_size} MLP channels, got {shape.intermediate_size}")


def pruned_config(config: ModelConfig, shape: Shape, layers: list[int] | None = None) -> ModelConfig:
    """The config of `shape`; `layers` are the kept layers' indices (default the first ones), whose
    per-layer features (attention type, RoPE) the pruned model keeps."""
    check_shape(config, shape)
    config = config.keep_layers(layers if layers is not None else list(range(shape.layers)))
    # head_dim is pinned: hidden_size / heads no longer gives it once heads are removed.
    return config.replace(num_key_value_heads=shape.kv_heads,
                          num_attention_heads=shape.heads, intermediate_size=shape.intermediate_size,
                          head_dim=config.dim_per_head)


def parse_budget(budget: float | str, config: ModelConfig) -> int:
    """'0.5' -> half the parameters; '60M' / '60000000' -> an absolute count."""
    text = str(budget).strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}.get(text[-1:], 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise UserError(f"parameter budget must be a fraction (0.5) or a count (60M), got {budget!r}") from None
    params = int(value * config.num_parameters()) if value <= 1.0 else int(value)
    if params <= 0:
        raise UserError(f"parameter budget must be positive, got {budget!r}")
    return params


def solve_budget(config: ModelConfig, params: int, layers: int | None = None, kv_heads: int | None = None,
                 heads: int | None = None, multiple_of: int = 32) -> Shape:
    """The shape with the fixed parts given and the widest MLP (a multiple of `multiple_of`) within `params`."""
    full = Shape.of(config)
    kv = full.kv_heads if kv_heads is None else kv_heads
    if heads is None:  # keep every query head of the kept groups
        heads = kv * (config.num_attention_heads // config.num_key_value_heads)
    base = Shape(full.layers if layers is None else layers, kv, heads, full.intermediate_size)
    check_shape(config, base)
    if multiple_of <= 0:
        raise UserError(f"multiple_of must be positive, got {multiple_of}")
    # Parameters are affine in the MLP width f: P(f) = P(0) + f * per_channel.
    at_zero = pruned_config(config, base).replace(intermediate_size=0).num_parameters()
    per_channel = (3 * config.hidden_size + 2 * config.mlp_bias) * base.layers
    width = min((params - at_zero) // per_channel // multiple_of * multiple_of, full.intermediate_size)
    if width < multiple_of:
        raise UserError(
            f"a budget of {params:,} parameters leaves no MLP channels with {base.layers} layers and "
            f"{base.heads}/{base.kv_heads} heads (that alone is {at_zero + per_channel * multiple_of:,}); "
            "keep fewer layers (--layers) or heads (--heads/--kv-heads), or raise the budget")
    return Shape(base.layers, base.kv_heads, base.heads, int(width))


# ---- importance -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Importance:
    heads: Tensor  # [L, H] squared contribution norm of each query head
    channels: Tensor  # [L, F] squared contribution norm of each MLP channel
    layer_distance: Tensor  # [L] mean angular distance between a layer's input and output, in [0, 1]

    def groups(self, n_kv: int) -> Tensor:
        """[L, Hkv] score of each KV group: the sum over its query heads."""
        L, H = self.heads.shape
        return self.heads.view(L, n_kv, H // n_kv).sum(-1)


def angular_distance(x_in: Tensor, x_out: Tensor) -> Tensor:
    """Mean over tokens of angle(x_in, x_out) / pi; inputs [..., d].

    Computed as 2 atan2(|a - b|, |a + b|) on the unit vectors rather than arccos(a . b): arccos loses
    half its digits near cos = 1, exactly where the layers worth dropping are.
    """
    a = torch.nn.functional.normalize(x_in.float(), dim=-1)
    b = torch.nn.functional.normalize(x_out.float(), dim=-1)
    angle = 2 * torch.atan2((a - b).norm(dim=-1), (a + b).norm(dim=-1))  # [...] in [0, pi]
    return (angle / torch.pi).mean()


@torch.no_grad()
def importance(model: Transformer, blocks: Tensor, chunk: int = 8) -> Importance:
    """Head, channel and layer scores of the dense model on calibration blocks [N, S]."""
    cfg = model.config
    D, H = cfg.dim_per_head, cfg.num_attention_heads
    runner = LayerwiseRunner(model, blocks, chunk)
    heads, channels, distance = [], [], []
    for _, layer in runner.layers():
        head_sq = torch.zeros(H, dtype=torch.float64)
        chan_sq = torch.zeros(cfg.intermediate_size, dtype=torch.float64)
        w_o = layer.self_attn.o_proj.weight.float()  # [d, H*D]

        def on_o_proj(_m, args):
            y = args[0].float().reshape(-1, H, D)  # [tokens, H, D]
            for h in range(H):
                head_sq[h] += (y[:, h] @ w_o[:, h * D:(h + 1) * D].T).pow(2).sum().double()

        def on_down_proj(_m, args):
            chan_sq.add_(args[0].float().reshape(-1, args[0].shape[-1]).pow(2).sum(0, dtype=torch.float64))

        hooks = [layer.self_attn.o_proj.register_forward_pre_hook(on_o_proj),
                 layer.mlp.down_proj.register_forward_pre_hook(on_down_proj)]
        try:
            x_in = runner.x
            runner.advance(layer)
        finally:
            for hook in hooks:
                hook.remove()
        heads.append(head_sq.float())
        channels.append((chan_sq * layer.mlp.down_proj.weight.double().pow(2).sum(0)).float())
        distance.append(angular_distance(x_in, runner.x))
    return Importance(torch.stack(heads), torch.stack(channels), torch.stack(distance))


# ---- physical removal -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Kept:
    """Indices into the original model of everything the pruned model keeps (sorted)."""

    layers: list[int]
    kv_heads: list[list[int]]  # per kept layer
    heads: list[list[int]]  # per kept layer, query heads in the original numbering
    channels: list[list[int]]  # per kept layer


def select(config: ModelConfig, imp: Importance, shape: Shape) -> Kept:
    """Keep the highest-scoring layers, groups, heads within groups and channels; original order kept."""
    check_shape(config, shape)
    n_kv = config.num_key_value_heads
    group = config.num_attention_heads // n_kv
    per_group = shape.heads // shape.kv_heads
    layers = _top(imp.layer_distance, shape.layers)
    kv_heads, heads, channels = [], [], []
    group_scores = imp.groups(n_kv)
    for i in layers:
        groups = _top(group_scores[i], shape.kv_heads)
        kv_heads.append(groups)
        heads.append([g * group + h for g in groups
                      for h in _top(imp.heads[i, g * group:(g + 1) * group], per_group)])
        channels.append(_top(imp.channels[i], shape.intermediate_size))
    return Kept(layers, kv_heads, heads, channels)


def _top(scores: Tensor, k: int) -> list[int]:
    return sorted(scores.topk(k).indices.tolist())


def _rows(heads: list[int], dim: int) -> Tensor:
    """Row indices of a projection's output for the given heads (each head owns `dim` rows)."""
    return (torch.tensor(heads)[:, None] * dim + torch.arange(dim)[None]).flatten()


def prune_to(model: Transformer, kept: Kept) -> Transformer:
    """A new, smaller Transformer holding exactly the kept structure of `model`."""
    cfg = model.config
    D = cfg.dim_per_head
    shape = Shape(len(kept.layers), len(kept.kv_heads[0]), len(kept.heads[0]), len(kept.channels[0]))
    new_cfg = pruned_config(cfg, shape, kept.layers)
    src = model.state_dict()
    state: dict[str, Tensor] = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for new_i, old_i in enumerate(kept.layers):
        old, new = f"model.layers.{old_i}.", f"model.layers.{new_i}."
        q_rows, kv_rows = _rows(kept.heads[new_i], D), _rows(kept.kv_heads[new_i], D)
        ch = torch.tensor(kept.channels[new_i])
        rows_of = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
                   "mlp.gate_proj": ch, "mlp.up_proj": ch}
        cols_of = {"self_attn.o_proj": q_rows, "mlp.down_proj": ch}
        for key, value in src.items():
            if not key.startswith(old):
                continue
            name = key[len(old):]
            module = name.rsplit(".", 1)[0]
            if module in rows_of:  # weight [out, in] and bias [out]: select output rows
                value = value.index_select(0, rows_of[module])
            elif module in cols_of and name.endswith("weight"):  # select input columns
                value = value.index_select(1, cols_of[module])
            state[new + name] = value.clone()
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    with torch.device(device):
        pruned = Transformer(new_cfg).to(dtype)
    pruned.load_state_dict(state, strict=True)
    return pruned.eval()


def prune_structured(model: Transformer, blocks: Tensor, shape: Shape, chunk: int = 8) -> tuple[Transformer, Kept]:
    """Score on calibration blocks, select and remove: the Minitron-style width/depth prune."""
    check_shape(model.config, shape)
    kept = select(model.config, importance(model, blocks, chunk), shape)
    return prune_to(model, kept), kept


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters actually held (tied tensors counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
