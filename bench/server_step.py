"""Where a serving step's time goes: `llama_decode` against the Python around it, inside the engine.

    python bench/server_step.py            # 5 greedy requests of 64 tokens, one at a time (C = 1)
    python bench/server_step.py --quick    # 2 requests of 16 tokens

No HTTP: the serving engine of `edgefinfer serve` (per-slot layout, f16 KV, flash attention, 2
threads: bench/server.py's settings) runs in its own thread as in the server, and each part of a
step is timed by wrapping it: the raw `llama_decode` call, the binding's `decode` around it (batch
fill, logits copy), the executor, the scheduler's `schedule` and `update` (and inside `update`
sampling, `logit_bias`, text), the metrics. Medians over all steps (one prefill in every max_tokens
steps, so a median is a decode step's).

What the step costs beyond `llama_decode` is what a server in C++ (llama-server) does not pay per
token. The same calls in a warm loop are also timed (`warm_*`): each decode streams the whole
model's weights through the caches, so inside the engine the interpreter starts every step cold.

Writes bench/results/server_step.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path

import numpy as np

# As bench/server.py runs our server: torch is imported, one OpenMP thread keeps it from competing
# with llama.cpp's own threads (their count is set explicitly).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, print_table, versions, write_results  # noqa: E402

PROMPT = "Explain how a refrigerator works to a ten-year-old."


class Timer:
    """Median wall time of each wrapped callable, in microseconds."""

    def __init__(self):
        self.samples: dict[str, list[float]] = collections.defaultdict(list)

    def wrap(self, owner: object, attr: str, name: str) -> None:
        inner = getattr(owner, attr)
        samples = self.samples[name]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - t0)

        setattr(owner, attr, timed)

    def clear(self) -> None:
        for v in self.samples.values():
            v.clear()


def warm_costs(vocab: int) -> dict[str, float]:
    """The same numpy work as a step's, in a warm loop (microseconds)."""
    row = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    n = 2000
    return {"warm_argmax_us": timeit.timeit(row.argmax, number=n) / n * 1e6,
            "warm_copy_us": timeit.timeit(row.copy, number=n) / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()
    requests = args.requests or (2 if args.quick else 5)
    max_tokens = args.max_tokens or (16 if args.quick else 64)

    from edgefinfer import reference
    import edgefinfer.server_gpu.scheduler as scheduler_module
    from edgefinfer.sampling import SamplingParams
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine
    from edgefinfer.server_gpu.request import GenerationParams

    gguf = reference.gguf_path("smollm2-135m")
    engine, _ = build_engine(ServeOptions(model=str(gguf), threads=args.threads, max_num_seqs=16,
                                          max_model_len=2048, kv_dtype="f16", flash_attn=True))
    timer = Timer()
    ctx, scheduler = engine.executor.ctx, engine.scheduler
    timer.wrap(ctx.lib, "llama_decode", "llama_decode")
    timer.wrap(ctx, "decode", "binding decode (batch, logits copy)")
    timer.wrap(engine.executor, "execute", "executor execute")
    timer.wrap(scheduler, "schedule", "scheduler schedule")
    timer.wrap(scheduler, "update", "scheduler update")
    timer.wrap(scheduler_module, "pick_token", "  update: pick_token")
    timer.wrap(scheduler_module.sampler, "apply_bias", "  update: logit_bias")
    timer.wrap(scheduler, "_emit", "  update: emit (text, stop strings)")
    timer.wrap(engine, "_record", "metrics record")
    timer.wrap(engine, "_publish", "metrics publish")
    timer.wrap(engine, "_step", "engine step")

    ids = engine.tokenizer.encode(PROMPT)
    # Ban end-of-sequence as bench/server.py does: every request runs max_tokens steps.
    bias = tuple((t, -100.0) for t in {engine.tokenizer.eos_id, *engine.scheduler.stop_ids} if t is not None)

    def one(i: int) -> None:
        done = threading.Event()
        engine.submit(f"r{i}", [ids[0], *engine.tokenizer.encode(f"Request {i}."), *ids[1:]],
                      GenerationParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
                                       logit_bias=bias),
                      lambda out: done.set() if out.finished else None)
        done.wait()

    engine.start()  # its own thread, as in the server; outputs are delivered there
    one(-1)  # warm-up: the first graph of each shape
    timer.clear()
    t0 = time.time()
    for i in range(requests):
        one(i)
    engine.close()
    rows = []
    for name, samples in timer.samples.items():
        rows.append({"part": name, "calls": len(samples), "median_us": round(statistics.median(samples) * 1e6, 1)})
    by = {r["part"]: r["median_us"] for r in rows}
    overhead = by["engine step"] - by["llama_decode"]
    summary = {"step_us": by["engine step"], "llama_decode_us": by["llama_decode"],
               "python_per_step_us": round(overhead, 1),
               "python_share": round(overhead / by["engine step"], 4),
               **{k: round(v, 1) for k, v in warm_costs(engine.executor.vocab_size).items()}}
    print_table(rows, ["part", "calls", "median_us"])
    print(f"per step: {summary['step_us']:.0f} us, llama_decode {summary['llama_decode_us']:.0f} us, "
          f"Python around it {overhead:.0f} us ({100 * summary['python_share']:.1f}%); warm loop: argmax "
          f"{summary['warm_argmax_us']:.1f} us, 200 KB copy {summary['warm_copy_us']:.1f} us")
    path = write_results("server_step", {"rows": rows, "summary": summary, "requests": requests,
                                         "max_tokens": max_tokens, "threads": args.threads, "model": gguf.name,
                                         "machine": machine(), "versions": versions("llama-cpp-python"),
                                         "elapsed_s": round(time.time() - t0, 1)}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
