"""Our fused ONNX int4 export vs onnxruntime-genai's model builder int4, same source weights.

    python bench/onnx_vs_genai.py [--model HF_DIR] [--rounds 5] [--decode 64] [--threads 1]

Builds both int4 folders from one Hugging Face checkpoint (default: the shipped reference model),
then decodes greedily at batch 1 with the same thread count: ours through `OrtBackend` (a Python
loop over an IO-bound session), the builder's through `og.Generator` (its C++ loop). Rounds are
interleaved so that load on a shared machine hits both alike. Per token it records wall time and the
calling thread's CPU time: with one intra-op thread ONNX Runtime computes on the calling thread, so
CPU time measures the work itself even when other processes compete for the cores.

Also reported: folder sizes, build times, and on the same text (teacher-forced) each int4 model's
top-1 agreement and mean |logit diff| against our float eager model. Writes
bench/results/onnx_vs_genai.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
        "polished the great lens, and watched the ships pass safely beyond the rocks. One stormy night, a "
        "small fishing boat appeared out of the rain, its sail torn and its lantern dark.")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".onnx", ".data"))


def build_ours(hf_dir: Path, out: Path, block_size: int) -> float:
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.onnx_export import export_onnx

    t0 = time.perf_counter()
    export_onnx(load_model(hf_dir), out, weights="int4", block_size=block_size)
    return time.perf_counter() - t0


def build_genai(hf_dir: Path, out: Path, block_size: int, cache: Path, python: Path | None = None) -> float:
    """onnxruntime-genai's builder (its `--help` crashes in 0.18.0; the command itself works), run by
    `python` (default: this interpreter; bench/peers.py's side environment for Gemma 3)."""
    t0 = time.perf_counter()
    cmd = [str(python or sys.executable), "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", "int4", "-e", "cpu", "-c", str(cache), "--extra_options", f"int4_block_size={block_size}"]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        raise RuntimeError(f"the genai model builder failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return time.perf_counter() - t0


def genai_int4(hf_dir: Path, work: Path, python: Path | None = None, name: str = "genai-int4") -> Path:
    """onnxruntime-genai's own int4 model (block 32) of `hf_dir` in work/`name`, built once by the
    builder `python` runs (default: this interpreter's)."""
    out = work / name
    if not (out / "genai_config.json").is_file():
        print(f"[bench] building onnxruntime-genai's int4 model of {hf_dir.name} ...", file=sys.stderr, flush=True)
        build_genai(hf_dir, out, 32, work / "genai-cache", python)
    return out


def decode_ours(folder: Path, prompt: list[int], n: int, threads: int) -> tuple[list[float], list[float], list[int]]:
    from edgefinfer.runtime.backends.ort import OrtBackend

    backend = OrtBackend(folder, threads=threads, max_seq_len=len(prompt) + n + 1)
    logits = backend.forward(prompt, 0)
    tok, wall, cpu, tokens = int(logits[-1].argmax()), [], [], []
    for pos in range(len(prompt), len(prompt) + n):
        w0, c0 = time.perf_counter(), time.thread_time()
        tok = int(backend.forward([tok], pos)[-1].argmax())  # the argmax is part of a decode step
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        tokens.append(tok)
    return wall, cpu, tokens


def decode_genai(folder: Path, prompt: list[int], n: int, threads: int) -> tuple[list[float], list[float], list[int]]:
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + n + 1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)  # prefill
    wall, cpu, tokens = [], [], []
    for _ in range(n + 1):
        w0, c0 = time.perf_counter(), time.thread_time()
        gen.generate_next_token()
        tok = int(gen.get_next_tokens()[0])
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        tokens.append(tok)
    # The first call samples from the prefill's logits (no model run): drop it, keep n decode steps.
    return wall[1:], cpu[1:], tokens[1:]


def quality(hf_dir: Path, folders: dict[str, Path], tokens: list[int]) -> dict[str, dict[str, float]]:
    """Teacher-forced top-1 agreement and mean |logit diff| of each folder against the float eager model."""
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.runtime.backends.ort import OrtBackend
    from edgefinfer.runtime.backends.torch_eager import TorchBackend

    ref = TorchBackend(load_model(hf_dir), max_seq_len=len(tokens) + 1).forward(tokens, 0)
    out = {}
    for name, folder in folders.items():
        got = OrtBackend(folder, threads=1, max_seq_len=len(tokens) + 1).forward(tokens, 0)
        out[name] = {"top1_vs_float": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                     "mean_abs_logit_diff": float(np.abs(got - ref).mean())}
    return out


def run(hf_dir: str | Path | None = None, work_dir: str | Path | None = None, *, block_size: int = 32,
        n_prompt: int = 16, n_decode: int = 64, rounds: int = 5, threads: int = 1,
        rebuild: bool = False) -> dict[str, Any]:
    """Build both int4 models (cached in `work_dir`) and measure decode ms/token; returns the figures."""
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.tokenization.tokenizer import Tokenizer

    if hf_dir is None:
        from edgefinfer.model.reference import pull

        hf_dir = pull("smollm2-135m")
    hf_dir = Path(hf_dir)
    work = Path(work_dir) if work_dir else cache_dir() / "bench" / "onnx_vs_genai" / hf_dir.name
    ours_dir, genai_dir = work / f"ours_int4_g{block_size}", work / f"genai_int4_g{block_size}"
    build_s: dict[str, float | None] = {"ours": None, "genai": None}
    if rebuild:
        shutil.rmtree(work, ignore_errors=True)
    if not (ours_dir / "model.onnx").is_file():
        build_s["ours"] = build_ours(hf_dir, ours_dir, block_size)
    if not (genai_dir / "model.onnx").is_file():
        build_s["genai"] = build_genai(hf_dir, genai_dir, block_size, work / "hf_cache")

    text_ids = Tokenizer.from_dir(hf_dir).encode(TEXT)
    prompt = (text_ids * (1 + n_prompt // max(len(text_ids), 1)))[:n_prompt]
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in ("ours", "genai")}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):  # interleaved
        for name, fn, folder in (("ours", decode_ours, ours_dir), ("genai", decode_genai, genai_dir)):
            wall, cpu, toks = fn(folder, prompt, n_decode, threads)
            times[name]["wall"] += wall
            times[name]["cpu"] += cpu
            tokens[name] = toks

    ms = {name: {kind: 1e3 * statistics.median(v) for kind, v in t.items()} for name, t in times.items()}
    same = sum(a == b for a, b in zip(tokens["ours"], tokens["genai"]))
    return {
        "model": str(hf_dir),
        "block_size": block_size,
        "threads": threads,
        "n_prompt": n_prompt,
        "n_decode": n_decode,
        "rounds": rounds,
        "onnx_int4_ms_per_token": round(ms["ours"]["wall"], 3),
        "ortgenai_int4_ms_per_token": round(ms["genai"]["wall"], 3),
        "onnx_int4_cpu_ms_per_token": round(ms["ours"]["cpu"], 3),
        "ortgenai_int4_cpu_ms_per_token": round(ms["genai"]["cpu"], 3),
        "ratio_wall": round(ms["ours"]["wall"] / ms["genai"]["wall"], 3),
        "ratio_cpu": round(ms["ours"]["cpu"] / ms["genai"]["cpu"], 3),
        "size_bytes": {"ours": folder_bytes(ours_dir), "genai": folder_bytes(genai_dir)},
        "build_s": build_s,
        "greedy_tokens_equal": f"{same}/{n_decode}",
        "quality": quality(hf_dir, {"ours": ours_dir, "genai": genai_dir}, text_ids),
        "machine": machine(),
        "versions": versions("onnxruntime", "onnxruntime-genai", "onnx", "onnx-ir"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="Hugging Face folder (default: the shipped reference model)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    res = run(args.model, block_size=args.block_size, n_decode=args.decode, rounds=args.rounds,
              threads=args.threads, rebuild=args.rebuild)
    rows = [{"engine": name, "ms/token (wall)": res[f"{key}_ms_per_token"],
             "ms/token (cpu)": res[f"{key}_cpu_ms_per_token"], "MiB": res["size_bytes"][name] / 2**20,
             "top1 vs float": res["quality"][name]["top1_vs_float"]}
            for name, key in (("ours", "onnx_int4"), ("genai", "ortgenai_int4"))]
    print_table(rows, list(rows[0]))
    print(f"ours / genai: {res['ratio_wall']}x wall, {res['ratio_cpu']}x cpu; "
          f"greedy tokens equal {res['greedy_tokens_equal']}")
    print(f"wrote {write_results('onnx_vs_genai', res)}")


if __name__ == "__main__":
    main()
