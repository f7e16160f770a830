"""Build benchmark: every target the host can build, on the reference model, plus the peers.

    python bench/build.py [--quick] [--threads N]

Per target and recipe: bundle size, perplexity delta against the float model (measured by running the
artefact in its own runtime on the same test tokens), host decode and prefill tokens/s, build time.
Each target's default recipe (edgefinfer.bundle.targets) is a row, beside the alternatives it was chosen over,
and `--quality-budget 5` on android is a row of its own (the recipe it picked, measured the same way).
ExecuTorch lowers SmolLM2 in 6-11 minutes on 2 cores, so the .pte rows are the android default, the
budget build (a program-cache hit when it picks the default) and the 8-bit alternative.
Side by side: our ONNX int4 vs onnxruntime-genai's model builder int4 of the same weights
(bench/onnx_vs_genai.py), and our GGUF Q8_0 vs llama.cpp's own quantizer run on our F16 export.
Our .pte vs ExecuTorch's own LLM export is bench/et_vs_export_llm.py (its own results file).
Writes bench/results/build.json.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, versions, write_results  # noqa: E402

DEFAULT = "default"  # the target's default recipe
BUDGET = "budget:5"  # `--quality-budget 5`: the recipe the build chooses
PLAN = [  # (target, recipe)
    ("android", DEFAULT),  # 8da4w-g32-fzp
    ("android", BUDGET),
    ("android", "8da8w"),  # the 8-bit alternative (the default before float zero points)
    ("linux-x86_64", DEFAULT),  # int4-g32-fzp
    ("linux-x86_64", "int8"),  # the 8-bit alternative (the default before)
    ("linux-x86_64", "int4-g32"),  # integer zero points on the same grid size
    ("linux-x86_64", "int4-gptq-g32"),
    ("gpu-server", DEFAULT),
    ("gpu-server", "int4-g32-fzp"),  # Q4_1 from our float zero points (llama.cpp's own Q4_1 is the default)
    ("gpu-server", "int4-g32-sym"),  # Q4_0 from our symmetric codes
    ("gpu-server", "int4-g32"),  # Q4_1 from our asymmetric codes (integer zero points)
    ("gpu-server", "int8-g32-emb8"),  # Q8_0; also the peer comparison below
    ("ios", "fp16"),
    ("qnn", "qdq-a16w8"),
]
QUICK = [("linux-x86_64", "int4-g32"), ("gpu-server", "int4-g32-sym"), ("gpu-server", "int8-g32-emb8")]


def bundle_row(target: str, recipe: str, out: Path, folder: Path, eval_tokens: int, threads: int) -> dict:
    from edgefinfer.app.build import BuildOptions, build
    from edgefinfer.bundle.manifest import load_manifest
    from edgefinfer.bundle.targets import get_target

    budget = float(recipe.split(":")[1]) if recipe.startswith("budget:") else None
    chosen = None if budget is not None else get_target(target).recipe if recipe == DEFAULT else recipe
    t0 = time.perf_counter()
    build(BuildOptions(target=target, model=folder, out=out, recipe=chosen, quality_budget=budget,
                       eval_tokens=eval_tokens, max_seq_len=512, threads=threads))
    wall = time.perf_counter() - t0
    m = load_manifest(out)
    size = sum(a.size for a in m.artefacts if a.role in ("model", "weights"))
    art = m.artefact("model")
    return {"target": target, "recipe": m.recipe["name"], "size_bytes": size, "ppl": m.metrics.get("ppl"),
            "ppl_delta": m.metrics.get("ppl_delta_pct"), "decode_tok_s": m.metrics.get("decode_tok_s"),
            "prefill_tok_s": m.metrics.get("prefill_tok_s"), "build_s": m.metrics.get("build_s"),
            "wall_s": round(wall, 1), "float_ppl": m.metrics.get("float_ppl"),
            "default": m.recipe["name"] == get_target(target).recipe, "quality_budget_pct": budget,
            **({"candidates": m.recipe["candidates"]} if budget is not None else {}),
            **({"gguf_tensor_types": art.meta.get("tensor_types")} if art.format == "gguf" else {})}


def gguf_vs_llamacpp_quantizer(folder: Path, work: Path, eval_tokens: int, threads: int) -> dict:
    """Our Q8_0 (re-packed from our int8 codes) vs llama.cpp's quantizer on our F16 export."""
    import llama_cpp

    from edgefinfer.app.build import _perplexity_of, _test_tokens
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
    from edgefinfer.tokenization.tokenizer import Tokenizer

    work.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_dir(folder)
    f16, theirs = work / "f16.gguf", work / "llamacpp-q8_0.gguf"
    export_gguf(load_model(folder), tok, f16, "f16")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    t0 = time.perf_counter()
    llama_cpp.llama_model_quantize(str(f16).encode(), str(theirs).encode(), ctypes.byref(params))
    ids = _test_tokens(tok, eval_tokens)
    out = {}
    for name, path in [("ours_q8_0", work.parent / "gpu-server-int8-g32-emb8" / "model.gguf"),
                       ("llamacpp_q8_0", theirs)]:
        if not path.is_file():
            continue
        backend = LlamaCppBackend(path, n_ctx=512, threads=threads)

        def logits_fn(t):
            backend.reset()
            return backend.forward(t[0].tolist(), 0)[None]

        out[name] = {"size_bytes": path.stat().st_size, "ppl": _perplexity_of(logits_fn, ids, 256)}
    out["llamacpp_quantize_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from edgefinfer.model import reference
    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.bundle.targets import get_target

    folder = reference.pull("smollm2-135m")
    work = cache_dir() / "bench" / "build"
    work.mkdir(parents=True, exist_ok=True)
    eval_tokens = 512 if args.quick else 2048
    rows = []
    for target, recipe in (QUICK if args.quick else PLAN):
        if get_target(target).missing():
            print(f"[bench/build] {target}: skipped ({'; '.join(get_target(target).missing())})", file=sys.stderr)
            continue
        print(f"[bench/build] {target} {recipe} ...", file=sys.stderr, flush=True)
        try:
            name = recipe.replace(":", "") if recipe != DEFAULT else get_target(target).recipe
            rows.append(bundle_row(target, recipe, work / f"{target}-{name}", folder, eval_tokens, args.threads))
        except Exception as e:  # report the others
            print(f"[bench/build]   failed: {e}", file=sys.stderr)
            rows.append({"target": target, "recipe": recipe, "error": str(e).splitlines()[0]})
    print_table(rows, ["target", "recipe", "default", "quality_budget_pct", "size_bytes", "ppl", "ppl_delta",
                       "decode_tok_s", "prefill_tok_s", "build_s"])

    from onnx_vs_genai import run as onnx_vs_genai

    print("[bench/build] ONNX int4: ours vs onnxruntime-genai builder ...", file=sys.stderr, flush=True)
    ort = onnx_vs_genai(folder, rounds=3 if args.quick else 6, threads=args.threads)
    print(f"ONNX int4 decode: ours {ort['onnx_int4_ms_per_token']:.2f} ms/token, onnxruntime-genai "
          f"{ort['ortgenai_int4_ms_per_token']:.2f} ms/token (ratio {ort['ratio_wall']:.3f})")
    gguf = gguf_vs_llamacpp_quantizer(folder, work / "gguf-peer", eval_tokens, args.threads)
    print(f"GGUF Q8_0: {gguf}")
    path = write_results("build", quick=args.quick, payload={
        "rows": rows,
        "onnx_int4_ms_per_token": ort["onnx_int4_ms_per_token"],
        "ortgenai_int4_ms_per_token": ort["ortgenai_int4_ms_per_token"],
        "onnx_vs_genai": {k: v for k, v in ort.items() if k not in ("machine", "versions")},
        "gguf_vs_llamacpp_quantizer": gguf,
        "settings": {"quick": args.quick, "eval_tokens": eval_tokens, "eval_window": 256, "max_seq_len": 512,
                     "eval_split": "test (Persuasion)", "ppl_delta": "percent vs eager fp32 on the same tokens"},
        "threads": args.threads, "machine": machine(),
        "versions": versions("executorch", "torchao", "onnxruntime", "onnxruntime-genai", "llama_cpp_python", "gguf"),
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
