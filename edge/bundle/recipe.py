"""A build recipe: every name `edgefinfer build --recipe` accepts, parsed once where the user's string
enters (the CLI, the Python API, a manifest) and passed on as this value.

    float      fp32 | fp16              the exporter keeps float weights (fp16: Core ML's compute
                                        precision, a GGUF's F16 matrices)
    quant      the quantization grammar of `edgefinfer.bundle.quant_recipe` (int4-g32, 8da4w-gptq-g32-fzp,
               8da8w, fp8, ...): our quantizers make it, `quant` holds its typed description
    qdq        qdq-SCHEME (qdq-a16w8, ...)   static activation + weight quantization by the exporter
                                        itself (QNN's QDQ graphs, MediaTek's NeuropilotQuantizer)
    llamacpp   llamacpp-TYPE (llamacpp-q4_1, llamacpp-q4_k_m)   llama.cpp's own quantizer, run by the
                                        GGUF exporter on the float model

Which QDQ schemes and llama.cpp types exist is for the exporter that makes them to say (the build
checks them up front); this tells the kinds apart, so that nothing past the boundary looks at a
recipe's spelling. Foundation: a pure value, like the grammar it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from enum import StrEnum

from edgefinfer.errors import UserError
from edgefinfer.bundle.quant_recipe import SUPER_BLOCK, QuantRecipe, WeightFormat, parse_recipe



class RecipeKind(StrEnum):
    """Who makes a recipe's weights (the table above): the exporter keeps them float, our quantizers
    make them, the exporter quantizes statically (QDQ), or llama.cpp's quantizer does."""

    FLOAT = "float"
    QUANT = "quant"
    QDQ = "qdq"
    LLAMACPP = "llamacpp"


FLOAT_NAMES: tuple[str, ...] = ("fp32", "fp16")
QDQ_PREFIX = "qdq-"
LLAMACPP_PREFIX = "llamacpp-"


@dataclass(frozen=True)
class Recipe:
    name: str  # as the user (or the target, or a checkpoint) named it; what the manifest records
    kind: RecipeKind
    quant: QuantRecipe | None = None  # kind "quant": what our quantizers apply
    # kind "float": fp32 | fp16; "qdq": the exporter's scheme (a16w8); "llamacpp": the file type (q4_1)
    variant: str | None = None

    @classmethod
    def parse(cls, name: str) -> "Recipe":
        """The recipe `name` names; a one-line UserError (the grammar's) when it names none."""
        if name in FLOAT_NAMES:
            return cls(name, RecipeKind.FLOAT, variant=name)
        for prefix, kind in ((QDQ_PREFIX, RecipeKind.QDQ), (LLAMACPP_PREFIX, RecipeKind.LLAMACPP)):
            if name.startswith(prefix) and name != prefix:
                return cls(name, kind, variant=name.removeprefix(prefix))
        return cls(name, RecipeKind.QUANT, quant=parse_recipe(name))

    @classmethod
    def of(cls, quant: QuantRecipe) -> "Recipe":
        """A recipe already described (a quantized checkpoint's `quantization_config`)."""
        return cls(quant.name, RecipeKind.QUANT, quant=quant)

    @property
    def quantized_by_us(self) -> bool:
        """Whether our quantizers make it (float, QDQ and llama.cpp's quantizer are the exporters')."""
        return self.kind is RecipeKind.QUANT

    def __str__(self) -> str:
        return self.name


def quant_recipe_of(name: str | None) -> QuantRecipe | None:
    """A recorded recipe name's grammar description (a manifest's, an artefact's metadata); None for
    float, QDQ and llama.cpp recipes, for labels outside every grammar ("8da4w (pre-quantized)", mixed
    precision) and for none."""
    if not name:
        return None
    try:
        return Recipe.parse(name).quant
    except UserError:
        return None


