"""`edgefinfer build --target T`: model -> (quantize) -> compile -> evaluate -> bundle, in one step.

Each step prints its progress and duration; the build ends with a table (artefact, size, perplexity
vs float, host decode tokens/s). The bundle is written to a temporary folder and renamed into place
when complete (`edgefinfer.bundle.manifest.BundleWriter`), so Ctrl-C or a kill never leaves a half bundle.

Perplexity is measured on the same test tokens for the float model (eager torch) and for the
artefact run by its own runtime (ExecuTorch, ONNX Runtime, llama.cpp), so the delta is the cost of
the whole path, not only of quantization. With `--quality-budget PCT` the build tries the candidate
recipes of the target's format smallest first: a candidate that cannot apply to the model (a group
size that does not divide its widths, a format the artefact cannot hold) is skipped with the reason;
each other one is quantized exactly as the exporter will quantize it and scored on the eager model;
the first within budget is compiled and measured again by its own runtime, and it ships only if
that measurement is within budget too (else the next candidate is tried). When none is, the build
fails with one line naming the best it reached, and nothing is written.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


from edgefinfer.app.bundle_readme import bundle_readme
from edgefinfer.app.model_arg import DEFAULT_MODEL, resolve_model
from edgefinfer.bundle.artefact import KVSpec, Layout
from edgefinfer.bundle.manifest import BundleWriter
from edgefinfer.errors import UserError
from edgefinfer.bundle.recipe import LLAMACPP_PREFIX, Recipe, RecipeKind, for_model, source_precision
from edgefinfer.bundle.targets import Target, get_target

# Candidate recipes per artefact format for --quality-budget, smallest first; at one size the cheap
# round-to-nearest one before the data-aware one (GPTQ: about a minute on the reference model).
CANDIDATES: dict[str, list[str]] = {
    "pte": ["8da4w-g128-emb4", "8da4w-g32-emb4", "8da4w-gptq-g32-emb4", "8da4w-g32", "8da4w-gptq-g32",
            "8da4w-g32-fzp", "8da4w-gptq-g32-fzp", "8da4w-g32-fzp-outliers16", "8da8w", "fp32"],
    "onnx": ["int4-g64", "int4-g32", "int4-gptq-g32", "int4-g32-fzp", "int4-gptq-g32-fzp", "int8", "fp32"],
    "gguf": ["int4-g32-sym", "int4-g32", "llamacpp-q4_1", "int4-gptq-g32", "int4-gptq-g32-fzp", "int8-g32-emb8",
             "fp16"],
}
# The peer runner that reads a format's tokenizer.json (llama.cpp reads the GGUF's own vocabulary).
RUNNER_DIALECT = {"pte": "executorch", "onnx": "onnxruntime-genai"}


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
    requantize_source: bool = False  # also bring the source GGUF's higher-bit matrices down to the recipe
    fit_source_size: bool = False  # a GGUF: those matrices in types no larger than their source's (`source_precision`)


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
    """Build `opts.target`'s bundle from `opts.model` in five logged steps (the module doc); returns the
    bundle's folder, written whole or not at all."""
    # A static cache holds max_seq_len positions: score the float model, the candidates and the artefact
    # on the same windows (a shorter window alone raises perplexity by several percent).
    opts = dataclasses.replace(opts, eval_window=min(opts.eval_window, opts.max_seq_len))
    target, kv, given = _check_up_front(opts)
    out = Path(opts.out) if opts.out else default_out(target.name)
    _remove_stale_temporaries(out)
    folder = resolve_model(str(opts.model) if opts.model is not None else DEFAULT_MODEL)
    log = StepLog()
    source = _load_source(folder, target, opts, log)
    recipe, quantized, candidates, tried, kept = _choose_recipe(source, target, given, opts, log)

    model_meta = {"name": folder.name, "config": source.model.config.to_hf(), "source": str(folder)}
    with BundleWriter(out, target=target.name, model=model_meta) as writer:
        source.tokenizer.save(writer.tmp)  # beside the artefact: its runtime loads it to evaluate
        compiled = _compile_within_budget(writer.tmp, target, source, recipe, quantized, candidates, tried, kv,
                                          opts, log)
        _fill_bundle(writer, target, source, compiled, kv, opts)
        writer.manifest.recipe = {"name": compiled.recipe.name, "target_default": target.recipe,
                                  "quality_budget_pct": opts.quality_budget}
        if tried:
            writer.manifest.recipe["candidates"] = [c.to_dict() for c in tried]
        if kept:
            writer.manifest.recipe["source_precision"] = {name: fmt.to_dict() for name, fmt in sorted(kept.items())}
        writer.manifest.metrics = {"float_ppl": source.float_ppl, "eval_tokens": len(source.test_ids),
                                   "eval_split": "test", **compiled.figures, "build_s": round(compiled.build_s, 1)}
        bundle = writer.commit()
    size = sum(a.size for a in writer.manifest.artefacts if a.role in ("model", "weights"))
    print_summary(target, compiled.recipe.name, compiled.files[0], size, source.float_ppl, compiled.figures,
                  compiled.build_s)
    return bundle


