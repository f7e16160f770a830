"""Compression benchmark on the reference model (SmolLM2-135M): pruning and distillation, one table.

    python bench/compress.py [--quick] [--threads 2]

Rows: dense; magnitude / Wanda / SparseGPT at 50% unstructured; Wanda with a sensitivity-based
per-layer allocation; Wanda and SparseGPT at 2:4; structured pruning to ~50% of the parameters
without and with distillation. Each row has the test perplexity (Persuasion, disjoint 512-token
windows over the first `eval_tokens` tokens), parameters, sizes and the minutes it took to make.
The distilled student is saved as a draft model (`$EDGEFINFER_CACHE/models/smollm2-135m-draft`)
and its greedy acceptance rate against the teacher is measured two ways: teacher-forced top-1
agreement, and real k=4 greedy speculative decoding on prompts from the test text.

Writes bench/results/compress.json (--quick: compress-quick.json, ignored by git).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

# The full run's sizes, picked to finish in ~25 minutes on a shared, busy 2-core machine (the teacher
# ran at 150-800 tokens/s there, depending on the other jobs).
FULL = dict(eval_tokens=4096, calib_blocks=16, calib_len=256, sensitivity_blocks=2, sparsegpt=True,
            distill_steps=24, distill_batch=8, distill_len=256, distill_lr=5e-4, top_k=64,
            agree_tokens=1024, spec_prompts=3, spec_new_tokens=32)
QUICK = dict(eval_tokens=512, calib_blocks=2, calib_len=64, sensitivity_blocks=0, sparsegpt=False,
             distill_steps=2, distill_batch=2, distill_len=64, distill_lr=5e-4, top_k=32,
             agree_tokens=128, spec_prompts=1, spec_new_tokens=8)
# Structured target: half the parameters. 20 of 30 layers (lowest angular distance dropped), 2 of 3
# KV groups (6 of 9 query heads), MLP width solved from the budget (768 of 1536). Of the shapes we
# tried at this budget it had the lowest perplexity before distillation (see docs/COMPRESSION.md).
STRUCTURED = dict(params="0.5", layers=20, kv_heads=2)


def log(msg: str) -> None:
    print(f"[compress] {msg}", file=sys.stderr, flush=True)


def sizes(model, sparse_rows: bool, pattern: tuple[int, int] | None) -> dict:
    """fp32 bytes dense, and with the pruned Linear weights stored sparse (values + 1-bit mask, or 2:4 metadata)."""
    from edgefinfer.prune.structured import parameter_count
    from edgefinfer.prune.unstructured import linear_weights, nonzero_parameters

    params = parameter_count(model)
    linears = linear_weights(model)
    lin_total = sum(w.numel() for w in linears)
    lin_nonzero = sum(int((w != 0).sum()) for w in linears)
    if not sparse_rows:  # dense and structured models: nothing to gain from a sparse format
        sparse = params * 4
    elif pattern is not None:  # kept values + log2(m) bits of position each (NVIDIA's 2:4 metadata: 2 bits)
        sparse = (params - lin_total) * 4 + lin_nonzero * 4 + lin_nonzero * (pattern[1].bit_length() - 1) / 8
    else:  # non-zero values + a bitmask over every Linear weight
        sparse = (params - lin_total) * 4 + lin_nonzero * 4 + lin_total / 8
    return {"params": params, "nonzero_params": nonzero_parameters(model), "dense_mb": round(params * 4 / 1e6, 1),
            "sparse_mb": round(sparse / 1e6, 1)}


def speculative_acceptance(teacher, draft, prompts: list[list[int]], new_tokens: int, k: int = 4) -> dict:
    """Greedy speculative decoding (k drafts per round) with static caches; returns acceptance counters."""
    import torch

    from edgefinfer.model.kv_cache import StaticCache
    from edgefinfer.runtime.speculative.proposers import DraftModelProposer, torch_model_step
    from edgefinfer.runtime.speculative.verify import SpecStats, verify_greedy

    stats = SpecStats()
    with torch.inference_mode():
        for prompt in prompts:
            length = len(prompt) + new_tokens + k + 1
            t_cache = StaticCache(teacher.config, 1, length)
            proposer = DraftModelProposer(torch_model_step(draft, StaticCache(draft.config, 1, length)))
            context = list(prompt)
            teacher(torch.tensor([context[:-1]]), torch.arange(len(context) - 1), t_cache)  # all but the last
            while len(context) < len(prompt) + new_tokens:
                drafted = proposer.propose(context, k)
                feed = [context[-1], *drafted.tokens]
                pos = torch.arange(len(context) - 1, len(context) - 1 + len(feed))
                logits = teacher(torch.tensor([feed]), pos, t_cache)[0]  # [k+1, V]
                result = verify_greedy(drafted.tokens, logits)
                stats.record(result)
                context.extend(result.tokens)
    return {"k": k, "prompts": len(prompts), "proposed": stats.proposed, "accepted": stats.accepted,
            "acceptance_rate": stats.acceptance_rate, "tokens_per_teacher_step": stats.tokens_per_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: tiny sizes, fewer rows")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a busy shared machine 2 OpenMP threads ran up to 10x slower)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model, save_model
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.data.corpora import load_text
    from edgefinfer.distill.pipeline import DistillOptions, distill_checkpoint
    from edgefinfer.distill.trainer import TrainConfig
    from edgefinfer.data.evaluate import compare, perplexity
    from edgefinfer.prune.calibration import calibration_blocks
    from edgefinfer.prune.pipeline import PruneOptions, prune_model
    from edgefinfer.prune.unstructured import linear_weights
    from edgefinfer.prune.masks import sparsity_of
    from edgefinfer.tokenization.tokenizer import Tokenizer

    S = QUICK if args.quick else FULL
    t_start = time.perf_counter()
    folder = reference.pull("smollm2-135m")
    tok = Tokenizer.from_dir(folder)
    dense = load_model(folder)
    test_ids = tok.encode(load_text("test"))
    eval_ids = test_ids[:S["eval_tokens"]]
    calib = calibration_blocks(tok, S["calib_blocks"], S["calib_len"], seed=0)

    def ppl(model) -> float:
        return perplexity(model, eval_ids, window=512, stride=512).ppl

    rows: list[dict] = []

    def add(method: str, model, minutes: float, pattern=None, unstructured: bool = False, **extra) -> dict:
        t = time.perf_counter()
        row = {"method": method, "sparsity": round(sparsity_of(linear_weights(model)), 4),
               **sizes(model, unstructured, pattern),
               "test_ppl": round(ppl(model), 3), "minutes": round(minutes, 2), **extra}
        rows.append(row)
        log(f"{method}: test ppl {row['test_ppl']}, sparsity {row['sparsity']}, params {row['params']:,} "
            f"({minutes:.1f} min to make, {time.perf_counter() - t:.0f}s to evaluate)")
        return row

    dense_row = add("dense", dense, 0.0)
    plans = [("magnitude", PruneOptions("magnitude", 0.5)), ("wanda", PruneOptions("wanda", 0.5))]
    if S["sparsegpt"]:
        plans.append(("sparsegpt", PruneOptions("sparsegpt", 0.5)))
    if S["sensitivity_blocks"]:
        plans.append(("wanda+sensitivity", PruneOptions("wanda", 0.5, allocation="sensitivity", spread=0.1,
                                                        sensitivity_blocks=S["sensitivity_blocks"])))
    plans.append(("wanda 2:4", PruneOptions("wanda", pattern="2:4")))
    if S["sparsegpt"]:
        plans.append(("sparsegpt 2:4", PruneOptions("sparsegpt", pattern="2:4")))
    for name, opts in plans:
        log(f"{name} ...")
        t = time.perf_counter()
        pruned, info = prune_model(copy.deepcopy(dense), opts, calib, quiet=True)
        extra = {"layer_sparsity": [round(s, 3) for s in info["layer_sparsity"]]} if "layer_sparsity" in info else {}
        add(name, pruned, (time.perf_counter() - t) / 60, (2, 4) if opts.pattern else None, unstructured=True, **extra)
        del pruned

    # Structured to half the parameters, then distilled from the dense teacher.
    log("structured ...")
    t = time.perf_counter()
    student, info = prune_model(copy.deepcopy(dense), PruneOptions("structured", **STRUCTURED), calib, quiet=True)
    structured_min = (time.perf_counter() - t) / 60
    row = add("structured", student, structured_min, shape=info["shape"], kept_layers=info["kept_layers"])
    row["sparsity"] = round(1 - row["params"] / dense_row["params"], 4)  # structured: fraction of parameters removed

    work = cache_dir() / "bench" / ("compress-quick" if args.quick else "compress")
    shutil.rmtree(work, ignore_errors=True)  # a fresh run each time (the teacher cache is kept: it is keyed)
    save_model(student, work / "student-0", tokenizer_dir=folder)
    train = TrainConfig(steps=S["distill_steps"], batch_size=S["distill_batch"], lr=S["distill_lr"],
                        min_lr=S["distill_lr"] / 10, warmup_steps=max(1, S["distill_steps"] // 10),
                        log_every=max(1, S["distill_steps"] // 10), checkpoint_every=max(1, S["distill_steps"] // 2))
    opts = DistillOptions(train, student=str(work / "student-0"), params=None, block_len=S["distill_len"],
                          top_k=S["top_k"], eval_tokens=0, device="cpu")
    log(f"distilling: {train.steps} steps x {train.batch_size} x {opts.block_len} tokens ...")
    report = distill_checkpoint(folder, work / "distill", opts)
    assert report is not None
    cache_s = report["teacher_cache"]["build_seconds"]
    distilled = load_model(work / "distill" / "model")
    row = add("structured+distill", distilled, structured_min + (report["train_seconds"] + cache_s) / 60,
              shape=report["shape"], distill_tokens=report["tokens_trained"],
              distill_train_minutes=round(report["train_seconds"] / 60, 2),
              teacher_cache_minutes=round(cache_s / 60, 2), teacher_topk_coverage=round(report["teacher_cache"]["coverage"], 4),
              distill_tok_s=report["tok_s"], final_kd_loss=report["final_losses"].get("kd"))
    row["sparsity"] = round(1 - row["params"] / dense_row["params"], 4)

    draft_dir = work / "draft" if args.quick else cache_dir() / "models" / "smollm2-135m-draft"
    save_model(distilled, draft_dir, tokenizer_dir=folder)
    log(f"draft model saved to {draft_dir}; measuring acceptance ...")
    agree = compare(dense, distilled, test_ids[: S["agree_tokens"]], window=512, max_tokens=S["agree_tokens"])
    prompts = [test_ids[i * 997: i * 997 + 32] for i in range(1, S["spec_prompts"] + 1)]
    spec = speculative_acceptance(dense, distilled, prompts, S["spec_new_tokens"])

    for scratch in (work / "student-0", work / "distill" / "checkpoints", work / "distill" / "student-init"):
        shutil.rmtree(scratch, ignore_errors=True)  # ~2 GB of optimizer state; the model and logs stay

    columns = ["method", "sparsity", "params", "nonzero_params", "dense_mb", "sparse_mb", "test_ppl", "minutes"]
    print_table(rows, columns)
    print(f"draft: teacher-forced greedy agreement {agree.top1:.3f} over {agree.positions} tokens; "
          f"k=4 speculation acceptance {spec['acceptance_rate']:.3f}, {spec['tokens_per_teacher_step']:.2f} tokens/step")
    path = write_results("compress", quick=args.quick, payload={
        "dense_test_ppl": dense_row["test_ppl"],
        "rows": rows,
        "draft_acceptance_rate": round(agree.top1, 4),
        "draft": {"path": str(draft_dir), "teacher_forced_top1": round(agree.top1, 4), "kl": round(agree.kl, 4),
                  "positions": agree.positions, "speculative_k4": spec},
        "distill_budget": {"tokens": report["tokens_trained"], "steps": train.steps, "batch": train.batch_size,
                           "block_len": opts.block_len, "lr": train.lr, "top_k": opts.top_k,
                           "train_minutes": round(report["train_seconds"] / 60, 2),
                           "teacher_cache_minutes": round(cache_s / 60, 2)},
        "settings": {"quick": args.quick, **S, "structured": STRUCTURED, "eval": "test split, first eval_tokens "
                     "tokens, disjoint 512-token windows", "sparsity": "unstructured rows: zero fraction of the "
                     "decoder Linear weights; structured rows: fraction of parameters removed",
                     "sizes": "MB = 1e6 bytes, fp32; sparse_mb stores pruned Linear weights as values + 1-bit "
                     "mask (unstructured) or + 2-bit positions (2:4)"},
        "wall_minutes": round((time.perf_counter() - t_start) / 60, 2),
        "threads": args.threads,
        "machine": machine(),
        "versions": versions("transformers", "numpy", "safetensors"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
