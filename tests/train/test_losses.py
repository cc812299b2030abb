"""Loss graphs from add_loss: values against numpy and torch, gradients against torch autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.errors import InputError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import add_loss, keep_outputs, remove_loss, with_parameters

torch = pytest.importorskip("torch")  # an optional dependency: the reference for every loss
F = torch.nn.functional

N, C = 6, 5
TORCH_LOSS = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "huber": F.huber_loss,  # delta=1, add_loss's default
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "cross_entropy": F.cross_entropy,
    "nll": F.nll_loss,
}
CLASS_KINDS = ("cross_entropy", "nll")


def identity_model(shape: list, dtype: int = TensorProto.FLOAT, opset: int = 18) -> onnx.ModelProto:
    """``y = Identity(logits)``: the loss gradient w.r.t. the input is the loss gradient itself."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["logits"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("logits", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


def log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def make_data(kind: str, shape: tuple, dtype: np.dtype, rng: np.random.Generator):
    x = rng.standard_normal(shape).astype(dtype) * 2
    if kind == "nll":  # log-probabilities, as torch's nll_loss takes
        x = log_softmax(x.astype(np.float64)).astype(dtype)
    if kind in CLASS_KINDS:
        t = rng.integers(0, shape[1], size=shape[:1] + shape[2:]).astype(np.int64)
    elif kind == "bce_with_logits":
        t = rng.uniform(0, 1, size=shape).astype(dtype)  # soft targets are allowed
    else:
        t = rng.standard_normal(shape).astype(dtype)
    w = rng.uniform(0.1, 2.0, size=shape[:1]).astype(dtype)
    return x, t, w