N_STEPS = 5  # load, float perplexity, quantize, compile, evaluate


@dataclass
class _Source:
    """The model a build starts from, loaded once (step 1) and scored in float (step 2)."""

    folder: Path
    model: Any
    prequantized: Recipe | None  # the checkpoint's own quantization (`edgefinfer quantize`); None: float
    tokenizer: Any  # what the bundle ships: the peer runner's dialect of `source_tokenizer` where it has one
    source_tokenizer: Any
    test_ids: list[int]
    prefix: list[int]  # what scoring puts first: [BOS] for models trained to see one (Gemma)
    float_ppl: float | None


@dataclass(frozen=True)
class _Compiled:
    """The artefact that ships: its recipe, files (the main one first), the exporter's metadata, the
    figures its own runtime measured, and the seconds its compilation took."""

    recipe: Recipe
    files: list[str]
    meta: dict[str, Any]
    figures: dict[str, Any]
    build_s: float


def _check_up_front(opts: BuildOptions) -> tuple[Target, KVSpec, Recipe | None]:
    """(target, KV cache, the recipe asked for): every option a user can get wrong, checked before any
    work, each with a one-line UserError."""
    target = get_target(opts.target)
    target.check()  # a missing SDK fails here, before any work
    _check_budget(target, opts)
    kv = artefact_cache(target, opts.kv)  # so does a cache layout the target cannot have
    given = Recipe.parse(opts.recipe) if opts.recipe else None  # and a recipe no exporter knows
    if opts.draft is not None and not Path(opts.draft).is_dir():
        raise UserError(f"draft model folder {opts.draft} does not exist")
    if opts.fit_source_size and (opts.requantize_source or target.format != "gguf"):
        raise UserError("--fit-source-size chooses the GGUF types of a source's higher-bit matrices: it needs a GGUF "
                        f"target (gpu-server; {target.name} writes {target.format}) and no --requantize-source")
    return target, kv, given


def _load_source(folder: Path, target: Target, opts: BuildOptions, log: StepLog) -> _Source:
    """Steps 1 and 2: the model, its tokenizer and test tokens; its float perplexity."""
    from edgefinfer.tokenization.tokenizer import Tokenizer

    done = log.step(1, N_STEPS, f"load {folder}")
    model, prequantized = _load(folder)
    tokenizer = Tokenizer.from_dir(folder)
    test_ids = _test_tokens(tokenizer, opts.eval_tokens)
    source_tokenizer = tokenizer
    if target.format in RUNNER_DIALECT:  # the peer's runner must encode the shipped tokenizer exactly
        tokenizer = _runner_tokenizer(tokenizer, RUNNER_DIALECT[target.format], test_ids)
    done()

    done = log.step(2, N_STEPS, "float perplexity (eager torch)")
    prefix = tokenizer.scoring_prefix  # [BOS] for models trained to see one first (Gemma)
    float_ppl, reused = _float_perplexity(model, test_ids, opts.eval_window, prefix)
    done((f": {float_ppl:.3f}" if float_ppl else "") + (" (reused the artefact cache)" if reused else ""))
    return _Source(folder, model, prequantized, tokenizer, source_tokenizer, test_ids, prefix, float_ppl)


