"""Decode speed of the android default bundle against onnxruntime-genai's int4, interleaved rounds.

    python bench/android_speed.py [--bundle dist/android] [--rounds 3] [--threads 1]   # android_speed.json
    python bench/android_speed.py --threads 2      # android_speed-2threads.json
    python bench/android_speed.py --bundle OTHER --name android_speed-other   # another recipe, its own file

Issue 12 keeps a speed floor under the quality-first android default: its decode speed must stay at or
above onnxruntime-genai's int4 (the fastest peer in bench/runtime.py). Identical runs of one .pte
differed 1.5x on the shared build box, so each round measures both engines back to back (each in its
own process, bench/runtime.py's child) and the result is the median and spread of the per-round
ratios, not one figure per engine. The bundle is built with `edgefinfer build --target android` if
missing (a program-cache hit when it was built before). Writes bench/results/android_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402
from runtime import measure  # noqa: E402


def bundle_and_peer(bundle: Path) -> tuple[Path, str, Path, Path, dict]:
    """The bundle's .pte and recipe (built with `edgefinfer build --target android` if missing: a
    program-cache hit when it was built before), onnxruntime-genai's int4 build of the same model, the
    128-token prompt file both engines are given, and the bundle's metrics (its build's perplexity)."""
    from edgefinfer.bundle.manifest import load_manifest
    from edgefinfer.data.corpora import load_text
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.model import reference
    from edgefinfer.tokenization.tokenizer import Tokenizer
    from onnx_vs_genai import genai_int4

    folder = reference.pull("smollm2-135m")
    if not (bundle / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "edgefinfer", "build", "--target", "android", "-o", str(bundle)],
                       check=True)
    manifest = load_manifest(bundle)
    pte, recipe = bundle / manifest.artefact("model").path, manifest.artefact("model").recipe
    work = cache_dir() / "bench" / "runtime"
    genai = genai_int4(folder, work)
    prompt_file = work / "prompt-android-speed.json"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(json.dumps(Tokenizer.from_dir(folder).encode(load_text("test"))[:128]))
    return pte, recipe, genai, prompt_file, manifest.metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dist/android")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--name", help="results file stem (default android_speed[-Nthreads])")
    args = ap.parse_args()
    host = machine()
    pte, recipe, genai, prompt_file, metrics = bundle_and_peer(Path(args.bundle))
    # Recipes differ (ours against genai's RTN int4): the bundle's perplexity beside its speed, as its
    # build measured it with ExecuTorch (genai's on the same text: bench/onnx_vs_genai.py).
    quality = {k: metrics.get(k) for k in ("ppl_delta_pct", "eval_tokens", "eval_split")}

    rounds = []
    for i in range(args.rounds):
        ours = measure("ours", "executorch", pte, prompt_file, args.tokens, args.threads)
        peer = measure("genai", "onnxruntime", genai, prompt_file, args.tokens, args.threads)
        rounds.append({"round": i, "ours_decode_tok_s": ours["decode_tok_s"], "genai_decode_tok_s": peer["decode_tok_s"],
                       "ratio": ours["decode_tok_s"] / peer["decode_tok_s"]})
        print(f"[android_speed] round {i}: {recipe} {ours['decode_tok_s']:.1f} tok/s vs genai int4 "
              f"{peer['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in rounds]
    summary = {"recipe": recipe, "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
               "max_ratio": max(ratios), "ours_median_tok_s": statistics.median(r["ours_decode_tok_s"] for r in rounds),
               "genai_median_tok_s": statistics.median(r["genai_decode_tok_s"] for r in rounds),
               "ours_quality": quality}
    print_table(rounds, ["round", "ours_decode_tok_s", "genai_decode_tok_s", "ratio"])
    print(f"\n{recipe} .pte vs onnxruntime-genai int4: median ratio {summary['median_ratio']:.2f}x "
          f"(range {summary['min_ratio']:.2f}-{summary['max_ratio']:.2f}, {args.rounds} rounds, {args.threads} thread)")
    name = args.name or ("android_speed" if args.threads == 1 else f"android_speed-{args.threads}threads")
    path = write_results(name, {"command": " ".join(["python", "bench/android_speed.py", *sys.argv[1:]]), **summary, "rounds": rounds, "threads": args.threads,
                                           "prompt_tokens": 128, "decode_tokens": args.tokens,
                                           "machine": host,  # its load_avg_at_start: before the rounds
                                           "load_avg_end": [round(x, 2) for x in os.getloadavg()],
                                           "versions": versions("executorch", "onnxruntime-genai")})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
