"""The PythonOp matrix: each custom Function exported with onnxgrad.export, run on onnxruntime through
ForwardBackward, and compared (values and gradients) with the same module in PyTorch eager."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
import torch

import onnxgrad
from onnxgrad.errors import GradientNotImplementedError, PythonOpError
from onnxgrad.model.pythonop_spec import node_attributes
from onnxgrad.pythonop import contexts
from onnxgrad.pythonop.executor import run_model
from tests.pythonop import functions as F

torch.manual_seed(0)


def _python_nodes(model: onnx.ModelProto, op: str = "PythonOp") -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def compare_with_torch(module, *args, input_grads=True, rtol=1e-10, atol=1e-12):
    """Export ``module``, run forward + backward (ones on every output) on onnxruntime and in eager.

    Returns the model and the ForwardBackward; asserts outputs and gradients (parameters and
    floating-point inputs) agree.
    """
    model = onnxgrad.export(module, args)
    onnx.checker.check_model(model, full_check=True)
    inits = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    wrt = [n for n, a in zip(names, args) if input_grads and a.is_floating_point()]
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=wrt)
    feeds = {n: a.detach().numpy().copy() for n, a in zip(names, args)}
    res = fb.forward(feeds)
    grads = res.backward()

    leaves = [a.detach().clone().requires_grad_(n in wrt) for n, a in zip(names, args)]
    module.zero_grad()
    outs = module(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [o for o in outs if o.requires_grad]
    torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    assert len(res.outputs) == len(outs)
    for got, want in zip(res.outputs, outs):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=rtol, atol=atol)
    for name, p in module.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        np.testing.assert_allclose(grads[name], want.numpy(), rtol=rtol, atol=atol, err_msg=name)
    for n, leaf in zip(names, leaves):
        if n in wrt:
            np.testing.assert_allclose(grads[n], leaf.grad.numpy(), rtol=rtol, atol=atol, err_msg=n)
    return model, fb


def test_single_tensor_input_and_output(no_leaks):
    model, _ = compare_with_torch(F.Apply(F.Cube.apply).double(), torch.randn(3, 4, dtype=torch.float64))
    (node,) = _python_nodes(model)
    attrs = node_attributes(node)
    assert attrs["func_name"] == "tests.pythonop.functions.Cube"
    assert attrs["name"] == "Cube"  # required by both schema generations: the class's __qualname__
    assert attrs["input_convention"] == "d" and attrs["training_mode"] == 1
    assert attrs["input_tensor_types"] == [onnx.TensorProto.DOUBLE] and attrs["input_tensor_ranks"] == [2]
    assert attrs["output_tensor_types"] == [onnx.TensorProto.DOUBLE] and attrs["output_tensor_ranks"] == [2]
    assert attrs["input_requires_grads"] == [1] and attrs["output_tensor_requires_grads"] == [1]


def test_multiple_tensor_inputs_and_outputs(no_leaks):
    module = F.Apply(lambda h, y: F.MulAdd.apply(h, y)).double()
    model, fb = compare_with_torch(module, *torch.randn(2, 3, 4, dtype=torch.float64))
    (node,) = _python_nodes(model)
    assert len(node.input) == 2 and len(node.output) == 3  # ctx + 2 outputs
    (grad,) = _python_nodes(fb.graphs.backward, "PythonOpGrad")
    assert len(grad.input) == 3 and len(grad.output) == 2  # ctx + one gradient per output


def test_every_constant_kind(no_leaks):
    def fn(h):
        return F.Constants.apply(h, 2, 0.5, True, (3, 2, 2), (0.25, 0.75), (True, False), None, "triple")

    model, _ = compare_with_torch(F.Apply(fn).double(), torch.randn(3, 4, dtype=torch.float64))
    attrs = node_attributes(_python_nodes(model)[0])
    assert attrs["input_convention"] == "dcccccccc"
    assert (attrs["input_int_scalars"], attrs["input_int_scalar_positions"]) == ([2], [1])
    assert (attrs["input_float_scalars"], attrs["input_float_scalar_positions"]) == ([0.5], [2])
    assert (attrs["input_bool_scalars"], attrs["input_bool_scalar_positions"]) == ([1], [3])
    assert attrs["input_int_tuples"] == [3, 2, 2] and attrs["input_int_tuple_positions"] == [4]
    assert attrs["input_float_tuples"] == [0.25, 0.75] and attrs["input_float_tuple_begins"] == [0]
    assert attrs["input_bool_tuples"] == [1, 0] and attrs["input_bool_tuple_positions"] == [6]
    assert attrs["input_none_positions"] == [7]
    assert (attrs["input_string_scalars"], attrs["input_string_scalar_positions"]) == (["triple"], [8])
    assert "input_pointer_scalars" not in attrs
    assert attrs["input_requires_grads"] == [1, 0, 0, 0, 0, 0, 0, 0, 0]


def test_unstorable_argument_is_refused_at_export_without_an_address():
    class Opaque:
        pass

    x = torch.randn(3, 4)
    with pytest.raises(PythonOpError, match=r"Tagged: argument 1 of apply\(\) is a Opaque") as err:
        onnxgrad.export(F.Apply(lambda h: F.Tagged.apply(h, Opaque())), (x,))
    assert "0x" not in str(err.value)
    for bad, kind in (([3, 4], "list"), ((1, 2.5), "tuple"), (torch.float32, "dtype")):
        with pytest.raises(PythonOpError, match=f"argument 1 of apply.. is a {kind}"):
            onnxgrad.export(F.Apply(lambda h, bad=bad: F.Tagged.apply(h, bad)), (x,))


class ReturnsInt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, 7

    @staticmethod
    def backward(ctx, g, _):
        return g * 2


@pytest.mark.parametrize("functions", [None, [F.Cube]])  # kept as PythonOp, or inlined
def test_function_returning_a_non_tensor_is_refused_at_export(functions):
    """Before: torch's INTERNAL ASSERT in _jit_pass_lower_all_tuples, naming nothing."""
    module = F.Apply(lambda h: ReturnsInt.apply(h)[0])
    original = torch.autograd.Function.__dict__["apply"]
    message = (
        r"^tests\.pythonop\.test_matrix\.ReturnsInt\.forward returned output 1 of 2 as int 7: a "
        r"Function exported as a PythonOp node \(or inlined\) may return only tensors\."
    )
    with pytest.raises(PythonOpError, match=message):
        onnxgrad.export(module, (torch.randn(3, 4),), functions=functions)
    assert torch.autograd.Function.__dict__["apply"] is original  # restored after the export
    assert ReturnsInt.apply(torch.ones(1))[1] == 7  # outside an export nothing is checked