def _choose_recipe(source: _Source, target: Target, given: Recipe | None, opts: BuildOptions, log: StepLog
                   ) -> tuple[Recipe, Any, Iterator[tuple[Recipe, Any]], list[Candidate], dict[str, Any]]:
    """Step 3: (the first recipe to compile, its quantized model, the candidates after it, the candidates
    tried, the matrices kept at the bits of the GGUF the weights came from). One candidate, unless a
    quality budget asks for the smallest recipe within it; a UserError when none is."""
    recipe = given or Recipe.parse(default_recipe(target, source.folder))
    # No matrix is re-quantized below the bits its source GGUF gave it, with the default recipe or an
    # explicit one (--requantize-source takes the recipe literally; a quality budget measures its
    # candidates anyway).
    keep = not opts.requantize_source and opts.quality_budget is None
    model = source.model
    kept = for_model(source_precision(source.folder, recipe, target.format, opts.fit_source_size) if keep else {},
                     model)
    if source.prequantized is not None:  # `edgefinfer quantize` already chose: export those codes as they are
        if opts.recipe or opts.quality_budget is not None:
            raise UserError(f"{source.folder} is already quantized ({source.prequantized.name}); drop "
                            "--recipe/--quality-budget or build from the float checkpoint")
        recipe = source.prequantized
        done = log.step(3, N_STEPS, f"use the checkpoint's quantization ({recipe.name})")
        if target.format == "gguf":
            _check_checkpoint_for_gguf(model, recipe, target)
        elif name := next((n for n, m in model.named_modules() if getattr(getattr(m, "fmt", None), "super_block", None)),
                          None):
            raise UserError(f"{source.folder}: {name} holds K-quant super-blocks, GGUF's (target gpu-server); "
                            f"for {target.name} re-quantize it without -k")
        quantized = model
    tried: list[Candidate] = []
    if opts.quality_budget is not None:
        done = log.step(3, N_STEPS, f"choose the smallest recipe within +{opts.quality_budget}% perplexity")
        candidates = eager_candidates(model, target, source.tokenizer, source.float_ppl, source.test_ids, opts, tried)
    else:
        if source.prequantized is None:
            done = log.step(3, N_STEPS, f"quantize ({recipe.name})")
            check_recipe(model, target, recipe, kept)
            if kept:
                bits = ", ".join(f"{sum(f.bits == b for f in kept.values())} at {b} bits"
                                 for b in sorted({f.bits for f in kept.values()}, reverse=True))
                print(f"  {len(kept)} matrices keep the GGUF the weights came from's precision ({bits}) "
                      "(--requantize-source to quantize them with the recipe)", file=sys.stderr)
            quantized = quantize_for(model, target, recipe, source.tokenizer, kept)
        candidates = iter([(recipe, quantized)])
    first, quantized = next(candidates, (None, None))
    if first is None:
        raise budget_error(target, opts.quality_budget, tried)
    done(f": {first.name}")
    return first, quantized, candidates, tried, kept


def _compile_within_budget(folder: Path, target: Target, source: _Source, recipe: Recipe, quantized: Any,
                           candidates: Iterator[tuple[Recipe, Any]], tried: list[Candidate], kv: KVSpec,
                           opts: BuildOptions, log: StepLog) -> _Compiled:
    """Steps 4 and 5: compile `quantized` into `folder` and measure it with its own runtime. With a
    quality budget, a candidate over it on its runtime is deleted and the next one compiled, until one
    is confirmed (a UserError when none is): the eager score alone does not ship a recipe."""
    while True:
        done = log.step(4, N_STEPS, f"compile {target.format} for {target.name} ({recipe.name})")
        t_build = time.perf_counter()
        files, meta = compile_artefact(target, quantized, source.tokenizer, recipe, kv, folder, opts)
        build_s = time.perf_counter() - t_build
        done(" (reused the artefact cache)" if meta.get("cached") else "")
        done = log.step(5, N_STEPS, "evaluate the artefact with its runtime")
        figures = evaluate_artefact(target, folder / files[0], source.test_ids, source.float_ppl, opts,
                                    source.prefix) if target.runs_here and source.test_ids else {}
        done()
        if opts.quality_budget is None or _confirmed(figures, opts.quality_budget, tried, target):
            return _Compiled(recipe, files, meta, figures, build_s)
        for f in files:  # over budget on its runtime: try the next candidate
            (folder / f).unlink(missing_ok=True)
        recipe, quantized = next(candidates, (None, None))
        if recipe is None:
            raise budget_error(target, opts.quality_budget, tried)


def _fill_bundle(writer: BundleWriter, target: Target, source: _Source, compiled: _Compiled, kv: KVSpec,
                 opts: BuildOptions) -> None:
    """Add to the bundle being written what sits beside the artefact: the tokenizer, the README, the
    artefact's manifest entries (the main file with its recipe and figures) and the draft model."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        writer.add(name, format="tokenizer", role="tokenizer")
    if (writer.tmp / "genai_config.json").is_file():  # onnxruntime-genai's own tokenizer, on the bundle
        _check_genai_tokenizer(writer.tmp, source.source_tokenizer, source.tokenizer, source.test_ids)
    main, *extras = compiled.files
    (writer.tmp / "README.txt").write_text(bundle_readme(target, main, source.tokenizer))
    writer.add("README.txt", format="text", role="readme")
    writer.add(main, format=target.format, role="model", backend=target.backend, recipe=compiled.recipe.name,
               **_manifest_meta(compiled.meta), metrics={**compiled.figures, "build_s": round(compiled.build_s, 1)})
    for extra in extras:
        writer.add(extra, format=f"{target.format}-data", role="weights", backend=target.backend)
    if opts.draft is not None:
        _add_draft(writer, target, Path(opts.draft), source.tokenizer, kv, opts)


# ---- steps ----------------------------------------------------------------------------------------------

def _load(folder: Path) -> tuple[Any, Recipe | None]:
    """(model, its recipe) for a quantized checkpoint, (model, None) for a float one."""
    from edgefinfer.model.checkpoint import load_config, load_model

    if "quantization_config" not in load_config(folder).extra:
        return load_model(folder), None
    from edgefinfer.compile.quant.checkpoint import load_quantized

    model, recipe = load_quantized(folder)
    return model, Recipe.of(recipe)


def _runner_tokenizer(tokenizer, dialect: str, test_ids: list[int]):
    """The tokenizer rewritten into the forms the target's peer runner implements, checked on probe
    strings and the test text to give `tokenizers`' ids; a UserError naming what it cannot represent."""
    import json

    from edgefinfer.compile.runner_tokenizer import runner_tokenizer, runner_tokenizer_class

    sample = _sample_texts(tokenizer, test_ids)
    source = json.loads(tokenizer.backend.to_str())
    return tokenizer.with_backend_json(runner_tokenizer(source, dialect, sample), runner_tokenizer_class(source, dialect))


