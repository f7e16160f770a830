"""The quantization recipe type, re-exported: it lives in the foundation (`edgefinfer.bundle.quant_recipe`)
so that artefact descriptions and runtimes can hold one without importing the exporters."""

from edgefinfer.bundle.quant_recipe import (RECIPE_NAMES, RECIPES, AWQSettings, GPTQSettings, QuantRecipe,  # noqa: F401
                                     RotationSettings, WeightFormat, parse_recipe)
