"""Loss graphs from add_loss: values against numpy and torch, gradients against torch autograd."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.autodiff.graph import ir_version_for
from onnxgrad.errors import InputError
from onnxgrad.train import add_loss, remove_loss

torch = pytest.importorskip("torch")  # an optional dependency: the reference for every loss
F = torch.nn.functional

N, C = 6, 5
TORCH_LOSS = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "cross_entropy": F.cross_entropy,
}


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


def make_data(kind: str, shape: tuple, dtype: np.dtype, rng: np.random.Generator):
    x = rng.standard_normal(shape).astype(dtype) * 2
    if kind == "cross_entropy":
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
    if kind == "bce_with_logits":
        p = 1 / (1 + np.exp(-x))
        return -(t * np.log(p) + (1 - t) * np.log(1 - p))
    shifted = x - x.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
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


@pytest.mark.parametrize("classes", [C, "C"])
def test_cross_entropy_rank3_and_dynamic_classes(classes):
    """Logits (N, C, L) with targets (N, L), as torch; the class count may be symbolic."""
    rng = np.random.default_rng(1)
    x, t, _ = make_data("cross_entropy", (N, C, 3), np.dtype(np.float64), rng)
    model = add_loss(identity_model(["N", classes, 3], TensorProto.DOUBLE), "cross_entropy")
    loss, grad = onnx_loss_and_grad(model, x, t, None, np.float64)
    t_loss, t_grad = torch_reference("cross_entropy", x, t, None, "mean")
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
    np.testing.assert_allclose(grad, t_grad, rtol=1e-5, atol=1e-6)


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
        ({"kind": "mse", "output": "nope"}, "not an output"),
        ({"kind": "mse", "target_name": "logits"}, "already has a value named 'logits'"),
        ({"kind": "mse", "weight_name": "y"}, "already has a value named 'y'"),
        ({"kind": "mse", "weight_name": "target"}, "must differ"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        add_loss(identity_model(["N", C]), **kwargs)


def test_cross_entropy_needs_class_axis():
    with pytest.raises(InputError, match="rank >= 2"):
        add_loss(identity_model(["N"]), "cross_entropy")
