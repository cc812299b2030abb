"""Ops that stop the gradient (rules/nondiff.py): accepted anywhere in a graph, contributing
nothing.

Each model of ``test_stop_gradient_op`` computes ``y = x * cast(op(x...))``: the op's result acts
as a constant, so dy/dx is exactly that constant (as float) — a gradient flowing through the op
would change it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.registry import lookup, supported_ops
from onnxgrad.errors import GradientWarning
from onnxgrad.testing import check_gradients, check_op, node_model, run_gradients
from tests.autodiff.conftest import F32, D, assert_ok, graph_model, model
from tests.autodiff.random_data import rnd  # one generator per test (conftest.py)
from tests.models import make_model

X = np.array([[-1.5, 0.25, 2.0], [3.0, -0.5, 0.0], [1.0, 1.0, -2.0]])


def _bools(prefix):
    return [
        helper.make_node("Greater", ["x", "zero"], [f"{prefix}a"]),
        helper.make_node("Less", ["x", "one"], [f"{prefix}b"]),
    ]


CASES = {
    "Ceil": [helper.make_node("Ceil", ["x"], ["c"])],
    "Sign": [helper.make_node("Sign", ["x"], ["c"])],
    "IsInf": [helper.make_node("IsInf", ["x"], ["c"])],
    "GreaterOrEqual": [helper.make_node("GreaterOrEqual", ["x", "zero"], ["c"])],
    "LessOrEqual": [helper.make_node("LessOrEqual", ["x", "zero"], ["c"])],
    "ArgMin": [helper.make_node("ArgMin", ["x"], ["c"], axis=1, keepdims=1)],
    "EyeLike": [helper.make_node("EyeLike", ["x"], ["c"])],
    "Not": [*_bools("p"), helper.make_node("Not", ["pa"], ["c"])],
    "And": [*_bools("p"), helper.make_node("And", ["pa", "pb"], ["c"])],
    "Or": [*_bools("p"), helper.make_node("Or", ["pa", "pb"], ["c"])],
    "Xor": [*_bools("p"), helper.make_node("Xor", ["pa", "pb"], ["c"])],
}


EXPECTED = {
    "Ceil": np.ceil,
    "Sign": np.sign,
    "IsInf": np.isinf,
    "GreaterOrEqual": lambda x: x >= 0,
    "LessOrEqual": lambda x: x <= 0,
    "ArgMin": lambda x: np.argmin(x, axis=1)[:, None],
    "EyeLike": lambda x: np.eye(*x.shape),
    "Not": lambda x: ~(x > 0),
    "And": lambda x: (x > 0) & (x < 1),
    "Or": lambda x: (x > 0) | (x < 1),
    "Xor": lambda x: (x > 0) ^ (x < 1),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_stop_gradient_op(op):
    assert onnxgrad.supported_ops()[op] == "zero"
    nodes = [
        *CASES[op],
        helper.make_node("Cast", ["c"], ["cf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "cf"], ["y"]),
    ]
    model = make_model(
        nodes,
        [("x", np.float64, [3, 3])],
        [("y", np.float64, [3, 3])],
        {"zero": np.array(0.0), "one": np.array(1.0)},
    )
    onnx.checker.check_model(model, full_check=True)
    got = onnxgrad.gradients(model, {"x": X}, wrt=["x"])["x"]
    np.testing.assert_array_equal(got, np.broadcast_to(EXPECTED[op](X), X.shape).astype(float))


def test_stop_gradient_ops_are_declared_in_one_module():
    """Every zero-gradient declaration lives in rules/nondiff.py, and each rule names its module."""
    from onnxgrad.autodiff.registry import lookup, rules_table

    declared = [r for r in rules_table() if r.kind == "zero"]
    assert declared and {r.file for r in declared} == {"rules/nondiff.py"}
    assert lookup("", "Relu", 14).file == "rules/elementwise.py"  # a formula
    assert lookup("", "MaxPool", 12).file == "rules/pool.py"  # a rule


def test_hardmax_has_zero_gradient() -> None:
    check_op("Hardmax", [rnd(3, 4, dtype=F32)], attrs={"axis": -1}, opset=13)


ZERO_OPS = [
    "OptionalHasElement",
    "BitCast",
    "QLinearConv",
    "QLinearMatMul",
    "ImageDecoder",
    "MelWeightMatrix",
]


@pytest.mark.parametrize("op", ZERO_OPS)
def test_zero_declarations(op: str) -> None:
    r = lookup("", op, 26)
    assert r is not None and r.kind == "zero" and r.note
    assert supported_ops()[op] == "zero"


def test_optional_has_element_stops_gradient() -> None:
    """``y = x * Cast(OptionalHasElement(Optional(x)))``: only the direct path carries a gradient."""
    x = helper.make_tensor_value_info("x", D, [3])
    y = helper.make_tensor_value_info("y", D, [3])
    nodes = [
        helper.make_node("Optional", ["x"], ["o"]),
        helper.make_node("OptionalHasElement", ["o"], ["h"]),
        helper.make_node("Cast", ["h"], ["hf"], to=D),
        helper.make_node("Mul", ["x", "hf"], ["y"]),
    ]
    graphs = build_gradient(graph_model(nodes, [x], [y]), inputs_requiring_grad=["x"])
    _, grads = run_gradients(graphs, {"x": np.arange(3.0)})
    np.testing.assert_array_equal(grads["x"], np.ones(3))


def test_quantize_dequantize_stops_gradient_under_quantized_zero() -> None:
    """quantized="zero": a QDQ pair between a weight and the output stops the weight's gradient
    (with a GradientWarning naming it), the rest flows (rules/quant.py has the "ste" default)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    inits = [
        numpy_helper.from_array(np.float32([0.5, -1, 2, 0.3]), "w"),
        numpy_helper.from_array(np.float32(0.1), "scale"),
        numpy_helper.from_array(np.int8(0), "zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "scale", "zp"], ["q"], name="q"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["wq"]),
        helper.make_node("Mul", ["x", "wq"], ["y"]),
    ]
    with pytest.warns(GradientWarning, match=r"'w' by node 'q' \(QuantizeLinear\)"):
        graphs = build_gradient(
            graph_model(nodes, [x], [y], inits=inits),
            trainable=["w"],
            inputs_requiring_grad=["x"],
            quantized="zero",
        )
    xv = np.float32([1, 2, 3, 4])
    _, grads = run_gradients(graphs, {"x": xv})
    np.testing.assert_array_equal(grads["w"], np.zeros(4, np.float32))
    np.testing.assert_allclose(grads["x"], np.float32([0.5, -1, 2, 0.3]), rtol=1e-6)


# ---- ops that stop gradients -------------------------------------------------------------------
def test_nondifferentiable_ops_in_the_path():
    # y = Where(x > 0, x, zeros(shape(x))) + x * Floor(x) * Cast(ArgMax(x)) ; the stopped ops
    # (Shape, ConstantOfShape, Greater, Floor, ArgMax) contribute no gradient.
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node(
            "ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.zeros(1, np.float64))
        ),
        helper.make_node("Greater", ["x", "z"], ["pos"]),
        helper.make_node("Where", ["pos", "x", "z"], ["relu"]),
        helper.make_node("Floor", ["x"], ["fl"]),
        helper.make_node("ArgMax", ["x"], ["am"], axis=1, keepdims=1),
        helper.make_node("Cast", ["am"], ["amf"], to=TensorProto.DOUBLE),
        helper.make_node("Mul", ["x", "fl"], ["t"]),
        helper.make_node("Mul", ["t", "amf"], ["u"]),
        helper.make_node("Add", ["relu", "u"], ["y"]),
    ]
    m = model(nodes, [("x", np.float64, ["n", 4])], [("y", np.float64, None)])
    x = away_from(away_from(rnd(3, 4) * 3, [0.0]), [-2.0, -1.0, 1.0, 2.0])
    assert_ok(check_gradients(m, {"x": x}))
    got = onnxgrad.gradients(m, {"x": x}, {"y": np.ones_like(x)}, wrt=["x"])
    am = np.argmax(x, axis=1)[:, None]
    np.testing.assert_allclose(got["x"], (x > 0) + np.floor(x) * am)


