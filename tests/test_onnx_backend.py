"""OrtBackend: the Backend contract, its errors, and that the runtime never needs the exporter."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edgefinfer.compile.onnx_export import export_onnx
from edgefinfer.compile.onnx_static import export_static_decode
from edgefinfer.errors import UserError
from edgefinfer.runtime.backends.base import Backend
from edgefinfer.runtime.backends.ort import OrtBackend, OrtStaticBackend
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_model(vocab_size=128, max_position_embeddings=32, sliding_window=6)
    folder = tmp_path_factory.mktemp("onnx")
    export_onnx(model, folder)
    return model, folder


def test_backend_contract(exported):
    model, folder = exported
    backend = OrtBackend(folder, threads=1)
    assert isinstance(backend, Backend)
    assert (backend.name, backend.vocab_size, backend.max_seq_len, backend.window) == ("onnxruntime", 128, 32, 6)
    logits = backend.forward([1, 2, 3], 0)
    assert logits.shape == (3, 128) and logits.dtype == np.float32
    step = backend.forward([4], 3)
    assert step.shape == (1, 128)
    # The returned decode logits are a copy: the next step must not change them.
    kept = step.copy()
    backend.forward([5], 4)
    assert np.array_equal(step, kept)
    assert backend.forward([], 5).shape == (0, 128)


def test_limits_are_user_errors(exported, tmp_path):
    _, folder = exported
    backend = OrtBackend(folder, threads=1)
    with pytest.raises(UserError, match="KV buffer holds 32"):
        backend.forward(list(range(30)), 5)
    with pytest.raises(UserError, match="no ONNX model"):
        OrtBackend(tmp_path / "nothing-here")
    static = tiny_model(vocab_size=128, max_position_embeddings=32)
    export_static_decode(static, tmp_path / "static" / "model.onnx", cache_slots=4)
    with pytest.raises(UserError, match="OrtStaticBackend"):
        OrtBackend(tmp_path / "static")
    with pytest.raises(UserError, match="not a static decode graph"):
        OrtStaticBackend(folder)


def test_runtime_does_not_import_the_exporter(exported):
    """A phone has no exporter: loading and running the backend must not import edgefinfer.compile."""
    _, folder = exported
    code = ("import sys\n"
            "from edgefinfer.runtime.backends.ort import OrtBackend\n"
            f"OrtBackend({str(folder)!r}, threads=1).forward([1, 2], 0)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('edgefinfer.compile') or m == 'torch')\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
