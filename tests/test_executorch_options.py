"""Fast checks (no lowering): vendor-SDK detection and export options refused up front."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgefinfer.compile import vendor_sdks
from edgefinfer.errors import UserError
from tests.helpers import tiny_model


@pytest.fixture
def no_qnn(monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)


def test_sdk_checks_are_instant_and_import_nothing_heavy():
    code = ("import time, sys; t = time.perf_counter(); from edgefinfer.compile.vendor_sdks import SDK_CHECKS; "
            "[f() for f in SDK_CHECKS.values()]; "
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'executorch.exir' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 0.5 and out[1:] == ["False", "False"], out


def test_mediatek_names_the_missing_modules_and_how_to_get_them():
    reason = vendor_sdks.missing_sdk("mediatek")
    assert reason.startswith("missing MediaTek NeuroPilot SDK (mtk_converter, mtk_neuron)")
    assert "not on PyPI" in reason and "\n" not in reason


def test_mediatek_is_found_when_its_modules_are_importable(tmp_path, monkeypatch):
    for name in ("mtk_converter", "mtk_neuron"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert vendor_sdks.missing_sdk("mediatek") is None


def test_qnn_sdk_needs_the_host_library(no_qnn, tmp_path, monkeypatch):
    assert "QNN_SDK_ROOT is not set" in vendor_sdks.missing_sdk("qnn_executorch")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path))
    reason = vendor_sdks.missing_sdk("qnn_executorch")
    assert f"QNN_SDK_ROOT={tmp_path} has no lib/x86_64-linux-clang/libQnnHtp.so" in reason
    assert "onnxruntime-qnn" in reason  # the PyPI alternative is named
    lib = tmp_path / vendor_sdks.QNN_HOST_LIB
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    assert vendor_sdks.missing_sdk("qnn_executorch") is None


def test_arm_names_tosa_serializer_first():
    reason = vendor_sdks.missing_sdk("arm_ethos_u")
    assert reason.startswith("missing Arm TOSA serializer (tosa_serializer)") and "setup.sh" in reason


def test_installed_sdks_pass_and_unknown_delegates_are_refused():
    pytest.importorskip("executorch")
    assert vendor_sdks.missing_sdk("xnnpack") is None
    assert vendor_sdks.missing_sdk("coreml") is None
    with pytest.raises(UserError, match="unknown ExecuTorch delegate 'vulkan'"):
        vendor_sdks.require_sdk("vulkan")
    with pytest.raises(UserError, match="missing MediaTek"):
        vendor_sdks.require_sdk("mediatek")


# ---- export options, refused before any lowering ------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe="int3"), "unknown ExecuTorch recipe 'int3'"),
    (dict(recipe="fp16"), "recipe fp16 is Core ML's"),
    (dict(recipe="8da4w", backend="coreml"), "Core ML builds use fp16 or fp32"),
    (dict(backend="vulkan"), "unknown ExecuTorch back-end"),
    (dict(embedding_4bit=True), "embedding_4bit goes with the quantized recipes"),
    (dict(recipe="8da4w", group_size=48), "group size 48 does not divide"),
    (dict(kv="window"), "kv='window' needs window=N"),
    (dict(kv="window", window=8, max_seq_len=64), "max_seq_len applies to kv='static'"),
    (dict(kv="window", window=8, lookahead=0), "lookahead must be >= 1"),
    (dict(kv="static", window=8), "apply to kv='window'"),
    (dict(kv="paged"), "unknown kv layout"),
    (dict(backend="coreml", custom_ops=True), "Core ML cannot delegate"),
    (dict(backend="coreml", kv="window", window=8), "kv='static' only"),
    (dict(kv="window", window=8, custom_ops=False), "custom ops only"),
])
def test_bad_options_fail_fast(kwargs, message, tmp_path):
    pytest.importorskip("executorch")
    from edgefinfer.compile.executorch_export import export_pte

    t = time.perf_counter()
    with pytest.raises(UserError, match=message):
        export_pte(tiny_model(), tmp_path / "m.pte", progress=False, cache=False, **kwargs)
    assert time.perf_counter() - t < 2
    assert not (tmp_path / "m.pte").exists()


def test_prequantized_models_must_match_and_fit_xnnpack(tmp_path):
    pytest.importorskip("torchao")
    from edgefinfer.compile.et_quant import quantize_for_xnnpack
    from edgefinfer.compile.executorch_export import resolve_options
    from edgefinfer.compile.quant import parse_recipe, quantize_model

    q = quantize_for_xnnpack(tiny_model(), "8da4w")
    assert resolve_options(q, recipe="8da4w").prequantized
    with pytest.raises(UserError, match="already quantized as 8da4w"):
        resolve_options(q, recipe="8da8w")
    weight_only = tiny_model()
    quantize_model(weight_only, parse_recipe("int4-g32"))
    with pytest.raises(UserError, match="quantize with 8da4w-g32"):
        resolve_options(weight_only, recipe="8da4w")
    fp8 = tiny_model()
    quantize_model(fp8, parse_recipe("fp8"))
    with pytest.raises(UserError, match="fp8"):
        resolve_options(fp8, recipe="8da4w")


def test_runtime_backend_does_not_import_the_compiler():
    code = ("import sys; import edgefinfer.runtime.backends.executorch as m; "
            "print(any(k.startswith('edgefinfer.compile') for k in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_missing_program_is_a_user_error(tmp_path: Path):
    pytest.importorskip("executorch")
    from edgefinfer.runtime.backends.executorch import ExecuTorchBackend

    with pytest.raises(UserError, match="does not exist"):
        ExecuTorchBackend(tmp_path / "nope.pte")
    (tmp_path / "junk.pte").write_bytes(b"not a program")
    with pytest.raises(UserError, match="not a loadable ExecuTorch program"):
        ExecuTorchBackend(tmp_path / "junk.pte")


def test_a_pte_bundle_registers_its_kernels_before_the_tokenizer_thread_starts():
    # torch's import is pure Python: started after the tokenizer.json parse, which holds the GIL, it would wait
    # for it. open_backend calls this before that thread. It registers the kernels with ExecuTorch's C++
    # runtime without ExecuTorch's Python wrappers, which import its exporter (exir, torch._inductor).
    from edgefinfer.runtime.engine import _import_runtime

    code = ("import sys; from edgefinfer.runtime.engine import _import_runtime; _import_runtime('executorch'); "
            "from executorch.extension.pybindings import _C; ops = set(_C._get_operator_names()); "
            "print({'llama::custom_sdpa.out', 'llama::update_cache.out', 'quantized_decomposed::embedding_4bit.out'}"
            " <= ops, sorted({m for m in sys.modules if m.startswith(('executorch.exir', 'torch._inductor', "
            "'torch._dynamo'))})[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out.splitlines()[-1] == "True []", out
    assert _import_runtime("torch") is None  # a backend without a separate runtime package: nothing to do


def test_kernel_libraries_are_found_in_the_package_or_left_to_their_modules(tmp_path: Path):
    # A layout without the shared object (another build of ExecuTorch): None, and register_kernels imports
    # the Python module instead, as before.
    from edgefinfer.runtime.backends.executorch import kernel_library

    first, second = tmp_path / "a", tmp_path / "b"
    (second / "kernels" / "quantized").mkdir(parents=True)
    assert kernel_library("kernels/quantized", "quantized_ops_aot_lib", [first, second]) is None
    (second / "kernels" / "quantized" / "libquantized_ops_aot_lib.pyi").write_text("")
    assert kernel_library("kernels/quantized", "quantized_ops_aot_lib", [first, second]) is None
    lib = second / "kernels" / "quantized" / "libquantized_ops_aot_lib.so"
    lib.write_bytes(b"")
    assert kernel_library("kernels/quantized", "quantized_ops_aot_lib", [first, second]) == lib
