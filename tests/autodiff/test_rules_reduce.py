"""Gradient checks of the reduction rules (rules/reduce.py): the Reduce* ops, CumSum and CumProd.

Each rule is checked against float64 central finite differences through onnxruntime; ties of
ReduceMax / ReduceMin and CumProd are also compared with torch autograd in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxgrad.testing import check_op, node_model
from tests.autodiff.conftest import check_model, grads
from tests.autodiff.random_data import pos, rnd, rng  # one generator per test (conftest.py)

from .test_rules_indexing import versus_torch


def axes_arr(axes: Sequence[int]) -> np.ndarray:
    return np.array(axes, dtype=np.int64)


# ---- reductions -----------------------------------------------------------------------------
REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceLogSum",
]


def reduce_input(op: str, *shape: int) -> np.ndarray:
    return pos(*shape) if op == "ReduceLogSum" else rnd(*shape)


def reduce_case(
    op: str, opset: int, x: np.ndarray, axes: Sequence[int] | None, **attrs: Any
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Inputs and attributes of a reduction in the form of its opset: axes attribute or input."""
    axes_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is None:
        return [x], attrs
    if axes_input:
        return [x, axes_arr(axes)], attrs
    return [x], {**attrs, "axes": list(axes)}


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("opset", [11, 13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [[1], [-1, 0], None], ids=["one", "negative", "all"])
def test_reduce(op: str, opset: int, keepdims: int, axes: list[int] | None) -> None:
    inputs, attrs = reduce_case(op, opset, reduce_input(op, 2, 3, 4), axes, keepdims=keepdims)
    check_op(op, inputs, attrs=attrs, opset=opset)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_dynamic(op: str, keepdims: int) -> None:
    for opset, axes in ((11, [0, -1]), (18, [-2]), (18, None)):
        inputs, attrs = reduce_case(op, opset, reduce_input(op, 3, 2, 4), axes, keepdims=keepdims)
        check_op(op, inputs, attrs=attrs, opset=opset, dynamic=True)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("noop", [0, 1])
def test_reduce_empty_axes(op: str, noop: int) -> None:
    """Empty or absent axes: every axis, or the identity (the op's elementwise part) with noop."""
    x = reduce_input(op, 2, 3)
    opset = 13 if op == "ReduceSum" else 18
    for inputs in ([x, axes_arr([])], [x]):
        for keepdims in (0, 1):
            check_op(op, inputs, attrs={"noop_with_empty_axes": noop, "keepdims": keepdims}, opset=opset)


def runtime_axes_model(op: str, x: np.ndarray, axes: list[int], **attrs: Any) -> onnx.ModelProto:
    """A reduction whose axes are a graph input: nothing about them is known when building."""
    model = node_model(op, [x, axes_arr(axes)], attrs=attrs)
    init = model.graph.initializer.pop()
    model.graph.input.append(helper.make_tensor_value_info(init.name, TensorProto.INT64, [None]))
    del model.graph.value_info[:]
    if attrs.get("keepdims", 1) or (not axes and attrs.get("noop_with_empty_axes")):
        rank = x.ndim
    else:
        rank = x.ndim - len(axes) if axes else 0
    out = model.graph.output[0].type.tensor_type
    out.ClearField("shape")
    out.shape.SetInParent()  # a shape of that rank, every dim unknown
    for _ in range(rank):
        out.shape.dim.add()
    return model


@pytest.mark.parametrize(
    "op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceProd", "ReduceL2", "ReduceLogSumExp"]
)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_at_run_time(op: str, keepdims: int) -> None:
    x = reduce_input(op, 2, 3, 4)
    for axes in ([0, -1], [1], []):
        model = runtime_axes_model(op, x, axes, keepdims=keepdims)
        check_model(model, [x, axes_arr(axes)])
    model = runtime_axes_model(op, x, [], keepdims=keepdims, noop_with_empty_axes=1)
    check_model(model, [x, axes_arr([])])


def test_reduce_prod_with_zeros() -> None:
    """One zero in a slice: its gradient is the product of the others; two zeros: all zero."""
    x = rnd(3, 4)
    x[0, 1] = 0.0
    x[1, 0] = x[1, 2] = 0.0
    check_op("ReduceProd", [x, axes_arr([1])], attrs={"keepdims": 0})
    check_op("ReduceProd", [x, axes_arr([-2])], attrs={"keepdims": 1})
    check_op("ReduceProd", [x], attrs={"keepdims": 0})


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_reduce_extremum_ties_split_evenly(op: str) -> None:
    """Tied extrema share the gradient evenly, as torch.amax / torch.amin."""
    x = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 0.0], [-1.0, -1.0, 5.0, -1.0]])
    model = node_model(op, [x, axes_arr([1])], attrs={"keepdims": 0})
    y, cot, ours = grads(model, {"in0": x}, ["in0"])
    t = torch.tensor(x, requires_grad=True)
    ty = (torch.amax if op == "ReduceMax" else torch.amin)(t, dim=1)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy())
    np.testing.assert_allclose(ours["in0"], t.grad.numpy(), rtol=1e-12)


def test_reduce_l2_at_zero_is_zero() -> None:
    x = np.zeros((2, 3))
    x[1] = [1.0, -2.0, 2.0]
    model = node_model("ReduceL2", [x, axes_arr([1])], attrs={"keepdims": 0})
    _, cot, ours = grads(model, {"in0": x}, ["in0"])
    np.testing.assert_allclose(ours["in0"][0], 0.0)
    np.testing.assert_allclose(ours["in0"][1], cot[1] * x[1] / 3.0)


# ---- CumSum, CumProd ------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [11, 14])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
def test_cumsum(opset: int, exclusive: int, reverse: int, axis: int) -> None:
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check_op("CumSum", [rnd(3, 4), np.array(axis, dtype=np.int64)], attrs=attrs, opset=opset)
    check_op("CumSum", [rnd(3, 4), np.array(axis, dtype=np.int32)], attrs=attrs, opset=opset, dynamic=True)


def cumprod_input() -> np.ndarray:
    """Lines without zeros, with one zero (first, middle, last) and with two zeros."""
    x = rng().uniform(0.5, 1.5, (6, 5)) * rng().choice([-1.0, 1.0], (6, 5))
    x[1, 0] = x[2, 2] = x[3, 4] = 0.0
    x[4, 1] = x[4, 3] = 0.0
    return x


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [1, -2])
def test_cumprod(exclusive: int, reverse: int, axis: int) -> None:
    x = cumprod_input() if axis == 1 else cumprod_input().T.copy()
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check_op("CumProd", [x, np.array(axis, dtype=np.int64)], attrs=attrs, opset=26)
    check_op("CumProd", [x, np.array(axis, dtype=np.int64)], attrs=attrs, opset=26, dynamic=True)


@pytest.mark.parametrize("reverse", [0, 1])
def test_cumprod_versus_torch(reverse: int) -> None:
    def fn(x: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
        if reverse:
            return torch.cumprod(x.flip(1), 1).flip(1)
        return torch.cumprod(x, 1)

    versus_torch(
        "CumProd", [cumprod_input(), np.array(1, dtype=np.int64)], fn, {"reverse": reverse}, opset=26
    )
