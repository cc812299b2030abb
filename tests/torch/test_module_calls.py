"""OnnxModule's lean call path: a plain Runner's sessions run positionally on their C-level run,
tensors cross in one call each way (``TorchInterop.to_ortvalues`` / ``tensors_at``); the cases
that leave the fast forms (strided tensors, bool, an onnxruntime without them) give the same
values, and the other runners (PythonOp graphs) keep the generic path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnx import TensorProto, helper  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad import deps  # noqa: E402
from onnxgrad.errors import OnnxGradRuntimeError  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402
from tests.pythonop import functions as F  # noqa: E402
from tests.torch.conftest import export_net as _export  # noqa: E402


def _grads(module, x, weight):
    """The output, and the gradients of x and the module's parameters, of a loss whose gradient
    reaches the output as a strided (transposed) tensor."""
    y = module(x)
    loss = (y.t() * weight).sum()  # the gradient of y comes back transposed: not contiguous
    params = [p for p in module.parameters() if p.requires_grad]
    return y, torch.autograd.grad(loss, [x, *params])


def test_strided_gradients_and_parameters_give_torch_values(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    (variant,) = [m._variant(tuple(m.onnx_names.values()), ("x",))]
    assert variant.direct
    x = torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(3, 5, dtype=torch.float64)
    # a parameter replaced by a column-major copy of itself: strided, the same values
    for p in (m.get_parameter("0.weight"), net64[0].weight):
        p.data = p.data.t().contiguous().t()
    assert not m.get_parameter("0.weight").is_contiguous()
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, got = _grads(m, xo, weight)
    want_y, want = _grads(net64, xt, weight)
    torch.testing.assert_close(y, want_y)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_replaced_parameter_is_fed_and_an_in_place_update_is_seen(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    m(x).sum().backward()  # the variant and its sessions exist: a second call takes the fast path
    with torch.no_grad():
        m.get_parameter("2.bias").add_(1.0)  # in place: the same storage, new values
        net64[2].bias.add_(1.0)
    torch.testing.assert_close(m(x), net64(x))
    new = torch.randn(3, 6, dtype=torch.float64)
    m.get_submodule("2").weight = torch.nn.Parameter(new.clone())  # a new tensor object
    net64[2].weight = torch.nn.Parameter(new.clone())
    torch.testing.assert_close(m(x), net64(x))
    m.get_submodule("2").weight.data = new * 2  # the same Parameter, another storage
    with torch.no_grad():
        net64[2].weight.copy_(new * 2)
    y = m(x)
    torch.testing.assert_close(y, net64(x))
    y.sum().backward()
    net64.zero_grad()
    net64(x).sum().backward()
    torch.testing.assert_close(m.get_parameter("2.weight").grad, net64[2].weight.grad)


def test_inference_under_no_grad_uses_the_fast_path(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64).t().contiguous().t()  # a strided input
    with torch.no_grad():
        y = m(x)
    (variant,) = m._variants.values()
    assert variant.direct
    assert not y.requires_grad
    torch.testing.assert_close(y, net64(x).detach())


def _mismatch_model():
    """y = (a + b) * w: a and b declare independent symbolic sizes, so onnxruntime, not the
    module's input checks, refuses two sizes that do not broadcast."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "w"], ["y"])],
        "mismatch",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor("w", TensorProto.FLOAT, [1], [2.0])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_an_onnxruntime_failure_is_an_onnxgrad_error_in_both_directions():
    m = OnnxModule(_mismatch_model(), trainable=["w"])
    a, b = torch.ones(3), torch.ones(4)
    failed = "the forward graph failed in onnxruntime"
    with pytest.raises(OnnxGradRuntimeError, match=failed):
        m(a, b)
    with torch.no_grad(), pytest.raises(OnnxGradRuntimeError, match=failed):
        m(a, b)
    y = m(torch.ones(3), torch.full((3,), 2.0))
    torch.testing.assert_close(y, torch.full((3,), 6.0))
    (variant,) = [v for v in m._variants.values() if v.runner.wrt]

    def broken(feeds, names, options):
        raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : a stand-in failure")

    variant._bwd_run = broken
    with pytest.raises(OnnxGradRuntimeError, match=r"the backward graph failed in onnxruntime: .*stand-in"):
        y.sum().backward()


def test_a_pythonop_graph_keeps_the_generic_path_and_trains():
    torch.manual_seed(3)
    net = F.Net().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    m = OnnxModule(onnxgrad.export(net, (x,)))
    y = m(x)
    (variant,) = m._variants.values()
    assert not variant.direct  # the PythonOp runner, through BaseRunner.forward / backward
    y.pow(2).sum().backward()
    net.zero_grad()
    net(x).pow(2).sum().backward()
    for tname, oname in m.onnx_names.items():
        want = dict(net.named_parameters())[oname].grad
        torch.testing.assert_close(m.get_parameter(tname).grad, want, msg=oname)


# ---- the batched crossings of TorchInterop ------------------------------------------------------
def _vector(*values):
    vector = deps.C.OrtValueVector()
    for v in values:
        vector.push_back(v)
    return vector


