"""Re-packing quantized modules into the layouts the exporters write, without re-quantizing.

Every function here only moves bits: codes, scales and zero points come from the module unchanged,
so the exported weights dequantize to exactly the eager model's weights (tests check it bit for bit
against gguf-py's dequantizer, onnxruntime's MatMulNBits kernel and torchao's tensor).

* ONNX Runtime `com.microsoft.MatMulNBits` (`to_matmulnbits`; `matmulnbits_reference` is a numpy
  re-statement of ORT's documented semantics):
    B            uint8 [N, k_blocks, block_size * bits / 8], codes unsigned (code + 2^(bits-1)),
                 packed low bits first along K (4-bit: element 2j in the low nibble of byte j);
    scales       float [N, k_blocks];
    zero_points  uint8 [N, ceil(k_blocks * bits / 8)], unsigned, packed the same way; omitted when
                 every zero point is 2^(bits-1), ORT's default (our symmetric formats);
    y = A @ ((code - zero_point) * scale)^T, block_size a power of two >= 16.
  A float zero point (`-fzp`) is written as its symmetric part (zero_points omitted) plus per-group
  offsets that the exporter adds as a small float MatMul over the activations' group sums
  (`QuantLinear.offset_split`): ORT 1.31 does take float zero_points, but only on an unpacked
  fallback that dequantizes B on every call (measured: 3.1 ms against 47 us for one 576 x 1536 decode
  matmul, 1 thread), while the split keeps MatMulNBits' packed int8-compute kernel.
* GGUF `Q4_0` / `Q4_1` / `Q8_0` (`to_gguf_q4_0`, `to_gguf_q4_1`, `to_gguf_q8_0`): blocks of 32 along K,
  each an fp16 `d` followed by the codes: Q4_0 stores 16 bytes, byte j = (q[j] + 8) | (q[j + 16] + 8) << 4
  and decodes (nibble - 8) * d; Q4_1 stores d, an fp16 `m`, then the same 16 bytes, and decodes
  nibble * d + m, so asymmetric codes map with m = -d * (zero + 8) (exact: `primitives` chooses such
  scales; a float zero point's m is its fp16 group minimum, recovered from z); Q8_0 stores 32 int8 and decodes q * d. Only group-32 formats map (int4 either way, int8
  symmetric); others raise a UserError naming the recipe that fits.
* torchao / ExecuTorch XNNPACK 8da4w (`to_torchao`, `torchao_model`): `IntxUnpackedToInt8Tensor`
  holds the same int8 codes, scales and int8 zero points; with `act_quant` it carries
  `int8_asym_per_token` activation quantization, which XNNPACK lowers to its dynamically quantized
  linear. XNNPACK's 4-bit kernels want symmetric weights (the 8da4w recipes are); a float zero point
  (8da4w-*-fzp) becomes `OffsetLinear`: its symmetric part on XNNPACK's kernel plus a float linear
  over the input's group sums (`QuantLinear.offset_split`), ordinary ops that every runner has. A
  split activation (`act_split`) becomes `OutlierSplitLinear`: two rows per token through the same
  dynamically quantized linear; float input channels (`float_cols`) become `FloatChannelsLinear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from edgefinfer.compile.quant.modules import QuantEmbedding, QuantLinear, _IntStorage
from edgefinfer.compile.quant.primitives import CLIP_TOP
from edgefinfer.errors import UserError

MATMULNBITS_BITS = (2, 4, 8)
GGUF_BLOCK = 32


# ---- ONNX Runtime MatMulNBits -----------------------------------------------------------------------

@dataclass(frozen=True)
class MatMulNBitsWeights:
    B: np.ndarray  # uint8 [N, k_blocks, blob_size]
    scales: np.ndarray  # float32 (or float16) [N, k_blocks]
    zero_points: np.ndarray | None  # uint8 [N, ceil(k_blocks * bits / 8)], None = the default 2^(bits-1)
    K: int
    N: int
    bits: int
    block_size: int

    @property
    def attributes(self) -> dict[str, int]:
        return {"K": self.K, "N": self.N, "bits": self.bits, "block_size": self.block_size}


def _pack_low_first(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., L] holding `bits`-bit values -> uint8 [..., ceil(L * bits / 8)], element i of each
    byte's run in bits [i*bits, (i+1)*bits)."""
    per_byte = 8 // bits
    L = values.shape[-1]
    pad = (-L) % per_byte
    v = np.concatenate([values, np.zeros((*values.shape[:-1], pad), np.uint8)], -1) if pad else values
    v = v.reshape(*v.shape[:-1], -1, per_byte).astype(np.uint16)
    shifts = (np.arange(per_byte, dtype=np.uint16) * bits)
    return (v << shifts).sum(-1).astype(np.uint8)


