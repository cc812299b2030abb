"""Schemas, attribute tables, the Function registry and hand-built graphs (including the original
exporter's older layout)."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import onnxgrad
from onnxgrad.errors import PythonOpError
from onnxgrad.model.pythonop_spec import (
    complete_class_names,
    decode_constants,
    encode_constants,
    parse_forward,
)
from onnxgrad.pythonop import FIRST_HANDLE, contexts, make_runner, register_function, resolve_function
from onnxgrad.pythonop.executor import PythonOpRunner, run_model
from onnxgrad.pythonop.registry import ContextRegistry, unregister_function
from onnxgrad.runtime.runner import Runner
from tests.models import mlp
from tests.pythonop import functions as F

DOUBLE = TensorProto.DOUBLE
CUBE = "tests.pythonop.functions.Cube"


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 9
    return model


def _cube_node(x="x", ctx="ctx", y="y", class_name=None, **overrides):
    """A PythonOp calling Cube; ``class_name``: its ``name`` attribute (none by default, as in files
    written before onnxgrad wrote it)."""
    attrs = dict(
        func_name=CUBE,
        input_convention="d",
        input_tensor_types=[DOUBLE],
        input_tensor_ranks=[2],
        input_requires_grads=[1],
        output_tensor_types=[DOUBLE],
        output_tensor_ranks=[2],
        output_tensor_requires_grads=[1],
        training_mode=1,
    )
    attrs.update(overrides)
    attrs = {k: v for k, v in attrs.items() if v is not None}
    node = helper.make_node("PythonOp", [x], [ctx, y], domain="com.microsoft", **attrs)
    if class_name is not None:  # make_node's own ``name=`` is the node's name
        node.attribute.append(helper.make_attribute("name", class_name))
    return node


def _cube_grad_node(class_name=None, **attrs):
    """A PythonOpGrad of Cube reading (ctx, dy) and writing dx; ``attrs`` beyond the required ones."""
    node = helper.make_node(
        "PythonOpGrad",
        ["ctx", "dy"],
        ["dx"],
        domain="com.microsoft",
        func_name=CUBE,
        output_convention="d",
        output_tensor_requires_grads=[1],
        **attrs,
    )
    if class_name is not None:  # make_node's own ``name=`` is the node's name
        node.attribute.append(helper.make_attribute("name", class_name))
    return node


def _vi(name, rank=2, dtype=DOUBLE):
    return helper.make_tensor_value_info(name, dtype, [None] * rank)


@pytest.fixture(autouse=True)
def cube_registered():
    register_function(F.Cube)


# ---- schemas -----------------------------------------------------------------------------------
def test_checker_and_shape_inference_accept_both_nodes_and_type_their_outputs():
    grad = _cube_grad_node(
        input_tensor_types=[DOUBLE],
        input_tensor_ranks=[2],
        output_tensor_types=[DOUBLE],
        output_tensor_ranks=[2],
    )
    grad.attribute.append(helper.make_attribute("name", "Cube"))
    model = _model([_cube_node(class_name="Cube"), grad], [_vi("x"), _vi("dy")], [_vi("y"), _vi("dx")])
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {vi.name: vi.type.tensor_type for vi in inferred.graph.value_info}
    assert types["ctx"].elem_type == TensorProto.INT64 and len(types["ctx"].shape.dim) == 0
    assert "dx" not in types  # a graph output: its declared type stands
    # an intermediate PythonOpGrad output gets its recorded dtype and rank
    model.graph.node.append(helper.make_node("Neg", ["dx"], ["ndx"]))
    model.graph.output[1].name = "ndx"
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    dx = next(vi for vi in inferred.graph.value_info if vi.name == "dx").type.tensor_type
    assert dx.elem_type == DOUBLE and len(dx.shape.dim) == 2


@pytest.mark.parametrize("op", ["PythonOp", "PythonOpGrad"])
def test_checker_requires_the_class_name_as_both_schema_generations_do(op):
    """Seeds 000, 001 and 002 mark ``name`` required; a node with only ``func_name`` fails the
    checker, and onnxgrad's own loaders add ``name`` to their copy first."""
    fwd = _cube_node(class_name="Cube")
    grad = _cube_grad_node(class_name="Cube")
    target = fwd if op == "PythonOp" else grad
    model = _model([fwd, grad], [_vi("x"), _vi("dy")], [_vi("y"), _vi("dx")])
    onnx.checker.check_model(model, full_check=True)
    kept = [a for a in target.attribute if a.name != "name"]
    del target.attribute[:]
    target.attribute.extend(kept)
    model = _model([fwd, grad], [_vi("x"), _vi("dy")], [_vi("y"), _vi("dx")])
    with pytest.raises(
        onnx.checker.ValidationError, match=rf"(?s)Required attribute 'name' is missing.*OpType: {op}\b"
    ):
        onnx.checker.check_model(model, full_check=True)
    assert complete_class_names(model.graph) == 1  # name = func_name, on the node lacking it only
    onnx.checker.check_model(model, full_check=True)
    names = {n.op_type: [a.s for a in n.attribute if a.name == "name"] for n in model.graph.node}
    assert names == {"PythonOp": [b"Cube"], "PythonOpGrad": [b"Cube"], op: [CUBE.encode()]}