@pytest.mark.parametrize("form", ["vector", "vector without dlpack_at", "list"])
def test_tensors_at_reads_float_int_and_bool_results(form, monkeypatch):
    interop = deps.torch_interop()
    if form == "vector without dlpack_at":  # an older onnxruntime
        monkeypatch.setattr(interop, "_at", False)
    f = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    i = torch.arange(4)
    b = torch.tensor([True, False, True])
    values = interop.to_ortvalues([f, i, b])
    vector = values if form == "list" else _vector(*values)  # runs that give a plain sequence
    got = interop.tensors_at(vector, [2, 0, 1])
    assert [t.dtype for t in got] == [torch.bool, torch.float32, torch.int64]
    assert got[0].tolist() == [True, False, True]
    torch.testing.assert_close(got[1], f)
    assert got[2].tolist() == [0, 1, 2, 3]
    assert got[1].data_ptr() == f.data_ptr()  # no copy either way


@pytest.mark.parametrize("direct", [True, False])
def test_to_ortvalues_copies_only_strided_tensors(direct, monkeypatch):
    interop = deps.torch_interop()
    if not direct:  # the older form: each tensor through to_ortvalue
        monkeypatch.setattr(interop, "_direct", None)
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    dense, strided, flag = base[1:], base.t(), torch.tensor([False, True])
    w = torch.ones(2, requires_grad=True)
    values = interop.to_ortvalues([dense, strided, flag, w])
    assert values[0].data_ptr() == dense.data_ptr() and values[3].data_ptr() == w.data_ptr()
    np.testing.assert_array_equal(values[1].numpy(), strided.numpy())  # a contiguous copy
    assert values[2].data_type() == "tensor(bool)" and values[2].numpy().tolist() == [False, True]


def test_the_direct_form_is_refused_to_a_reader_that_takes_strided_capsules():
    real = deps.C.OrtValue.from_dlpack

    def lenient(capsule):  # reads a strided capsule as a contiguous copy
        return real(torch.utils.dlpack.to_dlpack(torch.from_dlpack(capsule).contiguous()))

    assert deps.direct_from_dlpack(torch, lenient, "capsule") is None
    assert deps.direct_from_dlpack(torch, real, "capsule+flag") is None
    if deps.DLPACK_FORM == "capsule":
        assert deps.direct_from_dlpack(torch) is real


# ---- the fixed cost of a call: zero_grad, Function.apply, the crossings written inline ----------
def _step_grads(m, x):
    m.zero_grad()
    m(x).pow(2).sum().backward()
    return {t: p.grad.clone() for t, p in m.named_parameters()}


def test_zero_grad_clears_own_and_submodule_gradients_or_zeros_them(net64):
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    first = _step_grads(m, x)
    m(x).sum().backward()  # accumulates onto the first step's gradients
    assert not torch.equal(m.get_parameter("0.weight").grad, first["0.weight"])
    assert _step_grads(m, x).keys() == first.keys()  # zero_grad dropped them: no accumulation
    for t, g in _step_grads(m, x).items():
        torch.testing.assert_close(g, first[t])
    m.zero_grad(set_to_none=False)  # zeros, of each parameter's shape, as nn.Module gives
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    # a submodule's parameters (here a head added on top) are cleared too
    m.head = torch.nn.Linear(3, 1).double()
    m.head(m(x)).sum().backward()
    assert m.head.weight.grad is not None
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_functorch_transforms_get_torchs_own_refusal(net64):
    """Outside functorch transforms the Function is applied without torch's Python layer; inside
    one (vmap, grad) the call goes through ``Function.apply``, whose refusal names what is missing
    (applied directly, torch fails an internal assert instead)."""
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.vmap(m)(x.unsqueeze(0).expand(2, 3, 4))
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(lambda t: m(t).sum())(x)
    torch.testing.assert_close(m(x), net64(x))  # and the module works as before afterwards


@pytest.mark.parametrize("form", ["fast", "no direct from_dlpack", "no dlpack_at"])
def test_calls_without_the_inline_forms_give_torch_values(form, net64, monkeypatch):
    """The crossings written inline in a run fall back on TorchInterop's methods where the
    installed onnxruntime lacks their forms (the interop is patched before the module is built)."""
    interop = deps.torch_interop()
    _, has_value, has_tensor = interop.fast_forms()  # what the installed onnxruntime offers
    if form == "no direct from_dlpack":
        monkeypatch.setattr(interop, "_direct", None)
    elif form == "no dlpack_at":
        monkeypatch.setattr(interop, "_at", False)
    to_capsule, to_value, to_tensor = interop.fast_forms()
    assert to_capsule is not None
    assert (to_value is None) == (has_value is None or form == "no direct from_dlpack")
    assert (to_tensor is None) == (has_tensor is None or form == "no dlpack_at")
    m = OnnxModule(_export(net64, torch.randn(2, 4, dtype=torch.float64)))
    x = torch.randn(3, 4, dtype=torch.float64)
    got = _step_grads(m, x)
    net64.zero_grad()
    net64(x).pow(2).sum().backward()
    want = {t: dict(net64.named_parameters())[n].grad for t, n in m.onnx_names.items()}
    assert got.keys() == want.keys()
    for t in got:
        torch.testing.assert_close(got[t], want[t], msg=t)
    with torch.no_grad():
        torch.testing.assert_close(m(x), net64(x))
