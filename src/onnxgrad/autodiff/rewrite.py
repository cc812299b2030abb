"""Rewrites of the forward graph that keep every value the model computes and make its gradient
cheaper. They run on the model before differentiation.

- ``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``: ReLU is monotonic, so both give the same
  values and pick the same window elements, but ReLU (and its gradient mask) then runs on the
  pooled tensor, 4x smaller for the usual 2x2 pool, and the full-size activation is not saved for
  the backward. Conv-ReLU-MaxPool is the building block of most CNNs.

Measured and left out: ``MatMul(x, W) + b`` (+ ReLU) on a batch of sequences as one ``Gemm``
between reshapes (what onnxruntime does itself when every dim is static). onnxruntime's Gemm
writes the broadcast bias first and accumulates onto it, and applies the ReLU in a second pass: the
anchor transformer's forward took 19.7 ms with it, 18.9 ms without.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper

from .graph import all_names, node_operands, unique_name


def rewrite_for_training(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with the rewrites above applied to its main graph,
    whose nodes must be in topological order (they stay so)."""
    _relu_after_max_pool(model.graph, all_names(model.graph))
    return model


def _relu_after_max_pool(graph: onnx.GraphProto, taken: set[str]) -> None:
    uses = Counter(name for node in graph.node for name in node_operands(node))
    outputs = {o.name for o in graph.output}
    position = {out: i for i, node in enumerate(graph.node) for out in node.output}
    for i_pool, pool in enumerate(graph.node):
        if not _is(pool, "MaxPool") or not pool.input or pool.input[0] not in position:
            continue
        i_relu = position[pool.input[0]]
        relu = graph.node[i_relu]
        if not _is(relu, "Relu") or uses[relu.output[0]] != 1 or relu.output[0] in outputs:
            continue
        if not _commutes(pool):
            continue
        pooled = unique_name(f"{pool.output[0]}_before_relu", taken)
        new_pool, new_relu = onnx.NodeProto(), onnx.NodeProto()
        new_pool.CopyFrom(pool)
        new_pool.input[0], new_pool.output[0] = relu.input[0], pooled
        new_relu.CopyFrom(relu)
        new_relu.input[0], new_relu.output[0] = pooled, pool.output[0]
        # MaxPool takes ReLU's place (its only input, x, is known there), ReLU takes MaxPool's.
        graph.node[i_relu].CopyFrom(new_pool)
        graph.node[i_pool].CopyFrom(new_relu)


def _is(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _commutes(pool: onnx.NodeProto) -> bool:
    """Whether ReLU commutes with this MaxPool: only its values are used (not its Indices), and
    every window holds at least one element of X (a window of padding alone gives -inf, not 0)."""
    if len(pool.output) > 1 and pool.output[1]:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in pool.attribute}
    kernel = list(attrs.get("kernel_shape", []))
    if not kernel:
        return False
    dilations = list(attrs.get("dilations") or [1] * len(kernel))
    pads = list(attrs.get("pads") or [0] * 2 * len(kernel))
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    return all(p < extents[i % len(kernel)] for i, p in enumerate(pads))
