"""Sliding-window streaming on the reference model: resident memory while generating 10x the window.

    python bench/window_stream.py [--window 256] [--quick] [--threads 1]

Three artefacts of SmolLM2-135M, each streamed through the runtime's token loop in its own process
(greedy, end-of-sequence ignored), resident memory sampled every 32 tokens:
  onnx-window   ONNX Runtime int4, GroupQueryAttention's windowed cache (`export_onnx(kv="window")`);
  pte-window    ExecuTorch 8da4w + 4-bit embeddings, the ring cache with 4 attention sinks
                (`export_pte(kv="window")`);
  onnx-static   the static ONNX graph sized for the whole stream (max_seq_len = 10 x window + prompt),
                for contrast: its buffers are committed page by page as the stream fills them.
Reports resident memory growth after the first two windows (the bound the tests use is 2 MiB on
tiny models), decode tokens/s, and writes bench/results/window_stream.json and window_stream.png.
Artefacts are cached under $EDGEFINFER_CACHE/bench (the ExecuTorch export takes minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, print_table, versions, write_results  # noqa: E402

SAMPLE_EVERY = 32
PROMPT_TOKENS = 64


def artefacts(window: int, total: int) -> dict[str, Path]:
    """Export (once) the three artefacts; returns name -> path."""
    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.executorch_export import export_pte
    from edgefinfer.compile.onnx_export import export_onnx
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.tokenization.tokenizer import Tokenizer

    folder = reference.pull("smollm2-135m")
    root = cache_dir() / "bench" / "window_stream"
    paths = {"onnx-window": root / f"onnx-window-{window}", "pte-window": root / f"pte-window-{window}" / "model.pte",
             "onnx-static": root / f"onnx-static-{total}"}
    model = None
    for name, path in paths.items():
        if path.exists() and (path.is_file() or (path / "model.onnx").is_file()):
            continue
        model = model or load_model(folder)
        t0 = time.perf_counter()
        print(f"[export] {name} ...", file=sys.stderr, flush=True)
        if name == "onnx-window":
            export_onnx(model, path, weights="int4", kv="window", window=window)
        elif name == "onnx-static":
            export_onnx(model, path, weights="int4", max_seq_len=total)
        else:
            export_pte(model, path, recipe="8da4w", embedding_4bit=True, kv="window", window=window, num_sinks=4)
        Tokenizer.from_dir(folder).save(path if path.is_dir() else path.parent)
        print(f"[export] {name} done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return paths


def prompt_ids() -> list[int]:
    from edgefinfer.model import reference
    from edgefinfer.data.corpora import load_text
    from edgefinfer.tokenization.tokenizer import Tokenizer

    return Tokenizer.from_dir(reference.pull("smollm2-135m")).encode(load_text("test")[:2000])[:PROMPT_TOKENS]


def child(path: str, prompt: list[int], n_tokens: int, threads: int) -> None:
    """Stream `n_tokens` and print one JSON line: RSS samples and decode speed. Imports only the
    runtime (the ONNX Runtime path then runs without torch)."""
    from edgefinfer.decoding.generation import GenerationStats
    from edgefinfer.runtime.decode import generate_tokens
    from edgefinfer.runtime.engine import Engine, rss_mb

    engine = Engine.load(path, threads=threads)
    stats, samples = GenerationStats(), []
    for i, _ in enumerate(generate_tokens(engine.backend, prompt, n_tokens, stop_ids=(), stats=stats)):
        if i % SAMPLE_EVERY == 0:
            samples.append((i, round(rss_mb(), 2)))
    print(json.dumps({"samples": samples, "decode_tok_s": stats.decode_tok_s, "tokens": stats.generated_tokens}))


def run(name: str, path: Path, prompt: list[int], n_tokens: int, threads: int, window: int) -> dict:
    print(f"[stream] {name}: {n_tokens} tokens ...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, __file__, "--child", str(path), "--prompt", ",".join(map(str, prompt)),
                           "--tokens", str(n_tokens), "--threads", str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed: {proc.stderr.strip().splitlines()[-1]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    settled = [rss for i, rss in out["samples"] if i >= 2 * window]
    out.update(engine=name, rss_start_mb=settled[0], rss_end_mb=out["samples"][-1][1],
               growth_after_2_windows_mb=round(max(settled) - settled[0], 2))
    print(f"[stream] {name}: {out['decode_tok_s']:.1f} tok/s, growth {out['growth_after_2_windows_mb']} MiB",
          file=sys.stderr, flush=True)
    return out


def plot(rows: list[dict], window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        xs, ys = zip(*r["samples"])
        ax.plot(xs, ys, label=f"{r['engine']} ({r['decode_tok_s']:.0f} tok/s)")
    for k in range(1, 11):
        ax.axvline(k * window, color="0.9", lw=0.8, zorder=0)
    ax.set_xlabel(f"generated tokens (grey lines: multiples of the {window}-token window)")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("SmolLM2-135M: streaming 10x the window, 1 thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="window 64 (10x = 640 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, [int(t) for t in args.prompt.split(",")], args.tokens, args.threads)
    window = 64 if args.quick else args.window
    n_tokens = 10 * window
    paths = artefacts(window, n_tokens + PROMPT_TOKENS)
    prompt = prompt_ids()
    rows = [run(name, path, prompt, n_tokens, args.threads, window) for name, path in paths.items()]
    print_table(rows, ["engine", "tokens", "decode_tok_s", "rss_start_mb", "rss_end_mb", "growth_after_2_windows_mb"])
    payload = {"window": window, "tokens": n_tokens, "threads": args.threads, "rows": rows, "machine": machine(),
               "versions": versions("onnxruntime", "executorch")}
    if not args.quick:
        plot(rows, window, RESULTS / "window_stream.png")
    print(write_results("window_stream", payload, quick=args.quick))


if __name__ == "__main__":
    main()
