"""`edgefinfer quantize MODEL --recipe int4-awq-g64 -o OUT`: quantize, evaluate, write checkpoint + report."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import click

from edgefinfer.compile.quant.recipe import RECIPE_NAMES
from edgefinfer.errors import UserError

REPORT_FILE = "quantization_report.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|kib|mib|gib)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

# The calibration `edgefinfer build` quantizes with (app/build.py's quantize_for): 16 blocks of 256 tokens,
# seed 0, from the mixed text (Austen, plays, the Old Testament, code), so that `quantize` and `build`
# give the same model for the same recipe.
CALIB_SPLIT, CALIB_BLOCKS, CALIB_LEN, CALIB_SEED = "calib-mix", 16, 256, 0


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    if m is None:
        raise UserError(f"cannot read the size {text!r}: use bytes or a number with KB/MB/GB/MiB (e.g. 85MB), "
                        "or a recipe name to match its uniform size (e.g. int4-g32-sym)")
    return int(float(m[1]) * _UNITS[m[2].lower() if m[2] else None])


@click.command(name="quantize")
@click.argument("model", default="smollm2-135m")
@click.option("-r", "--recipe", "recipe_name", required=True,
              help=f"Quantization recipe, e.g. {', '.join(RECIPE_NAMES[:4])}, int4-awq-g64, 8da4w-g32, fp8 "
                   "(see docs/QUANTIZATION.md for the grammar).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Output folder.")
@click.option("--calib-blocks", default=CALIB_BLOCKS, show_default=True, type=int,
              help="Calibration blocks (GPTQ/AWQ/mixed).")
@click.option("--calib-len", default=CALIB_LEN, show_default=True, type=click.IntRange(16), help="Tokens per block.")
@click.option("--calib-split", default=CALIB_SPLIT, show_default=True,
              help="Corpus split to calibrate on (see docs/DATA.md): calib-mix is what `build` uses, calib is Austen only.")
@click.option("--calib-text", type=click.Path(path_type=Path, dir_okay=False),
              help="Calibration text file (instead of --calib-split).")
@click.option("--eval-tokens", default=4096, show_default=True, type=click.IntRange(0),
              help="Test tokens for perplexity / KL / top-1 (0 = skip the evaluation).")
@click.option("--window", default=512, show_default=True, type=click.IntRange(2), help="Evaluation window.")
@click.option("--stride", default=256, show_default=True, type=click.IntRange(1), help="Evaluation stride.")
@click.option("--mixed-budget", default=None,
              help="Mixed precision under a size budget: bytes (85MB) or a recipe whose uniform size to match.")
@click.option("--mixed-max-ppl", type=float, default=None,
              help="Mixed precision: smallest model whose predicted perplexity increase stays under this percent.")
@click.option("--mixed-high", default="int8-g32", show_default=True,
              help="The higher-precision recipe mixed precision may give sensitive units.")
@click.option("--mixed-unit", type=click.Choice(["layer", "linear"]), default="layer", show_default=True,
              help="Sensitivity granularity: whole decoder layers (fast) or single linears.")
@click.option("--sensitivity-tokens", default=512, show_default=True, type=click.IntRange(16),
              help="Calibration tokens used to measure sensitivity.")
@click.option("--seed", default=CALIB_SEED, show_default=True, type=int, help="Seed for the calibration sample.")
@click.option("--requantize-source", is_flag=True,
              help="For a model converted from a GGUF: quantize every matrix to the recipe, also those the GGUF "
              "stored with more bits (default: those stay at 8 bits, as `edgefinfer build` keeps them).")
@click.option("--target", default=None,
              help="The build target the checkpoint is for (e.g. gpu-server): a source GGUF's higher-bit matrices "
              "are kept in formats its artefact holds (a GGUF: Q5_0 / Q8_0; default: per-channel int8, which the "
              ".pte and .onnx exports take).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
def quantize(model: str, recipe_name: str, output: Path, calib_blocks: int, calib_len: int, calib_split: str,
             calib_text: Path | None,
             eval_tokens: int, window: int, stride: int, mixed_budget: str | None, mixed_max_ppl: float | None,
             mixed_high: str, mixed_unit: str, sensitivity_tokens: int, seed: int, requantize_source: bool,
             target: str | None, threads: int | None) -> None:
    """Quantize MODEL with a recipe; write a quantized checkpoint and a JSON report to OUTPUT."""
    import torch

    from edgefinfer.app.model_arg import resolve_model
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.quant.apply import plan_formats, quantize_model
    from edgefinfer.compile.quant.checkpoint import read_quantization_config, save_quantized
    from edgefinfer.compile.quant.recipe import parse_recipe
    from edgefinfer.compile.quant.report import build_report, float_size_bytes, measure_quality, summary_table
    from edgefinfer.tokenization.tokenizer import Tokenizer

    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    say = lambda msg: click.echo(msg, err=True)  # noqa: E731
    recipe = parse_recipe(recipe_name)
    artefact_format = None
    if target is not None:
        from edgefinfer.bundle.targets import get_target

        artefact_format = get_target(target).format  # an unknown name fails here, before any work
    folder = resolve_model(model)
    if (folder / "config.json").is_file() and (done := read_quantization_config(folder)) is not None:
        raise UserError(f"{folder} is already quantized (recipe {done['recipe']['name']}); quantize its float model")
    float_model, qmodel = load_model(folder), load_model(folder)
    plan_formats(qmodel, recipe)  # bad group sizes fail here, before any calibration work
    tok = Tokenizer.from_dir(folder)
    use_mixed = mixed_budget is not None or mixed_max_ppl is not None
    if mixed_budget is not None and mixed_max_ppl is not None:
        raise UserError("give either --mixed-budget or --mixed-max-ppl, not both")
    if mixed_budget is not None and not _is_recipe(mixed_budget):
        parse_size(mixed_budget)  # a malformed budget fails before any work

    calib = None
    if recipe.needs_calibration or use_mixed:
        needs = (recipe.method if recipe.method != "rtn" else "smoothing the int8 activations" if recipe.smoothing
                 else "picking the float outlier channels" if recipe.outlier_channels else "mixed precision")
        calib = _calibration_blocks(tok, calib_text, calib_len, calib_blocks, seed, needs, calib_split)

    extra: dict = {"model": str(folder), "calib_blocks": 0 if calib is None else calib.shape[0],
                   "calib_len": calib_len, "calib_source": str(calib_text) if calib_text else calib_split,
                   "threads": torch.get_num_threads()}
    if use_mixed:
        recipe, extra["mixed_precision"] = _mixed(float_model, recipe, calib, mixed_budget, mixed_max_ppl, mixed_high,
                                                  mixed_unit, sensitivity_tokens, calib_len, say)
        plan_formats(qmodel, recipe)
    elif not requantize_source and (kept := _source_precision(folder, recipe_name, artefact_format, qmodel)):
        per_channel = any(f.group_size is None for f in kept.values())
        say(f"{len(kept)} matrices stay at 8 bits: the GGUF the weights came from stored them with more bits than "
            "the recipe's (--requantize-source to quantize them too)" if per_channel else
            f"{len(kept)} matrices keep their source GGUF's types ({', '.join(sorted({f.label() for f in kept.values()}))})")
        recipe = recipe.with_overrides(kept)
        extra["source_precision"] = sorted(kept)
        plan_formats(qmodel, recipe)

    result = quantize_model(qmodel, recipe, calib, progress=say)
    quality = None
    if eval_tokens:
        from edgefinfer.data.corpora import load_text

        say(f"evaluating on {eval_tokens} test tokens (window {window}, stride {stride})")
        ids = torch.tensor(tok.encode(load_text("test")))
        quality = measure_quality(float_model, qmodel, ids, window, stride, eval_tokens)
    float_bytes = float_size_bytes(float_model)
    extra["wall_seconds"] = time.perf_counter() - t0
    report = build_report(result, quality, float_bytes, extra)
    save_quantized(qmodel, recipe, output, tokenizer_dir=folder,
                   extra_files={REPORT_FILE: json.dumps(report, indent=2) + "\n"})
    click.echo(summary_table(qmodel, result, quality, float_bytes))
    click.echo(f"wrote {output} ({REPORT_FILE} inside)")


def _source_precision(folder: Path, recipe_name: str, artefact_format: str | None, model) -> dict:
    """`edgefinfer build`'s rule: the matrices a source GGUF stored above the recipe's bits, in formats the
    artefact holds (per-channel int8 unless it is a GGUF), at `model`'s widths."""
    from edgefinfer.bundle.recipe import Recipe, for_model, source_precision

    return for_model(source_precision(folder, Recipe.parse(recipe_name), artefact_format), model)


