"""KV memory and speculative decoding benchmark.

    python bench/kv_spec.py [--quick] [--threads N] [--draft DIR]

1. KV memory waste under a mixed-length workload (lengths from a long-tailed distribution):
   bytes reserved vs bytes used for the paged-KV manager (block 16) vs contiguous max-length
   allocation, and how many sequences fit in a fixed KV budget each way.
2. Speculative decoding on the reference model, greedy, through the runtime Engine (eager torch):
   plain vs prompt lookup on a task that repeats its input, and plain vs a small draft model (the
   distilled student when it exists). Output equality is asserted, speed-up and acceptance reported.
Writes bench/results/kv_spec.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402


def workload(n: int, max_len: int, seed: int = 0) -> list[int]:
    """Sequence lengths (prompt + output): log-normal, median ~300 tokens, capped at the context."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(mean=5.7, sigma=0.9, size=n), 8, max_len)]


def kv_waste(lengths: list[int], block_size: int, max_len: int) -> dict:
    from edgefinfer.runtime.kv.paged_manager import PagedKVManager

    total_blocks = sum(-(-n // block_size) for n in lengths) + 1
    manager = PagedKVManager(total_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        manager.allocate(i, list(range(n)))
    used = sum(lengths)
    paged_reserved = manager.stats().num_used * block_size
    contiguous_reserved = len(lengths) * max_len
    return {"paged_kv_waste": 1 - used / paged_reserved, "contiguous_kv_waste": 1 - used / contiguous_reserved}


def max_concurrent(lengths: list[int], block_size: int, max_len: int, budget_tokens: int) -> dict:
    """Sequences admitted in arrival order until the KV budget is full, each way."""
    from edgefinfer.runtime.kv.paged_manager import PagedKVManager

    manager = PagedKVManager(budget_tokens // block_size, block_size, enable_prefix_caching=False)
    paged = 0
    for i, n in enumerate(lengths):
        if not manager.allocate(i, list(range(n))):
            break
        paged += 1
    return {"paged_max_seqs": paged, "contiguous_max_seqs": budget_tokens // max_len}


def speculative(folder: Path, draft: Path | None, n_tokens: int, threads: int) -> dict:
    from edgefinfer.data.corpora import load_text
    from edgefinfer.runtime.engine import Engine

    # A task that repeats its input (quoting, summarising with citations, editing code): the prompt holds
    # a passage and the start of its repetition, so a model that continues faithfully copies it.
    passage = load_text("test")[2000:3400]
    prompt = passage + "\n\nThe same passage, quoted again in full:\n\n" + passage[:60]

    def timed(spec: str | None) -> tuple[list[int], float, object]:
        engine = Engine.load(folder, backend="torch", speculative=spec, threads=threads)
        engine.generate(prompt, max_tokens=4)  # warm-up
        t0 = time.perf_counter()
        out = engine.generate(prompt, max_tokens=n_tokens)
        dt = time.perf_counter() - out.stats.prefill_s - t0
        return out.token_ids, (len(out.token_ids) - 1) / dt, engine.speculation

    base_ids, base_tok_s, _ = timed(None)
    rows = [{"mode": "plain", "decode_tok_s": base_tok_s, "speedup": 1.0, "acceptance": None, "tokens": len(base_ids)}]
    result = {"spec_speedup_lookup": None, "spec_speedup_draft": None, "spec_acceptance_draft": None,
              "spec_acceptance_lookup": None}
    candidates = [("lookup", "lookup:3,8")]
    if draft is not None:
        candidates.append(("draft", f"draft:{draft},4"))
    for name, spec in candidates:
        ids, tok_s, spec_state = timed(spec)
        if ids != base_ids:
            raise AssertionError(f"speculative decoding ({name}) changed the greedy output")
        rows.append({"mode": spec, "decode_tok_s": tok_s, "speedup": tok_s / base_tok_s,
                     "acceptance": spec_state.stats.acceptance_rate, "tokens": len(ids)})
        result[f"spec_speedup_{name}"] = tok_s / base_tok_s
        result[f"spec_acceptance_{name}"] = spec_state.stats.acceptance_rate
    result["spec_rows"] = rows
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", type=Path, default=None, help="draft model folder (default: the distilled student)")
    args = ap.parse_args()
    from edgefinfer.model import reference
    from edgefinfer.files.user_cache import cache_dir

    block_size, max_len, budget = 16, 2048, 65536
    lengths = workload(200 if args.quick else 2000, max_len)
    out = {**kv_waste(lengths, block_size, max_len), **max_concurrent(lengths, block_size, max_len, budget)}
    print_table([{"layout": "paged (block 16)", "waste": out["paged_kv_waste"], "max_seqs": out["paged_max_seqs"]},
                 {"layout": f"contiguous ({max_len})", "waste": out["contiguous_kv_waste"],
                  "max_seqs": out["contiguous_max_seqs"]}], ["layout", "waste", "max_seqs"])

    folder = reference.pull("smollm2-135m")
    draft = args.draft or cache_dir() / "models" / "smollm2-135m-draft"
    draft = draft if (draft / "config.json").is_file() else None
    if draft is None:
        print("no draft model found (run bench/compress.py to distil one); draft row skipped", file=sys.stderr)
    spec = speculative(folder, draft, 48 if args.quick else 160, args.threads)
    print_table(spec["spec_rows"], ["mode", "decode_tok_s", "speedup", "acceptance", "tokens"])
    out.update(spec)
    path = write_results("kv_spec", quick=args.quick, payload={
        **out,
        "settings": {"quick": args.quick, "block_size": block_size, "max_len": max_len, "kv_budget_tokens": budget,
                     "num_sequences": len(lengths), "length_distribution": "lognormal(5.7, 0.9) clipped to [8, 2048]",
                     "draft": str(draft) if draft else None, "backend": "torch eager fp32", "batch": 1},
        "threads": args.threads, "machine": machine(), "versions": versions(),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
