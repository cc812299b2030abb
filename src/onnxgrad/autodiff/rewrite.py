"""Rewrites of the forward graph that keep every value the model computes and make its gradient
cheaper. They run on the model before differentiation.

- ``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``: ReLU is monotonic, so both give the same
  values and pick the same window elements, but ReLU (and its gradient mask) then runs on the
  pooled tensor, 4x smaller for the usual 2x2 pool, and the full-size activation is not saved for
  the backward. Conv-ReLU-MaxPool is the building block of most CNNs.
- ``MatMul(x, W) + b`` (and a ReLU after it) with ``W`` a 2-D and ``b`` a 1-D float initializer
  becomes ``Reshape(Gemm(Reshape(x, [-1, K]), W, b), x.shape[:-1] + [N])``: how PyTorch exports a
  ``Linear`` applied to a batch of sequences. onnxruntime fuses this itself only when every dim of
  x is static; with a dynamic batch it ran the MatMul, a broadcast Add and the ReLU as three passes
  over the output, where a Gemm adds the bias and applies the ReLU as it writes it.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import all_names, node_operands, opset_of, unique_name


def rewrite_for_training(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with the rewrites above applied to its main graph,
    whose nodes must be in topological order (they stay so)."""
    taken = all_names(model.graph)
    _relu_after_max_pool(model.graph, taken)
    if opset_of(model) >= 13:  # Slice with tensor inputs, Gemm broadcasting its bias
        _dense_layers(model.graph, taken)
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


def _dense_layers(graph: onnx.GraphProto, taken: set[str]) -> None:
    uses = Counter(name for node in graph.node for name in node_operands(node))
    outputs = {o.name for o in graph.output}
    consumer = {name: node for node in graph.node for name in node.input}
    inits = {i.name: i for i in graph.initializer}
    floats = (TensorProto.FLOAT, TensorProto.DOUBLE)  # onnxruntime's Gemm kernels

    def sole_consumer(name: str, op_type: str) -> onnx.NodeProto | None:
        node = consumer.get(name)
        if node is None or not _is(node, op_type) or uses[name] != 1 or name in outputs:
            return None
        return node

    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    index = {id(node): i for i, node in enumerate(graph.node)}
    for i, mm in enumerate(graph.node):
        if not _is(mm, "MatMul") or len(mm.input) != 2 or mm.input[1] not in inits:
            continue
        w = inits[mm.input[1]]
        add = sole_consumer(mm.output[0], "Add")
        if len(w.dims) != 2 or w.data_type not in floats or add is None:
            continue
        bias = add.input[1] if add.input[0] == mm.output[0] else add.input[0]
        b = inits.get(bias)
        if b is None or list(b.dims) != [w.dims[1]] or b.data_type != w.data_type:
            continue
        relu = sole_consumer(add.output[0], "Relu")
        last = relu if relu is not None else add
        k, n = int(w.dims[0]), int(w.dims[1])
        rows, flat, gemm, lead, full = (unique_name(f"{mm.output[0]}_{s}", taken) for s in _PARTS)
        consts = {
            rows: np.array([-1, k], dtype=np.int64),
            f"{rows}_start": np.array([0], dtype=np.int64),
            f"{rows}_end": np.array([-1], dtype=np.int64),
            f"{rows}_n": np.array([n], dtype=np.int64),
        }
        taken.update(consts)
        graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in consts.items())
        x = mm.input[0]
        nodes = [
            helper.make_node("Reshape", [x, rows], [flat]),
            helper.make_node("Gemm", [flat, mm.input[1], bias], [gemm]),
        ]
        if relu is not None:
            activated = unique_name(f"{gemm}_relu", taken)
            nodes.append(helper.make_node("Relu", [gemm], [activated]))
            gemm = activated
        nodes += [
            helper.make_node("Shape", [x], [f"{lead}_shape"]),
            helper.make_node("Slice", [f"{lead}_shape", f"{rows}_start", f"{rows}_end"], [lead]),
            helper.make_node("Concat", [lead, f"{rows}_n"], [full], axis=0),
            helper.make_node("Reshape", [gemm, full], [last.output[0]]),
        ]
        taken.add(f"{lead}_shape")
        replaced[i] = nodes  # where the MatMul was: x, W and b are all known there
        dropped.update(index[id(node)] for node in (add, relu) if node is not None)
    if not replaced:
        return
    new_nodes = []
    for i, node in enumerate(graph.node):
        if i in replaced:
            new_nodes.extend(replaced[i])
        elif i not in dropped:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)


_PARTS = ("rows", "flat", "gemm", "lead", "shape")


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
