"""If, Loop and Scan (and nestings of them): gradients against float64 finite differences and torch."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
import onnxgrad.autodiff.rules.control_flow  # registers the rules (until rules/__init__ lists them)
import onnxgrad.autodiff.rules.sequence
from onnxgrad.autodiff.engine import check_graphs
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_gradients, run_model
from tests.autodiff.random_data import rng  # one generator per test (conftest.py)
from tests.models import make_model

F64, I64, BOOL = TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL


def vi(name: str, dtype: int, shape: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def graph(name: str, nodes: list, inputs: list, outputs: list) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, inputs, outputs)


def node(op: str, inputs: list[str], outputs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, inputs, outputs, name=f"{op}_{outputs[0]}", **attrs)


def const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value)))


def check(model: onnx.ModelProto, feeds: dict, same_forward: bool = True) -> onnxgrad.GradientGraphs:
    """Gradients of every float input and initializer match finite differences; both graphs pass the
    ONNX checker; the forward computes what the model computes."""
    wrt = [k for k, v in feeds.items() if np.asarray(v).dtype == np.float64]
    wrt += [i.name for i in model.graph.initializer if i.data_type == F64]
    graphs = onnxgrad.build_gradient(
        model,
        trainable=[w for w in wrt if w not in feeds],
        inputs_requiring_grad=[w for w in wrt if w in feeds],
    )
    check_graphs(graphs)
    result = check_gradients(model, feeds, wrt=wrt, graphs=graphs)
    assert result.ok, result.report()
    if same_forward:
        want = run_model(model)(feeds)
        inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        got = run_model(graphs.forward)({**{t: inits[t] for t in graphs.trainable}, **feeds})
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)
    return graphs


# ---- If ---------------------------------------------------------------------------------------
def if_model(cond_from_data: bool) -> onnx.ModelProto:
    """y = exp(x) * (tanh(x W) * x if c else x * x + b); c an input, or sum(x) > 0."""
    then = graph(
        "then",
        [node("Mul", ["x", "W"], ["t1"]), node("Tanh", ["t1"], ["t2"]), node("Mul", ["t2", "x"], ["t3"])],
        [],
        [vi("t3", F64, [3])],
    )
    other = graph(
        "else", [node("Mul", ["x", "x"], ["e1"]), node("Add", ["e1", "b"], ["e2"])], [], [vi("e2", F64, [3])]
    )
    nodes = [
        node("Exp", ["x"], ["ex"]),
        node("If", ["c"], ["y0"], then_branch=then, else_branch=other),
        node("Mul", ["y0", "ex"], ["y"]),
    ]
    inputs = [("x", np.float64, [3])]
    if cond_from_data:
        nodes = [
            node("ReduceSum", ["x"], ["s"], keepdims=0),
            const("zero", 0.0),
            node("Greater", ["s", "zero"], ["c"]),
            *nodes,
        ]
    else:
        inputs.append(("c", np.bool_, []))
    inits = {"W": np.array([0.5, -1.0, 2.0]), "b": np.array([0.1, 0.2, 0.3])}
    return make_model(nodes, inputs, [("y", np.float64, [3])], inits)


@pytest.mark.parametrize("taken", [True, False])
def test_if_with_condition_input_differentiates_the_taken_branch(taken):
    graphs = check(if_model(False), {"x": np.array([0.3, -0.2, 0.7]), "c": np.array(taken)})
    # tanh(xW) is read by the backward then-branch: an extra output of the forward If (the else
    # branch returns an empty tensor there), saved for the backward If on the same condition
    fwd_if = next(n for n in graphs.forward.graph.node if n.op_type == "If")
    assert len(fwd_if.output) == 2 and fwd_if.output[1] in graphs.saved
    assert "c" in graphs.saved
    assert [n.op_type for n in graphs.backward.graph.node].count("If") == 1


@pytest.mark.parametrize("x", [[0.3, -0.2, 0.7], [-0.3, -0.2, 0.1]])
def test_if_with_computed_condition(x):
    check(if_model(True), {"x": np.array(x)})


def test_if_branch_passing_an_outer_value_through():
    # then: the captured x itself (the checker wants a node there); else: -x * W
    then = graph("then", [node("Identity", ["x"], ["xo"])], [], [vi("xo", F64, [2])])
    other = graph(
        "else", [node("Neg", ["x"], ["n"]), node("Mul", ["n", "W"], ["m"])], [], [vi("m", F64, [2])]
    )
    model = make_model(
        [node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [("x", np.float64, [2]), ("c", np.bool_, [])],
        [("y", np.float64, [2])],
        {"W": np.array([2.0, 3.0])},
    )
    for taken in (True, False):
        check(model, {"x": np.array([0.5, -1.5]), "c": np.array(taken)})


def test_if_branch_output_named_like_the_if_output():
    # optimum's merged decoders name a branch output after the If output ('present.1.value'); the
    # backward reads that output (tanh's y) under the same name: no Identity(y -> y), no false cycle
    def branch(name: str, op: str) -> onnx.GraphProto:
        return graph(name, [node(op, ["x", "W"], ["z"]), node("Tanh", ["z"], ["y"])], [], [vi("y", F64, [3])])

    model = make_model(
        [node("If", ["c"], ["y"], then_branch=branch("then", "Mul"), else_branch=branch("else", "Add"))],
        [("x", np.float64, [3]), ("c", np.bool_, [])],
        [("y", np.float64, [3])],
        {"W": np.array([0.5, -1.0, 2.0])},
    )
    for taken in (True, False):
        check(model, {"x": np.array([0.3, -0.2, 0.7]), "c": np.array(taken)})


def test_if_branches_defining_one_name_with_different_types():
    # optimum's merged decoder: '/transformer/Add_1_output_0' is an int64 position in one branch
    # and float embeddings in the other. Here 'a' is int64 in then (a count, cast back to float),
    # float in else, where a nested If reads it from its enclosing branch
    then = graph(
        "then",
        [const("k", np.array([2], np.int64)), node("Add", ["k", "k"], ["a"]),
         node("Cast", ["a"], ["af"], to=F64), node("Mul", ["x", "af"], ["t"]), node("Tanh", ["t"], ["out"])],
        [],
        [vi("out", F64, [3])],
    )  # fmt: skip
    inner = graph("inner", [node("Mul", ["a", "W"], ["i"])], [], [vi("i", F64, [3])])
    inner_else = graph("inner_else", [node("Neg", ["a"], ["i"])], [], [vi("i", F64, [3])])
    other = graph(
        "else",
        [node("Mul", ["x", "W"], ["a"]), node("If", ["c2"], ["n"], then_branch=inner, else_branch=inner_else),
         node("Tanh", ["n"], ["out"])],
        [],
        [vi("out", F64, [3])],
    )  # fmt: skip
    model = make_model(
        [node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [("x", np.float64, [3]), ("c", np.bool_, []), ("c2", np.bool_, [])],
        [("y", np.float64, [3])],
        {"W": np.array([0.5, -1.0, 2.0])},
    )
    for taken in (True, False):
        graphs = check(model, {"x": np.array([0.3, -0.2, 0.7]), "c": np.array(taken), "c2": np.array(True)})
    check(model, {"x": np.array([0.3, -0.2, 0.7]), "c": np.array(False), "c2": np.array(False)})
    # the main graph keeps its names; each branch value has one name of its own
    assert [i.name for i in graphs.forward.graph.input][:3] == ["x", "c", "c2"]
    assert graphs.outputs == ["y"]


def test_if_branch_with_dynamic_shapes():
    # the then-branch's ReduceSum needs the shape of exp(x), known only at run time: computed in the
    # forward branch and exported through the If like any value the backward reads
    then = graph(
        "then",
        [node("Exp", ["x"], ["t"]), node("ReduceSum", ["t"], ["u"], keepdims=1)],
        [],
        [vi("u", F64, [1])],
    )
    other = graph("else", [node("ReduceMax", ["x"], ["e"], keepdims=1)], [], [vi("e", F64, [1])])
    model = make_model(
        [node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [("x", np.float64, ["N"]), ("c", np.bool_, [])],
        [("y", np.float64, [1])],
    )
    for taken in (True, False):
        check(model, {"x": np.array([0.3, -0.2, 0.7]), "c": np.array(taken)})


# ---- Loop -------------------------------------------------------------------------------------
def rnn_loop(extra_use_of_x: bool = False) -> onnx.ModelProto:
    """h_{t+1} = tanh(h_t W + x[t] U + b) for t < M; outputs h_M and sum_t h_{t+1}^2."""
    nodes = [
        node("Gather", ["x", "i"], ["xt"], axis=0),
        node("MatMul", ["h", "W"], ["hw"]),
        node("MatMul", ["xt", "U"], ["xu"]),
        node("Add", ["hw", "xu"], ["s1"]),
        node("Add", ["s1", "b"], ["s2"]),
        node("Tanh", ["s2"], ["hn"]),
        node("Identity", ["cin"], ["cout"]),
        node("Mul", ["hn", "hn"], ["sq"]),
    ]
    if extra_use_of_x:  # x also read whole: its gradient is accumulated, not stacked by rows
        nodes[-2:-2] = [node("ReduceSum", ["x"], ["xs"], keepdims=0), node("Mul", ["hn0", "xs"], ["hn"])]
        nodes[5] = node("Tanh", ["s2"], ["hn0"])
    body = graph(
        "rnn",
        nodes,
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [4])],
        [vi("cout", BOOL, []), vi("hn", F64, [4]), vi("sq", F64, [4])],
    )
    inits = {
        "W": rng().standard_normal((4, 4)) * 0.5,
        "U": rng().standard_normal((3, 4)),
        "b": np.array([0.1, 0.2, 0.3, -0.1]),
    }
    return make_model(
        [
            node("Loop", ["M", "", "h0"], ["hT", "hs"], body=body),
            node("ReduceSum", ["hs"], ["total"], keepdims=0),
        ],
        [("x", np.float64, ["T", 3]), ("h0", np.float64, [4]), ("M", np.int64, [])],
        [("hT", np.float64, [4]), ("total", np.float64, [])],
        inits,
    )


@pytest.mark.parametrize("trips", [4, 2, 0])
def test_loop_rnn_over_time(trips):
    # 4 rows of x, read as x[t] for t < trips: the other rows get zero gradients
    feeds = {"x": rng().standard_normal((4, 3)), "h0": rng().standard_normal(4), "M": np.array(trips)}
    graphs = check(rnn_loop(), feeds)
    # x[t] is gathered again by the backward, not taped; h_t and tanh are
    taped = [o.name for o in graphs.forward.graph.output if "_tape" in o.name]
    assert sorted(t.split("_tape")[0] for t in taped) == ["h", "hn"]


def test_loop_capture_read_whole_is_accumulated():
    feeds = {"x": rng().standard_normal((3, 3)), "h0": rng().standard_normal(4), "M": np.array(3)}
    check(rnn_loop(extra_use_of_x=True), feeds)


def test_zero_iterations_pass_carried_gradients_through():
    graphs = onnxgrad.build_gradient(
        rnn_loop(), trainable=["W"], inputs_requiring_grad=["h0"], outputs=["hT"]
    )
    dh = rng().standard_normal(4)
    feeds = {"x": rng().standard_normal((2, 3)), "h0": rng().standard_normal(4), "M": np.array(0)}
    out, grads = onnxgrad.testing.run_gradients(graphs, feeds, {"hT": dh})
    np.testing.assert_array_equal(out["hT"], feeds["h0"])
    np.testing.assert_array_equal(grads["h0"], dh)
    np.testing.assert_array_equal(grads["W"], np.zeros((4, 4)))


def test_loop_that_tapes_nothing_still_counts_its_iterations():
    # h = 2 h: the backward reads no forward value, only the number of iterations (T = M here)
    body = graph(
        "double",
        [const("two", 2.0), node("Mul", ["h", "two"], ["hn"]), node("Identity", ["cin"], ["cout"])],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [2])],
        [vi("cout", BOOL, []), vi("hn", F64, [2])],
    )
    model = make_model(
        [node("Loop", ["M", "", "h0"], ["hT"], body=body)],
        [("h0", np.float64, [2]), ("M", np.int64, [])],
        [("hT", np.float64, [2])],
    )
    graphs = onnxgrad.build_gradient(model, inputs_requiring_grad=["h0"])
    assert [o.name.split("_tape")[0] for o in graphs.forward.graph.output] == ["hT", "i"]
    dy = np.array([0.5, -1.0])
    for trips in (3, 0):
        feeds = {"h0": np.array([0.3, -0.2]), "M": np.array(trips)}
        _, grads = onnxgrad.testing.run_gradients(graphs, feeds, {"hT": dy})
        np.testing.assert_array_equal(grads["h0"], dy * 2.0**trips)


def growth_loop() -> onnx.ModelProto:
    """h = h * a + b while |h|^2 < 50 (and at most M times): the iteration count depends on data."""
    body = graph(
        "grow",
        [
            node("Mul", ["h", "a"], ["ha"]),
            node("Add", ["ha", "b"], ["hn"]),
            node("Mul", ["hn", "hn"], ["sq"]),
            node("ReduceSum", ["sq"], ["norm"], keepdims=0),
            const("limit", 50.0),
            node("Less", ["norm", "limit"], ["cout"]),
        ],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [2])],
        [vi("cout", BOOL, []), vi("hn", F64, [2])],
    )
    return make_model(
        [node("Loop", ["M", "c0", "h0"], ["hT"], body=body)],
        [("h0", np.float64, [2]), ("M", np.int64, []), ("c0", np.bool_, [])],
        [("hT", np.float64, [2])],
        {"a": np.array([1.5, -1.3]), "b": np.array([0.2, 0.1])},
    )


@pytest.mark.parametrize("start", [True, False])
def test_loop_with_condition(start):
    feeds = {"h0": np.array([0.8, -0.6]), "M": np.array(100), "c0": np.array(start)}
    graphs = check(growth_loop(), feeds)
    out = run_model(graphs.forward)({**feeds, "a": np.array([1.5, -1.3]), "b": np.array([0.2, 0.1])})
    assert (out["hT"] ** 2).sum() >= 50 if start else np.array_equal(out["hT"], feeds["h0"])


# ---- Scan -------------------------------------------------------------------------------------
def scan_model(
    in_axis: int, in_dir: int, out_axis: int, out_dir: int, steps: int | str = "T"
) -> onnx.ModelProto:
    """s' = tanh(s W + x_t U), y_t = s' * z_t; x scanned along any axis, z backwards; y on any axis."""
    body = graph(
        "cell",
        [
            node("MatMul", ["s", "W"], ["sw"]),
            node("MatMul", ["xt", "U"], ["xu"]),
            node("Add", ["sw", "xu"], ["s1"]),
            node("Tanh", ["s1"], ["sn"]),
            node("Mul", ["sn", "zt"], ["yt"]),
        ],
        [vi("s", F64, [2, 4]), vi("xt", F64, [2, 3]), vi("zt", F64, [2, 4])],
        [vi("sn", F64, [2, 4]), vi("yt", F64, [2, 4])],
    )
    xs, ys = [2, 3], [2, 4]
    xs.insert(in_axis % 3, steps)
    ys.insert(out_axis % 3, steps)
    scan = node(
        "Scan",
        ["s0", "x", "z"],
        ["sT", "y"],
        body=body,
        num_scan_inputs=2,
        scan_input_axes=[in_axis, 0],
        scan_input_directions=[in_dir, 1],
        scan_output_axes=[out_axis],
        scan_output_directions=[out_dir],
    )
    return make_model(
        [scan],
        [("x", np.float64, xs), ("z", np.float64, [steps, 2, 4]), ("s0", np.float64, [2, 4])],
        [("sT", np.float64, [2, 4]), ("y", np.float64, ys)],
        {"W": rng().standard_normal((4, 4)) * 0.5, "U": rng().standard_normal((3, 4))},
    )


@pytest.mark.parametrize("axes", [(0, 0, 0, 0), (1, 1, 2, 1), (-1, 0, -1, 1)])
@pytest.mark.parametrize("steps", [3, 0])
def test_scan_axes_directions_and_empty_sequences(axes, steps):
    xs = [2, 3]
    xs.insert(axes[0] % 3, steps)
    feeds = {
        "x": rng().standard_normal(xs),
        "z": rng().standard_normal((steps, 2, 4)),
        "s0": rng().standard_normal((2, 4)),
    }
    # onnxruntime fails on the model itself over an empty sequence: the forward guards the Scan
    graphs = check(scan_model(*axes), feeds, same_forward=steps > 0)
    if steps == 0:
        out = run_model(graphs.forward)(
            {**feeds, **{i.name: numpy_helper.to_array(i) for i in scan_model(*axes).graph.initializer}}
        )
        np.testing.assert_array_equal(out["sT"], feeds["s0"])
        assert out["y"].size == 0 and out["y"].ndim == 3


def test_scan_of_static_length_is_not_guarded():
    graphs = check(
        scan_model(0, 0, 0, 0, steps=3),
        {
            "x": rng().standard_normal((3, 2, 3)),
            "z": rng().standard_normal((3, 2, 4)),
            "s0": rng().standard_normal((2, 4)),
        },
    )
    assert [n.op_type for n in graphs.forward.graph.node] == ["Scan"]
    # slices of x and z are gathered again by the backward: only states are taped
    assert sorted(o.name.split("_tape")[0] for o in graphs.forward.graph.output if "_tape" in o.name) == [
        "s",
        "sn",
    ]


# ---- nesting ----------------------------------------------------------------------------------
def test_if_inside_loop():
    """h = tanh(h W) on even iterations, h * h + b on odd ones."""
    then = graph(
        "then", [node("Mul", ["h", "W"], ["t1"]), node("Tanh", ["t1"], ["t2"])], [], [vi("t2", F64, [3])]
    )
    other = graph(
        "else", [node("Mul", ["h", "h"], ["e1"]), node("Add", ["e1", "b"], ["e2"])], [], [vi("e2", F64, [3])]
    )
    body = graph(
        "body",
        [
            const("two", np.int64(2)),
            const("zero", np.int64(0)),
            node("Mod", ["i", "two"], ["parity"]),
            node("Equal", ["parity", "zero"], ["even"]),
            node("If", ["even"], ["hn"], then_branch=then, else_branch=other),
            node("Identity", ["cin"], ["cout"]),
        ],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [3])],
        [vi("cout", BOOL, []), vi("hn", F64, [3])],
    )
    model = make_model(
        [node("Loop", ["M", "", "h0"], ["hT"], body=body)],
        [("h0", np.float64, [3]), ("M", np.int64, [])],
        [("hT", np.float64, [3])],
        {"W": np.array([0.5, -1.0, 0.7]), "b": np.array([0.1, 0.2, 0.3])},
    )
    for trips in (4, 1, 0):
        check(model, {"h0": np.array([0.3, -0.4, 0.5]), "M": np.array(trips)})


def nested_loops() -> onnx.ModelProto:
    """For each row x[i]: K inner steps g = tanh(g W + x[i]) (also summing g b); h = g + sum."""
    inner = graph(
        "inner",
        [
            node("Mul", ["g", "W"], ["g1"]),
            node("Add", ["g1", "xi"], ["g2"]),
            node("Tanh", ["g2"], ["gn"]),
            node("Identity", ["c2"], ["c2o"]),
            node("Mul", ["gn", "b"], ["gs"]),
        ],
        [vi("k", I64, []), vi("c2", BOOL, []), vi("g", F64, [3])],
        [vi("c2o", BOOL, []), vi("gn", F64, [3]), vi("gs", F64, [3])],
    )
    outer = graph(
        "outer",
        [
            node("Gather", ["x", "i"], ["xi"], axis=0),
            node("Loop", ["K", "", "h"], ["hn", "gss"], body=inner),
            node("ReduceSum", ["gss", "axis0"], ["gsum"], keepdims=0),
            node("Add", ["hn", "gsum"], ["hn2"]),
            node("Identity", ["cin"], ["cout"]),
        ],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [3])],
        [vi("cout", BOOL, []), vi("hn2", F64, [3]), vi("hn", F64, [3])],
    )
    return make_model(
        [node("Loop", ["M", "", "h0"], ["hT", "hs"], body=outer)],
        [("h0", np.float64, [3]), ("x", np.float64, ["T", 3]), ("M", np.int64, []), ("K", np.int64, [])],
        [("hT", np.float64, [3]), ("hs", np.float64, ["T", 3])],
        {"W": np.array([0.5, -1.0, 0.7]), "b": np.array([0.1, 0.2, 0.3]), "axis0": np.array([0])},
    )


@pytest.mark.parametrize(("outer", "inner"), [(3, 2), (2, 0), (0, 2)])
def test_loop_inside_loop(outer, inner):
    feeds = {
        "h0": rng().standard_normal(3),
        "x": rng().standard_normal((max(outer, 1), 3)),
        "M": np.array(outer),
        "K": np.array(inner),
    }
    check(nested_loops(), feeds)


def test_loop_inside_if_branch():
    # the inner Loop's tape lives in the branch: exported through the If as well
    body = graph(
        "body",
        [node("Mul", ["h", "W"], ["hw"]), node("Sin", ["hw"], ["hn"]), node("Identity", ["cin"], ["cout"])],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [2])],
        [vi("cout", BOOL, []), vi("hn", F64, [2])],
    )
    then = graph("then", [node("Loop", ["M", "", "x"], ["l"], body=body)], [], [vi("l", F64, [2])])
    other = graph("else", [node("Cos", ["x"], ["o"])], [], [vi("o", F64, [2])])
    model = make_model(
        [node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
        [("x", np.float64, [2]), ("c", np.bool_, []), ("M", np.int64, [])],
        [("y", np.float64, [2])],
        {"W": np.array([1.2, -0.7])},
    )
    for taken in (True, False):
        check(model, {"x": np.array([0.4, -0.9]), "c": np.array(taken), "M": np.array(3)})


# ---- a TorchScript export ---------------------------------------------------------------------
class ScriptedRNN(torch.nn.Module):
    """Python control flow that torch.jit.script keeps: a loop over time, a branch, a list."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 4)
        self.rec = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        states: list[torch.Tensor] = []
        for t in range(x.shape[0]):
            h = torch.tanh(self.inp(x[t]) + self.rec(h))
            if h.sum() > 0:
                h = h * 2.0
            else:
                h = h - 1.0
            states.append(h)
        return torch.stack(states).sum(0) * h