def test_input_that_needs_no_gradient(no_leaks):
    module = F.Apply(lambda h, mask: F.MaskedScale.apply(h, mask)).double()
    x, mask = torch.randn(3, 4, dtype=torch.float64), (torch.rand(3, 4) > 0.5).double()
    model = onnxgrad.export(module, (x, mask))
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])  # mask: no gradient
    grads = fb.forward({"x": x.numpy(), "rest_0": mask.numpy()}).backward()
    module(x, mask).sum().backward()
    np.testing.assert_allclose(grads["lin.weight"], module.lin.weight.grad.numpy(), rtol=1e-12)
    (fwd,) = _python_nodes(fb.graphs.forward)
    assert node_attributes(fwd)["input_requires_grads"] == [1, 0]
    (grad,) = _python_nodes(fb.graphs.backward, "PythonOpGrad")
    assert list(grad.output) == [grad.output[0]] and grad.output[0]  # only the gradient of h


def test_outputs_marked_non_differentiable(no_leaks):
    module = F.Apply(F.SortedWithIndex.apply, post=lambda vp: vp[0] * vp[1] + vp[0]).double()
    model, fb = compare_with_torch(module, torch.randn(3, 4, dtype=torch.float64))
    assert node_attributes(_python_nodes(model)[0])["output_tensor_requires_grads"] == [1, 0]
    (grad,) = _python_nodes(fb.graphs.backward, "PythonOpGrad")
    assert grad.input[2] == ""  # no gradient input for the non-differentiable output


def test_bool_output_crosses_the_boundary(no_leaks):
    module = F.Apply(F.Threshold.apply, post=lambda ym: ym[0] * ym[1].to(ym[0].dtype)).double()
    compare_with_torch(module, torch.randn(3, 4, dtype=torch.float64))


def test_materialize_grads_false_gets_none_for_the_unused_output(no_leaks):
    F.SplitNoMaterialize.seen.clear()
    module = F.Apply(F.SplitNoMaterialize.apply, post=lambda ab: ab[0].sin()).double()
    _, fb = compare_with_torch(module, torch.randn(3, 4, dtype=torch.float64))
    assert F.SplitNoMaterialize.seen == [(False, True), (False, True)]  # onnxruntime, then eager
    (grad,) = _python_nodes(fb.graphs.backward, "PythonOpGrad")
    assert grad.input[1] and grad.input[2] == ""


@pytest.mark.parametrize("fn", [F.Passthrough, F.TransposeView, F.DoubleInPlace], ids=lambda f: f.__name__)
def test_function_returning_its_input_a_view_or_an_inplace_result(fn, no_leaks):
    compare_with_torch(F.Apply(fn.apply, post=torch.sin).double(), torch.randn(3, 4, dtype=torch.float64))


def test_inplace_function_never_writes_into_the_callers_buffer(no_leaks):
    model = onnxgrad.export(_InPlaceOnInput(), (torch.randn(2, 3, dtype=torch.float64),))
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=["x"])
    for _ in range(3):  # the first call copies everything, later ones only what they must
        x = np.arange(6, dtype=np.float64).reshape(2, 3)
        res = fb.forward({"x": x})
        np.testing.assert_array_equal(x, np.arange(6).reshape(2, 3))
        np.testing.assert_allclose(res.outputs[0], 2 * x + x)
        np.testing.assert_allclose(res.backward()["x"], np.full((2, 3), 3.0))