def _is_recipe(text: str) -> bool:
    from edgefinfer.compile.quant.recipe import parse_recipe

    try:
        parse_recipe(text)
    except UserError:
        return False
    return True


def calibration_split(split: str = CALIB_SPLIT) -> str:
    """`split`, or Austen's `calib` where this version of the corpora has no mixed calibration text."""
    from edgefinfer.data.corpora import SPLITS

    return split if split != "calib-mix" or split in SPLITS else "calib"


def default_calibration(tok):
    """The calibration blocks `build` quantizes with (CALIB_BLOCKS x CALIB_LEN of CALIB_SPLIT, CALIB_SEED)."""
    return _calibration_blocks(tok, None, CALIB_LEN, CALIB_BLOCKS, CALIB_SEED, "calibration")


def _calibration_blocks(tok, calib_text: Path | None, calib_len: int, calib_blocks: int, seed: int, method: str,
                        split: str = CALIB_SPLIT):
    from edgefinfer.data.corpora import SPLITS, load_text, token_blocks

    if calib_blocks < 1:
        raise UserError(f"the calibration set is empty (--calib-blocks {calib_blocks}): {method} needs at least one "
                        "block; use --calib-blocks 32 or an RTN recipe")
    if calib_text is not None:
        if not calib_text.is_file():
            raise UserError(f"calibration text {calib_text} does not exist")
        text = calib_text.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise UserError(f"the calibration set is empty: {calib_text} holds no text")
    else:
        split = calibration_split(split)
        if split not in SPLITS:
            raise UserError(f"unknown corpus split {split!r} for --calib-split; choose one of {', '.join(SPLITS)}")
        text = load_text(split)
    ids = tok.encode(text)
    available = len(ids) // calib_len
    if available == 0:
        raise UserError(f"the calibration text has {len(ids)} tokens, less than one block of {calib_len}: "
                        "use a longer text or a smaller --calib-len")
    return token_blocks(ids, calib_len, min(calib_blocks, available), seed=seed)


