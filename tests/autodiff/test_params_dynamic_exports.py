"""Exporter constants of decoders exported with dynamic shapes (a KV cache: past length symbolic)
stay out of the default trainable set, as they do in static exports.

Found on the zoo's GPT-2 / Llama exported the way optimum does (tests/zoo/test_decoders_kv.py):
the attention scale multiplied into a key transposed to (..., head size, past + sequence), the
scalar 1 expanded into an attention mask of ones and cast to bool, and RoPE's inverse frequencies
(folded into a table in a static export, here multiplied by positions at run time) were trained,
and the training drifted from torch's (1.2e-4 relative after 10 steps on GPT-2).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.autodiff.params import parameter_reasons

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(
        nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_scale_along_a_symbolic_last_dim_is_a_constant_where_another_use_is_static():
    model = _model(
        [
            helper.make_node("Mul", ["q", "scale"], ["qs"]),  # (..., head size 8)
            helper.make_node("Mul", ["kt", "scale"], ["ks"]),  # (..., past + sequence)
            helper.make_node("MatMul", ["qs", "ks"], ["scores"]),
            helper.make_node("Add", ["scores", "bias"], ["y"]),  # (..., past + sequence) only
        ],
        [
            helper.make_tensor_value_info("q", F, ["b", 4, "s", 8]),
            helper.make_tensor_value_info("kt", F, ["b", 4, 8, "t"]),
        ],
        [helper.make_tensor_value_info("y", F, ["b", 4, "s", "t"])],
        {"scale": np.array([0.59], np.float32), "bias": np.array([0.1], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["scale"] == "scalar constant"
    # one value against symbolic last dims only: kept (it may be a one-output layer's bias)
    assert reasons["bias"] is None


def test_a_value_read_by_boolean_ops_only_is_not_trained():
    model = _model(
        [
            helper.make_node("Expand", ["one", "shape"], ["ones"]),
            helper.make_node("Cast", ["ones"], ["ones_b"], to=TensorProto.BOOL),
            helper.make_node("And", ["ones_b", "keep"], ["mask"]),
            helper.make_node("Where", ["mask", "x", "w"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("keep", TensorProto.BOOL, ["s"]),
            helper.make_tensor_value_info("x", F, ["s"]),
        ],
        [helper.make_tensor_value_info("y", F, ["s"])],
        {"one": np.array(1.0, np.float32), "w": np.array([0.5, 0.25], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["one"] == "read as a boolean"
    assert reasons["w"] is None


def _rope(freqs: np.ndarray):
    return _model(
        [
            helper.make_node("Cast", ["positions"], ["pos_f"], to=F),
            helper.make_node("MatMul", ["freqs", "pos_f"], ["angles"]),
            helper.make_node("Cos", ["angles"], ["y"]),
        ],
        [helper.make_tensor_value_info("positions", TensorProto.INT64, [1, 1, "s"])],
        [helper.make_tensor_value_info("y", F, [1, 4, "s"])],
        {"freqs": freqs.reshape(1, 4, 1).astype(np.float32)},
    )


def test_rotary_inverse_frequencies_are_not_trained():
    inv_freq = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)  # transformers' RoPE, head size 8
    assert parameter_reasons(_rope(inv_freq))["freqs"] == "rotary inverse frequencies"
    # not a geometric sequence from 1: a weight
    assert parameter_reasons(_rope(np.array([1.0, 0.5, 0.3, 0.1])))["freqs"] is None


def test_uses_inside_if_branches_are_followed():
    """optimum's merged decoder: the initializers are in the main graph, every read is in a branch
    of an If; a branch's values are followed as the main graph's are (Expand, Cast, then And)."""
    then = helper.make_graph(
        [
            helper.make_node("Expand", ["one", "shape"], ["ones"]),
            helper.make_node("Cast", ["ones"], ["ones_b"], to=TensorProto.BOOL),
            helper.make_node("And", ["ones_b", "keep"], ["mask"]),
            helper.make_node("Where", ["mask", "x", "w"], ["y"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("y", F, ["s"])],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])],
        "else",
        [],
        [helper.make_tensor_value_info("y", F, ["s"])],
    )
    model = _model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("keep", TensorProto.BOOL, ["s"]),
            helper.make_tensor_value_info("x", F, ["s"]),
        ],
        [helper.make_tensor_value_info("y", F, ["s"])],
        {"one": np.array(1.0, np.float32), "w": np.array([0.5, 0.25], np.float32)},
    )
    reasons = parameter_reasons(model)
    assert reasons["one"] == "read as a boolean"
    assert reasons["w"] is None
