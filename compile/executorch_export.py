"""Export a Transformer to an ExecuTorch program (.pte) with its KV cache held in the graph.

    meta = export_pte(model, Path("model.pte"), recipe="8da4w", embedding_4bit=True, max_seq_len=512)

Pipeline (each stage is printed with its elapsed time; lowering takes 1-4 minutes per model on 2 cores):

1. quantize  (8da4w / 8da8w)  our RTN quantization (`edgefinfer.compile.quant`), re-packed for torchao
                              (`et_quant`); an already-quantized model is taken as it is;
2. export                     torch.export of `ExportableLM`: forward(tokens [1, S], input_pos [1]) ->
                              logits [1, S, V], S dynamic in 1..max_chunk, the KV cache in mutable
                              buffers; with `custom_ops` the attention is ExecuTorch's
                              `llama::update_cache` + `llama::custom_sdpa` (`et_attention`);
3. lower                      XNNPACK (the dynamically-quantized partitioner first for 8da*w, then
                              the general one), Core ML, or MediaTek's NeuroPilot (`mediatek` target:
                              ExecuTorch's NeuropilotPartitioner, after static activation + weight
                              quantization with its NeuropilotQuantizer (pt2e), calibrated on text;
                              it needs MediaTek's mtk_converter / mtk_neuron, which are not on PyPI);
4. to_executorch              memory planning (graph inputs not planned), quantized-op fusion
                              (`embedding_4bit`), delegate segments outside the flatbuffer.

The program carries the constant methods ExecuTorch's `TextLLMRunner` reads (`get_max_seq_len`,
`get_max_context_len`, `get_vocab_size`, `get_n_layers`, `get_bos_id`, `get_eos_ids`, `use_kv_cache`,
`enable_dynamic_shape`, `use_sdpa_with_kv_cache`) and ours (`edgefinfer_*`: cache layout, window,
sinks, whether every position's logits are returned), so `ExecuTorchBackend` needs no side file.

Caching (`artefact_cache`): a finished .pte is stored under `$EDGEFINFER_CACHE/artefacts/executorch/<key>/`,
the key hashing the model's tensors and config, the options, the tool versions and the exporter's
source (`CACHE_SOURCES`); a later export with the same key copies it instead of lowering again.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import operator
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from edgefinfer.bundle.artefact import ArtefactSpec, KVSpec, Layout, write_spec
from edgefinfer.compile.et_attention import EtRingCache, EtStaticCache, ExportableLM, swap_attention
from edgefinfer.files.atomic import write_bytes
from edgefinfer.compile.artefact_cache import ArtefactCache, content_key
from edgefinfer.compile import quant
from edgefinfer.compile.et_quant import (QUANTIZED_SCHEMES, Scheme, check_xnnpack_layout, is_quantized,
                                         quantize_for_xnnpack, scheme_of)
from edgefinfer.compile.vendor_sdks import require_sdk
from edgefinfer.errors import UserChoice, UserError
from edgefinfer.model import transformer as transformer_module
from edgefinfer.model.transformer import Transformer

Delegate = Literal["xnnpack", "coreml", "neuropilot"]
Progress = Callable[[str], None]



class NeuropilotRecipe(UserChoice):
    """NeuroPilot recipes: static activation + weight quantization by ExecuTorch's NeuropilotQuantizer,
    calibrated on text. The value is the recipe as the user names it; the member's name is the
    quantizer's `Precision` (A16W8: uint16 activations, int8 weights). A StrEnum: written (manifest,
    cache key) as its value."""

    A16W8 = "qdq-a16w8"
    A8W8 = "qdq-a8w8"
    A16W4 = "qdq-a16w4"
    A8W4 = "qdq-a8w4"
    A16W16 = "qdq-a16w16"

    @classmethod
    def refusal(cls, text: object) -> str:
        return f"recipe {text!r} is not a NeuroPilot recipe: use one of {', '.join(cls)}"

    @property
    def precision(self) -> str:
        """The name of ExecuTorch's `executorch.backends.mediatek.Precision` member."""
        return self.name


NEUROPILOT_RECIPES: tuple[NeuropilotRecipe, ...] = tuple(NeuropilotRecipe)
NEUROPILOT_PLATFORMS = ("mt6989", "mt6991", "mt6993")  # what ExecuTorch 1.5.1's NeuropilotBackend accepts
# MediaTek's own LLM export passes these to its Neuron compiler (gno: graph optimisations).
NEUROPILOT_COMPILE_OPTIONS = (("gno", b"LTS"), ("gno-exp", b""), ("gno-non-4d-tiling", b""))

# The exporter modules whose source is part of the cache key: editing them invalidates old programs.
# The exported graph is a trace of the model's forward and of the modules `compile.quant.layouts` swaps in
# (a float zero point's OffsetLinear), so their source is part of the key as well as the exporter's.
CACHE_SOURCES = (*(Path(__file__).with_name(n) for n in ("executorch_export.py", "et_attention.py", "et_quant.py",
                                                         "fusion.py")),
                 *quant.SOURCES, Path(transformer_module.__file__))
PROGRAM = "model.pte"  # the program's name inside a cache entry
# Kernel libraries a .pte from this exporter may need registered before it is loaded.
RUNTIME_KERNEL_MODULES = ("executorch.kernels.quantized", "executorch.extension.llm.custom_ops.custom_ops")


# ---- public API ----------------------------------------------------------------------------------------

