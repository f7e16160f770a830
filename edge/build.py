"""`edgefinfer build --target T`: model -> (quantize) -> compile -> evaluate -> bundle, in one step.

Each step prints its progress and duration; the build ends with a table (artefact, size, perplexity
vs float, host decode tokens/s). The bundle is written to a temporary folder and renamed into place
when complete (`edgefinfer.bundle.BundleWriter`), so Ctrl-C or a kill never leaves a half bundle.

Perplexity is measured on the same test tokens for the float model (eager torch) and for the
artefact run by its own runtime (ExecuTorch, ONNX Runtime, llama.cpp), so the delta is the cost of
the whole path, not only of quantization. With `--quality-budget PCT` the build first scores each
candidate recipe of the target's format on the eager quantized model and keeps the smallest one
whose perplexity increase stays within PCT percent.
"""

from __future__ import annotations

import copy
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


from edgefinfer.bundle import BundleWriter
from edgefinfer.errors import UserError
from edgefinfer.targets import Target, get_target

# Candidate recipes per artefact format, smallest first (for --quality-budget).
CANDIDATES: dict[str, list[str]] = {
    "pte": ["8da4w-g128-emb4", "8da4w-g32-emb4", "8da8w", "fp32"],
    "onnx": ["int4-g32", "int8", "fp32"],
    "gguf": ["int4-g32-sym-emb8", "int8-g32-emb8", "fp16"],
}
FLOAT_RECIPES = ("fp32", "fp16")


@dataclass
class BuildOptions:
    target: str
    model: str | Path | None = None  # HF folder; None = the shipped reference model
    out: str | Path | None = None  # bundle folder; default dist/<target>
    recipe: str | None = None  # default: the target's
    quality_budget: float | None = None  # max perplexity increase in percent
    max_seq_len: int = 1024  # static-cache positions in the artefact
    kv: str | None = None  # "static" (default) | "window:N[,sinks:S]": a streaming cache (pte, onnx)
    eval_tokens: int = 1024  # test tokens scored for perplexity (0: skip evaluation)
    eval_window: int = 256
    threads: int | None = None
    soc: str = "sm8650"  # qnn target: the Snapdragon to compile for
    draft: str | Path | None = None  # a draft model folder to ship for speculative decoding


