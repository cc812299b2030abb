"""Elementwise gradient rules (rules/elementwise.py): unary, binary (with broadcasting undone) and
variadic ops, Where, Clip, Cast and Dropout.

Every rule is checked against float64 central finite differences (``onnxgrad.testing.check_op``)
with inputs kept away from kinks and domain edges; ``dynamic=True`` gives the float inputs symbolic
dims, which exercises the run-time un-broadcasting. onnxruntime has no float64 kernel for some ops
(the inverse and hyperbolic trig functions, Tan, Erf, Celu, Mean): those run on ``onnx.reference``.
The conventions at kinks and ties are compared with torch autograd in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto

import onnxgrad
from onnxgrad.testing import check_gradients, check_op, node_model, run_gradients
from tests.autodiff.random_data import rnd, rng  # one generator per test (conftest.py)

REF = "reference"
ORT = "onnxruntime"


def rand(*shape: int) -> np.ndarray:
    return rng().standard_normal(shape)


def uniform(lo: float, hi: float) -> Callable[..., np.ndarray]:
    return lambda *shape: rng().uniform(lo, hi, shape)


def away_from(x: np.ndarray, points: list[float], gap: float = 0.1) -> np.ndarray:
    """``x`` with values near ``points`` (kinks) pushed away, so finite differences are exact."""
    x = np.array(x, dtype=np.float64)
    for p in points:
        near = np.abs(x - p) < gap
        x[near] = p + np.where(x[near] >= p, gap, -gap)
    return x


def normal(scale: float = 1.0, kinks: tuple[float, ...] = ()) -> Callable[..., np.ndarray]:
    return lambda *shape: away_from(scale * rand(*shape), list(kinks))


def magnitude(lo: float, hi: float) -> Callable[..., np.ndarray]:
    """Values with |x| in [lo, hi] and random signs."""
    return lambda *shape: rng().uniform(lo, hi, shape) * rng().choice([-1.0, 1.0], shape)


# ---- unary -------------------------------------------------------------------------------------
# (op, input maker, attrs, opset, float64 backend)
UNARY: list[tuple[str, Callable[..., np.ndarray], dict[str, Any], int, str]] = [
    ("Identity", normal(), {}, 18, ORT),
    ("Neg", normal(), {}, 18, ORT),
    ("Exp", normal(), {}, 18, ORT),
    ("Log", uniform(0.3, 3.0), {}, 18, ORT),
    ("Sqrt", uniform(0.3, 3.0), {}, 18, ORT),
    ("Reciprocal", magnitude(0.5, 2.0), {}, 18, ORT),
    ("Abs", normal(kinks=(0,)), {}, 18, ORT),
    ("Relu", normal(kinks=(0,)), {}, 18, ORT),
    ("LeakyRelu", normal(kinks=(0,)), {}, 18, ORT),
    ("LeakyRelu", normal(kinks=(0,)), {"alpha": 0.3}, 18, ORT),
    ("Elu", normal(kinks=(0,)), {}, 18, ORT),
    ("Elu", normal(kinks=(0,)), {"alpha": 0.7}, 18, ORT),
    ("Sigmoid", normal(2.0), {}, 18, ORT),
    ("Tanh", normal(), {}, 18, ORT),
    ("Softplus", normal(2.0), {}, 18, ORT),
    ("Erf", normal(), {}, 18, REF),
    ("Gelu", normal(2.0), {}, 20, REF),
    ("Gelu", normal(2.0), {"approximate": "tanh"}, 20, REF),
    ("Sin", normal(2.0), {}, 18, ORT),
    ("Cos", normal(2.0), {}, 18, ORT),
    ("Tan", uniform(-1.2, 1.2), {}, 18, REF),
    ("Asin", uniform(-0.9, 0.9), {}, 18, REF),
    ("Acos", uniform(-0.9, 0.9), {}, 18, REF),
    ("Atan", normal(2.0), {}, 18, REF),
    ("Sinh", normal(), {}, 18, REF),
    ("Cosh", normal(), {}, 18, REF),
    ("Asinh", normal(2.0), {}, 18, REF),
    ("Acosh", uniform(1.1, 3.0), {}, 18, REF),
    ("Atanh", uniform(-0.9, 0.9), {}, 18, REF),
    ("Softsign", normal(2.0, kinks=(0,)), {}, 18, ORT),
    ("Selu", normal(kinks=(0,)), {}, 18, ORT),
    ("Selu", normal(kinks=(0,)), {"alpha": 1.3, "gamma": 0.8}, 18, ORT),
    ("Celu", normal(kinks=(0,)), {}, 18, REF),
    ("Celu", normal(kinks=(0,)), {"alpha": 0.6}, 18, REF),
    ("Shrink", normal(kinks=(-0.5, 0.5)), {}, 18, REF),
    ("Shrink", normal(kinks=(-0.4, 0.4)), {"lambd": 0.4, "bias": 0.25}, 18, REF),
    ("ThresholdedRelu", normal(2.0, kinks=(1.0,)), {}, 18, ORT),
    ("ThresholdedRelu", normal(kinks=(-0.3,)), {"alpha": -0.3}, 18, ORT),
    ("HardSigmoid", normal(3.0, kinks=(-2.5, 2.5)), {}, 18, ORT),
    ("HardSigmoid", normal(3.0, kinks=(-4 / 3, 2.0)), {"alpha": 0.3, "beta": 0.4}, 18, ORT),
    ("HardSwish", normal(3.0, kinks=(-3.0, 3.0)), {}, 18, ORT),
    ("Mish", normal(2.0), {}, 18, ORT),
    ("Swish", normal(2.0), {}, 24, ORT),
    ("Swish", normal(2.0), {"alpha": 0.7}, 24, ORT),
]


def _id(case: tuple) -> str:
    op, _, attrs, opset, _ = case
    return op + "".join(f"-{k}={v}" for k, v in attrs.items()) + ("" if opset == 18 else f"@{opset}")


@pytest.mark.parametrize(
    ("shape", "dynamic"), [((), False), ((7,), False), ((7,), True), ((2, 3, 4), False), ((2, 3, 4), True)]
)
@pytest.mark.parametrize("case", UNARY, ids=[_id(c) for c in UNARY])
def test_unary(case, shape, dynamic):
    op, make, attrs, opset, backend = case
    check_op(op, [make(*shape)], attrs=attrs, opset=opset, dynamic=dynamic, backend=backend)


@pytest.mark.parametrize("case", UNARY, ids=[_id(c) for c in UNARY])
def test_unary_float32_on_onnxruntime(case):
    """Every backward graph also runs on onnxruntime in float32 (kernels exist for all its ops)."""
    op, make, attrs, opset, _ = case
    x = make(3, 4).astype(np.float32)
    check_op(op, [x], attrs=attrs, opset=opset, dynamic=True)


def test_unary_reads_only_what_it_needs():
    """Formulas that read y save the output, not the input."""
    for op in ("Exp", "Sigmoid", "Tanh", "Relu", "Sqrt", "Tan", "Celu", "Selu", "HardSigmoid"):
        m = node_model(op, [rand(2, 3)])
        graphs = onnxgrad.build_gradient(m, inputs_requiring_grad=["in0"])
        assert graphs.saved == ["out0"], (op, graphs.saved)


# ---- binary, with broadcasting undone ----------------------------------------------------------
BROADCASTS = [
    ((3, 4), (3, 4)),
    ((3, 4), (4,)),  # b broadcast
    ((4,), (3, 4)),  # a broadcast
    ((2, 1, 4), (3, 1)),  # both ways
    ((1,), (2, 3)),
    ((), (2, 3)),  # scalar
    ((2, 3, 1), (1, 1, 4)),
]

BINARY: list[tuple[str, Callable[..., np.ndarray], Callable[..., np.ndarray], str]] = [
    ("Add", normal(), normal(), ORT),
    ("Sub", normal(), normal(), ORT),
    ("Mul", normal(), normal(), ORT),
    ("Div", normal(), magnitude(0.5, 2.0), ORT),
    ("Pow", uniform(0.5, 2.0), normal(), ORT),
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("sa", "sb"), BROADCASTS)
@pytest.mark.parametrize("case", BINARY, ids=[c[0] for c in BINARY])
def test_binary(case, sa, sb, dynamic):
    op, make_a, make_b, backend = case
    check_op(op, [make_a(*sa), make_b(*sb)], dynamic=dynamic, backend=backend)


def test_pow_integer_exponent_and_negative_base():
    a = away_from(rand(3, 4), [0.0])
    check_op("Pow", [a, np.array([2, 3, 1, 4], dtype=np.int64)])  # exponent an initializer
    res = check_gradients(
        node_model("Pow", [a, np.array([2.0, 3.0, 1.0, 4.0])]),
        {"in0": a, "in1": np.array([2.0, 3.0, 1.0, 4.0])},
        wrt=["in0"],
    )
    assert res.ok, res.report()


def test_pow_exponent_gradient_at_zero_base_is_zero():
    a = np.array([0.0, 0.0, 1.5])
    b = np.array([2.0, 0.0, 1.3])
    got = onnxgrad.gradients(
        node_model("Pow", [a, b]), {"in0": a, "in1": b}, {"out0": np.ones(3)}, wrt=["in1"]
    )["in1"]
    np.testing.assert_allclose(got, [0.0, 0.0, 1.5**1.3 * np.log(1.5)], rtol=1e-12)


def mod_inputs(sa: tuple[int, ...], sb: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """a, b with a / b away from integers (where fmod jumps)."""
    for _ in range(10_000):
        a, b = 3 * rand(*sa), magnitude(0.5, 2.0)(*sb)
        frac = np.abs(a / b) % 1.0
        if np.all((frac > 0.05) & (frac < 0.95)):
            return a, b
    raise RuntimeError("no inputs found")


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("sa", "sb"), BROADCASTS)
def test_mod(sa, sb, dynamic):
    a, b = mod_inputs(sa, sb)
    check_op("Mod", [a, b], attrs={"fmod": 1}, dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("sx", "ss"),
    [
        ((2, 3, 4), (2, 3, 4)),
        ((2, 3, 4), (4,)),
        ((2, 3, 4), (3, 1)),
        ((2, 3, 4), (1,)),
        ((2, 3, 4), ()),
        ((2, 3, 4), (1, 3, 1)),
    ],
)
def test_prelu(sx, ss, dynamic):
    check_op("PRelu", [normal(kinks=(0,))(*sx), rand(*ss)], dynamic=dynamic)


# ---- variadic ----------------------------------------------------------------------------------
VARIADIC_SHAPES = [
    [(3, 4)],
    [(3, 4), (3, 4)],
    [(3, 4), (4,)],
    [(1,), (2, 3)],
    [(2, 1, 4), (3, 1), (4,)],
    [(2, 3), (2, 3), (1, 3), ()],
]


def distinct(shapes: list[tuple[int, ...]], gap: float = 1e-2) -> list[np.ndarray]:
    """Inputs whose broadcast values differ by more than ``gap`` (no near-ties for Max/Min)."""
    for _ in range(10_000):
        xs = [rand(*s) for s in shapes]
        stacked = np.stack(np.broadcast_arrays(*xs))
        srt = np.sort(stacked, axis=0)
        if len(xs) == 1 or np.min(np.diff(srt, axis=0)) > gap:
            return xs
    raise RuntimeError("no inputs found")


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shapes", VARIADIC_SHAPES, ids=str)
@pytest.mark.parametrize(("op", "backend"), [("Sum", ORT), ("Mean", REF), ("Max", ORT), ("Min", ORT)])
def test_variadic(op, backend, shapes, dynamic):
    if op == "Mean":  # onnx.reference's Mean only broadcasts inputs after a full-shaped first one
        full = np.broadcast_shapes(*shapes)
        shapes = shapes if shapes[0] == full else [full, *shapes]
    check_op(op, distinct(shapes), dynamic=dynamic, backend=backend)


@pytest.mark.parametrize("shapes", VARIADIC_SHAPES, ids=str)
def test_mean_float32_on_onnxruntime(shapes):
    """onnxruntime has no float64 Mean: float32, with any input broadcast."""
    check_op("Mean", [x.astype(np.float32) for x in distinct(shapes)], dynamic=True)
    check_op("Mean", [x.astype(np.float32) for x in distinct(shapes)])


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_gradient_for_some_inputs_only(op):
    xs = distinct([(3, 4), (4,), (3, 1)])
    m = node_model(op, xs)
    backend = REF if op == "Mean" else ORT
    res = check_gradients(m, {f"in{i}": x for i, x in enumerate(xs)}, wrt=["in1"], backend=backend)
    assert res.ok, res.report()
    assert list(res.analytic) == ["in1"]


def test_variadic_opset8_forms():
    xs = distinct([(3, 4), (4,)])
    for op in ("Sum", "Max", "Min"):
        check_op(op, xs, opset=8)


# ---- conventions at kinks and ties, against torch autograd in float64 --------------------------
def ours(
    op: str,
    inputs: list[np.ndarray],
    cot: np.ndarray,
    attrs: dict | None = None,
    opset: int = 18,
    backend: str = ORT,
) -> list[np.ndarray]:
    """onnxgrad's gradients of <cot, op(inputs)> with respect to every input."""
    m = node_model(op, inputs, attrs=attrs, opset=opset)
    feeds = {f"in{i}": x for i, x in enumerate(inputs)}
    wrt = list(feeds)
    if backend == ORT:
        grads = onnxgrad.gradients(m, feeds, {"out0": cot}, wrt=wrt)
    else:
        graphs = onnxgrad.build_gradient(m, inputs_requiring_grad=wrt)
        _, grads = run_gradients(graphs, feeds, {"out0": cot}, backend=backend)
    return [grads[w] for w in wrt]


