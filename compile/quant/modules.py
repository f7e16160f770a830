"""Quantized drop-in modules for `nn.Linear` and `nn.Embedding`.

Each module stores exactly what an exporter needs and nothing derived:

    QuantLinear / QuantEmbedding   qweight int8 [N, K] (codes), scales fp16 [N, G], zeros int8 [N, G]
                                   (float32 code units for a float zero point, `-fzp`)
    Fp8Linear                      qweight float8_e4m3fn [N, K], scales fp32 [N, 1]

plus the format (bits, group size, symmetric). The eager forward dequantizes, so it computes with
exactly the weights an integer kernel sees; a QuantLinear with `act_quant` also quantize-dequantizes
its input per token to int8 (8da4w), as XNNPACK's dynamically quantized linear does; with `act_split`
as well, it quantizes each token's input in two parts (`split_outliers`), each by its own step; with
`float_cols`, those input channels bypass the int8 row and meet their weight columns in float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgefinfer.compile.quant.primitives import (Fp8Weights, IntWeights, dequantize_fp8, dequantize_int,
                                                 fake_quant_per_token_int8, scale_storage_dtype, split_outliers,
                                                 zero_dtype)
from edgefinfer.compile.quant.recipe import WeightFormat

FLOAT_BYTES = 2  # unquantized tensors are counted at fp16/bf16, as they would be deployed


class _IntStorage(nn.Module):
    """Codes, scales and zero points of one integer-quantized matrix [N, K]."""

    def __init__(self, n: int, k: int, fmt: WeightFormat, where: str = "this layer"):
        super().__init__()
        if fmt.kind != "int":
            raise ValueError(f"{type(self).__name__} holds integer formats, got {fmt.kind}")
        self.fmt = fmt
        self.group_size = fmt.group_for(k, where)
        self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(n, k // self.group_size, dtype=scale_storage_dtype(fmt)))
        self.register_buffer("zeros", torch.zeros(n, k // self.group_size, dtype=zero_dtype(fmt)))

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def symmetric(self) -> bool:
        return self.fmt.symmetric

    def set_weights(self, w: IntWeights) -> None:
        if w.codes.shape != self.qweight.shape or w.scales.shape != self.scales.shape:
            raise ValueError(f"shape mismatch: codes {tuple(w.codes.shape)} scales {tuple(w.scales.shape)}, "
                             f"expected {tuple(self.qweight.shape)} {tuple(self.scales.shape)}")
        self.qweight = w.codes.to(torch.int8).contiguous()
        self.scales = w.scales.to(scale_storage_dtype(self.fmt)).contiguous()
        self.zeros = w.zeros.to(zero_dtype(self.fmt)).contiguous()

    def int_weights(self) -> IntWeights:
        return IntWeights(self.qweight, self.scales, self.zeros)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int(self.qweight, self.scales, self.zeros).to(dtype)  # [N, K]

    def offset_split(self) -> tuple[Tensor, Tensor]:
        """A float-zero-point matrix as a symmetric one plus per-group offsets: (q - z) * d =
        q * d + m with m = -z * d, so W x = (q * d) x + m @ group_sums(x).

        Returns (q * d [N, K] float32, m [N, G] float32). Kernels without float zero points run the
        first term as an ordinary symmetric int4 matmul (XNNPACK qb4w, MatMulNBits' fast path) and
        the second as a small float matmul over the G = K / group_size sums of x."""
        zero = torch.zeros_like(self.zeros, dtype=torch.float32)
        return dequantize_int(self.qweight, self.scales, zero), -self.zeros.float() * self.scales.float()

    def packed_bytes(self) -> int:
        """Bytes in a packed deployment: codes at `bits` each, fp16 scales, zero points if asymmetric
        (`bits` each, or an fp16 minimum each for a float zero point)."""
        n, k = self.qweight.shape
        if self.fmt.super_block:  # K-quants: integer levels per group, fp16 steps per super-block
            return int(n * k * self.fmt.bits_per_weight(k)) // 8
        groups = self.scales.numel()
        zero_bits = groups * self.fmt.zero_point_bits
        return (n * k * self.fmt.bits + zero_bits + 7) // 8 + 2 * groups


class QuantLinear(_IntStorage):
    def __init__(self, in_features: int, out_features: int, fmt: WeightFormat, bias: bool = False,
                 act_quant: bool = False, where: str = "this layer", act_split: int = 0, float_cols: int = 0):
        """act_split: with act_quant, k > 0 quantizes each token's input as two int8 rows, its values
        clipped at 1/k of its largest magnitude and the rest beyond (`split_outliers`); 0: one row.
        float_cols: with act_quant, room for that many input channel indices kept out of the int8 row
        (`float_cols` [n] int64, filled by `compile.quant.outliers` or a checkpoint); 0: none, no buffer."""
        super().__init__(out_features, in_features, fmt, where)
        self.in_features, self.out_features = in_features, out_features
        self.act_quant = act_quant
        self.act_split = act_split
        self.float_cols: Tensor | None
        self.register_buffer("float_cols", torch.zeros(float_cols, dtype=torch.long) if float_cols else None)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, fmt: WeightFormat, weights: IntWeights, act_quant: bool = False,
                   where: str = "this layer") -> "QuantLinear":
        q = cls(linear.in_features, linear.out_features, fmt, linear.bias is not None, act_quant, where)
        q.set_weights(weights)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return q

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (a fresh float32 tensor; code that reads `.weight` keeps working)."""
        return self.dequantized()

    def forward(self, x: Tensor) -> Tensor:  # [..., K] -> [..., N]
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not self.act_quant:
            return F.linear(x, self.dequantized(x.dtype), bias)
        # As the .pte computes it: the symmetric part on int8 activations (XNNPACK's dynamically
        # quantized linear), a float zero point's group offsets on the float activations (a float linear).
        w, offsets = self.offset_split() if self.fmt.float_zero else (self.dequantized(), None)
        w = w.to(x.dtype)
        cols = self.float_cols  # LLM.int8()'s decomposition: these channels never see int8
        x_int = x if cols is None else x.index_fill(-1, cols, 0.0)
        if self.act_split:
            clipped, outliers = split_outliers(x_int, self.act_split)
            y = F.linear(fake_quant_per_token_int8(clipped), w) + F.linear(fake_quant_per_token_int8(outliers), w)
        else:
            y = F.linear(fake_quant_per_token_int8(x_int), w)
        if cols is not None:
            y = y + F.linear(x.index_select(-1, cols), w[:, cols])
        if offsets is not None:  # the offsets see every channel: they are float already
            y = y + F.linear(group_sums(x, self.group_size), offsets.to(x.dtype))
        return y if bias is None else y + bias

    def packed_bytes(self) -> int:
        """With float channels, their weight columns are stored once more, in float."""
        floats = (0 if self.bias is None else self.bias.numel()) + (
            0 if self.float_cols is None else self.float_cols.numel() * self.out_features)
        return super().packed_bytes() + FLOAT_BYTES * floats

    def extra_repr(self) -> str:
        act = (f", act=int8-per-token x2 (split at 1/{self.act_split})" if self.act_quant and self.act_split
               else ", act=int8-per-token" if self.act_quant else "")
        if self.float_cols is not None:
            act += f", {self.float_cols.numel()} float channels"
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.label()}{act}"


