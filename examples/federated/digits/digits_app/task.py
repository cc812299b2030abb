"""The model and each node's data: the same MLP on every machine (built from a seed), and a non-IID
part of scikit-learn's digits per SuperNode (``--node-config "partition-id=I num-partitions=N"``):
node ``I`` holds the classes ``c`` with ``c % N == I`` of the training split."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def model(seed: int = 0) -> onnx.ModelProto:
    """x (N, 64) -> Gemm -> Relu -> Gemm -> logits (N, 10)."""
    rng = np.random.default_rng(seed)
    weights = {
        "W1": (rng.normal(size=(64, 64)) / 8).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "W2": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["x", "W1", "b1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"]),
        ],
        "digits_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    return proto


def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features scaled to [0, 1], labels, and a fixed permutation (its first 300: held out)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64), np.random.default_rng(0).permutation(len(x))


def partition(partition_id: int, num_partitions: int) -> dict[str, np.ndarray]:
    """The training examples of one node: the classes ``c % num_partitions == partition_id``."""
    x, y, order = _digits()
    train = order[300:]
    mine = train[y[train] % num_partitions == partition_id]
    return {"x": x[mine], "target": y[mine]}


def held_out() -> dict[str, np.ndarray]:
    """The 300 examples no node trains on (the server's evaluation)."""
    x, y, order = _digits()
    return {"x": x[order[:300]], "target": y[order[:300]]}
