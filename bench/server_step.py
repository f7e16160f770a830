"""Where a serving step's time goes: `llama_decode` against the Python around it, inside the engine.

    python bench/server_step.py            # 5 greedy requests of 64 tokens, one at a time (C = 1)
    python bench/server_step.py --quick    # 2 requests of 16 tokens

No HTTP: the serving engine of `edgefinfer serve` (per-slot layout, f16 KV, flash attention, 2
threads: bench/server.py's settings) runs in its own thread as in the server, and each part of a
step is timed by wrapping it: the raw `llama_decode` call, the binding's `decode` around it (batch
fill, logits view), the executor, the scheduler's `schedule` and `update` (and inside `update`
sampling, `logit_bias`, text), the metrics. Medians over all steps (one prefill in every max_tokens
steps, so a median is a decode step's).

What the step costs beyond `llama_decode` is what a server in C++ (llama-server) does not pay per
token. The same calls in a warm loop are also timed (`warm_*`): each decode streams the whole
model's weights through the caches, so inside the engine the interpreter starts every step cold.

`--peer` also checks that the kernels are not where llama-server is ahead: it alternates, in one
run, llama-server's own per-token decode time (`timings.predicted_ms` of a non-streamed
/completion, greedy, `--parallel 16`, same GGUF, threads, f16 KV and flash attention) with bare
`llama_decode` steps through our binding in a context of the server's settings, `--peer-rounds`
pairs of 64 tokens each.

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


def decode_parity(gguf: Path, threads: int, rounds: int, binary: str | None) -> dict:
    """Per-token decode time, llama-server's own against bare llama_decode through our binding,
    alternated (ms per token, one 64-token greedy completion per round and side)."""
    import httpx
    from bench import peers
    from bench.server import SLOT_CTX, SLOTS, ServerProcess, free_port, llama_server_argv
    from edgefinfer.runtime.backends.llamacpp_binding import LlamaContext, LlamaModel

    port, n = free_port(), 64
    server = ServerProcess("llama-server", "default",
                           llama_server_argv(binary or peers.llama_server(), gguf, port, threads), port)
    model = LlamaModel(gguf)
    ctx = LlamaContext(model, SLOTS, SLOT_CTX, flash_attn=True, kv_dtype="f16", threads=threads, max_tokens=512)

    def ours(i: int) -> float:
        ctx.remove(0)
        tokens = model.tokenize(f"Request {i}. {PROMPT}")
        token, pos, times = int(ctx.decode([(0, 0, tokens, 1)], copy=False)[-1].argmax()), len(tokens), []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = ctx.decode([(0, pos, [token], 1)], copy=False)
            times.append(time.perf_counter() - t0)
            token, pos = int(logits[-1].argmax()), pos + 1
        return statistics.median(times) * 1e3

    def peer(i: int) -> float:
        body = {"prompt": f"Request {i}. {PROMPT}", "n_predict": n, "temperature": 0, "cache_prompt": False,
                "ignore_eos": True}
        t = httpx.post(f"{server.url}/completion", json=body, timeout=300).json()["timings"]
        return t["predicted_ms"] / (t["predicted_n"] - 1)  # the first token comes from the prompt's logits

    try:
        with server:
            peer(-1), ours(-1)  # warm-up
            pairs = [(ours(i), peer(i)) for i in range(rounds)]
    finally:
        ctx.close()
        model.close()
    ratios = [a / b for a, b in pairs]
    return {"ours_llama_decode_ms": [round(a, 2) for a, _ in pairs],
            "llama_server_ms": [round(b, 2) for _, b in pairs],
            "ours_over_llama_server_median": round(statistics.median(ratios), 3),
            "ours_over_llama_server_min_max": [round(min(ratios), 3), round(max(ratios), 3)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--peer", action="store_true", help="also time llama-server's own decode step against ours")
    ap.add_argument("--peer-rounds", type=int, default=8)
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: bench/peers.py builds one)")
    args = ap.parse_args()
    requests = args.requests or (2 if args.quick else 5)
    max_tokens = args.max_tokens or (16 if args.quick else 64)

    from edgefinfer.model import reference
    import edgefinfer.server_gpu.scheduler as scheduler_module
    from edgefinfer.decoding.sampling import SamplingParams
    from edgefinfer.server_gpu.loader import ServeOptions, build_engine
    from edgefinfer.server_gpu.request import GenerationParams

    gguf = reference.gguf_path("smollm2-135m")
    engine, _ = build_engine(ServeOptions(model=str(gguf), threads=args.threads, max_num_seqs=16,
                                          max_model_len=2048, kv_dtype="f16", flash_attn=True, kv_unified=False))
    timer = Timer()
    ctx, scheduler = engine.executor.ctx, engine.scheduler
    timer.wrap(ctx.lib, "llama_decode", "llama_decode")
    timer.wrap(ctx, "decode", "binding decode (batch, logits view)")
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
    parity = None
    if args.peer:
        parity = decode_parity(gguf, args.threads, args.peer_rounds, args.llama_server)
        print(f"decode step, bare llama_decode through our binding / llama-server's own: "
              f"{parity['ours_over_llama_server_median']:.3f} (median of {args.peer_rounds} alternated pairs; "
              f"{parity['ours_llama_decode_ms']} against {parity['llama_server_ms']} ms)")
    path = write_results("server_step", {"rows": rows, "summary": summary, "decode_parity": parity, "requests": requests,
                                         "max_tokens": max_tokens, "threads": args.threads, "model": gguf.name,
                                         "machine": machine(), "versions": versions("llama-cpp-python"),
                                         "elapsed_s": round(time.time() - t0, 1)}, quick=args.quick)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
