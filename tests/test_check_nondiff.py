"""``onnxgrad check`` and ``check_gradients`` at kinks: a ReLU zero or a pooling tie within the
finite-difference step is reported as NONDIFF, not as a failure; a wrong rule still fails."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import supported_ops
from onnxgrad.autodiff import registry
from onnxgrad.cli import main
from onnxgrad.testing import check_gradients, check_nodes, node_model


def cnn(seed: int = 0) -> onnx.ModelProto:
    """x [N, 1, 6, 6] -> Conv -> Relu -> MaxPool 2x2 -> Flatten -> Gemm -> y [N, 3]: the ReLU zeros
    tie inside the pooling windows."""
    rng = np.random.default_rng(seed)

    def init(name: str, scale: float, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[
            init("conv.weight", 0.5, 4, 1, 3, 3),
            init("conv.bias", 0.1, 4),
            init("fc.weight", 0.3, 3, 36),
            init("fc.bias", 0.1, 3),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


@pytest.fixture
def cnn_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(cnn(), path)
    return path


def statuses(text: str) -> dict[str, str]:
    """Node name -> status of the check table."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]
    return {r[0]: r[4] for r in rows if len(r) == 5 and r[0] != "node"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_correct_cnn_passes_at_every_seed(cnn_path, capsys, seed):
    """Before: MaxPool FAIL and exit 1 at seeds 0-3 (the central difference halves the slope at a
    tie of ReLU zeros)."""
    assert main(["check", str(cnn_path), "--seed", str(seed)]) == 0
    text = capsys.readouterr().out
    found = statuses(text)
    assert set(found) == {"conv", "relu", "pool", "flatten", "fc", "whole model"}
    assert not any(s.startswith("FAIL") for s in found.values())
    assert re.fullmatch(
        r"ok|NONDIFF \(not differentiable within the step at \d+ of 24 elements\)", found["pool"]
    )
    assert "0 failed" in text


def test_the_tie_is_reported_as_nondiff(cnn_path, capsys):
    assert main(["check", str(cnn_path), "--seed", "0"]) == 0
    text = capsys.readouterr().out
    assert statuses(text)["pool"] == "NONDIFF (not differentiable within the step at 1 of 24 elements)"
    assert "6 checks: 5 ok, 1 not differentiable at some probed elements, 0 failed, 0 skipped" in text
    assert "kink within the finite-difference step" in text


def test_a_wrong_maxpool_rule_still_fails(cnn_path, capsys, monkeypatch):
    """A MaxPool rule giving 1.5 times the gradient fails, ties or not."""
    supported_ops()
    (right,) = [r for r in registry._RULES[("", "MaxPool")] if r.since <= 18][-1:]
    wrong = registry.Rule(
        "MaxPool",
        "",
        right.since,
        lambda g, n: [dx * 1.5 if dx is not None else None for dx in right.fn(g, n)],
        "rule",
    )
    monkeypatch.setitem(registry._RULES, ("", "MaxPool"), [wrong])
    assert main(["check", str(cnn_path), "--seed", "0"]) == 1
    text = capsys.readouterr().out
    assert statuses(text)["pool"] == "FAIL"
    assert "node pool (MaxPool):" in text


def relu_model() -> onnx.ModelProto:
    return node_model("Relu", [np.zeros((2, 3))])


def test_check_gradients_at_a_relu_zero_is_nondiff_not_a_mismatch():
    x = np.array([[0.0, 1.0, -2.0], [0.5, 0.0, -0.3]])
    result = check_gradients(relu_model(), {"in0": x})
    assert result.ok
    assert sorted(k.index for k in result.nondiff) == [(0, 0), (1, 1)]
    assert result.probed == {"in0": 6}
    assert result.nondiff_note() == "not differentiable within the step at 2 of 6 elements"
    k = result.nondiff[0]
    assert min(k.left, k.right) == pytest.approx(0.0, abs=1e-9)  # one slope 0, the other the cotangent
    assert result.max_error["in0"] < 1e-8  # the kinks are left out of the error


def test_a_wrong_relu_rule_fails_at_the_zero_and_elsewhere(monkeypatch):
    """Twice the gradient: outside the one-sided slopes at the zero, wrong at the smooth points."""
    supported_ops()
    wrong = registry.Rule(
        "Relu", "", 1, lambda g, n: [g.Where(g.Less(n.x, 0.0), n.dy * 0.0, n.dy * 2.0)], "rule"
    )
    monkeypatch.setitem(registry._RULES, ("", "Relu"), [wrong])
    x = np.array([[0.0, 1.0, -2.0], [0.5, 0.0, -0.3]])
    result = check_gradients(relu_model(), {"in0": x})
    assert not result.ok
    assert sorted(m.index for m in result.mismatches) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert result.nondiff == []


def test_check_nodes_status_nondiff():
    model = cnn()
    x = np.random.default_rng(0).standard_normal((2, 1, 6, 6)).astype(np.float32)
    x[0, 0] = -5.0  # every ReLU of sample 0 is zero: the pooling windows tie at 0
    pool = next(c for c in check_nodes(model, {"x": x}, max_elements=300) if c.op_type == "MaxPool")
    assert pool.status == "NONDIFF" and pool.result is not None and pool.result.ok
    assert pool.note == pool.result.nondiff_note() and pool.result.nondiff


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ("x=2,36", r"--shape x=2,36: input 'x' has rank 2 \(shape \(2, 36\)\), the model expects rank 4"),
        (
            "x=2,3,6,6",
            r"--shape x=2,3,6,6: input 'x' has shape \(2, 3, 6, 6\), the model expects \(N, 1, 6, 6\)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["check", "bench"])
def test_a_wrong_shape_is_one_line(cnn_path, capsys, shape, message, command):
    assert main([command, str(cnn_path), "--shape", shape]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("onnxgrad: error: ")
    assert re.search(message, err)


def test_a_wrong_value_between_the_slopes_at_a_kink_still_fails(monkeypatch):
    """At x = 0 a quarter of the gradient lies between the one-sided slopes (0 and the cotangent) but
    is neither: a mismatch, not NONDIFF. Elsewhere the rule is right."""
    supported_ops()

    def quarter_at_zero(g, n):
        dx = g.Where(g.Greater(n.x, 0.0), n.dy, n.dy * 0.0)
        return [g.Where(g.Equal(n.x, 0.0), n.dy * 0.25, dx)]

    monkeypatch.setitem(
        registry._RULES, ("", "Relu"), [registry.Rule("Relu", "", 1, quarter_at_zero, "rule")]
    )
    x = np.array([[0.0, 1.0, -2.0], [0.5, 0.0, -0.3]])
    result = check_gradients(relu_model(), {"in0": x})
    assert sorted(m.index for m in result.mismatches) == [(0, 0), (1, 1)]
    assert result.nondiff == []