def _sample_texts(tokenizer, test_ids: list[int]) -> list[str]:
    """Paragraphs of the test text (as far as the evaluation loaded it) for the tokenizer checks."""
    return tokenizer.decode(test_ids[:1024], skip_special_tokens=False).split("\n\n")


def _check_genai_tokenizer(folder: Path, source, shipped, test_ids: list[int]) -> None:
    import json

    from edgefinfer.compile.runner_tokenizer import check_runner, genai_encoder

    sample = _sample_texts(source, test_ids)
    check_runner(json.loads(source.backend.to_str()), json.loads(shipped.backend.to_str()),
                 {"onnxruntime-genai": genai_encoder(folder)}, sample)


def _remove_stale_temporaries(out: Path) -> None:
    """A build killed with SIGKILL leaves its temporary folder beside the destination; clear it."""
    if out.parent.is_dir():
        for stale in out.parent.glob(f".{out.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)


def _test_tokens(tokenizer, n: int) -> list[int]:
    if n <= 0:
        return []
    from edgefinfer.data.corpora import load_text

    return tokenizer.encode(load_text("test")[: n * 8])[:n]


def _perplexity_of(logits_fn, ids: list[int], window: int, prefix: list[int] = ()) -> float:
    """Disjoint windows: every window starts from an empty cache, as a phone's prompt would."""
    import torch

    from edgefinfer.data.evaluate import perplexity

    return perplexity(lambda t: torch.as_tensor(logits_fn(t)), ids, window=window, stride=window, prefix=prefix).ppl


# A source GGUF's type -> our recipe that re-emits its grids (`source_precision` keeps the rest of its types).
OWN_GRID_RECIPES = {"q4_k_m": "int4-g32-fzp-k"}


def default_recipe(target: Target, folder: Path) -> str:
    """The target's recipe, except that a llama.cpp build of weights converted from a GGUF keeps that
    GGUF's type: the weights already lie on its grid, so re-quantizing onto it loses almost nothing,
    while another 4-bit grid adds a second rounding (bench/results/gemma3.json, `grids`: Gemma 3 270M,
    from Q4_K_M, and SmolLM2-135M, from Q4_1, each built both ways). A Q4_K_M source takes our -k
    recipe, which finds its blocks again (`grids_16k`: the same size as llama.cpp's re-quantization, and
    no worse); other types llama.cpp's own quantizer."""
    from edgefinfer.compile.gguf_export import LLAMA_FTYPES
    from edgefinfer.model.gguf_import import source_gguf_type

    grid = source_gguf_type(folder) if target.format == "gguf" else None
    if grid in OWN_GRID_RECIPES:
        return OWN_GRID_RECIPES[grid]
    return f"llamacpp-{grid}" if grid in LLAMA_FTYPES else target.recipe


def _float_perplexity(model, test_ids: list[int], window: int, prefix: list[int]) -> tuple[float | None, bool]:
    """(eager float perplexity, reused): from the artefact cache when this model was scored on the same
    tokens by the same code before (a rebuild), else measured and stored."""
    if not test_ids:
        return None, False
    from edgefinfer.compile.artefact_cache import cached_figures
    from edgefinfer.data import evaluate
    from edgefinfer.model import config, kv_cache, transformer

    options = {"test_ids": test_ids, "window": window, "prefix": list(prefix)}
    sources = (evaluate.__file__, transformer.__file__, kv_cache.__file__, config.__file__)  # what the score runs
    figures, reused = cached_figures("float-ppl", model, options, sources,
                                     lambda: {"ppl": _perplexity_of(lambda ids: model(ids), test_ids, window, prefix)})
    return figures["ppl"], reused


def quantize_for(model, target: Target, recipe: Recipe, tokenizer, overrides: dict[str, Any] | None = None):
    """The model as the exporter should see it: quantized by our recipes (with per-module `overrides`
    of their formats), or float. What comes back is what the artefact computes (the exporters re-pack
    quantized layers without re-quantizing), so its eager perplexity is the artefact's up to the
    runtime's float arithmetic."""
    if not recipe.quantized_by_us:
        return model  # exporters handle float, Core ML fp16, QNN QDQ and llama.cpp's quantizer themselves
    from edgefinfer.compile.quant.apply import quantize_model

    parsed = recipe.quant
    if overrides:
        parsed = parsed.with_overrides(overrides)
    calib = None
    if parsed.needs_calibration:
        from edgefinfer.app.quantize_command import default_calibration

        # 16 blocks of 256 tokens across kinds of text (a minute of GPTQ on the reference model; the
        # smoothing of int8 activations reads their maxima): the same default as `edgefinfer quantize`,
        # so both commands make the same model of a recipe.
        calib = default_calibration(tokenizer)
    return _cached_quantization(model, parsed, calib, lambda m: quantize_model(
        m, parsed, calib, progress=lambda line: print(f"  {line}", file=sys.stderr)))


def _cached_quantization(model, recipe, calib, quantize: Callable) -> Any:
    """`quantize(copy of model)`, or the same recipe's result on the same weights and calibration from
    the artefact cache (a quantized checkpoint: bit-exact codes, so the exporters' keys hit too)."""
    import tempfile

    from edgefinfer.compile import quant
    from edgefinfer.compile.artefact_cache import ArtefactCache, content_key
    from edgefinfer.compile.quant.checkpoint import load_quantized, save_quantized

    store, files = ArtefactCache(), ("config.json", "model.safetensors")
    key = content_key("quantized", model, {"recipe": recipe.to_dict(), "calibration": calib},
                      sorted(Path(quant.__file__).parent.glob("*.py")))
    if (entry := store.get("quantized", key)) is not None:
        print(f"  [cache] reused the quantized model {key[:12]}", file=sys.stderr)
        return load_quantized(entry.files[files[0]].parent)[0]
    quantized = copy.deepcopy(model)
    quantize(quantized)
    try:
        with tempfile.TemporaryDirectory(prefix="edgefinfer-quantized-") as tmp:
            save_quantized(quantized, recipe, Path(tmp) / "q")
            store.put("quantized", key, {name: Path(tmp) / "q" / name for name in files}, {"recipe": recipe.name})
    except Exception as e:  # noqa: BLE001 (safetensors reports a full disk as its own error type)
        # A cache that cannot be written is no cache, never a failed build.
        print(f"  [cache] warning: the quantized model was not cached ({str(e).splitlines()[0][:120]})",
              file=sys.stderr)
    return quantized


def compile_artefact(target: Target, model, tokenizer, recipe: Recipe, cache: KVSpec, folder: Path,
                     opts: BuildOptions) -> tuple[list[str], dict]:
    """Write the target's artefact(s) into `folder` with KV cache `cache` (`artefact_cache`); returns
    (files, metadata), the main file first."""
    eos = model.config.eos_token_ids
    if target.format == "gguf":
        from edgefinfer.compile.gguf_export import export_gguf

        # Quantized layers keep their codes (Q4_0 / Q4_1 / Q8_0, or refused); float matrices are F16,
        # or, for llamacpp-* recipes, whatever llama.cpp's quantizer makes of them.
        dtype = recipe.variant if recipe.kind is RecipeKind.LLAMACPP else "f16"
        return ["model.gguf"], export_gguf(model, tokenizer, folder / "model.gguf", dtype)
    if target.format == "pte":
        from edgefinfer.compile.executorch_export import export_pte

        from edgefinfer.compile.et_quant import is_quantized, scheme_of

        # A quantized model goes as it is (8da4w if any linear is 4-bit, else 8da8w); float and QDQ recipes
        # name ExecuTorch's scheme themselves (fp32 / fp16, NeuroPilot's qdq-*).
        et_recipe = (scheme_of(model) if is_quantized(model) else recipe.variant if recipe.kind is RecipeKind.FLOAT
                     else recipe.name)
        options = (dict(kv=cache.layout, window=cache.window, num_sinks=cache.sinks) if cache.streams else
                   dict(kv=cache.layout, max_seq_len=opts.max_seq_len))
        if target.delegate == "neuropilot":  # its static quantizer observes calibration text
            from edgefinfer.data.corpora import load_text

            options["calibration"] = [tokenizer.encode(load_text("calib")[:8000])[:256]]
        meta = export_pte(model, folder / "model.pte", recipe=et_recipe, backend=target.delegate or "xnnpack",
                          bos_id=tokenizer.bos_id, eos_ids=list(eos), **options)
        return ["model.pte"], meta
    if target.format == "onnx":
        from edgefinfer.compile.onnx_export import export_onnx

        meta = export_onnx(model, folder, **(dict(kv=cache.layout, window=cache.window) if cache.streams else
                                             dict(kv=cache.layout, max_seq_len=opts.max_seq_len)))
        files = [meta["model_file"]] + [f for f in meta["files"] if f != meta["model_file"]]
        return files, meta
    if target.format == "qnn-context":
        from edgefinfer.compile.qnn import QnnScheme, build_qnn
        from edgefinfer.data.corpora import load_text
        from edgefinfer.runtime.backends.ort import attention_sink, recorded_feeds

        # Activation ranges from 4 prompt-processor calls (64 tokens each) over calibration text.
        calib = [tokenizer.encode(load_text("calib")[:8000])[:256]]
        scheme = QnnScheme.parse(recipe.variant) if recipe.kind is RecipeKind.QDQ else QnnScheme.A16W8
        meta = build_qnn(model, folder, soc=opts.soc, context=opts.max_seq_len, scheme=scheme, calibration=calib,
                         progress=lambda m: print(f"  {m}", file=sys.stderr), record_feeds=recorded_feeds,
                         sink_token=sink_token(tokenizer), sink_of=attention_sink)
        files = [meta.get("context_model", "model_ctx.onnx")] + [f for f in meta["files"]
                                                                 if f != meta.get("context_model", "model_ctx.onnx")]
        return files, meta
    raise UserError(f"target {target.name}: format {target.format} has no exporter")


def sink_token(tokenizer) -> int:
    """The QNN graphs' attention-sink token: a newline, as documents in the pre-training text start
    after one (SmolLM2, 1024 test tokens: float perplexity 40.95 without a prefix, 40.51 after "\\n",
    41.40 after <|im_start|>); the tokenizer's BOS, else token 0, where a newline is not one token."""
    ids = tokenizer.encode("\n")
    return ids[0] if len(ids) == 1 else (tokenizer.bos_id if tokenizer.bos_id is not None else 0)


def artefact_cache(target: Target, kv: str | None) -> KVSpec:
    """The KV cache `--kv` asks the artefact to be exported with (parsed once, here)."""
    from edgefinfer.runtime.engine import KVOption

    spec = KVOption.parse(kv)
    if spec.layout is Layout.STATIC:
        return KVSpec(Layout.STATIC)
    if spec.layout is None:
        raise UserError("--kv paged is chosen when running (edgefinfer run / serve), not built into an "
                        "artefact; build with --kv static or --kv window:N")
    if target.format not in ("pte", "onnx"):
        raise UserError(f"target {target.name} ({target.format}) keeps a full KV cache; --kv window:N applies to "
                        "the ExecuTorch and ONNX targets (e.g. android, linux-x86_64)")
    if target.format == "onnx" and spec.sinks:
        raise UserError("ONNX Runtime's windowed cache keeps no attention sinks: use --kv window:N, or an "
                        "ExecuTorch target (android) for sinks")
    return KVSpec(Layout.WINDOW, window=spec.window, sinks=spec.sinks)


def evaluate_artefact(target: Target, path: Path, test_ids: list[int], float_ppl: float | None,
                      opts: BuildOptions, prefix: list[int] = ()) -> dict[str, Any]:
    """Perplexity and host speed of the artefact, run by its own runtime."""
    if target.format == "qnn-context":
        # The HTP emulator takes seconds per token on a real model: measure the same QDQ graphs on the
        # CPU EP instead (tests check that the emulator's greedy tokens match them).
        from edgefinfer.compile.qnn import PROMPT_QDQ_FILE, QDQ_FILE, SINK_FILE
        from edgefinfer.runtime.backends.ort import open_qnn

        prompt = PROMPT_QDQ_FILE if (path.parent / PROMPT_QDQ_FILE).is_file() else None
        sink = SINK_FILE if (path.parent / SINK_FILE).is_file() else None
        backend = open_qnn(path.parent, {"qdq_model": QDQ_FILE, "prompt_qdq_model": prompt, "sink_kv": sink},
                           ep="cpu", threads=opts.threads)
    else:
        from edgefinfer.runtime.engine import open_backend

        backend, _, _ = open_backend(path.parent if target.format == "onnx" else path, target.backend,
                                     threads=opts.threads, max_seq_len=opts.max_seq_len)

    def logits_fn(tokens):
        backend.reset()
        return backend.forward(tokens[0].tolist(), 0)[None]

    ppl = _perplexity_of(logits_fn, test_ids, min(opts.eval_window, backend.max_seq_len), prefix)
    # Speed through the runtime's own token loop: 64 prompt tokens, then 33 greedy tokens (no stop ids).
    from edgefinfer.decoding.generation import GenerationStats
    from edgefinfer.runtime.decode import generate_tokens

    stats = GenerationStats()
    for _ in generate_tokens(backend, test_ids[:64], 33, stats=stats):
        pass
    return {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / float_ppl - 1) if float_ppl else None,
            "prefill_tok_s": stats.prefill_tok_s, "decode_tok_s": stats.decode_tok_s,
            **({"measured_on": "onnxruntime CPU EP, QDQ graphs"} if target.format == "qnn-context" else {})}


