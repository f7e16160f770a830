"""Quantize a model with a recipe: RTN, GPTQ or AWQ on the decoder linears, RTN on embeddings / head.

`quantize_model(model, recipe, calib)` rewrites `model` in place (nn.Linear -> QuantLinear /
Fp8Linear, nn.Embedding -> QuantEmbedding) and returns a `QuantResult` with the per-layer formats
and timings. The rewritten model is still our `Transformer`: same forward, same cache contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn

from edgefinfer.compile.quant import awq as awq_mod
from edgefinfer.compile.quant.calibrate import (INPUT_GROUPS, ActivationSampler, HessianAccumulator, LayerRunner,
                                                capture_inputs)
from edgefinfer.compile.quant.gptq import gptq_damp_sweep, gptq_quantize
from edgefinfer.model.transformer import first_rows
from edgefinfer.compile.quant.modules import Fp8Linear, QuantEmbedding, QuantLinear, model_size_bytes, tied_head
from edgefinfer.compile.quant.outliers import decoder_int8_linears, keep_outliers_float
from edgefinfer.compile.quant.primitives import IntWeights, quantize_fp8, quantize_int
from edgefinfer.compile.quant.recipe import QuantRecipe, WeightFormat
from edgefinfer.compile.quant.rotation import check_rotatable, rotate_model
from edgefinfer.compile.quant.smoothing import smooth_mlp_inputs, smoothing_exponents
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

Progress = Callable[[str], None]
EMBEDDING, LM_HEAD = "model.embed_tokens", "lm_head"


@dataclass
class QuantResult:
    recipe: QuantRecipe
    formats: dict[str, WeightFormat | None]  # every linear / embedding -> its format (None = float)
    seconds: float
    size_bytes: int
    tied_head: bool
    layer_seconds: list[float] = field(default_factory=list)
    awq_gain: list[float] = field(default_factory=list)  # per scaling group: RTN loss / AWQ loss
    clip_gain: list[float] = field(default_factory=list)  # per clipped linear: loss unclipped / clipped
    gptq_damp: dict[str, float] = field(default_factory=dict)  # per GPTQ matrix: the damp used
    head_method: str = "rtn"  # how lm_head was quantized (gptq: on the final hidden states, when untied)
    smoothing: dict[int, int] = field(default_factory=dict)  # layer -> largest power of two its MLP input shrank by

    def bits_table(self) -> dict[str, str]:
        return {name: "float" if f is None else f.label() for name, f in self.formats.items()}


def plan_formats(model: Transformer, recipe: QuantRecipe) -> dict[str, WeightFormat | None]:
    """The format of every linear and the embedding, validated against the model's shapes up front
    (a group size that does not divide a dimension fails before any work is done). A rotated recipe
    unties the head (see rotation.py), so the tied-format check applies only without one."""
    plan: dict[str, WeightFormat | None] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            role = "lm_head" if name == LM_HEAD else "linear"
            plan[name] = recipe.format_for(name, role)
    plan[EMBEDDING] = recipe.format_for(EMBEDDING, "embedding")
    for name, fmt in plan.items():
        if fmt is None:
            continue
        k = model.get_submodule(name).weight.shape[1]
        if fmt.kind == "int":
            fmt.group_for(k, name)
            plan[name] = fmt.for_width(k)  # K-quant super-blocks only where they divide the row
    if model.config.tie_word_embeddings and recipe.rotation is None and plan[EMBEDDING] != plan[LM_HEAD]:
        label = lambda f: "float" if f is None else f.label()  # noqa: E731
        raise UserError(f"the model ties lm_head to its embeddings, but the recipe gives them different formats "
                        f"({label(plan[EMBEDDING])} vs {label(plan[LM_HEAD])}): give both the same one")
    if plan[EMBEDDING] is not None and plan[EMBEDDING].kind != "int":
        raise UserError("embeddings can be quantized to integers only (use -emb8, -emb4 or -embf)")
    return plan


def _smooth(model: Transformer, plan: dict[str, WeightFormat | None], calib: Tensor | None, result: QuantResult,
            say: Progress) -> None:
    """Power-of-two smoothing of the int8 activations (see smoothing.py); skipped, and said, when no
    calibration blocks were given (`edgefinfer build` and `quantize` always give them)."""
    if calib is None or calib.numel() == 0:
        say("[smooth] no calibration blocks: int8 activations left unsmoothed")
        return
    t = time.perf_counter()
    factors = smoothing_exponents(model, calib, plan)
    smooth_mlp_inputs(model, factors)
    result.smoothing = {i: 1 << int(e.max()) for i, (_, e) in factors.items()}
    top = max(result.smoothing.values(), default=1)
    say(f"[smooth] {len(factors)} of {len(model.model.layers)} MLP inputs shrunk by powers of two "
        f"(largest {top}x), {time.perf_counter() - t:.1f}s")


def set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def _quantized_linear(linear: nn.Linear, fmt: WeightFormat, act_quant: bool, name: str,
                      weights: IntWeights | None = None) -> nn.Module:
    if fmt.kind == "fp8":
        return Fp8Linear.from_float(linear, quantize_fp8(linear.weight))
    weights = weights if weights is not None else quantize_int(linear.weight, fmt, name)
    return QuantLinear.from_float(linear, fmt, weights, act_quant, name)


def quantize_model(model: Transformer, recipe: QuantRecipe, calib: Tensor | None = None,
                   progress: Progress | None = None, batch_size: int = 8) -> QuantResult:
    """Quantize `model` in place. `calib` [N, S] token blocks are needed by GPTQ and AWQ."""
    t0 = time.perf_counter()
    if recipe.rotation is not None:
        check_rotatable(model)
    plan = plan_formats(model, recipe)
    say = progress or (lambda _msg: None)
    act_quant = recipe.activations == "int8-per-token"
    calibrated = recipe.method != "rtn"
    if calibrated and (calib is None or calib.numel() == 0):
        raise UserError(f"{recipe.method} needs calibration data, but the calibration set is empty: "
                        "pass calibration blocks (e.g. --calib-blocks 32) or use an RTN recipe")
    # Rotation first: every method (and the calibration activations) then sees the rotated weights.
    if recipe.rotation is not None:
        rot = rotate_model(model, recipe.rotation.kind, recipe.rotation.seed)
        say(f"[rotation] R1 {rot.residual}, R2 {rot.head} per head, {rot.seconds:.1f}s"
            + (f"; head untied (+{rot.extra_parameters / 1e6:.1f}M parameters)" if rot.untied else ""))
    result = QuantResult(recipe, plan, 0.0, 0, model.config.tie_word_embeddings)
    if recipe.smoothing:  # on the float (rotated) model, before anything is rounded
        _smooth(model, plan, calib, result, say)

    # Embeddings first, so calibration activations start from the quantized lookup.
    _quantize_embedding_and_head(model, plan, act_quant)
    layers = model.model.layers
    if calibrated:
        runner = LayerRunner(model, calib, batch_size)
        say(f"[{recipe.method}] calibrating on {calib.shape[0]} blocks x {calib.shape[1]} tokens, "
            f"{len(layers)} layers")
        for i, layer in enumerate(layers):
            t = time.perf_counter()
            prefix = f"model.layers.{i}."
            fmts = {n: plan[prefix + n] for grp in INPUT_GROUPS for n in grp}
            if recipe.method in ("awq", "awq-gptq"):  # awq-gptq: fold AWQ's scales, leave rounding to GPTQ
                _awq_layer(layer, runner, fmts, recipe, act_quant, prefix, result, quantize=recipe.method == "awq")
            if recipe.method in ("gptq", "awq-gptq"):
                _gptq_layer(layer, runner, fmts, recipe, act_quant, prefix, result)
            runner.advance(layer)
            result.layer_seconds.append(time.perf_counter() - t)
            say(f"[{recipe.method}] layer {i + 1:3d}/{len(layers)}  {result.layer_seconds[-1]:6.2f}s  "
                f"elapsed {time.perf_counter() - t0:7.1f}s")
        if recipe.method != "awq":
            result.head_method = _gptq_head(model, runner, plan, recipe, act_quant, result)
        del runner

    # RTN for whatever is still float and planned (all decoder linears for RTN recipes).
    for name, fmt in plan.items():
        module = model.get_submodule(name)
        if fmt is None or not isinstance(module, nn.Linear):
            continue
        set_module(model, name, _quantized_linear(module, fmt, act_quant, name))
    if recipe.outlier_split and act_quant:  # decoder linears only: the head's input is one norm's output
        for _, module in decoder_int8_linears(model):
            module.act_split = recipe.outlier_split
    if recipe.outlier_channels and act_quant:  # on the quantized model: the inputs it will see
        t = time.perf_counter()
        count = keep_outliers_float(model, calib, recipe.outlier_channels, batch_size)
        say(f"[outliers] {recipe.outlier_channels} float input channels in each of {count} linears, "
            f"{time.perf_counter() - t:.1f}s")

    result.seconds = time.perf_counter() - t0
    result.size_bytes = model_size_bytes(model)
    say(f"[{recipe.method}] done in {result.seconds:.1f}s, {result.size_bytes / 1e6:.2f} MB")
    return result


def _quantize_embedding_and_head(model: Transformer, plan: dict[str, WeightFormat | None], act_quant: bool) -> None:
    emb_fmt = plan[EMBEDDING]
    emb = model.model.embed_tokens
    if model.config.tie_word_embeddings:
        if emb_fmt is not None:
            qemb = QuantEmbedding.from_float(emb, emb_fmt, quantize_int(emb.weight, emb_fmt, EMBEDDING))
            model.model.embed_tokens = qemb
            model.lm_head = tied_head(qemb, act_quant)
        return
    if emb_fmt is not None:
        model.model.embed_tokens = QuantEmbedding.from_float(emb, emb_fmt, quantize_int(emb.weight, emb_fmt, EMBEDDING))
    # An untied head is quantized with the decoder linears (RTN), like any other linear.


# ---- GPTQ ------------------------------------------------------------------------------------------------

def _gptq_layer(layer: nn.Module, runner: LayerRunner, fmts: dict[str, WeightFormat | None], recipe: QuantRecipe,
                act_quant: bool, prefix: str, result: QuantResult) -> None:
    groups = [g for g in INPUT_GROUPS if any(fmts[n] is not None and fmts[n].kind == "int" for n in g)]
    # true_sequential: one pass per input group, so o_proj sees quantized q/k/v, etc.
    stages = [[g] for g in groups] if recipe.gptq.true_sequential else [groups]
    for stage in stages:
        hessians = HessianAccumulator(halves=bool(recipe.gptq.damp_grid))
        heads = [g[0] for g in stage]
        with capture_inputs(layer, heads, hessians, stop_after=heads[-1]):
            runner.run(layer, until_stop=True)
        for grp in stage:
            _gptq_group(layer, grp, hessians, fmts, recipe, act_quant, prefix, result)


def _gptq_group(root: nn.Module, names: tuple[str, ...], hessians: HessianAccumulator,
                fmts: dict[str, WeightFormat | None], recipe: QuantRecipe, act_quant: bool, prefix: str,
                result: QuantResult) -> None:
    """GPTQ on linears sharing an input (the Hessian of names[0]'s input): rows are independent given H,
    so same-format linears are solved as one stacked matrix."""
    by_format: dict[WeightFormat, list[str]] = {}
    for n in names:
        fmt = fmts[n]
        if fmt is not None and fmt.kind == "int":
            by_format.setdefault(fmt, []).append(n)
    H = hessians.hessian(names[0])
    for fmt, members in by_format.items():
        linears = [root.get_submodule(n) for n in members]
        W = torch.cat([lin.weight.detach() for lin in linears])  # [sum N_i, K]
        where = prefix + members[0]
        if recipe.gptq.damp_grid:
            fit, val = hessians.hessian(names[0], 0), hessians.hessian(names[0], 1)
            q, damp = gptq_damp_sweep(W, fit, val, H, fmt, recipe.gptq, where)
        else:
            q, damp = gptq_quantize(W, H, fmt, recipe.gptq, where), recipe.gptq.damp
        result.gptq_damp.update({prefix + n: damp for n in members})
        row = 0
        for n, lin in zip(members, linears):
            rows = slice(row, row + lin.out_features)
            part = IntWeights(q.codes[rows], q.scales[rows], q.zeros[rows])
            set_module(root, n, _quantized_linear(lin, fmt, act_quant, prefix + n, part))
            row += lin.out_features


def _gptq_head(model: Transformer, runner: LayerRunner, plan: dict[str, WeightFormat | None], recipe: QuantRecipe,
               act_quant: bool, result: QuantResult) -> str:
    """GPTQ on an untied lm_head, from the final hidden states (after the last layer and the final norm).

    A tied head is the embedding table too: a lookup has no input Hessian, and GPTQ's error
    compensation across columns would move every looked-up row further from its float value than
    rounding does, so tied heads stay round-to-nearest (with the embedding)."""
    fmt = plan[LM_HEAD]
    if model.config.tie_word_embeddings or fmt is None or fmt.kind != "int" or not isinstance(model.lm_head, nn.Linear):
        return "rtn"
    hessians = HessianAccumulator(halves=bool(recipe.gptq.damp_grid))
    with torch.no_grad():
        for x in runner.hidden.split(runner.batch_size):
            hessians(LM_HEAD, model.model.norm(x).reshape(-1, x.shape[-1]).float())
    _gptq_group(model, (LM_HEAD,), hessians, plan, recipe, act_quant, "", result)
    return "gptq"


# ---- AWQ -------------------------------------------------------------------------------------------------

def _awq_layer(layer: nn.Module, runner: LayerRunner, fmts: dict[str, WeightFormat | None], recipe: QuantRecipe,
               act_quant: bool, prefix: str, result: QuantResult, quantize: bool = True) -> None:
    """AWQ's scale search and fold, then (awq.clip) its clipping search, then RTN. quantize=False stops
    after the scales (awq-gptq: GPTQ does the rounding, compensating error itself)."""
    groups = awq_mod.scaling_groups(layer)
    sampler = ActivationSampler(recipe.awq.max_tokens, runner.tokens)
    inputs = [grp[0] for grp in INPUT_GROUPS]  # every linear's input: the clip search needs o_proj's too
    seq_len = runner.positions.shape[1]
    # The attention block's objective needs whole sequences: the first calibration blocks, up to
    # max_tokens (and one runner chunk, whose rotary tables they use).
    n_seqs = max(1, min(runner.batch_size, recipe.awq.max_tokens // seq_len)) if recipe.awq.objective == "block" else 0
    sequences: list[Tensor] = []

    def on_input(name: str, x: Tensor) -> None:
        sampler(name, x)
        kept = sum(t.shape[0] for t in sequences)
        if name == "self_attn.q_proj" and kept < n_seqs:
            sequences.append(x.reshape(-1, seq_len, x.shape[-1])[: n_seqs - kept].clone())

    with capture_inputs(layer, inputs, on_input, stop_after="mlp.down_proj"):
        runner.run(layer, until_stop=True)
    source = {n: grp[0] for grp in INPUT_GROUPS for n in grp}  # linear -> the captured input it reads
    folded: dict[str, Tensor] = {}  # captured input -> the scale its consumers' inputs were divided by
    for g in groups:
        formats = [fmts[n] if fmts[n] is not None and fmts[n].kind == "int" else None for n in g.consumers]
        if all(f is None for f in formats):
            continue
        consumers = [layer.get_submodule(n) for n in g.consumers]
        weights = [c.weight for c in consumers]
        x = sampler.rows(g.inputs)
        objective = None  # the consumers' own outputs
        if recipe.awq.objective == "block" and g.producer == "input_layernorm":
            seqs = torch.cat(sequences)
            b = seqs.shape[0]
            attn = layer.self_attn
            objective = awq_mod.block_objective(
                lambda h: attn(h, first_rows(runner.ropes, b), runner.positions[:b], None), seqs, consumers, formats)
        elif recipe.awq.objective == "block" and g.producer == layer.mlp_norm_name:
            objective = awq_mod.block_objective(layer.mlp, x, consumers, formats)
        s, loss, rtn_loss = awq_mod.search_scale(x, sampler.mean_abs(g.inputs), weights, formats, recipe.awq, objective)
        awq_mod.fold_scale(layer, g, s)
        folded[source[g.consumers[0]]] = s
        result.awq_gain.append(rtn_loss / loss if loss > 0 else 1.0)
    if not quantize:
        return
    for grp in INPUT_GROUPS:
        for n in grp:
            fmt = fmts[n]
            if fmt is None:
                continue
            linear = layer.get_submodule(n)
            if recipe.awq.clip and fmt.kind == "int" and n not in awq_mod.CLIP_SKIP:
                x = sampler.rows(source[n])
                x = x[:: max(1, x.shape[0] // recipe.awq.clip_tokens)][: recipe.awq.clip_tokens]  # spread evenly
                if source[n] in folded:
                    x = x / folded[source[n]]  # what the linear reads after the fold
                ratios, loss, unclipped = awq_mod.search_clip(x, linear.weight, fmt, recipe.awq)
                awq_mod.apply_clip(linear, ratios, fmt)
                result.clip_gain.append(unclipped / loss if loss > 0 else 1.0)
            set_module(layer, n, _quantized_linear(linear, fmt, act_quant, prefix + n))
