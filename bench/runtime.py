"""Runtime benchmark: our Engine on each backend vs the peers, reference model, batch 1, one run.

    python bench/runtime.py [--quick] [--threads N] [--only llamacpp,onnxruntime,...] [--out NAME]

Engines (each measured in its own process, so resident memory is its own):
  ours:  the runtime's token loop (`edgefinfer.runtime.decode.generate_tokens`) over the torch (fp32),
         ExecuTorch (.pte 8da4w + 4-bit embeddings, XNNPACK), ONNX Runtime (int4 MatMulNBits) and
         llama.cpp (GGUF Q8_0 and Q4_0) backends, artefacts made by `edgefinfer build`;
  peers: llama-cpp-python's high-level API on the same GGUFs, onnxruntime-genai's generator on its own
         model-builder int4 of the same weights, and transformers' generate (fp32).
Per engine: prefill and decode tokens/s, time to first token, peak resident memory, and for ours the
share of decode time spent in Python outside the backend call. The roofline is the measured read
bandwidth (a read-only sum over 512 MiB with the benchmark's thread count: decode streams the weights
in, it writes almost nothing) over the weight bytes per token. Writes bench/results/runtime.json and a plot.

Threading, as each engine's own users set it: every engine gets `--threads` explicitly. Engines on
torch (ours on torch, transformers) also run with OMP_NUM_THREADS=threads and OMP_WAIT_POLICY=PASSIVE,
since busy-waiting OpenMP threads slow eager torch several times on a shared box. llama.cpp never
does: PASSIVE puts its OpenMP workers to sleep between ops (at 2 threads llama-cpp-python decoded
the Q8_0 GGUF at 86 tok/s without it and 29 with it), so the llama.cpp engines run with OpenMP's
defaults. ExecuTorch and ONNX Runtime use their own thread pools and take `threads` directly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, print_table, versions, result_stem, write_results  # noqa: E402

HERE = Path(__file__).resolve()


def peak_rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---- one engine, in a child process ----------------------------------------------------------------------

def child_ours(backend_kind: str, path: str, prompt: list[int], n: int, threads: int) -> dict:
    from edgefinfer.runtime.decode import generate_tokens
    from edgefinfer.runtime.engine import open_backend

    backend, _, _ = open_backend(Path(path), backend_kind, threads=threads or None,  # 0: the runtime's default
                                 max_seq_len=len(prompt) + n + 8)
    inner = {"s": 0.0}
    forward = backend.forward

    def timed_forward(tokens, start):
        t0 = time.perf_counter()
        out = forward(tokens, start)
        inner["s"] += time.perf_counter() - t0
        return out

    backend.forward = timed_forward
    list(generate_tokens(backend, prompt, 4))  # warm-up
    from edgefinfer.decoding.generation import GenerationStats

    stats = GenerationStats()
    inner["s"] = 0.0
    t0 = time.perf_counter()
    tokens = generate_tokens(backend, prompt, n, stats=stats)
    first = next(tokens)
    ttft = time.perf_counter() - t0
    inner_prefill = inner["s"]
    inner["s"] = 0.0
    t1 = time.perf_counter()
    rest = list(tokens)
    decode_s = time.perf_counter() - t1
    return {"prefill_tok_s": len(prompt) / ttft, "decode_tok_s": len(rest) / decode_s, "ttft_s": ttft,
            "python_overhead": 1 - inner["s"] / decode_s, "tokens": [first, *rest],
            "prefill_backend_s": inner_prefill}


def child_llamacpp_peer(path: str, prompt: list[int], n: int, threads: int) -> dict:
    import llama_cpp

    # 0: llama-cpp-python's own defaults (half the CPUs for one-token steps, all of them for prompts).
    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + n + 8, n_threads=threads or None,
                          n_threads_batch=threads or None, verbose=False)
    llm.create_completion(prompt, max_tokens=4, temperature=0.0)  # warm-up
    llm.reset()
    t0 = time.perf_counter()
    gen = llm.generate(prompt, temp=0.0, reset=True)
    first = next(gen)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    rest = [next(gen) for _ in range(n - 1)]
    decode_s = time.perf_counter() - t1
    return {"prefill_tok_s": len(prompt) / ttft, "decode_tok_s": len(rest) / decode_s, "ttft_s": ttft,
            "tokens": [first, *rest]}


def child_genai(folder: str, prompt: list[int], n: int, threads: int) -> dict:
    import onnxruntime_genai as og

    config = og.Config(folder)
    # The builder's genai_config.json names no thread count, and genai then ran on one thread (a
    # "2 threads" row compared our two against its one): the same explicit count as every other engine.
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run(count: int) -> tuple[float, float, list[int]]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + count, min_length=len(prompt) + count, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        gen.generate_next_token()
        ttft = time.perf_counter() - t0
        out = [int(gen.get_next_tokens()[0])]
        t1 = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return ttft, time.perf_counter() - t1, out

    run(4)
    ttft, decode_s, out = run(n)
    return {"prefill_tok_s": len(prompt) / ttft, "decode_tok_s": (len(out) - 1) / decode_s, "ttft_s": ttft,
            "tokens": out}


def child_transformers(folder: str, prompt: list[int], n: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        t0 = time.perf_counter()
        model(ids)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / ttft, "decode_tok_s": (n - 1) / max(total - ttft, 1e-9),
            "ttft_s": ttft, "tokens": out[0, len(prompt):].tolist()}


def run_child(args: argparse.Namespace) -> None:
    prompt = json.loads(Path(args.prompt_file).read_text())
    if args.child == "ours":
        out = child_ours(args.kind, args.path, prompt, args.n, args.threads)
    elif args.child == "llamacpp":
        out = child_llamacpp_peer(args.path, prompt, args.n, args.threads)
    elif args.child == "genai":
        out = child_genai(args.path, prompt, args.n, args.threads)
    else:
        out = child_transformers(args.path, prompt, args.n, args.threads)
    out["rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(out))


def engine_env(kind: str, threads: int) -> dict[str, str]:
    """The child's environment: OpenMP settings for torch only (see the module doc)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if kind != "llamacpp":
        env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    return env


