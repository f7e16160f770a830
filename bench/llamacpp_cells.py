"""llama.cpp's KV cell formats on the reference GGUF: which one `edgefinfer run` should keep.

    python bench/llamacpp_cells.py [--threads 2] [--rounds 3]

The shipped SmolLM2-135M Q4_1 GGUF through the runtime's own backend (`LlamaCppBackend`, one
sequence), in three cell formats: f32 K/V with plain attention (exact for float weights), f16 K/V
with plain attention, f16 K/V with flash attention (llama-server's `-fa auto` on a CPU). What a
conversation does to a cache, each timed on its own:

- `prefill_400_s`: a fresh 400-token prompt;
- `turn_44_at_813_s`: a chat turn, 44 new tokens on top of 813 cached ones (a session's turn 10);
- `decode_at_64_tok_s` / `decode_at_850_tok_s`: 64 one-token steps after 64 / 850 cached tokens;
- `split_equal_up_to`: the largest prefill batch whose logits equal the same tokens fed one at a time
  (bit for bit), of 2, 4, 8, 16, 32, 48 and 64 tokens.

Formats are interleaved per round (each a fresh context), medians of `--rounds` with their range. Random
token ids (the same for every format), greedy logits only. Writes bench/results/llamacpp_cells.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, uptime, versions, write_results  # noqa: E402

FORMATS = (("f32", False), ("f16", False), ("f16", True))
SPLITS = (2, 4, 8, 16, 32, 48, 64)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def one_round(gguf: Path, dtype: str, flash: bool, threads: int, ids: list[int]) -> dict:
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
    from edgefinfer.runtime.backends.llamacpp_binding import CellFormat

    b = LlamaCppBackend(gguf, n_ctx=1024, threads=threads, cells=CellFormat(dtype, flash))
    out = {"prefill_400_s": timed(lambda: b.forward_last(ids[:400], 0))}

    def decode(start: int) -> float:
        b.rollback(start)
        return 64 / timed(lambda: [b.forward_last([ids[start + i]], start + i) for i in range(64)])

    out["decode_at_64_tok_s"] = decode(64)
    b.reset()
    b.forward_last(ids[:813], 0)
    out["turn_44_at_813_s"] = timed(lambda: b.forward_last(ids[813:857], 813))
    out["decode_at_850_tok_s"] = decode(850)
    return out


def split_equal_up_to(gguf: Path, dtype: str, flash: bool, ids: list[int]) -> int:
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
    from edgefinfer.runtime.backends.llamacpp_binding import CellFormat

    b = LlamaCppBackend(gguf, n_ctx=1024, threads=1, cells=CellFormat(dtype, flash))
    alone = np.stack([b.forward([t], i)[0] for i, t in enumerate(ids[:max(SPLITS)])])
    best = 1
    for n in SPLITS:
        b.reset()
        if not np.array_equal(b.forward(ids[:n], 0), alone[:n]):
            break
        best = n
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from edgefinfer.model import reference

    gguf = reference.gguf_path("smollm2-135m")
    ids = [int(t) for t in np.random.default_rng(0).integers(100, 40000, 1000)]
    before = uptime()
    samples: dict[tuple, list[dict]] = {f: [] for f in FORMATS}
    for r in range(args.rounds):
        for f in FORMATS[r % len(FORMATS):] + FORMATS[:r % len(FORMATS)]:  # rotated: no format always first
            samples[f].append(one_round(gguf, *f, args.threads, ids))
            print(f"round {r + 1}: {f} {samples[f][-1]}", flush=True)
    rows = []
    for (dtype, flash), runs in samples.items():
        row = {"kv": dtype, "flash_attn": flash}
        for key in runs[0]:
            values = [run[key] for run in runs]
            row[key] = round(statistics.median(values), 4 if key.endswith("_s") else 1)
            row[key + "_range"] = [round(min(values), 4), round(max(values), 4)]
        row["split_equal_up_to"] = split_equal_up_to(gguf, dtype, flash, ids)
        rows.append(row)
    payload = {"machine": machine(), "versions": versions("llama-cpp-python"), "model": gguf.name,
               "threads": args.threads, "rounds": args.rounds, "uptime_before": before,
               "uptime_after": uptime(),
               "load_avg_end": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    out = write_results("llamacpp_cells", payload)
    print_table(rows, ["kv", "flash_attn", "prefill_400_s", "turn_44_at_813_s", "decode_at_64_tok_s",
                       "decode_at_850_tok_s", "split_equal_up_to"])
    print(f"{before} -> {payload['uptime_after']}; wrote {out}")


if __name__ == "__main__":
    main()
