"""Quantization benchmark: size and held-out perplexity of every scheme, on two models.

    python bench/quantize.py [--quick] [--threads N] [--only RECIPE,...] [--skip-student]
    python bench/quantize.py --add RECIPE,...   # measure rows with the full settings, merge them into
                                                # the committed quantize.json (same rows replaced)

Models:
* the reference model (SmolLM2-135M-Instruct; its weights are dequantized Q4_1, i.e. they sit on an
  asymmetric 4-bit grid with a float minimum per 32 weights; our asymmetric int4 uses an integer zero
  point, so int4-g32 RTN is not lossless on it, see the rows);
* a model whose weights never sat on a 4-bit grid after training: the structured+distilled student of
  bench/compress.py (20 of 30 layers, 2 of 3 KV groups, MLP 768; 24 distillation steps from the
  teacher), loaded from $EDGEFINFER_CACHE/models/smollm2-135m-draft where bench/compress.py saves it,
  or made here the same way (about 10 minutes) when it is missing. Only the headline rows.

Calibration: token blocks of `calib-mix` (Austen, Shakespeare, the KJV Old Testament and docutils'
code, interleaved; edgefinfer.data.corpora), except the row marked `calib=austen` (the Austen-only `calib`
split, for comparison). Judged on four held-out domains that share no text with either calibration
split: `test` (Persuasion: the existing test_ppl / kl / top-1 keys), `plays` (Shakespeare not in the
mix), `bible` (KJV New Testament), `code` (requests' source); disjoint windows of 512 tokens.

Rows: float; int8 (per-channel, and g32 = GGUF Q8_0's layout); int4 RTN at g32, g64, g128; GPTQ at g32
and g64, and its variants at g32 (without act-order, without true-sequential = `parallel`, with a
damping sweep, calibrated on Austen only); AWQ with and without its clipping search, and with AutoAWQ's
duo scaling and block-output objective (`autoawq`); AWQ then GPTQ;
8da4w-g32 with RTN and GPTQ; rotated recipes (`-rot`, compile/quant/rotation.py). g128 does not
divide SmolLM2's hidden size (576): that row is recorded as skipped with the reason. Each row: packed
size (codes at their bit width, fp16 scales, zero points, float tensors at 2 bytes), perplexity on
each held-out domain and its increase over float, the worst increase, KL to the float model and top-1
agreement on `test`, the time quantization took; `goals` reads the issue's goals off the rows.

Writes bench/results/quantize.json (--quick: quantize-quick.json).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

# Sized for about an hour on a shared, busy 2-core machine at one thread (load average ~6 while this
# ran: a 512-token forward of the reference model took 2-4 s, so evaluating one row on 4096 + 3 x 1024
# tokens ~50 s, and GPTQ / AWQ on 16 x 256 calibration tokens ~2 minutes each). The grid is trimmed to
# fit a working session: symmetric int4, g64 AWQ / AWQ+GPTQ and mixed precision are not run here.
FULL = dict(eval_tokens=4096, heldout_tokens=1024, window=512, calib_blocks=16, calib_len=256)
QUICK = dict(eval_tokens=512, heldout_tokens=256, window=256, calib_blocks=2, calib_len=128)
HELDOUT = ("plays", "bible", "code")  # besides `test`
DAMP_GRID = (0.01, 0.05, 0.2)
# Row name -> (recipe it starts from, changes): the variants that have no recipe spelling of their own.
VARIANTS = {
    "int4-gptq-g32 parallel": ("int4-gptq-g32", {"gptq": {"true_sequential": False}}),
    "int4-gptq-g32 damp-sweep": ("int4-gptq-g32", {"gptq": {"damp_grid": DAMP_GRID}}),
    "int4-gptq-g32 calib=austen": ("int4-gptq-g32", {"calib": "calib"}),
    # AutoAWQ's duo scaling and block-output objective (compile/quant/awq.py), both off by default.
    "int4-awq-g32 autoawq": ("int4-awq-g32", {"awq": {"duo": True, "objective": "block"}}),
    # Not in the committed grid (time): combinations to try with --only.
    "int4-awq-gptq-g32 damp-sweep": ("int4-awq-gptq-g32", {"gptq": {"damp_grid": DAMP_GRID}}),
    "int4-gptq-g32-rot damp-sweep": ("int4-gptq-g32-rot", {"gptq": {"damp_grid": DAMP_GRID}}),
}
# -fzp (float zero point: the group minimum in fp16, as GGUF Q4_1): on the reference model it recovers
# the grid the weights were distributed on, so it measures the model's history as much as the method.
FZP_RECIPES = ["int4-g32-fzp", "int4-gptq-g32-fzp", "8da4w-g32-fzp", "int4-g32-fzp-rot"]
FULL_RECIPES = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128",
                "int4-gptq-g32", "int4-gptq-g64", "int4-gptq-noact-g32",
                "int4-gptq-g32 parallel", "int4-gptq-g32 damp-sweep", "int4-gptq-g32 calib=austen",
                "int4-awq-noclip-g32", "int4-awq-g32", "int4-awq-g32 autoawq", "int4-awq-gptq-g32",
                "8da4w-g32", "8da4w-gptq-g32",
                "int4-g32-rot", "int4-gptq-g32-rot", "int4-awq-gptq-g32-rot", "8da4w-gptq-g32-rot", *FZP_RECIPES]
STUDENT_RECIPES = ["int8", "int4-g32", "int4-gptq-g32", "int4-awq-g32", "int4-awq-g32 autoawq", "int4-awq-gptq-g32",
                   "int4-g32-rot",
                   "int4-gptq-g32-rot", "int4-g32-fzp", "int4-gptq-g32-fzp", "8da4w-g32-fzp"]
QUICK_RECIPES = ["int8", "int4-g32", "int4-gptq-g32"]


# ---- evaluation ------------------------------------------------------------------------------------------

class Evaluator:
    """Perplexity, KL and top-1 agreement in one pass per model, against cached float log-probs
    (kl=False: perplexity only, nothing cached but the float perplexity)."""

    def __init__(self, float_model, ids: torch.Tensor, window: int, kl: bool = True):
        self.ids, self.window, self.kl = ids, window, kl
        self.windows = [ids[i: i + window] for i in range(0, ids.numel() - 1, window) if ids[i: i + window].numel() > 1]
        with torch.inference_mode():
            logps = [float_model(w[None])[0].float().log_softmax(-1).half() for w in self.windows]  # [S, V]
        self.float_ppl = self._ppl(logps)
        self.ref = logps if kl else []
        self.tokens = sum(w.numel() - 1 for w in self.windows)

    def _ppl(self, logps: list[torch.Tensor]) -> float:
        nll, n = 0.0, 0
        for w, lp in zip(self.windows, logps):
            nll -= lp[:-1].float().gather(-1, w[1:, None]).sum().item()
            n += w.numel() - 1
        return math.exp(nll / n)

    @torch.inference_mode()
    def __call__(self, model) -> dict:
        if not self.kl:
            nll = sum(-model(w[None])[0, :-1].float().log_softmax(-1).gather(-1, w[1:, None]).sum().item()
                      for w in self.windows)
            return {"ppl": math.exp(nll / self.tokens)}
        nll, n, kl, agree, positions = 0.0, 0, 0.0, 0, 0
        for w, ref in zip(self.windows, self.ref):
            lp = model(w[None])[0].float().log_softmax(-1)  # [S, V]
            nll -= lp[:-1].gather(-1, w[1:, None]).sum().item()
            n += w.numel() - 1
            r = ref.float()
            kl += (r.exp() * (r - lp)).sum().item()
            agree += (r.argmax(-1) == lp.argmax(-1)).sum().item()
            positions += w.numel()
        return {"test_ppl": math.exp(nll / n), "kl_to_float": kl / positions, "top1_agreement": agree / positions,
                "eval_tokens": n}


# ---- the never-quantized model ---------------------------------------------------------------------------

def student_model(folder: Path, tok) -> tuple[object, dict]:
    """The structured+distilled student of bench/compress.py: loaded from where that benchmark saves it,
    or made here with its settings (structured pruning to half the parameters, then distillation)."""
    from compress import FULL as COMPRESS, STRUCTURED

    from edgefinfer.model.checkpoint import load_model, save_model
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.distill.pipeline import DistillOptions, distill_checkpoint
    from edgefinfer.distill.trainer import TrainConfig
    from edgefinfer.prune.calibration import calibration_blocks
    from edgefinfer.prune.pipeline import PruneOptions, prune_model

    path = cache_dir() / "models" / "smollm2-135m-draft"
    if (path / "config.json").is_file():
        return load_model(path), {"path": str(path), "made_by": "bench/compress.py (cached)"}
    t0 = time.perf_counter()
    print("[student] not cached: structured pruning + distillation as bench/compress.py does (~10 min)",
          file=sys.stderr)
    calib = calibration_blocks(tok, COMPRESS["calib_blocks"], COMPRESS["calib_len"], seed=0)
    student, _ = prune_model(load_model(folder), PruneOptions("structured", **STRUCTURED), calib, quiet=True)
    work = cache_dir() / "bench" / "quantize-student"
    save_model(student, work / "student-0", tokenizer_dir=folder)
    steps, lr = COMPRESS["distill_steps"], COMPRESS["distill_lr"]
    train = TrainConfig(steps=steps, batch_size=COMPRESS["distill_batch"], lr=lr, min_lr=lr / 10,
                        warmup_steps=max(1, steps // 10), log_every=max(1, steps // 10), checkpoint_every=steps)
    opts = DistillOptions(train, student=str(work / "student-0"), params=None, block_len=COMPRESS["distill_len"],
                          top_k=COMPRESS["top_k"], eval_tokens=0, device="cpu")
    distill_checkpoint(folder, work / "distill", opts)
    model = load_model(work / "distill" / "model")
    save_model(model, path, tokenizer_dir=folder)
    return model, {"path": str(path), "made_by": "bench/quantize.py with bench/compress.py's settings",
                   "minutes": round((time.perf_counter() - t0) / 60, 1)}


# ---- one model's table -----------------------------------------------------------------------------------

def make_recipe(name: str):
    """(recipe, calibration split) of a row name: a recipe spelling, or one of VARIANTS."""
    from edgefinfer.compile.quant.recipe import parse_recipe

    base, changes = VARIANTS.get(name, (name, {}))
    recipe = parse_recipe(base)
    if "gptq" in changes:
        recipe = recipe.replace(gptq=dataclasses.replace(recipe.gptq, **changes["gptq"]))
    if "awq" in changes:
        recipe = recipe.replace(awq=dataclasses.replace(recipe.awq, **changes["awq"]))
    return recipe.replace(name=name), changes.get("calib", "calib-mix")


def bench_model(label: str, model, domains: dict, calib: dict, names: list[str], opts: dict, rows: list[dict],
                float_row: bool = True) -> dict:
    from edgefinfer.compile.quant.apply import plan_formats, quantize_model
    from edgefinfer.compile.quant.report import float_size_bytes
    from edgefinfer.errors import UserError

    t0 = time.perf_counter()
    evaluators = {d: Evaluator(model, ids, opts["window"], kl=d == "test") for d, ids in domains.items()}
    float_ppl = {d: e.float_ppl for d, e in evaluators.items()}
    float_bytes = float_size_bytes(model)
    test = evaluators["test"]
    if float_row:
        rows.append({"model": label, "recipe": "float", "size_bytes": float_bytes, "size_pct_fp16": 100.0,
                     "test_ppl": test.float_ppl, "kl_to_float": 0.0, "top1_agreement": 1.0,
                     "eval_tokens": test.tokens, "heldout_ppl": float_ppl,
                     "heldout_increase_pct": {d: 0.0 for d in domains}, "worst_increase_pct": 0.0, "quantize_s": 0.0})
    print(f"[{label}] float ppl " + ", ".join(f"{d} {p:.2f}" for d, p in float_ppl.items())
          + f" ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    for name in names:
        t = time.perf_counter()
        row: dict = {"model": label, "recipe": name}
        try:
            recipe, calib_split = make_recipe(name)
            q = copy.deepcopy(model)
            plan_formats(q, recipe)
            blocks = calib[calib_split] if recipe.method != "rtn" else None
            result = quantize_model(q, recipe, blocks)
        except UserError as e:
            row.update(size_bytes=None, test_ppl=None, skipped=str(e))
            rows.append(row)
            print(f"[{label}] {name}: skipped ({e})", file=sys.stderr)
            continue
        quant_s = time.perf_counter() - t
        row.update(size_bytes=result.size_bytes, size_pct_fp16=100 * result.size_bytes / float_bytes,
                   **test(q), quantize_s=quant_s)
        row["ppl_increase_pct"] = 100 * (row["test_ppl"] / test.float_ppl - 1)
        ppl = {"test": row["test_ppl"], **{d: e(q)["ppl"] for d, e in evaluators.items() if d != "test"}}
        row["heldout_ppl"] = ppl
        row["heldout_increase_pct"] = {d: 100 * (p / float_ppl[d] - 1) for d, p in ppl.items()}
        row["worst_increase_pct"] = max(row["heldout_increase_pct"].values())
        row["calibration"] = None if recipe.method == "rtn" else calib_split
        row["head"] = result.head_method
        if result.gptq_damp and recipe.gptq.damp_grid:
            chosen = list(result.gptq_damp.values())
            row["damp_chosen"] = {str(d): chosen.count(d) for d in recipe.gptq.damp_grid}
        rows.append(row)
        print(f"[{label}] {name}: " + ", ".join(f"{d} {v:+.2f}%" for d, v in row["heldout_increase_pct"].items())
              + f"; {row['size_bytes'] / 1e6:.2f} MB, quantize {quant_s:.0f}s, total {time.perf_counter() - t:.0f}s",
              file=sys.stderr)
        del q
    return {"float_test_ppl": test.float_ppl, "float_heldout_ppl": float_ppl, "float_size_bytes": float_bytes,
            "seconds": time.perf_counter() - t0}


def merge_rows(new_rows: list[dict], models: dict, t0: float) -> Path:
    """Put `new_rows` (measured with FULL) into the committed quantize.json in place of the rows of the
    same model and recipe, recompute the goals, and note what was added when."""
    from common import RESULTS

    path = RESULTS / "quantize.json"
    payload = json.loads(path.read_text())
    if payload.get("quick") or payload.get("only"):
        raise SystemExit(f"{path} is not a full run: run the full benchmark before adding rows to it")
    for label, m in models.items():  # the float figures these rows were measured against must agree
        committed = payload["models"].get(label, {}).get("float_test_ppl")
        if committed is not None and abs(committed - m["float_test_ppl"]) > 1e-4 * committed:
            raise SystemExit(f"{label}: float test ppl {m['float_test_ppl']:.6f} here, {committed:.6f} in {path}: "
                             "the settings or the model changed; run the full benchmark")
    keys = {(r["model"], r["recipe"]) for r in new_rows}
    payload["rows"] = [r for r in payload["rows"] if (r["model"], r["recipe"]) not in keys] + new_rows
    payload["goals"] = {label: goals(payload["rows"], label) for label in payload["models"]}
    payload.setdefault("added", []).append({"rows": sorted(f"{m}:{r}" for m, r in keys),
                                            "date": time.strftime("%Y-%m-%d"), "machine": machine(),
                                            "seconds": round(time.perf_counter() - t0, 1)})
    return write_results("quantize", payload)


def goals(rows: list[dict], label: str) -> dict:
    """The issue's goals, read off one model's rows (worst held-out domain throughout)."""
    done = {r["recipe"]: r for r in rows if r["model"] == label and r.get("worst_increase_pct") is not None}
    worst = lambda name: done[name]["worst_increase_pct"] if name in done else None  # noqa: E731
    four_bit = [n for n, r in done.items() if ("int4" in n or "8da4w" in n) and ("g32" in n or "g64" in n)]
    best = min(four_bit, key=worst, default=None)
    pairs = {"rtn": ("int4-g32", "int4-g32-rot"), "gptq": ("int4-gptq-g32", "int4-gptq-g32-rot")}
    return {
        "best_4bit": {"recipe": best, "worst_increase_pct": worst(best) if best else None, "goal_pct": 3.0},
        # The best int8 recipe measured (per-channel RTN `int8`, Q8_0's `int8-g32`, `int8-gptq`, ...).
        "int8": {"recipe": (b8 := min((n for n in done if n.startswith("int8")), key=worst, default=None)),
                 "worst_increase_pct": worst(b8) if b8 else None, "goal_pct": 0.5,
                 "per_channel_rtn_worst_increase_pct": worst("int8")},
        "awq_minus_gptq_g32_pct": (worst("int4-awq-g32") - worst("int4-gptq-g32"))
        if worst("int4-awq-g32") is not None and worst("int4-gptq-g32") is not None else None,
        "rotation_gain_pct": {m: (worst(a) - worst(b)) if worst(a) is not None and worst(b) is not None else None
                              for m, (a, b) in pairs.items()},
    }


# ---- main ------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="A run of about a minute (fewer rows and tokens).")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1).")
    parser.add_argument("--skip-student", action="store_true", help="Only the reference model.")
    parser.add_argument("--only", help="Comma-separated rows to run (a look at a few; not for committed results).")
    parser.add_argument("--add", help="Comma-separated rows to measure with the full settings and merge into the "
                                      "committed quantize.json (rows of the same model and recipe are replaced; "
                                      "the student gets those of them in its list).")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.add and (args.quick or args.only):
        parser.error("--add measures with the full settings: it does not combine with --quick or --only")
    opts = QUICK if args.quick else FULL
    names = (args.add or args.only).split(",") if (args.add or args.only) else QUICK_RECIPES if args.quick else FULL_RECIPES

    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.data.corpora import load_text, token_blocks
    from edgefinfer.model.reference import pull
    from edgefinfer.tokenization.tokenizer import Tokenizer

    t0 = time.perf_counter()
    folder = pull("smollm2-135m")
    tok = Tokenizer.from_dir(folder)
    def first_tokens(split: str, n: int) -> torch.Tensor:  # tokenize a prefix, not a 2.5M-char split
        ids = tok.encode(load_text(split)[: n * 12])[:n]
        assert len(ids) == n, f"{split}: {n * 12} chars gave fewer than {n} tokens"
        return torch.tensor(ids)

    domains = {"test": first_tokens("test", opts["eval_tokens"]),
               **{d: first_tokens(d, opts["heldout_tokens"]) for d in HELDOUT}}
    calib = {split: token_blocks(tok.encode(load_text(split)), opts["calib_len"], opts["calib_blocks"], seed=0)
             for split in ("calib-mix", "calib")}
    rows: list[dict] = []
    models: dict = {}

    def save() -> Path:  # after each model, so a failure later keeps what was measured
        if args.add:
            return merge_rows(rows, models, t0)
        payload.update(float_test_ppl=models["smollm2-135m"]["float_test_ppl"],
                       float_size_bytes=models["smollm2-135m"]["float_size_bytes"],
                       goals={label: goals(rows, label) for label in models}, wall_seconds=time.perf_counter() - t0)
        return write_results("quantize", payload, quick=args.quick or bool(args.only))

    payload = {
        "benchmark": "quantize", "quick": args.quick, "only": args.only, "float_test_ppl": None,
        "float_size_bytes": None, "models": models, "rows": rows, "goals": {},
        "settings": {**opts, "eval": f"disjoint windows of {opts['window']} tokens over the first {opts['eval_tokens']} "
                                      f"test tokens and the first {opts['heldout_tokens']} of each of "
                                      f"{', '.join(HELDOUT)}",
                     "calibration": f"{opts['calib_blocks']} x {opts['calib_len']} tokens of the calib-mix split "
                                    "(seed 0); the calib=austen row: the same of the calib split",
                     "damp_grid": DAMP_GRID},
        "machine": machine(), "threads": torch.get_num_threads(),
        "versions": versions("torchao", "numpy", "safetensors", "gguf", "onnxruntime"),
    }
    fresh = not args.add  # --add: the committed file already has the float rows
    models["smollm2-135m"] = bench_model("smollm2-135m", load_model(folder), domains, calib, names, opts, rows, fresh)
    path = save()
    student_names = [n for n in STUDENT_RECIPES if not (args.only or args.add) or n in names]
    if not args.skip_student and not args.quick and student_names:
        student, provenance = student_model(folder, tok)
        models["student"] = bench_model("student", student, domains, calib, student_names, opts, rows, fresh)
        models["student"].update(provenance, parameters=sum(p.numel() for p in student.parameters()))
        path = save()
    table = [{**r, "skipped": (r.get("skipped") or "")[:40] or None,
              **{f"{d}_%": (r.get("heldout_increase_pct") or {}).get(d) for d in domains}} for r in rows]
    print_table(table, ["model", "recipe", "size_bytes", "size_pct_fp16", "test_ppl", *[f"{d}_%" for d in domains],
                        "worst_increase_pct", "kl_to_float", "top1_agreement", "quantize_s", "skipped"])
    for label, g in json.loads(path.read_text())["goals"].items():
        print(f"[{label}] goals: {json.dumps(g)}")
    print(f"wrote {path} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
