"""Checkpoint in, pruned checkpoint + JSON report out: what `edgefinfer prune` and the benchmark run."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edgefinfer.model.checkpoint import load_model, save_model
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.prune.calibration import calibration_blocks
from edgefinfer.prune.masks import check_sparsity, parse_pattern, sparsity_of
from edgefinfer.prune.sensitivity import allocate_sparsity, layer_sensitivity
from edgefinfer.prune.structured import Shape, parameter_count, parse_budget, prune_structured, solve_budget
from edgefinfer.prune.unstructured import (METHODS, UnstructuredSpec, layer_sparsities, linear_weights,
                                           nonzero_parameters, prune_unstructured)

REPORT_NAME = "prune_report.json"
ALL_METHODS = (*METHODS, "structured")


@dataclass(frozen=True)
class PruneOptions:
    method: str = "wanda"
    sparsity: float = 0.5
    pattern: str | None = None  # "2:4"
    allocation: str = "uniform"  # | "sensitivity"
    spread: float = 0.1  # sensitivity allocation: +/- around the target
    sensitivity_blocks: int = 4  # calibration blocks (the last ones) on which each layer's ppl delta is measured
    params: str | None = None  # structured: budget, "0.5" or "60M"
    layers: int | None = None
    kv_heads: int | None = None
    heads: int | None = None
    multiple_of: int = 32
    calib_blocks: int = 32
    calib_len: int = 256
    eval_tokens: int = 4096  # test-split tokens for perplexity before/after; 0 skips it
    seed: int = 0

    def validate(self) -> None:
        if self.method not in ALL_METHODS:
            raise UserError(f"unknown pruning method {self.method!r}; use one of {', '.join(ALL_METHODS)}")
        check_sparsity(self.sparsity)
        if self.pattern is not None:
            parse_pattern(self.pattern)
            if self.method == "structured":
                raise UserError("an N:M pattern applies to unstructured methods, not to --method structured")
        if self.allocation not in ("uniform", "sensitivity"):
            raise UserError(f"allocation must be 'uniform' or 'sensitivity', got {self.allocation!r}")
        if self.method == "structured" and self.params is None:
            raise UserError("structured pruning needs a parameter budget: --params 0.5 (fraction) or 60M (count)")
        if self.allocation == "sensitivity" and not 0 < self.sensitivity_blocks <= self.calib_blocks:
            raise UserError(f"sensitivity needs 1..{self.calib_blocks} scoring blocks, got {self.sensitivity_blocks}")
        if self.calib_blocks <= 0 or self.calib_len <= 1:
            raise UserError("calibration needs at least one block of at least two tokens")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def eval_ids(tokenizer, max_tokens: int) -> list[int]:
    from edgefinfer.data.corpora import load_text

    return tokenizer.encode(load_text("test"))[:max_tokens]


def test_perplexity(model: Transformer, ids: list[int]) -> float | None:
    from edgefinfer.data.evaluate import perplexity

    return perplexity(model, ids, window=512, stride=512).ppl if len(ids) > 1 else None


def prune_model(model: Transformer, opts: PruneOptions, calib: torch.Tensor, quiet: bool = False) -> tuple[Transformer, dict]:
    """Apply `opts` to `model` (unstructured: in place) and return the pruned model and what was done."""
    opts.validate()
    say = None if quiet else log
    info: dict = {}
    if opts.method == "structured":
        budget = parse_budget(opts.params, model.config)  # type: ignore[arg-type]
        shape = solve_budget(model.config, budget, opts.layers, opts.kv_heads, opts.heads, opts.multiple_of)
        pruned, kept = prune_structured(model, calib, shape)
        info.update(budget=budget, shape=asdict(shape), kept_layers=kept.layers)
        return pruned, info
    pattern = parse_pattern(opts.pattern) if opts.pattern else None
    layer_sparsity = None
    if opts.allocation == "sensitivity":
        if pattern is not None:
            raise UserError("an N:M pattern fixes every layer's sparsity; use --allocation uniform with --pattern")
        probe = UnstructuredSpec(opts.method, opts.sparsity)
        scored = calib[-opts.sensitivity_blocks:]  # a few blocks suffice to rank layers; 30 evaluations add up
        sensitivity = layer_sensitivity(model, probe, calib, scored, say)
        layer_sparsity = allocate_sparsity(sensitivity, opts.sparsity, opts.spread)
        info.update(sensitivity_ppl_delta=sensitivity, layer_sparsity=list(layer_sparsity))
    spec = UnstructuredSpec(opts.method, opts.sparsity, pattern, layer_sparsity)
    prune_unstructured(model, spec, calib if opts.method != "magnitude" else None, log=say)
    info["measured_layer_sparsity"] = [round(s, 5) for s in layer_sparsities(model)]
    return model, info


def prune_checkpoint(src: str | Path, dest: str | Path, opts: PruneOptions, quiet: bool = False) -> dict:
    """Load `src`, prune, write an HF folder at `dest` with `prune_report.json`; returns the report."""
    from edgefinfer.tokenization.tokenizer import Tokenizer

    opts.validate()
    t0 = time.perf_counter()
    model = load_model(src)
    tokenizer = Tokenizer.from_dir(src)
    params_before = parameter_count(model)
    ids = eval_ids(tokenizer, opts.eval_tokens) if opts.eval_tokens else []
    ppl_before = test_perplexity(model, ids)
    calib = calibration_blocks(tokenizer, opts.calib_blocks, opts.calib_len, opts.seed)
    t_prune = time.perf_counter()
    pruned, info = prune_model(model, opts, calib, quiet)
    prune_s = time.perf_counter() - t_prune
    ppl_after = test_perplexity(pruned, ids)
    report = {
        "source": str(src),
        "method": opts.method,
        "options": asdict(opts),
        "params_before": params_before,
        "params_after": parameter_count(pruned),
        "nonzero_params": nonzero_parameters(pruned),
        "sparsity": round(sparsity_of(linear_weights(pruned)), 6),  # over the decoder layers' Linear weights
        "shape": asdict(Shape.of(pruned.config)),
        "test_ppl_before": ppl_before,
        "test_ppl_after": ppl_after,
        "eval_tokens": len(ids),
        "prune_seconds": round(prune_s, 2),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        **info,
    }
    save_model(pruned, dest, tokenizer_dir=src, extra_files={REPORT_NAME: json.dumps(report, indent=2) + "\n"})
    return report