def test_pythonop_schema_requires_what_the_original_requires():
    schema = onnx.defs.get_schema("PythonOp", 1, "com.microsoft")
    required = sorted(n for n, a in schema.attributes.items() if a.required)
    assert required == [
        "input_tensor_ranks",
        "input_tensor_types",
        "name",
        "output_tensor_ranks",
        "output_tensor_requires_grads",
        "output_tensor_types",
    ]
    schema = onnx.defs.get_schema("PythonOpGrad", 1, "com.microsoft")
    assert sorted(n for n, a in schema.attributes.items() if a.required) == [
        "name",
        "output_tensor_requires_grads",
    ]


def test_files_without_name_still_build_and_the_gradient_writes_name():
    model = _model([_cube_node()], [_vi("x")], [_vi("y")])  # func_name only
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=["x"])
    for proto in (graphs.forward, graphs.backward):
        onnx.checker.check_model(proto, full_check=True)
    (fwd,) = [n for n in graphs.forward.graph.node if n.op_type == "PythonOp"]
    (grad,) = [n for n in graphs.backward.graph.node if n.op_type == "PythonOpGrad"]
    for node in (fwd, grad):
        attrs = {a.name: a.s for a in node.attribute if a.type == onnx.AttributeProto.STRING}
        assert (attrs["name"], attrs["func_name"]) == (CUBE.encode(), CUBE.encode())
    assert not any(a.name == "name" for a in model.graph.node[0].attribute)  # the caller's model


def test_checker_accepts_the_older_attribute_spellings():
    node = _cube_node(func_name=None, input_convention=None, input_requires_grads=None)
    node.attribute.extend(
        [
            helper.make_attribute("name", CUBE),
            helper.make_attribute("call_convention", "d"),
            helper.make_attribute("input_tensor_requires_grads", [1]),
        ]
    )
    model = _model([node], [_vi("x")], [_vi("y")])
    onnx.checker.check_model(model, full_check=True)
    spec = parse_forward(node)
    assert (spec.func_name, spec.convention, spec.requires_grad) == (CUBE, "d", (True,))


# ---- constant tables ---------------------------------------------------------------------------
def test_constants_round_trip_with_their_python_types():
    constants = {
        1: 7,
        2: -0.5,
        3: True,
        4: (1, 2, 3),
        5: (0.5,),
        6: (True, False),
        7: None,
        8: "s",
        9: (4,),
        10: (),
    }
    attrs = encode_constants("d" + "c" * 10, constants, "Fn")
    assert attrs["input_int_tuple_begins"] == [0, 3] and attrs["input_int_tuple_positions"] == [4, 9]
    decoded = decode_constants(attrs)
    assert decoded == constants
    assert [type(decoded[i]) for i in (1, 2, 3)] == [int, float, bool]


def test_raw_addresses_from_the_original_exporter_are_refused():
    with pytest.raises(PythonOpError, match="raw memory addresses"):
        decode_constants({"input_pointer_scalars": [140234234], "input_pointer_scalar_positions": [1]})
    with pytest.raises(PythonOpError, match="does not fit in int64"):
        encode_constants("dc", {1: 2**70}, "Fn")


def test_malformed_nodes_are_reported():
    with pytest.raises(PythonOpError, match=r"has 2 tensor argument.* but the node has 1 input"):
        parse_forward(_cube_node(input_convention="dd"))
    with pytest.raises(PythonOpError, match="constant argument 1 has no value"):
        parse_forward(_cube_node(input_convention="dc"))
    with pytest.raises(PythonOpError, match="names no function"):
        parse_forward(_cube_node(func_name=None))