def test_nondiff_declarations():
    ops = onnxgrad.supported_ops()
    for op in (
        "Shape",
        "Size",
        "ConstantOfShape",
        "Equal",
        "ArgMax",
        "Floor",
        "Round",
        "NonZero",
        "RandomNormalLike",
        "BitwiseAnd",
        "IsNaN",
    ):
        assert ops[op] == "zero", op
    for op in (
        "Reshape",
        "Slice",
        "Gather",
        "Pad",
        "Tile",
        "Clip",
        "Where",
        "DepthToSpace",
        "Range",
        "OneHot",
    ):
        assert ops[op] == "rule", op


# ---- no gradient ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["QLinearMatMul", "QLinearConv"])
def test_requantizing_products_have_no_gradient(op: str) -> None:
    found = lookup("", op, 21)
    assert found is not None and found.kind == "zero"
    assert lookup("", "MatMulInteger", 21).file == "rules/quant.py"


def away_from(x: np.ndarray, points: list[float], gap: float = 0.05) -> np.ndarray:
    """``x`` with values near ``points`` (kinks) pushed away, so finite differences are exact."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


# ---- the standing net: every zero-gradient declaration is proven -------------------------------
# For each op declared with zero(...) and each input that may be floating-point (by its ONNX
# schema), one of: its outputs are not floating-point and it is proven piecewise constant below, or
# finite differences on random valid inputs are exactly zero (FD_CASES), or a reason (JUSTIFIED).
_FLOAT_TYPE_STRS = ("tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)")


def _float_inputs(op: str, domain: str) -> list[str]:
    """The inputs of ``op`` that the schema lets be floating-point (or an optional/sequence of)."""
    schema = onnx.defs.get_schema(op, 26, domain)
    allowed = {t.type_param_str: t.allowed_type_strs for t in schema.type_constraints}
    return [
        i.name
        for i in schema.inputs
        if any(f in a for a in allowed.get(i.type_str, [i.type_str]) for f in _FLOAT_TYPE_STRS)
    ]


def _r(*shape: int) -> np.ndarray:
    return rnd(*shape) * 2


# op -> (inputs, attributes, opset): inputs whose dtype is float are perturbed, one element at a time
FD_CASES: dict[str, tuple[list, dict, int]] = {
    "ArgMax": ([_r(3, 4)], {"axis": 1}, 13),
    "ArgMin": ([_r(3, 4)], {"axis": 0}, 13),
    "Ceil": ([_r(3, 4)], {}, 13),
    "Floor": ([_r(3, 4)], {}, 13),
    "Round": ([_r(3, 4)], {}, 22),
    "Sign": ([_r(3, 4)], {}, 13),
    "Equal": ([_r(3, 4), _r(3, 4)], {}, 19),
    "Greater": ([_r(3, 4), _r(3, 4)], {}, 13),
    "GreaterOrEqual": ([_r(3, 4), _r(3, 4)], {}, 16),
    "Less": ([_r(3, 4), _r(3, 4)], {}, 13),
    "LessOrEqual": ([_r(3, 4), _r(3, 4)], {}, 16),
    "Hardmax": ([_r(3, 4)], {"axis": -1}, 13),
    "IsInf": ([np.array([1.0, -np.inf, 3.0, np.inf], np.float32)], {}, 20),
    "IsNaN": ([np.array([1.0, np.nan, 3.0], np.float32)], {}, 20),
    "NonZero": ([_r(3, 4)], {}, 13),  # the indices of the nonzero elements: none is near zero
    "EyeLike": ([_r(3, 4)], {}, 22),
    "Shape": ([_r(3, 4)], {}, 25),
    "Size": ([_r(3, 4)], {}, 25),
    "NonMaxSuppression": (
        [
            np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 2, 1, 3], [0, 2.05, 1, 3.1]]], np.float32),
            np.array([[[0.9, 0.75, 0.6, 0.95]]], np.float32),
            np.array([5], np.int64),
            np.array([0.5], np.float32),
            np.array([0.1], np.float32),
        ],
        {},
        11,
    ),
    "QLinearMatMul": (
        [
            np.array([[10, -3], [4, 7]], np.int8),
            np.array(0.0307, np.float32),
            np.array(1, np.int8),
            np.array([[-5, 2], [9, 1]], np.int8),
            np.array(0.0413, np.float32),
            np.array(0, np.int8),
            np.array(0.0171, np.float32),
            np.array(-2, np.int8),
        ],
        {},
        21,
    ),
    "QLinearConv": (
        [
            np.arange(16, dtype=np.uint8).reshape(1, 1, 4, 4) * 7,
            np.array(0.0213, np.float32),
            np.array(3, np.uint8),
            np.array([[[[1, -2], [3, 4]]]], np.int8),
            np.array(0.0371, np.float32),
            np.array(0, np.int8),
            np.array(0.0523, np.float32),
            np.array(5, np.uint8),
        ],
        {},
        10,
    ),
    "MelWeightMatrix": (
        [
            np.array(8, np.int64),
            np.array(32, np.int64),
            np.array(8000, np.int64),
            np.array(130.3, np.float32),
            np.array(3407.7, np.float32),
        ],
        {},
        17,
    ),
}

JUSTIFIED = {
    "Bernoulli": "a random 0/1 draw with probability p: piecewise constant in p, and a new draw each run",
    "Multinomial": "random class indices (integers), a new draw each run",
    "RandomNormalLike": "a random draw shaped like the input: its values are not read",
    "RandomUniformLike": "a random draw shaped like the input: its values are not read",
    "BitCast": "reinterprets the bits as another type: not a function of the real value",
    "OptionalHasElement": "whether an optional holds a value (test_optional_has_element_stops_gradient)",
    "SequenceLength": "the length of a sequence, an integer",
}


def test_every_zero_declaration_is_proven() -> None:
    """Each op declared with zero(...) has no input that may be floating-point, or is in FD_CASES
    (finite differences checked below) or JUSTIFIED."""
    from onnxgrad.autodiff.registry import rules_table

    unproven = []
    for r in rules_table():
        if r.kind != "zero" or r.op_type in FD_CASES or r.op_type in JUSTIFIED:
            continue
        if _float_inputs(r.op_type, r.domain):
            unproven.append(r.op_type)
    assert not unproven, (
        f"zero-gradient ops with floating-point inputs, neither checked nor justified: {unproven}"
    )
    assert set(FD_CASES) | set(JUSTIFIED) <= set(supported_ops())


def _one_node(op: str, inputs: list, attrs: dict, opset: int) -> onnx.ModelProto:
    """A one-node model: float inputs are graph inputs ``in{i}``, the others initializers; every
    output typed by shape inference."""
    names, graph_inputs, inits = [], [], []
    for i, a in enumerate(inputs):
        name = f"in{i}"
        names.append(name)
        if a.dtype.kind == "f":
            graph_inputs.append(
                helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            )
        else:
            inits.append(numpy_helper.from_array(a, name))
    schema = onnx.defs.get_schema(op, opset, "")
    outs = [f"out{k}" for k in range(len(schema.outputs))]
    node = helper.make_node(op, names, outs, **attrs)
    graph = helper.make_graph([node], op, graph_inputs, [], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v for v in inferred.graph.value_info}
    model.graph.output.extend(types[o] for o in outs if o in types)
    return model


def _finite_differences(
    op: str, inputs: list, attrs: dict, opset: int, eps: float = 1e-4
) -> dict[str, float]:
    """The largest change of any output (as float64) when one element of one float input moves by
    +-eps, per input: zero for an op whose gradient is zero at these inputs."""
    import onnxruntime as ort

    model = _one_node(op, inputs, attrs, opset)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {f"in{i}": a for i, a in enumerate(inputs) if a.dtype.kind == "f"}

    def run(f: dict) -> list[np.ndarray]:
        return [np.asarray(o, dtype=np.float64) for o in sess.run(None, f)]

    base = run(feeds)
    worst = {}
    for name, a in feeds.items():
        change = 0.0
        for k in range(a.size):
            for sign in (1, -1):
                moved = a.copy()
                v = float(a.flat[k])
                moved.flat[k] += sign * eps * (max(1.0, abs(v)) if np.isfinite(v) else 1.0)
                for b, m in zip(base, run({**feeds, name: moved})):
                    if b.shape != m.shape:
                        return {name: np.inf}
                    both = np.isfinite(b) & np.isfinite(m)
                    change = max(change, float(np.abs(b[both] - m[both]).max(initial=0.0)))
                    change = max(change, float(np.sum(np.isfinite(b) != np.isfinite(m))))
        worst[name] = change
    return worst


@pytest.mark.parametrize("op", sorted(FD_CASES))
def test_zero_declaration_has_zero_finite_differences(op: str) -> None:
    assert onnxgrad.supported_ops()[op] == "zero"
    inputs, attrs, opset = FD_CASES[op]
    inputs = [
        np.asarray(a, dtype=np.float32) if np.asarray(a).dtype == np.float64 else np.asarray(a)
        for a in inputs
    ]
    changes = _finite_differences(op, inputs, attrs, opset)
    assert changes and all(c == 0 for c in changes.values()), changes


def test_the_net_sees_a_nonzero_gradient() -> None:
    """The check above fails for an op with a gradient (it is not vacuous)."""
    changes = _finite_differences("Neg", [np.float32([1.0, -2.0])], {}, 13)
    assert changes["in0"] > 0


# ---- ops the net found declared zero but differentiable -----------------------------------------
def test_range_gradient_in_start_and_delta() -> None:
    """Range(start, limit, delta) = start + i delta: linear in start and delta (the limit only sets
    the length, 7 here, far from a change)."""
    check_op("Range", [np.array(0.3), np.array(2.45), np.array(0.3)], opset=11)


def test_one_hot_gradient_in_values() -> None:
    """OneHot(indices, depth, [off, on]) is linear in the values."""
    check_op(
        "OneHot", [np.array([[0, 3], [2, 1]], np.int64), np.array(4, np.int64), rnd(2, dtype=F32)], opset=11
    )


@pytest.mark.parametrize("axis", [None, 0])
def test_unique_gradient(axis: int | None) -> None:
    """Unique's values (rows with axis=0) are copies of their first occurrence: finite differences
    agree (distinct values), and a repeated copy gets no gradient (perturbing it would split it)."""
    attrs = {} if axis is None else {"axis": axis}
    check_op("Unique", [rnd(4, 3)], attrs=attrs, opset=11)
    x = rnd(4, 3)
    x[2] = x[0]
    graphs = build_gradient(node_model("Unique", [x], attrs=attrs, opset=11), inputs_requiring_grad=["in0"])
    _, grads = run_gradients(graphs, {"in0": x})
    want = np.ones_like(x)
    want[2] = 0
    np.testing.assert_array_equal(grads["in0"], want)
