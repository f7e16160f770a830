"""A small builder for ONNX graphs written node by node (onnx-ir underneath).

The exporters emit their graphs directly instead of tracing the torch model and hoping ONNX Runtime
fuses the result: tracing produces hundreds of elementwise nodes that ORT does not fuse back into
its contrib kernels (GroupQueryAttention, SkipSimplifiedLayerNormalization, MatMulNBits), and the
decode loop then runs ~3x slower. Writing the graph by hand makes the fused form the only form.

Why onnx-ir rather than `onnx.helper`: values are objects (wiring is by reference, not by string
names that can silently collide), numpy weights are wrapped without a copy, and `ir.save` streams
initializers to an external-data file, so a multi-GB model never has to fit a 2 GB protobuf.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx_ir as ir

OPSET = 21  # ONNX domain; 21 has int16/uint16 QuantizeLinear (needed by the QNN A16W8 path)
MS_DOMAIN = "com.microsoft"
DATA_FILE_SUFFIX = ".data"  # model.onnx -> model.onnx.data

Dim = int | str | None

_NP_TO_IR = {
    np.dtype(np.float32): ir.DataType.FLOAT,
    np.dtype(np.float16): ir.DataType.FLOAT16,
    np.dtype(np.int64): ir.DataType.INT64,
    np.dtype(np.int32): ir.DataType.INT32,
    np.dtype(np.uint8): ir.DataType.UINT8,
    np.dtype(np.int8): ir.DataType.INT8,
}


def ir_dtype(dtype: np.dtype | type) -> ir.DataType:
    return _NP_TO_IR[np.dtype(dtype)]


class GraphBuilder:
    """Collects inputs, initializers, nodes and outputs; `model()` assembles an `ir.Model`.

    Node outputs are named `<scope>/<name>` so that a graph viewer shows the layer structure.
    """

    def __init__(self, opset: int = OPSET):
        self.opset = opset
        self.graph = ir.Graph([], [], nodes=[], opset_imports={"": opset, MS_DOMAIN: 1}, name="edgefinfer")
        self.tape = ir.tape.Tape(self.graph)
        self._consts: dict[str, ir.Value] = {}
        self.scope = ""

    # ---- graph interface ---------------------------------------------------------------------
    def input(self, name: str, dtype: ir.DataType, shape: Sequence[Dim]) -> ir.Value:
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        self.graph.inputs.append(value)
        return value

    def output(self, value: ir.Value, name: str, dtype: ir.DataType, shape: Sequence[Dim]) -> None:
        value.name = name
        value.type = ir.TensorType(dtype)
        value.shape = ir.Shape(shape)
        self.graph.outputs.append(value)

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer (wrapped, not copied). Re-using a name returns the existing value."""
        if name in self._consts:
            return self._consts[name]
        array = np.ascontiguousarray(array)
        value = self.tape.initializer(ir.Tensor(array, dtype=ir_dtype(array.dtype), name=name), name=name)
        self._consts[name] = value
        return value

    def scalar_i64(self, *values: int) -> ir.Value:
        """A shared int64 1-D constant (axes, shapes, split sizes)."""
        key = "const_i64_" + "_".join(str(v).replace("-", "m") for v in values)
        return self.const(key, np.array(values, dtype=np.int64))

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], name: str, *, domain: str = "",
           num_outputs: int = 1, **attributes: Any) -> Any:
        """Add a node; returns its output value, or a tuple when `num_outputs` > 1."""
        full = f"{self.scope}/{name}" if self.scope else name
        attrs = {k: v for k, v in attributes.items() if v is not None}
        if num_outputs == 1:
            out = self.tape.op(op_type, list(inputs), attrs, domain=domain, name=full)
            out.name = f"{full}/out"
            return out
        outs = self.tape.op_multi_out(op_type, list(inputs), attrs, num_outputs=num_outputs, domain=domain,
                                      name=full)
        for i, o in enumerate(outs):
            o.name = f"{full}/out{i}"
        return tuple(outs)

    def model(self, metadata: dict[str, str] | None = None) -> ir.Model:
        return ir.Model(self.graph, ir_version=10, producer_name="edgefinfer", metadata_props=dict(metadata or {}))


def save_model(model: ir.Model, path: Path) -> list[Path]:
    """Write `path` and its external-data file (always, so the layout does not depend on size).

    Returns the files written, model first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + DATA_FILE_SUFFIX)
    ir.save(model, path, external_data=data.name, size_threshold_bytes=1024)
    return [path] + ([data] if data.exists() else [])


def read_metadata(path: Path) -> dict[str, str]:
    """The model's metadata_props, without loading its weights."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    return {p.key: p.value for p in proto.metadata_props}