def group_sums(x: Tensor, group_size: int) -> Tensor:
    """[..., K] -> [..., K / group_size]: the sum of each group of consecutive channels."""
    return x.unflatten(-1, (x.shape[-1] // group_size, group_size)).sum(-1)


class QuantEmbedding(_IntStorage):
    """Rows [V, D] quantized in groups along D; a lookup dequantizes only the rows it gathers."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: WeightFormat, where: str = "embeddings"):
        super().__init__(num_embeddings, embedding_dim, fmt, where)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    @classmethod
    def from_float(cls, emb: nn.Embedding, fmt: WeightFormat, weights: IntWeights) -> "QuantEmbedding":
        q = cls(emb.num_embeddings, emb.embedding_dim, fmt)
        q.set_weights(weights)
        return q

    @property
    def weight(self) -> Tensor:
        return self.dequantized()

    def forward(self, ids: Tensor) -> Tensor:  # [...] -> [..., D]
        flat = ids.flatten()
        rows = dequantize_int(self.qweight[flat], self.scales[flat], self.zeros[flat])  # [n, D]
        return rows.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt.label()}"


def tied_head(embedding: QuantEmbedding, act_quant: bool = False) -> QuantLinear:
    """An output head that shares the embedding's codes, scales and zero points (one copy in memory)."""
    head = QuantLinear(embedding.embedding_dim, embedding.num_embeddings, embedding.fmt, act_quant=act_quant)
    head.qweight, head.scales, head.zeros = embedding.qweight, embedding.scales, embedding.zeros
    return head


class Fp8Linear(nn.Module):
    """float8 e4m3 weights with one fp32 scale per output channel (the GPU server's format)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.fmt = WeightFormat("fp8")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("scales", torch.ones(out_features, 1, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, linear: nn.Linear, weights: Fp8Weights) -> "Fp8Linear":
        q = cls(linear.in_features, linear.out_features, linear.bias is not None)
        q.qweight, q.scales = weights.codes.contiguous(), weights.scales.float().contiguous()
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return q

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_fp8(self.qweight, self.scales).to(dtype)

    @property
    def weight(self) -> Tensor:
        return self.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def packed_bytes(self) -> int:
        bias = 0 if self.bias is None else FLOAT_BYTES * self.bias.numel()
        return self.qweight.numel() + 4 * self.scales.numel() + bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8-e4m3"


QUANT_MODULES = (QuantLinear, QuantEmbedding, Fp8Linear)


def module_format(module: nn.Module) -> WeightFormat | None:
    """The format of a quantized module, None for a float one."""
    return module.fmt if isinstance(module, QUANT_MODULES) else None


def model_size_bytes(model: nn.Module) -> int:
    """Deployed weight bytes: quantized modules packed, every other parameter at 2 bytes; shared tensors
    (tied embeddings) counted once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, QUANT_MODULES):
            if module.qweight.data_ptr() not in seen:  # a tied head shares its embedding's codes
                seen.add(module.qweight.data_ptr())
                total += module.packed_bytes()
            elif getattr(module, "bias", None) is not None:
                total += FLOAT_BYTES * module.bias.numel()
            continue
        for p in module.parameters(recurse=False):
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += FLOAT_BYTES * p.numel()
    return total