def measure(child: str, kind: str, path: Path, prompt_file: Path, n: int, threads: int) -> dict:
    env = engine_env(kind, threads)
    cmd = [sys.executable, str(HERE), "--child", child, "--kind", kind, "--path", str(path),
           "--prompt-file", str(prompt_file), "--n", str(n), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{child}/{kind} failed:\n{proc.stderr[-3000:]}")


# ---- the run ------------------------------------------------------------------------------------------------

def read_bandwidth_gb_s(threads: int) -> float:
    """Sustained read bandwidth: bytes summed per second over a 512 MiB array split across `threads`
    threads (numpy releases the GIL inside the sum), best of 5. A copy would count its writes too."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(512 * 2**20 // 8)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def build_artefacts(work: Path, folder: Path, quick: bool, only: set[str] | None = None) -> dict[str, Path]:
    from edgefinfer.app.build import BuildOptions, build

    arts = {}
    for name, target, recipe, kind in [("gguf-q8_0", "gpu-server", "int8-g32-emb8", "llamacpp"),
                                       ("gguf-q4_0", "gpu-server", "int4-g32-sym-emb8", "llamacpp"),
                                       ("onnx-int4", "linux-x86_64", "int4-g32", "onnxruntime"),
                                       ("pte-8da4w", "android", "8da4w-g32-emb4", "executorch")]:
        if only is not None and kind not in only:
            continue
        out = work / name
        if not (out / "manifest.json").is_file():
            print(f"[runtime] building {name} ...", file=sys.stderr, flush=True)
            build(BuildOptions(target=target, model=folder, out=out, recipe=recipe, eval_tokens=0,
                               max_seq_len=512))
        arts[name] = out
    genai = work / "genai-int4"
    if only is not None and "onnxruntime" not in only:
        return arts
    if not (genai / "genai_config.json").is_file():
        from onnx_vs_genai import build_genai

        print("[runtime] building onnxruntime-genai int4 ...", file=sys.stderr, flush=True)
        build_genai(folder, genai, 32, work / "genai-cache")
    arts["genai-int4"] = genai
    return arts


def plot(rows: list[dict], roofline: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [f"{r['engine']}\n{r['backend']} {r['quant']}" for r in rows]
    colors = ["tab:blue" if r["engine"] == "edgefinfer" else "tab:gray" for r in rows]
    ax.barh(names, [r["decode_tok_s"] for r in rows], color=colors)
    ax.axvline(roofline, color="tab:red", linestyle="--", label=f"int4 roofline {roofline:.0f} tok/s")
    ax.set_xlabel("decode tokens/s (batch 1, greedy)")
    ax.set_title("SmolLM2-135M decode speed: edgefinfer (blue) vs peers (grey)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="", help=argparse.SUPPRESS)
    ap.add_argument("--path", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--only", default=None, help="backends to run, comma-separated (torch, executorch, "
                    "onnxruntime, llamacpp); the artefacts of the others are not built")
    ap.add_argument("--out", default="runtime", help="results name (bench/results/NAME.json)")
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return

    from edgefinfer.model import reference
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.data.corpora import load_text
    from edgefinfer.tokenization.tokenizer import Tokenizer

    folder = reference.pull("smollm2-135m")
    work = cache_dir() / "bench" / "runtime"
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    arts = build_artefacts(work, folder, args.quick, only)
    built = dict(arts)
    arts = {k: built.get(k, work / "not-built") for k in ("gguf-q8_0", "gguf-q4_0", "onnx-int4", "pte-8da4w", "genai-int4")}
    prompt_len, n = (64, 16) if args.quick else (128, 64)
    prompt = Tokenizer.from_dir(folder).encode(load_text("test"))[:prompt_len]
    prompt_file = work / "prompt.json"
    prompt_file.write_text(json.dumps(prompt))

    plan = [
        ("edgefinfer", "ours", "torch", folder, "fp32"),
        ("edgefinfer", "ours", "executorch", arts["pte-8da4w"] / "model.pte", "8da4w"),
        ("edgefinfer", "ours", "onnxruntime", arts["onnx-int4"], "int4"),
        ("edgefinfer", "ours", "llamacpp", arts["gguf-q8_0"] / "model.gguf", "q8_0"),
        ("edgefinfer", "ours", "llamacpp", arts["gguf-q4_0"] / "model.gguf", "q4_0"),
        ("llama-cpp-python", "llamacpp", "llamacpp", arts["gguf-q8_0"] / "model.gguf", "q8_0"),
        ("llama-cpp-python", "llamacpp", "llamacpp", arts["gguf-q4_0"] / "model.gguf", "q4_0"),
        ("onnxruntime-genai", "genai", "onnxruntime", arts["genai-int4"], "int4"),
        ("transformers", "transformers", "torch", folder, "fp32"),
    ]
    plan = [p for p in plan if only is None or p[2] in only]
    rows = []
    for engine, child, kind, path, quant in plan:
        print(f"[runtime] {engine} {kind} {quant} ...", file=sys.stderr, flush=True)
        try:
            r = measure(child, kind, path, prompt_file, n, args.threads)
        except Exception as e:  # one broken engine must not hide the others' figures
            print(f"[runtime]   failed: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        tokens = r.pop("tokens")
        rows.append({"engine": engine, "backend": kind, "quant": quant, **r, "first_tokens": tokens[:8]})

    bandwidth = read_bandwidth_gb_s(args.threads)
    weights = {q: sum(f.stat().st_size for f in arts[a].iterdir() if f.suffix in (".gguf", ".pte", ".onnx", ".data"))
               for q, a in [("q4_0", "gguf-q4_0"), ("q8_0", "gguf-q8_0"), ("int4", "onnx-int4"), ("8da4w", "pte-8da4w")]
               if a in built}
    weights["fp32"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    for r in rows:
        r["roofline_tok_s"] = bandwidth * 1e9 / weights[r["quant"]]
        r["of_roofline"] = r["decode_tok_s"] / r["roofline_tok_s"]
    roofline = bandwidth * 1e9 / weights.get("q4_0", weights.get("int4", min(weights.values())))
    print_table(rows, ["engine", "backend", "quant", "decode_tok_s", "prefill_tok_s", "ttft_s", "rss_mb",
                       "python_overhead", "of_roofline"])
    print(f"read bandwidth {bandwidth:.1f} GB/s at {args.threads} thread(s); int4 roofline {roofline:.0f} tok/s")
    plot(rows, roofline, RESULTS / f"{result_stem(args.out, args.quick)}.png")
    path = write_results(args.out, quick=args.quick, payload={
        "rows": rows, "roofline_tok_s": roofline, "read_bandwidth_gb_s": bandwidth, "weight_bytes": weights,
        "threading": {kind: {k: v for k, v in engine_env(kind, args.threads).items() if k.startswith("OMP_")}
                      for kind in ("torch", "executorch", "onnxruntime", "llamacpp")},
        "settings": {"quick": args.quick, "prompt_tokens": prompt_len, "decode_tokens": n, "batch": 1,
                     "greedy": True, "each_engine_in_its_own_process": True},
        "threads": args.threads, "machine": machine(),
        "versions": versions("executorch", "onnxruntime", "onnxruntime-genai", "llama_cpp_python", "transformers"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