def export_pte(model: Transformer, out_path: str | Path, *, recipe: Scheme | NeuropilotRecipe | str = Scheme.FP32,
               group_size: int = 32,
               embedding_4bit: bool = False, kv: Layout = Layout.STATIC, max_seq_len: int | None = None,
               window: int | None = None, num_sinks: int = 0, lookahead: int | None = None,
               backend: Delegate = "xnnpack", custom_ops: bool | None = None, all_logits: bool = True,
               bos_id: int | None = None, eos_ids: list[int] | None = None,
               calibration: list[list[int]] | None = None, platform: str = "mt6989",
               progress: bool | Progress = True, cache: bool = True, cache_dir: str | Path | None = None
               ) -> dict[str, Any]:
    """Write `model` as an ExecuTorch program at `out_path` and return its metadata (for the manifest).

    recipe        fp32; fp16 (Core ML compute precision only); 8da8w (int8 per-channel weights) or
                  8da4w (int4 weights in groups of `group_size`), both with int8 dynamic activations;
                  for NeuroPilot: qdq-a16w8 / qdq-a8w8 / qdq-a16w4 / qdq-a8w4 / qdq-a16w16 (static).
                  A model already quantized by `edgefinfer quantize` (8da4w recipes) is exported as is.
    embedding_4bit  quantize the embedding table to int4 g32 (and a tied output head with it).
    kv            static: `max_seq_len` slots (default: the model's max_position_embeddings);
                  window: a ring of `window` + `lookahead` slots (+ `num_sinks` sink slots), for
                  unbounded streams; a forward then takes at most `lookahead + 1` tokens (default
                  lookahead = window).
    custom_ops    ExecuTorch's update_cache / custom_sdpa (default: on for XNNPACK, off for Core ML,
                  whose delegate cannot take them); off = the model's own attention in plain ops
                  (static cache only).
    all_logits    return logits for every new position (speculative verification needs them);
                  False returns the last position only (what ExecuTorch's runners use).
    progress      True: stage lines on stderr; or a callable taking one line (called from a helper
                  thread too, every 30 s of a long stage).
    calibration   NeuroPilot: token streams the static quantizer observes (default: pseudo-random
                  ids, fit for tests only).
    platform      NeuroPilot: the MediaTek SoC to compile for (mt6989 = Dimensity 9300, ...).
    cache         reuse / store the program in `cache_dir` (default `$EDGEFINFER_CACHE/executorch`).
    """
    say = _progress_fn(progress)
    opts = resolve_options(model, recipe=recipe, group_size=group_size, embedding_4bit=embedding_4bit, kv=kv,
                           max_seq_len=max_seq_len, window=window, num_sinks=num_sinks, lookahead=lookahead,
                           backend=backend, custom_ops=custom_ops, all_logits=all_logits, bos_id=bos_id,
                           eos_ids=eos_ids, platform=platform, calibration=calibration)
    out_path = Path(out_path)
    t0 = time.perf_counter()
    stages: dict[str, float] = {}

    with _stage("hash", say, stages):
        key = export_key(model, opts)
    store = ArtefactCache(cache_dir)
    if cache and (hit := store.get("executorch", key)) is not None:
        store.restore(hit, {PROGRAM: out_path})
        meta = dict(hit.meta, cached=True, original_build_s=hit.meta["build_s"],
                    build_s=round(time.perf_counter() - t0, 2), path=str(out_path))
        say(f"[executorch] cache hit {key[:12]}: copied {hit.files[PROGRAM]} ({meta['size_bytes'] / 2**20:.1f} MiB)")
        return meta

    program, spec, methods = _program(model, opts, say, stages)
    with _stage("write", say, stages):
        write_bytes(out_path, program.buffer)
    meta = {
        **write_spec(spec, "manifest"),  # format, recipe, kv, inputs, outputs
        **_program_meta(opts, methods),
        "size_bytes": out_path.stat().st_size,
        "stages_s": {k: round(v, 2) for k, v in stages.items()},
        "build_s": round(time.perf_counter() - t0, 2),
        "cache_key": key,
        "cached": False,
        "path": str(out_path),
    }
    if cache:
        store.put("executorch", key, {PROGRAM: out_path}, meta)
    say(f"[executorch] wrote {out_path} ({meta['size_bytes'] / 2**20:.2f} MiB) in {meta['build_s']:.1f}s")
    return meta


def _program(model: Transformer, opts: PteOptions, say: Progress, stages: dict[str, float]
             ) -> tuple[Any, ArtefactSpec, dict[str, Any]]:
    """The pipeline's stages 1-4 (the module doc), each timed into `stages`: (the ExecuTorch program,
    its description, the constant methods that carry it)."""
    with _stage(f"quantize {opts.scheme}", say, stages):
        prepared = _prepare_weights(model, opts)
    with _stage("export", say, stages), _finite_mask(opts.delegate == "neuropilot"):
        module, example, dynamic = _exportable(prepared, opts)
        exported = _torch_export(module, example, dynamic, opts)
    if opts.delegate == "neuropilot":
        with _stage(f"quantize {opts.scheme} (NeuropilotQuantizer)", say, stages):
            exported = _neuropilot_quantize(exported, example, opts, model.config.vocab_size)
    spec = artefact_spec(prepared, opts)
    methods = write_spec(spec, "pte")
    with _stage(f"lower ({opts.delegate})", say, stages):
        edge = _lower(exported, methods, opts)
    with _stage("to_executorch", say, stages):
        program = _to_executorch(edge)
    return program, spec, methods