# ---- Function registry and ctx handles --------------------------------------------------------
def test_unregistered_class_fails_naming_it_and_nothing_is_imported():
    name = "evil_pkg_never_imported.sub.Function"
    model = _model([_cube_node(func_name=name)], [_vi("x")], [_vi("y")])
    graphs = onnxgrad.build_gradient(model)
    with pytest.raises(
        PythonOpError, match=rf"calls '{name}', which is not a registered Function.*nothing was imported"
    ):
        make_runner(graphs, ["CPUExecutionProvider"])
    assert "evil_pkg_never_imported" not in sys.modules
    # the caller may allow a class explicitly
    runner = make_runner(graphs, ["CPUExecutionProvider"], functions={name: F.Cube})
    assert isinstance(runner, PythonOpRunner)


def test_resolution_by_registry_bare_name_and_explicit_import():
    assert resolve_function(CUBE) is F.Cube
    assert resolve_function("Cube") is F.Cube  # older files name the bare class
    register_function(F.Cube, name="alias.Cube")
    assert resolve_function("alias.Cube") is F.Cube
    unregister_function("alias.Cube")
    with pytest.raises(PythonOpError, match="not a registered Function"):
        resolve_function("alias.Cube")
    unregister_function(F.RoundSTE)
    name = "tests.pythonop.functions.RoundSTE"
    with pytest.raises(PythonOpError, match="not a registered"):
        resolve_function(name)
    assert resolve_function(name, allow_import=["tests.pythonop"]) is F.RoundSTE
    with pytest.raises(PythonOpError, match="not a registered"):
        resolve_function(name, allow_import=["tests.other"])
    with pytest.raises(PythonOpError, match=r"not a torch\.autograd\.Function"):
        register_function(int)


def test_plain_graphs_get_the_plain_runner():
    graphs = onnxgrad.build_gradient(mlp())
    assert type(make_runner(graphs, ["CPUExecutionProvider"])) is Runner


def test_context_handles_start_at_0x1000000_and_release_once():
    reg = ContextRegistry()
    h1, h2 = reg.add("a"), reg.add("b")
    assert (h1, h2) == (FIRST_HANDLE, FIRST_HANDLE + 1)
    assert reg.get(h2) == "b"
    reg.release(h2)
    with pytest.raises(PythonOpError, match="unknown or already released"):
        reg.get(h2)
    with pytest.raises(PythonOpError, match="was not created by a training forward"):
        reg.get(0)
    holder = reg.handle_value(h1)
    del holder  # dropping the last holder of a handle releases it
    assert len(reg) == 0


# ---- hand-built graphs --------------------------------------------------------------------------
def test_original_layout_in_one_graph_runs():
    """A graph as the original exporter wrote it: forward and backward in one graph, the older
    spellings, and PythonOpGrad's 1 + 2N inputs (the forward outputs as a control dependency)."""
    fwd = _cube_node(func_name=None, input_convention=None, input_requires_grads=None)
    fwd.attribute.extend(
        [
            helper.make_attribute("name", "Cube"),
            helper.make_attribute("call_convention", "d"),
            helper.make_attribute("input_tensor_requires_grads", [1]),
            helper.make_attribute("inplace", 0),
        ]
    )
    grad = helper.make_node(
        "PythonOpGrad",
        ["ctx", "dy", "y"],
        ["dx"],
        domain="com.microsoft",
        name="Cube_grad",
        output_convention="d",
        input_tensor_types=[DOUBLE],
        input_tensor_ranks=[2],
        input_tensor_requires_grads=[1],
        output_tensor_types=[DOUBLE],
        output_tensor_ranks=[2],
        output_tensor_requires_grads=[1],
        inplace=0,
    )
    grad.attribute.append(helper.make_attribute("name", "Cube"))
    model = _model([fwd, grad], [_vi("x"), _vi("dy")], [_vi("y"), _vi("dx")])
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).standard_normal((3, 4))
    dy = np.random.default_rng(1).standard_normal((3, 4))
    y, dx = run_model(model, {"x": x, "dy": dy})
    xt = torch.tensor(x, requires_grad=True)
    yt = F.Cube.apply(xt)
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-12)
    assert len(contexts) == 0


