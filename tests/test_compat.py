"""onnxgrad.compat: the onnxcustom ``OrtGradientForwardBackward`` interface, used as its users did.

Models are scikit-learn estimators converted with skl2onnx. Forward outputs are compared with
``predict``; gradients with an independent computation: by hand for ``LinearRegression``, with
scikit-learn's own backpropagation (``MLPRegressor._backprop``) and a numpy backprop for
``MLPRegressor``.
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import os
import pickle
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.capi import _pybind_state as C
from skl2onnx import to_onnx
from sklearn.datasets import load_diabetes, make_classification
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.neural_network import MLPClassifier, MLPRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import onnxgrad.autodiff.rules.ml  # noqa: F401  (registers the ai.onnx.ml rules)
from onnxgrad import gradients
from onnxgrad.compat import OrtGradientForwardBackward, OrtGradientForwardBackwardFunction, OrtValueVector
from onnxgrad.errors import InputError, OnnxGradRuntimeError, PathNotFoundError

DTYPES = [np.float32, np.float64]
OPSETS = {"": 17, "ai.onnx.ml": 3}
CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def torch_device(*args):
    """A ``torch.device`` (the tests using one are skipped without torch)."""
    return pytest.importorskip("torch").device(*args)


# ---- data, models, references ----------------------------------------------------------------
@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    """Standardised diabetes data (float64): a small MLP fits quickly and keeps live units."""
    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(axis=0)) / X.std(axis=0)
    y = (y - y.mean()) / y.std()
    return X, y


def convert(model, X: np.ndarray, dtype: type, **kwargs) -> onnx.ModelProto:
    onx = to_onnx(model, X[:1].astype(dtype), target_opset=OPSETS, **kwargs)
    onx.ir_version = min(onx.ir_version, 10)  # what onnxruntime releases of the time loaded
    return onx


@pytest.fixture(scope="module")
def linreg(data) -> LinearRegression:
    X, y = data
    return LinearRegression().fit(X, y)


@pytest.fixture(scope="module")
def mlp(data) -> MLPRegressor:
    X, y = data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return MLPRegressor(hidden_layer_sizes=(8,), max_iter=300, random_state=0).fit(X, y)


def linreg_onnx(linreg: LinearRegression, X: np.ndarray, dtype: type) -> onnx.ModelProto:
    # onnxcustom's tutorials converted with black_op so the coefficients become initializers
    return convert(linreg, X, dtype, black_op={"LinearRegressor"})


def mlp_weights(fb: OrtGradientForwardBackward) -> list[np.ndarray]:
    """The MLP's initializers in the order of sklearn's layers: W0, b0, W1, b1."""
    names = ("coefficient", "intercepts", "coefficient1", "intercepts1")
    return [fb.get_initializer(n) for n in names]


def numpy_mlp_backprop(weights: list[np.ndarray], X: np.ndarray, G: np.ndarray):
    """Relu MLP with identity output: gradients of sum(G * output) w.r.t. X and every weight."""
    coefs = [w.astype(np.float64) for w in weights[0::2]]
    intercepts = [b.astype(np.float64).ravel() for b in weights[1::2]]
    acts = [X.astype(np.float64)]
    for i, (W, b) in enumerate(zip(coefs, intercepts)):
        z = acts[-1] @ W + b
        acts.append(np.maximum(z, 0) if i < len(coefs) - 1 else z)
    delta = G.astype(np.float64)
    grads: dict[str, np.ndarray] = {}
    for i in reversed(range(len(coefs))):
        grads[f"W{i}"] = acts[i].T @ delta
        grads[f"b{i}"] = delta.sum(axis=0)
        delta = delta @ coefs[i].T
        if i > 0:
            delta = delta * (acts[i] > 0)
    grads["X"] = delta
    return grads


def sklearn_backprop(mlp: MLPRegressor, X: np.ndarray, y: np.ndarray):
    """scikit-learn's own gradients of its loss 0.5 * mean((pred - y)^2), without penalty."""
    model = copy.deepcopy(mlp)
    model.alpha = 0.0
    layers = len(model.coefs_)
    activations = [X] + [None] * layers
    deltas = [None] * layers
    coef_grads = [np.empty_like(c) for c in model.coefs_]
    intercept_grads = [np.empty_like(b) for b in model.intercepts_]
    # scikit-learn 1.7 added sample_weight after y; older releases (1.3-1.6) have no such argument
    weight = ("sample_weight" in inspect.signature(model._backprop).parameters) * (None,)
    _, coef_grads, intercept_grads = model._backprop(
        X, y.reshape((-1, 1)), *weight, activations, deltas, coef_grads, intercept_grads
    )
    return coef_grads, intercept_grads


