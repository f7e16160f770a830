"""Quantization recipes: one typed description of what is quantized, how, and what stays in float.

A pure value type (it imports nothing but the errors), so it lives in the foundation: the artefact
description (`edgefinfer.bundle.artefact`) and the runtimes hold it without importing an exporter.
`edgefinfer.compile.quant.recipe` re-exports it for the quantizers.

A recipe name is a short dash-separated string parsed by `parse_recipe`:

    SCHEME [-METHOD] [-gN | -pc] [-sym | -asym | -fzp] [-k] [-embF] [-smooth] [-split] [-outliersN] [-rot]

    SCHEME  int8 | int4 | 8da4w | 8da8w | fp8  (8daNw = int8 dynamic per-token activations, intN weights;
                                               8da8w is per-channel, with int8 per-row embeddings)
    METHOD  rtn (default) | gptq (act-order, static groups, true-sequential) | gptq-noact
            | awq (scales, then clipping search) | awq-noclip (scales only) | awq-gptq (AWQ's scales, then GPTQ)
    -gN     group size N along the input dimension; -pc = per output channel (one group per row)
    -sym / -asym   symmetric (zero point 0) or asymmetric (integer zero point) weights
    -fzp    asymmetric with a float zero point: each group is x = d * q + m with an fp16 minimum m, as
            llama.cpp's Q4_1 and torchao's ZeroPointDomain.FLOAT store it; for kernels that have
            only symmetric low-bit weights (XNNPACK, MatMulNBits' fast path) it is exported as the
            symmetric codes plus a small float linear over the input's group sums (int4 and int8;
            8da4w-*-fzp too)
    -k      K-quant super-blocks (GGUF's Q4_K, with int4-[METHOD-]g32-fzp): the scales and minima of each
            8 groups of 32 quantized to 6 bits under one fp16 step and one fp16 minimum step, 4.5 bits a
            weight instead of Q4_1's 5.0; a matrix whose width is not a multiple of 256 takes the plain
            group-32 format (Q4_1), as llama.cpp falls back for its K-quants. GGUF (gpu-server) only
    -embF   embeddings and output head: emb8 (int8 g32 sym), emb4 (int4 g32 sym), embf (kept float);
            defaults: int8 per-row for int8 and 8da4w, emb8 for int4, float for fp8
    -rot    fuse a randomized Hadamard rotation into the float weights first (QuaRot / SpinQuant R1+R2,
            see `edgefinfer.compile.quant.rotation`); composes with every method; unties a tied head

    -smooth for int8 activations (8daNw): shrink the large channels of the MLP's down-projection input by
            powers of two over whole weight groups, folded into the up projection and chosen per layer
            on the calibration text (exact in float; the weights stay on their grids; see
            `edgefinfer.compile.quant.smoothing`, measured in bench/results/gemma3.json `smoothing`)
    -split  for int8 activations (8daNw): each token's input to a decoder linear quantized as two int8
            rows, its values clipped at 1/8 of its largest magnitude and the outliers beyond, through the
            same weights (`edgefinfer.compile.quant.primitives.split_outliers`): close to float
            activations; a decode token's GEMM reads the weights once for both rows, a prefill computes
            twice (measured: bench/results/int8_activations.json)
    -outliersN  for int8 activations (8daNw): per decoder linear, the N input channels with the largest
            magnitude on the calibration text stay out of the int8 row and are multiplied in float by their
            (dequantized) weight columns, LLM.int8()'s decomposition with channels fixed at build time
            (`edgefinfer.compile.quant.outliers`; measured: bench/results/int8_activations.json)

Examples: `int8`, `int4-g32`, `int4-awq-g64`, `int4-gptq-g128-sym`, `8da4w-g32`, `fp8`, `int4-g64-emb8`,
`int4-gptq-g32-rot`, `8da4w-g32-emb8-rot`.
`RECIPES` lists the canonical names; any name the grammar accepts works.

Mixed precision is expressed with `overrides` (module-name pattern -> format, or None for float),
which `edgefinfer.compile.quant.mixed` fills from a measured sensitivity.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

from edgefinfer.errors import UserError

Method = Literal["rtn", "gptq", "awq", "awq-gptq"]
Activations = Literal["none", "int8-per-token"]
Role = Literal["linear", "embedding", "lm_head"]

METHODS: tuple[str, ...] = ("rtn", "gptq", "awq", "awq-gptq")
INT_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)
# -split: clip at 1/8 of each token's peak. Eager, Gemma 3 270M 8da4w-g32-fzp, bible 4096 tokens:
# 1/4 +4.31%, 1/8 +3.98%, 1/16 +4.56% with q/k/v/down split alone (unsplit +7.81%, float activations +2.02%).
SPLIT_RATIO = 8
# -outliersN: more float channels than this would make the float part a GEMM of its own (64 float32
# columns of a 640-wide input weigh 80% of its int4 matrix).
MAX_OUTLIER_CHANNELS = 64
# GGUF's K-quants as (kind, bits, group, symmetric, float zero, super-block): Q4_K and Q5_K (x = d * sc * q -
# dmin * m, 6-bit sc and m per group of 32) and Q6_K (x = d * sc * q, signed 8-bit sc per group of 16).
SUPER_BLOCK = 256
SUPER_BLOCK_FORMATS = (("int", 4, 32, False, True, SUPER_BLOCK), ("int", 5, 32, False, True, SUPER_BLOCK),
                       ("int", 6, 16, True, False, SUPER_BLOCK))


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix [out, in] is stored.

    kind "int": integer codes with one fp16 scale (and, if asymmetric, one integer zero point) per group
    of `group_size` consecutive input channels of a row; `group_size=None` means one group per row.
    float_zero: asymmetric with a float zero point instead (the group's fp16 minimum, see
    `compile.quant.primitives`): the grid starts at the group's minimum rather than at a multiple of
    the scale, which costs 12 more bits per group than an int4 zero point.
    kind "fp8": float8 e4m3 values with one fp32 scale per row (bits/group/symmetric are fixed).
    scale_dtype: the values scales are rounded to (always stored as float16): "float16", or
    "bfloat16" for XNNPACK, whose 4-bit kernels keep scales in bf16 (8da4w recipes use it, so the
    exported .pte computes with exactly the eager model's weights).
    super_block: GGUF's K-quants, `SUPER_BLOCK_FORMATS`: the group scales (and float minima) of each run
    of `super_block` weights are themselves integers times one fp16 step per run (and one fp16 minimum
    step), so a group's scale is no fp16 value and is stored as float32 (`compile.quant.primitives`).
    """

    kind: Literal["int", "fp8"] = "int"
    bits: int = 4
    group_size: int | None = 32
    symmetric: bool = True
    scale_dtype: Literal["float16", "bfloat16"] = "float16"
    float_zero: bool = False
    super_block: int | None = None

    def __post_init__(self) -> None:
        if self.super_block is not None and (self.kind, self.bits, self.group_size, self.symmetric, self.float_zero,
                                             self.super_block) not in SUPER_BLOCK_FORMATS:
            raise UserError(f"super-blocks of {self.super_block} exist for GGUF's K-quants only: int4-g32-fzp "
                            f"(Q4_K), int5-g32-fzp (Q5_K) and int6-g16-sym (Q6_K) in super-blocks of {SUPER_BLOCK}")
        if self.kind == "fp8":
            object.__setattr__(self, "bits", 8)
            object.__setattr__(self, "group_size", None)
            object.__setattr__(self, "symmetric", True)
            object.__setattr__(self, "scale_dtype", "float16")
            object.__setattr__(self, "float_zero", False)
            return
        if self.float_zero and self.symmetric:
            raise UserError("a float zero point is an asymmetric format: use symmetric=False with float_zero=True")
        if self.scale_dtype not in ("float16", "bfloat16"):
            raise UserError(f"scale_dtype must be 'float16' or 'bfloat16', got {self.scale_dtype!r}")
        if self.kind != "int":
            raise UserError(f"unknown weight format kind {self.kind!r}: use 'int' or 'fp8'")
        if self.bits not in INT_BITS:
            raise UserError(f"{self.bits}-bit weights are not supported: use one of {INT_BITS}")
        if self.group_size is not None and self.group_size <= 0:
            raise UserError(f"group size must be a positive number of input channels, got {self.group_size}")

    def group_for(self, in_features: int, where: str = "this layer") -> int:
        """The group size for a matrix with `in_features` columns; UserError if it does not divide it."""
        g = in_features if self.group_size is None else self.group_size
        if in_features % g:
            divisors = [d for d in (16, 32, 64, 128, 256) if in_features % d == 0]
            raise UserError(f"group size {g} does not divide the input dimension {in_features} of {where}: "
                            f"use a group size that divides it ({', '.join(map(str, divisors)) or 'per-channel -pc'})")
        return g

    def for_width(self, in_features: int) -> "WeightFormat":
        """The format a matrix `in_features` wide takes: without super-blocks where they do not divide
        it (llama.cpp falls back likewise: Gemma 3's 640-wide rows): Q4_K's groups as Q4_1, Q5_K and Q6_K
        as Q8_0."""
        if self.super_block and in_features % self.super_block:
            if self.bits == 4:  # Q4_K -> Q4_1: the same groups and minima
                return dataclasses.replace(self, super_block=None)
            return WeightFormat("int", 8, 32, True)  # Q5_K, Q6_K -> Q8_0 (llama.cpp: Q5_1, Q8_0; no Q5_1 here)
        return self

    def bits_per_weight(self, in_features: int) -> float:
        """Stored bits per weight including scales and zero points (fp16 scales, packed zero points;
        K-quants: `scale_bits` per group scale and minimum, fp16 steps per super-block)."""
        if self.kind == "fp8":
            return 8 + 32 / in_features
        g = in_features if self.group_size is None else self.group_size
        if self.super_block:
            per_group = self.scale_bits * (2 if self.float_zero else 1)
            return self.bits + per_group / g + 16 * (2 if self.float_zero else 1) / self.super_block
        return self.bits + (16 + self.zero_point_bits) / g

    @property
    def scale_bits(self) -> int:
        """Bits of one group's scale: 16 (fp16), or a K-quant's integer level (6 with minima, 8 signed)."""
        return 16 if not self.super_block else 6 if self.float_zero else 8

    @property
    def zero_point_bits(self) -> int:
        """Stored bits of one group's zero point: none (symmetric), `bits` (integer), 16 (fp16 minimum)."""
        return 16 if self.float_zero else 0 if self.symmetric else self.bits

    def label(self) -> str:
        if self.kind == "fp8":
            return "fp8"
        g = "pc" if self.group_size is None else f"g{self.group_size}"
        bf16 = "-bf16" if self.scale_dtype == "bfloat16" else ""
        zero = "fzp" if self.float_zero else "sym" if self.symmetric else "asym"
        k = f"-k{self.super_block}" if self.super_block else ""
        return f"int{self.bits}-{g}-{zero}{k}{bf16}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("float_zero", "super_block"):  # written only when set: files of other formats stay as they were
            if not d[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WeightFormat":
        return cls(**{k: d[k] for k in ("kind", "bits", "group_size", "symmetric", "scale_dtype", "float_zero",
                                        "super_block") if k in d})


@dataclass(frozen=True)
class GPTQSettings:
    # Fraction of the mean Hessian diagonal added to the diagonal. 0.05 rather than the paper's 0.01:
    # with the few thousand calibration tokens a CPU affords, down_proj (K = 4 d) overfits at 0.01.
    damp: float = 0.05
    block_size: int = 128  # columns per lazy-update block (rounded up to a multiple of the group)
    # Quantize columns by decreasing Hessian diagonal. Groups stay static and contiguous (see gptq.py),
    # so unlike act-order with g_idx it costs nothing at inference.
    act_order: bool = True
    true_sequential: bool = True  # q/k/v, then o, then gate/up, then down see already-quantized inputs
    # Damps to choose from per matrix, by output error on held-out calibration tokens (gptq.py);
    # empty: always `damp`. Costs one extra GPTQ per candidate.
    damp_grid: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "damp_grid", tuple(self.damp_grid))  # a JSON list from config.json


