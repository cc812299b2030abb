"""Gradient checks of the matrix-product rules (rules/linalg.py): MatMul, Gemm, Einsum, Det.

Every rule is checked against float64 central finite differences: through onnxruntime where it has
float64 kernels (MatMul, Gemm, Einsum), else through onnx.reference on tiny shapes plus one float32
onnxruntime check (Det). Einsum and Det are also compared with torch autograd in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import Backend, check_gradients, check_op, node_model, run_model
from tests.autodiff.conftest import declared_symbolic, ensure_output_shape
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

F32 = np.float32


def torch_grads(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    fn: Callable[..., torch.Tensor],
    *,
    backend: Backend = "onnxruntime",
    opset: int = 18,
    wrt: Sequence[int] | None = None,
    rtol: float = 1e-8,
    dims: dict[int, Sequence[int]] | None = None,
) -> None:
    """Compare the output and input gradients of a one-node model with torch autograd (float64).

    ``fn`` takes one tensor per input (None for absent ones); ``wrt``: indices of the inputs to
    differentiate (default: every floating-point one); ``dims``: the input dims declared symbolic
    (``declared_symbolic``), None for all static. Shared by the other rule test modules.
    """
    model = declared_symbolic(node_model(op, inputs, attrs=attrs, opset=opset), dims)
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    if wrt is None:
        wrt = [i for i, x in enumerate(inputs) if x is not None and np.asarray(x).dtype.kind == "f"]
    names = [f"in{i}" for i in wrt]
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=names)
    out = run_model(graphs.forward, backend)(feeds)
    y = out["out0"]
    cot = rng().standard_normal(y.shape).astype(y.dtype)
    bfeeds = {s: out[s] if s in out else feeds[s] for s in graphs.saved}
    bfeeds[graphs.grad_inputs["out0"]] = cot
    res = run_model(graphs.backward, backend)(bfeeds)
    ts = [
        None if x is None else torch.tensor(np.asarray(x), requires_grad=i in wrt)
        for i, x in enumerate(inputs)
    ]
    ty = fn(*ts)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=rtol, atol=1e-10)
    for i, name in zip(wrt, names):
        expected = ts[i].grad.numpy()  # type: ignore[union-attr]
        np.testing.assert_allclose(
            res[graphs.grad_outputs[name]], expected, rtol=rtol, atol=1e-10, err_msg=name
        )


# ---- MatMul ---------------------------------------------------------------------------------
MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (2, 4, 5)),  # batched
    ((2, 1, 3, 4), (3, 4, 2)),  # broadcast batch
    ((3, 4), (2, 4, 5)),  # matrix times a batch
    ((2, 3, 4), (4, 5)),  # batch times a matrix (Linear)
    ((4,), (4,)),  # dot
    ((4,), (2, 4, 3)),  # vector on the left
    ((2, 3, 4), (4,)),  # vector on the right
    ((4,), (4, 3)),
    ((3, 4), (4,)),
]


@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES, ids=[f"{a}x{b}" for a, b in MATMUL_SHAPES])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_matmul(sa: tuple, sb: tuple, dynamic: bool) -> None:
    check_op("MatMul", [rnd(*sa), rnd(*sb)], dynamic=dynamic)


def test_matmul_one_side_constant() -> None:
    check_op("MatMul", [rnd(2, 3, 4), rnd(4, 5)], constant=[1])
    check_op("MatMul", [rnd(2, 3, 4), rnd(4, 5)], constant=[0])


# ---- Gemm -----------------------------------------------------------------------------------
GEMM_C_SHAPES = [None, (), (1,), (5,), (3, 1), (1, 5), (3, 5)]


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize(("alpha", "beta"), [(1.0, 1.0), (0.7, -1.3)])
def test_gemm_transposes_and_scales(trans_a: int, trans_b: int, alpha: float, beta: float) -> None:
    a = rnd(4, 3) if trans_a else rnd(3, 4)
    b = rnd(5, 4) if trans_b else rnd(4, 5)
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}
    check_op("Gemm", [a, b, rnd(3, 5)], attrs=attrs)


@pytest.mark.parametrize("c_shape", GEMM_C_SHAPES, ids=[str(s) for s in GEMM_C_SHAPES])
@pytest.mark.parametrize("opset", [11, 13])
def test_gemm_bias_broadcast(c_shape: tuple | None, opset: int) -> None:
    c = None if c_shape is None else rnd(*c_shape)
    inputs = [rnd(4, 3), rnd(4, 5)] + ([c] if c is not None else [])
    check_op("Gemm", inputs, attrs={"transA": 1, "beta": 0.5}, opset=opset)


@pytest.mark.parametrize("opset", [7, 9])
def test_gemm_old_opsets(opset: int) -> None:
    check_op("Gemm", [rnd(3, 4), rnd(5, 4), rnd(5)], attrs={"transB": 1, "alpha": 2.0}, opset=opset)


def test_gemm_dynamic() -> None:
    check_op("Gemm", [rnd(3, 4), rnd(4, 5), rnd(1, 5)], attrs={"beta": 2.0}, dynamic=True)


# ---- Einsum ---------------------------------------------------------------------------------
EINSUM_CASES = [
    # (equation, operand shapes)
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("ij,kj", [(3, 4), (5, 4)]),  # implicit output "ik"
    ("i,j->ij", [(3,), (4,)]),  # outer product
    ("ij->", [(3, 4)]),  # full sum: every letter is missing from the output
    ("ij->j", [(3, 4)]),
    ("ij->ji", [(3, 4)]),
    ("ii->i", [(4, 4)]),  # diagonal
    ("ii", [(4, 4)]),  # trace (implicit "")
    ("iij->j", [(3, 3, 2)]),
    ("ii,i->i", [(3, 3), (3,)]),
    ("iji,jk->ik", [(3, 2, 3), (2, 4)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 5)]),  # broadcast ellipsis
    ("...ij,jk->...ik", [(2, 3, 3, 4), (4, 5)]),
    ("i...j,j...->i...", [(3, 2, 4), (4, 2)]),  # ellipsis in the middle
    ("...i,...i->...", [(1, 3, 4), (2, 1, 4)]),  # size-1 ellipsis dims on both sides
    ("...ii->...i", [(2, 3, 3)]),
    ("b...,b->...", [(2, 3, 4), (2,)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),  # three operands
    ("ab,bc,ca->", [(2, 3), (3, 4), (4, 2)]),
    ("i,i,i->i", [(4,), (4,), (4,)]),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
    (",ij->ij", [(), (2, 3)]),  # a scalar operand
    ("Ab,bA->A", [(3, 4), (4, 3)]),  # upper-case letters
]


def check_einsum(equation: str, inputs: list[np.ndarray], dynamic: bool = False) -> None:
    """check_op for Einsum, declaring the output shape where inference gives up (broadcast '...')."""
    model = node_model("Einsum", inputs, attrs={"equation": equation}, opset=12, dynamic=dynamic)
    ensure_output_shape(model, np.einsum(equation, *inputs).shape, dynamic)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    result = check_gradients(model, feeds, wrt=list(feeds))
    assert result.ok, result.report()


@pytest.mark.parametrize(("equation", "shapes"), EINSUM_CASES, ids=[c[0] for c in EINSUM_CASES])
def test_einsum(equation: str, shapes: list[tuple]) -> None:
    check_einsum(equation, [rnd(*s) for s in shapes])


@pytest.mark.parametrize("index", [1, 3, 9, 13, 16, 17], ids=lambda i: EINSUM_CASES[i][0])
def test_einsum_dynamic(index: int) -> None:
    equation, shapes = EINSUM_CASES[index]
    check_einsum(equation, [rnd(*s) for s in shapes], dynamic=True)


def test_einsum_opset28() -> None:
    """Einsum-28 (same signature) on onnx.reference: onnxruntime 1.31 loads opsets up to 26."""
    check_op(
        "Einsum", [rnd(2, 3, 3), rnd(3, 4)], attrs={"equation": "bii,ij->bj"}, opset=28, backend="reference"
    )


def test_einsum_same_value_twice() -> None:
    """x used as both operands of ``ij,ij->``: the two contributions add up (gradient 2 x)."""
    model = node_model("Einsum", [rnd(3, 4), rnd(3, 4)], attrs={"equation": "ij,ij->"})
    node = model.graph.node[0]
    node.input[1] = node.input[0]
    del model.graph.input[1]
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    x = rnd(3, 4)
    out = run_model(graphs.forward)({"in0": x})
    feeds = {s: out.get(s, x) for s in graphs.saved}
    feeds[graphs.grad_inputs["out0"]] = np.array(1.5)
    res = run_model(graphs.backward)(feeds)
    np.testing.assert_allclose(res[graphs.grad_outputs["in0"]], 3.0 * x, rtol=1e-12)


@pytest.mark.parametrize(
    ("equation", "shapes"),
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ii,i->i", [(3, 3), (3,)]),
        ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 5)]),
    ],
)
def test_einsum_versus_torch(equation: str, shapes: list[tuple]) -> None:
    inputs = [rnd(*s) for s in shapes]
    torch_grads("Einsum", inputs, {"equation": equation}, lambda *t: torch.einsum(equation, *t), opset=12)


def test_einsum_unknown_rank_with_ellipsis_is_unsupported() -> None:
    """An operand of unknown rank (here from a Reshape to a shape read at run time) under '...'."""
    nodes = [
        helper.make_node("Reshape", ["x", "s"], ["r"]),
        helper.make_node("Einsum", ["r", "w"], ["e"], equation="...j,jk->...k"),
        helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3]),
            helper.make_tensor_value_info("s", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [3, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version_for(model.opset_import)
    with pytest.raises(GradientNotImplementedError, match=r"Einsum node .*rank of input 0 must be known"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["x"])


# ---- Det ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (2, 4, 4), (2, 1, 3, 3)])
def test_det_reference(shape: tuple) -> None:
    """float64 through onnx.reference: onnxruntime has no float64 Det."""
    check_op("Det", [rnd(*shape)], backend="reference", opset=11)


@pytest.mark.parametrize("shape", [(2, 3, 3), (2, 1, 1)])
def test_det_dynamic_size(shape: tuple) -> None:
    check_op("Det", [rnd(*shape)], backend="reference", dynamic=True)
    check_op("Det", [rnd(*shape).astype(F32) + np.eye(shape[-1], dtype=F32)], dynamic=True)


@pytest.mark.parametrize("opset", [11, 22])
def test_det_onnxruntime_float32(opset: int) -> None:
    check_op("Det", [rnd(2, 3, 3).astype(F32) + 2 * np.eye(3, dtype=F32)], opset=opset)


def test_det_of_singular_matrix_is_its_cofactor_matrix() -> None:
    """A rank-1 3x3 matrix: det is 0, its gradient the (nonzero, rank-deficient) cofactor matrix."""
    u, v = rnd(3, 1), rnd(1, 3)
    x = np.stack([u @ v, np.diag([1.0, 2.0, 0.0])])  # rank 1, and a singular diagonal
    model = node_model("Det", [x])
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    out = run_model(graphs.forward, "reference")({"in0": x})
    feeds = {s: out.get(s, x) for s in graphs.saved}
    feeds[graphs.grad_inputs["out0"]] = np.ones(2)
    dx = run_model(graphs.backward, "reference")(feeds)[graphs.grad_outputs["in0"]]
    assert np.all(np.isfinite(dx))
    np.testing.assert_allclose(dx[1], np.diag([0.0, 0.0, 2.0]), atol=1e-12)
    cof = np.array(
        [
            [(-1) ** (i + j) * np.linalg.det(np.delete(np.delete(x[0], i, 0), j, 1)) for j in range(3)]
            for i in range(3)
        ]
    )
    np.testing.assert_allclose(dx[0], cof, atol=1e-12)
    check_op("Det", [x], backend="reference")  # finite differences agree there too


def _cofactor_matrix(a: np.ndarray) -> np.ndarray:
    n = a.shape[-1]
    return np.array(
        [
            [(-1) ** (i + j) * np.linalg.det(np.delete(np.delete(a, i, 0), j, 1)) for j in range(n)]
            for i in range(n)
        ]
    )


@pytest.mark.parametrize(
    "n, rank", [(3, 2), (3, 1), (4, 2), (4, 3)], ids=["3x3-rank2", "3x3-rank1", "4x4-rank2", "4x4-rank3"]
)
def test_det_gradient_at_singular_matrices_is_the_adjugate_transpose(n: int, rank: int) -> None:
    """d det(A)/dA = adj(A)^T (the cofactor matrix), finite where A has no inverse: nonzero and of
    rank 1 for rank n-1, zero for rank n-2 (every (n-1)-minor vanishes)."""
    a = rnd(n, rank) @ rnd(rank, n)
    model = node_model("Det", [a])
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    out = run_model(graphs.forward, "reference")({"in0": a})
    feeds = {s: out.get(s, a) for s in graphs.saved}
    feeds[graphs.grad_inputs["out0"]] = np.array(1.0)
    dx = run_model(graphs.backward, "reference")(feeds)[graphs.grad_outputs["in0"]]
    assert dx.shape == (n, n) and np.all(np.isfinite(dx))
    cof = _cofactor_matrix(a)
    np.testing.assert_allclose(dx, cof, atol=1e-10)
    if rank == n - 1:
        assert np.linalg.matrix_rank(dx, tol=1e-8) == 1
    else:
        np.testing.assert_allclose(dx, 0.0, atol=1e-10)
    check_op("Det", [a], backend="reference")  # finite differences of the polynomial agree
    check_op("Det", [a], backend="reference", opset=22, dynamic=True)


def test_det_versus_torch() -> None:
    torch_grads("Det", [rnd(2, 3, 3)], {}, torch.linalg.det, backend="reference")
