"""Gradient rules of the gathers, scatters, TopK, Compress and Trilu (rules/indexing.py).

Every rule is checked against float64 central finite differences through onnxruntime (which runs
these ops in float64). Scatter reductions and TopK are also compared with torch autograd in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import onnxgrad
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.rules import indexing  # noqa: F401  (registers the rules until rules/__init__ does)
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_gradients, check_op, node_model
from tests.autodiff.conftest import (
    assert_ok,
    check_feeds,
    gradients,
    i64,
    model,
    runtime_inputs,
    untyped_outputs_ranked,
)
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

F32 = np.float32


def versus_torch(
    op: str,
    inputs: list[np.ndarray],
    fn: Callable[..., torch.Tensor],
    attrs: dict[str, Any] | None = None,
    opset: int = 18,
    n_outputs: int = 1,
) -> None:
    """Output 0 and the gradients of every float input of a one-node model against torch (float64)."""
    dtypes = [np.float64] + [np.int64] * (n_outputs - 1)
    model = node_model(op, inputs, attrs=attrs, opset=opset, n_outputs=n_outputs, output_dtypes=dtypes)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    y, cot, ours = gradients(model, feeds, list(feeds))
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]
    ty = fn(*ts)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12)
    for name in feeds:
        expected = ts[int(name[2:])].grad.numpy()
        np.testing.assert_allclose(ours[name], expected, rtol=1e-10, atol=1e-12, err_msg=name)


# ---- ScatterElements and Scatter ------------------------------------------------------------------
DUP_IDX = i64([[1, 0, 2, 1], [1, 2, 2, 0]])  # (2, 4) into (3, 4) along axis 0: collisions in columns 0 and 2

ELEMENTS_OPSETS = [(11, "none"), (13, "none"), (16, "add"), (16, "mul"), (18, "max"), (18, "min")]


def scatter_reduction_inputs(reduction: str, shape: tuple[int, ...], upd_shape: tuple[int, ...]):
    """Data and updates: with zeros among the factors for mul, with no ties for max/min (kinks)."""
    if reduction in ("max", "min"):
        values = rng().permutation(np.prod(shape) + np.prod(upd_shape)).astype(np.float64) * 0.1
        return values[: np.prod(shape)].reshape(shape), values[np.prod(shape) :].reshape(upd_shape)
    data, upd = rnd(*shape), rnd(*upd_shape)
    if reduction == "mul":
        upd.flat[[0, 3]] = 0.0
    return data, upd


@pytest.mark.parametrize(("opset", "reduction"), ELEMENTS_OPSETS)
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements(opset: int, reduction: str, axis: int) -> None:
    # along axis 1: (3, 2) indices [[1, 1], [0, 2], [2, 2]] into (3, 4), collisions in rows 0 and 2
    idx = DUP_IDX if axis == 0 else DUP_IDX.T.copy()[:3, :2]
    data, upd = scatter_reduction_inputs(reduction, (3, 4), idx.shape)
    attrs = {"axis": axis} if reduction == "none" else {"axis": axis, "reduction": reduction}
    check_op("ScatterElements", [data, idx, upd], attrs=attrs, opset=opset)
    # indices known only at run time, and symbolic dims
    model = runtime_inputs(node_model("ScatterElements", [data, idx, upd], attrs=attrs, opset=opset), "in1")
    check_feeds(model, {"in0": data, "in1": idx, "in2": upd})
    check_op("ScatterElements", [data, idx, upd], attrs=attrs, opset=opset, dynamic=True)


def test_scatter_elements_overwritten_updates_get_no_gradient() -> None:
    """Reduction none: of updates written to the same place, only the last (row-major) one counts,
    which is what finite differences of onnxruntime's forward give. torch.scatter's backward
    (src.grad = grad.gather(index)) would give both duplicates 1 here."""
    data, upd = rnd(3, 4), rnd(2, 4)
    model = node_model("ScatterElements", [data, DUP_IDX, upd], attrs={"axis": 0})
    cot = np.ones((3, 4))
    _, _, res = gradients(model, {"in0": data, "in2": upd}, ["in0", "in2"], cot)
    # updates[0, 0] and updates[1, 0] both go to data[1, 0]: the later one wins
    assert res["in2"][0, 0] == 0.0 and res["in2"][1, 0] == 1.0
    assert res["in2"][0, 2] == 0.0 and res["in2"][1, 2] == 1.0
    assert res["in2"].sum() == 6.0  # the 8 updates fill 6 places
    np.testing.assert_array_equal(res["in0"], [[1, 0, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1]])


def test_scatter_elements_unique_constant_indices_need_no_mask() -> None:
    idx = i64([[2, 0, 1, -3]])  # -3 is row 0 of 3: still unique per column
    data, upd = rnd(3, 4), rnd(1, 4)
    check_op("ScatterElements", [data, idx, upd], attrs={"axis": 0})
    graphs = build_gradient(node_model("ScatterElements", [data, idx, upd]), inputs_requiring_grad=["in2"])
    assert [n.op_type for n in graphs.backward.graph.node] == ["GatherElements"]


@pytest.mark.parametrize("opset", [9, 10])
def test_scatter_opset_9(opset: int) -> None:
    data, upd = rnd(3, 4), rnd(2, 4)
    check_op("Scatter", [data, DUP_IDX, upd], attrs={"axis": 0}, opset=opset)
    check_op(
        "Scatter", [data, DUP_IDX.T.copy()[:3, :2], upd.T.copy()[:3, :2]], attrs={"axis": 1}, opset=opset
    )


@pytest.mark.parametrize(
    ("reduction", "reduce"), [("add", "sum"), ("mul", "prod"), ("max", "amax"), ("min", "amin")]
)
def test_scatter_elements_versus_torch(reduction: str, reduce: str) -> None:
    """Reductions with ties (max/min) and zeros (mul: one and two zeros at one place) vs torch."""
    data = np.round(rnd(3, 5), 0)  # small integers: ties between data and updates
    upd = np.round(rnd(2, 5), 0)
    idx = i64([[1, 0, 2, 1, 0], [1, 2, 2, 0, 0]])
    if reduction == "mul":
        upd[:, 0] = [0.0, 0.0]  # two zeros land on data[1, 0]
        upd[0, 2] = 0.0  # one zero lands on data[2, 2]
        data[0, 4] = 0.0
    versus_torch(
        "ScatterElements",
        [data, idx, upd],
        lambda d, i, u: d.scatter_reduce(0, i, u, reduce, include_self=True),
        attrs={"axis": 0, "reduction": reduction},
    )


def test_scatter_elements_none_versus_torch_without_duplicates() -> None:
    idx = i64([[2, 0, 1, 0], [0, 1, 2, 2]])
    versus_torch(
        "ScatterElements", [rnd(3, 4), idx, rnd(2, 4)], lambda d, i, u: d.scatter(0, i, u), attrs={"axis": 0}
    )


# ---- ScatterND ------------------------------------------------------------------------------------
ND_OPSETS = [(11, "none"), (13, "none"), (16, "add"), (16, "mul"), (18, "max"), (18, "min")]


@pytest.mark.parametrize(("opset", "reduction"), ND_OPSETS)
@pytest.mark.parametrize(
    ("idx", "upd_shape"),
    [(i64([[1], [0], [1]]), (3, 2, 3)), (i64([[[0, 1], [2, 0]], [[0, 1], [-1, 1]]]), (2, 2, 3))],
    ids=["rows", "pairs"],
)
def test_scatter_nd(opset: int, reduction: str, idx: np.ndarray, upd_shape: tuple[int, ...]) -> None:
    """Index rows (whole slices) and pairs into (3, 2, 3), each with a repeated index."""
    data, upd = scatter_reduction_inputs(reduction, (3, 2, 3), upd_shape)
    attrs = {} if reduction == "none" else {"reduction": reduction}
    check_op("ScatterND", [data, idx, upd], attrs=attrs, opset=opset)
    model = runtime_inputs(node_model("ScatterND", [data, idx, upd], attrs=attrs, opset=opset), "in1")
    check_feeds(model, {"in0": data, "in1": idx, "in2": upd})


def test_scatter_nd_unique_indices() -> None:
    data, upd = rnd(4, 3), rnd(2, 3)
    check_op("ScatterND", [data, i64([[3], [-1 + 1]]), upd])
    graphs = build_gradient(
        node_model("ScatterND", [data, i64([[3], [0]]), upd]), inputs_requiring_grad=["in2"]
    )
    assert [n.op_type for n in graphs.backward.graph.node] == ["GatherND"]


# ---- TensorScatter --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["linear", "circular"])
@pytest.mark.parametrize("with_indices", [False, True])
def test_tensor_scatter(mode: str, with_indices: bool) -> None:
    past, upd = rnd(2, 5, 3), rnd(2, 2, 3)
    w = i64([3, 1] if mode == "linear" else [4, 2]) if with_indices else None
    inputs = [past, upd] + ([w] if with_indices else [])
    check_op("TensorScatter", inputs, attrs={"mode": mode}, opset=24)
    # sequence axis 2 of a 4-D cache, symbolic dims
    past4, upd4 = rnd(2, 3, 4, 2), rnd(2, 3, 3, 2)
    inputs4 = [past4, upd4] + ([i64([1, 3])] if with_indices else [])
    attrs = {"mode": mode, "axis": 2} if mode == "circular" or not with_indices else {"axis": 2}
    if mode == "linear" and with_indices:
        inputs4[2] = i64([1, 0])
    check_op("TensorScatter", inputs4, attrs=attrs, opset=24, dynamic=True)


# ---- TopK -----------------------------------------------------------------------------------------
def topk_input(*shape: int) -> np.ndarray:
    return rng().permutation(int(np.prod(shape))).reshape(shape) * 0.25 - 1.0  # distinct values


def values_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop output 1 (TopK's Indices) from the graph outputs: the model does not use it."""
    model.graph.output.pop()
    return model


