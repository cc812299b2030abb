"""Gradient checks of the loss ops (rules/losses.py): NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss, every reduction, with and without weights and ignore_index, N x C and
N x C x d1 x ... layouts, the optional log_prob output.

Against float64 central finite differences through onnxruntime (weights included), and against
torch.nn.functional.nll_loss / cross_entropy in float64 (values and input gradients).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import onnxgrad.autodiff.rules.losses  # noqa: F401  (registers the rules until rules/__init__ does)
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.testing import check_gradients, check_op, node_model
from tests.autodiff.conftest import grads
from tests.autodiff.random_data import rnd

OPS = ["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"]
REDUCTIONS = ["none", "sum", "mean"]
IGNORE = 1  # a valid class, so ignored samples would count if the mask were missed


def case(
    op: str, shape: tuple, weighted: bool, ignore: int | None, seed: int = 0, dtype: Any = np.int64
) -> list[np.ndarray | None]:
    """Scores (log probabilities for NLL), labels hitting ``ignore`` at a few samples, weights."""
    rng = np.random.default_rng(seed)
    n, c = shape[0], shape[1]
    x = rnd(*shape)
    if op == "NegativeLogLikelihoodLoss":
        x = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    labels = rng.integers(0, c, size=(n, *shape[2:]))
    if ignore is not None:
        labels.reshape(-1)[::3] = ignore
    weight = rng.random(c) + 0.5 if weighted else None
    return [x, labels.astype(dtype), weight]


def attrs_of(reduction: str, ignore: int | None) -> dict[str, Any]:
    return {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})


def check(op: str, inputs: list, attrs: dict[str, Any], log_prob: bool = False, **kw: Any) -> None:
    n_outputs = 2 if log_prob else 1
    inputs = inputs if inputs[2] is not None else inputs[:2]
    check_op(op, inputs, attrs=attrs, n_outputs=n_outputs, max_elements=16, **kw)


# (weights, ignore_index, layout): ignored labels inside and outside the class range
CASES = [
    (True, IGNORE, (3, 4)),
    (True, IGNORE, (2, 3, 2, 3)),
    (True, None, (3, 4, 2)),
    (False, None, (3, 4, 2)),
    (False, -100, (3, 4)),
]
CASE_IDS = [
    "weighted-ignore-NxC",
    "weighted-ignore-NxCxd1xd2",
    "weighted-NxCxd1",
    "plain-NxCxd1",
    "ignore-100-NxC",
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(("weighted", "ignore", "shape"), CASES, ids=CASE_IDS)
def test_loss(op: str, reduction: str, weighted: bool, ignore: int | None, shape: tuple) -> None:
    """Finite differences (scores and weights), then values and score gradients against torch."""
    x, labels, weight = case(op, shape, weighted, ignore)
    attrs = attrs_of(reduction, ignore)
    inputs = [x, labels, weight] if weighted else [x, labels]
    check_op(op, inputs, attrs=attrs, max_elements=16)
    model = node_model(op, inputs, attrs=attrs)
    feeds = {"in0": x} | ({"in2": weight} if weighted else {})
    y, cot, ours = grads(model, feeds, ["in0"])
    tx = torch.tensor(x, requires_grad=True)
    fn = F.nll_loss if op == "NegativeLogLikelihoodLoss" else F.cross_entropy
    ty = fn(
        tx,
        torch.tensor(labels),
        weight=None if weight is None else torch.tensor(weight),
        ignore_index=-100 if ignore is None else ignore,
        reduction=reduction,
    )
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours["in0"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_opsets_dynamic_shapes_and_int32_labels(op: str) -> None:
    inputs = case(op, (3, 4, 2), True, IGNORE, dtype=np.int32)
    check(op, inputs, attrs_of("mean", IGNORE), opset=12)
    check(op, case(op, (3, 4, 2), False, None), attrs_of("mean", None), opset=13, dynamic=True)
    check(op, inputs, attrs_of("none", IGNORE), opset=13, dynamic=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_softmax_cross_entropy_log_prob_output(reduction: str) -> None:
    """The model outputs log_prob too: both outputs carry a gradient."""
    inputs = case("SoftmaxCrossEntropyLoss", (3, 4, 2), True, IGNORE)
    check("SoftmaxCrossEntropyLoss", inputs, attrs_of(reduction, IGNORE), log_prob=True)


def test_softmax_cross_entropy_only_log_prob_takes_a_gradient() -> None:
    inputs = case("SoftmaxCrossEntropyLoss", (3, 4), True, None)
    model = node_model("SoftmaxCrossEntropyLoss", inputs, n_outputs=2)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in2"], outputs=["out1"])
    result = check_gradients(model, {"in0": inputs[0], "in2": inputs[2]}, graphs=graphs)
    assert result.ok, result.report()
    assert not result.analytic["in2"].any()  # log_prob does not depend on the weights


def test_ignored_samples_get_no_gradient() -> None:
    x, labels, weight = case("SoftmaxCrossEntropyLoss", (4, 3), True, 2)
    model = node_model("SoftmaxCrossEntropyLoss", [x, labels, weight], attrs=attrs_of("mean", 2))
    _, _, ours = grads(model, {"in0": x, "in2": weight}, ["in0", "in2"])
    ignored = labels == 2
    assert ignored.any() and not ours["in0"][ignored].any()
    assert ours["in2"][2] == 0.0  # the ignored class's weight does not matter