def theirs(fn: Callable[..., Any], inputs: list[np.ndarray], cot: np.ndarray) -> list[np.ndarray]:
    torch = pytest.importorskip("torch")
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in inputs]
    fn(*ts).backward(torch.tensor(cot))
    return [t.grad.numpy() for t in ts]


def assert_same(op, inputs, fn, attrs=None, opset=18, backend=ORT, reshape_torch=None):
    torch_inputs = [
        x if r is None else x.reshape(r) for x, r in zip(inputs, reshape_torch or [None] * len(inputs))
    ]
    cot = rng().standard_normal(np.broadcast_shapes(*(np.shape(x) for x in inputs)))
    a = ours(op, inputs, cot, attrs, opset, backend)
    b = theirs(fn, torch_inputs, cot)
    for i, (ga, gb) in enumerate(zip(a, b)):
        np.testing.assert_allclose(
            ga, gb.reshape(ga.shape), rtol=1e-6, atol=1e-12, err_msg=f"{op}: input {i}"
        )


def with_points(points: list[float], n: int = 12, scale: float = 3.0) -> np.ndarray:
    """Random values plus the exact kink points."""
    return np.concatenate([np.asarray(points, dtype=np.float64), scale * rand(n)])


def test_torch_mish():
    F = pytest.importorskip("torch.nn.functional")
    assert_same("Mish", [with_points([0.0, -20.0, 20.0])], F.mish)


