"""The Qualcomm NPU path: static decode graph, QDQ, QNN context binary run on the x86 HTP emulator.

The emulator test builds and runs a 2-layer model end to end in ~5 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import onnx
import pytest

from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.compile.qnn import build_qnn, get_soc, qnn_session, require_qnn
from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.ort import OrtStaticBackend
from edgefinfer.runtime.backends.torch_eager import TorchBackend
from tests.helpers import tiny_model

VOCAB = 256
HAS_QNN = importlib.util.find_spec("onnxruntime_qnn") is not None


@pytest.mark.parametrize("kw", [dict(), dict(model_type="qwen2", qkv_bias=True)])
def test_static_graph_matches_eager_window_attention(tmp_path, kw):
    """An 8-token window run 3x past its length; 2 spare slots make a 2-token rollback exact."""
    model = tiny_model(vocab_size=VOCAB, max_position_embeddings=64, **kw)
    meta = export_static_decode(model, tmp_path / "model.onnx", cache_slots=7)
    assert meta["window"] == 8  # 7 slots + the token itself
    meta = export_static_decode(model, tmp_path / "model.onnx", cache_slots=9, window=8)
    ours, ref = OrtStaticBackend(tmp_path, threads=1), TorchBackend(model, window=8)
    assert ours.window == 8 and ours.slots == 9
    tokens = np.random.default_rng(0).integers(0, VOCAB, 24).tolist()
    assert np.abs(ours.forward(tokens[:20], 0) - ref.forward(tokens[:20], 0)).max() < 1e-4  # measured 4e-6
    ours.rollback(18)
    assert np.abs(ours.forward(tokens[18:], 18) - ref.forward(tokens[18:], 18)).max() < 1e-4
    proto = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)  # standard ops only
    assert all(d.dim_value > 0 for i in proto.graph.input for d in i.type.tensor_type.shape.dim)  # static


@pytest.mark.skipif(not HAS_QNN, reason="needs onnxruntime-qnn")
@pytest.mark.parametrize("scheme,tol_htp,tol_float", [("a16w8", 0.3, 0.5), ("a8w8", 0.8, 1.5)])
def test_context_binary_on_htp_emulator(tmp_path, scheme, tol_htp, tol_float):
    model = tiny_model(vocab_size=VOCAB, max_position_embeddings=64)
    rng = np.random.default_rng(0)
    calibration = [rng.integers(0, VOCAB, 24).tolist() for _ in range(4)]
    meta = build_qnn(model, tmp_path, soc="sm8650", cache_slots=15, scheme=scheme, calibration=calibration,
                     keep_float=True)
    assert (meta["soc_model"], meta["htp_arch"]) == (57, 75)
    ctx = onnx.load(str(tmp_path / meta["context_model"]), load_external_data=False)
    assert [n.op_type for n in ctx.graph.node] == ["EPContext"]  # the whole graph runs on the HTP
    assert meta["context_binaries"] and (tmp_path / meta["context_binaries"][0]).stat().st_size > 10_000

    tokens = calibration[0][:4]  # ~10-30 ms per token on the emulator for this model
    htp = OrtStaticBackend(tmp_path / "model_ctx.onnx", session=qnn_session(tmp_path / "model_ctx.onnx", "sm8650"))
    qdq = OrtStaticBackend(tmp_path / "model_qdq.onnx", threads=1)
    flt = OrtStaticBackend(tmp_path / "model_float.onnx", threads=1)
    a, b, c = htp.forward(tokens, 0), qdq.forward(tokens, 0), flt.forward(tokens, 0)
    # Measured (logit std 1.2): a16w8 HTP vs CPU QDQ 0.09, QDQ vs float 0.15; a8w8 0.29 / 0.54.
    assert np.abs(a - b).max() < tol_htp
    assert np.abs(b - c).max() < tol_float
    assert (a.argmax(-1) == b.argmax(-1)).all() and (b.argmax(-1) == c.argmax(-1)).all()


def test_missing_package_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # makes `import onnxruntime_qnn` fail
    with pytest.raises(UserError, match=r"pip install onnxruntime-qnn==2\.7\.0"):
        require_qnn()
    with pytest.raises(UserError, match="onnxruntime-qnn"):
        build_qnn(tiny_model(vocab_size=VOCAB), "/nonexistent/never-written", soc="sm8650")


def test_socs():
    assert (get_soc("SM8650").htp_arch, get_soc("sm-8750").soc_model) == (75, 69)
    with pytest.raises(UserError, match="unknown Qualcomm SoC 'sm9999'.*sm8650 \\(Snapdragon 8 Gen 3, v75\\)"):
        get_soc("sm9999")
