"""onnxcustom's own calling conventions on onnxgrad.compat: output caches reused on every
iteration, the returned values bound with onnxruntime's C-level ``SessionIOBinding``, output
gradients given in another shape of the same size (issue 22, items 5 to 7).

The scenarios mirror onnxcustom's ``_unittests/ut_training/test_ortgradient.py`` and the loop of
``OrtGradientForwardBackwardOptimizer._iteration``: a ``LinearRegression`` converted with
``black_op={'LinearRegressor'}``, whose gradients are checked by hand (``X^T G``, ``sum(G)``).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime.capi import _pybind_state as C
from skl2onnx import to_onnx
from sklearn.datasets import make_regression
from sklearn.linear_model import LinearRegression

from onnxgrad.compat import OrtGradientForwardBackward, OrtValueVector
from onnxgrad.errors import InputError

CPU = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


@pytest.fixture(scope="module")
def linear():
    """(model, X, y, coef, intercept): onnxcustom's tutorial model, 10 features, float32."""
    X, y = make_regression(100, n_features=10, noise=0.5, random_state=0)
    X, y = X.astype(np.float32), (y / y.std()).astype(np.float32)
    reg = LinearRegression().fit(X, y)
    onx = to_onnx(reg, X[:1], target_opset={"": 17, "ai.onnx.ml": 3}, black_op={"LinearRegressor"})
    onx.ir_version = 10
    fb = OrtGradientForwardBackward(onx)
    return fb, X, y, fb.get_initializer("coef"), fb.get_initializer("intercept")


def expected_grads(x: np.ndarray, coef: np.ndarray, g: np.ndarray) -> list[np.ndarray]:
    """Gradients of sum(G * (x coef + b)) w.r.t. x, coef, intercept, in float64."""
    g = g.astype(np.float64).reshape((-1, 1))
    return [g @ coef.astype(np.float64).T, x.astype(np.float64).T @ g, g.sum(axis=0)]