def _unpack_low_first(packed: np.ndarray, bits: int, length: int) -> np.ndarray:
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    v = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*packed.shape[:-1], -1)[..., :length].astype(np.uint8)


def to_matmulnbits(module: _IntStorage, scale_dtype: np.dtype = np.float32) -> MatMulNBitsWeights:
    """The inputs and attributes of a MatMulNBits node computing `module` (a QuantLinear); for a float
    zero point, its symmetric part q * d (the offsets come from `module.offset_split()`)."""
    bits, g = module.fmt.bits, module.group_size
    N, K = module.qweight.shape
    if bits not in MATMULNBITS_BITS:
        raise UserError(f"MatMulNBits takes {MATMULNBITS_BITS}-bit weights, this layer has {bits}")
    if g < 16 or g & (g - 1):
        raise UserError(f"MatMulNBits needs a power-of-two block size >= 16, this layer has {g} "
                        "(per-channel needs K to be one); re-quantize with a -g32/-g64/-g128 recipe")
    offset = 1 << (bits - 1)
    codes = (module.qweight.numpy().astype(np.int16) + offset).astype(np.uint8)  # [N, K] in [0, 2^bits)
    k_blocks = K // g
    B = _pack_low_first(codes.reshape(N, k_blocks, g), bits)  # [N, k_blocks, g * bits / 8]
    scales = module.scales.numpy().astype(scale_dtype)
    if module.fmt.float_zero:
        return MatMulNBitsWeights(B, scales, None, K, N, bits, g)
    zeros = module.zeros.numpy().astype(np.int16) + offset  # [N, k_blocks]
    zero_points = None if np.all(zeros == offset) else _pack_low_first(zeros.astype(np.uint8), bits)
    return MatMulNBitsWeights(B, scales, zero_points, K, N, bits, g)


def matmulnbits_reference(w: MatMulNBitsWeights) -> np.ndarray:
    """Dequantized B [N, K] float32 as ORT's MatMulNBits defines it: (code - zero_point) * scale."""
    N, k_blocks, _ = w.B.shape
    g = w.block_size
    codes = _unpack_low_first(w.B, w.bits, g).astype(np.float32)  # [N, k_blocks, g]
    if w.zero_points is None:
        zp = np.full((N, k_blocks), 1 << (w.bits - 1), np.float32)
    else:
        zp = _unpack_low_first(w.zero_points, w.bits, k_blocks).astype(np.float32)
    deq = (codes - zp[..., None]) * w.scales.astype(np.float32)[..., None]
    return deq.reshape(N, k_blocks * g)[:, : w.K]


# ---- GGUF Q4_0 / Q4_1 / Q8_0 ------------------------------------------------------------------------

# GGUF type -> (bits, symmetric, the recipe that produces it).
GGUF_FORMATS = {"Q4_0": (4, True, "int4-g32-sym"), "Q4_1": (4, False, "int4-g32 or int4-g32-fzp"),
                "Q5_0": (5, True, "int5-g32-sym (a source GGUF's Q5_0 matrices, kept by `build`)"),
                "Q8_0": (8, True, "int8-g32")}