def _check_checkpoint_for_gguf(model, recipe: Recipe, target: Target) -> None:
    """A one-line UserError, before the export, if a quantized checkpoint holds a layer with no GGUF type.
    A per-channel int8 override is what `edgefinfer quantize` keeps of a source GGUF's higher-bit matrices
    when not told the target: for those, the error says how to make them fit."""
    from edgefinfer.compile.gguf_export import layer_gguf_type, quantized_gguf_types

    modules = dict(model.named_modules())
    for name, fmt in recipe.quant.overrides if recipe.quant is not None else ():
        if name in modules and fmt is not None and fmt.bits == 8 and fmt.group_size is None:
            try:
                layer_gguf_type(f"{name}.weight", modules[name])
            except UserError as e:
                raise UserError(f"{e}; this checkpoint keeps its source GGUF's higher-bit matrices per channel: "
                                f"re-quantize with `edgefinfer quantize ... --target {target.name}`") from None
    quantized_gguf_types(model)


def check_recipe(model, target: Target, recipe: Recipe, overrides: dict[str, Any] | None = None) -> None:
    """A one-line UserError, before any work, if `recipe` (with per-module format `overrides`: the
    matrices kept at their source's precision) cannot make `target`'s artefact from `model`."""
    if recipe.kind in (RecipeKind.FLOAT, RecipeKind.QDQ):
        return  # the exporters check these themselves, up front
    if recipe.kind is RecipeKind.LLAMACPP:
        from edgefinfer.compile.gguf_export import LLAMA_FTYPES

        if target.format != "gguf" or recipe.variant not in LLAMA_FTYPES:
            raise UserError(f"recipe {recipe.name}: llama.cpp's quantizer makes GGUF files (gpu-server), with "
                            f"{', '.join(LLAMACPP_PREFIX + t for t in LLAMA_FTYPES)}")
        return
    from edgefinfer.compile.quant.apply import plan_formats

    parsed = recipe.quant.with_overrides(overrides) if overrides else recipe.quant
    plan_formats(model, parsed)  # group sizes that do not divide the model's widths, tied-head formats
    if target.format != "gguf" and parsed.weights.super_block:
        raise UserError(f"recipe {recipe.name}: -k super-blocks are GGUF's K-quants (target gpu-server); "
                        f"for {target.name} drop -k")
    if target.format == "gguf":
        from edgefinfer.compile.gguf_export import gguf_types_for

        gguf_types_for(model, parsed)  # only formats with an exact GGUF type
    elif target.format == "pte" and parsed.activations != "int8-per-token":
        raise UserError(f"recipe {recipe.name}: ExecuTorch's XNNPACK runs 8da4w-* and 8da8w recipes (int4 / int8 weights, "
                        "int8 dynamic activations) or fp32")


