"""Quantization for ExecuTorch's XNNPACK back-end: 8da4w / 8da8w linears and 4-bit embeddings.

The model is quantized with `edgefinfer.compile.quant` (our round-to-nearest codes, scales and zero
points, in `QuantLinear` / `QuantEmbedding` modules that run in eager torch), then re-packed without
re-quantizing into torchao's `IntxUnpackedToInt8Tensor` (`torchao_model`), which torch.export and
the XNNPACK partitioners lower to XNNPACK's dynamically quantized linear (int8 per-token
activations x int4 groupwise / int8 per-channel weights) and to `quantized_decomposed::embedding_4bit`.
So the .pte holds exactly the weights of the eager quantized model, which is the reference the
parity tests compare against.

XNNPACK's blockwise 4-bit kernel (qb4w) keeps its scales in bfloat16, so 4-bit formats here round
scales to bfloat16 values (`WeightFormat.scale_dtype`, rounded up so that no weight clips): measured
on one 8da4w linear, float16 scales put the .pte 0.008 off the eager module, bf16 ones 7e-7.
8-bit per-channel (qc8w) and the 4-bit embedding table keep float32 scales; the embedding gets bf16
values too, so that a tied head can share its codes.

A model that is already quantized (by `edgefinfer quantize` with an 8da4w recipe) is exported as it
is. torchao's weight-only configs are never used: they lower to XNNPACK without error but return
wrong logits (probe: max |diff| 3710 for int8, 238 for int4).
"""

from __future__ import annotations

import copy
from enum import StrEnum
from typing import Callable

from torch import nn

from edgefinfer.compile.quant import QuantEmbedding, QuantLinear, QuantRecipe, WeightFormat, quantize_model
from edgefinfer.compile.quant.modules import Fp8Linear
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer



class Scheme(StrEnum):
    """ExecuTorch's weight schemes (`export_pte`'s `recipe`): float32, Core ML's float16 compute, and
    XNNPACK's int8 dynamic activations over int8 per-channel (8da8w) or int4 groupwise (8da4w) weights.
    A StrEnum: written (manifest, cache key) as its name."""

    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "8da8w"
    INT4 = "8da4w"

    @classmethod
    def parse(cls, text: "str | Scheme", allowed: tuple["Scheme", ...] | None = None) -> "Scheme":
        """`text` as a scheme (where a caller's string enters), one of `allowed` (default: all);
        a one-line UserError for another."""
        allowed = tuple(cls) if allowed is None else allowed
        if text not in allowed:
            what = "quantized scheme" if allowed == QUANTIZED_SCHEMES else "ExecuTorch recipe"
            raise UserError(f"unknown {what} {text!r}: use one of {', '.join(allowed)}")
        return cls(text)

    @property
    def quantized(self) -> bool:
        return self in QUANTIZED_SCHEMES


SCHEMES: tuple[Scheme, ...] = tuple(Scheme)
QUANTIZED_SCHEMES: tuple[Scheme, ...] = (Scheme.INT8, Scheme.INT4)
EMBEDDING_4BIT = WeightFormat("int", 4, 32, True, "bfloat16")


def xnnpack_recipe(model: Transformer, scheme: Scheme | str, group_size: int = 32, embedding_4bit: bool = False) -> QuantRecipe:
    """The `QuantRecipe` behind an ExecuTorch scheme.

    Decoder linears: 8da4w = int4 groupwise symmetric, 8da8w = int8 per-channel symmetric, both with
    int8 per-token dynamic activations (the only quantized linears XNNPACK runs fast). The output head
    follows the linears, except when it is tied to the embeddings: then it shares their format (4-bit
    g32 with `embedding_4bit`, else it stays float).
    """
    scheme = Scheme.parse(scheme, QUANTIZED_SCHEMES)
    weights = (WeightFormat("int", 4, group_size, True, "bfloat16") if scheme is Scheme.INT4
               else WeightFormat("int", 8, None, True))
    embedding = EMBEDDING_4BIT if embedding_4bit else None
    head = embedding if model.config.tie_word_embeddings else weights
    name = f"{scheme}-g{group_size}" if scheme is Scheme.INT4 else str(scheme)
    return QuantRecipe(name=name + ("-emb4" if embedding_4bit else "-embf"), weights=weights,
                       activations="int8-per-token", embedding=embedding, lm_head=head)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (QuantLinear, QuantEmbedding, Fp8Linear)) for m in model.modules())


def quantize_for_xnnpack(model: Transformer, scheme: Scheme | str, group_size: int = 32, embedding_4bit: bool = False,
                         progress: Callable[[str], None] | None = None) -> Transformer:
    """A quantized copy of a float `model` (round-to-nearest): the eager reference of the exported .pte."""
    if is_quantized(model):
        raise UserError("the model is already quantized; export it as it is (recipe of its quantization)")
    out = copy.deepcopy(model).float().eval()
    quantize_model(out, xnnpack_recipe(out, scheme, group_size, embedding_4bit), progress=progress)
    return out


def check_xnnpack_layout(model: nn.Module) -> None:
    """Refuse quantized modules that XNNPACK cannot run as dynamically quantized linears."""
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            raise UserError(f"{name} is fp8, which ExecuTorch's XNNPACK back-end does not run: "
                            "quantize with an 8da4w recipe (e.g. 8da4w-g32) for phones")
        if isinstance(m, QuantLinear):
            fmt = m.fmt
            # A float zero point runs as its symmetric part plus a float offset linear (layouts.OffsetLinear).
            ok = (fmt.symmetric or (fmt.float_zero and fmt.bits == 4)) and m.act_quant and (
                (fmt.bits == 4 and m.group_size % 16 == 0) or (fmt.bits == 8 and m.group_size == m.in_features))
            if not ok:
                raise UserError(f"{name} is {fmt.label()}{' with' if m.act_quant else ' without'} int8 activations; "
                                "XNNPACK runs int4 groupwise or int8 per-channel symmetric weights with int8 "
                                "activations: quantize with 8da4w-g32 (or export the float model with recipe 8da8w)")
        if isinstance(m, QuantEmbedding) and (m.fmt.bits not in (4, 8) or not m.fmt.symmetric):
            raise UserError(f"{name} is {m.fmt.label()}; ExecuTorch's quantized embeddings are symmetric 4- or 8-bit: "
                            "use -emb4 or -emb8")


def scheme_of(model: nn.Module) -> Scheme:
    """The scheme of an already-quantized model (8da4w if any linear is 4-bit)."""
    bits = {m.fmt.bits for m in model.modules() if isinstance(m, QuantLinear)}
    return Scheme.INT4 if 4 in bits else Scheme.INT8 if bits else Scheme.FP32