def assert_close(got, expected, dtype: type) -> None:
    got = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    expected = np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape or got.size == expected.size
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    scale = max(np.abs(expected).max(), 1e-12)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=rtol, atol=rtol * scale)


# ---- LinearRegression ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_linreg_forward_equals_predict(data, linreg, dtype):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, dtype))
    assert fb.weights_to_train == ["coef", "intercept"]
    fn = fb.new_instance()
    inputs = [X[:50].astype(dtype), fb.get_initializer("coef"), fb.get_initializer("intercept")]
    for training in (False, True):
        out = fn.forward(inputs, training=training)
        assert len(out) == 1
        assert_close(out[0], linreg.predict(X[:50]).reshape((-1, 1)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linreg_backward_by_hand(data, linreg, dtype):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, dtype))
    fn = fb.new_instance()
    x = X[:40].astype(dtype)
    coef, intercept = fb.get_initializer("coef"), fb.get_initializer("intercept")
    G = np.random.default_rng(0).standard_normal((40, 1)).astype(dtype)
    fn.forward([x, coef, intercept], training=True)
    gx, gcoef, gintercept = fn.backward([G])
    # y = x @ coef + intercept
    assert_close(gx, G.astype(np.float64) @ coef.T.astype(np.float64), dtype)
    assert_close(gcoef, x.T.astype(np.float64) @ G, dtype)
    assert_close(gintercept, G.sum(axis=0), dtype)
    assert gcoef.numpy().dtype == dtype and gcoef.shape() == list(coef.shape)


def test_linreg_weights_in_any_order(data, linreg):
    X, _ = data
    onx = linreg_onnx(linreg, X, np.float32)
    fb = OrtGradientForwardBackward(onx, weights_to_train=["intercept", "coef"])
    assert fb.cls_type_._grad_input_names == ["X", "intercept", "coef"]
    assert fb.cls_type_._bw_fetches_names == ["X_grad", "intercept_grad", "coef_grad"]
    fn = fb.new_instance()
    x = X[:10].astype(np.float32)
    coef, intercept = fb.get_initializer("coef"), fb.get_initializer("intercept")
    out = fn.forward([x, intercept, coef], training=True)
    assert_close(out[0], linreg.predict(X[:10]).reshape((-1, 1)), np.float32)
    G = np.ones((10, 1), dtype=np.float32)
    _, gintercept, gcoef = fn.backward([G])
    assert gintercept.shape() == [1] and gcoef.shape() == [10, 1]
    assert_close(gintercept, [10.0], np.float32)
    assert_close(gcoef, x.sum(axis=0, keepdims=True).T, np.float32)


