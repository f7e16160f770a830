"""Qualcomm NPU (`--target qnn`): static decode graph -> QDQ quantization -> QNN HTP context binary.

    build_qnn(model, out_dir, soc="sm8650")
      1. `export_static_decode`: batch 1, one token, a W-slot window cache, finite mask (float)
      2. `quantize_qdq`: onnxruntime's QNN QDQ config (A16W8 by default, or A8W8), calibrated on the
         float graph's own decode-step inputs
      3. `compile_context`: the `onnxruntime-qnn` plugin EP compiles the whole graph offline into an
         EPContext model + QNN context binary for the SoC's HTP architecture
      -> model_qdq.onnx (runs anywhere ORT runs: CPU reference), model_ctx.onnx + *.bin (the phone)

The `onnxruntime-qnn` wheel also ships an x86 HTP emulator: `qnn_session(ctx_path, soc)` runs the
context model on it (about a second per token), which is how tests check the binary.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from edgefinfer.compile.onnx_graph import read_metadata
from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.errors import UserError
from edgefinfer.model import Transformer
from edgefinfer.runtime.backends.ort import qnn_context_session, require_qnn  # noqa: F401 (re-exported)
from edgefinfer.runtime.backends.ort import qnn_session_options as _qnn_session_options

FLOAT_FILE, QDQ_FILE, CTX_FILE = "model_float.onnx", "model_qdq.onnx", "model_ctx.onnx"


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
QUANT_SCHEMES = ("a16w8", "a8w8")


def get_soc(name: str) -> Soc:
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SOCS:
        known = ", ".join(f"{s.name} ({s.marketing}, v{s.htp_arch})" for s in SOCS.values())
        raise UserError(f"unknown Qualcomm SoC {name!r}: use one of {known}")
    return SOCS[key]


# ---- the plugin EP (the session helpers live in the runtime: a phone opens the context model too) ----

def qnn_session_options(soc: Soc, *, context_out: Path | None = None):
    return _qnn_session_options(soc.htp_arch, soc.soc_model, context_out)


def qnn_session(model_path: str | Path, soc: str | Soc):
    """A session on the QNN HTP backend for `soc` (the x86 emulator on a PC), e.g. for a context model."""
    soc = soc if isinstance(soc, Soc) else get_soc(soc)
    return qnn_context_session(model_path, soc.htp_arch, soc.soc_model)


# ---- QDQ quantization ---------------------------------------------------------------------------------

def calibration_feeds(float_path: Path, token_streams: Sequence[Sequence[int]], max_steps: int = 256
                      ) -> list[dict[str, np.ndarray]]:
    """Every decode-step input the float static graph sees while reading `token_streams` (teacher forced)."""
    from edgefinfer.runtime.backends.ort import OrtStaticBackend

    backend = OrtStaticBackend(float_path, threads=1)
    feeds: list[dict[str, np.ndarray]] = []
    run = backend.session.run

    def recording_run(names, feed):
        feeds.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return run(names, feed)

    backend.session.run = recording_run  # type: ignore[method-assign]
    for stream in token_streams:
        backend.reset()
        backend.forward(list(stream)[: max_steps - len(feeds)], 0)
        if len(feeds) >= max_steps:
            break
    return feeds


class _Feeds:
    """onnxruntime.quantization's CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def quantize_qdq(float_path: Path, out_path: Path, feeds: list[dict[str, np.ndarray]], scheme: str = "a16w8") -> Path:
    """A QDQ copy of the float graph for the QNN HTP: activations uint16 (a16w8) or uint8, weights uint8."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    if scheme not in QUANT_SCHEMES:
        raise UserError(f"unknown QNN quantization {scheme!r}: use one of {', '.join(QUANT_SCHEMES)}")
    if not feeds:
        raise UserError("QDQ calibration needs at least one token of calibration text")
    act = QuantType.QUInt16 if scheme == "a16w8" else QuantType.QUInt8
    config = get_qnn_qdq_config(str(float_path), _Feeds(feeds), activation_type=act, weight_type=QuantType.QUInt8)
    config.use_external_data_format = True
    quantize(str(float_path), str(out_path), config)
    return out_path


def compile_context(qdq_path: Path, out_dir: Path, soc: Soc) -> dict[str, Any]:
    """Compile the QDQ graph offline into `out_dir/model_ctx.onnx` + its QNN context binary."""
    import onnxruntime as ort

    ctx = out_dir / CTX_FILE
    try:
        ort.InferenceSession(str(qdq_path), qnn_session_options(soc, context_out=ctx))
    except Exception as e:  # QNN's messages are long; keep the first line
        raise UserError(f"QNN could not compile {qdq_path.name} for {soc.name} (HTP v{soc.htp_arch}): "
                        f"{str(e).splitlines()[0][:300]}") from None
    bins = sorted(p.name for p in out_dir.glob("*.bin"))
    if not ctx.is_file() or not bins:
        raise UserError(f"QNN wrote no context binary for {soc.name}; is the whole graph supported by the HTP?")
    return {"context_model": ctx.name, "context_binaries": bins}


# ---- the pipeline --------------------------------------------------------------------------------------

def build_qnn(model: Transformer, out_dir: str | Path, *, soc: str = "sm8650", cache_slots: int = 63,
              scheme: str = "a16w8", calibration: Sequence[Sequence[int]] | None = None,
              max_seq_len: int | None = None, keep_float: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Float static graph -> QDQ -> QNN context binary in `out_dir`. Returns the artefact metadata
    (on the phone: `OrtStaticBackend(ctx, session=qnn_context_session(ctx, htp_arch, soc_model))`).

    calibration: token streams the quantizer observes (default: one stream of pseudo-random ids,
        which is only fit for tests; pass real text for a real model).
    """
    say = progress or (lambda _m: None)
    target = get_soc(soc)
    require_qnn()  # fail before any work when the package is missing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    float_path = out / FLOAT_FILE
    meta = export_static_decode(model, float_path, cache_slots=cache_slots, max_seq_len=max_seq_len)
    say(f"[qnn] static decode graph: {cache_slots} cache slots ({time.perf_counter() - t0:.1f}s)")
    streams = calibration or [np.random.default_rng(0).integers(0, model.config.vocab_size, 64).tolist()]
    feeds = calibration_feeds(float_path, streams)
    quantize_qdq(float_path, out / QDQ_FILE, feeds, scheme)
    say(f"[qnn] {scheme} QDQ from {len(feeds)} calibration steps ({time.perf_counter() - t0:.1f}s)")
    ctx = compile_context(out / QDQ_FILE, out, target)
    say(f"[qnn] context binary for {target.name} / HTP v{target.htp_arch} ({time.perf_counter() - t0:.1f}s)")
    if not keep_float:
        for f in out.glob(FLOAT_FILE + "*"):
            f.unlink()
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    return {**meta, **ctx, "files": files, "qdq_model": QDQ_FILE, "scheme": scheme, "soc": target.name,
            "soc_model": target.soc_model, "htp_arch": target.htp_arch, "calibration_steps": len(feeds),
            "seconds": round(time.perf_counter() - t0, 2),
            "graph": read_metadata(out / QDQ_FILE).get("edgefinfer.graph")}


def copy_artefacts(src: Path, dest: Path) -> list[str]:
    """Copy a build's runtime files (context model, binaries, QDQ model) into a bundle folder."""
    names = [p.name for p in src.iterdir() if p.is_file() and not p.name.startswith(FLOAT_FILE)]
    for n in names:
        shutil.copyfile(src / n, dest / n)
    return sorted(names)
