"""Serving benchmark: edgefinfer's server vs llama.cpp's own `llama-server --parallel N` (and
llama-cpp-python's `llama_cpp.server`), same GGUF, same client, same requests, same machine.

    python bench/server.py            # the full run (about 20 minutes on 2 cores)
    python bench/server.py --quick    # about two minutes: one run each, fewer requests

Servers, each in its own process with the same thread count, slots and context:
- `llama-server` built from the llama.cpp vendored in the pinned llama-cpp-python sdist, with our
  wheel's ggml flags (bench/peers.py builds it once), `--parallel 16` slots of 2048 cells (its
  per-slot layout), f16 KV and flash attention (its defaults on this CPU; `--flash-attn off` to
  compare without). For workload (b) also with `--cache-reuse 256`, and with `cache_prompt: false`.
- `llama_cpp.server`, llama-cpp-python's server, which serves one request at a time: workload (a).
- `edgefinfer` at its defaults (`defaults`: f16 KV, flash attention, per-slot streams that keep each
  finished prompt, as llama-server's; no tuning flag), `unified` (`--kv-layout unified`: one pool,
  prefixes stored once), and `batch-invariant` (`--batch-invariant`: exactly `edgefinfer run`'s tokens; not in the default
  set, `--servers edgefinfer:batch-invariant` adds it).

Workloads (closed loop: C clients, each sending its next request when its previous one ends), shaped
like real traffic where it shares, and unshared where it must not:
- (a) `short`: 16 one-line prompts, 48 output tokens, at C = 1 (each prompt once per run) and 16
  (two per client), every request with its own first word (nothing shared);
- (b) `shared-system`: 16 concurrent chats whose prompts share a 512-token system prompt, each a
  different question, 48 output tokens; the system prompt is the same in every run (warm, as a
  deployed assistant's is), the questions are new each run;
- (c) `long-short`: half 1500-token prompts, half one-line prompts, 48 output tokens, C = 8 (new
  text each run);
- (d) `chat-header`: the short prompts in the model's chat template (its default system turn: a
  header every request shares, as chat traffic does), a new question each request, C = 16;
- (e) `repeated`: the same 16 chat prompts in every run (a chat history sent again), C = 16: a
  server that keeps finished prompts answers them from its cache.

Per workload, concurrency and server: output tokens/s (tokens of all completions / wall time),
TTFT p50/p99 (first streamed text) and inter-token latency p50 (per request: (last chunk - first
chunk) / (tokens - 1)). Tokens are counted by re-tokenizing each completion with the model's
tokenizer, the same way for every server; greedy with end-of-sequence banned, so every server writes
exactly max_tokens tokens. Runs are interleaved (each repeat visits the servers in a rotated order);
rows hold the median of `--repeats` (>= 3) runs, and the runs themselves.

Also measured: `kv_capacity`, sequences admitted at one fixed KV memory budget.

Writes bench/results/server.json and bench/results/server.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, machine, print_table, result_stem, uptime, versions, write_results  # noqa: E402
from edgefinfer.libraries.cpus import usable_cores  # noqa: E402
# Ports below the ephemeral range: one that `bind(0)` finds free can be taken before the server binds it
# (tests/server_harness.py says how a replicas cluster lost that race); bench/server_scale.py starts those too.
from tests.server_harness import free_port  # noqa: E402

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
SLOTS = 16  # llama-server --parallel, and our --max-num-seqs
SLOT_CTX = 2048  # cells per sequence (llama-server: per slot)

BANNED: tuple[int, ...] = ()  # end-of-sequence token ids, read from the GGUF in main()


# ------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]
    levels: tuple[int, ...]
    requests_per_client: int
    min_requests: int = 2  # per run, whatever the concurrency (C = 1 with 2 requests is one second of data)
    # How a run makes its prompts new (`run_prompts`): "request", each request starts with a word no
    # other request of the benchmark starts with (nothing shared); "run", the run's tag goes first (the
    # run's requests share what their prompts share, nothing with other runs); "{tag}" in a prompt, the
    # tag goes there (what comes before it is shared with every run: warm); "none", the same prompts
    # every run (repeated traffic).
    tag: str = "run"


def end_tokens(meta, tokenizer) -> tuple[int, ...]:
    """The GGUF's end-of-sequence token ids: what every benchmark request bans, so that every server
    writes exactly max_tokens tokens."""
    from edgefinfer.model.gguf_import import config_from_gguf

    ends = [tokenizer.eos_id, tokenizer.token_id("<|endoftext|>"), *config_from_gguf(meta).eos_token_ids]
    return tuple(sorted({t for t in ends if t is not None}))


def text_of_tokens(tokenizer, seed_text: str, num_tokens: int) -> str:
    """A prose prompt of exactly `num_tokens` tokens (by the model's tokenizer)."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(seed_text)
    return tokenizer.decode(ids[:num_tokens])


SYSTEM_SEED = ("You are a careful assistant for a public library. Answer in plain language, cite the section "
               "of the library rules you rely on, never invent opening hours, and keep each answer short. ")
LONG_SEED = ("The history of the lighthouse begins with fires lit on hills to guide ships home, and continues "
             "through towers of stone, oil lamps, lenses and finally electric lights watched from far away. ")


def chat_prompt(tokenizer, question: str) -> str:
    """`question` as one user turn in the model's chat template (SmolLM2's adds its default system turn)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}])


def workloads(tokenizer, quick: bool) -> list[Workload]:
    system = text_of_tokens(tokenizer, SYSTEM_SEED, 512)
    long = text_of_tokens(tokenizer, LONG_SEED, 1500)
    # One request per client where prompts are long (each run then costs up to a minute per server).
    return [
        Workload("short", tuple(PROMPTS), (1, 16), 1 if quick else 2, 2 if quick else len(PROMPTS), tag="request"),
        Workload("shared-system", tuple(f"{system}\n{{tag}}Question: {p}\nAnswer:" for p in PROMPTS), (16,), 1),
        Workload("long-short", tuple(f"{long}\n{p}" if i % 2 == 0 else p for i, p in enumerate(PROMPTS[:8])),
                 (8,), 1),
        Workload("chat-header", tuple(chat_prompt(tokenizer, "{tag}" + p) for p in PROMPTS), (16,), 1),
        Workload("repeated", tuple(chat_prompt(tokenizer, p) for p in PROMPTS), (16,), 1, tag="none"),
    ]


# ------------------------------------------------------------------------------------- servers
@dataclass
class ServerProcess:
    name: str
    config: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    body: dict = field(default_factory=dict)  # extra request fields (llama-server's cache_prompt)
    log: Path | None = None  # its stderr goes here (a chatty server would fill an unread pipe), else a pipe
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerProcess":
        err = open(self.log, "wb") if self.log else subprocess.PIPE
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=err,
                                     env={**os.environ, **self.env}, start_new_session=True)
        if self.log:
            err.close()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.log.read_bytes() if self.log else self.proc.stderr.read()
                raise RuntimeError(f"{self.label} exited: {said.decode(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.label} did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def label(self) -> str:
        return f"{self.name} [{self.config}]"


# torch is imported by our server; one OpenMP thread keeps it from busy-waiting beside llama.cpp's
# own threads (llama.cpp's thread count is set explicitly and is not affected).
OURS_ENV = {"OMP_NUM_THREADS": "1"}


def llama_server_argv(binary: Path | str, gguf: Path, port: int, threads: int, flash_attn: str = "on",
                      gpu_layers: int = 0) -> list[str]:
    """llama.cpp's `llama-server` as every benchmark runs it: SLOTS slots of SLOT_CTX cells (its
    per-slot layout), f16 KV, the thread count for decode and batches alike."""
    th = str(threads)
    return [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", th, "-tb", th,
            "--parallel", str(SLOTS), "-c", str(SLOTS * SLOT_CTX), "-ctk", "f16", "-ctv", "f16", "-fa", flash_attn,
            "--no-webui", "--log-disable", "-a", "model", "-ngl", str(gpu_layers)]


def ours_argv(gguf: Path, port: int, threads: int, gpu_layers: int = 0, flash_attn: bool = True) -> list[str]:
    """`edgefinfer serve` with the capacity every peer gets too (slots, context, threads); its KV
    settings are its defaults (f16, flash attention: llama-server's), flash attention off on request."""
    return [sys.executable, "-m", "edgefinfer.app.serve_command", str(gguf), "--port", str(port),
            "--threads", str(threads), "--max-num-seqs", str(SLOTS), "--max-model-len", str(SLOT_CTX),
            "--log-level", "warning", "--gpu-layers", str(gpu_layers),
            "--served-model-name", "model", *([] if flash_attn else ["--no-flash-attn"])]


OURS_CONFIGS = {"defaults": [], "unified": ["--kv-layout", "unified"], "batch-invariant": ["--batch-invariant"]}


# ------------------------------------------------------------------------------------- client
RETRIES = 2  # the openai client's default max_retries


async def one_request(client: httpx.AsyncClient, server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    # Greedy, no repetition penalty (llama_cpp.server applies 1.1 by default) and end-of-sequence
    # tokens banned: every server then generates the very same tokens, max_tokens of them.
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "repeat_penalty": 1.0, "logit_bias": {str(t): -100 for t in BANNED}, **server.body}
    for attempt in range(RETRIES + 1):
        t0 = time.perf_counter()
        first = last = error = None
        text, done = "", False
        try:
            async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    done = done or line == "data: [DONE]"
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    error = chunk.get("error", error)  # a stream that fails midway says so in an event
                    delta = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                    if delta:
                        last = time.perf_counter() - t0
                        first = last if first is None else first
                    text += delta
        except httpx.RemoteProtocolError:
            # llama-server sometimes closes a kept-alive connection just as the pool reuses it
            # ("Server disconnected without sending a response"); like the openai client
            # (max_retries=2), send again on a fresh connection. Only before any output: a stream
            # cut midway is a failure. Retries are counted per run.
            if text or attempt == RETRIES:
                raise
            continue
        end = time.perf_counter() - t0
        return {"ttft": first if first is not None else end, "last": last if last is not None else end,
                "text": text, "retries": attempt, "done": done, "error": error}
    raise AssertionError("unreachable")


async def run_level(server: ServerProcess, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list]:
    queue = list(prompts)
    results: list[dict] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            results.append(await one_request(client, server, queue.pop(0), max_tokens))

    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        return time.perf_counter() - t0, results


def measure(server: ServerProcess, work: Workload, concurrency: int, max_tokens: int, tokenizer,
            run_index: int) -> dict:
    n = max(work.min_requests, concurrency * work.requests_per_client)
    prompts = run_prompts(work, run_index, n, tokenizer)
    wall, results = asyncio.run(run_level(server, prompts, concurrency, max_tokens))
    counts = [len(tokenizer.encode(r["text"])) for r in results]
    ttft = np.array([r["ttft"] for r in results])
    itl = [(r["last"] - r["ttft"]) / (c - 1) for r, c in zip(results, counts) if c > 1]
    run = {"tok_s": round(sum(counts) / wall, 2), "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
           "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
           "itl_p50_s": round(float(np.median(itl)), 4) if itl else None,
           "requests": len(results), "output_tokens": sum(counts), "wall_s": round(wall, 2),
           "retries": sum(r["retries"] for r in results)}
    print(f"  {work.name:<13} C={concurrency:<3} {server.label:<32} {run['tok_s']:8.1f} tok/s  TTFT p50 "
          f"{run['ttft_p50_s']:.3f}s p99 {run['ttft_p99_s']:.3f}s  ITL p50 {run['itl_p50_s']}", flush=True)
    return run


def warm_up(server: ServerProcess) -> None:
    asyncio.run(run_level(server, [PROMPTS[0]], 1, 4))


def run_prompts(work: Workload, run_index: int, n: int, tokenizer) -> list[str]:
    """The n prompts of one run, none of which an earlier run has seen, so that no server answers a run
    from a cache filled by the one before it.

    A shared workload tags its run ("Session 7. ..."): within the run its requests share what they
    share by design; where a prompt holds "{tag}", the tag goes there, each request's own ("Session 7,
    Lorem: "), and what comes before it is shared by every run. An unshared one starts every request
    with its own word. A repeated one sends the same prompts every run. A tag shared by the
    whole run is a prefix too: llama-server's slots reuse any common prefix token by token, so with
    "Session 7. " in front of 20-token prompts it skipped a fifth of every prefill (C = 1 TTFT 108 vs
    138 ms for ours, whose cache shares whole 16-token blocks; 145 vs 141 ms with distinct first
    words), and at C = 16 the second request of each prompt found the first one's whole prompt in
    its slot."""
    prompts = [work.prompts[i % len(work.prompts)] for i in range(n)]
    if work.tag == "none":
        return prompts
    words = distinct_words(tokenizer)
    if work.tag == "request":
        return [f"{words[next(_REQUESTS) % len(words)]}: {p}" for p in prompts]
    if "{tag}" in prompts[0]:
        return [p.replace("{tag}", f"Session {run_index}, {words[next(_REQUESTS) % len(words)]}: ") for p in prompts]
    return [f"Session {run_index}. {p}" for p in prompts]


_REQUESTS = itertools.count()  # unshared requests so far: each takes the next word


@functools.cache
def distinct_words(tokenizer) -> tuple[str, ...]:
    """Capitalised words that are one token each (no leading space): distinct first tokens."""
    vocab = tokenizer.backend.get_vocab()
    return tuple(w for w, _ in sorted(vocab.items(), key=lambda kv: kv[1])
                 if w.isascii() and w.isalpha() and w[0].isupper() and w[1:].islower() and 4 <= len(w) <= 10)


def kv_stats(server: ServerProcess) -> dict:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        for key in ("edgefinfer_num_requests_running", "edgefinfer_prefix_cache_hit_rate",
                    "edgefinfer_kv_retained_prefixes"):
            if line.startswith(key + " "):
                out[key.removeprefix("edgefinfer_")] = float(line.split()[1])
    return out


# ------------------------------------------------------------------------------------- kv capacity
def kv_bytes_per_cell(gguf: Path, dtype_bytes: int = 2) -> int:
    from edgefinfer.model.gguf_import import config_from_gguf, open_gguf

    cfg = config_from_gguf(open_gguf(gguf))
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes


def kv_capacity(gguf: Path, threads: int, budget_mb: int, tokenizer, max_tokens: int) -> dict:
    """Sequences running at once under one KV budget: ours (the unified pool, admission by the
    manager) measured by flooding it with 64 short requests and polling /metrics; llama-server's
    per-slot layout reserves SLOT_CTX cells per slot, so it holds budget / SLOT_CTX sequences."""
    cells = budget_mb * 2**20 // kv_bytes_per_cell(gguf)
    port = free_port()
    server = ServerProcess("edgefinfer", "kv-unified", [sys.executable, "-m", "edgefinfer.app.serve_command", str(gguf),
                           "--port", str(port), "--threads", str(threads), "--max-num-seqs", "64", "--max-model-len",
                           str(SLOT_CTX), "--kv-layout", "unified", "--kv-cells", str(cells), "--kv-dtype", "f16", "--served-model-name", "model",
                           "--log-level", "warning"], port, env={"OMP_NUM_THREADS": "1"})
    peak = 0
    with server:
        async def flood() -> None:
            nonlocal peak
            task = asyncio.ensure_future(run_level(server, [PROMPTS[i % 16] for i in range(64)], 64, max_tokens))
            async with httpx.AsyncClient() as c:
                while not task.done():
                    text = (await c.get(server.url + "/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("edgefinfer_num_requests_running "):
                            peak = max(peak, int(float(line.split()[1])))
                    await asyncio.sleep(0.05)
            await task
        asyncio.run(flood())
    return {"budget_mb": budget_mb, "cells": int(cells), "kv_dtype": "f16", "max_model_len": SLOT_CTX,
            "edgefinfer_max_seqs": peak, "llama_server_max_seqs": int(cells // SLOT_CTX),
            "request": f"{len(PROMPTS)} one-line prompts, {max_tokens} output tokens, 64 at once"}


# ------------------------------------------------------------------------------------- plot
def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in rows))
    labels = list(dict.fromkeys(f"{r['server']} [{r['config']}]" for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        tok, ttft = [], []
        for g in groups:
            row = next((r for r in rows if (r["workload"], r["concurrency"]) == g
                        and f"{r['server']} [{r['config']}]" == label), None)
            tok.append(row["tok_s"] if row else 0)
            ttft.append(row["ttft_p50_s"] if row else 0)
        xs = [i + j * width for i in range(len(groups))]
        axes[0].bar(xs, tok, width, label=label)
        axes[1].bar(xs, ttft, width, label=label)
    for ax, title in zip(axes, ("output tokens/s (median)", "TTFT p50, s (median; log)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [f"{w}\nC={c}" for w, c in groups])
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------- main
def median_row(key: tuple, runs: list[dict]) -> dict:
    mine = [r for r in runs if (r["server"], r["config"], r["workload"], r["concurrency"]) == key]
    med = {k: round(statistics.median(r[k] for r in mine), 4) for k in ("tok_s", "ttft_p50_s", "ttft_p99_s")}
    itl = [r["itl_p50_s"] for r in mine if r["itl_p50_s"] is not None]
    return {"server": key[0], "config": key[1], "workload": key[2], "concurrency": key[3], **med,
            "itl_p50_s": round(statistics.median(itl), 4) if itl else None,
            "tok_s_min": min(r["tok_s"] for r in mine), "tok_s_max": max(r["tok_s"] for r in mine),
            "runs": len(mine), "requests": mine[0]["requests"], "retries": sum(r["retries"] for r in mine)}


def paired_ratio(runs: list[dict], config: str, workload: str, concurrency: int) -> dict:
    """Our tok/s over llama-server's within each repeat, median and range. The repeats are interleaved,
    so a host whose speed drifts during the benchmark moves both sides of a pair alike: the ratio of
    the medians can then pair a fast run with a slow one."""
    def by_repeat(server: str, cfg: str) -> dict[int, float]:
        return {r["repeat"]: r["tok_s"] for r in runs if (r["server"], r["config"], r["workload"], r["concurrency"])
                == (server, cfg, workload, concurrency)}

    ours, peer = by_repeat("edgefinfer", config), by_repeat("llama-server", "default")
    ratios = [ours[k] / peer[k] for k in ours if k in peer and peer[k] > 0]
    if not ratios:
        return {}
    return {"tok_s_ratio_paired": round(statistics.median(ratios), 2),
            "tok_s_ratio_paired_min_max": [round(min(ratios), 2), round(max(ratios), 2)]}


def main() -> None:
    global BANNED, SLOTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run of each, one request per client")
    ap.add_argument("--model", default=None, help="GGUF file (default: the shipped SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", usable_cores())),
                    help="CPU threads for every server (default: one per physical core this process may run on)")
    ap.add_argument("--gpu-layers", type=int, default=0, help="offload layers (CUDA builds), every server")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved runs per row (default 3; 1 with --quick)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per completion (default 48, 16 quick)")
    ap.add_argument("--workloads", default="short,shared-system,long-short,chat-header,repeated")
    ap.add_argument("--levels", default=None, help="concurrency levels of short and shared-system (default 1,16 and 16)")
    ap.add_argument("--slots", type=int, default=SLOTS, help="llama-server --parallel and our --max-num-seqs")
    ap.add_argument("--no-llama-cpp-python", action="store_true", help="skip llama_cpp.server")
    ap.add_argument("--kv-budget-mb", type=int, default=96, help="KV memory of the capacity measurement (0: skip it)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: bench/peers.py builds one)")
    ap.add_argument("--servers", default=None, help="only these, comma-separated NAME[:CONFIG] "
                    "(e.g. edgefinfer:defaults,llama-server; edgefinfer:batch-invariant adds the exact mode)")
    ap.add_argument("--ours-args", default="", help="extra arguments for our server (e.g. '--retain-tokens 1024')")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="on",
                    help="flash attention for every server (default on: llama-server's default `auto` turns it on "
                         "on this CPU, and it is the faster setting for every server here)")
    ap.add_argument("--out", default="server")
    args = ap.parse_args()
    # A SIGTERM (`timeout`, CI) unwinds like Ctrl-C, so the server processes below are stopped too: each
    # runs in its own session, and a benchmark killed outright left them serving (and loading the host).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from bench.peers import llama_server
    from edgefinfer.model import reference
    from edgefinfer.model.gguf_import import open_gguf, tokenizer_from_gguf

    SLOTS = args.slots
    gguf = Path(args.model) if args.model else reference.gguf_path("smollm2-135m")
    meta = open_gguf(gguf)
    tokenizer = tokenizer_from_gguf(meta)
    BANNED = end_tokens(meta, tokenizer)
    args.repeats = args.repeats or (1 if args.quick else 3)
    max_tokens = args.max_tokens or (16 if args.quick else 48)
    binary = Path(args.llama_server) if args.llama_server else llama_server()
    th = str(args.threads)

    def ours(config: str) -> ServerProcess:
        port = free_port()
        argv = ours_argv(gguf, port, args.threads, args.gpu_layers, flash_attn=args.flash_attn == "on")
        argv += [*OURS_CONFIGS[config], *args.ours_args.split()]
        return ServerProcess("edgefinfer", config, argv, port, env=OURS_ENV)

    def peer(config: str) -> ServerProcess:
        port = free_port()
        argv = llama_server_argv(binary, gguf, port, args.threads, args.flash_attn, args.gpu_layers)
        body = {}
        if config == "cache-reuse":
            argv += ["--cache-reuse", "256"]
        if config == "no-prompt-cache":
            body = {"cache_prompt": False}
        return ServerProcess("llama-server", config, argv, port, body=body)

    def llama_cpp_python() -> ServerProcess:
        port = free_port()
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--host", "127.0.0.1",
                "--n_threads", th, "--n_threads_batch", th, "--n_ctx", str(SLOT_CTX), "--verbose", "False",
                "--model_alias", "model", "--interrupt_requests", "False", "--n_gpu_layers", str(args.gpu_layers),
                "--flash_attn", str(args.flash_attn == "on")]
        return ServerProcess("llama_cpp.server", "default", argv, port)

    wanted = args.workloads.split(",")
    plan = [w for w in workloads(tokenizer, args.quick) if w.name in wanted]
    if args.levels:
        levels = tuple(int(x) for x in args.levels.split(","))
        plan = [dataclasses.replace(w, levels=levels) if w.name in ("short", "shared-system") else w
                for w in plan]
    runs: list[dict] = []
    t0 = time.time()
    uptime_before = uptime()
    print(f"model {gguf.name}, threads {args.threads}, max_tokens {max_tokens}, repeats {args.repeats}, "
          f"llama-server {binary}", flush=True)
    def chosen(key: tuple[str, str]) -> bool:
        if not args.servers:
            return True
        return any(want in (key[0], f"{key[0]}:{key[1]}") for want in args.servers.split(","))

    with contextlib.ExitStack() as stack:
        servers = {key: stack.enter_context(make()) for key, make in {
            ("edgefinfer", "defaults"): lambda: ours("defaults"),
            ("edgefinfer", "unified"): lambda: ours("unified"),
            **({("edgefinfer", "batch-invariant"): lambda: ours("batch-invariant")}
               if args.servers and "edgefinfer:batch-invariant" in args.servers else {}),
            ("llama-server", "default"): lambda: peer("default"),
            ("llama-server", "cache-reuse"): lambda: peer("cache-reuse"),
            ("llama-server", "no-prompt-cache"): lambda: peer("no-prompt-cache"),
            **({} if args.no_llama_cpp_python else {("llama_cpp.server", "default"): llama_cpp_python}),
        }.items() if chosen(key)}
        for s in servers.values():
            warm_up(s)
        for work in plan:
            entries = [k for k in servers if k[0] != "llama_cpp.server" or work.name == "short"]
            if work.name != "shared-system":  # the prompt-cache variants matter where prompts share
                entries = [k for k in entries if k[1] not in ("cache-reuse", "no-prompt-cache")]
            if work.tag == "none" or "{tag}" in work.prompts[0]:
                # What every run shares with the runs before it (the repeated prompts, a system prompt)
                # has been seen once before the first measured run too, as a deployed server's has.
                for key in entries:
                    asyncio.run(run_level(servers[key], run_prompts(work, -1, len(work.prompts), tokenizer), 16, 2))
            for c in work.levels:
                for rep in range(args.repeats):
                    order = entries[rep % len(entries):] + entries[:rep % len(entries)]
                    for key in order:
                        server = servers[key]
                        # Every server sees fresh prompts: none is helped by the one before.
                        run = measure(server, work, c, max_tokens, tokenizer, len(runs))
                        runs.append({"server": key[0], "config": key[1], "workload": work.name, "concurrency": c,
                                     "repeat": rep, **run})
        cache = {k[1]: kv_stats(s) for k, s in servers.items() if k[0] == "edgefinfer"}
    rows = [median_row(k, runs) for k in dict.fromkeys((r["server"], r["config"], r["workload"], r["concurrency"])
                                                       for r in runs)]
    print("measuring sequences admitted at a fixed KV budget", flush=True)
    capacity = kv_capacity(gguf, args.threads, args.kv_budget_mb, tokenizer, max_tokens) if args.kv_budget_mb else {}

    def row(server: str, config: str, workload: str, c: int) -> dict | None:
        return next((r for r in rows if (r["server"], r["config"], r["workload"], r["concurrency"])
                     == (server, config, workload, c)), None)

    summary = {}
    for config in OURS_CONFIGS:
        for work, c in (("short", 1), ("short", 16), ("shared-system", 16), ("long-short", 8), ("chat-header", 16),
                        ("repeated", 16)):
            a, b = row("edgefinfer", config, work, c), row("llama-server", "default", work, c)
            if a and b:
                summary[f"{config} {work} C={c}"] = {"tok_s_ratio": round(a["tok_s"] / b["tok_s"], 2),
                                                     **paired_ratio(runs, config, work, c),
                                                     "ttft_p50_ratio": round(a["ttft_p50_s"] / b["ttft_p50_s"], 2),
                                                     "ttft_p99_ratio": round(a["ttft_p99_s"] / b["ttft_p99_s"], 2)}
    if capacity:
        summary["kv_capacity_ratio"] = round(capacity["edgefinfer_max_seqs"] / max(1, capacity["llama_server_max_seqs"]), 2)
    payload = {"rows": rows, "kv_capacity": capacity, "summary": summary, "edgefinfer_metrics": cache,
               "all_runs": runs, "machine": machine(), "threads": args.threads, "model": gguf.name,
               "max_tokens": max_tokens, "quick": args.quick, "repeats": args.repeats,
               "kv_dtype": "f16 (all but edgefinfer batch-invariant: f32)",
               "flash_attn": f"{args.flash_attn} (all but edgefinfer batch-invariant: off)",
               "uptime_before": uptime_before, "uptime_after": uptime(),
               "llama_server": {"binary": str(binary), "slots": SLOTS, "slot_ctx": SLOT_CTX,
                                "flags": (binary.parent / "flags.txt").read_text().strip()
                                if (binary.parent / "flags.txt").is_file() else None},
               "versions": versions("llama-cpp-python", "fastapi", "uvicorn", "httpx"),
               "elapsed_s": round(time.time() - t0, 1)}
    path = write_results(args.out, payload, quick=args.quick)
    png = RESULTS / f"{result_stem(args.out, args.quick)}.png"
    plot(rows, png)
    print_table(rows, ["workload", "concurrency", "server", "config", "tok_s", "tok_s_min", "tok_s_max",
                       "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "runs"])
    print(f"kv_capacity {capacity}")
    for k, v in summary.items():
        print(f"  {k}: {v}")
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
