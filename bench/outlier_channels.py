"""Eager probe: the android default's int8 activations with a fixed set of outlier channels kept float.

    python bench/outlier_channels.py [--models smollm2-135m,gemma3-270m] [--channels 4,16] [--tokens 4096]

LLM.int8()'s decomposition with calibrated channels, as a candidate cheaper than `-split` (which
computes a second GEMM row, bench/results/split_activations.json): per decoder linear, the k input
channels with the largest magnitude on the default calibration text are taken out of the int8 row and
multiplied in float by the same (dequantized) weight columns,

    y = W_sym q8(x * keep) + W_sym[:, cols] x[cols] + offsets(group_sums(x))

which in a .pte would be a mask multiply, a [K -> k] one-hot linear and a [k -> N] float linear beside
XNNPACK's GEMM. Not an exported recipe yet: this measures the eager model only (the eager 8da4w-g32-fzp
model matched its .pte within 0.02 points on Gemma's bible text), beside the same model with whole and
with split activations, on --tokens held-out tokens per domain. Writes bench/results/outlier_channels.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

DOMAINS = ("test", "plays", "bible", "code")


def calibration_absmax(model, decoder: dict, tok) -> dict:
    """Per decoder linear, the largest |x| of each input channel over the default calibration text."""
    from edgefinfer.app.quantize_command import default_calibration

    seen: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_module, args):
            a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            seen[name] = torch.maximum(seen[name], a) if name in seen else a
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in decoder.items()]
    blocks = default_calibration(tok)
    prefix = torch.tensor(list(tok.scoring_prefix), dtype=blocks.dtype).expand(blocks.shape[0], -1)
    try:
        with torch.no_grad():
            for start in range(0, blocks.shape[0], 4):
                model(torch.cat([prefix[start:start + 4], blocks[start:start + 4]], 1))
    finally:
        for h in handles:
            h.remove()
    return seen


def float_channels_forward(module, cols: torch.Tensor):
    """The module's forward with input channels `cols` multiplied in float, the rest int8 per token."""
    from edgefinfer.compile.quant.modules import group_sums
    from edgefinfer.compile.quant.primitives import fake_quant_per_token_int8

    keep = torch.ones(module.in_features)
    keep[cols] = 0

    def forward(x):
        w, offsets = module.offset_split() if module.fmt.float_zero else (module.dequantized(), None)
        y = F.linear(fake_quant_per_token_int8(x * keep), w) + F.linear(x[..., cols], w[:, cols])
        if offsets is not None:
            y = y + F.linear(group_sums(x, module.group_size), offsets)
        return y if module.bias is None else y + module.bias
    return forward


def probe(name: str, channels: list[int], args) -> dict:
    from edgefinfer.bundle.quant_recipe import SPLIT_RATIO
    from edgefinfer.data.corpora import load_text
    from edgefinfer.data.evaluate import perplexity
    from split_activations import android_quantized

    model, tok, recipe_name, quantized, decoder = android_quantized(name)
    absmax = calibration_absmax(quantized, decoder, tok)
    ids = {d: tok.encode(load_text(d)[: args.tokens * 8])[: args.tokens] for d in DOMAINS}

    def ppl(m) -> dict[str, float]:
        with torch.no_grad():
            return {d: perplexity(lambda t: torch.as_tensor(m(t)), ids[d], window=args.window, stride=args.window,
                                  prefix=tok.scoring_prefix).ppl for d in DOMAINS}

    float_ppl = ppl(model)
    rows = {}

    def record(label: str) -> None:
        got = ppl(quantized)
        rows[label] = {d: round(100 * (got[d] / float_ppl[d] - 1), 2) for d in DOMAINS}
        print(f"[outliers] {name} {label}: {rows[label]}", file=sys.stderr, flush=True)

    record("whole int8")
    for m in decoder.values():
        m.act_split = SPLIT_RATIO
    record(f"split (1/{SPLIT_RATIO})")
    for m in decoder.values():
        m.act_split = 0
    for k in channels:
        for n, m in decoder.items():
            m.forward = float_channels_forward(m, absmax[n].topk(k).indices)
        record(f"{k} float channels")
    return {"recipe": recipe_name, "float_ppl": float_ppl, "ppl_delta_pct": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--channels", default="4,16")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    channels = [int(c) for c in args.channels.split(",")]
    models = {name: probe(name, channels, args) for name in args.models.split(",")}
    write_results("outlier_channels", {
        "command": "python bench/outlier_channels.py " + " ".join(sys.argv[1:]), "machine": machine(),
        "versions": versions("torch"), "measured_by": "eager torch (int8 activations fake-quantized as XNNPACK rounds them)",
        "tokens_per_domain": args.tokens, "window": args.window, "models": models,
        "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}})
    print_table([{"model": name, "activations": label, **{d: f"{v:+.2f}%" for d, v in row.items()}}
                 for name, r in models.items() for label, row in r["ppl_delta_pct"].items()],
                ["model", "activations", *DOMAINS])


if __name__ == "__main__":
    main()
