"""The gradient checker's tolerances come from the computation it checks: a float32 rule 1 % (or
0.1 %) off fails, a float64 product of large inputs passes without elements called "not
differentiable", and a MaxPool over tied values (a dead ReLU channel) is checked next to the tie
with a note, while a wrong MaxPool rule still fails."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxgrad import supported_ops
from onnxgrad.autodiff import registry
from onnxgrad.cli import main
from onnxgrad.testing import check_gradients, check_nodes, check_op
from tests.models import make_model


def _scaled(monkeypatch: pytest.MonkeyPatch, op: str, factor: float) -> None:
    """Replace the rule of ``op`` by the same rule times ``factor`` (1: right)."""
    supported_ops()
    right = registry._RULES[("", op)][-1]
    wrong = registry.Rule(
        op,
        "",
        right.since,
        lambda g, n: [d * factor if d is not None else None for d in right.fn(g, n)],
        "rule",
    )
    monkeypatch.setitem(registry._RULES, ("", op), [wrong])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("factor", [1.01, 1.001])
def test_a_rule_slightly_off_fails(monkeypatch, dtype, factor):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(dtype)
    assert check_op("Sin", [x]).ok  # the right rule passes
    _scaled(monkeypatch, "Sin", factor)
    with pytest.raises(AssertionError, match="gradient check of Sin failed") as info:
        check_op("Sin", [x])
    assert "not differentiable" not in str(info.value)


@pytest.mark.parametrize("scale", [1.0, 100.0, 1e4])
def test_float64_products_of_large_inputs_pass(scale):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 5)) * scale, rng.standard_normal((5, 3)) * scale
    result = check_op("MatMul", [a, b])
    assert result.ok and not result.nondiff, result.report()


def test_a_wrong_rule_on_large_inputs_still_fails(monkeypatch):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 5)) * 1e4, rng.standard_normal((5, 3)) * 1e4
    _scaled(monkeypatch, "MatMul", 1.001)
    with pytest.raises(AssertionError, match="gradient check of MatMul failed"):
        check_op("MatMul", [a, b])


def test_given_tolerances_are_used_as_given(monkeypatch):
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    _scaled(monkeypatch, "Sin", 1.01)
    assert check_op("Sin", [x], rtol=5e-2, atol=5e-3).ok  # loose on purpose: the caller's choice


def _dead_channel_model() -> onnx.ModelProto:
    """Conv -> Relu -> MaxPool(3, 2, 1) -> Flatten, the second channel's bias making it 0 everywhere."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node(
            "MaxPool", ["r"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
        ),
        helper.make_node("Flatten", ["p"], ["y"], name="flatten"),
    ]
    inits = {
        "W": rng.standard_normal((2, 1, 3, 3)).astype(np.float32),
        "B": np.array([0.0, -100.0], np.float32),
    }
    return make_model(nodes, [("x", np.float32, ["N", 1, 6, 6])], [("y", np.float32, ["N", 18])], inits)


def test_maxpool_over_tied_values_is_checked_next_to_the_tie(tmp_path, capsys):
    model = _dead_channel_model()
    x = np.random.default_rng(1).standard_normal((2, 1, 6, 6)).astype(np.float32)
    checks = {c.name: c for c in check_nodes(model, {"x": x})}
    pool = checks["pool"]
    assert pool.status == "ok", (pool.note, pool.result.report() if pool.result else None)
    assert "tied input values moved apart by multiples of 1e-05" in pool.note
    assert "first-index subgradient" in pool.note
    assert checks["conv"].note == ""  # no tie breaking where nothing picks a maximum
    assert check_gradients(model, {"x": x}).ok
    path = tmp_path / "dead.onnx"
    onnx.save(model, path)
    assert main(["check", str(path)]) == 0, capsys.readouterr().out


def test_a_wrong_maxpool_rule_fails_at_ties_too(monkeypatch):
    _scaled(monkeypatch, "MaxPool", 1.5)
    x = np.random.default_rng(1).standard_normal((2, 1, 6, 6)).astype(np.float32)
    pool = {c.name: c for c in check_nodes(_dead_channel_model(), {"x": x})}["pool"]
    assert pool.status == "FAIL" and "tied input values" not in pool.note  # wrong next to the tie too