# K-quant formats (`WeightFormat.super_block`) -> GGUF type.
GGUF_K_FORMATS = {(4, 32, True): "Q4_K", (5, 32, True): "Q5_K", (6, 16, False): "Q6_K"}  # (bits, group, float zero)


def gguf_type_of(fmt, group_size: int | None) -> str | None:
    """The GGUF type holding a layer of format `fmt` (bit for bit; a float zero point's minimum within
    float32 rounding), or None. Q4_1's minimum is a float, so both asymmetric int4 kinds map onto it."""
    if fmt is not None and fmt.kind == "int" and fmt.super_block:
        return GGUF_K_FORMATS.get((fmt.bits, group_size, fmt.float_zero))
    if fmt is None or fmt.kind != "int" or group_size != GGUF_BLOCK:
        return None
    if fmt.float_zero and fmt.bits != 4:
        return None
    return next((t for t, (bits, sym, _) in GGUF_FORMATS.items() if (bits, sym) == (fmt.bits, fmt.symmetric)), None)


def _check_gguf(module: _IntStorage, type_name: str) -> None:
    bits, symmetric, recipe = GGUF_FORMATS[type_name]
    fmt = module.fmt
    if gguf_type_of(fmt, module.group_size) != type_name:
        kind = "symmetric" if symmetric else "asymmetric"
        raise UserError(f"GGUF {type_name} is {kind} {bits}-bit in blocks of 32; this layer is "
                        f"{fmt.label()}: quantize with recipe {recipe}")


