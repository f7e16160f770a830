"""Export-time fusion of the projections that read one input: q|k|v and gate|up.

    fused = fuse_projections(copy.deepcopy(model))   # in place; the checkpoint layout is untouched

Three linears over the same activations cost three kernel calls, three dynamic quantizations of the
input (8da4w) and, for a float zero point, three group-sum reductions; one linear over the stacked
rows costs one of each, and the same arithmetic row for row (rows of a quantized matrix are
independent: codes, scales and zero points stack along the output dimension). The model's own
`Attention.projections` / `MLP.forward` split the fused output back. Fewer, larger nodes also
shorten ExecuTorch's lowering, whose passes retrace the graph node by node.

Layers whose projections differ in format (a mixed-precision recipe) are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from edgefinfer.compile.quant.modules import QuantLinear
from edgefinfer.model.transformer import Transformer


def stack_rows(linears: list[nn.Module]) -> nn.Module | None:
    """One linear computing the concatenated outputs of `linears` (all reading the same input), or
    None when their formats differ."""
    first = linears[0]
    if all(type(m) is nn.Linear for m in linears):
        out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                        device="meta")
        if any((m.bias is None) != (first.bias is None) for m in linears):
            return None
        out.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
        if first.bias is not None:
            out.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
        return out
    if not all(type(m) is QuantLinear for m in linears):
        return None
    same = all(m.fmt == first.fmt and m.group_size == first.group_size and m.act_quant == first.act_quant
               and m.act_split == first.act_split and (m.bias is None) == (first.bias is None)
               and _same_cols(m.float_cols, first.float_cols) for m in linears)
    if not same:
        return None
    out = QuantLinear(first.in_features, sum(m.out_features for m in linears), first.fmt, first.bias is not None,
                      first.act_quant, act_split=first.act_split)
    if first.float_cols is not None:
        out.register_buffer("float_cols", first.float_cols.clone())
    out.qweight = torch.cat([m.qweight for m in linears])
    out.scales = torch.cat([m.scales for m in linears])
    out.zeros = torch.cat([m.zeros for m in linears])
    if first.bias is not None:
        out.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return out


def _same_cols(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two linears keep the same input channels float (`QuantLinear.float_cols`)."""
    return (a is None) == (b is None) and (a is None or torch.equal(a, b))


def fuse_projections(model: Transformer) -> Transformer:
    """Stack q|k|v and gate|up of every layer (in place); returns `model`."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = stack_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            attn.qkv_proj = qkv
            for name in ("q_proj", "k_proj", "v_proj"):
                del attn._modules[name]
        gate_up = stack_rows([mlp.gate_proj, mlp.up_proj])
        if gate_up is not None:
            mlp.gate_up_proj = gate_up
            for name in ("gate_proj", "up_proj"):
                del mlp._modules[name]
    return model
