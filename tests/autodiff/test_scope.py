"""The scope of a gradient build (autodiff/scope.py): names, the tape of values the backward reads,
child scopes for subgraphs, as rules and the engine use them through a GradBuilder."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnxgrad.autodiff.builder import GradBuilder, Var
from onnxgrad.autodiff.engine import build_gradient, check_graphs
from onnxgrad.model.graph import ValueInfo
from onnxgrad.testing import check_gradients, node_model

F = TensorProto.FLOAT


def builder(consts: dict[str, np.ndarray] | None = None) -> GradBuilder:
    """A builder over forward values ``x`` [2, 3], ``y`` [3] and the known tensors ``consts``."""
    infos = {"x": ValueInfo("x", F, (2, 3)), "y": ValueInfo("y", F, (3,))}
    known = {}
    for name, arr in (consts or {}).items():
        infos[name] = ValueInfo(name, F, arr.shape)
        known[name] = numpy_helper.from_array(arr, name)
    return GradBuilder(infos, known, set(infos), 18)


def test_reading_a_forward_value_saves_it_once() -> None:
    g = builder()
    x = g.fwd("x")
    assert g.fwd("x") is x and not g.saved  # saved only once read
    g.Neg(x)
    g.Exp(x)
    assert g.read(x) == "x"
    assert g.saved == {"x": ValueInfo("x", F, (2, 3))}
    assert [n.input[0] for n in g.nodes] == ["x", "x"]


def test_a_backward_value_is_read_as_it_is() -> None:
    g = builder()
    y = g.Neg(g.fwd("y"))
    assert g.read(y) == y.name
    assert set(g.saved) == {"y"}


def test_a_constant_is_copied_not_saved() -> None:
    g = builder({"c": np.ones(3, np.float32)})
    g.Mul(g.fwd("y"), g.fwd("c"))
    assert set(g.saved) == {"y"}
    assert list(g.initializers) == ["c"]
    np.testing.assert_array_equal(numpy_helper.to_array(g.initializers["c"]), np.ones(3))


def test_a_child_reading_an_outer_forward_value_makes_the_parent_save_it() -> None:
    g = builder()
    g.infos["inner"] = ValueInfo("inner", F, (3,))
    sub = g.child(local={"inner"})
    sub.Add(sub.fwd("x"), sub.fwd("inner"))
    assert set(g.saved) == {"x"}  # the parent's value: the parent's tape
    assert set(sub.saved) == {"inner"}  # the subgraph's own: the child's (its rule exports it)
    assert len(sub.nodes) == 1 and not g.nodes


def test_a_child_reads_the_values_of_its_parent_by_name() -> None:
    g = builder({"c": np.ones(3, np.float32)})
    dy = g.Neg(g.fwd("y"))
    body = g.child()  # a subgraph of the backward alone (rnn's Scan bodies)
    out = body.Mul(body.Add(g.fwd("x"), dy), g.fwd("c"))
    assert out.g is body
    assert [list(n.input) for n in body.nodes] == [["x", dy.name], [body.nodes[0].output[0], "c"]]
    assert set(g.saved) == {"y", "x"} and list(g.initializers) == ["c"]
    assert not body.saved and not body.initializers


def test_outer_gives_a_value_of_the_child() -> None:
    g = builder()
    dy = g.Neg(g.fwd("y"))
    sub = g.child()
    inner = sub.outer(dy)
    assert isinstance(inner, Var) and inner.g is sub and inner.name == dy.name and not inner.forward
    assert isinstance(inner * 2, Var) and len(sub.nodes) == 1  # arithmetic emits into the child
    sub.outer(g.fwd("x"))
    assert "x" in g.saved


def test_a_child_makes_its_own_constants() -> None:
    g = builder()
    body = g.child()
    one = body.const(1.0, F)
    assert one.g is body and list(body.initializers) == [one.name] and not g.initializers
    assert body.const(1.0, F) is one  # made once per scope


def test_shapes_of_outer_values_are_computed_once_in_the_defining_scope() -> None:
    g = builder()
    g.infos["x"] = ValueInfo("x", F, ("n", 3))  # not static: computed by the forward
    sub, other = g.child(), g.child()
    shape = sub.shape_of(sub.fwd("x"))
    assert shape.g is sub and other.shape_of(other.fwd("x")).name == shape.name
    assert [n.op_type for n in g.fwd_nodes] == ["Shape"] and not sub.fwd_nodes
    assert set(g.saved) == {shape.name}


def test_fresh_names_never_collide_across_scopes() -> None:
    g = builder()
    sub = g.child(local=["x"])
    body = sub.child()
    names = [s.fresh(h) for _ in range(50) for s in (g, sub, body) for h in ("a", "x", "a__1")]
    names += [s.reserve(n) for s in (g, sub, body) for n in ("x", "free")]
    assert len(set(names)) == len(names)
    assert "x" not in names and names.count("free") == 1


def test_forward_additions_of_a_child_are_its_own() -> None:
    g = builder()
    sub = g.child()
    shape = sub.fwd_op("Shape", sub.fwd("y"), dtype=TensorProto.INT64, shape=(1,))
    k = sub.fwd_const(2)
    assert [n.op_type for n in sub.fwd_nodes] == ["Shape", "Constant"] and not g.fwd_nodes
    assert {shape.name, k.name} <= sub.local
    sub.Add(shape, k)
    assert set(sub.saved) == {shape.name} and list(sub.initializers) == [k.name]  # a constant: copied


def lstm() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    x, w, r = (rng.standard_normal(s) * 0.6 for s in ((3, 2, 3), (1, 16, 3), (1, 16, 4)))
    model = node_model("LSTM", [x, w, r], attrs={"hidden_size": 4}, n_outputs=2, opset=14)
    return model, {"in0": x, "in1": w, "in2": r}


def test_rnn_scan_bodies_are_child_scopes() -> None:
    """A Scan body reads the rule's values by name (the main scope saves the forward ones) and holds
    the constants it makes; the gradients are right."""
    model, feeds = lstm()
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds))
    check_graphs(graphs)
    scans = [n for n in graphs.backward.graph.node if n.op_type == "Scan"]
    bodies = [next(a.g for a in n.attribute if a.name == "body") for n in scans]
    assert len(bodies) == 2 and all(b.initializer for b in bodies)  # 1 - y * y, ...
    outer = {i.name for i in graphs.backward.graph.input} | {
        o for n in graphs.backward.graph.node for o in n.output
    }
    read = {i for b in bodies for n in b.node for i in n.input}
    defined = {v.name for b in bodies for v in [*b.input, *b.initializer]} | {
        o for b in bodies for n in b.node for o in n.output
    }
    assert "in2" in read & outer  # R, read by name from the main scope, which saves it
    assert read <= defined | outer
    result = check_gradients(model, feeds, wrt=list(feeds), backend="reference", graphs=graphs)
    assert result.ok, result.report()