class _InPlaceOnInput(torch.nn.Module):
    def forward(self, x):
        return F.DoubleInPlace.apply(x.clone()) + x


def test_same_function_twice_in_one_graph(no_leaks):
    module = F.Apply(lambda h: F.Cube.apply(F.Cube.apply(h) * 0.5) + F.Cube.apply(h)).double()
    model, fb = compare_with_torch(module, torch.randn(3, 4, dtype=torch.float64) * 0.5)
    assert len(_python_nodes(model)) == 3
    assert len(_python_nodes(fb.graphs.backward, "PythonOpGrad")) == 3


def test_straight_through_estimator_trains_with_the_custom_backward(no_leaks):
    net = F.Net().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    _, fb = compare_with_torch(net, x)
    grads = fb.forward({"x": x.numpy()}).backward()
    assert np.abs(grads["a.weight"]).sum() > 0  # the true derivative of round() would give zero


def test_eval_mode_keeps_no_ctx_and_forward_runs_without_autograd(no_leaks):
    net = F.Apply(F.GradMode.apply).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    fb = onnxgrad.ForwardBackward(onnxgrad.export(net, (x,)))
    F.GradMode.seen.clear()
    out = fb.forward({"x": x.numpy()}, training=False)
    assert F.GradMode.seen == [False] and len(contexts) == 0
    with torch.no_grad():
        np.testing.assert_allclose(out.outputs[0], net(x).numpy(), rtol=1e-12)

    net.eval()
    model = onnxgrad.export(net, (x,))
    assert node_attributes(_python_nodes(model)[0])["training_mode"] == 0
    F.GradMode.seen.clear()
    (y,) = run_model(model, {"x": x.numpy()}, training=True)  # training_mode=0: still no ctx
    assert F.GradMode.seen == [False] and len(contexts) == 0
    np.testing.assert_allclose(y, out.outputs[0], rtol=1e-12)
    with pytest.raises(GradientNotImplementedError, match="training_mode=0"):
        onnxgrad.build_gradient(model)


def test_exception_in_forward_names_the_function(no_leaks):
    model = onnxgrad.export(F.Apply(F.Cube.apply).double(), (torch.randn(3, 4, dtype=torch.float64),))
    for node in _python_nodes(model):
        next(
            a for a in node.attribute if a.name == "func_name"
        ).s = b"tests.pythonop.functions.FailingForward"
    onnxgrad.register_function(F.FailingForward)
    fb = onnxgrad.ForwardBackward(model)
    with pytest.raises(
        PythonOpError, match=r"FailingForward\.forward raised ValueError: forward refuses"
    ) as err:
        fb.forward({"x": np.ones((3, 4))})
    assert isinstance(err.value.__cause__, ValueError)


def test_exception_in_backward_names_the_function_and_releases_the_ctx(no_leaks):
    model = onnxgrad.export(
        F.Apply(F.FailingBackward.apply).double(), (torch.randn(3, 4, dtype=torch.float64),)
    )
    fb = onnxgrad.ForwardBackward(model)
    res = fb.forward({"x": np.ones((3, 4))})
    assert len(contexts) == 1
    with pytest.raises(PythonOpError, match=r"FailingBackward\.backward raised ArithmeticError") as err:
        res.backward()
    assert isinstance(err.value.__cause__, ArithmeticError)
    (forward,) = [n.name for n in model.graph.node if n.op_type == "PythonOp"]
    assert f"PythonOpGrad node '{forward}_Grad'" in str(err.value)  # named after its forward node
    assert len(contexts) == 0


def test_dropped_forward_results_release_their_ctx():
    model = onnxgrad.export(F.Apply(F.Cube.apply).double(), (torch.randn(3, 4, dtype=torch.float64),))
    fb = onnxgrad.ForwardBackward(model)
    gc.collect()
    before = len(contexts)
    results = [fb.forward({"x": np.ones((3, 4))}) for _ in range(5)]
    assert len(contexts) == before + 5
    handles = sorted(contexts.handles())
    assert all(h >= 0x1000000 for h in handles)
    results[2].backward()
    assert len(contexts) == before + 4
    del results
    gc.collect()
    assert len(contexts) == before


def test_functions_selects_which_calls_stay_python_ops(no_leaks):
    module = F.Apply(lambda h: F.RoundSTE.apply(F.Cube.apply(h))).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    model = onnxgrad.export(module, (x,), functions=[F.Cube])
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("PythonOp") == 1 and "Round" in ops  # RoundSTE inlined: its forward only
    attrs = node_attributes(_python_nodes(model)[0])
    assert attrs["func_name"] == "tests.pythonop.functions.Cube"
    fb = onnxgrad.ForwardBackward(model)
    res = fb.forward({"x": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(res.outputs[0], module(x).numpy(), rtol=1e-12)
    np.testing.assert_array_equal(res.backward()["lin.weight"], 0.0)  # Round's true derivative
