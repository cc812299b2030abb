"""Several parameters an exporter stored as one initializer, read directly (issue 37 §13): the dynamo
exporter's optimizer merges a fresh model's equal zero biases and ones norm weights. Where its node
metadata says which modules read the value, each module's parameter is split out and trains apart;
where nothing says it, every door warns (naming the initializer and its readers), ``onnxgrad info``
lists it, and ``split_shared`` keeps them apart. A layer applied several times reads its parameter
from its own module: one parameter, as in torch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.artifacts import generate
from onnxgrad.autodiff.params import select_parameters, split_shared
from onnxgrad.errors import InputError
from onnxgrad.train import Trainer, with_parameters
from tests.models import make_model

F32 = np.float32
RNG = np.random.default_rng(11)
SCOPES = "pkg.torch.onnx.name_scopes"
KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


def merged(modules: tuple[str, str] | None = None, kind: str | None = "PARAMETER"):
    """y = tanh(x + b) + b, ``b`` (zeros) read by two Add nodes; ``modules``: the torch modules of
    the two nodes as the dynamo exporter writes them (``None``: no metadata); ``b`` named as the
    parameter of the first module."""
    name = f"{modules[0]}.bias" if modules else "b"
    nodes = [
        helper.make_node("Add", ["x", name], ["h"], name="add_0"),
        helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
        helper.make_node("Add", ["t", name], ["y"], name="add_1"),
    ]
    if modules:
        for node, module in zip((nodes[0], nodes[2]), modules):
            entry = node.metadata_props.add()
            entry.key, entry.value = SCOPES, repr(["", module, node.name])
    model = make_model(nodes, [("x", F32, ["N", 8])], [("y", F32, ["N", 8])], {name: np.zeros(8, F32)})
    if kind:
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, [8])
        entry = info.metadata_props.add()
        entry.key, entry.value = KIND, kind
        model.graph.value_info.append(info)
    return model


WARNING = r"initializers holding one value repeated .* 'b' by \['add_0', 'add_1'\]"


def test_without_metadata_every_door_warns_and_split_shared_keeps_them_apart(tmp_path):
    model = merged()
    with pytest.warns(UserWarning, match=WARNING):
        selection = select_parameters(model)
    assert selection.shared == {"b": ["add_0", "add_1"]} and selection.trainable == ["b"]
    with pytest.warns(UserWarning, match=WARNING):
        onnxgrad.ForwardBackward(model)
    with pytest.warns(UserWarning, match=WARNING):
        Trainer(model, loss="mse", progress=False)
    with pytest.warns(UserWarning, match=WARNING):
        generate(model, loss="mse", targets=("onnxruntime",))
    apart = split_shared(model)
    selection = select_parameters(apart)  # no warning: each node reads its own
    assert selection.trainable == ["b", "b_1"] and selection.shared == {}
    with pytest.raises(InputError, match=r"'tanh' is not an initializer that several nodes read"):
        split_shared(model, ["tanh"])


def test_info_lists_shared_constants(tmp_path, capsys):
    import onnx

    from onnxgrad.cli import main

    onnx.save(merged(), tmp_path / "m.onnx")
    assert main(["info", str(tmp_path / "m.onnx")]) == 0
    out = capsys.readouterr().out
    assert "shared constants (one value repeated, read by several nodes" in out
    assert any(line.split() == ["b", "add_0,", "add_1"] for line in out.splitlines())


def test_merged_by_the_dynamo_exporter_trains_apart_as_torch():
    torch = pytest.importorskip("torch")
    model = merged(("model.a", "model.b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the file says which modules read it
        selection = select_parameters(model)
    assert selection.aliases == {"model.b.bias": "model.a.bias"} and selection.shared == {}
    assert selection.trainable == ["model.a.bias", "model.b.bias"]
    fb = onnxgrad.ForwardBackward(model)
    x, dy = RNG.standard_normal((4, 8)).astype(F32), RNG.standard_normal((4, 8)).astype(F32)
    grads = fb.forward({"x": x}).backward({"y": dy})
    a, b = (torch.zeros(8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    y = torch.tanh(torch.tensor(x, dtype=torch.float64) + a) + b
    (y * torch.tensor(dy, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(grads["model.a.bias"], a.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["model.b.bias"], b.grad.numpy(), rtol=1e-5, atol=1e-6)
    # trained weights go back into the file as every front end chose them
    applied = with_parameters(model, {"model.b.bias": np.ones(8, F32)})
    got = {i.name: numpy_helper.to_array(i) for i in applied.graph.initializer}
    assert not got["model.a.bias"].any() and (got["model.b.bias"] == 1).all()
    only = {
        i.name: numpy_helper.to_array(i)
        for i in with_parameters(model, {"model.a.bias": np.ones(8, F32)}).graph.initializer
    }
    assert (only["model.a.bias"] == 1).all() and not only["model.b.bias"].any()  # b is another parameter


def test_one_module_applied_twice_is_one_parameter():
    # ALBERT's shared layer: both reads come from the parameter's own module
    model = merged(("model.layer", "model.layer"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        selection = select_parameters(model)
    assert selection.aliases == {} and selection.shared == {} and selection.trainable == ["model.layer.bias"]


def test_a_merged_buffer_is_not_split():
    # only torch parameters are split (a buffer's copies would lose what the file says of it)
    model = merged(("model.a", "model.b"), kind="BUFFER")
    assert select_parameters(model).aliases == {}
