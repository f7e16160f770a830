"""`--target mediatek`: ExecuTorch's NeuroPilot path, wired as MediaTek's own flow does it.

MediaTek's SDK (mtk_converter, mtk_neuron) is not on PyPI, so ExecuTorch's NeuropilotPartitioner
cannot run here. These tests give its package importable empty SDK modules, run the real
NeuropilotQuantizer (pt2e, needs only torchao), and replace the partitioner alone by a recorder
that keeps what the exporter hands it and delegates nothing. The program it was given is then run
as a graph module, to check that the quantized graph computes the model.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from edgefinfer.errors import UserError
from tests.helpers import tiny_model

pytest.importorskip("executorch")
from executorch.exir.backend.partitioner import Partitioner, PartitionResult  # noqa: E402


@pytest.fixture
def fake_sdk(tmp_path, monkeypatch):
    """Empty mtk_converter / mtk_neuron packages (enough for `executorch.backends.mediatek` to import)."""
    pkg = tmp_path / "mtk_converter" / "python" / "converters" / "pytorch"
    pkg.mkdir(parents=True)
    for folder in (tmp_path / "mtk_converter", pkg.parent.parent, pkg.parent, pkg):
        (folder / "__init__.py").write_text("")
    (pkg / "importer_v2.py").write_text("def is_fx_node_supported(node):\n    return True\n")
    (tmp_path / "mtk_neuron").mkdir()
    (tmp_path / "mtk_neuron" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sdk = ("mtk_converter", "mtk_neuron", "executorch.backends.mediatek")
    for name in [m for m in sys.modules if m.startswith(sdk)]:
        del sys.modules[name]  # later tests must see the SDK missing again


class RecordingPartitioner(Partitioner):
    """Stands in for NeuropilotPartitioner: records its compile specs and the graph it is offered."""

    seen: list["RecordingPartitioner"] = []

    def __init__(self, compile_spec, op_types_to_skip=None, op_names_to_skip=None):
        super().__init__()
        self.specs = {s.key: s.value for s in compile_spec}
        self.ops: set[str] = set()
        self.inputs: list[tuple[int, ...]] = []
        self.quant_dtypes: set[str] = set()
        RecordingPartitioner.seen.append(self)

    def partition(self, ep):
        for node in ep.graph.nodes:
            if node.op == "call_function":
                name = getattr(node.target, "__name__", str(node.target))  # e.g. aten.mm.default
                self.ops.add(name)
                if name.startswith("quantized_decomposed.") and "quantize_per_" in name:  # Q and DQ
                    self.quant_dtypes.add(f"{name.split('.')[1].split('_per_')[1]} {node.args[-1]}")
        user_inputs = set(ep.graph_signature.user_inputs)
        self.inputs = [tuple(n.meta["val"].shape) for n in ep.graph.nodes if n.op == "placeholder"
                       and n.name in user_inputs]
        return PartitionResult(tagged_exported_program=ep, partition_tags={})  # delegates nothing


def test_neuropilot_wiring(tmp_path, fake_sdk, monkeypatch):
    import executorch.backends.mediatek as mediatek

    from edgefinfer.compile.executorch_export import export_pte

    import edgefinfer.compile.executorch_export as exporter

    monkeypatch.setattr(mediatek, "NeuropilotPartitioner", RecordingPartitioner)
    quantized, quantize = [], exporter._neuropilot_quantize  # keep the program that goes to lowering
    monkeypatch.setattr(exporter, "_neuropilot_quantize", lambda *a: quantized.append(quantize(*a)) or quantized[0])
    RecordingPartitioner.seen.clear()
    model = tiny_model(vocab_size=64, max_position_embeddings=32)
    rng = np.random.default_rng(0)
    calibration = [rng.integers(0, 64, 24).tolist() for _ in range(2)]
    meta = export_pte(model, tmp_path / "model.pte", recipe="qdq-a16w8", backend="neuropilot", max_seq_len=32,
                      calibration=calibration, platform="mt6991", progress=False, cache=False)

    [rec] = RecordingPartitioner.seen
    assert rec.specs == {"platform-config": b"mt6991", "gno": b"LTS", "gno-exp": b"", "gno-non-4d-tiling": b""}
    assert rec.inputs == [(1, 1), (1,)]  # fixed shapes: one token per call, its position
    assert not any("llama." in op for op in rec.ops)  # no ExecuTorch custom ops: the delegate cannot take them
    # A16W8 by NeuropilotQuantizer: int16 activations, int8 per-channel weights
    assert rec.quant_dtypes == {"tensor torch.int16", "channel torch.int8"}
    assert (meta["delegate"], meta["recipe"], meta["kv"]["max_chunk"]) == ("neuropilot", "qdq-a16w8", 1)
    assert meta["methods"]["get_max_seq_len"] == 1 and meta["methods"]["get_max_context_len"] == 32

    # The quantized program that went to lowering must still compute the model (to within A16W8 error).
    # It runs here as a graph module: ExecuTorch's portable kernels have no int16 quantize.
    program = quantized[0].module()
    tokens = calibration[0][:8]
    with torch.no_grad():
        ref = model(torch.tensor([tokens]))[0].numpy()
        got = np.concatenate([program(torch.tensor([[t]]), torch.tensor([i]))[0].numpy()
                              for i, t in enumerate(tokens)])
    assert np.abs(got - ref).max() < 0.1 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(recipe="8da4w"), "recipe '8da4w' is not a NeuroPilot recipe: use one of qdq-a16w8"),
    (dict(recipe="qdq-a16w8", platform="mt6985"), "unknown MediaTek platform 'mt6985'"),
    (dict(recipe="qdq-a16w8", kv="window", window=8), "kv='static' only"),
])
def test_neuropilot_options_are_checked_up_front(fake_sdk, kwargs, message):
    from edgefinfer.compile.executorch_export import resolve_options

    with pytest.raises(UserError, match=message):
        resolve_options(tiny_model(vocab_size=64), backend="neuropilot", **kwargs)


def test_without_the_sdk_neuropilot_is_refused_before_any_work():
    from edgefinfer.compile.executorch_export import resolve_options

    with pytest.raises(UserError, match=r"missing MediaTek NeuroPilot SDK \(mtk_converter, mtk_neuron\)"):
        resolve_options(tiny_model(vocab_size=64), recipe="qdq-a16w8", backend="neuropilot")