@pytest.mark.parametrize("indices_used", [False, True])
@pytest.mark.parametrize(
    ("opset", "attrs", "with_k"),
    [
        (1, {"k": 2}, False),
        (10, {"axis": 0}, True),
        (11, {"largest": 0, "sorted": 0}, True),
        (11, {"axis": -2, "largest": 1}, True),
        (24, {"axis": 2}, True),
    ],
)
def test_topk(opset: int, attrs: dict[str, Any], with_k: bool, indices_used: bool) -> None:
    x = topk_input(3, 4, 5)
    inputs = [x, i64([2])] if with_k else [x]
    for dynamic in (False, True) if with_k else (False,):
        model = node_model(
            "TopK",
            inputs,
            attrs=attrs,
            opset=opset,
            n_outputs=2,
            output_dtypes=[np.float64, np.int64],
            dynamic=dynamic,
        )
        check_feeds(model if indices_used else values_only(model), {"in0": x})


def test_topk_versus_torch() -> None:
    x = topk_input(4, 6)
    versus_torch(
        "TopK",
        [x, i64([3])],
        lambda t, k: torch.topk(t, 3, dim=1, largest=False).values,
        attrs={"axis": 1, "largest": 0},
        opset=11,
        n_outputs=2,
    )


# ---- Compress, Trilu ------------------------------------------------------------------------------
@pytest.mark.parametrize(("opset", "axis"), [(9, None), (9, 0), (9, 1), (11, None), (11, 1), (11, -1)])
def test_compress(opset: int, axis: int | None) -> None:
    x = rnd(3, 4)
    cond = np.array([True, False, True], dtype=bool)  # shorter than the axis for axes 1 and -1 (4)
    attrs = {} if axis is None else {"axis": axis}
    for dynamic in (False, True):
        model = node_model("Compress", [x, cond], attrs=attrs, opset=opset, dynamic=dynamic)
        check_feeds(untyped_outputs_ranked(model, 1 if axis is None else 2), {"in0": x})


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 1, -2])
def test_trilu(upper: int, k: int | None) -> None:
    inputs = [rnd(2, 3, 4)] + ([] if k is None else [np.array(k, dtype=np.int64)])
    check_op("Trilu", inputs, attrs={"upper": upper}, opset=14)
    check_op("Trilu", inputs, attrs={"upper": upper}, opset=14, dynamic=True)


