"""build_gradient(recompute=...): saved activations rebuilt in the backward give the same gradients
from a smaller saved set."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.recompute import layer_of, saved_bytes  # noqa: F401
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled


def _stack(layers: int = 3) -> onnx.ModelProto:
    """x[2,8] -> per layer: /layers.i/ MatMul, Add, Tanh, Mul (self-gated), LayerNormalization."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    prev = "x"
    for i in range(layers):
        p = f"/layers.{i}/"
        w, b = f"layers.{i}.w", f"layers.{i}.b"
        s, t = f"layers.{i}.ln.w", f"layers.{i}.ln.b"
        inits += [
            numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32) * 0.5, w),
            numpy_helper.from_array(rng.normal(size=8).astype(np.float32), b),
            numpy_helper.from_array((1 + 0.1 * rng.normal(size=8)).astype(np.float32), s),
            numpy_helper.from_array((0.1 * rng.normal(size=8)).astype(np.float32), t),
        ]
        nodes += [
            helper.make_node("MatMul", [prev, w], [p + "mm"], name=p + "MatMul"),
            helper.make_node("Add", [p + "mm", b], [p + "add"], name=p + "Add"),
            helper.make_node("Tanh", [p + "add"], [p + "tanh"], name=p + "Tanh"),
            helper.make_node("Mul", [p + "tanh", p + "add"], [p + "mul"], name=p + "Mul"),
            helper.make_node("LayerNormalization", [p + "mul", s, t], [p + "ln"], name=p + "LN", axis=-1),
        ]
        prev = p + "ln"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _grads(graphs: onnxgrad.GradientGraphs, x: np.ndarray) -> dict[str, np.ndarray]:
    fb = onnxgrad.ForwardBackward(graphs)
    dy = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    return fb.forward({"x": x}).backward([dy])


def _activations(graphs: onnxgrad.GradientGraphs) -> set[str]:
    fed = set(graphs.trainable) | {i.name for i in graphs.forward.graph.input}
    return {n for n in graphs.saved if n not in fed}


SPECS = [
    "all",
    "layers",
    "/layers.1/",
    ["/layers.*/"],
    ["/layers.0/", "/layers.2/"],
    lambda node: "mine" if node.name.startswith("/layers.2/") else None,
]


@pytest.mark.parametrize("spec", SPECS, ids=["all", "layers", "prefix", "glob", "two", "callable"])
def test_same_gradients_smaller_saved_set(spec) -> None:
    model = _stack()
    x = np.random.default_rng(1).normal(size=(2, 8)).astype(np.float32)
    ref = onnxgrad.build_gradient(model)
    rc = onnxgrad.build_gradient(model, recompute=spec)
    onnx.checker.check_model(rc.backward, full_check=True)
    g0, g1 = _grads(ref, x), _grads(rc, x)
    assert g0.keys() == g1.keys()
    for k in g0:
        assert_allclose_scaled(g1[k], g0[k], rtol=1e-5, err_msg=k)
    before, after = _activations(ref), _activations(rc)
    assert len(after) < len(before)
    assert saved_bytes_of(rc, after) < saved_bytes_of(ref, before)
    assert any(n.name.startswith("recompute") for n in rc.backward.graph.node)


def saved_bytes_of(graphs: onnxgrad.GradientGraphs, names: set[str]) -> int:
    outs = {o.name: o for o in graphs.forward.graph.output}
    total = 0
    for n in names:
        dims = [d.dim_value or 1 for d in outs[n].type.tensor_type.shape.dim]
        total += int(np.prod(dims)) * 4
    return total


def test_all_keeps_only_inputs_and_parameters() -> None:
    rc = onnxgrad.build_gradient(_stack(), recompute="all")
    assert _activations(rc) == set()  # the backward rebuilds everything from x and the weights


def test_layers_keep_the_boundaries() -> None:
    """Per layer: what enters each layer stays saved, the inside is rebuilt."""
    rc = onnxgrad.build_gradient(_stack(), recompute="/layers.*/")
    acts = _activations(rc)
    assert acts == {"/layers.0/ln", "/layers.1/ln"}  # what enters layers 1 and 2


