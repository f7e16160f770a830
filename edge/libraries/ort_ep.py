"""ONNX Runtime, guarded, and its Qualcomm QNN plugin execution provider (`onnxruntime-qnn`).

Both sides of the qnn target open QNN sessions: the exporter compiles a QDQ graph into a context
binary by creating a session (`edgefinfer.compile.qnn`), and the runtime opens that context model on
the phone (`edgefinfer.runtime.backends.ort.open_qnn`). The helpers live here, below both, because an
exporter may not import the runtime and the runtime may not import an exporter.
"""

from __future__ import annotations

from pathlib import Path

from edgefinfer.errors import UserError
from edgefinfer.libraries.quiet import quiet_ort

QNN_PACKAGE, QNN_VERSION, QNN_EP = "onnxruntime-qnn", "2.7.0", "QNNExecutionProvider"


def import_ort():
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - onnxruntime is a declared dependency
        raise UserError("the ONNX backend needs onnxruntime: pip install onnxruntime") from e
    quiet_ort(ort)
    return ort


def require_qnn():
    """The `onnxruntime_qnn` module, its EP library registered with onnxruntime (once per process)."""
    try:
        import onnxruntime_qnn
    except ImportError:
        raise UserError(f"the qnn target needs the {QNN_PACKAGE} package (Qualcomm's ONNX Runtime EP with the QNN "
                        f"HTP libraries): pip install {QNN_PACKAGE}=={QNN_VERSION}") from None
    ort = import_ort()
    if not any(d.ep_name == QNN_EP for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
    return onnxruntime_qnn


def qnn_session_options(htp_arch: int, soc_model: int, context_out: str | Path | None = None):
    """Session options that put the whole graph on the QNN HTP backend (no CPU fallback); with
    `context_out`, creating a session compiles the graph into that EPContext model + binary."""
    ort = import_ort()
    require_qnn()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context_out is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_out))
        so.add_session_config_entry("ep.context_embed_mode", "0")  # the binary beside the model, not inside
    # An fp32 graph or a missing htp_arch/soc_model fails inside QNN with QNN_COMMON_ERROR_MEM_ALLOC.
    so.add_provider_for_devices(devices, {"backend_type": "htp", "htp_arch": str(htp_arch),
                                          "soc_model": str(soc_model)})
    return so


def qnn_context_session(model_path: str | Path, htp_arch: int, soc_model: int):
    """A session on a QNN context model (on a PC: the x86 HTP emulator). It must be opened with the
    provider options it was compiled for: `providers=[...]` fails with "EPContext node not compatible"."""
    return import_ort().InferenceSession(str(model_path), qnn_session_options(htp_arch, soc_model))
