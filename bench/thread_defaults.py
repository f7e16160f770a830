"""Decode speed of a GGUF at each engine's default thread count, beside explicit counts: `edgefinfer run`'s
runtime (one llama.cpp thread per physical core of its affinity mask, llama.cpp's own default) against
llama-cpp-python's high-level API (its defaults: half the CPUs for one-token steps, all for prompts).

    python bench/thread_defaults.py [--rounds 3] [--threads 1,2]

The shipped SmolLM2-135M Q4_1 GGUF, 128 prompt tokens, 64 greedy tokens, batch 1; each engine and
setting in a process of its own (bench/runtime.py's children: the runtime's token loop over its
llama.cpp backend, and `llama_cpp.Llama.generate`), `default` passing no thread count at all. Rounds
visit the settings in a rotated order; rows hold the median and range of the rounds. Writes
bench/results/thread_defaults.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import runtime as R  # noqa: E402
from common import machine, print_table, uptime, versions, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="explicit thread counts measured beside the defaults")
    ap.add_argument("--out", default="thread_defaults")
    args = ap.parse_args()

    from edgefinfer.data.corpora import load_text
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.libraries.cpus import usable_cores, usable_cpus
    from edgefinfer.model import reference
    from edgefinfer.model.gguf_import import open_gguf, tokenizer_from_gguf

    gguf = reference.gguf_path("smollm2-135m")
    prompt = tokenizer_from_gguf(open_gguf(gguf)).encode(load_text("test"))[:128]
    prompt_file = cache_dir() / "bench" / "thread_defaults-prompt.json"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text(json.dumps(prompt))
    counts = [0] + [int(t) for t in args.threads.split(",")]  # 0: the engine's default
    settings = [(engine, t) for t in counts for engine in ("ours", "llamacpp")]
    before = uptime()
    runs: dict[tuple[str, int], list[dict]] = {s: [] for s in settings}
    for r in range(args.rounds):
        k = r % len(settings)
        for engine, t in settings[k:] + settings[:k]:
            out = R.measure(engine, "llamacpp", gguf, prompt_file, 64, t)
            runs[(engine, t)].append(out)
            print(f"  round {r + 1} {engine:<9} threads {t or 'default':<8} decode {out['decode_tok_s']:6.1f} tok/s  "
                  f"prefill {out['prefill_tok_s']:6.1f} tok/s", file=sys.stderr, flush=True)
    first = runs[settings[0]][0]["tokens"]
    rows = []
    for (engine, t), rs in runs.items():
        decode = [x["decode_tok_s"] for x in rs]
        rows.append({"engine": "edgefinfer run" if engine == "ours" else "llama-cpp-python",
                     "threads": t or "default", "decode_tok_s": round(statistics.median(decode), 1),
                     "decode_min_max": [round(min(decode), 1), round(max(decode), 1)],
                     "prefill_tok_s": round(statistics.median(x["prefill_tok_s"] for x in rs), 1),
                     "same_tokens_as_first_row": all(x["tokens"] == first for x in rs)})
    print_table(rows, ["engine", "threads", "decode_tok_s", "decode_min_max", "prefill_tok_s", "same_tokens_as_first_row"])
    write_results(args.out, {
        "rows": rows, "runs": {f"{e}:{t or 'default'}": rs for (e, t), rs in runs.items()},
        "usable_cpus": usable_cpus(), "usable_cores": usable_cores(), "rounds": args.rounds,
        "prompt_tokens": len(prompt), "decode_tokens": 64, "model": gguf.name,
        "machine": machine(), "versions": versions("llama_cpp_python"), "uptime_before": before,
        "uptime_after": uptime()})


if __name__ == "__main__":
    main()
