"""Our modules' weights in the layouts ONNX Runtime's kernels take.

A linear becomes either a float `MatMul` operand (W^T, [K, N]) or the inputs of a
`com.microsoft.MatMulNBits` node. Integer weights come from `edgefinfer.compile.quant`'s modules
(`QuantLinear` / `QuantEmbedding`) through its `to_matmulnbits` re-packing, which only moves bits:
the ONNX graph holds exactly the codes, scales and zero points of the eager quantized model.

Two cases `to_matmulnbits` does not cover are handled here without changing a single dequantized
value:
* per-channel groups (one group per row, recipe `int8`): MatMulNBits needs a power-of-two block,
  so the row's one scale is repeated over blocks of the largest power of two dividing K;
* packed projections (q|k|v): layers with the same format are concatenated along N.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from edgefinfer.compile.quant.layouts import MatMulNBitsWeights, to_matmulnbits
from edgefinfer.compile.quant.modules import Fp8Linear, QuantEmbedding, QuantLinear
from edgefinfer.compile.quant.primitives import IntWeights
from edgefinfer.errors import UserError


@dataclass(frozen=True)
class FloatLinear:
    w_t: np.ndarray  # [K, N], the MatMul right operand
    bias: np.ndarray | None  # [N]


@dataclass(frozen=True)
class NBitsLinear:
    mm: MatMulNBitsWeights
    bias: np.ndarray | None  # [N]
    # A float zero point's group offsets m [N, G] (`QuantLinear.offset_split`): the graph adds
    # group_sums(x) [.., G] @ m^T to MatMulNBits' symmetric product. None: no offsets.
    offsets: np.ndarray | None = None


LinearSpec = FloatLinear | NBitsLinear


@dataclass(frozen=True)
class FloatEmbedding:
    table: np.ndarray  # [V, D]


@dataclass(frozen=True)
class QuantTable:
    """A GatherBlockQuantized table: uint8 codes packed low bits first along D (MatMulNBits' B, flat)."""

    mm: MatMulNBitsWeights  # B [V, k_blocks, blob]; its scales [V, k_blocks]


EmbeddingSpec = FloatEmbedding | QuantTable


def _np(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy().astype(dtype)


def _matmulnbits_block(k: int) -> int:
    """The largest power of two in [16, 256] dividing k (per-channel rows are re-blocked to it)."""
    for block in (256, 128, 64, 32, 16):
        if k % block == 0:
            return block
    raise UserError(f"a per-channel quantized layer with {k} input features cannot be written as MatMulNBits "
                    "(K must be a multiple of 16); re-quantize with a -g32 recipe")


def nbits_weights(module: QuantLinear | QuantEmbedding, scale_dtype: np.dtype) -> MatMulNBitsWeights:
    """MatMulNBits inputs for a quantized module, re-blocking per-channel groups."""
    n, k = module.qweight.shape
    g = module.group_size
    if g > 256 or g < 16 or g & (g - 1):  # per-channel (g == K) or a block MLAS has no kernel for
        if g != k:
            raise UserError(f"group size {g} cannot be written as MatMulNBits (a power of two in 16..256); "
                            "re-quantize with a -g32/-g64/-g128 recipe")
        block = _matmulnbits_block(k)
        reps = k // block
        fmt = replace(module.fmt, group_size=block)
        blocked = QuantLinear(k, n, fmt)  # a throwaway holder: same codes, the row's scale per block
        blocked.set_weights(IntWeights(module.qweight, module.scales.repeat_interleave(reps, 1),
                                       module.zeros.repeat_interleave(reps, 1)))
        module = blocked
    return to_matmulnbits(module, scale_dtype)


def linear_spec(module: nn.Module, float_dtype: np.dtype, name: str) -> LinearSpec:
    bias = getattr(module, "bias", None)
    bias_np = None if bias is None else _np(bias, float_dtype)
    if isinstance(module, QuantLinear):
        offsets = _np(module.offset_split()[1], float_dtype) if module.fmt.float_zero else None
        return NBitsLinear(nbits_weights(module, float_dtype), bias_np, offsets)
    if isinstance(module, Fp8Linear):
        raise UserError(f"{name} is fp8, which ONNX Runtime's CPU kernels do not run; "
                        "quantize with an int4/int8 recipe for the ONNX target (fp8 is for the GPU server)")
    if isinstance(module, nn.Linear):
        return FloatLinear(np.ascontiguousarray(_np(module.weight, float_dtype).T), bias_np)
    raise UserError(f"{name} is a {type(module).__name__}, which the ONNX exporter does not know")


def embedding_spec(module: nn.Module, float_dtype: np.dtype) -> EmbeddingSpec:
    if isinstance(module, QuantEmbedding):
        return QuantTable(nbits_weights(module, float_dtype))
    return FloatEmbedding(_np(module.weight, float_dtype))


def _bias_or_zeros(spec: LinearSpec, n: int, dtype: np.dtype) -> np.ndarray:
    return spec.bias if spec.bias is not None else np.zeros(n, dtype)


def _default_zero_points(mm: MatMulNBitsWeights) -> np.ndarray:
    """Packed zero points equal to MatMulNBits' implicit default 2^(bits-1)."""
    k_blocks = mm.scales.shape[1]
    per_byte = 8 // mm.bits
    z = 1 << (mm.bits - 1)
    byte = sum(z << (i * mm.bits) for i in range(per_byte)) & 0xFF
    return np.full((mm.N, -(-k_blocks // per_byte)), byte, np.uint8)


def concat_linears(specs: list[LinearSpec]) -> LinearSpec | None:
    """One linear computing all of `specs` side by side ([..., sum N]); None when formats differ."""
    first = specs[0]
    if any(type(s) is not type(first) for s in specs):
        return None
    biases = None
    if any(s.bias is not None for s in specs):
        dtype = next(s.bias for s in specs if s.bias is not None).dtype
        widths = [s.w_t.shape[1] if isinstance(s, FloatLinear) else s.mm.N for s in specs]
        biases = np.concatenate([_bias_or_zeros(s, n, dtype) for s, n in zip(specs, widths)])
    if isinstance(first, FloatLinear):
        if any(s.w_t.dtype != first.w_t.dtype or s.w_t.shape[0] != first.w_t.shape[0] for s in specs):
            return None
        return FloatLinear(np.concatenate([s.w_t for s in specs], axis=1), biases)
    mms = [s.mm for s in specs]
    if any((m.bits, m.block_size, m.K) != (first.mm.bits, first.mm.block_size, first.mm.K) for m in mms):
        return None
    offsets = None
    if any(s.offsets is not None for s in specs):  # group offsets stack along N when all have them alike
        if any(s.offsets is None or s.offsets.shape[1] != first.offsets.shape[1] for s in specs):
            return None
        offsets = np.concatenate([s.offsets for s in specs])
    zps = None
    if any(m.zero_points is not None for m in mms):
        zps = np.concatenate([m.zero_points if m.zero_points is not None else _default_zero_points(m) for m in mms])
    mm = replace(first.mm, B=np.concatenate([m.B for m in mms]), scales=np.concatenate([m.scales for m in mms]),
                 zero_points=zps, N=sum(m.N for m in mms))
    return NBitsLinear(mm, biases, offsets)


def unpacked_zero_points(mm: MatMulNBitsWeights) -> np.ndarray | None:
    """Zero points as uint8 [N, k_blocks], one per byte (None when MatMulNBits' default applies)."""
    if mm.zero_points is None:
        return None
    k_blocks = mm.scales.shape[1]
    shifts = np.arange(8 // mm.bits, dtype=np.uint8) * mm.bits
    values = (mm.zero_points[..., None] >> shifts) & ((1 << mm.bits) - 1)  # low bits first
    return values.reshape(mm.N, -1)[:, :k_blocks].astype(np.uint8)


def shares_codes(a: nn.Module, b: nn.Module) -> bool:
    """True when two quantized modules hold the same codes (a tied head made by `tied_head`)."""
    qa, qb = getattr(a, "qweight", None), getattr(b, "qweight", None)
    return qa is not None and qb is not None and qa.data_ptr() == qb.data_ptr() and qa.shape == qb.shape