def _program_meta(opts: PteOptions, methods: dict[str, Any]) -> dict[str, Any]:
    """What the manifest records of how the program was made (besides its spec, size and times)."""
    return {
        "backend": "executorch",
        "delegate": opts.delegate,
        "scheme": opts.scheme,
        "group_size": opts.group_size if opts.scheme is Scheme.INT4 else None,
        "embedding_4bit": opts.embedding_4bit,
        "custom_ops": opts.custom_ops,
        "all_logits": opts.all_logits,
        "methods": methods,
        "kernel_modules": list(RUNTIME_KERNEL_MODULES),
    }


def export_key(model: Transformer, opts: PteOptions) -> str:
    """The program's key in the artefact cache: the model, every resolved option (each may change the
    bytes), the tools, our source."""
    return content_key("executorch", model, dataclasses.asdict(opts), CACHE_SOURCES)


def artefact_spec(model: Transformer, opts: PteOptions) -> ArtefactSpec:
    """The program's description, stored as its constant methods (`edgefinfer.bundle.artefact` writes them:
    ExecuTorch's runner keys and ours) and in the manifest."""
    cfg = model.config
    return ArtefactSpec("pte", opts.kv, recipe_name=opts.recipe_name, vocab_size=cfg.vocab_size,
                        num_layers=cfg.num_hidden_layers, all_logits=opts.all_logits,
                        bos_id=opts.bos_id if opts.bos_id >= 0 else None, eos_ids=opts.eos_ids,
                        inputs=("tokens int64 [1, S]", "input_pos int64 [1] (position of tokens[0])"),
                        outputs=(f"logits float32 [1, {'S' if opts.all_logits else '1'}, {cfg.vocab_size}]",))