def assert_grads(got, expected) -> None:
    assert len(got) == len(expected)
    for value, ref in zip(got, expected):
        arr = value.numpy()
        scale = max(np.abs(ref).max(), 1e-6)
        np.testing.assert_allclose(arr.reshape(ref.shape), ref, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", ["C.OrtValueVector", "OrtValueVector", "list"])
def test_caches_are_overwritten_not_appended(linear, kind):
    """Item 5: the same caches passed on every iteration hold this iteration's values only."""
    fb, X, _, coef, intercept = linear
    fn = fb.new_instance()
    make = {"C.OrtValueVector": C.OrtValueVector, "OrtValueVector": OrtValueVector, "list": list}[kind]
    prediction_cache, gradient_cache = make(), make()
    rng = np.random.default_rng(0)
    for it in range(3):
        x = X[it * 10 : it * 10 + 10]
        w = coef + it  # other weights each time: the new prediction differs from the old one
        prediction = fn.forward([x, w, intercept], training=True, forward_outputs_cache=prediction_cache)
        assert prediction is prediction_cache and len(prediction) == 1
        np.testing.assert_allclose(prediction[0].numpy(), x @ w + intercept, rtol=1e-5, atol=1e-4)
        g = rng.standard_normal((10, 1)).astype(np.float32)
        gradient = fn.backward([g], backward_outputs_cache=gradient_cache)
        assert gradient is gradient_cache and len(gradient) == 3  # 3 inputs, 3 gradients
        assert_grads(gradient, expected_grads(x, w, g))


def test_previous_result_as_cache(linear):
    """What onnxcustom's loop does: the vectors the previous calls returned come back as caches.
    Before the fix, the prediction was appended (the old one read first) and 6 gradients came
    back for 3 inputs."""
    fb, X, _, coef, intercept = linear
    fn = fb.new_instance()
    x0, x1 = X[:8], X[8:16]
    prediction = fn.forward([x0, coef, intercept], training=True)
    gradient = fn.backward([np.ones((8, 1), np.float32)])
    old = prediction[0].numpy().copy()
    view = prediction[0].numpy()  # shares the value's buffer
    again = fn.forward([x1, coef, intercept], training=True, forward_outputs_cache=prediction)
    assert again is prediction and len(prediction) == 1
    np.testing.assert_allclose(prediction[0].numpy(), x1 @ coef + intercept, rtol=1e-5, atol=1e-4)
    assert not np.allclose(prediction[0].numpy(), old)
    # written in place, as the original's agent wrote into the cache: the earlier view changed too
    np.testing.assert_array_equal(view, prediction[0].numpy())
    g = np.full((8, 1), 2.0, np.float32)
    assert fn.backward([g], backward_outputs_cache=gradient) is gradient and len(gradient) == 3
    assert_grads(gradient, expected_grads(x1, coef, g))


def test_a_bare_vector_with_other_shapes_is_refused(linear):
    """onnxruntime's own vector can only be rewritten in place: a smaller last batch does not fit
    in the buffers of the previous one, and the error says what to pass instead."""
    fb, X, _, coef, intercept = linear
    fn = fb.new_instance()
    cache = C.OrtValueVector()
    fn.forward([X[:10], coef, intercept], forward_outputs_cache=cache)
    with pytest.raises(InputError, match=r"holding \[\('tensor\(float\)', \(10, 1\)\)\], cannot receive"):
        fn.forward([X[:4], coef, intercept], forward_outputs_cache=cache)
    np.testing.assert_allclose(cache[0].numpy(), X[:10] @ coef + intercept, rtol=1e-5, atol=1e-4)
    ours = OrtValueVector()  # onnxgrad's vector takes any shapes
    for n in (10, 4):
        out = fn.forward([X[:n], coef, intercept], forward_outputs_cache=ours)
        assert len(out) == 1 and out[0].shape() == [n, 1]
        np.testing.assert_allclose(out[0].numpy(), X[:n] @ coef + intercept, rtol=1e-5, atol=1e-4)
        assert len(out.to_dlpacks(lambda capsule: capsule)) == 1
        assert out.element_type_at(0) == TensorProto.FLOAT


def test_returned_values_bind_with_c_iobinding(linear):
    """Item 6: onnxcustom's losses bound the prediction with ``C.SessionIOBinding``: the values
    returned are the C objects it takes, as the original returned."""
    fb, X, y, coef, intercept = linear
    fn = fb.new_instance()
    x, t = X[:16], y[:16].reshape((-1, 1))
    (prediction,) = fn.forward([x, coef, intercept], training=True)
    assert type(prediction) is C.OrtValue
    # onnxcustom's square-error loss: Y = sum((X1 - X2)^2), Z = -2 (X1 - X2), with an IO binding
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["X1", "X2"], ["diff"]),
            helper.make_node("ReduceSumSquare", ["diff"], ["Y"], keepdims=0),
            helper.make_node("Mul", ["diff", "minus_two"], ["Z"]),
        ],
        "square_error",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None, 1]) for n in ("X1", "X2")],
        [
            helper.make_tensor_value_info("Y", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, 1]),
        ],
        [onnx.numpy_helper.from_array(np.array([-2], np.float32), "minus_two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    bind = C.SessionIOBinding(sess._sess)
    bind.bind_ortvalue_input("X1", C.OrtValue.ortvalue_from_numpy(t, CPU))
    bind.bind_ortvalue_input("X2", prediction)  # a TypeError with the public onnxruntime.OrtValue
    bind.bind_output("Y", CPU)
    bind.bind_output("Z", CPU)
    sess._sess.run_with_iobinding(bind, None)
    loss, loss_gradient = bind.get_outputs()
    pred = x @ coef + intercept
    np.testing.assert_allclose(loss.numpy(), ((t - pred) ** 2).sum(), rtol=1e-4)
    np.testing.assert_allclose(loss_gradient.numpy(), -2 * (t - pred), rtol=1e-3, atol=1e-4)
    gradients = fn.backward([loss_gradient])  # a C value goes back in as it came out
    assert all(type(g) is C.OrtValue for g in gradients)
    assert_grads(gradients, expected_grads(x, coef, loss_gradient.numpy()))


@pytest.mark.parametrize("as_ortvalue", [False, True])
def test_output_gradient_of_the_same_size_in_another_shape(linear, as_ortvalue):
    """Item 7: onnxcustom's tests fed a (1, N) gradient for an (N, 1) output; it is reshaped. A
    gradient with another number of values is still refused."""
    fb, X, _, coef, intercept = linear
    fn = fb.new_instance()
    x = X[:6]
    g = np.arange(6, dtype=np.float32).reshape((1, 6)) / 6
    fn.forward([x, coef, intercept], training=True)
    given = ort.OrtValue.ortvalue_from_numpy(g) if as_ortvalue else g
    assert_grads(fn.backward([given]), expected_grads(x, coef, g.reshape((6, 1))))
    fn.forward([x, coef, intercept], training=True)
    with pytest.raises(InputError, match=r"gradient 0 \('variable'\) has shape \(1, 5\), expected \(6, 1\)"):
        fn.backward([g[:, :5]])
    assert_grads(fn.backward([g.ravel()]), expected_grads(x, coef, g.reshape((6, 1))))  # (N,) too


def test_onnxcustom_optimizer_loop_learns(linear):
    """The loop of onnxcustom's ``OrtGradientForwardBackwardOptimizer._iteration`` (state list
    with X first, C vectors as caches, the weight update ``w -= lr / batch * grad``) drives the
    loss down from random weights to the least-squares fit."""
    fb, X, y, coef, intercept = linear
    fn = fb.new_instance()
    rng = np.random.default_rng(1)
    state = [None, rng.standard_normal(coef.shape).astype(np.float32), np.zeros_like(intercept)]
    prediction_cache, gradient_cache = C.OrtValueVector(), C.OrtValueVector()
    lr, batch, losses = 0.05, 10, []
    for _epoch in range(30):
        total = 0.0
        for start in range(0, len(X), batch):
            x, t = X[start : start + batch], y[start : start + batch].reshape((-1, 1))
            state[0] = x
            prediction = fn.forward(state, training=True, forward_outputs_cache=prediction_cache)
            diff = prediction[0].numpy() - t
            total += float((diff**2).sum())
            gradient = fn.backward([2 * diff], backward_outputs_cache=gradient_cache)
            assert len(gradient) == len(state)
            for i in (1, 2):
                state[i] = state[i] - lr / batch * gradient[i].numpy()
        losses.append(total / len(X))
    assert losses[-1] < losses[0] / 100
    np.testing.assert_allclose(state[1], coef, rtol=0.02, atol=0.02 * np.abs(coef).max())


def test_onx_inp_and_onx_out_pair_inputs_with_their_gradients(linear):
    """onnxcustom's ``_onx_inp`` / ``_onx_out``: the differentiated values in its order (forward
    inputs, then weights) and their gradients, pairwise, one length (onnxcustom's own check)."""
    fb = linear[0]
    assert fb.cls_type_._onx_inp == ["X", "coef", "intercept"]
    assert fb.cls_type_._onx_out == ["X_grad", "coef_grad", "intercept_grad"]


def test_onx_inp_of_a_qdq_model_trained_in_its_scales(tmp_path):
    """A model as onnxruntime's quantize_static writes it (QuantizeLinear/DequantizeLinear pairs,
    int8 weights behind DequantizeLinear), trained in its float scales only (the zero points are
    integers): ``_onx_inp`` lists the input, then the scales in the order given."""
    from tests.autodiff.test_rules_quant import _float_mlp, _quantize

    r = np.random.default_rng(0)
    x = r.standard_normal((6, 8)).astype(np.float32)
    qdq = _quantize(tmp_path, _float_mlp(r), "static", [x, r.standard_normal((6, 8)).astype(np.float32)])
    scales = [i.name for i in qdq.graph.initializer if i.name.endswith("_scale")]
    assert "y_scale" in scales  # the output's own quantization
    fb = OrtGradientForwardBackward(qdq, weights_to_train=scales)
    assert fb.cls_type_._onx_inp == ["x", *scales]
    assert fb.cls_type_._onx_out == [f"{n}_grad" for n in ["x", *scales]]
    fn = fb.new_instance()
    fn.forward([x, *[fb.get_initializer(n) for n in scales]], training=True)
    grads = fn.backward([np.ones((6, 4), np.float32)])
    assert len(grads) == len(fb.cls_type_._onx_out)
