"""A Function's float arguments reach it exact: onnxgrad writes the float64 values beside the
float32 table of the PythonOp node; a file with only the float32 table warns about rounded ones."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch

import onnxgrad
from onnxgrad.errors import PythonOpError
from onnxgrad.model.pythonop_spec import decode_constants, node_attributes, warn_rounded_floats
from tests.pythonop import functions as F


def _export(s: float, t: tuple[float, float]) -> tuple[torch.nn.Module, onnx.ModelProto]:
    torch.manual_seed(0)
    module = F.Apply(lambda h: sum(F.ScaleBy.apply(h, s, t))).double()
    return module, onnxgrad.export(module, (torch.randn(3, 4, dtype=torch.float64),))


@pytest.mark.parametrize(("s", "t"), [(1 / 3, (0.1, 1e-50)), (1e-50, (1 / 7, 3.0)), (1e40, (1e-40, 1 / 3))])
def test_float_arguments_are_exact_in_a_float64_model(s: float, t: tuple[float, float]) -> None:
    module, model = _export(s, t)
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if n.op_type == "PythonOp"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our own file: nothing rounded to warn about
        assert decode_constants(node_attributes(node)) == {1: s, 2: t}
    x = torch.randn(3, 4, dtype=torch.float64)
    fb = onnxgrad.ForwardBackward(model, inputs_requiring_grad=[model.graph.input[0].name])
    res = fb.forward({model.graph.input[0].name: x.numpy()})
    grads = res.backward()
    leaf = x.clone().requires_grad_(True)
    want = module(leaf)
    want.backward(torch.ones_like(want))
    # a few float64 roundings apart (onnxruntime's Gemm against torch's Linear); a float32 argument
    # would be 1e-8 off relative (1/3, 0.1), or 0 (1e-50) or inf (1e40)
    rtol = 64 * np.finfo(np.float64).eps
    np.testing.assert_allclose(res.outputs[0], want.detach().numpy(), rtol=rtol, atol=0)
    np.testing.assert_allclose(grads[model.graph.input[0].name], leaf.grad.numpy(), rtol=rtol, atol=0)
    np.testing.assert_allclose(grads["lin.weight"], module.lin.weight.grad.numpy(), rtol=rtol, atol=0)


def _without_exact(model: onnx.ModelProto) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == "PythonOp"]
    kept = [a for a in node.attribute if not a.name.endswith("_exact")]
    del node.attribute[:]
    node.attribute.extend(kept)
    return node


def test_a_foreign_node_with_only_float32_values_warns_about_rounded_ones() -> None:
    _, model = _export(1 / 3, (0.5, 0.1))
    node = _without_exact(model)
    found: list[tuple[int, float]] = []
    assert decode_constants(node_attributes(node), "PythonOp", found=found) == {
        1: float(np.float32(1 / 3)),
        2: (0.5, float(np.float32(0.1))),
    }
    assert found == [(1, float(np.float32(1 / 3))), (2, float(np.float32(0.1)))]
    with pytest.warns(UserWarning, match=r"\(.*ScaleBy\): 1 = 0\.3333333432674408, 2 = 0\.10000000149"):
        warn_rounded_floats([node])
    _, exact = _export(0.5, (2.0, -0.25))  # exactly float32: nothing to say
    node = _without_exact(exact)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = []
        decode_constants(node_attributes(node), found=found)
        warn_rounded_floats([node])
    assert found == []


def test_the_rounded_float_warning_comes_once_per_build_naming_every_node() -> None:
    """Each node is parsed by the gradient rule and by each runtime: the warning still comes once,
    for the model, naming all its nodes."""
    torch.manual_seed(0)
    twice = lambda h: sum(F.ScaleBy.apply(sum(F.ScaleBy.apply(h, 0.1, (0.5, 1 / 3))), 1e-5, (2.0, 0.5)))
    module = F.Apply(twice).double()
    model = onnxgrad.export(module, (torch.randn(3, 4, dtype=torch.float64),))
    nodes = [n for n in model.graph.node if n.op_type == "PythonOp"]
    for node in nodes:
        kept = [a for a in node.attribute if not a.name.endswith("_exact")]
        del node.attribute[:]
        node.attribute.extend(kept)
    name = model.graph.input[0].name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fb = onnxgrad.ForwardBackward(model)
        fb.forward({name: np.ones((3, 4))}).backward()
        fb.forward({name: np.ones((3, 4))}, training=False)
    said = [str(w.message) for w in caught if "float32 tables" in str(w.message)]
    assert len(said) == 1, said
    assert all(f"node {n.name!r}" in said[0] for n in nodes)
    assert "1 = 0.10000000149011612" in said[0] and "1 = 9.99999974737875" in said[0]


def test_an_exact_table_that_disagrees_with_the_float32_one_is_refused() -> None:
    _, model = _export(1 / 3, (0.5, 0.1))
    (node,) = [n for n in model.graph.node if n.op_type == "PythonOp"]
    for a in node.attribute:
        if a.name == "input_float_scalars_exact":
            a.t.CopyFrom(onnx.numpy_helper.from_array(np.array([0.25]), ""))
    with pytest.raises(PythonOpError, match="does not round to input_float_scalars"):
        decode_constants(node_attributes(node))
    for a in node.attribute:
        if a.name == "input_float_scalars_exact":
            a.t.CopyFrom(onnx.numpy_helper.from_array(np.array([1 / 3, 0.5]), ""))
    with pytest.raises(PythonOpError, match="_exact holds 2 values where input_float_scalars holds 1"):
        decode_constants(node_attributes(node))


class _RaisesWithGraph(torch.autograd.Function):
    """A forward failing as torch's exporter does: the message, then the whole traced graph."""

    @staticmethod
    def forward(ctx, x):
        graph = "\n".join(f"  %{k} : Float(3) = aten::mul(%{k - 1}, %w)" for k in range(1, 400))
        raise RuntimeError(f"unsupported value kind\n\nTorch IR graph at exception: graph(%0):\n{graph}")

    @staticmethod
    def backward(ctx, g):
        return g


def test_python_op_error_leaves_out_torch_ir_graph() -> None:
    module = F.Apply(lambda h: _RaisesWithGraph.apply(h))
    with pytest.raises(PythonOpError) as caught:
        onnxgrad.export(module, (torch.randn(3, 4),))
    message = str(caught.value)
    assert "unsupported value kind" in message and "_RaisesWithGraph" in message
    assert "Torch IR graph" not in message and "aten::mul" not in message and len(message) < 400


class _TakesAList(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, values):
        return x * len(values)

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_a_failed_export_prints_no_torch_ir_graph(capfd: pytest.CaptureFixture[str]) -> None:
    """torch's exporter prints the traced graph to stdout when a step fails (its ONNX log, from
    C++): onnxgrad.export keeps that out, the PythonOpError says what failed."""
    module = F.Apply(lambda h: _TakesAList.apply(h, [1, 2]))
    with pytest.raises(PythonOpError, match=r"argument 1 of apply\(\) is a list"):
        onnxgrad.export(module, (torch.randn(3, 4),))
    out, err = capfd.readouterr()
    assert "Torch IR graph" not in out + err and "aten::linear" not in out + err
