"""OnnxModule: an ONNX graph as a PyTorch layer, checked against the same network in torch."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from onnxgrad.errors import InputError, InputTypeError, OnnxGradRuntimeError  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402
from tests.torch.conftest import export_net as _export  # noqa: E402


def test_parameters_named_for_torch_and_mapped_to_onnx(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    assert m.onnx_names == {
        "0.weight": "0.weight",
        "0.bias": "0.bias",
        "2.weight": "2.weight",
        "2.bias": "2.bias",
    }
    assert all(isinstance(p, torch.nn.Parameter) for p in m.parameters())
    assert "<- ONNX '0.weight'" in repr(m)


def test_gradcheck_float64_inputs_and_parameters(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m, (x,))
    w = m.get_parameter("0.weight")

    def f(x, w):
        return torch.func.functional_call(m, {"0.weight": w}, (x,))

    assert torch.autograd.gradcheck(f, (x, w.detach().clone().requires_grad_()))


def test_gradients_equal_torch_and_frozen_parameters_are_skipped(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(7, 4, dtype=torch.float64)
    m.get_parameter("2.bias").requires_grad_(False)
    m(x).pow(2).sum().backward()
    net64(x).pow(2).sum().backward()
    for tname, p in m.named_parameters():
        ref = dict(net64.named_parameters())[m.onnx_names[tname]]
        if tname == "2.bias":
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_several_forwards_before_backwards(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    ys = [m(x) for x in xs]
    for x, y in reversed(list(zip(xs, ys))):
        (gx,) = torch.autograd.grad(y.sum(), x)
        xr = x.detach().requires_grad_()
        (want,) = torch.autograd.grad(net64(xr).sum(), xr)
        torch.testing.assert_close(gx, want)


def test_second_backward_raises_torch_error(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    loss = m(torch.randn(2, 4, dtype=torch.float64)).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_no_grad_keeps_nothing_and_matches(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        y = m(x)
    assert y.grad_fn is None
    torch.testing.assert_close(y, net64(x).detach())


def test_mixed_network_trains_like_torch():
    torch.manual_seed(0)
    middle = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    onnx_middle = OnnxModule(_export(middle, torch.randn(2, 8)))

    def wrap(mid):
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(3, 8), mid, torch.nn.Tanh(), torch.nn.Linear(8, 1))

    ours, ref = wrap(onnx_middle), wrap(copy.deepcopy(middle))
    opt_a = torch.optim.Adam(ours.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    x, t = torch.randn(32, 3, generator=gen), torch.randn(32, 1, generator=gen)
    losses = []
    for _ in range(20):
        for net, opt in ((ours, opt_a), (ref, opt_b)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), t)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-5)


def test_state_dict_copy_pickle_and_to_onnx(net64, tmp_path):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    with torch.no_grad():
        m.get_parameter("0.bias").add_(1.0)
    x = torch.randn(4, 4, dtype=torch.float64)
    want = m(x).detach()
    other = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    other.load_state_dict(m.state_dict())
    torch.testing.assert_close(other(x), want)
    torch.testing.assert_close(copy.deepcopy(m)(x), want)
    torch.testing.assert_close(pickle.loads(pickle.dumps(m))(x), want)
    torch.save(m, tmp_path / "m.pt")
    torch.testing.assert_close(torch.load(tmp_path / "m.pt", weights_only=False)(x), want)
    sess = ort.InferenceSession(m.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x.numpy()})[0], want.numpy(), rtol=1e-12)


def test_bad_calls(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    with pytest.raises(InputError, match=r"expected 1 input tensor\(s\) \['x'\], got 2"):
        m(torch.zeros(1, 4), torch.zeros(1, 4))
    with pytest.raises(InputError, match="is not an initializer"):
        OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)), trainable=["nope"])


def test_tensors_cross_without_copies(net64, monkeypatch):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    seen = {}
    variant = m._variant(tuple(m.onnx_names.values()), ("x",))
    assert variant.direct  # a plain Runner: its forward session is called directly
    original = variant._fwd_run

    def spy(feeds, names, options):
        res = original(feeds, names, options)
        seen.update(inputs={k: v.data_ptr() for k, v in feeds.items()}, outputs=res[0].data_ptr())
        return res

    monkeypatch.setattr(variant, "_fwd_run", spy)
    y = m(x)
    assert seen["inputs"]["x"] == x.data_ptr()  # torch -> onnxruntime: the same buffer
    assert seen["inputs"]["0.weight"] == m.get_parameter("0.weight").data_ptr()
    assert variant._fwd_take[0] == 0
    assert seen["outputs"] == y.data_ptr()  # onnxruntime -> torch: the same buffer


def test_create_graph_is_refused_clearly(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(OnnxGradRuntimeError, match="does not support create_graph=True"):
        torch.autograd.grad(m(x).sum(), x, create_graph=True)


def _bn_dropout_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 2),
    ).double()


def test_train_and_eval_switch_batchnorm_and_dropout():
    net = _bn_dropout_net()
    net.eval()
    m = OnnxModule(_export(net, torch.randn(4, 5, dtype=torch.float64)))
    stats = {m.onnx_names[t] for t, _ in m.named_buffers()}
    assert stats == {"1.running_mean", "1.running_var"}  # buffers, not parameters
    x = torch.randn(16, 5, dtype=torch.float64)
    m.eval()
    torch.testing.assert_close(m(x), net(x))  # inference: running statistics, no dropout
    # training: BatchNorm uses batch statistics and updates the running ones; Dropout drops
    net.train()
    net[3].p = 0.0  # the torch reference without dropout, for the BatchNorm part
    m.train()
    before = m.get_buffer("1.running_mean").clone()
    x.requires_grad_(True)
    y = m(x)
    zero_rows = (y == 0).all(dim=1)
    assert not torch.equal(m.get_buffer("1.running_mean"), before)
    momentum = net[1].momentum
    batch_mean = (x @ net[0].weight.T + net[0].bias).mean(0)
    want = (1 - momentum) * before + momentum * batch_mean
    torch.testing.assert_close(m.get_buffer("1.running_mean"), want)
    # dropout: about half of the hidden units are zeroed, survivors scaled by 2
    h = torch.nn.functional.relu(net[1](net[0](x)))
    assert not zero_rows.all()
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    _ = h


def test_eval_mode_gradients_match_torch():
    net = _bn_dropout_net().eval()
    m = OnnxModule(_export(net, torch.randn(4, 5, dtype=torch.float64))).eval()
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(m, (x,))
    m(x).sum().backward()
    net(x).sum().backward()
    for tname, p in m.named_parameters():
        torch.testing.assert_close(p.grad, dict(net.named_parameters())[m.onnx_names[tname]].grad)


# ---- what the per-call caches must not change ------------------------------------------------------------
def test_a_parameter_replaced_between_calls_is_the_one_fed_and_trained(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    m(x).sum().backward()  # the call signature is now known
    new = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    m.get_submodule("0").weight = new
    y = m(x)
    ref = torch.func.functional_call(net64, {"0.weight": new.detach()}, (x,))
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()
    # functional_call puts a plain tensor in _parameters for the duration of the call
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    out = torch.func.functional_call(m, {"0.weight": w}, (x,))
    torch.testing.assert_close(out, torch.func.functional_call(net64, {"0.weight": w.detach()}, (x,)))
    (gw,) = torch.autograd.grad(out.sum(), w)
    assert gw.shape == w.shape and gw.abs().sum() > 0


def test_freezing_a_parameter_between_calls_changes_what_is_differentiated(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    m(x).sum().backward()
    assert m.get_parameter("2.bias").grad is not None
    m.zero_grad(set_to_none=True)
    m.get_parameter("2.bias").requires_grad_(False)
    m(x).sum().backward()
    assert m.get_parameter("2.bias").grad is None and m.get_parameter("0.weight").grad is not None
    with torch.no_grad():  # nothing requires grad: no graph
        assert m(x).grad_fn is None
    assert m(x).grad_fn is not None  # and back


def test_a_new_input_shape_or_dtype_is_validated_again(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    m(torch.randn(3, 4, dtype=torch.float64))
    assert m(torch.randn(5, 4, dtype=torch.float64)).shape == (5, 3)  # the batch dimension is free
    for _ in range(2):  # a refused signature is not remembered as valid
        with pytest.raises(InputError, match=r"input 'x' has shape \(3, 5\), the model expects"):
            m(torch.randn(3, 5, dtype=torch.float64))
        with pytest.raises(InputTypeError, match=r"input 'x' has dtype complex64, the model expects float64"):
            m(torch.ones(3, 4, dtype=torch.complex64))
        with pytest.raises(InputError, match=r"input 'x' has rank 1"):
            m(torch.randn(4, dtype=torch.float64))
        with pytest.raises(InputError, match=r"input 'x' must be a torch.Tensor, got ndarray"):
            m(np.zeros((3, 4)))
        with pytest.raises(InputError, match=r"expected 1 input tensor\(s\) \['x'\], got 0"):
            m()
    assert m(torch.randn(3, 4, dtype=torch.float64)).shape == (3, 3)


def test_many_input_shapes_keep_the_signature_memory_bounded(net64):
    from onnxgrad.torch import module as module_impl

    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    for n in range(1, module_impl._MAX_PLANS + 20):
        m(torch.randn(n, 4, dtype=torch.float64))
    assert len(m._plans) <= module_impl._MAX_PLANS
    assert len(m._variants) == 1  # one graph variant for all of them


def test_strided_and_offset_inputs_give_the_same_values_and_gradients(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    base = torch.randn(4, 6, dtype=torch.float64)
    cases = {
        "transposed": base[:, :4].t().contiguous().t(),  # column-major: not contiguous
        "sliced columns": base[:, 1:5],  # strided rows
        "offset rows": torch.randn(9, 4, dtype=torch.float64)[5:],  # contiguous, storage offset
    }
    for name, x in cases.items():
        xr = x.detach().clone().requires_grad_()
        xs = x.detach().requires_grad_()  # the same strides and storage offset
        assert xs.stride() == x.stride() and xs.storage_offset() == x.storage_offset()
        y = m(xs)
        torch.testing.assert_close(y, net64(x.detach()), msg=name)
        (g,) = torch.autograd.grad(y.pow(2).sum(), xs)
        (want,) = torch.autograd.grad(net64(xr).pow(2).sum(), xr)
        torch.testing.assert_close(g, want, msg=name)


def test_in_place_change_of_a_saved_input_is_reported_by_torch(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    y = m(x)
    x.add_(1.0)  # x is saved for the weight gradient of the first layer
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_in_place_change_of_an_output_the_backward_saved_is_reported_as_torch_does():
    # mlp's output is Sigmoid's, which its backward reads: torch saves it, and so does onnxgrad
    from tests.models import mlp

    model = mlp()
    m = OnnxModule(model)
    assert "y" in m._variant(("W1", "b1", "W2", "b2"), ()).saved_names
    w = {i.name: torch.tensor(onnx.numpy_helper.to_array(i)) for i in model.graph.initializer}
    x = torch.randn(3, 4, dtype=torch.float64)

    def eager(x):
        return torch.sigmoid(torch.relu(x @ w["W1"] + w["b1"]) @ w["W2"] + w["b2"])

    w["W1"].requires_grad_()
    want = eager(x)
    want.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as torch_error:
        want.sum().backward()
    y = m(x)
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        y.sum().backward()
    assert "output 0 of _OnnxFunction, is at version 1; expected version 0" in str(ours.value)
    assert "is at version 1; expected version 0" in str(torch_error.value)
    # left alone, the output's gradient is torch's
    (g,) = torch.autograd.grad(m(x).pow(2).sum(), m.W1)
    (g_want,) = torch.autograd.grad(eager(x).pow(2).sum(), w["W1"])
    torch.testing.assert_close(g, g_want)


def _two_outputs_model():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(12, dtype=np.float64).reshape(4, 3) / 10, "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Tanh", ["h"], ["a"]),
            helper.make_node("Mul", ["h", "h"], ["b"]),
        ],
        "two",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 4])],
        [
            helper.make_tensor_value_info("a", TensorProto.DOUBLE, ["n", 3]),
            helper.make_tensor_value_info("b", TensorProto.DOUBLE, ["n", 3]),
        ],
        [w],
    )
    return onnx.helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_an_output_left_out_of_the_loss_counts_as_a_zero_gradient():
    m = OnnxModule(_two_outputs_model())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = m.w.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    for _ in range(2):
        x.grad, m.w.grad, xr.grad, w.grad = None, None, None, None
        a, b = m(x)
        assert a.requires_grad and b.requires_grad
        a.sum().backward()  # b does not reach the loss
        torch.tanh(xr @ w).sum().backward()
        torch.testing.assert_close(x.grad, xr.grad)
        torch.testing.assert_close(m.w.grad, w.grad)


def test_tensors_cross_to_onnxruntime_and_back_by_dlpack():
    from onnxgrad.runtime.values import from_torch, to_torch

    base = torch.arange(12.0).reshape(3, 4)
    cases = [
        base,
        base[1:],  # storage offset
        torch.nn.Parameter(base.clone()),  # requires grad: shared, not refused
        torch.tensor([True, False, True]),
        torch.zeros(0, 3),
        torch.tensor(2.5, dtype=torch.float64),
        base.to(torch.bfloat16),
    ]
    for t in cases:
        value = from_torch(t)
        back = to_torch(value)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t.detach())
        assert back.data_ptr() == t.data_ptr() or t.numel() == 0  # no copy
    strided = base.t()
    value = from_torch(strided)  # a strided view crosses as a contiguous copy
    assert value.shape() == [4, 3] and torch.equal(to_torch(value), strided)
    # the value holds its tensor: the buffer outlives every Python reference to the tensor
    value = from_torch(torch.full((1000,), 7.0))
    assert torch.equal(to_torch(value), torch.full((1000,), 7.0))


def test_run_takes_wrappers_other_mappings_and_iterables():
    from types import MappingProxyType

    from onnx import TensorProto, helper

    from onnxgrad.runtime.values import from_numpy, run

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    a = np.array([1.0, -1.0], np.float32)
    for feeds, names in [
        ({"x": from_numpy(a)}, ["y"]),
        ({"x": ort.OrtValue.ortvalue_from_numpy(a)}, ("y",)),
        (MappingProxyType({"x": from_numpy(a)}), iter(["y"])),
    ]:
        (y,) = run(sess, feeds, names)
        np.testing.assert_array_equal(y.numpy(), [1.0, 0.0])
    with pytest.raises(Exception, match="Unexpected input data type"):  # a failed run is not retried
        run(sess, {"x": from_numpy(a.astype(np.float64))}, ["y"])


def test_integer_output_comes_back_without_a_gradient():
    """A model with a float and an int64 output (ArgMax): both come out, the float one trains."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["k"], axis=1, keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["N"]),
        ],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    om = OnnxModule(model)
    x = torch.randn(5, 4)
    y, k = om(x)
    assert k.dtype == torch.int64 and not k.requires_grad and y.requires_grad
    torch.testing.assert_close(k, (x @ torch.from_numpy(w)).argmax(dim=1))
    y.sum().backward()
    torch.testing.assert_close(om.w.grad, x.T @ torch.ones(5, 3))
