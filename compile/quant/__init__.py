"""edgefinfer.compile.quant: int8, int4 (RTN, GPTQ, AWQ), 8da4w, FP8 and mixed-precision quantization.

    recipe = parse_recipe("int4-awq-g64")
    result = quantize_model(model, recipe, calib_blocks)   # model rewritten in place
    save_quantized(model, result.recipe, "out/", tokenizer_dir=src)
    model = load_quantized("out/")

docs/QUANTIZATION.md describes the formats, the methods and the measured results.
"""

import importlib
from pathlib import Path
from typing import Any

# This package's source files: the artefact cache keys every exporter that quantizes (or traces the
# modules quantization swaps in) on them.
SOURCES: tuple[Path, ...] = tuple(sorted(Path(__file__).parent.glob("*.py")))

# Names re-exported lazily: importing the package (the CLI does, to list `quantize`) must not pull
# torch in; each name loads its module on first use.
_EXPORTS = {
    "apply": ("QuantResult", "plan_formats", "quantize_model"),
    "layouts": ("MatMulNBitsWeights", "matmulnbits_reference", "to_gguf_q4_0", "to_gguf_q4_1", "to_gguf_q8_0",
                "to_matmulnbits", "to_torchao", "torchao_model"),
    "modules": ("Fp8Linear", "QuantEmbedding", "QuantLinear", "model_size_bytes"),
    "recipe": ("RECIPE_NAMES", "RECIPES", "QuantRecipe", "WeightFormat", "parse_recipe"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