# ---- Gather, GatherND, GatherElements -------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices", "axis"),
    [
        ((5, 3), np.array([0, 2, 2, 4]), 0),  # duplicates add up
        ((5, 3), np.array([[1, -1], [0, 1]]), 1),  # 2-D and negative indices
        ((2, 4, 3), np.array([3, -4, 0]), -2),
        ((2, 4, 3), np.array(2), 1),  # scalar index drops the axis
        ((2, 4, 3), np.array([[0, 2], [2, 2]], dtype=np.int32), -1),
    ],
)
def test_gather(shape, indices, axis, dynamic):
    check_op("Gather", [rnd(*shape), indices], attrs={"axis": axis}, dynamic=dynamic)


def test_gather_with_indices_from_an_input():
    # Token ids fed at run time (an embedding lookup), negative ones included.
    m = model(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        [("ids", np.int64, [2, 3])],
        [("y", np.float64, None)],
        inits={"table": rnd(6, 4)},
    )
    assert_ok(check_gradients(m, {"ids": np.array([[0, 5, -1], [2, 2, 0]])}))


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices"),
    [
        ((4, 3), np.array([[0], [3], [0]])),  # rows, one repeated
        ((4, 3, 2), np.array([[1, 2], [-1, 0], [1, 2]])),  # (row, col) pairs, negative, repeated
        ((3, 2), np.array([[[2, 1]], [[0, 0]]])),  # single elements, batched index shape
    ],
)
def test_gather_nd(shape, indices, dynamic):
    check_op("GatherND", [rnd(*shape), indices], dynamic=dynamic)


def test_gather_nd_batch_dims_is_refused():
    m = node_model("GatherND", [rnd(2, 3), np.array([[1], [0]])], attrs={"batch_dims": 1})
    with pytest.raises(GradientNotImplementedError, match="batch_dims"):
        onnxgrad.build_gradient(m, inputs_requiring_grad=["in0"])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("shape", "indices", "axis"),
    [
        ((3, 4), np.array([[0, 2, 2], [1, 1, 0], [0, 0, 0]]), 1),
        ((3, 4), np.array([[2, 0, 1, -1], [2, 2, 2, 0]]), 0),
        ((2, 3, 2), np.array([[[1], [0]], [[2], [-3]]]), -2),
    ],
)
def test_gather_elements(shape, indices, axis, dynamic):
    check_op("GatherElements", [rnd(*shape), indices], attrs={"axis": axis}, dynamic=dynamic)