def test_torch_selu():
    F = pytest.importorskip("torch.nn.functional")
    assert_same("Selu", [with_points([0.0])], F.selu)


def test_torch_celu():
    F = pytest.importorskip("torch.nn.functional")
    assert_same("Celu", [with_points([0.0])], lambda x: F.celu(x, 0.5), attrs={"alpha": 0.5}, backend=REF)


def test_torch_elu_leaky_relu_relu_abs_at_zero():
    F = pytest.importorskip("torch.nn.functional")
    x = [with_points([0.0])]
    assert_same("Elu", x, lambda t: F.elu(t, 0.5), attrs={"alpha": 0.5})
    assert_same("LeakyRelu", x, lambda t: F.leaky_relu(t, 0.25), attrs={"alpha": 0.25})
    assert_same("Relu", x, F.relu)
    assert_same("Abs", x, lambda t: t.abs())


def test_torch_hardswish_hardsigmoid():
    F = pytest.importorskip("torch.nn.functional")
    x = [with_points([-3.0, 0.0, 3.0])]
    assert_same("HardSwish", x, F.hardswish)
    # torch's hardsigmoid is ONNX HardSigmoid with alpha = 1/6 (the ONNX default is 0.2)
    assert_same("HardSigmoid", x, F.hardsigmoid, attrs={"alpha": 1 / 6, "beta": 0.5})


