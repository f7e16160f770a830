"""`edgefinfer prune`: unstructured (magnitude, Wanda, SparseGPT), N:M, and structured pruning."""

from __future__ import annotations

import json

import click

# Literal here so that `edgefinfer --help` does not import torch (pipeline.py checks they agree).
METHODS = ("magnitude", "wanda", "sparsegpt", "structured")


@click.command(name="prune")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--method", type=click.Choice(METHODS), default="wanda", show_default=True,
              help="magnitude | wanda | sparsegpt zero weights in place; structured removes heads/channels/layers.")
@click.option("--sparsity", type=float, default=0.5, show_default=True, help="Fraction of Linear weights set to 0, in [0, 1).")
@click.option("--pattern", default=None, help="Semi-structured N:M, e.g. 2:4 (implies sparsity 1 - N/M).")
@click.option("--allocation", type=click.Choice(["uniform", "sensitivity"]), default="uniform", show_default=True,
              help="Per-layer sparsity: the same everywhere, or from measured per-layer perplexity deltas.")
@click.option("--spread", type=float, default=0.1, show_default=True, help="Sensitivity allocation: +/- around --sparsity.")
@click.option("--sensitivity-blocks", type=int, default=4, show_default=True,
              help="Sensitivity allocation: calibration blocks each layer's perplexity delta is measured on.")
@click.option("--params", default=None, help="Structured: parameter budget, a fraction (0.5) or a count (60M).")
@click.option("--layers", type=int, default=None, help="Structured: decoder layers to keep (lowest angular distance dropped).")
@click.option("--kv-heads", type=int, default=None, help="Structured: KV heads (GQA groups) to keep per layer.")
@click.option("--heads", type=int, default=None, help="Structured: query heads per layer (a multiple of --kv-heads).")
@click.option("--multiple-of", type=int, default=32, show_default=True, help="Structured: MLP width granularity.")
@click.option("--calib-blocks", type=int, default=32, show_default=True, help="Calibration blocks from the calib split.")
@click.option("--calib-len", type=int, default=256, show_default=True, help="Tokens per calibration block.")
@click.option("--eval-tokens", type=int, default=4096, show_default=True,
              help="Test-split tokens for perplexity before/after (0 skips it).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON.")
def prune(model: str, out: str, method: str, sparsity: float, pattern: str | None, allocation: str, spread: float,
          sensitivity_blocks: int, params: str | None, layers: int | None, kv_heads: int | None, heads: int | None, multiple_of: int,
          calib_blocks: int, calib_len: int, eval_tokens: int, seed: int, threads: int | None, as_json: bool) -> None:
    """Prune MODEL (a HF folder or a reference-model name) and write the result to OUT as a HF folder.

    \b
    Examples:
      edgefinfer prune smollm2-135m out/wanda50 --method wanda --sparsity 0.5
      edgefinfer prune smollm2-135m out/w24 --method wanda --pattern 2:4
      edgefinfer prune smollm2-135m out/half --method structured --params 0.5 --layers 20
    """
    from edgefinfer.app.model_arg import resolve_model
    from edgefinfer.prune.pipeline import REPORT_NAME, PruneOptions, prune_checkpoint

    if threads:
        import torch

        torch.set_num_threads(threads)
    opts = PruneOptions(method=method, sparsity=sparsity, pattern=pattern, allocation=allocation, spread=spread,
                        sensitivity_blocks=sensitivity_blocks, params=params, layers=layers, kv_heads=kv_heads,
                        heads=heads, multiple_of=multiple_of, calib_blocks=calib_blocks, calib_len=calib_len,
                        eval_tokens=eval_tokens, seed=seed)
    opts.validate()  # before loading anything: bad options fail in a second
    report = prune_checkpoint(resolve_model(model), out, opts, quiet=as_json)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    before, after = report["test_ppl_before"], report["test_ppl_after"]
    ppl = f", test ppl {before:.3f} -> {after:.3f}" if before is not None else ""
    click.echo(f"{method}: {report['params_before']:,} -> {report['params_after']:,} parameters "
               f"({report['nonzero_params']:,} non-zero), Linear sparsity {report['sparsity']:.3f}{ppl}, "
               f"{report['wall_seconds']:.1f}s; wrote {out} (report: {REPORT_NAME})")