# ---- MLPRegressor ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_forward_equals_predict(data, mlp, dtype):
    X, _ = data
    fb = OrtGradientForwardBackward(convert(mlp, X, dtype))
    assert fb.weights_to_train == ["coefficient", "intercepts", "coefficient1", "intercepts1"]
    fn = fb.new_instance()
    for training in (False, True):
        out = fn.forward([X[:60].astype(dtype), *mlp_weights(fb)], training=training)
        assert_close(out[0], mlp.predict(X[:60]).reshape((-1, 1)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_backward_equals_sklearn_backprop(data, mlp, dtype):
    X, y = data
    fb = OrtGradientForwardBackward(convert(mlp, X, dtype))
    weights = mlp_weights(fb)
    sk_weights = [mlp.coefs_[0], mlp.intercepts_[0], mlp.coefs_[1], mlp.intercepts_[1]]
    for w, ref in zip(weights, sk_weights):
        assert_close(w.ravel(), ref.ravel(), dtype)  # the initializers are sklearn's weights
    x, t = X[:64], y[:64]
    # scikit-learn's loss is 0.5 * mean((pred - y)^2): its gradient w.r.t. the output is below
    G = (mlp.predict(x) - t).reshape((-1, 1)) / len(x)
    fn = fb.new_instance()
    fn.forward([x.astype(dtype), *weights], training=True)
    gx, gw0, gb0, gw1, gb1 = fn.backward([G.astype(dtype)])
    coef_grads, intercept_grads = sklearn_backprop(mlp, x, t)
    assert (np.abs(coef_grads[0]) > 0).any()  # some hidden units are alive
    assert_close(gw0, coef_grads[0], dtype)
    assert_close(gb0, intercept_grads[0].reshape((1, -1)), dtype)
    assert_close(gw1, coef_grads[1], dtype)
    assert_close(gb1, intercept_grads[1].reshape((1, -1)), dtype)
    ref = numpy_mlp_backprop(weights, x, G)  # sklearn does not give the input gradient
    assert_close(gx, ref["X"], dtype)
    assert_close(gw0, ref["W0"], dtype)


def test_mlp_weights_shuffled(data, mlp):
    X, _ = data
    onx = convert(mlp, X, np.float64)
    order = ["intercepts1", "coefficient", "intercepts", "coefficient1"]
    fb = OrtGradientForwardBackward(onx, weights_to_train=order)
    fn = fb.new_instance()
    x = X[:20]
    G = np.random.default_rng(1).standard_normal((20, 1))
    fn.forward([x, *[fb.get_initializer(n) for n in order]], training=True)
    got = dict(zip(["X", *order], fn.backward([G])))
    ref = numpy_mlp_backprop(mlp_weights(fb), x, G)
    expected = {"X": "X", "coefficient": "W0", "intercepts": "b0", "coefficient1": "W1", "intercepts1": "b1"}
    for name, key in expected.items():
        assert_close(got[name], ref[key].reshape(got[name].shape()), np.float64)


def test_lifo_several_forwards(data, mlp):
    X, _ = data
    fb = OrtGradientForwardBackward(convert(mlp, X, np.float64))
    weights = mlp_weights(fb)
    fn = fb.new_instance()
    rng = np.random.default_rng(2)
    batches = [X[i * 15 : (i + 1) * 15 + i] for i in range(3)]  # three sizes: 15, 16, 17
    grads = [rng.standard_normal((len(b), 1)) for b in batches]
    for b in batches:
        fn.forward([b, *weights], training=True)
    assert len(fn.states_) == 3
    assert fn.saved_tensors[0] is batches[2]
    for k in reversed(range(3)):  # backwards in reverse order of the forwards
        got = fn.backward([grads[k]])
        ref = numpy_mlp_backprop(weights, batches[k], grads[k])
        assert_close(got[0], ref["X"], np.float64)
        assert_close(got[1], ref["W0"], np.float64)
        assert_close(got[4], ref["b1"].reshape((1, 1)), np.float64)
        if k:
            assert fn.saved_tensors[0] is batches[k - 1]
    with pytest.raises(OnnxGradRuntimeError, match="saved"):
        _ = fn.saved_tensors
    with pytest.raises(OnnxGradRuntimeError, match="training=True"):
        fn.backward([grads[0]])


@pytest.fixture(scope="module")
def pipeline(data):
    """StandardScaler + MLPRegressor on shifted, scaled features."""
    X, y = data
    raw = X * 3.0 + 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        pipe = make_pipeline(
            StandardScaler(), MLPRegressor(hidden_layer_sizes=(6,), max_iter=200, random_state=0)
        ).fit(raw, y)
    return pipe, raw


def declare_scaler_output(onx: onnx.ModelProto) -> onnx.ModelProto:
    """Declare the type of the Scaler's output, which ONNX shape inference leaves unknown."""
    node = onx.graph.node[0]
    assert node.op_type == "Scaler"
    n_features = onx.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    info = onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, [None, n_features])
    onx.graph.value_info.append(info)
    return onx


def test_pipeline_scaler_mlp_undeclared(pipeline):
    """The Scaler's output type is not declared: the graphs still build, and forward and the
    weight gradients are right (the input gradient is not asked for: X's path has no float type)."""
    pipe, raw = pipeline
    fb = OrtGradientForwardBackward(convert(pipe, raw, np.float32))
    assert fb.weights_to_train == ["coefficient", "intercepts", "coefficient1", "intercepts1"]
    fn = fb.new_instance()
    x = raw[:10].astype(np.float32)
    weights = mlp_weights(fb)
    out = fn.forward([x, *weights], training=True)
    assert_close(out[0], pipe.predict(raw[:10]).reshape((-1, 1)), np.float32)
    G = np.ones((10, 1), dtype=np.float32)
    grads = fn.backward([G])
    ref = numpy_mlp_backprop(weights, pipe[0].transform(raw[:10]), G)
    for got, key in zip(grads[1:], ("W0", "b0", "W1", "b1")):
        assert_close(got, ref[key].reshape(got.shape()), np.float32)


def test_pipeline_scaler_mlp_input_gradient(pipeline):
    """StandardScaler becomes an ai.onnx.ml Scaler: the input gradient goes through it."""
    pipe, raw = pipeline
    onx = declare_scaler_output(convert(pipe, raw, np.float32))
    fb = OrtGradientForwardBackward(onx)
    fn = fb.new_instance()
    x = raw[:30].astype(np.float32)
    weights = mlp_weights(fb)
    out = fn.forward([x, *weights], training=True)
    assert_close(out[0], pipe.predict(raw[:30]).reshape((-1, 1)), np.float32)
    G = np.ones((30, 1), dtype=np.float32)
    gx = fn.backward([G])[0]
    scaler = pipe[0]
    ref = numpy_mlp_backprop(weights, scaler.transform(raw[:30]), G)
    assert_close(gx, ref["X"] / scaler.scale_, np.float32)


def test_classifier_outputs_and_names():
    """LogisticRegression: an int64 label output (no gradient) beside the probabilities."""
    X, y = make_classification(120, n_features=6, n_classes=3, n_informative=4, random_state=0)
    clf = LogisticRegression().fit(X, y)
    onx = convert(clf, X, np.float64, black_op={"LinearClassifier"}, options={"zipmap": False})
    assert [o.name for o in onx.graph.output] == ["label", "probabilities"]
    x = X[:7]
    G = np.random.default_rng(6).standard_normal((7, 3))
    W = clf.coef_.T
    P = clf.predict_proba(x)
    dZ = P * (G - (G * P).sum(axis=1, keepdims=True))  # softmax backward
    for output_names in (None, ["probabilities"]):
        fb = OrtGradientForwardBackward(onx, output_names=output_names)
        fn = fb.new_instance()
        out = fn.forward([x, fb.get_initializer("coef"), fb.get_initializer("intercept")], True)
        assert_close(out[-1], P, np.float64)
        if output_names is None:
            np.testing.assert_array_equal(out[0].numpy(), clf.predict(x))
        gx, gw, gb = fn.backward([None] * (len(out) - 1) + [G])  # None: the label has no gradient
        assert_close(gx, dZ @ W.T, np.float64)
        assert_close(gw, x.T @ dZ, np.float64)
        assert_close(gb, dZ.sum(axis=0).reshape(gb.shape()), np.float64)


def test_mlp_classifier_with_a_0d_initializer():
    """skl2onnx's MLPClassifier has a 0-d float initializer, ``unity`` (probability of class 0 =
    unity - sigmoid), selected by default. Before: forward refused it, shape (1,) instead of ()."""
    X, y = make_classification(80, n_features=4, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = MLPClassifier(hidden_layer_sizes=(5,), max_iter=300, random_state=0).fit(X, y)
    onx = convert(clf, X, np.float32, options={"zipmap": False})
    fb = OrtGradientForwardBackward(onx)
    assert fb.weights_to_train == ["coefficient", "intercepts", "coefficient1", "intercepts1", "unity"]
    weights = [fb.get_initializer(n) for n in fb.weights_to_train]
    assert weights[-1].shape == ()
    fn = fb.new_instance()
    x = X[:6].astype(np.float32)
    label, proba = fn.forward([x, *weights], training=True)
    np.testing.assert_array_equal(label.numpy(), clf.predict(X[:6]))
    assert_close(proba, clf.predict_proba(X[:6]), np.float32)
    G = np.random.default_rng(7).standard_normal((6, 2)).astype(np.float32)
    grads = fn.backward([None, G])
    assert [tuple(g.shape()) for g in grads] == [x.shape] + [w.shape for w in weights]
    # sigmoid output: p1 = s(z), p0 = unity - p1
    p1 = clf.predict_proba(X[:6])[:, 1:]
    dz = (G[:, 1:] - G[:, :1]) * p1 * (1 - p1)
    ref = numpy_mlp_backprop(weights[:4], x, dz)
    for got, key in zip(grads, ("X", "W0", "b0", "W1", "b1")):
        assert_close(got, ref[key].reshape(got.shape()), np.float32)
    assert_close(grads[-1], np.array(G[:, 0].sum()), np.float32)
    assert grads[-1].numpy().shape == ()


def test_forward_backward_and_input_to_ort_return_an_ortvaluevector(data, linreg):
    """The original returned onnxruntime's OrtValueVector from all three; ours is one (a subclass
    that also indexes, slices and unpacks like the list earlier versions returned)."""
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32))
    fn = fb.new_instance()
    coef, intercept = fb.get_initializer("coef"), fb.get_initializer("intercept")
    values = fn.input_to_ort([X[:4].astype(np.float32), coef, intercept], None, debug=False)
    assert type(values) is OrtValueVector and isinstance(values, C.OrtValueVector)
    assert fn.input_to_ort(values, None, debug=False) is values  # already converted
    gc.collect()  # the arrays made for X[:4] are held by the vector, not freed under it
    np.testing.assert_array_equal(values[0].numpy(), X[:4].astype(np.float32))
    assert len(values.to_dlpacks(lambda capsule: capsule)) == 3  # the C++ vector holds them too
    out = fn.forward(values, training=True)
    assert type(out) is OrtValueVector and len(out) == 1
    (y,) = out
    assert type(y) is C.OrtValue and out[-1] is y and out[:] == [y]  # the original's item type
    assert_close(y, linreg.predict(X[:4]).reshape((-1, 1)), np.float32)
    grads = fn.backward([np.ones((4, 1), np.float32)])
    assert type(grads) is OrtValueVector and len(grads) == 3
    gx, gw = grads[0], grads[1:]
    assert [tuple(g.shape()) for g in gw] == [coef.shape, intercept.shape]
    assert_close(gx, np.tile(coef.reshape(1, -1), (4, 1)), np.float32)
    assert_close(grads[-1], [4.0], np.float32)
    assert repr(grads) == f"OrtValueVector(3 values, shapes={[(4, X.shape[1]), coef.shape, intercept.shape]})"
    out = fn.forward(values, training=False)
    assert type(out) is OrtValueVector