def test_budget() -> None:
    model = _stack()
    ref = onnxgrad.build_gradient(model)
    full = saved_bytes_of(ref, _activations(ref))
    with pytest.raises(InputError, match=r"recompute=1000000000: the saved activations .* already fit"):
        onnxgrad.build_gradient(model, recompute=10**9)  # nothing to recompute: refused, as below
    small = onnxgrad.build_gradient(model, recompute=full // 2)
    assert saved_bytes_of(small, _activations(small)) < full
    with pytest.raises(InputError):
        onnxgrad.build_gradient(model, recompute=-1)


def test_layer_of() -> None:
    names = {
        "/layers.3/attn/MatMul": "/layers.3/",
        "/0/attn/q/MatMul": "/0/",
        "/model/h.11/mlp/Add": "/model/h.11/",
    }
    for name, want in names.items():
        assert layer_of(helper.make_node("Add", [], [], name=name)) == want
    assert layer_of(helper.make_node("Add", [], [], name="node_MatMul_3")) is None


def test_dropout_is_not_recomputed() -> None:
    model = _stack(2)
    g = model.graph
    # a Dropout in training mode inside layer 1: its output and mask stay saved
    ratio = numpy_helper.from_array(np.array(0.5, np.float32), "ratio")
    train = numpy_helper.from_array(np.array(True), "train")
    g.initializer.extend([ratio, train])
    for n in g.node:
        if n.name == "/layers.1/Tanh":
            n.output[0] = "/layers.1/tanh_pre"
    idx = next(k for k, n in enumerate(g.node) if n.name == "/layers.1/Tanh")
    g.node.insert(
        idx + 1,
        helper.make_node(
            "Dropout",
            ["/layers.1/tanh_pre", "ratio", "train"],
            ["/layers.1/tanh", "/layers.1/mask"],
            name="/layers.1/Dropout",
            seed=3,
        ),
    )
    rc = onnxgrad.build_gradient(model, recompute="all")
    assert not any(n.op_type == "Dropout" for n in rc.backward.graph.node)
    acts = _activations(rc)
    assert "/layers.1/mask" in acts and "/layers.1/tanh" in acts  # kept: a random op is not rerun
    assert not any(a.startswith("/layers.0/") for a in acts)


def test_front_ends_pass_recompute() -> None:
    model = _stack()
    x = np.random.default_rng(1).normal(size=(2, 8)).astype(np.float32)
    fb = onnxgrad.ForwardBackward(model, recompute="layers")
    assert len(_activations(fb.graphs)) < len(_activations(onnxgrad.build_gradient(model)))
    dy = np.ones((2, 8), np.float32)
    g = fb.forward({"x": x}).backward([dy])
    g0 = onnxgrad.ForwardBackward(model).forward({"x": x}).backward([dy])
    for k in g0:
        assert_allclose_scaled(g[k], g0[k], rtol=1e-5)
    torch = pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    m0, m1 = OnnxModule(model), OnnxModule(model, recompute="all")
    for m in (m0, m1):
        m(torch.from_numpy(x)).sum().backward()
    for (n, p0), (_, p1) in zip(m0.named_parameters(), m1.named_parameters()):
        assert_allclose_scaled(p1.grad, p0.grad, rtol=1e-5, err_msg=n)
    variant = next(iter(m1._variants.values()))
    assert any(n.name.startswith("recompute") for n in variant.graphs.backward.graph.node)


def test_layer_of_dynamo_module_path() -> None:
    node = helper.make_node("MatMul", [], [], name="node_MatMul_7")
    node.metadata_props.add(
        key="pkg.torch.onnx.name_scopes",
        value="['', 'model', 'model.layers', 'model.layers.3', 'model.layers.3.attn', 'linear']",
    )
    assert layer_of(node) == "model.layers.3"


def test_the_callers_session_options_stay_as_they_are() -> None:
    import onnxruntime as ort

    from onnxgrad.runtime.runner import make_session

    graphs = onnxgrad.build_gradient(_stack(), recompute="layers")
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.intra_op_num_threads = 1
    before = options.execution_order
    session = make_session(graphs.backward, ["CPUExecutionProvider"], options)
    assert options.execution_order == before  # the priority order went to a copy
    assert session.get_session_options().execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert session.get_session_options().intra_op_num_threads == 1
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


def _unnamed() -> onnx.ModelProto:
    model = _stack()
    for n in model.graph.node:
        n.name = ""
    return model


@pytest.mark.parametrize(
    ("model", "spec", "message"),
    [
        (_stack, "Layers", r"'Layers' is not an option \(they are lowercase\).*'all', 'layers'"),
        (_stack, "blocks", r"prefixes \['blocks'\] match no node name.*'/layers.0/MatMul'"),
        (_stack, ["/layers.0/", "/block.*/"], r"prefixes \['/block.\*/'\] match no node name"),
        (_unnamed, "/layers.*/", "the model's nodes have no names"),
        (_unnamed, "layers", "recompute='layers' found no layer.*no names"),
        (_stack, lambda node: None, "returned None for every node"),
        (_stack, "none", r"recompute='none' is a node-name prefix.*pass recompute=None"),
        (_stack, 10**12, r"already fit the budget.*recompute=None"),
        (_unnamed, 1, r"recompute=1: a budget recomputes whole layers, and no node name"),
    ],
    ids=["case", "unknown", "one-of-two", "unnamed", "layers-unnamed", "callable", "none", "big", "no-layer"],
)
def test_an_option_that_selects_nothing_is_refused(model, spec, message) -> None:
    """Before: each of these built the ordinary graphs (every activation saved), silently."""
    with pytest.raises(InputError, match=message):
        onnxgrad.build_gradient(model(), recompute=spec)
    with pytest.raises(InputError, match=message):
        onnxgrad.ForwardBackward(model(), recompute=spec)
