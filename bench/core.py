"""Core benchmark: the reference model in our eager torch vs transformers vs llama.cpp, same weights.

    python bench/core.py [--quick] [--threads N]

Decode and prefill tokens/s at batch 1, greedy, the same thread count for every engine, in one run;
plus the reference model's test perplexity. llama.cpp runs an F16 GGUF of the same weights (made from
the shipped Q4_1 GGUF by llama.cpp's own quantize tool, which dequantizes). Writes bench/results/core.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, median_of, median_time, print_table, versions, write_results  # noqa: E402


def f16_gguf(src: Path, dest: Path) -> Path:
    import llama_cpp

    if not dest.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
        params.allow_requantize = True
        tmp = dest.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError("llama_model_quantize to F16 failed")
        os.replace(tmp, dest)
    return dest


def bench_eager(folder: Path, prompt: list[int], n_decode: int, repeats: int) -> dict:
    import torch

    from edgefinfer.model.kv_cache import StaticCache
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.decoding.eager import decode_one_token, prefill

    model = load_model(folder)
    cfg = model.config
    ids = torch.tensor([prompt])

    def run_prefill():
        prefill(model, ids, torch.arange(len(prompt))[None], StaticCache(cfg, 1, len(prompt) + n_decode + 1))

    def run_decode():
        cache = StaticCache(cfg, 1, len(prompt) + n_decode + 1)
        logits = prefill(model, ids, torch.arange(len(prompt))[None], cache)
        t0 = time.perf_counter()
        for i in range(n_decode):
            tok = logits.argmax(-1, keepdim=True)
            logits = decode_one_token(model, tok, torch.tensor([[len(prompt) + i]]), cache)
        return time.perf_counter() - t0

    prefill_s = median_time(run_prefill, repeats)
    run_decode()
    decode_s = median_of(run_decode, repeats)
    return {"engine": "edgefinfer eager (fp32)", "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": n_decode / decode_s}


def bench_transformers(folder: Path, prompt: list[int], n_decode: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        prefill_s = median_time(lambda: model(ids), repeats)

        def gen(n):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

        gen(2)
        # generate() = prefill + (n - 1) decode steps: subtract a 1-token run to isolate decoding.
        one = median_of(lambda: gen(1), repeats)
        full = median_of(lambda: gen(n_decode + 1), repeats)
    return {"engine": "transformers generate (fp32)", "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": n_decode / (full - one)}


def bench_llamacpp(gguf: Path, prompt: list[int], n_decode: int, repeats: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt) + n_decode + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=512, verbose=False)

    def run_prefill():
        llm.reset()
        llm.eval(prompt)

    def run_decode():
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
            llm.eval([tok])
        return time.perf_counter() - t0

    prefill_s = median_time(run_prefill, repeats)
    run_decode()
    decode_s = median_of(run_decode, repeats)
    return {"engine": "llama.cpp (F16 GGUF)", "prefill_tok_s": len(prompt) / prefill_s,
            "decode_tok_s": n_decode / decode_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: fewer tokens and repeats")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from edgefinfer.model import reference
    from edgefinfer.data.corpora import load_text
    from edgefinfer.data.evaluate import perplexity
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    prompt_len, n_decode, repeats = (64, 16, 1) if args.quick else (128, 64, 3)
    ppl_tokens = 1024 if args.quick else 8192
    folder = reference.pull("smollm2-135m")
    tok = Tokenizer.from_dir(folder)
    test_ids = tok.encode(load_text("test"))
    prompt = test_ids[:prompt_len]
    gguf = f16_gguf(reference.gguf_path("smollm2-135m"), folder.parent / f"{folder.name}-f16.gguf")

    rows = []
    for name, fn in [("eager", lambda: bench_eager(folder, prompt, n_decode, repeats)),
                     ("transformers", lambda: bench_transformers(folder, prompt, n_decode, repeats)),
                     ("llamacpp", lambda: bench_llamacpp(gguf, prompt, n_decode, repeats, args.threads))]:
        print(f"[core] {name} ...", file=sys.stderr, flush=True)
        rows.append({"key": name, **fn()})
    print("[core] test perplexity ...", file=sys.stderr, flush=True)
    ppl = perplexity(load_model(folder), test_ids, window=512, stride=256, max_tokens=ppl_tokens, progress=True)

    by = {r["key"]: r for r in rows}
    for r in rows:
        r["decode_vs_eager"] = r["decode_tok_s"] / by["eager"]["decode_tok_s"]
        r["prefill_vs_eager"] = r["prefill_tok_s"] / by["eager"]["prefill_tok_s"]
    print_table(rows, ["engine", "prefill_tok_s", "decode_tok_s", "prefill_vs_eager", "decode_vs_eager"])
    print(f"reference test perplexity: {ppl.ppl:.3f} over {ppl.tokens} tokens (window 512, stride 256)")
    path = write_results("core", quick=args.quick, payload={
        "eager_decode_tok_s": by["eager"]["decode_tok_s"],
        "eager_prefill_tok_s": by["eager"]["prefill_tok_s"],
        "transformers_decode_tok_s": by["transformers"]["decode_tok_s"],
        "transformers_prefill_tok_s": by["transformers"]["prefill_tok_s"],
        "llamacpp_decode_tok_s": by["llamacpp"]["decode_tok_s"],
        "llamacpp_prefill_tok_s": by["llamacpp"]["prefill_tok_s"],
        "ref_test_ppl": ppl.ppl,
        "ppl_tokens": ppl.tokens,
        "rows": rows,
        "settings": {"quick": args.quick, "prompt_tokens": prompt_len, "decode_tokens": n_decode,
                     "repeats": repeats, "batch": 1, "greedy": True},
        "threads": args.threads,
        "machine": machine(),
        "versions": versions("transformers", "llama_cpp_python", "gguf"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