def pte_delegates(path: str | Path) -> dict[str, Any]:
    """Structure of a .pte without running it: per method, its delegates' back-end ids and its
    non-delegated operators (read from the program flatbuffer)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(Path(path).read_bytes()).program
    out = {}
    for plan in program.execution_plan:
        out[plan.name] = {
            "delegates": [d.id for d in plan.delegates],
            "operators": sorted({f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators}),
        }
    return out


# ---- options ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PteOptions:
    """`export_pte`'s options as `resolve_options` checked and normalised them: what every stage
    reads, and (all of it: each field may change the program's bytes) the cache key's input."""

    scheme: Scheme | NeuropilotRecipe  # ExecuTorch's scheme (XNNPACK, Core ML), or NeuroPilot's recipe
    recipe_name: str  # as the manifest records it (8da4w-g32-emb4, "8da4w (pre-quantized)", qdq-a16w8)
    group_size: int | None
    embedding_4bit: bool
    prequantized: bool
    layout: Layout
    max_seq_len: int | None  # static: the cache's positions; window: None
    max_chunk: int  # tokens one forward takes
    window: int | None
    num_sinks: int
    lookahead: int | None
    delegate: Delegate
    custom_ops: bool
    all_logits: bool
    bos_id: int  # -1: none
    eos_ids: tuple[int, ...]
    platform: str | None = None  # NeuroPilot: the MediaTek SoC
    # NeuroPilot: the token streams its static quantizer observes (they decide the activation ranges,
    # hence the bytes); None: pseudo-random ids
    calibration: tuple[tuple[int, ...], ...] | None = None

    @property
    def kv(self) -> KVSpec:
        return KVSpec(self.layout, max_seq_len=self.max_seq_len, window=self.window, sinks=self.num_sinks,
                      lookahead=self.lookahead, max_chunk=self.max_chunk)


def resolve_options(model: Transformer, *, recipe: Scheme | NeuropilotRecipe | str = Scheme.FP32,
                    group_size: int = 32, embedding_4bit: bool = False, kv: Layout | str = Layout.STATIC,
                    max_seq_len: int | None = None, window: int | None = None, num_sinks: int = 0,
                    lookahead: int | None = None, backend: str = "xnnpack", custom_ops: bool | None = None,
                    all_logits: bool = True, bos_id: int | None = None, eos_ids: list[int] | None = None,
                    platform: str = "mt6989", calibration: list[list[int]] | None = None) -> PteOptions:
    """Check `export_pte`'s options up front (before minutes of lowering) and normalise them, once.
    Raises UserError with a one-line reason."""
    if backend not in ("xnnpack", "coreml", "neuropilot"):
        raise UserError(f"unknown ExecuTorch back-end {backend!r}: use xnnpack, coreml or neuropilot")
    layout = Layout.parse(kv)
    if backend == "neuropilot":
        return _neuropilot_options(model, recipe, layout, max_seq_len, window, num_sinks, lookahead, custom_ops,
                                   embedding_4bit, all_logits, bos_id, eos_ids, platform, calibration)
    scheme = Scheme.parse(recipe)
    require_sdk(backend)
    prequantized = _check_recipe(model, scheme, group_size, embedding_4bit, backend)
    custom_ops = backend == "xnnpack" if custom_ops is None else custom_ops
    if custom_ops and backend == "coreml":
        raise UserError("Core ML cannot delegate ExecuTorch's custom attention ops: use custom_ops=False")
    cache = _cache_options(model, layout, max_seq_len, window, num_sinks, lookahead, backend, custom_ops)
    return PteOptions(scheme=scheme, recipe_name=_recipe_name(scheme, group_size, embedding_4bit, prequantized),
                      group_size=group_size, embedding_4bit=embedding_4bit, prequantized=prequantized, **cache,
                      delegate=backend, custom_ops=custom_ops, all_logits=all_logits,
                      **_special_ids(model, bos_id, eos_ids))


def _check_recipe(model: Transformer, scheme: Scheme, group_size: int, embedding_4bit: bool, backend: str) -> bool:
    """Refuse a scheme the back-end or the model cannot take; whether the model comes quantized."""
    cfg = model.config
    if scheme is Scheme.FP16 and backend != "coreml":
        raise UserError("recipe fp16 is Core ML's compute precision; for XNNPACK use fp32, 8da8w or 8da4w")
    if backend == "coreml" and scheme.quantized:
        raise UserError(f"recipe {scheme} is XNNPACK's integer kernels; Core ML builds use fp16 or fp32")
    if embedding_4bit and not scheme.quantized:
        raise UserError("embedding_4bit goes with the quantized recipes 8da4w / 8da8w")
    prequantized = is_quantized(model)
    if prequantized:
        check_xnnpack_layout(model)
        if scheme is not scheme_of(model):
            raise UserError(f"the model is already quantized as {scheme_of(model)}: export it with recipe "
                            f"{str(scheme_of(model))!r}, or pass the float model to quantize it as {scheme}")
    if scheme is Scheme.INT4 and not prequantized and (group_size < 16 or cfg.hidden_size % group_size
                                                   or cfg.intermediate_size % group_size):
        raise UserError(f"group size {group_size} does not divide hidden_size {cfg.hidden_size} and "
                        f"intermediate_size {cfg.intermediate_size}: use 32, 64 or 128 (one that divides both)")
    return prequantized


def _cache_options(model: Transformer, layout: Layout, max_seq_len: int | None, window: int | None, num_sinks: int,
                   lookahead: int | None, backend: str, custom_ops: bool) -> dict[str, Any]:
    """The cache fields of `PteOptions` (XNNPACK, Core ML), checked."""
    if layout is Layout.STATIC:
        if window is not None or num_sinks or lookahead is not None:
            raise UserError("window, num_sinks and lookahead apply to kv='window'; drop them for a static cache")
        max_seq_len = max_seq_len or model.config.max_position_embeddings
        if max_seq_len < 2:
            raise UserError(f"max_seq_len must be at least 2, got {max_seq_len}")
        # coremltools cannot convert a graph with a symbolic length (placeholders must be tensors), so a
        # Core ML program takes one token per call; ExecuTorch's runner then prefills token by token.
        max_chunk = 1 if backend == "coreml" else max_seq_len
    else:
        if window is None or window < 1:
            raise UserError("kv='window' needs window=N >= 1 (the number of recent positions kept)")
        if max_seq_len is not None:
            raise UserError("max_seq_len applies to kv='static'; a window cache has no length limit")
        if num_sinks < 0:
            raise UserError(f"num_sinks must be >= 0, got {num_sinks}")
        if backend == "coreml":
            raise UserError("the Core ML build supports kv='static' only (its graph has a fixed length)")
        if custom_ops is False:
            raise UserError("kv='window' is exported with ExecuTorch's custom ops only: drop custom_ops=False")
        lookahead = window if lookahead is None else lookahead
        if lookahead < 1:
            raise UserError(f"lookahead must be >= 1 (a forward takes at most lookahead + 1 tokens), got {lookahead}")
        max_chunk = lookahead + 1
    return dict(layout=layout, max_seq_len=max_seq_len, max_chunk=max_chunk, window=window, num_sinks=num_sinks,
                lookahead=lookahead)


def _special_ids(model: Transformer, bos_id: int | None, eos_ids: list[int] | None) -> dict[str, Any]:
    """BOS (-1: none) and EOS ids for the program's constant methods: the given ones, else the config's."""
    cfg = model.config
    bos = bos_id if bos_id is not None else cfg.bos_token_id
    eos = list(eos_ids) if eos_ids is not None else cfg.eos_token_ids
    return dict(bos_id=-1 if bos is None else int(bos), eos_ids=tuple(int(e) for e in eos))


def _neuropilot_options(model: Transformer, recipe: NeuropilotRecipe | Scheme | str, layout: Layout,
                        max_seq_len: int | None, window: int | None, num_sinks: int, lookahead: int | None,
                        custom_ops: bool | None, embedding_4bit: bool, all_logits: bool, bos_id: int | None,
                        eos_ids: list[int] | None, platform: str, calibration: list[list[int]] | None) -> PteOptions:
    """MediaTek NeuroPilot: a float model, quantized statically by NeuropilotQuantizer; a static cache and
    one token per call (the Neuron compiler takes fixed shapes; ExecuTorch's runner then prefills
    token by token), plain-op attention (the delegate cannot take ExecuTorch's custom ops)."""
    recipe = NeuropilotRecipe.parse(recipe)
    if platform not in NEUROPILOT_PLATFORMS:
        raise UserError(f"unknown MediaTek platform {platform!r}: use one of {', '.join(NEUROPILOT_PLATFORMS)}")
    if layout is not Layout.STATIC or window is not None or num_sinks or lookahead is not None:
        raise UserError("the NeuroPilot build supports kv='static' only (its graph has fixed shapes)")
    if custom_ops:
        raise UserError("NeuroPilot cannot delegate ExecuTorch's custom attention ops: use custom_ops=False")
    if embedding_4bit:
        raise UserError("embedding_4bit is an XNNPACK recipe; NeuroPilot quantizes with its own quantizer")
    if is_quantized(model):
        raise UserError("NeuroPilot quantizes the float model itself: pass the float checkpoint")
    require_sdk("mediatek")
    max_seq_len = max_seq_len or model.config.max_position_embeddings
    if max_seq_len < 2:
        raise UserError(f"max_seq_len must be at least 2, got {max_seq_len}")
    streams = tuple(tuple(int(t) for t in s) for s in calibration) if calibration else None
    return PteOptions(scheme=recipe, recipe_name=str(recipe), group_size=None, embedding_4bit=False, prequantized=False,
                      layout=Layout.STATIC, max_seq_len=max_seq_len, max_chunk=1, window=None, num_sinks=0,
                      lookahead=None, delegate="neuropilot", custom_ops=False, all_logits=all_logits,
                      **_special_ids(model, bos_id, eos_ids), platform=platform, calibration=streams)


def _recipe_name(scheme: Scheme, group_size: int, embedding_4bit: bool, prequantized: bool) -> str:
    if prequantized:
        return f"{scheme} (pre-quantized)"
    name = f"8da4w-g{group_size}" if scheme is Scheme.INT4 else str(scheme)
    return name + ("-emb4" if embedding_4bit else "")


# ---- stages -------------------------------------------------------------------------------------------

def _prepare_weights(model: Transformer, opts: PteOptions) -> Transformer:
    """A float32 eval copy of the model, quantized for XNNPACK when the recipe asks (our own modules)."""
    if opts.prequantized:
        return copy.deepcopy(model).float().eval()  # float scales hold the same (fp16) values
    if opts.scheme in QUANTIZED_SCHEMES:
        return quantize_for_xnnpack(model, opts.scheme, opts.group_size, opts.embedding_4bit)
    return copy.deepcopy(model).float().eval()


def _exportable(model: Transformer, opts: PteOptions) -> tuple[nn.Module, tuple, tuple]:
    """The module torch.export sees, an example input and the dynamic shapes."""
    from edgefinfer.compile.fusion import fuse_projections
    from edgefinfer.compile.quant import torchao_model

    if opts.delegate == "xnnpack":
        # q|k|v and gate|up as one linear each: one dynamic quantization (and one group-sum, for a float
        # zero point) per input instead of three or two, and fewer nodes for every lowering pass
        fuse_projections(model)
    if opts.scheme in QUANTIZED_SCHEMES:
        model = torchao_model(model)  # QuantLinear -> nn.Linear holding the same codes as a torchao tensor
    cfg = model.config
    if opts.delegate == "xnnpack":
        _explicit_tanh_gelu(model)
        _delegable_norms(model)
    if opts.custom_ops:
        cache: nn.Module = (EtStaticCache(cfg, opts.max_seq_len) if opts.layout is Layout.STATIC else
                            EtRingCache(cfg, opts.window, opts.num_sinks, opts.lookahead))
        model = swap_attention(model)
    else:
        from edgefinfer.model.kv_cache import StaticCache

        cache = StaticCache(cfg, 1, opts.max_seq_len, trim=False)  # the window needs custom ops
    module = ExportableLM(model, cache, opts.all_logits).eval()
    n = min(2, opts.max_chunk)
    example = (torch.zeros(1, n, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    seq = torch.export.Dim("seq", min=1, max=opts.max_chunk) if opts.max_chunk > 1 else None
    dynamic = ({1: seq} if seq is not None else None, None)
    return module, example, dynamic


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation in plain ops: 0.5 x (1 + tanh(z)) = x sigmoid(2z)."""
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))


def _explicit_tanh_gelu(model: nn.Module) -> None:
    """ExecuTorch 1.5.1's XNNPACK delegate runs `gelu(approximate="tanh")` (Gemma's MLP) as the exact
    erf GELU (measured: 6e-7 from erf, 5e-4 from tanh on |x| < 10, enough to move Gemma's logits by
    1e-3); written in plain ops it runs as the model's own activation. Mutates `model`: a private copy
    (`_prepare_weights`)."""
    for m in model.modules():
        if getattr(m, "act_name", None) == "gelu_pytorch_tanh":
            m.act = _gelu_tanh


class _LinearMeanRMSNorm(nn.Module):
    """RMSNorm with the mean of squares as a linear over a constant 1/D row: XNNPACK takes linear but not
    mean over the last dimension (only a 4-D pool over dims 2 and 3), so `mean(-1)` ran outside the delegate
    and split every layer's graph at both of its norms (measured: 11 -> 8 delegates per layer, -14% CPU)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps
        dim = norm.weight.shape[0]
        self.register_buffer("mean_row", torch.full((1, dim), 1.0 / dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        x32 = x.float()
        mean_square = nn.functional.linear(x32 * x32, self.mean_row)  # [..., 1]
        return self.weight * (x32 * torch.rsqrt(mean_square + self.eps)).to(x.dtype)


def _delegable_norms(model: nn.Module) -> None:
    """Swap every RMSNorm (the block norms, the final norm, per-head q/k norms) for `_LinearMeanRMSNorm`.
    Mutates `model`: a private copy (`_prepare_weights`)."""
    from edgefinfer.model.transformer import RMSNorm

    for name, module in list(model.named_modules()):
        if type(module) is RMSNorm:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, _LinearMeanRMSNorm(module))


def _torch_export(module: nn.Module, example: tuple, dynamic: tuple, opts: PteOptions):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # MATH: the decomposition ExecuTorch can lower (the plain-op path); no_grad: no training ops. No
    # run_decompositions here: to_edge_transform_and_lower starts with the same functionalisation (which
    # also turns torchao's tensor subclasses into quantize/dequantize ops), and each one retraces the whole
    # graph with symbolic shapes (a tenth of the lowering's time).
    with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]):
        return torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)


@contextlib.contextmanager
def _finite_mask(enabled: bool, value: float = -100.0) -> Iterator[None]:
    """While tracing, make the attention mask an additive 0 / `value` bias instead of a boolean one.

    SDPA turns a boolean mask into -inf scores; a statically quantized graph (NeuroPilot's int16
    activations) would spend its whole range on them and lose every real score (measured: logits
    off by more than their own magnitude). A finite bias keeps the scores' resolution, as in the QNN
    graph (`onnx_static.MASK_OFF`)."""
    if not enabled:
        yield
        return
    import edgefinfer.model.transformer as model_module

    boolean = model_module.attention_mask
    model_module.attention_mask = lambda *a, **kw: torch.where(boolean(*a, **kw), 0.0, value)
    try:
        yield
    finally:
        model_module.attention_mask = boolean


def _neuropilot_quantize(exported, example: tuple, opts: PteOptions, vocab_size: int):
    """Static quantization as MediaTek's flow does it (pt2e with ExecuTorch's NeuropilotQuantizer):
    observe the calibration tokens one decode step at a time, convert, export again."""
    import executorch.kernels.quantized  # noqa: F401 (Q/DQ left outside the delegate need these out variants)
    import numpy as np
    from executorch.backends.mediatek import NeuropilotQuantizer, Precision
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    class FloatOnlyQuantizer(NeuropilotQuantizer):
        """ExecuTorch 1.5.1's annotator also marks integer ops (our position arithmetic, `input_pos +
        arange`) for quantization, which then fails; only floating-point values are quantized."""

        def annotate(self, model):
            super().annotate(model)
            for node in model.graph.nodes:
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point:
                    node.meta.pop("quantization_annotation", None)
            return model

    quantizer = FloatOnlyQuantizer()
    quantizer.setup_precision(getattr(Precision, opts.scheme.precision))
    prepared = prepare_pt2e(exported.module(), quantizer)
    streams = opts.calibration or [np.random.default_rng(0).integers(0, vocab_size, 64).tolist()]
    with torch.no_grad():
        for stream in streams:  # each stream from position 0: the cache is causal, older entries are hidden
            for pos, token in enumerate(stream[: opts.max_seq_len]):
                prepared(torch.tensor([[token]]), torch.tensor([pos]))
    converted = convert_pt2e(prepared, fold_quantize=False)
    return _torch_export(converted, example, (None, None), opts)


def neuropilot_partitioner(opts: PteOptions):
    """ExecuTorch's NeuropilotPartitioner with the compile specs for `opts.platform` (needs the SDK)."""
    from executorch.backends.mediatek import NeuropilotPartitioner
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    specs = [CompileSpec("platform-config", opts.platform.encode())]
    specs += [CompileSpec(key, value) for key, value in NEUROPILOT_COMPILE_OPTIONS]
    return NeuropilotPartitioner(specs)


def _partitioners(opts: PteOptions) -> list:
    if opts.delegate == "neuropilot":
        return [neuropilot_partitioner(opts)]
    if opts.delegate == "coreml":
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        precision = ct.precision.FLOAT16 if opts.scheme is Scheme.FP16 else ct.precision.FLOAT32
        specs = CoreMLBackend.generate_compile_specs(
            minimum_deployment_target=ct.target.iOS18, compute_precision=precision,
            compute_unit=ct.ComputeUnit.ALL, model_type=CoreMLBackend.MODEL_TYPE.MODEL)
        # The OSS Core ML runtime does not hold state: the KV-cache buffers stay with ExecuTorch.
        return [CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=False)]
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    # One partitioner for every scheme: the general one also takes the dynamically quantized linears
    # (the .pte holds the same int4/int8 kernels, bit-identical logits). ExecuTorch's llama export puts
    # XnnpackDynamicallyQuantizedPartitioner first, which makes every linear a delegate of its own and
    # costs two more whole-graph decompositions: on SmolLM2 that was 2.4x the lowering time.
    return [_single_decomposition_partitioner()() if LOWERING_SHORTCUTS else XnnpackPartitioner()]