@dataclass
class Candidate:
    """One --quality-budget candidate: skipped (why), or its eager and, if compiled, runtime figures."""

    recipe: str
    skipped: str | None = None
    size_bytes: int | None = None
    eager_ppl_delta: float | None = None
    runtime_ppl_delta: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _check_budget(target: Target, opts: BuildOptions) -> None:
    """--quality-budget's one-line errors, before any work."""
    if opts.quality_budget is None:
        return
    if opts.quality_budget < 0:
        raise UserError(f"--quality-budget is a perplexity increase in percent, >= 0; got {opts.quality_budget:g}")
    if opts.recipe:
        raise UserError("give --recipe or --quality-budget, not both (the budget chooses the recipe)")
    if opts.eval_tokens <= 0:
        raise UserError("--quality-budget needs an evaluation (drop --eval-tokens 0)")
    if not target.runs_here:
        raise UserError(f"--quality-budget measures the artefact with its runtime, which cannot run {target.name}'s "
                        f"artefact on this host; give --recipe instead")


def eager_candidates(model, target: Target, tokenizer, float_ppl: float, test_ids: list[int], opts: BuildOptions,
                     tried: list[Candidate]):
    """Yield (recipe, quantized model) for each candidate, smallest first, whose eager perplexity is
    within budget; every candidate's outcome (skipped and why, or measured) is appended to `tried`."""
    from edgefinfer.compile.quant.modules import model_size_bytes

    for name in CANDIDATES.get(target.format, [target.recipe]):
        recipe = Recipe.parse(name)  # once per candidate: every step below takes the value
        try:
            check_recipe(model, target, recipe)
        except UserError as e:
            print(f"  candidate {name:<22} skipped: {e}", file=sys.stderr)
            tried.append(Candidate(name, skipped=str(e)))
            continue
        quantized = quantize_for(model, target, recipe, tokenizer)
        scored, size = (_llamacpp_weights(model, tokenizer, recipe) if recipe.kind is RecipeKind.LLAMACPP else
                        (quantized, model_size_bytes(quantized)))
        ppl = _perplexity_of(lambda ids: scored(ids), test_ids, opts.eval_window, tokenizer.scoring_prefix)
        tried.append(Candidate(name, size_bytes=size,
                               eager_ppl_delta=round(100 * (ppl / float_ppl - 1), 3)))
        within = tried[-1].eager_ppl_delta <= opts.quality_budget
        print(f"  candidate {name:<22} eager ppl {ppl:8.3f} ({tried[-1].eager_ppl_delta:+.2f}%) "
              f"{'within budget: compile it' if within else 'over budget'}", file=sys.stderr)
        if within:
            yield recipe, quantized