def source_precision(folder: str | Path, recipe: Recipe, artefact_format: str | None = None,
                     fit_size: bool = False) -> dict[str, WeightFormat]:
    """Module -> the format for each matrix that the GGUF the weights were converted from stored above
    `recipe`'s bits (Gemma 3 270M's Q4_K_M: Q5_0 where a row of 640 fits no K-quant, Q6_K and Q8_0
    beside Q4_K). Re-rounding a 5- or 6-bit grid to 4 bits loses what the source kept. Per-channel int8
    is what both the XNNPACK and the MatMulNBits exports take beside 4-bit layers. A GGUF
    (`artefact_format` "gguf") keeps its source's types where ours are the same grid, so that the
    file is the size its source was: Q5_0 as int5 in symmetric groups of 32 (the same codes and
    scales, `primitives.SIGNED_SCALE_BITS`), everything else as int8 in such groups, Q8_0 (a Q8_0 source
    exactly, a 6-bit one within an eighth of its step). Empty for recipes outside our integer grammar
    and for models not converted from a GGUF. `edgefinfer build` and `edgefinfer quantize` both keep
    these unless told to re-quantize them (--requantize-source).

    `fit_size` (a GGUF only, `build --fit-source-size`): each such matrix takes the larger of Q8_0 and
    Q5_0 that is no larger than its source type, so that the file is no larger than its source where
    the source used types we do not write: Q5_1 (6.0 bits a weight) -> Q5_0 (5.5), not Q8_0 (8.5);
    an F16 or Q8_0 source -> Q8_0.

    A GGUF keeps a Q5_K or Q6_K source matrix as Q5_K / Q6_K (int5-g32-fzp / int6-g16-sym in
    super-blocks of 256, written by our writer since the K-quants landed), its own type and size. It also keeps the embedding and an untied
    head in their source types whenever our writer has them (Q8_0, Q6_K, Q5_K, Q5_0, Q4_K, Q4_1, Q4_0; a
    Q4_K_M file's 4-bit embedding of a large vocabulary would double as the recipe's -emb8), unless
    the recipe keeps them float (-embf). `for_model` then fits each to its matrix's width and gives a
    tied head its embedding's format."""
    from edgefinfer.model.gguf_import import TYPE_BITS, source_tensor_types

    types = source_tensor_types(folder)
    if not types or not recipe.quantized_by_us:
        return {}
    weights = recipe.quant.weights
    if weights.kind != "int":
        return {}
    gguf = artefact_format == "gguf"

    def kept(source_type: str) -> WeightFormat:
        if not gguf:  # what both the XNNPACK and the MatMulNBits exports take beside 4-bit layers
            return WeightFormat(kind="int", bits=8, group_size=None, symmetric=True)
        if source_type in GGUF_TYPE_FORMATS:  # our writer has it: the source's own type
            return GGUF_TYPE_FORMATS[source_type]
        if fit_size and _bits_per_weight(source_type) < _bits_per_weight("Q8_0"):
            return GGUF_TYPE_FORMATS["Q5_0"]
        return GGUF_TYPE_FORMATS["Q8_0"]

    formats = {name: kept(t) for name, t in types.items()
               if TYPE_BITS.get(t, 0) > weights.bits and name not in EMBEDDING_AND_HEAD}  # those: below
    if gguf and recipe.quant.embedding is not None:
        formats.update({name: GGUF_TYPE_FORMATS[t] for name, t in types.items()
                        if name in EMBEDDING_AND_HEAD and t in GGUF_TYPE_FORMATS})
    return formats


EMBEDDING_AND_HEAD = ("model.embed_tokens", "lm_head")
# ggml type -> the format holding it exactly (our writer's types; `compile.quant.layouts`).
GGUF_TYPE_FORMATS: dict[str, WeightFormat] = {
    "Q8_0": WeightFormat("int", 8, 32, True), "Q5_0": WeightFormat("int", 5, 32, True),
    "Q4_0": WeightFormat("int", 4, 32, True), "Q4_1": WeightFormat("int", 4, 32, False, float_zero=True),
    "Q4_K": WeightFormat("int", 4, 32, False, float_zero=True, super_block=SUPER_BLOCK),
    "Q5_K": WeightFormat("int", 5, 32, False, float_zero=True, super_block=SUPER_BLOCK),
    "Q6_K": WeightFormat("int", 6, 16, True, super_block=SUPER_BLOCK),
}


def for_model(kept: dict[str, WeightFormat], model) -> dict[str, WeightFormat]:
    """`kept` (from `source_precision`) as `model` takes it: each format at its matrix's width
    (`WeightFormat.for_width`: a K-quant only where the rows are whole super-blocks, else llama.cpp's
    fallback), and a tied head in its embedding's format."""
    fitted = {name: fmt.for_width(model.get_submodule(name).weight.shape[1]) for name, fmt in kept.items()}
    if model.config.tie_word_embeddings and EMBEDDING_AND_HEAD[0] in fitted:
        fitted[EMBEDDING_AND_HEAD[1]] = fitted[EMBEDDING_AND_HEAD[0]]
    return fitted


def _bits_per_weight(ggml_type: str) -> float:
    """Bits a weight of a ggml type takes in the file, scales included (Q8_0: 8.5, Q6_K: 6.5625)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    return 8 * size / block