def numpy_elementwise(kind: str, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """The per-element loss, computed independently of the ONNX formulation."""
    if kind == "mse":
        return (x - t) ** 2
    if kind == "l1":
        return np.abs(x - t)
    if kind == "huber":
        d = np.abs(x - t)
        return np.where(d < 1, 0.5 * d**2, d - 0.5)
    if kind == "bce_with_logits":
        p = 1 / (1 + np.exp(-x))
        return -(t * np.log(p) + (1 - t) * np.log(1 - p))
    logp = log_softmax(x) if kind == "cross_entropy" else x
    return -np.take_along_axis(logp, np.expand_dims(t, 1), axis=1).squeeze(1)


def reduce_ref(elem, w, reduction: str):
    """Reduction shared by the numpy and torch references (works on both array types)."""
    if w is None:
        return elem.mean() if reduction == "mean" else elem.sum()
    wb = w.reshape((-1,) + (1,) * (elem.ndim - 1))
    if reduction == "sum":
        return (elem * wb).sum()
    per_sample = int(np.prod(elem.shape[1:]))
    return (elem * wb).sum() / (w.sum() * per_sample)


def torch_reference(kind, x, t, w, reduction):
    """Loss value and gradient w.r.t. ``x`` from torch.nn.functional and autograd."""
    xt = torch.tensor(x, requires_grad=True)
    tt = torch.tensor(t)
    fn = TORCH_LOSS[kind]
    if w is None:
        loss = fn(xt, tt, reduction=reduction)
    else:
        loss = reduce_ref(fn(xt, tt, reduction="none"), torch.tensor(w), reduction)
    loss.backward()
    return loss.detach().numpy(), xt.grad.numpy()


def onnx_loss_and_grad(model, x, t, w, dtype):
    feeds = {"logits": x, "target": t}
    if w is not None:
        feeds["weights"] = w
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, loss = sess.run(["y", "loss"], feeds)
    np.testing.assert_array_equal(y, x)  # the original output is still there
    grads = onnxgrad.gradients(model, feeds, {"loss": np.array(1, dtype=dtype)}, wrt=["logits"])
    return loss, grads["logits"]


CASES = [
    (kind, reduction, weighted)
    for kind in TORCH_LOSS
    for reduction in ("mean", "sum")
    for weighted in (False, True)
]


@pytest.mark.parametrize(("kind", "reduction", "weighted"), CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loss_matches_numpy_and_torch(kind, reduction, weighted, dtype):
    rng = np.random.default_rng(0)
    shape = (N, C)
    x, t, w = make_data(kind, shape, np.dtype(dtype), rng)
    w = w if weighted else None
    onnx_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = add_loss(
        identity_model(["N", C], onnx_type),
        kind,
        reduction=reduction,
        weight_name="weights" if weighted else None,
    )
    loss, grad = onnx_loss_and_grad(model, x, t, w, dtype)
    assert loss.shape == () and loss.dtype == dtype and grad.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}
    expected = reduce_ref(numpy_elementwise(kind, x.astype(np.float64), t), w, reduction)
    np.testing.assert_allclose(loss, expected, **tol)
    t_loss, t_grad = torch_reference(kind, x, t, w, reduction)
    np.testing.assert_allclose(loss, t_loss, **tol)
    np.testing.assert_allclose(grad, t_grad, **tol)


@pytest.mark.parametrize("kind", CLASS_KINDS)
@pytest.mark.parametrize("classes", [C, "C"])
def test_class_losses_rank3_and_dynamic_classes(kind, classes):
    """Scores (N, C, L) with targets (N, L), as torch; the class count may be symbolic."""
    rng = np.random.default_rng(1)
    x, t, _ = make_data(kind, (N, C, 3), np.dtype(np.float64), rng)
    model = add_loss(identity_model(["N", classes, 3], TensorProto.DOUBLE), kind)
    loss, grad = onnx_loss_and_grad(model, x, t, None, np.float64)
    t_loss, t_grad = torch_reference(kind, x, t, None, "mean")
    np.testing.assert_allclose(loss, t_loss, rtol=1e-10)
    np.testing.assert_allclose(grad, t_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", list(TORCH_LOSS))
def test_older_opset_writes_axes_as_attributes(kind):
    """At opset 12, Unsqueeze/ReduceSum/ReduceMean take axes as attributes."""
    rng = np.random.default_rng(2)
    x, t, w = make_data(kind, (N, C), np.dtype(np.float32), rng)
    model = add_loss(identity_model(["N", C], opset=12), kind, weight_name="weights")
    onnx.checker.check_model(model, full_check=True)
    loss, grad = onnx_loss_and_grad(model, x, t, w, np.float32)
    t_loss, t_grad = torch_reference(kind, x, t, w, "mean")
    np.testing.assert_allclose(loss, t_loss, rtol=1e-5)
    assert_allclose_scaled(grad, t_grad, rtol=1e-5)


def test_model_interface():
    base = identity_model(["N", C])
    model = add_loss(base, "cross_entropy", weight_name="w")
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["y", "loss"]
    assert [i.name for i in model.graph.input] == ["logits", "target", "w"]
    target = model.graph.input[1].type.tensor_type
    assert target.elem_type == TensorProto.INT64
    assert [d.dim_param or d.dim_value for d in target.shape.dim] == ["N"]
    assert model.ir_version <= 13
    assert not model.graph.initializer  # constants are nodes: nothing new becomes trainable
    assert len(base.graph.node) == 1  # the input model is left alone
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=["logits"], outputs=["loss"])
    assert list(graphs.grad_inputs) == ["loss"]


def test_remove_loss_gives_back_the_inference_model():
    model = add_loss(identity_model(["N", C]), "mse", weight_name="w")
    plain = remove_loss(model)
    onnx.checker.check_model(plain, full_check=True)
    assert [i.name for i in plain.graph.input] == ["logits"]
    assert [o.name for o in plain.graph.output] == ["y"]
    assert [n.op_type for n in plain.graph.node] == ["Identity"]
    with pytest.raises(InputError, match="no output named"):
        remove_loss(plain)


def test_loss_on_a_trainable_model_gives_parameter_gradients():
    """A loss on top of Gemm: gradients of the weights match torch."""
    rng = np.random.default_rng(3)
    wt = rng.standard_normal((4, C))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.DOUBLE, ["N", C])],
        initializer=[onnx.numpy_helper.from_array(wt, "W")],
    )
    base = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    base.ir_version = ir_version_for(base.opset_import)
    model = add_loss(base, "cross_entropy")
    x = rng.standard_normal((N, 4))
    t = rng.integers(0, C, N)
    grads = onnxgrad.gradients(model, {"x": x, "target": t}, {"loss": np.array(1.0)})
    w_t = torch.tensor(wt, requires_grad=True)
    F.cross_entropy(torch.tensor(x) @ w_t, torch.tensor(t)).backward()
    np.testing.assert_allclose(grads["W"], w_t.grad.numpy(), rtol=1e-10)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "hinge"}, "unknown loss"),
        ({"kind": "mse", "reduction": "none"}, "unknown reduction"),
        ({"kind": "mse", "output": "nope"}, "neither an output nor a value"),
        ({"kind": "huber", "delta": 0}, "delta > 0"),
        ({"kind": "mse", "probabilities": True}, "'nll' loss only"),
        ({"kind": "mse", "l2": {"nope": 1.0}}, "l2 penalty on 'nope': unknown initializer"),
        ({"kind": "mse", "l1": 0.1}, "no weight of rank >= 2"),
        ({"kind": "mse", "target_name": "logits"}, "already has a value named 'logits'"),
        ({"kind": "mse", "weight_name": "y"}, "already has a value named 'y'"),
        ({"kind": "mse", "weight_name": "target"}, "must differ"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        add_loss(identity_model(["N", C]), **kwargs)


@pytest.mark.parametrize("kind", CLASS_KINDS)
def test_class_losses_need_class_axis(kind):
    with pytest.raises(InputError, match=f"{kind} needs scores of known rank >= 2"):
        add_loss(identity_model(["N"]), kind)


def test_huber_threshold():
    """delta moves the switch from quadratic to linear, as in torch's huber_loss."""
    rng = np.random.default_rng(4)
    x, t = rng.standard_normal((N, C)), rng.standard_normal((N, C))
    assert ((np.abs(x - t) < 0.3).any()) and ((np.abs(x - t) > 0.3).any())  # both branches
    model = add_loss(identity_model(["N", C], TensorProto.DOUBLE), "huber", delta=0.3)
    loss, grad = onnx_loss_and_grad(model, x, t, None, np.float64)
    xt = torch.tensor(x, requires_grad=True)
    expected = F.huber_loss(xt, torch.tensor(t), delta=0.3)
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, xt.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_l1_gradient_points_uphill():
    """onnxcustom's absolute loss had the wrong sign; here d|x - t|/dx = sign(x - t)."""
    x, t = np.array([[3.0, -2.0]]), np.array([[1.0, 1.0]])
    model = add_loss(identity_model([1, 2], TensorProto.DOUBLE), "l1", reduction="sum")
    _, grad = onnx_loss_and_grad(model, x, t, None, np.float64)
    np.testing.assert_array_equal(grad, [[1.0, -1.0]])


def test_nll_from_probabilities():
    """probabilities=True: the loss is nll_loss(log p), finite even where a probability is 0."""
    rng = np.random.default_rng(5)
    p = np.exp(log_softmax(rng.standard_normal((N, C)) * 2))
    t = rng.integers(0, C, N)
    model = add_loss(identity_model(["N", C], TensorProto.DOUBLE), "nll", probabilities=True)
    loss, grad = onnx_loss_and_grad(model, p, t, None, np.float64)
    pt = torch.tensor(p, requires_grad=True)
    expected = F.nll_loss(torch.log(pt), torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, pt.grad.numpy(), rtol=1e-12)
    p[0, t[0]] = 0.0  # an underflowed probability: log clamps at the smallest normal number
    loss, grad = onnx_loss_and_grad(model, p, t, None, np.float64)
    assert np.isfinite(loss) and np.isfinite(grad).all()
    np.testing.assert_allclose(
        loss * N, -np.log(np.finfo(np.float64).tiny) - np.log(p[1:][np.arange(N - 1), t[1:]]).sum()
    )


def linear_model(w: np.ndarray, b: np.ndarray, cast_w: bool = False) -> onnx.ModelProto:
    """``y = x @ W + b``; with ``cast_w`` W is float32, cast to the model's float64."""
    nodes = [
        helper.make_node("MatMul", ["x", "Wd" if cast_w else "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["y"]),
    ]
    if cast_w:
        nodes.insert(0, helper.make_node("Cast", ["W"], ["Wd"], to=TensorProto.DOUBLE))
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", w.shape[1]])],
        initializer=[onnx.numpy_helper.from_array(w, "W"), onnx.numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


@pytest.mark.parametrize(
    ("penalties", "coefs"),
    [
        ({"l1": 0.1, "l2": 0.2}, {"W": (0.1, 0.2)}),  # default: weights of rank >= 2, not biases
        ({"l2": 0.3, "penalized": ["W", "b"]}, {"W": (0, 0.3), "b": (0, 0.3)}),
        ({"l1": {"b": 0.5}, "l2": {"W": 0.01}}, {"W": (0, 0.01), "b": (0.5, 0)}),
    ],
)
@pytest.mark.parametrize("cast_w", [False, True])
def test_penalties_match_torch(penalties, coefs, cast_w):
    """loss + Σ l1 Σ|W| + l2 Σ W²: values and gradients of every weight equal torch's."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, C)).astype(np.float32 if cast_w else np.float64)
    b = rng.standard_normal(C)
    x, t = rng.standard_normal((N, 4)), rng.standard_normal((N, C))
    model = add_loss(linear_model(w, b, cast_w), "mse", **penalties)
    assert not any(i.name.startswith("loss") for i in model.graph.initializer)
    feeds = {"x": x, "target": t}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    loss = sess.run(["loss"], feeds)[0]
    grads = onnxgrad.gradients(model, feeds, {"loss": np.array(1.0)})

    params = {"W": torch.tensor(w, requires_grad=True), "b": torch.tensor(b, requires_grad=True)}
    y = torch.tensor(x) @ params["W"].double() + params["b"]
    expected = F.mse_loss(y, torch.tensor(t))
    for name, (a, c) in coefs.items():
        p = params[name].double()
        expected = expected + a * p.abs().sum() + c * (p**2).sum()
    expected.backward()
    rtol = 1e-6 if cast_w else 1e-12
    np.testing.assert_allclose(loss, expected.item(), rtol=rtol)
    weights = {"W": w.astype(np.float64), "b": b}
    by_numpy = ((x @ weights["W"] + b - t) ** 2).mean()
    by_numpy += sum(a * np.abs(weights[n]).sum() + c * (weights[n] ** 2).sum() for n, (a, c) in coefs.items())
    np.testing.assert_allclose(loss, by_numpy, rtol=rtol)
    for name, p in params.items():
        assert grads[name].dtype == p.detach().numpy().dtype
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=rtol, atol=1e-7 if cast_w else 1e-14)


def test_keep_outputs_and_with_parameters():
    rng = np.random.default_rng(7)
    base = linear_model(rng.standard_normal((4, C)), rng.standard_normal(C))
    model = add_loss(base, "mse")
    only_loss = keep_outputs(model, ["loss"])
    assert [o.name for o in only_loss.graph.output] == ["loss"]
    assert {i.name for i in only_loss.graph.input} == {"x", "target"}
    new_w = np.ones((4, C))
    updated = with_parameters(base, {"W": new_w})
    values = {i.name: onnx.numpy_helper.to_array(i) for i in updated.graph.initializer}
    np.testing.assert_array_equal(values["W"], new_w)
    np.testing.assert_array_equal(values["b"], onnx.numpy_helper.to_array(base.graph.initializer[1]))
    assert onnx.numpy_helper.to_array(base.graph.initializer[0]).sum() != new_w.sum()  # a copy
    with pytest.raises(InputError, match="has shape"):
        with_parameters(base, {"W": np.ones(3)})
    with pytest.raises(InputError, match=r"\['nope'\] are not initializers"):
        with_parameters(base, {"nope": np.ones(3)})
    with pytest.raises(InputError, match="no output named 'y2'"):
        keep_outputs(model, ["y2"])


def test_loss_on_an_intermediate_value():
    """output= may name a value inside the graph: here the logits before a Softmax."""
    rng = np.random.default_rng(8)
    graph = helper.make_graph(
        [
            helper.make_node("Identity", ["x"], ["logits"]),
            helper.make_node("Softmax", ["logits"], ["p"], axis=1),
        ],
        "softmax",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", C])],
        [helper.make_tensor_value_info("p", TensorProto.DOUBLE, ["N", C])],
    )
    base = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    base.ir_version = ir_version_for(base.opset_import)
    model = add_loss(base, "cross_entropy", output="logits")
    assert [o.name for o in model.graph.output] == ["p", "loss"]
    x, t = rng.standard_normal((N, C)), rng.integers(0, C, N)
    grads = onnxgrad.gradients(model, {"x": x, "target": t}, {"loss": np.array(1.0)}, wrt=["x"])
    xt = torch.tensor(x, requires_grad=True)
    F.cross_entropy(xt, torch.tensor(t)).backward()
    np.testing.assert_allclose(grads["x"], xt.grad.numpy(), rtol=1e-12)