@dataclass
class StepLog:
    rows: list[dict[str, Any]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def step(self, i: int, n: int, what: str) -> Callable[[], None]:
        start = time.perf_counter()
        print(f"[build {i}/{n}] {what} ...", file=sys.stderr, flush=True)

        def done(extra: str = "") -> None:
            print(f"[build {i}/{n}] {what} done in {time.perf_counter() - start:.1f}s{extra}", file=sys.stderr,
                  flush=True)

        return done


def default_out(target: str) -> Path:
    return Path("dist") / target


def build(opts: BuildOptions) -> Path:
    target = get_target(opts.target)
    target.check()  # a missing SDK fails here, before any work
    artefact_window(target, opts.kv)  # so does a cache layout the target cannot have
    if opts.draft is not None and not Path(opts.draft).is_dir():
        raise UserError(f"draft model folder {opts.draft} does not exist")
    from edgefinfer.tokenizer import Tokenizer

    out = Path(opts.out) if opts.out else default_out(target.name)
    _remove_stale_temporaries(out)
    folder = _model_folder(opts.model)
    log = StepLog()
    n_steps = 5
    done = log.step(1, n_steps, f"load {folder}")
    model, prequantized = _load(folder)
    tokenizer = Tokenizer.from_dir(folder)
    test_ids = _test_tokens(tokenizer, opts.eval_tokens)
    done()

    done = log.step(2, n_steps, "float perplexity (eager torch)")
    float_ppl = _perplexity_of(lambda ids: model(ids), test_ids, opts.eval_window) if test_ids else None
    done(f": {float_ppl:.3f}" if float_ppl else "")

    recipe = opts.recipe or target.recipe
    if prequantized is not None:  # `edgefinfer quantize` already chose: export those codes as they are
        if opts.recipe or opts.quality_budget is not None:
            raise UserError(f"{folder} is already quantized ({prequantized}); drop --recipe/--quality-budget "
                            f"or build from the float checkpoint")
        recipe = prequantized
        done = log.step(3, n_steps, f"use the checkpoint's quantization ({recipe})")
        quantized = model
    elif opts.quality_budget is not None:
        done = log.step(3, n_steps, f"choose the smallest recipe within +{opts.quality_budget}% perplexity")
        recipe = choose_recipe(model, target, float_ppl, test_ids, opts)
    else:
        done = log.step(3, n_steps, f"quantize ({recipe})")
    if prequantized is None:
        quantized = quantize_for(model, target, recipe, tokenizer)
    done(f": {recipe}")

    model_meta = {"name": folder.name, "config": model.config.to_hf(), "source": str(folder)}
    with BundleWriter(out, target=target.name, model=model_meta) as writer:
        done = log.step(4, n_steps, f"compile {target.format} for {target.name}")
        t_build = time.perf_counter()
        art_files, meta = compile_artefact(target, quantized, tokenizer, recipe, writer.tmp, opts)
        build_s = time.perf_counter() - t_build
        done()
        tokenizer.save(writer.tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            writer.add(name, format="tokenizer", role="tokenizer")

        done = log.step(5, n_steps, "evaluate the artefact with its runtime")
        figures = evaluate_artefact(target, writer.tmp / art_files[0], test_ids, float_ppl, opts) \
            if target.runs_here and test_ids else {}
        done()
        main = art_files[0]
        writer.add(main, format=target.format, role="model", backend=target.backend, recipe=recipe,
                   **_manifest_meta(meta), metrics={**figures, "build_s": round(build_s, 1)})
        for extra in art_files[1:]:
            writer.add(extra, format=f"{target.format}-data", role="weights", backend=target.backend)
        if opts.draft is not None:
            _add_draft(writer, target, Path(opts.draft), tokenizer, opts)
        writer.manifest.recipe = {"name": recipe, "target_default": target.recipe,
                                  "quality_budget_pct": opts.quality_budget}
        writer.manifest.metrics = {"float_ppl": float_ppl, "eval_tokens": len(test_ids),
                                   "eval_split": "test", **figures, "build_s": round(build_s, 1)}
        bundle = writer.commit()
    size = sum(a.size for a in writer.manifest.artefacts if a.role in ("model", "weights"))
    print_summary(target, recipe, main, size, float_ppl, figures, build_s)
    return bundle


# ---- steps ----------------------------------------------------------------------------------------------

def _load(folder: Path):
    """(model, recipe name) for a quantized checkpoint, (model, None) for a float one."""
    from edgefinfer.checkpoint import load_config, load_model

    if "quantization_config" not in load_config(folder).extra:
        return load_model(folder), None
    from edgefinfer.compile.quant.checkpoint import load_quantized

    model, recipe = load_quantized(folder)
    return model, recipe.name


def _model_folder(model: str | Path | None) -> Path:
    from edgefinfer import reference

    if model is None:
        return reference.pull("smollm2-135m")
    path = Path(model)
    if path.exists():
        return path
    if str(model) in reference.MODELS:
        return reference.pull(str(model))
    raise UserError(f"model {model} does not exist (give a HF folder or one of {', '.join(reference.MODELS)})")


def _remove_stale_temporaries(out: Path) -> None:
    """A build killed with SIGKILL leaves its temporary folder beside the destination; clear it."""
    if out.parent.is_dir():
        for stale in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


def _test_tokens(tokenizer, n: int) -> list[int]:
    if n <= 0:
        return []
    from edgefinfer.data import load_text

    return tokenizer.encode(load_text("test")[: n * 8])[:n]


def _perplexity_of(logits_fn, ids: list[int], window: int) -> float:
    """Disjoint windows: every window starts from an empty cache, as a phone's prompt would."""
    import torch

    from edgefinfer.evaluate import perplexity

    return perplexity(lambda t: torch.as_tensor(logits_fn(t)), ids, window=window, stride=window).ppl


def quantize_for(model, target: Target, recipe: str, tokenizer):
    """The model as the exporter should see it: quantized by our recipes, or float."""
    if recipe in FLOAT_RECIPES or recipe.startswith("qdq-") or recipe in ("8da8w",):
        return model  # exporters handle float, Core ML fp16, QNN QDQ and torchao's 8da8w themselves
    from edgefinfer.compile.quant.apply import quantize_model
    from edgefinfer.compile.quant.recipe import parse_recipe

    parsed = parse_recipe(recipe)
    calib = None
    if parsed.method in ("gptq", "awq"):
        from edgefinfer.data import load_text, token_blocks

        calib = token_blocks(tokenizer.encode(load_text("calib")), 256, 16, seed=0)
    quantized = copy.deepcopy(model)
    quantize_model(quantized, parsed, calib, progress=lambda m: print(f"  {m}", file=sys.stderr))
    return quantized


def compile_artefact(target: Target, model, tokenizer, recipe: str, folder: Path,
                     opts: BuildOptions) -> tuple[list[str], dict]:
    """Write the target's artefact(s) into `folder`; returns (files, metadata), the main file first."""
    eos = model.config.eos_token_ids
    window, sinks = artefact_window(target, opts.kv) or (None, 0)
    if target.format == "gguf":
        from edgefinfer.compile.gguf_export import export_gguf

        dtype = "f16" if recipe in FLOAT_RECIPES else "q8_0"
        return ["model.gguf"], export_gguf(model, tokenizer, folder / "model.gguf", dtype)
    if target.format == "pte":
        from edgefinfer.compile.executorch_export import export_pte

        et_recipe = recipe if recipe in ("fp32", "fp16", "8da8w") else "8da4w"
        cache = (dict(kv="window", window=window, num_sinks=sinks) if window else
                 dict(kv="static", max_seq_len=opts.max_seq_len))
        meta = export_pte(model, folder / "model.pte", recipe=et_recipe, backend=target.delegate or "xnnpack",
                          bos_id=tokenizer.bos_id, eos_ids=list(eos), **cache)
        return ["model.pte"], meta
    if target.format == "onnx":
        from edgefinfer.compile.onnx_export import export_onnx

        cache = dict(kv="window", window=window) if window else dict(kv="static", max_seq_len=opts.max_seq_len)
        meta = export_onnx(model, folder, **cache)
        files = [meta["model_file"]] + [f for f in meta["files"] if f != meta["model_file"]]
        return files, meta
    if target.format == "qnn-context":
        from edgefinfer.compile.qnn import build_qnn
        from edgefinfer.data import load_text

        # Activation ranges from 4 prompt-processor calls (64 tokens each) over calibration text.
        calib = [tokenizer.encode(load_text("calib")[:8000])[:256]]
        scheme = recipe.removeprefix("qdq-") if recipe.startswith("qdq-") else "a16w8"
        meta = build_qnn(model, folder, soc=opts.soc, context=opts.max_seq_len, scheme=scheme, calibration=calib,
                         progress=lambda m: print(f"  {m}", file=sys.stderr))
        files = [meta.get("context_model", "model_ctx.onnx")] + [f for f in meta["files"]
                                                                 if f != meta.get("context_model", "model_ctx.onnx")]
        return files, meta
    raise UserError(f"target {target.name}: format {target.format} has no exporter")


def artefact_window(target: Target, kv: str | None) -> tuple[int, int] | None:
    """(window, sinks) that `--kv` asks the artefact to stream with; None for a static cache."""
    if kv is None:
        return None
    from edgefinfer.runtime.engine import KVSpec

    spec = KVSpec.parse(kv)
    if spec.kind == "static":
        return None
    if spec.kind != "window":
        raise UserError("--kv paged is chosen when running (edgefinfer run / serve), not built into an "
                        "artefact; build with --kv static or --kv window:N")
    if target.format not in ("pte", "onnx"):
        raise UserError(f"target {target.name} ({target.format}) keeps a full KV cache; --kv window:N applies to "
                        "the ExecuTorch and ONNX targets (e.g. android, linux-x86_64)")
    if target.format == "onnx" and spec.sinks:
        raise UserError("ONNX Runtime's windowed cache keeps no attention sinks: use --kv window:N, or an "
                        "ExecuTorch target (android) for sinks")
    return spec.window, spec.sinks


def evaluate_artefact(target: Target, path: Path, test_ids: list[int], float_ppl: float | None,
                      opts: BuildOptions) -> dict[str, Any]:
    """Perplexity and host speed of the artefact, run by its own runtime."""
    if target.format == "qnn-context":
        # The HTP emulator takes seconds per token on a real model: measure the same QDQ graphs on the
        # CPU EP instead (tests check that the emulator's greedy tokens match them).
        from edgefinfer.compile.qnn import PROMPT_QDQ_FILE, QDQ_FILE
        from edgefinfer.runtime.backends.ort import open_qnn

        prompt = PROMPT_QDQ_FILE if (path.parent / PROMPT_QDQ_FILE).is_file() else None
        backend = open_qnn(path.parent, {"qdq_model": QDQ_FILE, "prompt_qdq_model": prompt}, ep="cpu",
                           threads=opts.threads)
    else:
        from edgefinfer.runtime.engine import open_backend

        backend, _, _ = open_backend(path.parent if target.format == "onnx" else path, target.backend,
                                     threads=opts.threads, max_seq_len=opts.max_seq_len)

    def logits_fn(tokens):
        backend.reset()
        return backend.forward(tokens[0].tolist(), 0)[None]

    ppl = _perplexity_of(logits_fn, test_ids, min(opts.eval_window, backend.max_seq_len))
    # Speed through the runtime's own token loop: 64 prompt tokens, then 33 greedy tokens (no stop ids).
    from edgefinfer.generation import GenerationStats
    from edgefinfer.runtime.decode import generate_tokens

    stats = GenerationStats()
    for _ in generate_tokens(backend, test_ids[:64], 33, stats=stats):
        pass
    return {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / float_ppl - 1) if float_ppl else None,
            "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s,
            **({"measured_on": "onnxruntime CPU EP, QDQ graphs"} if target.format == "qnn-context" else {})}


def choose_recipe(model, target: Target, float_ppl: float | None, test_ids: list[int], opts: BuildOptions) -> str:
    """The smallest candidate recipe whose eager perplexity stays within the budget."""
    if float_ppl is None:
        raise UserError("--quality-budget needs an evaluation (drop --eval-tokens 0)")
    from edgefinfer.compile.quant.modules import model_size_bytes

    tried = []
    for recipe in CANDIDATES.get(target.format, [target.recipe]):
        quantized = quantize_for(model, target, recipe, None)
        ppl = _perplexity_of(lambda ids: quantized(ids), test_ids, opts.eval_window)
        delta = 100 * (ppl / float_ppl - 1)
        tried.append((recipe, ppl, delta, model_size_bytes(quantized)))
        print(f"  candidate {recipe:<22} ppl {ppl:8.3f} ({delta:+.2f}%)", file=sys.stderr)
        if delta <= opts.quality_budget:
            return recipe
    raise UserError(f"no recipe for {target.name} stays within +{opts.quality_budget}% perplexity "
                    f"(best: {min(tried, key=lambda t: t[2])[0]} at {min(t[2] for t in tried):+.2f}%); "
                    f"raise --quality-budget")


def _add_draft(writer: BundleWriter, target: Target, draft: Path, tokenizer, opts: BuildOptions) -> None:
    from edgefinfer.checkpoint import load_model
    from edgefinfer.tokenizer import Tokenizer

    if Tokenizer.from_dir(draft).backend.to_str() != tokenizer.backend.to_str():
        raise UserError(f"draft model {draft} has a different tokenizer than the target; it cannot draft for it")
    files, meta = compile_artefact(target, quantize_for(load_model(draft), target, target.recipe, tokenizer),
                                   tokenizer, target.recipe, writer.tmp / "draft", opts)
    writer.add(f"draft/{files[0]}", format=target.format, role="draft", backend=target.backend,
               recipe=target.recipe, **_manifest_meta(meta))


def _manifest_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """An exporter's metadata minus what the manifest records in its own fields."""
    return {k: v for k, v in meta.items() if k not in ("files", "path", "format", "backend", "recipe", "role")}


def print_summary(target: Target, recipe: str, artefact: str, size: int, float_ppl: float | None,
                  figures: dict[str, Any], build_s: float) -> None:
    def fmt(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    print()
    print(f"{'target':<13} {'recipe':<20} {'artefact':<16} {'size MiB':>9} {'ppl':>8} {'vs float':>9} "
          f"{'decode tok/s':>12} {'build s':>8}")
    print(f"{target.name:<13} {recipe:<20} {artefact:<16} {size / 2**20:>9.1f} {fmt(figures.get('ppl'), '8.3f'):>8} "
          f"{fmt(figures.get('ppl_delta_pct'), '+8.2f'):>8}% {fmt(figures.get('decode_tok_s'), '12.1f'):>12} "
          f"{build_s:>8.1f}")
    if float_ppl is not None:
        print(f"(float perplexity {float_ppl:.3f} on the same test tokens)")
