"""Rotation benchmark: each 4-bit recipe with and without the fused Hadamard rotation (`-rot`).

    python bench/rotation.py [--quick] [--threads N] [--recipes a,b,...] [--model HF_FOLDER]

On the reference model (SmolLM2-135M-Instruct; --model: any float checkpoint with its tokenizer): test perplexity on two held-out kinds of text (the
Austen test split and `ood`, disjoint windows of 512 tokens), KL to float and top-1 agreement (the
evaluator of bench/quantize.py), packed size (a rotated tied model carries its head as a second
table), and the time quantization took, rotation included. GPTQ calibrates on 8 x 256 tokens of the
calib split (seed 0), as bench/quantize.py does. One extra row per base recipe compares the
randomized Hadamard with a Haar-random orthogonal rotation.

Writes bench/results/rotation.json (--quick: rotation-quick.json; --model: rotation-<folder name>.json).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402
from quantize import Evaluator  # noqa: E402

FULL = dict(eval_tokens=4096, window=512, calib_blocks=8, calib_len=256)
QUICK = dict(eval_tokens=512, window=512, calib_blocks=2, calib_len=128)
SPLITS = ("test", "ood")
# Asymmetric g32 is SmolLM2's own grid (its weights are dequantized Q4_1), so it is nearly lossless
# there; the symmetric and g64 rows are where rounding really loses information.
FULL_RECIPES = ["int4-g32", "int4-g32-sym", "int4-g64", "int4-g64-sym", "int4-pc-sym", "int4-gptq-g32",
                "int4-gptq-g32-sym", "int4-gptq-g64-sym", "8da4w-g32", "8da4w-gptq-g32"]
QUICK_RECIPES = ["int4-g64-sym", "8da4w-g32"]
ORTHOGONAL_BASELINE = ("int4-g64-sym", "8da4w-g32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="A run of a few minutes (fewer rows and tokens).")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1).")
    parser.add_argument("--recipes", help="Comma-separated base recipes (default: the full or quick list).")
    parser.add_argument("--model", help="A float Hugging Face folder (default: the reference model), e.g. a "
                        "model whose weights never sat on a 4-bit grid.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    opts = QUICK if args.quick else FULL
    bases = args.recipes.split(",") if args.recipes else QUICK_RECIPES if args.quick else FULL_RECIPES

    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.quant.apply import quantize_model
    from edgefinfer.compile.quant.recipe import RotationSettings, parse_recipe
    from edgefinfer.compile.quant.report import float_size_bytes
    from edgefinfer.data.corpora import load_text, token_blocks
    from edgefinfer.model.reference import pull
    from edgefinfer.tokenization.tokenizer import Tokenizer

    t0 = time.perf_counter()
    folder = Path(args.model) if args.model else pull("smollm2-135m")
    tok = Tokenizer.from_dir(folder)
    model = load_model(folder)
    evaluators = {s: Evaluator(model, torch.tensor(tok.encode(load_text(s))[: opts["eval_tokens"]]), opts["window"])
                  for s in SPLITS}
    calib = token_blocks(tok.encode(load_text("calib")), opts["calib_len"], opts["calib_blocks"], seed=0)
    float_bytes = float_size_bytes(model)
    rows = [{"recipe": "float", "rotation": "-", "size_bytes": float_bytes,
             **{f"{s}_ppl": e.float_ppl for s, e in evaluators.items()}}]
    print(f"float: {', '.join(f'{s} ppl {e.float_ppl:.3f}' for s, e in evaluators.items())}", file=sys.stderr)

    runs = [(b, None) for b in bases] + [(b, "hadamard") for b in bases]
    runs += [(b, "orthogonal") for b in bases if b in ORTHOGONAL_BASELINE]
    for base, kind in runs:
        recipe = parse_recipe(base + ("-rot" if kind else ""))
        if kind == "orthogonal":
            recipe = recipe.replace(rotation=RotationSettings("orthogonal"))
        t = time.perf_counter()
        q = copy.deepcopy(model)
        result = quantize_model(q, recipe, calib if recipe.method != "rtn" else None)
        row = {"recipe": recipe.name, "rotation": kind or "-", "size_bytes": result.size_bytes,
               "quantize_s": time.perf_counter() - t}
        for s, evaluate in evaluators.items():
            m = evaluate(q)
            row.update({f"{s}_ppl": m["test_ppl"], f"{s}_ppl_increase_pct": 100 * (m["test_ppl"] / evaluate.float_ppl - 1),
                        f"{s}_kl": m["kl_to_float"], f"{s}_top1": m["top1_agreement"]})
        rows.append(row)
        print(f"{recipe.name} [{kind or 'none'}]: " + ", ".join(
            f"{s} ppl {row[f'{s}_ppl']:.3f} ({row[f'{s}_ppl_increase_pct']:+.2f}%)" for s in SPLITS)
            + f", {row['size_bytes'] / 1e6:.2f} MB, {time.perf_counter() - t:.0f}s", file=sys.stderr)
        del q

    payload = {
        "benchmark": "rotation", "quick": args.quick, "model": str(args.model or "smollm2-135m"), "rows": rows,
        "settings": {**opts, "splits": list(SPLITS), "eval": f"disjoint windows of {opts['window']} over the first "
                     f"{opts['eval_tokens']} tokens of each split", "calibration": f"{opts['calib_blocks']} x "
                     f"{opts['calib_len']} tokens of the calib split (seed 0)",
                     "rotation": "R1 (residual, randomized Hadamard walsh 16 x paley-II 36) + R2 (V/O per head), "
                                 "RMSNorm weights folded, head untied; seed 0"},
        "machine": machine(), "threads": torch.get_num_threads(), "versions": versions("torch"),
        "wall_seconds": time.perf_counter() - t0,
    }
    path = write_results(f"rotation-{Path(args.model).name}" if args.model else "rotation", payload, quick=args.quick)
    cols = ["recipe", "rotation", "size_bytes"] + [f"{s}_{k}" for s in SPLITS for k in ("ppl", "ppl_increase_pct")]
    print_table(rows, cols + ["quantize_s"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