def _llamacpp_weights(model, tokenizer, recipe: Recipe):
    """(model, file bytes): the weights llama.cpp's quantizer gives the model, the file written and
    read back (gguf-py dequantizes every type exactly), so the candidate is scored on what it holds."""
    import tempfile

    from edgefinfer.compile.gguf_export import export_gguf
    from edgefinfer.model.gguf_import import import_gguf

    with tempfile.TemporaryDirectory() as tmp:
        export_gguf(model, tokenizer, Path(tmp) / "m.gguf", recipe.variant)
        return import_gguf(Path(tmp) / "m.gguf")[0], (Path(tmp) / "m.gguf").stat().st_size


def _confirmed(figures: dict[str, Any], budget: float, tried: list[Candidate], target: Target) -> bool:
    """Is the compiled artefact, measured by its own runtime, within budget? (Records the figure.)"""
    if figures.get("ppl_delta_pct") is None:
        raise UserError(f"--quality-budget: {target.name}'s artefact could not be measured by its runtime here; "
                        "give --recipe instead")
    tried[-1].runtime_ppl_delta = round(figures["ppl_delta_pct"], 3)
    ok = figures["ppl_delta_pct"] <= budget
    print(f"  candidate {tried[-1].recipe:<22} measured by {target.backend}: {figures['ppl_delta_pct']:+.2f}% "
          f"{'within budget' if ok else 'over budget: next candidate'}", file=sys.stderr)
    return ok