def test_gradient_graph_layout_and_checker():
    w = onnx.numpy_helper.from_array(np.ones((3, 3)), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        _cube_node(x="h"),
        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
    ]
    model = _model(nodes, [_vi("x")], [helper.make_tensor_value_info("s", DOUBLE, [])], [w])
    graphs = onnxgrad.build_gradient(model)
    for proto in (graphs.forward, graphs.backward):
        onnx.checker.check_model(proto, full_check=True)
    (grad,) = [n for n in graphs.backward.graph.node if n.op_type == "PythonOpGrad"]
    assert grad.domain == "com.microsoft" and len(grad.input) == 2 and len(grad.output) == 1
    assert grad.input[0] == "ctx" and "ctx" in graphs.saved
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    assert attrs["func_name"] == CUBE.encode() and attrs["output_convention"] == b"d"
    assert attrs["output_tensor_requires_grads"] == [1] and attrs["input_tensor_requires_grads"] == [1]
    assert onnxgrad.supported_ops()["com.microsoft.PythonOp"] == "rule"


def _inplace_model():
    node = _cube_node(func_name="tests.pythonop.functions.DoubleInPlace")
    add = helper.make_node("Add", ["y", "x"], ["z"])
    return _model([node, add], [_vi("x")], [_vi("z")])


def test_inplace_function_never_writes_into_a_buffer_others_read():
    register_function(F.DoubleInPlace)
    fb = onnxgrad.ForwardBackward(_inplace_model(), inputs_requiring_grad=["x"])
    for _ in range(3):  # the first call copies every input, later calls what they learned to
        x = np.arange(6.0).reshape(2, 3)
        res = fb.forward({"x": x})
        np.testing.assert_array_equal(x, np.arange(6.0).reshape(2, 3))  # the caller's buffer
        np.testing.assert_allclose(res.outputs[0], 3 * x)  # Add read x, not the doubled buffer
        np.testing.assert_allclose(res.backward()["x"], np.full((2, 3), 3.0))
    (kernel,) = fb._runner.fwd.kernels.values()
    assert kernel._dirty == {0}


def test_saved_caller_buffers_are_copied_so_later_changes_do_not_leak_into_backward():
    fb = onnxgrad.ForwardBackward(_model([_cube_node()], [_vi("x")], [_vi("y")]), inputs_requiring_grad=["x"])
    for _ in range(3):
        x = np.full((2, 2), 2.0)
        res = fb.forward({"x": x})
        x[:] = 100.0  # the caller reuses its buffer before the backward
        np.testing.assert_allclose(res.backward()["x"], np.full((2, 2), 12.0))  # 3 * 2**2
    (kernel,) = fb._runner.fwd.kernels.values()
    assert kernel._saved == {0}


def test_declared_input_types_and_ranks_are_checked_when_the_node_runs():
    """input_tensor_types / input_tensor_ranks exist "for input checks": before, a node declaring
    DOUBLE rank 4 ran Cube on a float rank-2 input."""
    node = _cube_node(input_tensor_ranks=[4], output_tensor_types=[TensorProto.FLOAT])
    node.name = "cube1"
    model = _model([node], [_vi("x", dtype=TensorProto.FLOAT)], [_vi("y", dtype=TensorProto.FLOAT)])
    x = np.ones((2, 3), np.float32)
    with pytest.raises(
        PythonOpError,
        match=r"^PythonOp node 'cube1' \(tests\.pythonop\.functions\.Cube\): input 0 \('x'\) is FLOAT "
        r"of rank 2, the node declares DOUBLE \(input_tensor_types\)$",
    ):
        run_model(model, {"x": x})
    float_cube = {"output_tensor_types": [TensorProto.FLOAT], "input_tensor_types": [TensorProto.FLOAT]}
    node = _cube_node(input_tensor_ranks=[4], **float_cube)
    node.name = "cube1"
    model = _model([node], [_vi("x", dtype=TensorProto.FLOAT)], [_vi("y", dtype=TensorProto.FLOAT)])
    with pytest.raises(
        PythonOpError,
        match=r"^PythonOp node 'cube1' \(tests\.pythonop\.functions\.Cube\): input 0 \('x'\) has rank 2, "
        r"the node declares rank 4 \(input_tensor_ranks\)$",
    ):
        run_model(model, {"x": x})
    assert len(contexts) == 0
    # -1 means "not recorded": any rank runs
    node = _cube_node(input_tensor_ranks=[-1], **float_cube)
    model = _model([node], [_vi("x", dtype=TensorProto.FLOAT)], [_vi("y", dtype=TensorProto.FLOAT)])
    (y,) = run_model(model, {"x": x})
    np.testing.assert_array_equal(y, x)
    with pytest.raises(PythonOpError, match=r"input_tensor_ranks has 2 entries for 1 tensor\(s\)"):
        parse_forward(_cube_node(input_tensor_ranks=[2, 2]))


