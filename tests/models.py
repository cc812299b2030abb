"""Small models built with onnx.helper, shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.model.graph import ir_version_for, onnx_dtype


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[tuple[str, np.dtype | type, Sequence[int | str | None] | None]],
    outputs: Sequence[tuple[str, np.dtype | type, Sequence[int | str | None] | None]],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """A model from nodes, (name, dtype, shape) inputs/outputs and named initializer arrays."""
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, onnx_dtype(t), s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, onnx_dtype(t), s) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


def mlp(
    dtype: type = np.float64, seed: int = 0, n_in: int = 4, hidden: int = 5, n_out: int = 3
) -> onnx.ModelProto:
    """x -> Gemm -> Relu -> Gemm -> Sigmoid, batch dimension symbolic."""
    rng = np.random.default_rng(seed)
    inits = {
        "W1": rng.standard_normal((n_in, hidden)).astype(dtype),
        "b1": rng.standard_normal(hidden).astype(dtype),
        "W2": rng.standard_normal((hidden, n_out)).astype(dtype),
        "b2": rng.standard_normal(n_out).astype(dtype),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "W2", "b2"], ["z"], name="fc2"),
        helper.make_node("Sigmoid", ["z"], ["y"], name="sigmoid"),
    ]
    return make_model(nodes, [("x", dtype, ["N", n_in])], [("y", dtype, ["N", n_out])], inits)


def numpy_mlp_grads(model: onnx.ModelProto, x: np.ndarray, dy: np.ndarray) -> dict[str, np.ndarray]:
    """Reference gradients of :func:`mlp`, by hand in numpy."""
    p = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    h = x @ p["W1"] + p["b1"]
    r = np.maximum(h, 0)
    y = 1 / (1 + np.exp(-(r @ p["W2"] + p["b2"])))
    dz = dy * y * (1 - y)
    dr = dz @ p["W2"].T
    dh = dr * (h > 0)
    return {"W1": x.T @ dh, "b1": dh.sum(0), "W2": r.T @ dz, "b2": dz.sum(0), "x": dh @ p["W1"].T}


__all__ = ["TensorProto", "make_model", "mlp", "numpy_mlp_grads"]


_LOADS: dict[int, bool] = {}


def ort_loads_opset(opset: int) -> bool:
    """Whether the installed onnxruntime loads a model of this default-domain opset (1.32 loads 28;
    the oldest supported release does not), for skipping checks that run new ops on it."""
    if opset not in _LOADS:
        import onnxruntime as ort

        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            "probe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = ir_version_for(model.opset_import)
        try:
            ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            _LOADS[opset] = True
        except Exception:
            _LOADS[opset] = False
    return _LOADS[opset]