def test_torchscript_export_with_loop_if_and_list_matches_torch_autograd():
    torch.manual_seed(0)
    module = ScriptedRNN().double()
    x, h0 = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            torch.jit.script(module),
            (x, h0),
            buffer,
            dynamo=False,
            input_names=["x", "h0"],
            output_names=["y"],
            dynamic_axes={"x": {0: "T"}},
            opset_version=17,
        )
    model = onnx.load_from_string(buffer.getvalue())
    assert {"Loop", "If", "SequenceInsert", "ConcatFromSequence"} <= _all_ops(model.graph)
    check_graphs(onnxgrad.build_gradient(model, inputs_requiring_grad=["x", "h0"]))

    xr, hr = x.clone().requires_grad_(), h0.clone().requires_grad_()
    y = module(xr, hr)
    dy = torch.randn_like(y)
    y.backward(dy)
    names = [n for n, _ in module.named_parameters()]
    got = onnxgrad.gradients(
        model, {"x": x.numpy(), "h0": h0.numpy()}, {"y": dy.numpy()}, wrt=["x", "h0", *names]
    )
    for name, tensor in [("x", xr), ("h0", hr), *module.named_parameters()]:
        np.testing.assert_allclose(got[name], tensor.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(
        run_model(model)({"x": x.numpy(), "h0": h0.numpy()})["y"], y.detach().numpy(), rtol=1e-13
    )


def _all_ops(g: onnx.GraphProto) -> set[str]:
    ops = set()
    for n in g.node:
        ops.add(n.op_type)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                ops |= _all_ops(a.g)
    return ops


# ---- refusals ---------------------------------------------------------------------------------
def test_missing_rule_inside_a_body_names_the_node():
    body = graph(
        "body",
        [
            helper.make_node("Foo", ["h"], ["f"], name="mystery", domain="my.domain"),
            node("Identity", ["cin"], ["cout"]),
        ],
        [vi("i", I64, []), vi("cin", BOOL, []), vi("h", F64, [2])],
        [vi("cout", BOOL, []), vi("f", F64, [2])],
    )
    model = make_model(
        [node("Loop", ["M", "", "h0"], ["hT"], body=body)],
        [("h0", np.float64, [2]), ("M", np.int64, [])],
        [("hT", np.float64, [2])],
    )
    model.opset_import.append(helper.make_opsetid("my.domain", 1))
    with pytest.raises(GradientNotImplementedError, match="no gradient rule for node 'mystery': op 'Foo'"):
        onnxgrad.build_gradient(model, inputs_requiring_grad=["h0"])


def scan8_model(directions: list[int], states: bool = True) -> onnx.ModelProto:
    """Scan-8 over a batch of 2: h' = tanh((x_t W + h U) z_t), y_t = h' (no state: y_t = tanh(x_t W) z_t)."""
    if states:
        nodes = [
            node("MatMul", ["xt", "W"], ["xw"]),
            node("MatMul", ["h", "U"], ["hu"]),
            node("Add", ["xw", "hu"], ["pre"]),
            node("Mul", ["pre", "zt"], ["pre2"]),
            node("Tanh", ["pre2"], ["h2"]),
            node("Identity", ["h2"], ["yt"]),
        ]
        ins, outs = [vi("h", F64, [3])], [vi("h2", F64, [3])]
    else:
        nodes = [
            node("MatMul", ["xt", "W"], ["xw"]),
            node("Tanh", ["xw"], ["t"]),
            node("Mul", ["t", "zt"], ["yt"]),
        ]
        ins, outs = [], []
    body = graph("b", nodes, [*ins, vi("xt", F64, [4]), vi("zt", F64, [3])], [*outs, vi("yt", F64, [3])])
    scan = node(
        "Scan",
        ["", *(["h0"] if states else []), "x", "z"],
        [*(["hT"] if states else []), "ys"],
        body=body,
        num_scan_inputs=2,
        directions=directions,
    )
    return make_model(
        [scan],
        [
            *([("h0", np.float64, [2, 3])] if states else []),
            ("x", np.float64, [2, 5, 4]),
            ("z", np.float64, [2, 5, 3]),
        ],
        [*([("hT", np.float64, [2, 3])] if states else []), ("ys", np.float64, [2, 5, 3])],
        initializers={"W": rng().standard_normal((4, 3)) * 0.5, "U": rng().standard_normal((3, 3)) * 0.5},
        opset=8,
    )


@pytest.mark.parametrize("lengths", [None, [3, 5]], ids=["full", "sequence_lens"])
@pytest.mark.parametrize(
    ("directions", "states"), [([0, 0], True), ([0, 1], True), ([1, 1], True), ([1, 0], False)]
)
def test_scan_8_batch_axis_form(directions: list[int], states: bool, lengths: list[int] | None):
    """Scan-8 (batch axis 0, scan axis 1, reversed inputs, sequence_lens) runs as Loops over the
    batch and the steps, with the values of onnxruntime's Scan-8, and differentiates as Loops."""
    model = scan8_model(directions, states)
    feeds = {"x": rng().standard_normal((2, 5, 4)), "z": rng().standard_normal((2, 5, 3))}
    if states:
        feeds["h0"] = rng().standard_normal((2, 3))
    if lengths is not None:
        model.graph.node[0].input[0] = "lens"
        model.graph.input.append(vi("lens", TensorProto.INT64, [2]))
        feeds["lens"] = np.array(lengths, dtype=np.int64)
    graphs = check(model, feeds, same_forward=False)
    assert "Scan" not in {n.op_type for n in graphs.forward.graph.node}
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    got = run_model(graphs.forward)({**{t: inits[t] for t in graphs.trainable}, **feeds})
    for name, value in run_model(model)(feeds).items():  # to rounding: the products run per element
        np.testing.assert_allclose(got[name], value, rtol=1e-14, atol=1e-15)


def test_scan_8_with_sequence_lens_and_integer_state_is_refused():
    """Steps past a length are masked by multiplication: an integer state cannot be."""
    body = graph(
        "b",
        [node("Add", ["s", "x"], ["sn"]), node("Add", ["c", "c"], ["cn"])],
        [vi("s", F64, [2]), vi("c", TensorProto.INT64, [1]), vi("x", F64, [2])],
        [vi("sn", F64, [2]), vi("cn", TensorProto.INT64, [1])],
    )
    model = make_model(
        [node("Scan", ["lens", "s0", "c0", "xs"], ["sT", "cT"], body=body, num_scan_inputs=1)],
        [
            ("lens", np.int64, [1]),
            ("s0", np.float64, [1, 2]),
            ("c0", np.int64, [1, 1]),
            ("xs", np.float64, [1, 3, 2]),
        ],
        [("sT", np.float64, [1, 2]), ("cT", np.int64, [1, 1])],
        opset=8,
    )
    with pytest.raises(GradientNotImplementedError, match=r"op 'Scan'.*opset 8"):
        onnxgrad.build_gradient(model, inputs_requiring_grad=["s0"])