def test_output_rank_is_checked_against_output_tensor_ranks():
    node = _cube_node(input_tensor_ranks=[-1], output_tensor_ranks=[3])
    node.name = "cube2"
    model = _model([node], [_vi("x")], [_vi("y", 3)])
    with pytest.raises(
        PythonOpError,
        match=r"^PythonOp node 'cube2' \(tests\.pythonop\.functions\.Cube\): output 0 has rank 2 "
        r"\(shape \(2, 3\)\), the node records rank 3 \(output_tensor_ranks\)$",
    ):
        run_model(model, {"x": np.ones((2, 3))})
    assert len(contexts) == 0


def test_pythonopgrad_checks_the_gradients_it_receives():
    fwd = _cube_node(class_name="Cube")
    grad = _cube_grad_node(name="cube_grad", input_tensor_types=[DOUBLE], input_tensor_ranks=[2])
    dy = helper.make_tensor_value_info("dy", TensorProto.FLOAT, [None, None])
    model = _model([fwd, grad], [_vi("x"), dy], [_vi("y"), _vi("dx")])
    with pytest.raises(
        PythonOpError,
        match=r"^PythonOpGrad node 'cube_grad' \(tests\.pythonop\.functions\.Cube\): input 1 \('dy'\) is "
        r"FLOAT of rank 2, the node declares DOUBLE \(input_tensor_types\)$",
    ):
        run_model(model, {"x": np.ones((2, 3)), "dy": np.ones((2, 3), np.float32)})
    assert len(contexts) == 0  # the ctx is released all the same
    model = _model([fwd, grad], [_vi("x"), _vi("dy", 1)], [_vi("y"), _vi("dx")])
    with pytest.raises(PythonOpError, match=r"input 1 \('dy'\) has rank 1, the node declares rank 2"):
        run_model(model, {"x": np.ones((2, 3)), "dy": np.ones(6)})
    assert len(contexts) == 0


@pytest.mark.parametrize("op", ["PythonOp", "PythonOpGrad"])
def test_inplace_flag_is_refused(op):
    """The old ``inplace`` flag asked that outputs reuse input memory; onnxgrad refuses it rather
    than ignore it (0, as the original exporter wrote it, is accepted)."""
    fwd = _cube_node(inplace=1 if op == "PythonOp" else 0)
    grad = _cube_grad_node(inplace=1 if op == "PythonOpGrad" else 0)
    grad.name, fwd.name = "g", "f"
    model = _model([fwd, grad], [_vi("x"), _vi("dy")], [_vi("y"), _vi("dx")])
    name = "f" if op == "PythonOp" else "g"
    with pytest.raises(
        PythonOpError,
        match=rf"^{op} node '{name}' \(tests\.pythonop\.functions\.Cube\) sets inplace=1, which onnxgrad "
        r"does not support: its outputs would reuse input buffers",
    ):
        run_model(model, {"x": np.ones((2, 3)), "dy": np.ones((2, 3))})
    if op == "PythonOp":
        with pytest.raises(PythonOpError, match="sets inplace=1"):
            onnxgrad.build_gradient(_model([fwd], [_vi("x")], [_vi("y")]), inputs_requiring_grad=["x"])


def test_safe_run_mode_0_calls_forward_directly_in_inference():
    register_function(F.GradMode)
    node = _cube_node(func_name="tests.pythonop.functions.GradMode", safe_run_mode=0)
    model = _model([node], [_vi("x")], [_vi("y")])
    F.GradMode.seen.clear()
    (y,) = run_model(model, {"x": np.zeros((1, 2))}, training=False)
    np.testing.assert_array_equal(y, np.ones((1, 2)))
    assert F.GradMode.seen == [False] and len(contexts) == 0