def _single_decomposition_partitioner():
    """XnnpackPartitioner that, when every node of the ops it keeps from decomposition passes its checks
    (every linear and torchao quantize op of our decoders does), says it needs no per-node check.

    With a check, `to_edge_transform_and_lower` takes its EDGE_DO_NOT_DECOMP path: decompose, rename the
    checked nodes into a no-decomposition namespace, decompose the whole graph again, rename them back:
    two whole-graph retraces with symbolic shapes on top of the functionalisation. Without one it
    decomposes once with the same ops kept (its own "more reliable path"). When a node fails its check
    the check is returned as ExecuTorch asks, and the lowering takes the stock path."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class SingleDecompositionPartitioner(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep):
            ops, check = super().ops_to_not_decompose(ep)
            kept = set(ops)
            if check is not None and all(check(n) for n in ep.graph.nodes
                                         if n.op == "call_function" and n.target in kept):
                return ops, None
            return ops, check

    return SingleDecompositionPartitioner


# Switch for the lowering's shortcuts (`_single_decomposition_partitioner`, `_decoder_xnnpack_passes`,
# `_partitions_legalized_in_place`): each leaves the program byte for byte as ExecuTorch's stock
# pipeline writes it, which tests/test_executorch_export.py checks by turning this off.
LOWERING_SHORTCUTS = True


def _lower(exported, methods: dict[str, Any], opts: PteOptions):
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    shortcuts = contextlib.ExitStack()
    if LOWERING_SHORTCUTS:
        shortcuts.enter_context(_partitions_legalized_in_place())
        if opts.delegate == "xnnpack":
            shortcuts.enter_context(_decoder_xnnpack_passes(opts.custom_ops))
    with shortcuts:
        return to_edge_transform_and_lower(
            exported, partitioner=_partitioners(opts),
            # The custom ops and torchao's quantize ops are not core ATen; the checks would refuse them.
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            constant_methods=methods)


# XNNPACK passes that only rewrite ops a decoder never has (each pass retraces every partition, matching or
# not): pass name -> the edge ops it looks for. ConvertToSDPAPass matches the plain-op attention, so it
# stays unless the attention is ExecuTorch's custom_sdpa (which XNNPACK does not take).
_PASSES_FOR_ABSENT_OPS = {
    "ConvertToUpsampleBilinear2d": ("upsample", "index", "floor"),  # matches decomposed upsampling
    "FuseBatchNormPass": ("batch_norm",),
    "DecomposeBatchNorm": ("batch_norm",),
    "Conv1dUnsqueezePass": ("convolution",),
    "PReLUReshapePass": ("prelu",),
    "InsertPadQDQPass": ("constant_pad_nd",),
    # These change a partition only where it holds their ops, yet retrace it whatever it holds.
    "FuseActivationPass": ("relu", "hardtanh"),  # fuses these into the op before them
    "RemoveGetItemPass": ("max_pool2d_with_indices", "aten.max.dim"),  # their getitem users
    "DecomposeConcatenate": ("cat",),  # splits a cat of more than 4 inputs
    "RemoveRedundantCopyPass": ("_to_copy",),  # removes a pair of dtype / memory-format copies
    "DimOrderOpsRevertPass": ("dim_order",),  # dim_order ops back to memory-format ops
}
# XNNPACK passes that only copy node.meta["custom"] (a user's annotation) onto quantize/dequantize nodes.
_PASSES_FOR_CUSTOM_META = ("PropagateCustomMetaPass",)


@contextlib.contextmanager
def _decoder_xnnpack_passes(custom_sdpa: bool) -> Iterator[None]:
    """While lowering, XNNPACK's preprocess skips the passes whose ops a partition does not contain.

    Its pass manager runs 17 passes on every partition, and six of them (upsampling, batch norm, conv1d,
    PReLU, padding; SDPA under custom_sdpa) can only rewrite ops that a decoder's graph lacks: 25% of the
    lowering's CPU time on SmolLM2, for no change. Six more (activation fusion, getitem removal, cat
    decomposition, redundant copies, dim-order reversion, custom-meta propagation) rewrite only the ops
    or annotations they look for, but retrace the partition in any case. A pass is skipped only when
    none of its ops is in the partition, so the program is byte-identical (tests/test_executorch_export.py
    lowers it both ways)."""
    from executorch.backends.xnnpack import xnnpack_preprocess

    full = xnnpack_preprocess.XNNPACKPassManager
    skip_when_absent = dict(_PASSES_FOR_ABSENT_OPS, **({"ConvertToSDPAPass": ()} if custom_sdpa else {}))

    class DecoderPassManager(full):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            nodes = exported_program.graph.nodes
            ops = {str(n.target) for n in nodes if n.op == "call_function"}
            custom = any("custom" in n.meta for n in nodes)

            def needed(name: str) -> bool:
                if name in _PASSES_FOR_CUSTOM_META:
                    return custom
                return name not in skip_when_absent or any(word in op for op in ops for word in skip_when_absent[name])

            self.passes = [p for p in self.passes if needed(p.__name__)]

    xnnpack_preprocess.XNNPACKPassManager = DecoderPassManager
    try:
        yield
    finally:
        xnnpack_preprocess.XNNPACKPassManager = full


# torch.fx's legalize_graph (torch 2.13) puts these first in its topological order (runtime assertions).
_LEGALIZE_FIRST = frozenset((
    operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod, operator.le,
    operator.lt, operator.ge, operator.gt, operator.eq, operator.ne, torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._assert_async.msg,
    torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default))


@contextlib.contextmanager
def _partitions_legalized_in_place() -> Iterator[None]:
    """While lowering, each partition cut out of the graph re-sorts the graph in place instead of
    rebuilding it.

    ExecuTorch's `create_submodule_from_nodes` ends every partition with torch.fx's `legalize_graph`:
    a new graph with a copy of every node, then Python code generated and compiled for the whole graph
    again. Done once per partition (210 on SmolLM2's 30 layers) that is quadratic in the layers: 22% of
    the full model's lowering. The replacement computes the same topological order (the same
    algorithm, on the same node and user order), moves the nodes into it, and leaves the graph as the
    copy would have: each node's users in graph order, the name counters and the find-nodes table as
    a fresh graph registers them. The code is generated once, after the last partition, before anything
    runs the module."""
    import collections

    from executorch.exir import lowered_backend_module
    from executorch.exir.backend import backend_api
    from torch.fx.graph import _FindNodesLookupTable, _Namespace

    legalize, create = lowered_backend_module.legalize_graph, backend_api._create_partitions_in_graph_module
    lower_one = backend_api._partition_and_lower_one_graph_module
    stale: set = set()

    def legalize_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        graph = gm.graph
        nodes = list(graph.nodes)
        indeg = dict.fromkeys(nodes, 0)
        for node in nodes:
            for user in node.users:
                indeg[user] += 1
        queue = collections.deque(n for n in nodes if indeg[n] == 0)
        order = []
        while queue:  # legalize_graph's order: Kahn's, runtime assertions first
            cur = queue.popleft()
            order.append(cur)
            for user in cur.users:
                indeg[user] -= 1
                if indeg[user] == 0:
                    if user.op == "call_function" and user.target in _LEGALIZE_FIRST:
                        queue.appendleft(user)
                    else:
                        queue.append(user)
        if len(order) < len(nodes):
            return legalize(gm)  # its error names the cycle
        namespace, table = _Namespace(), _FindNodesLookupTable()
        for node in order:  # as node_copy into a fresh graph registers them, in this order
            if namespace.create_name(node.name, None) != node.name:
                return legalize(gm)  # a copy would rename it: let the copy be made
            namespace.associate_name_with_obj(node.name, node)
            table.insert(node)
        cursor = graph._root
        for node in order:
            if cursor._next is not node:
                cursor.append(node)
            cursor = node
        position = {node: i for i, node in enumerate(order)}
        for node in order:  # a copy's users are created in graph order
            users = sorted(node.users, key=position.__getitem__)
            if list(node.users) != users:
                node.users.clear()
                node.users.update(dict.fromkeys(users))
        graph._graph_namespace, graph._find_nodes_lookup_table = namespace, table
        graph._tracer_cls = graph._tracer_extras = None
        graph._co_fields = {}
        stale.add(gm)
        return gm

    def recompiled(fn):
        def run(tagged_graph_module, *args, **kwargs):
            result = fn(tagged_graph_module, *args, **kwargs)
            for gm in list(stale):
                gm.recompile()
            stale.clear()
            return result
        return run

    lowered_backend_module.legalize_graph = legalize_in_place
    backend_api._create_partitions_in_graph_module = recompiled(create)
    backend_api._partition_and_lower_one_graph_module = recompiled(lower_one)
    try:
        yield
    finally:
        lowered_backend_module.legalize_graph = legalize
        backend_api._create_partitions_in_graph_module = create
        backend_api._partition_and_lower_one_graph_module = lower_one


def _to_executorch(edge):
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    # Each of these passes retraces the whole program, running every delegate's original graph again
    # (SmolLM2: 210), so each runs only where it can change something (LOWERING_SHORTCUTS; the program
    # is byte-identical either way).
    graph = edge.exported_program().graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    # Linears left outside a delegate run as ExecuTorch's optimized linear, not transpose + mm.
    if not LOWERING_SHORTCUTS or any(word in t for t in targets for word in _LINEAR_OPS):
        edge = edge.transform([ConvertToLinearPass()])
    # Mutable buffers start uninitialised unless marked; the ring's slot positions must start at -1
    # (empty). The K/V buffers need no initial value: empty slots are masked.
    init = not LOWERING_SHORTCUTS or any(n.op == "placeholder" and "slot_pos" in n.name for n in graph.nodes)
    with _delegates_unlifted_once(edge) if LOWERING_SHORTCUTS else contextlib.nullcontext():
        return edge.to_executorch(ExecutorchBackendConfig(
            passes=[InitializedMutableBufferPass(["slot_pos"])] if init else [],
            extract_delegate_segments=True,
            # The KV buffers' names go into the program, so a runtime can read and write the cache
            # (`Method.get_attribute`: a saved session restores its cache instead of prefilling again).
            emit_mutable_buffer_names=True,
            do_quant_fusion_and_const_prop=True,  # dequantize + embedding -> quantized_decomposed::embedding_4bit
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),  # inputs come from the caller
            sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),  # plan memory for the upper bound of S
        ))


@contextlib.contextmanager
def _delegates_unlifted_once(edge) -> Iterator[None]:
    """While `to_executorch` runs, each delegate's original program is turned into a module once.

    Every pass that retraces the program meets each delegate call and runs the delegate's original graph
    on fake tensors for its output shapes, through `ExportedProgram.module()`, which unlifts the program's
    parameters into a new GraphModule every time: a quarter of to_executorch on SmolLM2 (210 delegates
    times each retracing pass). The module is a pure function of the program, which nothing changes
    here, so the first one is handed out again; other programs are not touched."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules
    from torch.export import ExportedProgram

    originals = {id(lowered.original_module): lowered.original_module
                 for _, lowered, _ in get_lowered_submodules(edge.exported_program().graph_module)}
    module, made = ExportedProgram.module, {}

    def module_once(self, *args, **kwargs):
        if args or kwargs or originals.get(id(self)) is not self:
            return module(self, *args, **kwargs)
        if id(self) not in made:
            made[id(self)] = module(self)
        return made[id(self)]

    ExportedProgram.module = module_once
    try:
        yield
    finally:
        ExportedProgram.module = module


