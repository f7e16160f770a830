"""Build targets: what each device family runs, how it is quantized, and what the build needs.

A target names its artefact format, default quantization recipe and runtime backend. Its
requirements are checked up front, before any work: a missing vendor SDK fails in well under a
second with the SDK's name and how to get it.

Default recipes are quality-first: the smallest recipe whose artefact, measured by its own runtime
on the test split (for android also on the held-out domains of both reference models), stays within
+5% perplexity of the float model (bench/results/build.json; the
candidates are `edgefinfer.app.build.CANDIDATES`, `--quality-budget 5` re-derives the choice for any
model). The shipped SmolLM2-135M was distributed as GGUF Q4_1 (16 levels per group of 32 from a float
minimum), so a 4-bit grid with a float zero point (`-fzp`) holds its weights as they are, while
symmetric or integer-zero-point grids re-round them (+12% to +28%, even with GPTQ). The defaults:
android / linux-arm64 8da4w-g32-fzp-outliers16 (XNNPACK's int4 kernel on the symmetric part, a float
linear for the group offsets, int8 dynamic activations except 16 float outlier channels per decoder
linear: the plain 8da4w-g32-fzp held SmolLM2 within +2.5% on every held-out domain but left Gemma 3
270M's bible text at +7.8%; the float channels bring both within +3.6% at 0.89-0.96x its decode speed,
bench/results/int8_activations.json, where -outliers4 left Gemma's bible at +4.7%, no margin; the 8-bit
8da8w was +1.8% at 1.4x the size), linux-x86_64 int4-g32-fzp (MatMulNBits plus group
offsets, +0.3% measured by ONNX Runtime), gpu-server llama.cpp's own Q4_1 (`llamacpp-q4_1`, +0.4%),
or, for weights converted from a GGUF, that GGUF's own type (Gemma 3 270M: Q4_K_M; see
`edgefinfer.app.build.default_recipe`).
On a model that never saw a 4-bit grid these figures would not hold (bench/quantize.py reports a
distilled student beside the reference), and `--quality-budget` measures the candidates again.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

from edgefinfer.errors import UserError


@dataclass(frozen=True)
class Requirement:
    """A Python module that must be importable (or an environment variable set) to build a target."""

    what: str  # human name, e.g. "ExecuTorch"
    module: str | None = None
    env: str | None = None
    how: str = ""

    def missing(self) -> str | None:
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return f"{self.what} is not installed ({self.how})"
        if self.env is not None and not os.environ.get(self.env):
            return f"{self.what} was not found: set {self.env} ({self.how})"
        return None


EXECUTORCH = Requirement("ExecuTorch", "executorch", how="pip install 'edgefinfer[compile]' or executorch==1.5.1")
TORCHAO = Requirement("torchao", "torchao", how="pip install torchao==0.18.0")
COREMLTOOLS = Requirement("coremltools", "coremltools", how="pip install coremltools==9.0 (comes with executorch)")
ONNXRUNTIME = Requirement("ONNX Runtime", "onnxruntime", how="pip install onnxruntime==1.31.1")
ONNX = Requirement("onnx", "onnx", how="pip install onnx")
ORT_QNN = Requirement("onnxruntime-qnn (Qualcomm QNN execution provider)", "onnxruntime_qnn",
                      how="pip install onnxruntime-qnn==2.7.0")
MEDIATEK = Requirement("MediaTek NeuroPilot SDK (mtk_converter)", "mtk_converter",
                       how="install mtk_converter and mtk_neuron from MediaTek's NeuroPilot SDK; they are not on PyPI")
GGUF = Requirement("gguf", "gguf", how="pip install gguf==0.19.0")
# llama.cpp's quantizer (the default gpu-server recipe) and runtime (to measure the file).
LLAMA_CPP = Requirement("llama-cpp-python", "llama_cpp", how="pip install 'edgefinfer[llamacpp]'")


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    format: str  # pte | onnx | qnn-context | gguf
    backend: str  # executorch | onnxruntime | llamacpp
    recipe: str  # default quantization recipe (see edgefinfer.compile.quant)
    delegate: str | None = None  # xnnpack | coreml | qnn | neuropilot
    requires: tuple[Requirement, ...] = field(default_factory=tuple)
    runs_here: bool = True  # can this x86-64 Linux host execute the artefact (for measuring it)?

    def missing(self) -> list[str]:
        return [m for r in self.requires if (m := r.missing()) is not None]

    def check(self) -> None:
        """Raise a one-line UserError if the target cannot be built on this machine."""
        missing = self.missing()
        if missing:
            raise UserError(f"target {self.name!r} cannot be built here: {'; '.join(missing)}")


# The XNNPACK default: 4-bit weights on float-zero-point grids, int8 dynamic activations except for the 16
# input channels per decoder linear with the largest calibration magnitudes, which stay float (LLM.int8()'s
# decomposition, fixed at build time: `edgefinfer.compile.quant.outliers`).
ANDROID_RECIPE = "8da4w-g32-fzp-outliers16"

TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("android", "Android phones: ExecuTorch .pte on the CPU via XNNPACK, 8-bit dynamic activations "
           "with 4-bit groupwise weights and float zero points, 16 float outlier channels per linear (8-bit per-channel: "
           "--recipe 8da8w)", "pte",
           "executorch", ANDROID_RECIPE, "xnnpack", (EXECUTORCH, TORCHAO)),
    Target("ios", "iPhones: ExecuTorch .pte delegated to Core ML (ANE/GPU/CPU), fp16", "pte", "executorch", "fp16",
           "coreml", (EXECUTORCH, COREMLTOOLS), runs_here=False),
    Target("coreml", "Macs with Core ML: ExecuTorch .pte delegated to Core ML, fp16", "pte", "executorch", "fp16",
           "coreml", (EXECUTORCH, COREMLTOOLS), runs_here=False),
    Target("linux-arm64", f"ARM64 Linux boards (Raspberry Pi, Jetson CPU): ExecuTorch .pte via XNNPACK, "
           f"{ANDROID_RECIPE}", "pte", "executorch", ANDROID_RECIPE, "xnnpack", (EXECUTORCH, TORCHAO)),
    Target("linux-x86_64", "x86-64 Linux: ONNX Runtime CPU, int4 MatMulNBits with float zero points as group "
           "offsets (int8: --recipe int8)", "onnx", "onnxruntime", "int4-g32-fzp", None, (ONNX, ONNXRUNTIME)),
    Target("qnn", "Qualcomm Snapdragon NPUs (HTP): ONNX Runtime QNN context binary, QDQ A16W8, static shapes",
           "qnn-context", "onnxruntime", "qdq-a16w8", "qnn", (ONNX, ONNXRUNTIME, ORT_QNN), runs_here=True),
    Target("mediatek", "MediaTek APUs (Dimensity): ExecuTorch .pte delegated to NeuroPilot, static A16W8 "
           "(NeuropilotQuantizer)", "pte", "executorch", "qdq-a16w8", "neuropilot", (EXECUTORCH, MEDIATEK),
           runs_here=False),
    Target("gpu-server", "GPU servers: llama.cpp GGUF for edgefinfer serve (CUDA build of llama-cpp-python), Q4_1 by "
           "llama.cpp's quantizer (weights from a GGUF keep its type)", "gguf", "llamacpp", "llamacpp-q4_1", None, (GGUF, LLAMA_CPP)),
]}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise UserError(f"unknown target {name!r}; choose one of: {', '.join(TARGETS)}")
    return TARGETS[name]