def budget_error(target: Target, budget: float, tried: list[Candidate]) -> UserError:
    """One line: nothing met the budget; the best any candidate reached (its runtime figure if compiled)."""
    measured = [(c.runtime_ppl_delta if c.runtime_ppl_delta is not None else c.eager_ppl_delta, c)
                for c in tried if c.eager_ppl_delta is not None]
    if not measured:
        return UserError(f"no candidate recipe applies to this model for {target.name} "
                         f"({'; '.join(f'{c.recipe}: {c.skipped}' for c in tried)})")
    delta, best = min(measured, key=lambda t: t[0])
    how = f"measured by {target.backend}" if best.runtime_ppl_delta is not None else "eager"
    return UserError(f"no recipe for {target.name} stays within +{budget:g}% perplexity: the best, {best.recipe}, "
                     f"reached {delta:+.2f}% ({how}); raise --quality-budget or pass --recipe")


def _add_draft(writer: BundleWriter, target: Target, draft: Path, tokenizer, kv: KVSpec, opts: BuildOptions) -> None:
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.tokenization.tokenizer import Tokenizer

    if Tokenizer.from_dir(draft).backend.to_str() != tokenizer.backend.to_str():
        raise UserError(f"draft model {draft} has a different tokenizer than the target; it cannot draft for it")
    recipe = Recipe.parse(target.recipe)
    files, meta = compile_artefact(target, quantize_for(load_model(draft), target, recipe, tokenizer),
                                   tokenizer, recipe, kv, writer.tmp / "draft", opts)
    writer.add(f"draft/{files[0]}", format=target.format, role="draft", backend=target.backend,
               recipe=target.recipe, **_manifest_meta(meta))


def _manifest_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """An exporter's metadata minus what the manifest records in its own fields."""
    return {k: v for k, v in meta.items() if k not in ("files", "path", "format", "backend", "recipe", "role")}


def print_summary(target: Target, recipe: str, artefact: str, size: int, float_ppl: float | None,
                  figures: dict[str, Any], build_s: float) -> None:
    def fmt(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    w = max(20, len(recipe))  # the recipe column fits the name (8da4w-g32-fzp-outliers16)
    print()
    print(f"{'target':<13} {'recipe':<{w}} {'artefact':<16} {'size MiB':>9} {'ppl':>8} {'vs float':>9} "
          f"{'decode tok/s':>12} {'build s':>8}")
    print(f"{target.name:<13} {recipe:<{w}} {artefact:<16} {size / 2**20:>9.1f} {fmt(figures.get('ppl'), '8.3f'):>8} "
          f"{fmt(figures.get('ppl_delta_pct'), '+8.2f'):>8}% {fmt(figures.get('decode_tok_s'), '12.1f'):>12} "
          f"{build_s:>8.1f}")
    if float_ppl is not None:
        print(f"(float perplexity {float_ppl:.3f} on the same test tokens)")
