"""Serving benchmark: edgefinfer's server vs llama-cpp-python's own server, same GGUF, same machine.

    python bench/server.py            # the full run (about 10 minutes on 2 cores)
    python bench/server.py --quick    # about a minute

Each server runs in its own process with the same thread count and KV precision. A closed-loop load
generator (C clients, each sending its next request when the previous one ends) measures, per
concurrency C in 1, 4, 16, 32: aggregate output tokens/s (tokens of all completions / wall time of
the level) and p50/p99 time to first token (first streamed text). Output tokens are counted by
re-tokenizing each completion with the model's tokenizer, the same way for both servers.
Speculative decoding (prompt lookup, adaptive k) is measured on our server at C = 1 and 16.

Writes bench/results/server.json ("rows": server, concurrency, tok_s, ttft_p50_s, ttft_p99_s,
speculative, ...) and bench/results/server.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, machine, print_table, versions, result_stem, write_results  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List ten fruits, one per line, each with its color.",
    "Repeat the following sentence three times: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe the water cycle in four steps.",
    "Translate into French: Good morning, how are you today? I am fine, thank you.",
    "Give three tips for staying focused while studying.",
    "Write a haiku about autumn leaves, then explain it.",
    "Count from one to twenty in words, separated by commas.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Write an email to a colleague asking to move a meeting to Friday.",
    "Explain what a binary search does and why it is fast.",
    "Name the planets of the solar system in order from the sun.",
    "Write the alphabet in capital letters, separated by spaces.",
]


BANNED: tuple[int, ...] = ()  # end-of-sequence token ids, read from the GGUF in main()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, name: str, argv: list[str], port: int, model_id: str):
        self.name, self.argv, self.port, self.model_id = name, argv, port, model_id
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def one_request(client: httpx.AsyncClient, server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    # Greedy, no repetition penalty (llama_cpp.server applies 1.1 by default) and end-of-sequence
    # tokens banned: both servers then generate the very same tokens, max_tokens of them.
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "repeat_penalty": 1.0, "logit_bias": {str(t): -100 for t in BANNED}}
    t0 = time.perf_counter()
    ttft, text = None, ""
    async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = "".join(c.get("text") or "" for c in chunk.get("choices", []))
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": text,
            "latency": time.perf_counter() - t0}


async def run_level(server: ServerProcess, concurrency: int, num_requests: int, max_tokens: int) -> tuple[float, list]:
    queue = list(range(num_requests))
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop(0)
            results.append(await one_request(client, server, PROMPTS[i % len(PROMPTS)], max_tokens))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        return time.perf_counter() - t0, results


def measure(server: ServerProcess, concurrency: int, num_requests: int, max_tokens: int, tokenizer,
            speculative: bool) -> dict:
    asyncio.run(run_level(server, 1, 1, 4))  # warm-up
    wall, results = asyncio.run(run_level(server, concurrency, num_requests, max_tokens))
    tokens = sum(len(tokenizer.encode(r["text"])) for r in results)
    ttft = np.array([r["ttft"] for r in results])
    row = {"server": server.name, "concurrency": concurrency, "speculative": speculative,
           "tok_s": round(tokens / wall, 2), "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
           "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3), "requests": len(results),
           "output_tokens": tokens, "wall_s": round(wall, 2)}
    print(f"  {server.name:<16} C={concurrency:<3} spec={speculative!s:<5} {row['tok_s']:8.1f} tok/s  "
          f"TTFT p50 {row['ttft_p50_s']:.2f}s p99 {row['ttft_p99_s']:.2f}s", flush=True)
    return row


def spec_stats(server: ServerProcess) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        for key in ("edgefinfer_spec_draft_tokens_total", "edgefinfer_spec_accepted_tokens_total"):
            if line.startswith(key + " "):
                out[key.removeprefix("edgefinfer_")] = float(line.split()[1])
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, spec), style in {("edgefinfer", False): "o-", ("llama_cpp.server", False): "s--",
                                ("edgefinfer", True): "^:"}.items():
        pts = sorted((r["concurrency"], r["tok_s"], r["ttft_p99_s"]) for r in rows
                     if r["server"] == name and r["speculative"] == spec)
        if not pts:
            continue
        label = name + (" + prompt lookup" if spec else "")
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=label)
    ax1.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="Aggregate throughput")
    ax2.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="seconds", title="p99 time to first token")
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (ax1, ax2):
        ax.set_xticks(levels, labels=[str(c) for c in levels])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a run of about a minute")
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")),
                    help="CPU threads for each server (1 keeps a shared 2-core box stable)")
    ap.add_argument("--gpu-layers", type=int, default=0, help="offload layers (CUDA builds), both servers")
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved runs per level (default 2; 1 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 48, 16 quick)")
    ap.add_argument("--no-compare", action="store_true", help="skip llama-cpp-python's server")
    ap.add_argument("--out", default="server")
    args = ap.parse_args()

    from edgefinfer import reference
    from edgefinfer.gguf_import import config_from_gguf, open_gguf, tokenizer_from_gguf

    global BANNED
    gguf = Path(args.model) if args.model else reference.gguf_path("smollm2-135m")
    meta = open_gguf(gguf)
    tokenizer = tokenizer_from_gguf(meta)
    ends = [tokenizer.eos_id, tokenizer.token_id("<|endoftext|>"), *config_from_gguf(meta).eos_token_ids]
    BANNED = tuple(sorted({t for t in ends if t is not None}))
    levels = [int(x) for x in args.levels.split(",")]
    args.repeats = args.repeats or (1 if args.quick else 2)
    max_tokens = args.max_tokens or (16 if args.quick else 48)
    # Requests per level: ours gets 2 per client (1 with --quick); llama_cpp.server serves one request
    # at a time, so above C=4 it gets one per client to keep the run short (its TTFT still queues C deep).
    per_level = {c: max(2, c) if args.quick else max(4, 2 * c) for c in levels}
    theirs_per_level = {c: max(2, c) if args.quick else (max(4, 2 * c) if c <= 4 else c) for c in levels}
    py = sys.executable
    common = ["--threads", str(args.threads), "--max-num-seqs", str(max(32, *levels)), "--max-model-len",
              str(max(512, 2 * max_tokens + 64)), "--log-level", "warning", "--gpu-layers", str(args.gpu_layers)]

    def ours(spec: bool) -> ServerProcess:
        port = free_port()
        argv = [py, "-m", "edgefinfer.app.serve_command", str(gguf), "--port", str(port), *common,
                "--served-model-name", "model"]
        if spec:
            argv += ["--speculative", "lookup:3,4"]
        return ServerProcess("edgefinfer", argv, port, "model")

    def theirs() -> ServerProcess:
        port = free_port()
        argv = [py, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
                "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                "--type_k", "0", "--type_v", "0", "--verbose", "False", "--model_alias", "model",
                "--interrupt_requests", "False",
                "--n_gpu_layers", str(args.gpu_layers)]
        return ServerProcess("llama_cpp.server", argv, port, "model")

    # The servers stay up; each level runs them back to back, `--repeats` times in alternating
    # order, and keeps each one's best run: other jobs on a shared machine only ever slow a run down,
    # so the best of interleaved runs compares the servers under the same conditions.
    runs: list[dict] = []
    t0 = time.time()
    print(f"model {gguf.name}, threads {args.threads}, max_tokens {max_tokens}, repeats {args.repeats}")
    with contextlib.ExitStack() as stack:
        plain, spec = stack.enter_context(ours(False)), stack.enter_context(ours(True))
        ref = None if args.no_compare else stack.enter_context(theirs())
        for c in levels:
            entries = [(plain, per_level[c], False)] + ([(ref, theirs_per_level[c], False)] if ref else [])
            if c in (1, 16):
                entries.insert(1, (spec, per_level[c], True))
            for rep in range(args.repeats):
                for server, n, is_spec in (entries if rep % 2 == 0 else entries[::-1]):
                    runs.append({**measure(server, c, n, max_tokens, tokenizer, is_spec), "repeat": rep})
        spec_info = spec_stats(spec)
    rows = []
    for key in dict.fromkeys((r["server"], r["concurrency"], r["speculative"]) for r in runs):
        rows.append(max((r for r in runs if (r["server"], r["concurrency"], r["speculative"]) == key),
                        key=lambda r: r["tok_s"]))

    def row(name: str, c: int, speculative: bool = False) -> dict | None:
        return next((r for r in rows if (r["server"], r["concurrency"], r["speculative"]) == (name, c, speculative)),
                    None)

    summary = {}
    a, b = row("edgefinfer", 16), row("llama_cpp.server", 16)
    if a and b:
        summary = {"tok_s_ratio_c16": round(a["tok_s"] / b["tok_s"], 2),
                   "ttft_p99_ratio_c16": round(a["ttft_p99_s"] / b["ttft_p99_s"], 3),
                   "goal": ">= 3x throughput at C=16 with equal or better p99 TTFT"}
    payload = {"rows": rows, "all_runs": runs, "summary": summary, "speculative": spec_info, "machine": machine(),
               "threads": args.threads, "model": gguf.name, "max_tokens": max_tokens, "quick": args.quick,
               "kv_dtype": "f32 (both)", "versions": versions("llama-cpp-python", "fastapi", "uvicorn", "httpx"),
               "elapsed_s": round(time.time() - t0, 1)}
    path = write_results(args.out, payload, quick=args.quick)
    png = RESULTS / f"{result_stem(args.out, args.quick)}.png"
    plot(rows, png)
    print_table(rows, ["server", "concurrency", "speculative", "tok_s", "ttft_p50_s", "ttft_p99_s", "requests"])
    print(f"summary {summary}\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