def _mixed(model, recipe, calib, budget: str | None, max_ppl: float | None, high_name: str, unit: str,
           sensitivity_tokens: int, calib_len: int, say):
    from edgefinfer.compile.quant import mixed
    from edgefinfer.compile.quant.recipe import parse_recipe

    high = parse_recipe(high_name).weights
    formats = [recipe.weights, high]
    units = mixed.size_units(model, mixed.units_of(model, unit), formats)
    fixed = mixed.uniform_size(model, recipe) - sum(u.bytes[recipe.weights.label()] for u in units)
    unit_budget = None
    if budget is not None:
        unit_budget = _budget_bytes(model, budget) - fixed
        mixed.check_budget(units, unit_budget)  # before the (slow) measurement
    blocks = calib[: max(1, math.ceil(sensitivity_tokens / calib_len))]
    say(f"[sensitivity] {unit}s, {blocks.numel()} tokens, formats {recipe.weights.label()} / {high.label()}")
    units = mixed.measure_sensitivity(model, blocks, formats, unit, progress=say)
    if unit_budget is not None:
        alloc = mixed.allocate(units, formats, budget_bytes=unit_budget)
    else:
        alloc = mixed.allocate(units, formats, max_ppl_increase=max_ppl / 100)
    say(mixed.sensitivity_table(units, alloc))
    info = {"unit": unit, "formats": [f.label() for f in formats], "budget": budget, "max_ppl_increase_pct": max_ppl,
            "choice": alloc.choice, "predicted_kl": alloc.predicted_kl, "predicted_dnll": alloc.predicted_dnll,
            "sensitivity": {u.name: {"kl": u.kl, "dnll": u.dnll, "bytes": u.bytes} for u in units}}
    return mixed.mixed_recipe(recipe, alloc), info


def _budget_bytes(model, budget: str) -> int:
    """A byte count, or the uniform size of a recipe name."""
    from edgefinfer.compile.quant import mixed
    from edgefinfer.compile.quant.recipe import parse_recipe

    try:
        recipe = parse_recipe(budget)
    except UserError:
        return parse_size(budget)
    return mixed.uniform_size(model, recipe)
