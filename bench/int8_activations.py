"""The android recipe's int8 activations, whole and with their outliers handled: quality and speed, per model.

    python bench/int8_activations.py --pairs smollm2-135m=dist/android,dist/android-split,dist/android-outliers16 \
        --pairs gemma3-270m=GEMMA_DEFAULT,GEMMA_SPLIT,GEMMA_OUTLIERS16 [--tokens 4096] [--rounds 3]
    python bench/int8_activations.py --calibration --pairs smollm2-135m= --pairs gemma3-270m=

For each model, android bundles built from the same weights: the default (`edgefinfer build -t android`)
first, then variants of its recipe (`--recipe 8da4w-g32-fzp-split`, `...-outliers16`), each labelled by
the suffix its recipe adds. Perplexity change against the float model on each held-out domain, measured
by ExecuTorch on --tokens tokens per domain (1024-token deltas move by a point or two with int8
activations, see bench/gemma3.py `heldout_long`), then decode and prefill speed, all bundles back to
back in each round (each engine in its own process, bench/runtime.py's child) at 1 and 2 threads, as
the median and spread of the per-round ratios variant / default. Writes bench/results/int8_activations.json
and a plot of worst-domain quality against decode speed, int8_activations.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402
from gemma3 import heldout_ppl, measured_bundle  # noqa: E402
from runtime import measure  # noqa: E402

PROMPT_TOKENS, DECODE_TOKENS = 128, 64


def quality(model_name: str, bundles: dict[str, Path], args) -> dict:
    """Held-out perplexity change of each bundle (by ExecuTorch) against the float model, same tokens."""
    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    folder = reference.pull(model_name)
    model, tok = load_model(folder), Tokenizer.from_dir(folder)
    with torch.no_grad():
        float_ppl = heldout_ppl(lambda t: model(t), tok, args.tokens, args.window)
    out = {"float_ppl": float_ppl}
    for label, path in bundles.items():
        out[label] = measured_bundle(path, float_ppl, args)
        print(f"[int8] {model_name} {label}: {json.dumps(out[label]['ppl_delta_pct'])}", file=sys.stderr, flush=True)
    return out


def android_quantized(model_name: str):
    """(float model, tokenizer, recipe name, eager quantized model, its decoder linears by name): the android
    default recipe on a reference model, as `edgefinfer build` quantizes it (the artefact cache's copy)."""
    from edgefinfer.app.build import quantize_for
    from edgefinfer.bundle.recipe import Recipe, source_precision
    from edgefinfer.bundle.targets import get_target
    from edgefinfer.compile.quant.modules import QuantLinear
    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    folder = reference.pull(model_name)
    model, tok = load_model(folder), Tokenizer.from_dir(folder)
    target = get_target("android")
    recipe = Recipe.parse(target.recipe)
    quantized = quantize_for(model, target, recipe, tok, source_precision(folder, recipe))
    decoder = {n: m for n, m in quantized.named_modules() if isinstance(m, QuantLinear) and n.startswith("model.layers.")}
    return model, tok, recipe.name, quantized, decoder


def calibration(model_name: str, args) -> dict:
    """Eager perplexity of the android default's quantized model on the default calibration text (what a
    build could measure before choosing), with whole and with split int8 activations: the same codes."""
    from edgefinfer.app.quantize_command import default_calibration
    from edgefinfer.bundle.quant_recipe import SPLIT_RATIO
    from edgefinfer.data.evaluate import perplexity

    _, tok, recipe_name, quantized, decoder = android_quantized(model_name)
    ids = default_calibration(tok).flatten().tolist()
    out = {"recipe": recipe_name, "tokens": len(ids), "window": 256}
    for label, ratio in (("whole", 0), ("split", SPLIT_RATIO)):
        for m in decoder.values():
            m.act_split = ratio
        with torch.no_grad():
            out[f"{label}_ppl"] = perplexity(lambda t: quantized(t), ids, window=256, stride=256,
                                             prefix=tok.scoring_prefix).ppl
    out["split_wins_back_pct"] = round(100 * (out["whole_ppl"] / out["split_ppl"] - 1), 2)
    print(f"[int8] {model_name} calibration text: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def speed(model_name: str, bundles: dict[str, Path], args) -> list[dict]:
    """Decode / prefill of every bundle, back to back in each round, at 1 and 2 threads."""
    from edgefinfer.data.corpora import load_text
    from edgefinfer.model import reference
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(reference.pull(model_name))
    prompt = Path(args.work) / f"{model_name}-prompt.json"
    prompt.write_text(json.dumps(tok.encode(load_text("test"))[:PROMPT_TOKENS]))
    rows = []
    for threads in (1, 2):
        runs: dict[str, list[dict]] = {label: [] for label in bundles}
        for r in range(args.rounds):
            for label, path in bundles.items():
                runs[label].append(measure("ours", "executorch", path / "model.pte", prompt, DECODE_TOKENS, threads))
                print(f"[int8] {model_name} {threads} thr round {r} {label}: "
                      f"{runs[label][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        row: dict = {"model": model_name, "threads": threads, "bundles": list(bundles)}
        for kind in ("decode", "prefill"):
            got = {label: [g[f"{kind}_tok_s"] for g in runs[label]] for label in bundles}
            for label, values in got.items():
                row[f"{label}_{kind}_tok_s"] = statistics.median(values)
                if label != "default":  # per round: the variant over the default measured beside it
                    ratios = [v / d for v, d in zip(values, got["default"])]
                    row[f"{label}_{kind}_ratio"] = statistics.median(ratios)
                    row[f"{label}_{kind}_ratio_range"] = [min(ratios), max(ratios)]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", action="append", required=True,
                    help="MODEL=DEFAULT_BUNDLE,VARIANT_BUNDLE[,...] (repeat per model)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per domain")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="for the perplexity runs")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--calibration", action="store_true",
                    help="only the calibration text's eager perplexity, whole and split (section `calibration`, "
                         "merged into the results file)")
    args = ap.parse_args()
    from edgefinfer.files.user_cache import cache_dir

    args.work = cache_dir() / "bench" / "int8_activations"
    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    if args.calibration:
        path = Path(__file__).parent / "results" / "int8_activations.json"
        result = json.loads(path.read_text()) if path.is_file() else {}
        result["calibration"] = {pair.partition("=")[0]: calibration(pair.partition("=")[0], args)
                                 for pair in args.pairs}
        result["calibration_command"] = "python bench/int8_activations.py " + " ".join(sys.argv[1:])
        write_results("int8_activations", result)
        return
    result = {"command": "python bench/int8_activations.py " + " ".join(sys.argv[1:]), "machine": machine(),
              "versions": versions("executorch", "torchao"), "tokens_per_domain": args.tokens,
              "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS, "rounds": args.rounds,
              "models": {}, "speed": []}
    for pair in args.pairs:
        name, _, paths = pair.partition("=")
        bundles = labelled([Path(p) for p in paths.split(",")])
        result["models"][name] = quality(name, bundles, args)
        if not args.no_speed:
            result["speed"] += speed(name, bundles, args)
    result["load_avg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    write_results("int8_activations", result)
    plot(result, Path(__file__).parent / "results" / "int8_activations.png")
    table = [{"model": m, "bundle": label, "recipe": q[label]["recipe"],
              **{d: f"{v:+.2f}%" for d, v in q[label]["ppl_delta_pct"].items()}}
             for m, q in result["models"].items() for label in q if label != "float_ppl"]
    print_table(table, ["model", "bundle", "recipe", *next(iter(result["models"].values()))["float_ppl"]])
    for row in result["speed"]:
        print_table([{"model": row["model"], "threads": row["threads"], "bundle": label,
                      "decode_tok_s": row[f"{label}_decode_tok_s"], "prefill_tok_s": row[f"{label}_prefill_tok_s"],
                      "decode_ratio": row.get(f"{label}_decode_ratio", 1.0),
                      "prefill_ratio": row.get(f"{label}_prefill_ratio", 1.0)} for label in row["bundles"]],
                    ["model", "threads", "bundle", "decode_tok_s", "prefill_tok_s", "decode_ratio", "prefill_ratio"])


def plot(result: dict, path: Path) -> None:
    """Per model, each bundle's worst held-out perplexity change against its decode speed over the
    default's (1 thread): the trade the recipes offer, down and to the right is better."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        quality = result["models"][model]
        speed = next((r for r in result["speed"] if r["model"] == model and r["threads"] == 1), None)
        for label in (k for k in quality if k != "float_ppl"):
            worst = max(quality[label]["ppl_delta_pct"].values())
            ratio = 1.0 if label == "default" or speed is None else speed[f"{label}_decode_ratio"]
            ax.scatter(ratio, worst, color="tab:gray" if label == "default" else "tab:blue")
            ax.annotate(label, (ratio, worst), textcoords="offset points", xytext=(5, 4))
        ax.set_xlabel("decode speed vs the default (1 thread, ExecuTorch)")
        ax.set_ylabel("worst held-out perplexity change, %")
        ax.set_title(model)
        ax.grid(alpha=0.3)
    fig.suptitle("android recipes: int8 activations whole, split, or with float outlier channels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def labelled(paths: list[Path]) -> dict[str, Path]:
    """{"default": the first bundle, SUFFIX: each other one}, SUFFIX what its recipe adds to the first's
    (`8da4w-g32-fzp-split` over `8da4w-g32-fzp`: "split")."""
    from edgefinfer.bundle.manifest import load_manifest

    recipes = [load_manifest(p).recipe["name"] for p in paths]
    base = recipes[0]
    out = {"default": paths[0]}
    for path, recipe in zip(paths[1:], recipes[1:]):
        label = recipe[len(base) + 1:] if recipe.startswith(base + "-") else recipe
        if label in out:
            raise SystemExit(f"two bundles with recipe {recipe}: give each variant once")
        out[label] = path
    return out


if __name__ == "__main__":
    main()