@dataclass(frozen=True)
class AWQSettings:
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    # AutoAWQ's two departures from the paper, off by default: mixed on the reference model and worse
    # on the student (bench/quantize.py's `int4-awq-g32 autoawq` rows; see compile/quant/awq.py):
    duo: bool = False  # s = |x|^a / |w|^(1-a) (AutoAWQ's duo_scaling); False: the paper's s = |x|^a
    objective: Literal["linear", "block"] = "linear"  # "block": q/k/v scored on the attention output and
    # gate/up on the MLP output (AutoAWQ); "linear": on the consumers' own outputs (the paper)
    max_tokens: int = 4096  # calibration tokens (a uniform sample) scoring each candidate scaling (AutoAWQ: all)
    clip: bool = True  # then search a clipping range per group (AutoAWQ's auto_clip)
    clip_grid: int = 20  # clip ratios 1, 1 - 1/clip_grid, ..., 1 - clip_max_shrink
    clip_max_shrink: float = 0.5
    clip_tokens: int = 512  # of the max_tokens sample, the rows used to score clip ratios (AutoAWQ: 512)


@dataclass(frozen=True)
class RotationSettings:
    kind: Literal["hadamard", "orthogonal"] = "hadamard"  # orthogonal: Haar-random, the fallback/baseline
    seed: int = 0  # the random signs (or matrix): fixed, so a recipe always gives the same model