def test_torch_shrink_threshold_softsign():
    F = pytest.importorskip("torch.nn.functional")
    x = [with_points([-0.5, 0.5, 0.0, 1.0])]
    assert_same("Shrink", x, lambda t: F.softshrink(t, 0.5), attrs={"lambd": 0.5, "bias": 0.5})
    assert_same("ThresholdedRelu", x, lambda t: F.threshold(t, 1.0, 0.0))
    assert_same("Softsign", x, F.softsign)


def test_torch_prelu():
    F = pytest.importorskip("torch.nn.functional")
    x = away_from(rand(2, 3, 4), [0.0])
    x[0, :, 0] = 0.0  # at zero the slope branch, as torch
    slope = rand(3, 1)
    assert_same("PRelu", [x, slope], F.prelu, reshape_torch=[None, (3,)])


def test_torch_trig_and_gelu():
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("torch.nn.functional")
    x = [uniform(-0.9, 0.9)(10)]
    for op in ("Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Atanh"):
        assert_same(op, x, getattr(torch, op.lower()), backend=REF)
    assert_same("Acosh", [uniform(1.1, 3.0)(10)], torch.acosh, backend=REF)
    assert_same("Gelu", x, F.gelu, opset=20, backend=REF)
    assert_same(
        "Gelu",
        x,
        lambda t: F.gelu(t, approximate="tanh"),
        attrs={"approximate": "tanh"},
        opset=20,
        backend=REF,
    )