def test_integer_feature_gets_none_in_every_kind_of_result():
    """The gradient of a non-float feature reads back as None from the OrtValueVector; in a
    caller's C.OrtValueVector it is an empty placeholder (the C++ vector cannot hold None)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["x", "kf"], ["xk"]),
            helper.make_node("MatMul", ["xk", "W"], ["y"]),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["N", 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.array([[1.0], [2.0]], np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    fn = OrtGradientForwardBackward(model).new_instance()
    x, k, w = (
        np.ones((3, 2), np.float32),
        np.array([[1], [2], [3]], np.int64),
        np.array([[1.0], [2.0]], np.float32),
    )
    G = np.ones((3, 1), np.float32)
    fn.forward([x, k, w], training=True)
    grads = fn.backward([G])
    assert type(grads) is OrtValueVector and grads[1] is None and len(grads) == 3
    np.testing.assert_allclose(grads[0].numpy(), k * w.T)
    np.testing.assert_allclose(grads[2].numpy(), (x * k).T @ G)
    fn.forward([x, k, w], training=True)
    cache = C.OrtValueVector()
    assert fn.backward([G], backward_outputs_cache=cache) is cache and len(cache) == 3
    assert list(cache[1].shape()) == [0]  # the placeholder
    np.testing.assert_allclose(cache[2].numpy(), (x * k).T @ G)


# ---- the ai.onnx.ml rules on their own -------------------------------------------------------
def test_linear_regressor_rule_input_gradient(data):
    X, y = data
    Y = np.c_[y, 2 * y - X[:, 0]]  # two targets with different coefficients
    for target in (y, Y):
        lr = LinearRegression().fit(X, target)
        onx = convert(lr, X, np.float32)
        assert [n.op_type for n in onx.graph.node] == ["LinearRegressor"]
        x = X[:5].astype(np.float32)
        n_out = 1 if target.ndim == 1 else 2
        G = np.random.default_rng(3).standard_normal((5, n_out)).astype(np.float32)
        out_name = onx.graph.output[0].name
        got = gradients(onx, {"X": x}, {out_name: G}, wrt=["X"])["X"]
        assert_close(got, G.astype(np.float64) @ lr.coef_.reshape((n_out, -1)), np.float32)


def test_linear_regressor_has_no_trainable_weight(data, linreg):
    X, _ = data
    onx = convert(linreg, X, np.float32)  # LinearRegressor: coefficients are attributes
    with pytest.raises(ValueError, match="black_op"):
        OrtGradientForwardBackward(onx)


# ---- calling conventions ---------------------------------------------------------------------
def test_inputs_as_ortvalues_and_caches(data, linreg):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32))
    fn = fb.new_instance()
    arrays = [X[:8].astype(np.float32), fb.get_initializer("coef"), fb.get_initializer("intercept")]
    expected = linreg.predict(X[:8]).reshape((-1, 1))
    device = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
    vector = C.OrtValueVector()
    for a in arrays:
        vector.push_back(C.OrtValue.ortvalue_from_numpy(a, device))
    as_inputs = [
        arrays,
        [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays],
        [C.OrtValue.ortvalue_from_numpy(a, device) for a in arrays],
        vector,
    ]
    G = np.ones((8, 1), dtype=np.float32)
    for inputs in as_inputs:
        cache: list = ["stale"]
        out = fn.forward(inputs, training=True, forward_outputs_cache=cache)
        assert out is cache and len(cache) == 1
        assert_close(cache[0], expected, np.float32)
        bcache: list = []
        got = fn.backward([ort.OrtValue.ortvalue_from_numpy(G)], backward_outputs_cache=bcache)
        assert got is bcache and len(bcache) == 3
        assert_close(bcache[2], [8.0], np.float32)


def test_bad_calls_are_clear_errors(data, linreg):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32))
    fn = fb.new_instance()
    coef, intercept = fb.get_initializer("coef"), fb.get_initializer("intercept")
    x = X[:4].astype(np.float32)
    with pytest.raises(OnnxGradRuntimeError, match="training=True"):
        fn.backward([np.ones((4, 1), np.float32)])  # no forward at all
    fn.forward([x, coef, intercept], training=False)
    with pytest.raises(OnnxGradRuntimeError, match="training=True"):
        fn.backward([np.ones((4, 1), np.float32)])  # an inference forward keeps nothing
    with pytest.raises(InputError, match="expects 3 values"):
        fn.forward([x, coef])
    with pytest.raises(InputError, match="tensor\\(double\\)"):
        fn.forward([X[:4], coef, intercept])
    with pytest.raises(InputError, match="shape"):
        fn.forward([x, coef.T, intercept])
    fn.forward([x, coef, intercept], training=True)
    with pytest.raises(InputError, match=r"gradient 0 \('variable'\) has shape \(2, 4\), expected \(4, 1\)"):
        fn.backward([np.ones((2, 4), np.float32)])  # more values than the output has
    with pytest.raises(InputError, match="expects 1 gradients"):
        fn.backward([])
    got = fn.backward([None])  # a missing gradient counts as zeros; the forward was not consumed
    assert not got[1].numpy().any()
    with pytest.raises(OnnxGradRuntimeError):
        OrtGradientForwardBackwardFunction()


def test_cls_type_and_new_instance(data, linreg):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32), class_name="LinRegFB")
    assert fb.cls_type_.__name__ == "LinRegFB"
    assert issubclass(fb.cls_type_, OrtGradientForwardBackwardFunction)
    a, b = fb.new_instance(), fb.new_instance()
    assert isinstance(a, fb.cls_type_) and a is not b
    assert a.states_ == [] and b.states_ == []
    assert fb.cls_type_._input_names == ["X"] and fb.cls_type_._output_names == ["variable"]
    assert fb.cls_type_._weights_to_train == ["coef", "intercept"]
    a.save_for_backward((1, 2))
    assert a.saved_tensors == [1, 2]
    with pytest.raises(OnnxGradRuntimeError):
        _ = b.saved_tensors
    text = repr(fb)
    assert "LinRegFB" in text and "['coef', 'intercept']" in text and "cpu" in text


def test_get_initializer(data, mlp):
    X, _ = data
    fb = OrtGradientForwardBackward(convert(mlp, X, np.float32))
    expected = mlp.coefs_[0].astype(np.float32)
    np.testing.assert_array_equal(fb.get_initializer("coefficient"), expected)
    assert fb.get_initializer("shape_tensor").dtype == np.int64
    assert fb.get_initializer("nope", exc=False) is None
    with pytest.raises(ValueError, match="nope"):
        fb.get_initializer("nope")


def test_selection_of_weights(data, mlp):
    X, _ = data
    onx = convert(mlp, X, np.float32)
    names = OrtGradientForwardBackward._select_initializer_names(onx)
    assert names == ["coefficient", "intercepts", "coefficient1", "intercepts1"]  # no shape_tensor
    with pytest.raises(ValueError, match="empty"):
        OrtGradientForwardBackward(onx, weights_to_train=[])
    with pytest.raises(ValueError, match="not an initializer"):
        OrtGradientForwardBackward(onx, weights_to_train=["coefficient", "nope"])
    with pytest.raises(ValueError, match="floating-point"):
        OrtGradientForwardBackward(onx, weights_to_train=["shape_tensor"])
    with pytest.raises(ValueError, match="twice"):
        OrtGradientForwardBackward(onx, weights_to_train=["coefficient", "coefficient"])
    with pytest.raises(ValueError, match="input_names"):
        OrtGradientForwardBackward(onx, input_names=["Z"])
    with pytest.raises(ValueError, match="output_names"):
        OrtGradientForwardBackward(onx, output_names=["Z"])
    # training a subset: the others stay initializers, the forward takes only the chosen ones
    fb = OrtGradientForwardBackward(onx, weights_to_train=["intercepts1"])
    fn = fb.new_instance()
    fn.forward([X[:3].astype(np.float32), fb.get_initializer("intercepts1")], training=True)
    _, gb = fn.backward([np.ones((3, 1), np.float32)])
    assert_close(gb, [[3.0]], np.float32)


# ---- pickling, saving --------------------------------------------------------------------------
def test_pickle_round_trip(data, mlp):
    X, _ = data
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    order = ["intercepts1", "coefficient1", "coefficient", "intercepts"]
    fb = OrtGradientForwardBackward(
        convert(mlp, X, np.float32),
        weights_to_train=order,
        class_name="MLPFB",
        sess_options=options,
    )
    restored = pickle.loads(pickle.dumps(fb))
    assert restored.weights_to_train == order
    assert restored.cls_type_.__name__ == "MLPFB"
    assert restored.cls_type_ is not fb.cls_type_
    assert restored.sess_options.intra_op_num_threads == 1
    assert repr(restored) == repr(fb)
    x = X[:12].astype(np.float32)
    G = np.random.default_rng(4).standard_normal((12, 1)).astype(np.float32)
    results = []
    for obj in (fb, restored):
        fn = obj.new_instance()
        out = fn.forward([x, *[obj.get_initializer(n) for n in order]], training=True)
        results.append([out[0].numpy(), *[g.numpy() for g in fn.backward([G])]])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_save_onnx_graph(tmp_path, data, linreg):
    X, _ = data
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32), class_name="OrtGradientLR")
    fn = fb.new_instance()
    saved = fn.save_onnx_graph(str(tmp_path), prefix="pre_", suffix="_suf")
    assert set(saved) == {"_optimized_pre_grad_model", "_trained_onnx"}
    for attr, path in saved.items():
        assert os.path.exists(path)
        # the original's names: {prefix}{class name}{suffix}.{attribute}.onnx, nothing abbreviated
        assert os.path.basename(path) == f"pre_OrtGradientLR_suf.{attr}.onnx"
        model = onnx.load(path)
        onnx.checker.check_model(model, full_check=True)
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    # the saved graphs, run by plain onnxruntime, give the gradients of backward()
    x = X[:6].astype(np.float32)
    feeds = {"X": x, **{n: fb.get_initializer(n) for n in ("coef", "intercept")}}
    G = np.random.default_rng(5).standard_normal((6, 1)).astype(np.float32)
    cpu = ["CPUExecutionProvider"]
    fwd = ort.InferenceSession(saved["_optimized_pre_grad_model"], providers=cpu)
    env = dict(zip([o.name for o in fwd.get_outputs()], fwd.run(None, feeds)))
    env.update(feeds)
    graphs = fb.cls_type_._graphs
    env[graphs.grad_inputs["variable"]] = G
    bwd = ort.InferenceSession(saved["_trained_onnx"], providers=cpu)
    by_name = dict(
        zip(
            [o.name for o in bwd.get_outputs()],
            bwd.run(None, {i.name: env[i.name] for i in bwd.get_inputs()}),
        )
    )
    fn.forward(list(feeds.values()), training=True)
    for name, got in zip(["X", "coef", "intercept"], fn.backward([G])):
        np.testing.assert_allclose(got.numpy(), by_name[graphs.grad_outputs[name]], rtol=1e-6)
    as_bytes = fb.cls_type_.save_onnx_graph(bytes)
    assert set(as_bytes) == set(saved)
    assert all(isinstance(v, bytes) for v in as_bytes.values())
    assert onnx.load_from_string(as_bytes["_trained_onnx"]) == onnx.load(saved["_trained_onnx"])
    with pytest.raises(PathNotFoundError, match="missing' does not exist"):
        fn.save_onnx_graph(str(tmp_path / "missing"))


# ---- providers and devices ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "providers",
    [None, "cpu", "CPU", ["CPUExecutionProvider"], ("cpu", "cpu"), "torch:cpu"],
)
def test_cpu_providers(data, linreg, providers):
    X, _ = data
    if providers == "torch:cpu":
        providers = torch_device("cpu")
    fb = OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32), providers=providers)
    assert fb.device_ == ("cpu", 0)
    assert fb.ort_providers_ == ["CPUExecutionProvider"]
    assert fb.new_instance().device_name(fb.cls_type_._devices[0]) == "Cpu"


@pytest.mark.parametrize(
    "providers",
    ["tpu", ["NONE"], 42, "cuda:x", "torch:meta", ["cpu", "cuda"], ("TensorrtExecutionProvider",)],
)
def test_bad_providers(data, linreg, providers):
    X, _ = data
    if providers == "torch:meta":
        providers = torch_device("meta")
    if providers == ["cpu", "cuda"]:
        message = r"^providers \['cpu', 'cuda'\] must all designate one device$"
    else:
        bad = providers[0] if isinstance(providers, list | tuple) else providers
        message = (
            rf"^unexpected providers {re.escape(repr(bad))}: expected None, 'cpu', 'cuda', 'cuda:N', 'gpu', "
            r"a torch\.device, or a list of 'CPUExecutionProvider' / 'CUDAExecutionProvider'$"
        )
    with pytest.raises(InputError, match=message):
        OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32), providers=providers)


@pytest.mark.skipif(CUDA, reason="CUDA is available here")
@pytest.mark.parametrize("providers", ["cuda", "cuda:1", "gpu", "torch:cuda"])
def test_cuda_unavailable(data, linreg, providers):
    X, _ = data
    if providers == "torch:cuda":
        providers = torch_device("cuda", 0)
    with pytest.raises(ValueError, match="not available"):
        OrtGradientForwardBackward(linreg_onnx(linreg, X, np.float32), providers=providers)


def test_device_helpers():
    fn_cls = OrtGradientForwardBackwardFunction
    assert fn_cls.device_name(ort.OrtDevice.make("cpu", 0)) == "Cpu"
    memory = C.OrtDevice.default_memory()
    assert fn_cls.device_name(C.OrtDevice(C.OrtDevice.cpu(), memory, 0)) == "Cpu"
    assert fn_cls.device_name(C.OrtDevice(C.OrtDevice.cuda(), memory, 0)) == "Gpu"
    assert fn_cls.device_name("cuda:1") == "Gpu"
    assert fn_cls.device_name(torch_device("cpu")) == "Cpu"
    assert fn_cls.device_name(ort.OrtValue.ortvalue_from_numpy(np.zeros(2))) == "Cpu"
    to_type = OrtGradientForwardBackward._provider_name_to_device_type
    assert to_type("CPUExecutionProvider") == C.OrtDevice.cpu()
    assert to_type("CUDAExecutionProvider") == C.OrtDevice.cuda()
    with pytest.raises(InputError, match=r"^unexpected provider name 'NONE'$"):
        to_type("NONE")
    values = fn_cls.input_to_ort([np.zeros((2, 3), np.float32)[:, ::2]], None, debug=True)
    assert values[0].shape() == [2, 2] and values[0].device_name() == "Cpu"  # a C.OrtValue
    with pytest.raises(ValueError, match="None"):
        fn_cls.input_to_ort([None], None, debug=False)


def test_logging_and_ignored_config(data, linreg, caplog):
    X, _ = data
    onx = linreg_onnx(linreg, X, np.float32)
    with caplog.at_level(logging.DEBUG, logger="onnxgrad.compat"):
        fb = OrtGradientForwardBackward(onx, enable_logging=True, debug=True)
        fn = fb.new_instance()
        fn.forward(
            [X[:2].astype(np.float32), fb.get_initializer("coef"), fb.get_initializer("intercept")],
            training=True,
        )
    assert "weights_to_train=['coef', 'intercept']" in caplog.text
    assert "forward" in caplog.text
    with pytest.warns(UserWarning, match="graph_builder_config"):
        OrtGradientForwardBackward(onx, graph_builder_config=object())
