"""``testing.check_nodes`` checks each node with the dims its model declares symbolic, too.

The per-node check runs a one-node model at the static shapes of the values the model computes; a
rule whose run-time-shape path is wrong (the Conv input gradient with symbolic H and W, issue 37
§0) passed it. Nodes whose inputs the model declares with symbolic dims are built again with those
dims symbolic, and their gradients must equal the static ones.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import supported_ops
from onnxgrad.autodiff import registry
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_nodes, declare_symbolic


def strided_conv(dims: list) -> onnx.ModelProto:
    """x -> Conv 3x3 stride 2 pad 1 -> Relu -> y, x declared with ``dims``."""
    w = np.random.default_rng(0).standard_normal((4, 2, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "stem",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version_for(model.opset_import)
    return onnx.shape_inference.infer_shapes(model)


def x_even() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((2, 2, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("dims", [["N", 2, "H", "W"], [2, 2, 8, 8]], ids=["symbolic", "static"])
def test_strided_conv_passes_both_ways(dims: list) -> None:
    checks = check_nodes(strided_conv(dims), {"x": x_even()})
    assert [(c.op_type, c.status) for c in checks] == [("Conv", "ok"), ("Relu", "ok")], [
        c.note for c in checks
    ]


def _only_static_right(rule: registry.Rule) -> registry.Rule:
    """The Conv rule, with its input gradient doubled when X's spatial dims are not static."""

    def wrong(g, n):  # type: ignore[no-untyped-def]
        grads = rule.fn(g, n)
        if n.x.static_shape is None and grads[0] is not None:
            grads[0] = grads[0] * 2.0
        return grads

    return registry.Rule(rule.op_type, rule.domain, rule.since, wrong, rule.kind)


def test_a_rule_wrong_only_with_symbolic_dims_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right at static shapes (the finite differences agree), wrong along the run-time-shape path:
    FAIL, saying so; with the model's dims static the node is never built that way."""
    supported_ops()  # loads the rules
    rules = registry._RULES[("", "Conv")]
    monkeypatch.setitem(registry._RULES, ("", "Conv"), [_only_static_right(r) for r in rules])
    conv = check_nodes(strided_conv(["N", 2, "H", "W"]), {"x": x_even()})[0]
    assert conv.status == "FAIL" and conv.result is not None and conv.result.ok
    assert conv.note == "the gradient of in0 differs with the model's symbolic dims {'in0': [0, 2, 3]}"
    assert check_nodes(strided_conv([2, 2, 8, 8]), {"x": x_even()})[0].status == "ok"


def test_a_refusal_with_symbolic_dims_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that refuses symbolic sizes: the whole model would be refused; the node check says
    so rather than passing at static shapes."""
    supported_ops()

    def static_only(g, n):  # type: ignore[no-untyped-def]
        if n.x.static_shape is None:
            raise GradientNotImplementedError("Relu node: needs static sizes (planted)")
        return [n.dy * g.Cast(g.Greater(n.x, 0.0), to=n.x.dtype)]

    monkeypatch.setitem(registry._RULES, ("", "Relu"), [registry.Rule("Relu", "", 1, static_only, "rule")])
    relu = check_nodes(strided_conv(["N", 2, "H", "W"]), {"x": x_even()})[1]
    assert relu.status == "FAIL" and relu.result is not None and relu.result.ok, relu.note
    assert relu.note == "refused with the model's symbolic dims: Relu node: needs static sizes (planted)"


def test_declare_symbolic_keeps_the_model() -> None:
    model = strided_conv([2, 2, 8, 8])
    copy = declare_symbolic(model, {"x": [0, 2, 3, 9]})  # an axis past the rank is ignored
    dims = [d.dim_param or d.dim_value for d in copy.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["x_d0", 2, "x_d2", "x_d3"]
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [2, 2, 8, 8]