@dataclass(frozen=True)
class QuantRecipe:
    name: str
    weights: WeightFormat
    method: Method = "rtn"
    activations: Activations = "none"
    embedding: WeightFormat | None = None  # None: embeddings stay float
    lm_head: WeightFormat | None = None  # None: output head stays float; tied heads share the embedding's
    overrides: tuple[tuple[str, WeightFormat | None], ...] = ()  # (fnmatch pattern, format | None=float)
    keep_float: tuple[str, ...] = ()  # fnmatch patterns of modules never quantized
    gptq: GPTQSettings = field(default_factory=GPTQSettings)
    awq: AWQSettings = field(default_factory=AWQSettings)
    rotation: RotationSettings | None = None  # None: no rotation
    smoothing: bool = False  # the int8 activations' power-of-two smoothing (compile/quant/smoothing.py)
    outlier_split: int = 0  # k > 0: int8 activations of decoder linears in two rows, split at 1/k of the peak
    outlier_channels: int = 0  # N > 0: the N largest input channels of each decoder linear kept float

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing reads calibration text (GPTQ/AWQ's statistics, the smoothing's maxima, the
        float outlier channels)."""
        return self.method != "rtn" or self.smoothing or self.outlier_channels > 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.method != "rtn" and self.weights.kind != "int":
            raise UserError(f"{self.method} needs integer weights; fp8 is round-to-nearest only")
        if self.activations == "int8-per-token" and self.weights.kind != "int":
            raise UserError("dynamic int8 activations need integer weights")

    def format_for(self, name: str, role: Role) -> WeightFormat | None:
        """The format of module `name` (None: keep it float). keep_float beats overrides beats the role."""
        if any(fnmatchcase(name, p) for p in self.keep_float):
            return None
        for pattern, fmt in self.overrides:
            if fnmatchcase(name, pattern):
                return fmt
        return {"linear": self.weights, "embedding": self.embedding, "lm_head": self.lm_head}[role]

    def replace(self, **changes: Any) -> "QuantRecipe":
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, WeightFormat | None], name: str | None = None) -> "QuantRecipe":
        merged = tuple(overrides.items()) + self.overrides  # the new, exact names take precedence
        return self.replace(overrides=merged, name=name or self.name)

    # ---- JSON (config.json's quantization_config) --------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        fmt = lambda f: None if f is None else f.to_dict()  # noqa: E731
        return {
            "name": self.name,
            "weights": self.weights.to_dict(),
            "method": self.method,
            "activations": self.activations,
            "embedding": fmt(self.embedding),
            "lm_head": fmt(self.lm_head),
            "overrides": [[p, fmt(f)] for p, f in self.overrides],
            "keep_float": list(self.keep_float),
            "gptq": dataclasses.asdict(self.gptq),
            "awq": dataclasses.asdict(self.awq),
            "rotation": None if self.rotation is None else dataclasses.asdict(self.rotation),
            "smoothing": self.smoothing,
            "outlier_split": self.outlier_split,
            "outlier_channels": self.outlier_channels,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantRecipe":
        fmt = lambda f: None if f is None else WeightFormat.from_dict(f)  # noqa: E731
        try:
            return cls(
                name=d["name"],
                weights=WeightFormat.from_dict(d["weights"]),
                method=d.get("method", "rtn"),
                activations=d.get("activations", "none"),
                embedding=fmt(d.get("embedding")),
                lm_head=fmt(d.get("lm_head")),
                overrides=tuple((p, fmt(f)) for p, f in d.get("overrides", [])),
                keep_float=tuple(d.get("keep_float", [])),
                gptq=GPTQSettings(**d.get("gptq", {})),
                awq=AWQSettings(**d.get("awq", {})),
                rotation=None if d.get("rotation") is None else RotationSettings(**d["rotation"]),
                smoothing=bool(d.get("smoothing", False)),  # absent: quantized before smoothing existed
                outlier_split=int(d.get("outlier_split", 0)),  # absent: before the split existed
                outlier_channels=int(d.get("outlier_channels", 0)),  # absent: before float channels existed
            )
        except (KeyError, TypeError) as e:
            raise UserError(f"quantization_config is malformed ({e}); re-quantize the model") from None


# ---- names ------------------------------------------------------------------------------------------

_EMBEDDINGS = {
    "emb8": WeightFormat("int", 8, 32, True),
    "emb4": WeightFormat("int", 4, 32, True),
    "embf": None,
}
_NAME = re.compile(
    r"^(?P<scheme>int8|int4|8da4w|8da8w|fp8)"
    r"(?:-(?P<method>rtn|gptq-noact|gptq|awq-gptq|awq-noclip|awq))?"
    r"(?:-(?P<group>g\d+|pc))?"
    r"(?:-(?P<sym>sym|asym|fzp))?"
    r"(?:-(?P<k>k))?"
    r"(?:-(?P<emb>emb8|emb4|embf))?"
    r"(?:-(?P<smooth>smooth))?"
    r"(?:-(?P<split>split))?"
    r"(?:-outliers(?P<outliers>\d+))?"
    r"(?:-(?P<rot>rot))?$"
)

# The canonical names, listed in errors and in `edgefinfer quantize --help`.
RECIPE_NAMES: tuple[str, ...] = (
    "int8", "int8-g32",
    "int4-g32", "int4-g64", "int4-g128", "int4-g64-sym", "int4-g32-fzp", "int4-gptq-g32-fzp",
    "int4-g32-fzp-k", "int4-gptq-g32-fzp-k",
    "int4-gptq-g32", "int4-gptq-g64", "int4-gptq-g128", "int4-gptq-g64-sym", "int4-gptq-noact-g64-sym",
    "int4-awq-g32", "int4-awq-g64", "int4-awq-g128", "int4-awq-g64-sym", "int4-awq-noclip-g32", "int4-awq-gptq-g32",
    "8da4w-g32", "8da4w-g64", "8da4w-g128", "8da4w-g32-fzp", "8da4w-g32-fzp-smooth", "8da4w-g32-fzp-split", "8da4w-g32-fzp-outliers16",
    "8da4w-gptq-g32-fzp", "8da8w",
    "fp8",
)


def parse_recipe(name: str) -> QuantRecipe:
    """A recipe from its name (see the module docstring for the grammar)."""
    m = _NAME.match(name.strip().lower())
    if m is None:
        raise UserError(f"unknown recipe {name!r}: use one of {', '.join(RECIPE_NAMES)} "
                        "(grammar: SCHEME[-rtn|gptq|gptq-noact|awq|awq-noclip|awq-gptq][-gN|-pc][-sym|-asym|-fzp][-k][-emb8|-emb4|-embf][-smooth][-split][-outliersN][-rot])")
    scheme, method, group, sym, k_quant, emb, smooth, split, outliers, rot = (
        m[k] for k in ("scheme", "method", "group", "sym", "k", "emb", "smooth", "split", "outliers", "rot"))
    if k_quant and (scheme != "int4" or sym != "fzp" or group not in (None, "g32") or method == "gptq-noact"):
        raise UserError(f"recipe {name!r}: -k (GGUF Q4_K super-blocks) takes int4[-rtn|-gptq|-awq|-awq-gptq]-g32-fzp-k: "
                        "groups of 32 with float minima, their parameters chosen before the codes (not gptq-noact)")
    for suffix, given in (("smooth", smooth), ("split", split), (f"outliers{outliers}", outliers)):
        if given and scheme not in ("8da4w", "8da8w"):
            raise UserError(f"recipe {name!r}: -{suffix} is for int8 activations, which only 8da4w and 8da8w "
                            f"have; drop -{suffix}")
    if outliers is not None and not 1 <= int(outliers) <= MAX_OUTLIER_CHANNELS:
        raise UserError(f"recipe {name!r}: -outliers{outliers} keeps 1 to {MAX_OUTLIER_CHANNELS} channels float "
                        "per linear; use e.g. -outliers16")
    method = method or "rtn"
    act_order = method != "gptq-noact"
    clip = method != "awq-noclip"
    method = {"gptq-noact": "gptq", "awq-noclip": "awq"}.get(method, method)
    group_size = None if group == "pc" else int(group[1:]) if group else None

    if scheme == "fp8":
        if method != "rtn" or group or sym:
            raise UserError(f"recipe {name!r}: fp8 takes no method, group or symmetry (it is per-channel e4m3)")
        weights = WeightFormat("fp8")
        default_emb: WeightFormat | None = None  # the GPU server keeps embeddings in bf16
    elif scheme == "int8":
        weights = WeightFormat("int", 8, group_size, sym not in ("asym", "fzp"), float_zero=sym == "fzp")
        default_emb = WeightFormat("int", 8, None, True)
    elif scheme == "8da8w":  # XNNPACK's qc8w linear; the embedding and a tied head int8 per row as well
        if group not in (None, "pc") or sym in ("asym", "fzp"):
            raise UserError(f"recipe {name!r}: 8da8w is symmetric per-channel int8 (XNNPACK's qc8w); drop -gN/-asym")
        weights = WeightFormat("int", 8, None, True)
        default_emb = WeightFormat("int", 8, None, True)
    else:  # int4 and 8da4w
        if scheme == "8da4w" and sym == "asym":
            raise UserError(f"recipe {name!r}: 8da4w uses symmetric weights (XNNPACK's layout) or a float zero "
                            "point (-fzp, run as symmetric weights plus group offsets); an integer zero point "
                            "has no XNNPACK kernel: use -sym or -fzp")
        symmetric = sym == "sym" if scheme == "int4" else sym != "fzp"
        if group is None:
            group_size = 32 if scheme == "8da4w" else 64
        scales = "bfloat16" if scheme == "8da4w" else "float16"
        weights = WeightFormat("int", 4, 32 if k_quant else group_size, symmetric, scales, float_zero=sym == "fzp",
                               super_block=SUPER_BLOCK if k_quant else None)
        # 8da4w: int8 per-row, which XNNPACK runs both as the embedding and as a tied head (qc8w).
        default_emb = WeightFormat("int", 8, None, True) if scheme == "8da4w" else _EMBEDDINGS["emb8"]
    if weights.group_size is not None and weights.group_size & (weights.group_size - 1):
        raise UserError(f"recipe {name!r}: group size {weights.group_size} is not a power of two "
                        "(ONNX MatMulNBits and XNNPACK need 16, 32, 64, 128, ...)")
    embedding = _EMBEDDINGS[emb] if emb else default_emb
    if scheme == "8da4w" and embedding is not None and embedding.bits == 4:  # a tied 4-bit head is qb4w too
        embedding = dataclasses.replace(embedding, scale_dtype="bfloat16")
    return QuantRecipe(
        name=name,
        weights=weights,
        method=method,  # type: ignore[arg-type]
        activations="int8-per-token" if scheme in ("8da4w", "8da8w") else "none",
        embedding=embedding,
        lm_head=embedding,
        gptq=GPTQSettings(act_order=act_order),
        awq=AWQSettings(clip=clip),
        rotation=RotationSettings() if rot else None,
        smoothing=bool(smooth),
        outlier_split=SPLIT_RATIO if split else 0,
        outlier_channels=int(outliers or 0),
    )


RECIPES: dict[str, QuantRecipe] = {n: parse_recipe(n) for n in RECIPE_NAMES}
