"""Quantization benchmark: size and test perplexity of every scheme, on two models.

    python bench/quantize.py [--quick] [--threads N]

Models:
* the reference model (SmolLM2-135M-Instruct; its weights are dequantized Q4_1, i.e. already on an
  asymmetric 4-bit grid in groups of 32, so asymmetric int4-g32 is nearly lossless by construction);
* a model that was never quantized: a tiny Llama (d=256, 4 layers, GQA 4/2, tied embeddings) trained
  here for a few minutes on the Austen train split with the SmolLM2 tokenizer, its vocabulary cut to the
  4095 most frequent train tokens plus one UNK id (cached under $EDGEFINFER_CACHE/bench/).

Rows: float; int8 (per-channel, and g32 = GGUF Q8_0's layout); int4 RTN / GPTQ / AWQ at g32, g64,
g128 (asymmetric) and g64 symmetric (and RTN with 4-bit embeddings); 8da4w-g32 with RTN and GPTQ;
fp8; mixed precision (int4-g64-sym with int8-g32 for the most sensitive units) under the size budget
of uniform int4-g32-sym, with RTN and with GPTQ. g128 does not divide SmolLM2's hidden size (576):
those rows are recorded as skipped with the reason.
Each row: packed size (what an exporter writes: codes at their bit width, fp16 scales, zero points,
float tensors at 2 bytes), test perplexity (Persuasion, disjoint windows of 512 tokens over the first
`eval_tokens`), KL to the float model, top-1 agreement, and the time quantization took.

Writes bench/results/quantize.json (--quick: quantize-quick.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

# Sized for ~20 minutes on a shared, busy 2-core machine at one thread (GPTQ / AWQ take about a
# minute each on the reference model with 2048 calibration tokens there).
FULL = dict(eval_tokens=4096, window=512, calib_blocks=8, calib_len=256, sensitivity_blocks=2, tiny_steps=300)
QUICK = dict(eval_tokens=512, window=512, calib_blocks=2, calib_len=128, sensitivity_blocks=1, tiny_steps=30)
FULL_RECIPES = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128", "int4-g32-sym", "int4-g64-sym",
                "int4-g64-sym-emb4", "int4-gptq-g32", "int4-gptq-g64", "int4-gptq-g128", "int4-gptq-g64-sym",
                "int4-awq-g32", "int4-awq-g64", "int4-awq-g128", "int4-awq-g64-sym",
                "8da4w-g32", "8da4w-gptq-g32", "fp8", "mixed", "mixed-gptq"]
QUICK_RECIPES = ["int8", "int4-g64-sym", "int4-gptq-g64-sym", "int4-awq-g64-sym", "8da4w-g32", "fp8"]
MIXED_BUDGET, MIXED_LOW, MIXED_HIGH = "int4-g32-sym", "int4-g64-sym", "int8-g32"
TINY_VOCAB = 4096


# ---- evaluation ------------------------------------------------------------------------------------------

class Evaluator:
    """Perplexity, KL and top-1 agreement in one pass per model, against cached float log-probs."""

    def __init__(self, float_model, ids: torch.Tensor, window: int):
        self.ids, self.window = ids, window
        self.windows = [ids[i: i + window] for i in range(0, ids.numel() - 1, window) if ids[i: i + window].numel() > 1]
        self.ref: list[torch.Tensor] = []
        with torch.inference_mode():
            for w in self.windows:
                self.ref.append(float_model(w[None])[0].float().log_softmax(-1).half())  # [S, V]
        self.float_ppl = self._ppl(self.ref)
        self.tokens = sum(w.numel() - 1 for w in self.windows)

    def _ppl(self, logps: list[torch.Tensor]) -> float:
        nll, n = 0.0, 0
        for w, lp in zip(self.windows, logps):
            nll -= lp[:-1].float().gather(-1, w[1:, None]).sum().item()
            n += w.numel() - 1
        return math.exp(nll / n)

    @torch.inference_mode()
    def __call__(self, model) -> dict:
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

def tiny_austen_model(tok, steps: int, threads: int):
    """(model, id map) of a small Llama trained on Austen with a reduced SmolLM2 vocabulary; cached."""
    from safetensors.torch import load_file, save_file

    from edgefinfer.config import ModelConfig
    from edgefinfer.data import cache_dir, load_text
    from edgefinfer.model import Transformer

    config = ModelConfig(vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    folder = cache_dir() / "bench" / f"quant-tiny-austen-{steps}"
    train = torch.tensor(tok.encode(load_text("train")))
    counts = torch.bincount(train, minlength=tok.vocab_size)
    keep = counts.topk(TINY_VOCAB - 1).indices
    id_map = torch.zeros(max(tok.vocab_size, int(train.max()) + 1), dtype=torch.long)  # 0 = UNK
    id_map[keep] = torch.arange(1, TINY_VOCAB)
    model = Transformer(config)
    meta = {"steps": steps, "config": config.to_hf()}
    if (folder / "model.safetensors").is_file() and json.loads((folder / "meta.json").read_text()) == meta:
        model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
        model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval(), id_map, json.loads((folder / "train.json").read_text())

    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    data = id_map[train]
    seq, batch, lr = 128, 8, 2e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    t0, losses = time.perf_counter(), []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:  # linear warm-up, cosine decay
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s: s + seq + 1] for s in starts])
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, TINY_VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            print(f"  tiny model: step {step + 1}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)",
                  file=sys.stderr)
    model.eval()
    info = {"steps": steps, "batch": batch, "seq": seq, "train_tokens": steps * batch * seq,
            "train_seconds": time.perf_counter() - t0, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "threads": threads, "parameters": sum(p.numel() for p in model.parameters())}
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, folder / "model.safetensors")
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "train.json").write_text(json.dumps(info))
    return model, id_map, info


# ---- one model's table -----------------------------------------------------------------------------------

def bench_model(label: str, model, test_ids, calib, names: list[str], opts: dict, rows: list[dict]) -> dict:
    from edgefinfer.compile.quant import mixed
    from edgefinfer.compile.quant.apply import plan_formats, quantize_model
    from edgefinfer.compile.quant.recipe import parse_recipe
    from edgefinfer.compile.quant.report import float_size_bytes
    from edgefinfer.errors import UserError

    t0 = time.perf_counter()
    evaluate = Evaluator(model, test_ids, opts["window"])
    float_bytes = float_size_bytes(model)
    base = {"test_ppl": evaluate.float_ppl, "kl_to_float": 0.0, "top1_agreement": 1.0, "eval_tokens": evaluate.tokens}
    rows.append({"model": label, "recipe": "float", "size_bytes": float_bytes, "size_pct_fp16": 100.0, **base,
                 "quantize_s": 0.0})
    print(f"[{label}] float test ppl {evaluate.float_ppl:.3f} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    allocation = None
    for name in names:
        t = time.perf_counter()
        row = {"model": label, "recipe": name}
        try:
            if name.startswith("mixed"):
                if allocation is None:
                    allocation = _allocate(model, calib[: opts["sensitivity_blocks"]], mixed)
                low = parse_recipe(MIXED_LOW if name == "mixed" else MIXED_LOW.replace("int4-", "int4-gptq-"))
                recipe = mixed.mixed_recipe(low, allocation, f"{name}({MIXED_LOW}+{MIXED_HIGH}@{MIXED_BUDGET})")
                row["recipe"] = recipe.name
                row["int8_units"] = sum(v.startswith("int8") for v in allocation.choice.values())
            else:
                recipe = parse_recipe(name)
            q = copy.deepcopy(model)
            plan_formats(q, recipe)
            result = quantize_model(q, recipe, calib if recipe.method != "rtn" else None)
        except UserError as e:
            row.update(size_bytes=None, test_ppl=None, skipped=str(e))
            rows.append(row)
            print(f"[{label}] {name}: skipped ({e})", file=sys.stderr)
            continue
        quant_s = time.perf_counter() - t
        row.update(size_bytes=result.size_bytes, size_pct_fp16=100 * result.size_bytes / float_bytes,
                   **evaluate(q), quantize_s=quant_s)
        row["ppl_increase_pct"] = 100 * (row["test_ppl"] / evaluate.float_ppl - 1)
        rows.append(row)
        print(f"[{label}] {row['recipe']}: ppl {row['test_ppl']:.3f} ({row['ppl_increase_pct']:+.2f}%), "
              f"{row['size_bytes'] / 1e6:.2f} MB, quantize {quant_s:.0f}s, total {time.perf_counter() - t:.0f}s",
              file=sys.stderr)
        del q
    return {"float_test_ppl": evaluate.float_ppl, "float_size_bytes": float_bytes,
            "seconds": time.perf_counter() - t0}


def _allocate(model, blocks, mixed):
    from edgefinfer.compile.quant.recipe import parse_recipe

    low, high = parse_recipe(MIXED_LOW), parse_recipe(MIXED_HIGH).weights
    unit = "layer" if len(model.model.layers) > 8 else "linear"  # 30-layer model: 30 units, not 210
    units = mixed.measure_sensitivity(model, blocks, [low.weights, high], unit)
    fixed = mixed.uniform_size(model, low) - sum(u.bytes[low.weights.label()] for u in units)
    budget = mixed.uniform_size(model, parse_recipe(MIXED_BUDGET))
    allocation = mixed.allocate(units, [low.weights, high], budget_bytes=budget - fixed)
    print(mixed.sensitivity_table(units, allocation), file=sys.stderr)
    return allocation


# ---- main ------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="A run of about a minute (fewer rows and tokens).")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1).")
    parser.add_argument("--skip-tiny", action="store_true", help="Only the reference model.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    opts = QUICK if args.quick else FULL
    names = QUICK_RECIPES if args.quick else FULL_RECIPES

    from edgefinfer.checkpoint import load_model
    from edgefinfer.data import load_text, token_blocks
    from edgefinfer.reference import pull
    from edgefinfer.tokenizer import Tokenizer

    t0 = time.perf_counter()
    folder = pull("smollm2-135m")
    tok = Tokenizer.from_dir(folder)
    test_ids = torch.tensor(tok.encode(load_text("test"))[: opts["eval_tokens"]])
    calib = token_blocks(tok.encode(load_text("calib")), opts["calib_len"], opts["calib_blocks"], seed=0)
    rows: list[dict] = []
    models = {"smollm2-135m": bench_model("smollm2-135m", load_model(folder), test_ids, calib, names, opts, rows)}
    if not args.skip_tiny:
        tiny, id_map, train_info = tiny_austen_model(tok, opts["tiny_steps"], args.threads)
        models["tiny-austen"] = bench_model("tiny-austen", tiny, id_map[test_ids], id_map[calib], names, opts, rows)
        models["tiny-austen"]["training"] = train_info

    ref = models["smollm2-135m"]
    payload = {
        "benchmark": "quantize", "quick": args.quick,
        "float_test_ppl": ref["float_test_ppl"], "float_size_bytes": ref["float_size_bytes"],
        "models": models, "rows": rows,
        "settings": {**opts, "eval": f"disjoint windows of {opts['window']} over the first {opts['eval_tokens']} "
                                      "test tokens", "calibration": f"{opts['calib_blocks']} x {opts['calib_len']} "
                                      "tokens of the calib split (seed 0)",
                     "mixed": f"{MIXED_LOW} + {MIXED_HIGH} under the size of uniform {MIXED_BUDGET}"},
        "machine": machine(), "threads": torch.get_num_threads(),
        "versions": versions("torchao", "numpy", "safetensors", "gguf", "onnxruntime"),
        "wall_seconds": time.perf_counter() - t0,
    }
    path = write_results("quantize", payload, quick=args.quick)
    cols = ["model", "recipe", "size_bytes", "size_pct_fp16", "test_ppl", "ppl_increase_pct", "kl_to_float",
            "top1_agreement", "quantize_s", "skipped"]
    print_table([{**r, "skipped": (r.get("skipped") or "")[:40] or None} for r in rows], cols)
    print(f"wrote {path} in {payload['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