def _nibbles(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 32, 16]: unsigned 4-bit codes, byte j = q[j] | q[j + 16] << 4 (ggml's order)."""
    N, K = module.qweight.shape
    q = (module.qweight.numpy().astype(np.int16) + 8).astype(np.uint8).reshape(N, K // GGUF_BLOCK, GGUF_BLOCK)
    return q[..., :16] | (q[..., 16:] << 4)


def _fp16_bytes(values: torch.Tensor | np.ndarray, n: int, nb: int) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).astype(np.float16).reshape(n, nb, 1).view(np.uint8)  # [N, nb, 2]


def to_gguf_q4_0(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 32 * 18]: the tensor's bytes as gguf-py's `quantize(..., Q4_0)` lays them out."""
    _check_gguf(module, "Q4_0")
    N, K = module.qweight.shape
    nb = K // GGUF_BLOCK
    return np.concatenate([_fp16_bytes(module.scales.numpy(), N, nb), _nibbles(module)], -1).reshape(N, nb * 18)


def to_gguf_q4_1(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 32 * 20]: d, m = -d * (zero + 8), then the nibbles; decodes nibble * d + m,
    which is (code - zero) * d exactly because m is an fp16 value (checked: a scale chosen elsewhere
    could break it, and then the file would not hold our weights)."""
    _check_gguf(module, "Q4_1")
    N, K = module.qweight.shape
    nb = K // GGUF_BLOCK
    d = module.scales.float()
    m = -d * (module.zeros.float() + 8)
    if module.fmt.float_zero:  # z = -8 - m16 / d: the product recovers m16 to far within half an fp16 step
        m16 = m.half().float()
        if not torch.all((m16 - m).abs() <= m.abs() * 2.0**-16 + 2.0**-30):
            raise UserError("these float zero points are not fp16 group minima; re-quantize with this version "
                            "of edgefinfer")
        m = m16
    elif not torch.equal(m.half().float(), m):
        raise UserError("these asymmetric int4 scales cannot hold their zero point in GGUF Q4_1's fp16 minimum; "
                        "re-quantize with this version of edgefinfer (it chooses scales that can)")
    return np.concatenate([_fp16_bytes(d.numpy(), N, nb), _fp16_bytes(m.numpy(), N, nb), _nibbles(module)],
                          -1).reshape(N, nb * 20)


def to_gguf_q5_0(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 32 * 22]: fp16 d (negative where the group's largest magnitude is positive, as
    llama.cpp writes it), 32 fifth bits as a little-endian uint32 (bit j: code j, bit j + 16: code
    j + 16), then the low nibbles in Q4_0's order; decodes d * (u - 16) for u = code + 16."""
    _check_gguf(module, "Q5_0")
    N, K = module.qweight.shape
    nb = K // GGUF_BLOCK
    u = (module.qweight.numpy().astype(np.int16) + 16).astype(np.uint32).reshape(N, nb, GGUF_BLOCK)
    high = ((u >> 4) & 1) << np.arange(GGUF_BLOCK, dtype=np.uint32)  # [N, nb, 32]
    qh = np.bitwise_or.reduce(high, axis=-1).astype("<u4")[..., None].view(np.uint8)  # [N, nb, 4]
    low = (u & 0xF).astype(np.uint8)
    qs = low[..., :16] | (low[..., 16:] << 4)  # [N, nb, 16]
    return np.concatenate([_fp16_bytes(module.scales.numpy(), N, nb), qh, qs], -1).reshape(N, nb * 22)


def to_gguf_q8_0(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 32 * 34]: fp16 d then 32 int8 codes per block."""
    _check_gguf(module, "Q8_0")
    N, K = module.qweight.shape
    nb = K // GGUF_BLOCK
    qs = module.qweight.numpy().astype(np.int8).reshape(N, nb, GGUF_BLOCK).view(np.uint8)
    return np.concatenate([_fp16_bytes(module.scales.numpy(), N, nb), qs], -1).reshape(N, nb * 34)


# ---- GGUF Q4_K / Q5_K / Q6_K (K-quant super-blocks of 256) ---------------------------------------------

QK_K = 256


def _superblock_steps(scales: np.ndarray, top: int, low: int, high: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 step [N, S, 1], integer levels [N, S, per]) of float32 group scales [N, S, per] that are
    d * level with the largest magnitude on level `top` (`primitives.superblock_qparams`), recovered
    exactly; a UserError if they are not."""
    lead = np.take_along_axis(scales, np.abs(scales).argmax(-1)[..., None], -1)  # [N, S, 1]
    d = (lead / np.float32(top)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(d != 0, scales / np.where(d != 0, d, 1), 0)
    levels = np.round(levels)
    exact = ((d.astype(np.float16).astype(np.float32) == d).all() and (levels * d == scales).all()
             and ((levels >= low) & (levels <= high)).all())
    if not exact:
        raise UserError(f"these {what} are not K-quant super-blocks (an fp16 step times integer levels); "
                        "re-quantize with this version of edgefinfer")
    return d, levels


def _scales_and_minima(module: _IntStorage) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [N, S, 16]: per super-block fp16 d and dmin, then the 8 groups' 6-bit scales and minima packed
    into 12 bytes (ggml's get_scale_min_k4: groups 0-3 in the low 6 bits of bytes 0-3 / 4-7, groups 4-7
    as nibbles of bytes 8-11 plus the spare top 2 bits of bytes 0-7), unsigned codes [N, S, 8, 32]) of a
    Q4_K / Q5_K layer. It holds (code - z) * d * sc, which decodes as d * sc * u - dmin * mc with u =
    code + 2^(b-1) and mc = d * sc * (z + 2^(b-1)) / dmin."""
    N, K = module.qweight.shape
    S = K // QK_K
    offset = 1 << (module.fmt.bits - 1)
    scales = module.scales.numpy().astype(np.float32).reshape(N, S, 8)
    minima = (scales * (module.zeros.numpy().astype(np.float32).reshape(N, S, 8) + offset)).astype(np.float32)
    d, sc = _superblock_steps(scales, 63, 0, 63, "scales")
    peak = minima.max(-1, keepdims=True)  # float32 products: off by rounding, so dmin is rounded to fp16
    dmin = (peak / 63).astype(np.float16).astype(np.float32)
    mc = np.round(np.where(dmin > 0, minima / np.where(dmin > 0, dmin, 1), 0))
    if not ((mc >= 0) & (mc <= 63)).all() or not (np.abs(mc * dmin - minima) <= 1e-4 * np.abs(minima) + 1e-30).all():
        raise UserError("these float zero points are not K-quant minima; re-quantize with this version of edgefinfer")
    sc, mc = sc.astype(np.uint8), mc.astype(np.uint8)  # [N, S, 8]
    packed = np.empty((N, S, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = mc[..., 0:4] | ((mc[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mc[..., 4:8] & 0xF) << 4)
    head = np.concatenate([_fp16_bytes(d, N, S), _fp16_bytes(dmin, N, S), packed], -1)
    codes = (module.qweight.numpy().astype(np.int16) + offset).astype(np.uint8).reshape(N, S, 8, 32)
    return head, codes


def _k_quant_check(module: _IntStorage, type_name: str) -> None:
    if gguf_type_of(module.fmt, module.group_size) != type_name:
        bits, group, float_zero = next(key for key, name in GGUF_K_FORMATS.items() if name == type_name)
        holds = f"int{bits}-g{group}-{'fzp' if float_zero else 'sym'}-k{QK_K}"
        raise UserError(f"GGUF {type_name} holds {holds}; this layer is {module.fmt.label()}"
                        + (": quantize with recipe int4-g32-fzp-k" if type_name == "Q4_K" else ""))


def to_gguf_q4_k(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 256 * 144]: d, dmin and the 12 bytes of levels (`_scales_and_minima`), then 128 bytes
    of nibbles (groups 2c and 2c + 1 in the low and high nibbles of bytes 32c..32c + 31)."""
    _k_quant_check(module, "Q4_K")
    head, u = _scales_and_minima(module)
    N, S = head.shape[:2]
    qs = (u[:, :, 0::2] | (u[:, :, 1::2] << 4)).reshape(N, S, 128)
    return np.concatenate([head, qs], -1).reshape(N, S * 144)


def to_gguf_q5_k(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 256 * 176]: d, dmin and the 12 bytes of levels, 32 bytes of fifth bits (bit g of byte
    l: group g's element l), then Q4_K's 128 bytes of low nibbles."""
    _k_quant_check(module, "Q5_K")
    head, u = _scales_and_minima(module)
    N, S = head.shape[:2]
    low = u & 0xF
    qs = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(N, S, 128)
    qh = np.bitwise_or.reduce((u >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=2).astype(np.uint8)  # [N, S, 32]
    return np.concatenate([head, qh, qs], -1).reshape(N, S * 176)


def to_gguf_q6_k(module: _IntStorage) -> np.ndarray:
    """uint8 [N, K / 256 * 210]: per super-block 128 bytes of low nibbles, 64 of high 2-bit pairs, 16
    signed 8-bit group scales, fp16 d; decodes d * sc * (u - 32). ggml's order: each half of 128 values
    holds four runs of 32 (l, l + 32, l + 64, l + 96): low nibbles of runs 0 / 1 in bytes l / l + 32 and
    of runs 2 / 3 in their high nibbles, the high bits of all four in byte l of qh at shifts 0, 2, 4, 6."""
    _k_quant_check(module, "Q6_K")
    N, K = module.qweight.shape
    S = K // QK_K
    d, sc = _superblock_steps(module.scales.numpy().astype(np.float32).reshape(N, S, 16), -128, -128, 127, "scales")
    u = (module.qweight.numpy().astype(np.int16) + 32).astype(np.uint8).reshape(N, S, 2, 4, 32)  # half, run, l
    low, high = u & 0xF, u >> 4
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], -1)
    qh = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)  # [N, S, 2, 32]
    return np.concatenate([ql.reshape(N, S, 128), qh.reshape(N, S, 64), sc.astype(np.int8).view(np.uint8),
                           _fp16_bytes(d, N, S)], -1).reshape(N, S * 210)


# ---- torchao (ExecuTorch / XNNPACK) ------------------------------------------------------------------

def to_torchao(module: _IntStorage, dtype: torch.dtype = torch.float32) -> Tensor:
    """A torchao `IntxUnpackedToInt8Tensor` [N, K] holding the module's codes, scales and zeros."""
    try:
        from torchao.quantization import IntxUnpackedToInt8Tensor
        from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
            IntxUnpackedToInt8TensorActivationQuantization as ActQuant)
    except ImportError as e:
        raise UserError("the ExecuTorch layout needs torchao: pip install torchao==0.18.0") from e
    act = ActQuant.INT8_ASYM_PER_TOKEN if getattr(module, "act_quant", False) else None
    # A float zero point ships as its symmetric part (zero point 0); OffsetLinear adds the offsets.
    zeros = torch.zeros_like(module.zeros, dtype=torch.int8) if module.fmt.float_zero else module.zeros
    return IntxUnpackedToInt8Tensor(
        qdata=module.qweight,
        scale=module.scales.to(dtype),
        zero_point=zeros,
        target_dtype=getattr(torch, f"int{module.fmt.bits}"),
        block_size=(1, module.group_size),
        dtype=dtype,
        activation_quantization=act,
    )


class OffsetLinear(nn.Module):
    """y = linear(x) + offsets @ group_sums(x): a float-zero-point QuantLinear as two ordinary linears
    (the first holds the symmetric codes as a torchao tensor, the second the [N, G] group offsets).

    The group sums are taken as a mean over a [T, G, g, 1] view with keepdim (times g, folded into the
    offsets): XNNPACK has no sum, and its partitioner takes mean.dim only as a 4-D global average pool
    over dims (2, 3); an undelegated sum would split every layer's XNNPACK graph in pieces (measured:
    lowering SmolLM2 took over 8 minutes before it was stopped)."""

    def __init__(self, linear: nn.Linear, offsets: Tensor, group_size: int):
        super().__init__()
        self.linear = linear
        self.offsets = nn.Linear(offsets.shape[1], offsets.shape[0], bias=False)
        self.offsets.weight = nn.Parameter(offsets * group_size, requires_grad=False)  # [N, G], x g for the mean
        self.group_size = group_size

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        G = x.shape[-1] // self.group_size
        means = x.reshape(-1, G, self.group_size, 1).mean((2, 3), keepdim=True)  # [T, G, 1, 1]
        offsets = self.offsets(means.reshape(-1, G))  # [T, N]
        # The token count is -1, never its (symbolic) size: XNNPACK delegates a reshape to static sizes and
        # one inferred dim only, and each one it left out cut a layer's delegate in two (SmolLM2 cut to
        # 4 layers: 29 delegates -> 14, lowering 26.4 -> 22.7 s CPU, bench/results/lowering.json; decode
        # speed unchanged within noise).
        return self.linear(x) + offsets.reshape(*x.shape[:-2], -1, offsets.shape[-1])


class OutlierSplitLinear(nn.Module):
    """`QuantLinear.act_split` as XNNPACK runs it: each token's input split in two rows
    (`primitives.split_outliers`), both through one dynamically quantized linear (its per-token int8
    quantization gives each row its own step), and the two output rows added.

    Shaped for XNNPACK's partitioner, so that the layer stays one delegate: the peak is a max.dim over
    a 4-D [T, 1, 1, K] view (it takes 4-D inputs only), the rows stack on a static dim (a slice of the
    token dim would be dynamic, which it refuses), and their sum is a mean over dims (2, 3) of a 4-D
    [T, N, 2, 1] view times 2 (its global average pool; it has no sum). The mean of two values times 2
    is their float sum exactly, so the .pte adds what the eager module adds."""

    def __init__(self, linear: nn.Linear, ratio: int, bias: Tensor | None = None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("the split linear must be bias-free: a bias would be added once per row")
        self.linear, self.ratio = linear, ratio
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., T, K] -> [..., T, N]
        rows = x.reshape(-1, 1, 1, x.shape[-1])  # [T, 1, 1, K]
        limit = rows.abs().max(3, keepdim=True).values * (1.0 / self.ratio)  # [T, 1, 1, 1]
        clipped = torch.minimum(torch.maximum(rows, -limit), limit * CLIP_TOP)
        y = self.linear(torch.cat([clipped, rows - clipped], dim=1))  # [T, 2, 1, N]
        y = y.permute(0, 3, 1, 2).mean((2, 3), keepdim=True) * 2.0  # [T, N, 1, 1]: the two rows' sum
        y = y.reshape(*x.shape[:-2], -1, y.shape[1])  # -1 for the token count: see OffsetLinear
        return y if self.bias is None else y + self.bias


class FloatChannelsLinear(nn.Module):
    """`QuantLinear.float_cols` as XNNPACK runs it: y = inner(x * keep) + C (P x), where `keep` zeroes the
    float channels, P [n, K] is the one-hot matrix that picks them and C [N, n] holds their weight
    columns in float32. XNNPACK's partitioner takes no gather (index_select), and an op it leaves out
    cuts the layer's delegate in two; a multiply by a constant and two small float linears it takes
    (P x is exact: each output is one input times 1.0).

    What a decode step pays is the four small ops, hardly n: 4 and 16 float channels cost about the
    same (bench/results/int8_activations.json). Folding P into a float zero point's group-sum linear
    (one op fewer, a [G + n, K] float matrix) was no faster on SmolLM2, and larger."""

    def __init__(self, inner: nn.Module, cols: Tensor, weight: Tensor):
        """cols [n] int64 of the K inputs; weight [N, K] the (symmetric part of the) dequantized matrix."""
        super().__init__()
        n_out, width = weight.shape
        self.inner = inner
        keep = torch.ones(width, dtype=weight.dtype)
        keep[cols] = 0.0
        self.register_buffer("keep", keep)  # [K]
        self.pick = nn.Linear(width, cols.numel(), bias=False, device="meta")
        self.pick.weight = nn.Parameter(torch.eye(width, dtype=weight.dtype)[cols], requires_grad=False)  # [n, K]
        self.columns = nn.Linear(cols.numel(), n_out, bias=False, device="meta")
        self.columns.weight = nn.Parameter(weight[:, cols].contiguous(), requires_grad=False)  # [N, n]

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        return self.inner(x * self.keep) + self.columns(self.pick(x))


def torchao_model(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Swap (in place) every QuantLinear / QuantEmbedding for an nn.Linear / nn.Embedding whose weight
    is the equivalent torchao tensor, ready for torch.export + the XNNPACK partitioner. A tied head
    shares its embedding's codes (its tensor differs only in carrying activation quantization)."""
    converted: dict[tuple[int, bool], Tensor] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, (QuantLinear, QuantEmbedding)):
            continue
        key = (module.qweight.data_ptr(), bool(getattr(module, "act_quant", False)))
        if key not in converted:
            converted[key] = nn.Parameter(to_torchao(module, dtype), requires_grad=False)
        split = isinstance(module, QuantLinear) and module.act_quant and module.act_split
        if isinstance(module, QuantLinear):
            with_bias = module.bias is not None and not split  # a split linear adds its bias once, after
            new: nn.Module = nn.Linear(module.in_features, module.out_features, bias=with_bias, device="meta")
            if with_bias:
                new.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        else:
            new = nn.Embedding(module.num_embeddings, module.embedding_dim, device="meta")
        new.weight = converted[key]
        if split:
            bias = None if module.bias is None else module.bias.detach().to(dtype)
            new = OutlierSplitLinear(new, module.act_split, bias)
        if isinstance(module, QuantLinear):  # a float zero point's split is one dequantization: taken once
            symmetric, offsets = module.offset_split() if module.fmt.float_zero else (None, None)
            if module.act_quant and module.float_cols is not None:
                symmetric = symmetric if symmetric is not None else module.dequantized()
                new = FloatChannelsLinear(new, module.float_cols, symmetric.to(dtype))
            if offsets is not None:
                new = OffsetLinear(new, offsets.to(dtype), module.group_size)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