# What ConvertToLinearPass rewrites: [add|b]mm from linear modules, linear with view_copy around it.
_LINEAR_OPS = ("linear", "aten.mm.", "addmm", "bmm")


# ---- progress, files, cache ---------------------------------------------------------------------------

def _progress_fn(progress: bool | Progress) -> Progress:
    if callable(progress):
        return progress
    if progress:
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return lambda _msg: None


@contextlib.contextmanager
def _stage(name: str, say: Progress, times: dict[str, float], beat_s: float = 30.0) -> Iterator[None]:
    """Time a stage and report it; a long stage (lowering a real model takes minutes) also reports its
    elapsed time every `beat_s` seconds, from a helper thread."""
    t = time.perf_counter()
    total = sum(times.values())
    say(f"[executorch] {name} ...")
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(beat_s):
            say(f"[executorch] {name} ... {time.perf_counter() - t:.0f}s")

    beat = threading.Thread(target=heartbeat, name="pte-progress", daemon=True)
    beat.start()
    try:
        with warnings.catch_warnings():
            # torch/executorch deprecation chatter (_check_is_size, LeafSpec) and the emitter's note that
            # mutable buffers are uninitialised (intended, see _to_executorch) would bury the progress lines.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message="Mutation on a buffer")
            yield
    finally:
        stop.set()
        beat.join()
    times[name] = time.perf_counter() - t
    say(f"[executorch] {name} done in {times[name]:.1f}s (total {total + times[name]:.1f}s)")