def test_torch_fmod():
    torch = pytest.importorskip("torch")
    a, b = mod_inputs((3, 4), (4,))
    assert_same("Mod", [a, b], torch.fmod, attrs={"fmod": 1})


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_torch_max_min_ties_split_evenly(op):
    torch = pytest.importorskip("torch")
    a = np.array([1.0, 2.0, -1.0, 0.5, 3.0])
    b = np.array([1.0, 1.0, -1.0, 0.7, 3.0])  # ties at 0, 2, 4
    fn2 = torch.maximum if op == "Max" else torch.minimum
    assert_same(op, [a, b], fn2)
    # two inputs tie with y and a third does not (or does): amax/amin's even split over ties
    c = np.array([0.0, 5.0, -1.0, -5.0, 3.0])
    red = torch.amax if op == "Max" else torch.amin
    assert_same(op, [a, b, c], lambda *ts: red(torch.stack(ts), dim=0))
    # with broadcasting: the tie count is per output element
    assert_same(op, [a, np.array(1.0)], fn2)


# ---- Dropout -----------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [10, 12, 13])
def test_dropout_inference_is_identity(opset: int) -> None:
    x = rnd(3, 4)
    check_op("Dropout", [x], opset=opset)
    if opset >= 12:
        check_op("Dropout", [x, np.array(0.5), np.array(False)], opset=opset, constant={1})
        check_op(
            "Dropout",
            [x, None, np.array(False)],
            opset=opset,
            n_outputs=2,
            output_dtypes=[np.float64, np.bool_],
        )


# ---- Where, Clip, Cast -------------------------------------------------------------------------
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("cshape", "ashape", "bshape"),
    [((2, 3), (2, 3), (2, 3)), ((2, 3), (3,), (2, 1)), ((4, 1, 3), (1, 2, 1), ())],
)
def test_where(cshape, ashape, bshape, dynamic):
    cond = rng().random(cshape) > 0.5
    check_op("Where", [cond, rand(*ashape), rand(*bshape)], dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [False, True])
def test_clip_bounds_as_inputs(dynamic):
    x = away_from(rand(3, 5) * 2, [-0.5, 0.7])
    lo, hi = np.array(-0.5), np.array(0.7)
    check_op("Clip", [x, lo, hi], opset=18, dynamic=dynamic)  # grads for x, min and max
    # onnxruntime has no float64 kernel for Clip before opset 12
    check_op("Clip", [x, lo, hi], opset=11, constant=[1, 2], dynamic=dynamic, backend="reference")
    check_op("Clip", [x, lo], opset=13, dynamic=dynamic)
    check_op("Clip", [x, None, hi], opset=13, dynamic=dynamic)
    check_op("Clip", [x], opset=13, dynamic=dynamic)


def test_clip_attributes_and_inclusive_bounds():
    x = away_from(rand(4, 3) * 2, [-0.5, 0.7])
    check_op("Clip", [x], attrs={"min": -0.5, "max": 0.7}, opset=6, backend="reference")
    check_op("Clip", [x], attrs={"max": 0.7}, opset=6, backend="reference")
    # at x == min or max the gradient passes (as torch.clamp): check it directly
    m = node_model("Clip", [np.array([-1.0, 0.0, 1.0]), np.array(0.0), np.array(1.0)], constant=[1, 2])
    got = onnxgrad.gradients(m, {"in0": np.array([-1.0, 0.0, 1.0])}, {"out0": np.ones(3)}, wrt=["in0"])
    np.testing.assert_array_equal(got["in0"], [0.0, 1.0, 1.0])


@pytest.mark.parametrize("dynamic", [False, True])
def test_cast(dynamic):
    check_op(
        "Cast",
        [rand(3, 4)],
        attrs={"to": TensorProto.FLOAT},
        output_dtypes=[np.float32],
        dynamic=dynamic,
        eps=1e-2,
        rtol=1e-4,
        atol=1e-5,
    )
    check_op("Cast", [rand(3)], attrs={"to": TensorProto.DOUBLE}, dynamic=dynamic)
    check_op("CastLike", [rand(3, 2), np.zeros(1, np.float64)], constant=[1], opset=15)
