"""ForwardBackward: the numpy-in, numpy-out runtime on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxgrad
from onnxgrad.errors import InputError, OnnxGradRuntimeError
from tests.autodiff.random_data import seeded
from tests.models import mlp, numpy_mlp_grads

RNG = seeded("")  # replaced before each test by a generator seeded from the test's id


@pytest.fixture(autouse=True)
def fresh_random_data(request: pytest.FixtureRequest) -> None:
    """Each test draws from its own generator: the same data whatever ran before it."""
    global RNG
    RNG = seeded(request.node.nodeid)


def test_forward_matches_plain_onnxruntime_and_backward_matches_numpy():
    model = mlp()
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    x = RNG.standard_normal((7, 4))
    res = fb.forward({"x": x})
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(res.outputs[0], plain.run(None, {"x": x})[0], rtol=1e-12)
    dy = RNG.standard_normal((7, 3))
    grads = res.backward([dy])
    want = numpy_mlp_grads(model, x, dy)
    assert set(grads) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(grads[k], v, rtol=1e-10, atol=1e-12)


def test_in_place_change_of_an_output_the_backward_saved_leaves_the_gradients_alone():
    model = mlp()  # its output is Sigmoid's, which the backward reads
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    assert "y" in fb.graphs.saved
    x, dy = RNG.standard_normal((7, 4)), RNG.standard_normal((7, 3))
    res = fb.forward({"x": x})
    res.outputs[0] += 1.0  # the caller's array is its own
    grads = res.backward([dy])
    for k, v in numpy_mlp_grads(model, x, dy).items():
        np.testing.assert_allclose(grads[k], v, rtol=1e-10, atol=1e-12)


def test_saved_values_stay_in_onnxruntime_and_inputs_are_not_copied():
    fb = onnxgrad.ForwardBackward(mlp())
    x = np.ascontiguousarray(RNG.standard_normal((3, 4)))
    res = fb.forward({"x": x})
    saved = res._saved
    assert all(type(saved[s]).__name__ == "OrtValue" for s in fb.graphs.saved)
    # the input x is saved for the backward: it is the caller's buffer, wrapped, not copied
    assert saved["x"].data_ptr() == x.ctypes.data
    # parameters are wrapped around the live numpy buffers
    assert saved["W2"].data_ptr() == fb.parameters["W2"].ctypes.data


def test_several_forwards_alive_then_backwards_in_any_order():
    fb = onnxgrad.ForwardBackward(mlp())
    xs = [RNG.standard_normal((2, 4)) for _ in range(3)]
    results = [fb.forward({"x": x}) for x in xs]
    for i in (2, 0, 1):
        grads = results[i].backward()
        want = numpy_mlp_grads(mlp(), xs[i], np.ones((2, 3)))
        np.testing.assert_allclose(grads["W1"], want["W1"], rtol=1e-10)


def test_backward_protocol_errors():
    fb = onnxgrad.ForwardBackward(mlp())
    x = RNG.standard_normal((2, 4))
    res = fb.forward({"x": x})
    res.backward()
    with pytest.raises(OnnxGradRuntimeError, match="backward already ran"):
        res.backward()
    inf = fb.forward({"x": x}, training=False)
    np.testing.assert_allclose(inf.outputs[0], res.outputs[0])
    with pytest.raises(OnnxGradRuntimeError, match="training=False"):
        inf.backward()


def test_input_validation():
    fb = onnxgrad.ForwardBackward(mlp())
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['y'\]"):
        fb.forward({"x": np.zeros((2, 4)), "y": np.zeros(1)})
    with pytest.raises(InputError, match=r"missing input\(s\) \['x'\]"):
        fb.forward({})
    with pytest.raises(InputError, match="has dtype complex64, the model expects float64"):
        fb.forward({"x": np.zeros((2, 4), np.complex64)})
    with pytest.raises(InputError, match=r"dimension 1 must be 4"):
        fb.forward({"x": np.zeros((2, 5))})
    with pytest.raises(InputError, match="expects rank 2"):
        fb.forward({"x": np.zeros(4)})
    res = fb.forward({"x": np.zeros((2, 4))})
    with pytest.raises(InputError, match=r"has shape \(3, 3\), the output has \(2, 3\)"):
        res.backward({"y": np.zeros((3, 3))})
    with pytest.raises(InputError, match="no gradient can be given for"):
        res.backward({"nope": np.zeros((2, 3))})


def test_set_parameters_and_to_onnx_round_trip():
    fb = onnxgrad.ForwardBackward(mlp())
    x = RNG.standard_normal((5, 4))
    new = {k: v * 0.5 for k, v in fb.parameters.items()}
    fb.set_parameters(new)
    out = fb.forward({"x": x}, training=False).outputs[0]
    exported = fb.to_onnx()
    assert [o.name for o in exported.graph.output] == ["y"]
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], out, rtol=1e-12)
    with pytest.raises(InputError, match="has shape"):
        fb.set_parameters({"W1": np.zeros((2, 2))})
    with pytest.raises(InputError, match="is not a trainable parameter"):
        fb.set_parameters({"nope": np.zeros(1)})


def test_in_place_parameter_updates_are_seen_without_rebuild():
    fb = onnxgrad.ForwardBackward(mlp())
    x = RNG.standard_normal((2, 4))
    before = fb.forward({"x": x}, training=False).outputs[0].copy()
    fb.parameters["b2"][:] += 10.0  # live buffer
    after = fb.forward({"x": x}, training=False).outputs[0]
    p = fb.parameters
    z = np.maximum(x @ p["W1"] + p["b1"], 0) @ p["W2"] + p["b2"]
    np.testing.assert_allclose(after, 1 / (1 + np.exp(-z)), rtol=1e-12)  # the new b2 is used
    z_before = np.log(before / (1 - before))
    np.testing.assert_allclose(z, z_before + 10.0, rtol=1e-9, atol=1e-9)


def test_0d_parameters_and_inputs_keep_their_shape():
    """np.ascontiguousarray turns a 0-d array into shape (1,): parameters, inputs and output
    gradients of shape () must stay 0-d."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "s"], ["p"]), helper.make_node("Mul", ["p", "t"], ["y"])],
        "scalars",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3]),
         helper.make_tensor_value_info("t", TensorProto.DOUBLE, [])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])],
        [numpy_helper.from_array(np.array(2.0), "s")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    # a scalar gain is not in the default set (an exporter constant, by its use): name it
    fb = onnxgrad.ForwardBackward(model, trainable=["s"], inputs_requiring_grad=["t"])
    fb.set_parameters({"s": np.array(3.0)})
    assert fb.parameters["s"].shape == ()
    x = np.array([1.0, 2.0, 3.0])
    res = fb.forward({"x": x, "t": np.array(0.5)})
    np.testing.assert_allclose(res.outputs[0], x * 1.5)
    grads = res.backward({"y": np.ones(3)})
    assert grads["s"].shape == () and grads["t"].shape == ()
    np.testing.assert_allclose([grads["s"], grads["t"]], [x.sum() * 0.5, x.sum() * 3.0])


def test_unknown_provider_is_an_input_error():
    with pytest.raises(InputError, match="not available"):
        onnxgrad.ForwardBackward(mlp(), providers=["NoSuchExecutionProvider"])


def test_nothing_to_differentiate_is_an_input_error():
    """A model without trainable initializers, and no input asked for: refused up front (onnxruntime
    would fail on the empty backward graph with a native error)."""
    model = mlp()
    with pytest.raises(InputError, match=r"^nothing to differentiate: the model has no floating-point"):
        onnxgrad.ForwardBackward(model, trainable=[])
    fb = onnxgrad.ForwardBackward(model, trainable=[], inputs_requiring_grad=["x"])
    x = RNG.standard_normal((3, 4))
    got = fb.forward({"x": x}).backward()
    np.testing.assert_allclose(got["x"], numpy_mlp_grads(model, x, np.ones((3, 3)))["x"], rtol=1e-10)


def test_gradients_with_respect_to_inputs_and_initializers():
    model = mlp()
    x = RNG.standard_normal((3, 4))
    got = onnxgrad.gradients(model, {"x": x}, wrt=["x", "b1"])
    assert list(got) == ["x", "b1"]
    want = numpy_mlp_grads(model, x, np.ones((3, 3)))
    np.testing.assert_allclose(got["x"], want["x"], rtol=1e-10)
    with pytest.raises(InputError, match="neither initializers nor inputs"):
        onnxgrad.gradients(model, {"x": x}, wrt=["nope"])


def test_set_parameters_between_forward_and_backward_uses_the_forward_values():
    fb = onnxgrad.ForwardBackward(mlp())
    x = RNG.standard_normal((2, 4))
    model = mlp()
    res = fb.forward({"x": x})
    fb.set_parameters({k: np.zeros_like(v) for k, v in fb.parameters.items()})
    np.random.default_rng(0).standard_normal((1000, 1000))  # reuse freed memory, if any was freed
    got = res.backward()
    want = numpy_mlp_grads(model, x, np.ones((2, 3)))
    np.testing.assert_allclose(got["W1"], want["W1"], rtol=1e-10)


def test_training_flag_switches_batchnorm_and_dropout():
    torch = pytest.importorskip("torch")
    import io

    import onnx

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 2)
    ).double()
    net.eval()
    buf = io.BytesIO()
    torch.onnx.export(
        net,
        (torch.randn(4, 3, dtype=torch.float64),),
        buf,
        dynamo=False,
        input_names=["x"],
        dynamic_axes={"x": {0: "batch"}},
    )
    fb = onnxgrad.ForwardBackward(onnx.load_from_string(buf.getvalue()))
    assert set(fb.buffers) == {"1.running_mean", "1.running_var"}
    assert not set(fb.buffers) & set(fb.parameters)
    x = RNG.standard_normal((32, 3))
    # inference: running statistics, no dropout, exactly torch's eval output
    np.testing.assert_allclose(
        fb.forward({"x": x}, training=False).outputs[0], net(torch.from_numpy(x)).detach().numpy(), rtol=1e-10
    )
    # training: batch statistics (running mean updated as torch does), dropout active
    mean0 = fb.buffers["1.running_mean"].copy()
    res = fb.forward({"x": x})
    h = x @ fb.parameters["0.weight"].T + fb.parameters["0.bias"]
    m = net[1].momentum
    # ONNX stores the momentum as a float32 attribute: equal to torch up to float32 rounding
    np.testing.assert_allclose(fb.buffers["1.running_mean"], (1 - m) * mean0 + m * h.mean(0), rtol=1e-6)
    grads = res.backward()
    assert np.isfinite(grads["0.weight"]).all() and grads["0.weight"].any()
    exported = fb.to_onnx()  # inference model with the updated running statistics
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(
        sess.run(None, {"x": x})[0], fb.forward({"x": x}, training=False).outputs[0], rtol=1e-12
    )


