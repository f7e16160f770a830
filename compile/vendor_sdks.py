"""Is a vendor SDK for an ExecuTorch back-end present? One-line answers, in milliseconds.

Each check returns None when the SDK is usable, or one line "missing X: how to get it". Nothing
heavy is imported: modules are looked up with `importlib.util.find_spec` (which imports at most
the parent package, e.g. the 1 ms `executorch/__init__`), files with `os.path`. Building a target
whose SDK is absent must fail before any export work (a lowering takes minutes).

    qnn_executorch   Qualcomm QNN SDK (QAIRT) for ExecuTorch's Qualcomm back-end: not on PyPI; the
                     `qnn` target goes through onnxruntime-qnn (PyPI) instead.
    mediatek         MediaTek NeuroPilot SDK: `mtk_converter` + `mtk_neuron`, not on PyPI.
    arm_ethos_u      Arm TOSA serializer (`tosa_serializer`, from Arm's tosa-tools, not on PyPI)
                     and the Ethos-U Vela compiler (`ethos-u-vela`, on PyPI).
    coreml           coremltools (installed with executorch); Core ML programs build on Linux but
                     only run on Apple devices.
    xnnpack          executorch + torchao (the CPU path; on PyPI).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

from edgefinfer.errors import UserError

QNN_HOST_LIB = Path("lib") / "x86_64-linux-clang" / "libQnnHtp.so"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that is absent or broken
        return False


def _missing_modules(*names: str) -> list[str]:
    return [n for n in names if not _has_module(n)]


def executorch_sdk() -> str | None:
    missing = _missing_modules("executorch", "torchao")
    if missing:
        return (f"missing {' and '.join(missing)} (ExecuTorch's XNNPACK path): "
                "pip install executorch==1.5.1 torchao==0.18.0")
    return None


def qnn_executorch_sdk() -> str | None:
    """The QNN SDK that ExecuTorch's QnnPartitioner needs at lowering time (libQnnHtp.so for x86 hosts)."""
    if base := executorch_sdk():
        return base
    root = os.environ.get("QNN_SDK_ROOT")
    if root and (Path(root) / QNN_HOST_LIB).is_file():
        return None
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        if (Path(folder) / "libQnnHtp.so").is_file():
            return None
    where = (f"QNN_SDK_ROOT={root} has no {QNN_HOST_LIB}" if root else "QNN_SDK_ROOT is not set")
    return (f"missing Qualcomm QNN SDK for ExecuTorch's Qualcomm back-end ({where}): download QAIRT (2.37+) "
            "from Qualcomm's software center, unzip it and set QNN_SDK_ROOT to its folder; it is not on PyPI "
            "(or build --target qnn, which uses onnxruntime-qnn from PyPI)")


def mediatek_sdk() -> str | None:
    if base := executorch_sdk():
        return base
    missing = _missing_modules("mtk_converter", "mtk_neuron")
    if missing:
        return (f"missing MediaTek NeuroPilot SDK ({', '.join(missing)}): download the NeuroPilot Express SDK from "
                "MediaTek's NeuroPilot portal and pip install its mtk_converter and mtk_neuron wheels; "
                "they are not on PyPI")
    return None


def arm_ethos_u_sdk() -> str | None:
    if base := executorch_sdk():
        return base
    if not _has_module("tosa_serializer"):
        return ("missing Arm TOSA serializer (tosa_serializer): install Arm's tosa-tools with ExecuTorch's "
                "examples/arm/setup.sh (it is not on PyPI)")
    if not _has_module("ethosu.vela"):
        return "missing Arm Ethos-U Vela compiler (ethosu.vela): pip install ethos-u-vela"
    return None


def coreml_sdk() -> str | None:
    if base := executorch_sdk():
        return base
    if not _has_module("coremltools"):
        return "missing coremltools (Core ML back-end): pip install coremltools==9.0"
    return None


SDK_CHECKS: dict[str, Callable[[], str | None]] = {
    "xnnpack": executorch_sdk,
    "coreml": coreml_sdk,
    "qnn_executorch": qnn_executorch_sdk,
    "mediatek": mediatek_sdk,
    "arm_ethos_u": arm_ethos_u_sdk,
}


def missing_sdk(delegate: str) -> str | None:
    """The reason `delegate`'s SDK is unusable here, or None."""
    if delegate not in SDK_CHECKS:
        raise UserError(f"unknown ExecuTorch delegate {delegate!r}: one of {', '.join(SDK_CHECKS)}")
    return SDK_CHECKS[delegate]()


def require_sdk(delegate: str) -> None:
    """Raise a one-line UserError when `delegate`'s SDK is not usable on this machine."""
    if (reason := missing_sdk(delegate)) is not None:
        raise UserError(reason)
