"""Qualcomm NPU (`--target qnn`): static graphs -> QDQ quantization -> QNN HTP context binaries.

    build_qnn(model, out_dir, soc="sm8650", context=1024, chunk=64)
      1. `export_static_decode` twice, as Qualcomm's Genie pairs them: a prompt processor (`chunk`
         tokens per call) and a token generator (1 token), both over one `context`-slot cache
      2. `quantize_qdq`: onnxruntime's QNN QDQ config (A16W8 by default, or A8W8), weights int8 per
         output channel; the activation ranges are calibrated once, on the float prompt processor
         reading the calibration text behind the attention sink, and both graphs are quantized with
         those same ranges (one calibration cache), so they agree
      3. `compile_context`: the `onnxruntime-qnn` plugin EP compiles each graph offline into an
         EPContext model + QNN context binary for the SoC's HTP architecture
      -> model_ctx.onnx / prompt_ctx.onnx + *.bin (the phone), model_qdq.onnx / prompt_qdq.onnx (the
         same graphs for ONNX Runtime's CPU EP: the fallback, and how the build measures perplexity),
         sink_kv.npy (the attention sink: one token's float keys and values, held in cache slot 0)

Why the sink and per-channel weights (SmolLM2-135M, A16W8, 1024 test tokens, window 256, CPU EP;
float 40.95): per-tensor weights and no sink 48.16; sink 47.70; sink + per-channel weights 44.36.
Without them the HTP emulator and the CPU EP part at the 7th greedy token of a chat prompt (logits
RMS 0.4-1.4 apart); with them they agree on every step (RMS 0.1-0.5). The first position's residual
stream reaches |x| ~ 2e4 on SmolLM2 (~1e3 elsewhere): with its keys and values computed once in float
(PrefixQuant, Chen et al. 2024), the graphs never see it and the 16-bit ranges shrink ~20x.

The runtime runs them (`edgefinfer.runtime.backends.ort.open_qnn`): on the QNN EP where
`onnxruntime-qnn` is installed (on a PC, its x86 HTP emulator, ~1 s per token for a small model), on
the CPU EP otherwise. This module only builds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from edgefinfer.bundle.artefact import ONNX_GRAPHS, read_spec
from edgefinfer.compile.artefact_cache import cached_export
from edgefinfer.compile.onnx_graph import read_metadata
from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.libraries import ort_ep
from edgefinfer.errors import UserChoice, UserError
from edgefinfer.model.transformer import Transformer
from edgefinfer.libraries.ort_ep import qnn_context_session, require_qnn  # noqa: F401 (re-exported)
from edgefinfer.libraries.ort_ep import qnn_session_options as _qnn_session_options

# (float, QDQ, context model) files of the token generator and of the prompt processor.
FLOAT_FILE, QDQ_FILE, CTX_FILE = "model_float.onnx", "model_qdq.onnx", "model_ctx.onnx"
PROMPT_FLOAT_FILE, PROMPT_QDQ_FILE, PROMPT_CTX_FILE = "prompt_float.onnx", "prompt_qdq.onnx", "prompt_ctx.onnx"
CALIBRATION_FILE = "calibration.json"  # activation ranges, shared by the two graphs (not shipped)


@dataclass(frozen=True)
class Soc:
    name: str
    soc_model: int  # QNN_SOC_MODEL_* id
    htp_arch: int  # Hexagon HTP version (v68 ... v81)
    marketing: str


# SoC model ids as QNN's QnnTypes.h numbers them (cross-checked with ExecuTorch's QNN backend table).
SOCS: dict[str, Soc] = {s.name: s for s in (
    Soc("sa8295", 39, 68, "Snapdragon SA8295P (automotive)"),
    Soc("sm8450", 36, 69, "Snapdragon 8 Gen 1"),
    Soc("sm8475", 42, 69, "Snapdragon 8+ Gen 1"),
    Soc("sm8550", 43, 73, "Snapdragon 8 Gen 2"),
    Soc("sm8635", 68, 73, "Snapdragon 8s Gen 3"),
    Soc("ssg2115p", 46, 73, "Snapdragon SSG2115P"),
    Soc("sm8650", 57, 75, "Snapdragon 8 Gen 3"),
    Soc("sm8750", 69, 79, "Snapdragon 8 Elite"),
    Soc("sm8735", 85, 79, "Snapdragon 8s Gen 4"),
    Soc("sm8850", 87, 81, "Snapdragon 8 Elite Gen 5"),
)}


class QnnScheme(UserChoice):
    """QNN's QDQ quantization (`build_qnn`'s `scheme`, a `qdq-SCHEME` recipe's SCHEME): activations uint16
    (a16w8, the default) or uint8 (a8w8); MatMul weights int8 either way. A StrEnum: written (manifest,
    cache key) as its name."""

    A16W8 = "a16w8"
    A8W8 = "a8w8"

    @classmethod
    def refusal(cls, text: object) -> str:
        return f"unknown QNN quantization {text!r}: use one of {', '.join(cls)}"

    @property
    def activation_bits(self) -> int:
        return 16 if self is QnnScheme.A16W8 else 8


QUANT_SCHEMES: tuple[QnnScheme, ...] = tuple(QnnScheme)


def get_soc(name: str) -> Soc:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SOCS:
        known = ", ".join(f"{s.name} ({s.marketing}, v{s.htp_arch})" for s in SOCS.values())
        raise UserError(f"unknown Qualcomm SoC {name!r}: use one of {known}")
    return SOCS[key]


# ---- the plugin EP (the session helpers are in edgefinfer.libraries.ort_ep: a phone opens the context model too) ---

def qnn_session_options(soc: Soc, *, context_out: Path | None = None):
    return _qnn_session_options(soc.htp_arch, soc.soc_model, context_out)


def qnn_session(model_path: str | Path, soc: str | Soc):
    """A session on the QNN HTP backend for `soc` (the x86 emulator on a PC), e.g. for a context model."""
    soc = soc if isinstance(soc, Soc) else get_soc(soc)
    return qnn_context_session(model_path, soc.htp_arch, soc.soc_model)


# ---- QDQ quantization ---------------------------------------------------------------------------------

# Running a graph is the runtime's job, which an exporter may not import, so the caller passes in
# `edgefinfer.runtime.backends.ort.recorded_feeds`: the inputs of every call the float static graph
# runs while reading token streams (teacher forced), behind an attention sink if given; and
# `attention_sink`: one token's float keys and values at position 0, computed by the float graph.
RecordFeeds = Callable[..., list[dict[str, np.ndarray]]]  # (graph, streams, sink=None)
SinkOf = Callable[[Path, int], np.ndarray]  # (graph, token) -> [n_layers, 2, n_kv, head_dim]
SINK_FILE = "sink_kv.npy"


class _Feeds:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def quantize_qdq(float_path: Path, out_path: Path, feeds: list[dict[str, np.ndarray]] | None,
                 scheme: QnnScheme | str = QnnScheme.A16W8, ranges: Path | None = None) -> Path:
    """A QDQ copy of the float graph for the QNN HTP: activations uint16 (a16w8) or uint8; MatMul weights
    int8, symmetric, one scale per output channel (the form the HTP takes per-channel weights in;
    onnxruntime's QNN config only does that for Conv), other weights uint8 per tensor.

    ranges: a calibration cache (JSON of activation ranges by tensor name). If it exists, its ranges
        are used and `feeds` may be None; otherwise the ranges are calibrated on `feeds` and saved
        there, so a second graph with the same tensor names is quantized exactly like the first.
    """
    from onnxruntime.quantization import QuantType, quantize_static
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    scheme = QnnScheme.parse(scheme)
    if not feeds and not (ranges is not None and ranges.is_file()):
        raise UserError("QDQ calibration needs at least one token of calibration text")
    act = QuantType.QUInt16 if scheme.activation_bits == 16 else QuantType.QUInt8
    per_channel = {w: [{"axis": 1, "quant_type": QuantType.QInt8, "symmetric": True}]
                   for w in _matmul_weights(float_path)}
    c = get_qnn_qdq_config(str(float_path), _Feeds(feeds or []), activation_type=act, weight_type=QuantType.QUInt8,
                           init_overrides=per_channel)
    # quantize_static rather than quantize(config): only it takes the calibration cache.
    quantize_static(str(float_path), str(out_path), c.calibration_data_reader if feeds else None,
                    calibrate_method=c.calibrate_method, quant_format=c.quant_format,
                    activation_type=c.activation_type, weight_type=c.weight_type,
                    op_types_to_quantize=c.op_types_to_quantize, nodes_to_quantize=c.nodes_to_quantize,
                    nodes_to_exclude=c.nodes_to_exclude, per_channel=c.per_channel, reduce_range=c.reduce_range,
                    use_external_data_format=True, calibration_providers=c.calibration_providers,
                    extra_options=c.extra_options, calibration_cache_path=ranges)
    return out_path


def _matmul_weights(graph: Path) -> list[str]:
    """The initializers that are a MatMul's weight ([in, out]: per-channel along axis 1)."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    inits = {i.name for i in proto.graph.initializer}
    return sorted({n.input[1] for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits})


def compile_context(qdq_path: Path, ctx_path: Path, soc: Soc) -> list[str]:
    """Compile the QDQ graph offline into the EPContext model `ctx_path` + its QNN context binary;
    returns the binaries written."""
    import onnxruntime as ort

    before = set(ctx_path.parent.glob("*.bin"))
    try:
        ort.InferenceSession(str(qdq_path), qnn_session_options(soc, context_out=ctx_path))
    except Exception as e:  # QNN's messages are long; keep the first line
        raise UserError(f"QNN could not compile {qdq_path.name} for {soc.name} (HTP v{soc.htp_arch}): "
                        f"{str(e).splitlines()[0][:300]}") from None
    bins = sorted(p.name for p in set(ctx_path.parent.glob("*.bin")) - before)
    if not ctx_path.is_file() or not bins:
        raise UserError(f"QNN wrote no context binary for {soc.name}; is the whole graph supported by the HTP?")
    return bins


# ---- the pipeline --------------------------------------------------------------------------------------

# The modules whose source is part of the artefact cache's key (the graphs, the quantizer, the compiler's options).
CACHE_SOURCES = (*(Path(__file__).with_name(n) for n in ("qnn.py", "onnx_static.py", "onnx_export.py", "onnx_graph.py",
                                                          "onnx_weights.py")), Path(ort_ep.__file__))


@cached_export("qnn", CACHE_SOURCES)
def build_qnn(model: Transformer, out_dir: str | Path, *, soc: str = "sm8650", context: int = 1024, chunk: int = 64,
              scheme: QnnScheme | str = QnnScheme.A16W8, calibration: Sequence[Sequence[int]] | None = None,
              max_seq_len: int | None = None, keep_float: bool = False,
              progress: Callable[[str], None] | None = None, record_feeds: RecordFeeds,
              sink_token: int | None = None, sink_of: SinkOf | None = None) -> dict[str, Any]:
    """Float static graphs -> QDQ -> QNN context binaries in `out_dir`. Returns the artefact metadata,
    which `edgefinfer.runtime.backends.ort.open_qnn` reads to run them.

    context: cache slots, the tokens a query sees besides itself (a longer stream slides over them).
    chunk: tokens per call of the prompt processor, at most `context` (1: the token generator only).
    calibration: token streams the quantizer observes (default: one stream of pseudo-random ids,
        which is only fit for tests; pass real text for a real model).
    max_seq_len: RoPE positions in the graphs (default: the model's).
    record_feeds: runs the float graph over `calibration` and returns each call's inputs (the
        runtime's `recorded_feeds`).
    sink_token: a token whose float keys and values (`sink_of`: the runtime's `attention_sink`) fill
        cache slot 0 of every sequence, written to sink_kv.npy (None: no sink, every slot for the stream).
    """
    say = progress or (lambda _m: None)
    target = get_soc(soc)
    scheme = QnnScheme.parse(scheme)  # up front: the quantizer runs minutes later
    if chunk < 1 or context < 1:
        raise UserError(f"the QNN graphs need context >= 1 and chunk >= 1, got context={context}, chunk={chunk}")
    chunk = min(chunk, context)  # a call never takes more tokens than the cache holds
    if sink_token is not None and (sink_of is None or context < 2):
        raise UserError("an attention sink needs sink_of (the runtime's attention_sink) and context >= 2")
    require_qnn()  # fail before any work when the package is missing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in out.iterdir()}  # e.g. the bundle's tokenizer: not ours to list
    t0 = time.perf_counter()
    graphs = [(FLOAT_FILE, QDQ_FILE, CTX_FILE, 1)]
    if chunk > 1:  # calibrated first: its calls see whole chunks of text, the generator's ranges follow
        graphs.insert(0, (PROMPT_FLOAT_FILE, PROMPT_QDQ_FILE, PROMPT_CTX_FILE, chunk))
    meta: dict[str, Any] = {}
    for float_file, _, _, s in graphs:
        meta = export_static_decode(model, out / float_file, cache_slots=context, chunk=s, max_seq_len=max_seq_len)
    say(f"[qnn] static graphs: {', '.join(str(g[3]) for g in graphs)} token(s) per call over {context} cache slots "
        f"({time.perf_counter() - t0:.1f}s)")
    streams = calibration or [np.random.default_rng(0).integers(0, model.config.vocab_size, 64).tolist()]
    sink = None
    if sink_token is not None:
        sink = sink_of(out / graphs[0][0], sink_token)
        np.save(out / SINK_FILE, sink)
    feeds = record_feeds(out / graphs[0][0], streams, sink=sink)
    calibration_calls = len(feeds)
    ranges = out / CALIBRATION_FILE
    ranges.unlink(missing_ok=True)
    for float_file, qdq_file, _, _ in graphs:
        quantize_qdq(out / float_file, out / qdq_file, feeds, scheme, ranges=ranges)
        feeds = None  # the second graph reuses the first one's ranges
    say(f"[qnn] {scheme} QDQ from {calibration_calls} calibration calls "
        f"({time.perf_counter() - t0:.1f}s)")
    bins: dict[str, list[str]] = {}
    for _, qdq_file, ctx_file, _ in graphs:
        bins[ctx_file] = compile_context(out / qdq_file, out / ctx_file, target)
    say(f"[qnn] context binaries for {target.name} / HTP v{target.htp_arch} ({time.perf_counter() - t0:.1f}s)")
    ranges.unlink(missing_ok=True)
    if not keep_float:
        for float_file, *_ in graphs:
            for f in out.glob(float_file + "*"):
                f.unlink()
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in before)
    return {**{k: v for k, v in meta.items() if k != "chunk"}, "files": files, "context": context,
            "context_model": CTX_FILE, "qdq_model": QDQ_FILE,
            "prompt_context_model": PROMPT_CTX_FILE if chunk > 1 else None,
            "prompt_qdq_model": PROMPT_QDQ_FILE if chunk > 1 else None, "prompt_chunk": chunk,
            "context_binaries": sorted(b for v in bins.values() for b in v),
            "scheme": scheme, "calibration_calls": calibration_calls,
            "sink_kv": SINK_FILE if sink is not None else None, "sink_token": sink_token,
            "soc": target.name, "soc_model": target.soc_model, "htp_arch": target.htp_arch,
            "seconds": round(time.perf_counter() - t0, 2),
            "graph": ONNX_GRAPHS[read_spec("onnx", read_metadata(out / QDQ_FILE)).format]}