@pytest.mark.parametrize("opset", [11, 22])
def test_scalar_output_gradient_and_scalar_input_keep_their_rank(opset):
    """np.ascontiguousarray turns a 0-d array into shape (1,): a given scalar output gradient made
    the gradient of Det of a 2-D matrix come back (1, 2, 2), and a scalar input fed as (1,)."""
    from onnx import TensorProto, helper

    from onnxgrad.model.graph import ir_version_for

    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["d"]), helper.make_node("Mul", ["d", "s"], ["y"])],
        "det",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model.opset_import)
    x = np.array([[2.0, 1.0], [0.5, 3.0]], dtype=np.float32)
    s = np.array(1.5, dtype=np.float32)
    grads = onnxgrad.gradients(
        model, {"x": x, "s": s}, {"y": np.array(2.0, dtype=np.float32)}, wrt=["x", "s"]
    )
    assert grads["x"].shape == (2, 2) and grads["s"].shape == ()
    np.testing.assert_allclose(grads["x"], 3.0 * np.array([[3.0, -0.5], [-1.0, 2.0]]), rtol=1e-6)
    np.testing.assert_allclose(grads["s"], 2.0 * np.linalg.det(x), rtol=1e-6)
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    res = fb.forward({"x": x, "s": s})
    assert res.outputs[0].shape == ()
