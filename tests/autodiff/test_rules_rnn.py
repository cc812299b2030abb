"""Gradient checks of the recurrent rules (rules/rnn.py): RNN, GRU, LSTM.

onnxruntime has no float64 kernels for them, and onnx.reference implements neither sequence_lens,
clip, activations nor peepholes: the float64 finite-difference checks run on onnx.reference with the
numpy kernels below, which follow onnxruntime's semantics and are first checked against onnxruntime
itself in float32. Then the backward graphs run on onnxruntime in float32 (against their float64
results on onnx.reference, and against torch autograd through torch.onnx.export).
"""

from __future__ import annotations

import io
import itertools
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper
from onnx.reference.op_run import OpRun

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient, check_graphs
from onnxgrad.autodiff.rules import rnn as _rnn_rules  # noqa: F401  (registers the rules)
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import assert_allclose_scaled, check_gradients, node_model, run_gradients, run_model
from tests.autodiff.random_data import rng  # one generator per test (conftest.py)

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
T, B, N_IN, H = 3, 2, 3, 4  # steps, batch, input, hidden: tiny, the reference backend is slow


# ---- numpy kernels with onnxruntime's semantics ----------------------------------------------
_TAKES = {
    "affine": (True, True),
    "leakyrelu": (True, False),
    "thresholdedrelu": (True, False),
    "scaledtanh": (True, True),
    "hardsigmoid": (True, True),
    "elu": (True, False),
}
_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}


def np_activation(name: str, a: float, b: float) -> Any:
    return {
        "relu": lambda x: np.maximum(x, 0),
        "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: np.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: np.where(x > a, x, 0),
        "scaledtanh": lambda x: a * np.tanh(b * x),
        "hardsigmoid": lambda x: np.clip(a * x + b, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, a * (np.exp(x) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.log1p(np.exp(x)),
    }[name]


def np_activations(op: str, num_dirs: int, attrs: dict[str, Any]) -> list[list[Any]]:
    """Per direction, the activation functions as onnxruntime reads the attributes."""
    per_dir = {"RNN": 1, "GRU": 2, "LSTM": 3}[op]
    default = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}[op]
    names = [s.lower() for s in (attrs.get("activations") or default * num_dirs)]
    alphas, betas = list(attrs.get("activation_alpha") or []), list(attrs.get("activation_beta") or [])
    fns = []
    for name in names[: per_dir * num_dirs]:  # alpha, beta consumed in order by those taking them
        takes_a, takes_b = _TAKES.get(name, (False, False))
        da, db = _DEFAULTS.get(name, (0.0, 0.0))
        a = (alphas.pop(0) if alphas else da) if takes_a else 0.0
        b = (betas.pop(0) if betas else db) if takes_b else 0.0
        fns.append(np_activation(name, a, b))
    return [fns[d * per_dir : (d + 1) * per_dir] for d in range(num_dirs)]


def np_recurrent(op: str, x, w, r, bias=None, lens=None, h0=None, c0=None, p=None, **attrs: Any) -> tuple:
    """(Y, Y_h[, Y_c]) step by step: a reverse direction runs each sequence backwards from its last
    valid step, Y is zero past a sequence's length, Y_h/Y_c are zero for an empty sequence."""
    layout, direction = attrs.get("layout") or 0, attrs.get("direction") or "forward"
    clip = attrs.get("clip")
    if layout:
        x = x.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    steps, batch, _ = x.shape
    dirs, hid, dt = (2 if direction == "bidirectional" else 1), r.shape[-1], x.dtype
    n = GATES[op] * hid
    bias = np.zeros((dirs, 2 * n), dt) if bias is None else bias
    lens = np.full(batch, steps) if lens is None else np.asarray(lens)
    y = np.zeros((steps, dirs, batch, hid), dt)
    yh, yc = np.zeros((dirs, batch, hid), dt), np.zeros((dirs, batch, hid), dt)
    rows = np.arange(batch)

    def cl(v: np.ndarray) -> np.ndarray:
        return v if clip is None else np.clip(v, -clip, clip)

    for d, fns in enumerate(np_activations(op, dirs, attrs)):
        wb, rb, rd = bias[d, :n], bias[d, n:], r[d]
        pi, po, pf = (p[d, k * hid : (k + 1) * hid] for k in range(3)) if p is not None else (0, 0, 0)
        h = np.zeros((batch, hid), dt) if h0 is None else h0[d].copy()
        c = np.zeros((batch, hid), dt) if c0 is None else c0[d].copy()
        for s in range(steps):
            valid = s < lens
            t = np.clip(
                lens - 1 - s if (direction == "reverse" or d == 1) else np.full(batch, s), 0, steps - 1
            )
            xw, hr = x[t, rows] @ w[d].T + wb, h @ rd.T + rb
            if op == "RNN":
                hn, cn = fns[0](cl(xw + hr)), c
            elif op == "GRU":
                z = fns[0](cl(xw[:, :hid] + hr[:, :hid]))
                rg = fns[0](cl(xw[:, hid : 2 * hid] + hr[:, hid : 2 * hid]))
                if attrs.get("linear_before_reset"):
                    hh = fns[1](cl(xw[:, 2 * hid :] + rg * hr[:, 2 * hid :]))
                else:
                    hh = fns[1](cl(xw[:, 2 * hid :] + (rg * h) @ rd[2 * hid :].T + rb[2 * hid :]))
                hn, cn = (1 - z) * hh + z * h, c
            else:
                g = xw + hr  # gate blocks i, o, f, c
                i = fns[0](cl(g[:, :hid] + pi * c))
                f = 1 - i if attrs.get("input_forget") else fns[0](cl(g[:, 2 * hid : 3 * hid] + pf * c))
                cn = f * c + i * fns[1](cl(g[:, 3 * hid :]))
                hn = fns[0](cl(g[:, hid : 2 * hid] + po * cn)) * fns[2](cn)
            h, c = np.where(valid[:, None], hn, h), np.where(valid[:, None], cn, c)
            y[t[valid], d, rows[valid]] = h[valid]
        yh[d], yc[d] = h * (lens > 0)[:, None], c * (lens > 0)[:, None]
    if layout:
        y, yh, yc = y.transpose(2, 0, 1, 3), yh.transpose(1, 0, 2), yc.transpose(1, 0, 2)
    return (y, yh, yc) if op == "LSTM" else (y, yh)


_ATTRS = ("activation_alpha", "activation_beta", "activations", "clip", "direction", "layout")
_ATTRS += ("linear_before_reset", "input_forget")


def _reference_kernel(op: str) -> type:
    class Kernel(OpRun):
        op_domain = ""

        def _run(self, *inputs: Any, **_: Any) -> tuple:  # type: ignore[override]
            attrs = {a: getattr(self, a, None) for a in _ATTRS}
            outs = np_recurrent(op, *inputs, **attrs)
            return tuple(o for o, name in zip(outs, self.onnx_node.output))

    Kernel.__name__ = op
    return Kernel


@pytest.fixture(autouse=True)
def recurrent_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    base = testing._precise_ops
    kernels = [_reference_kernel(op) for op in GATES]
    monkeypatch.setattr(testing, "_precise_ops", lambda: [*base(), *kernels])


# ---- models -----------------------------------------------------------------------------------
def make_inputs(
    op: str,
    direction: str = "forward",
    lens: list[int] | None = None,
    layout: int = 0,
    peepholes: bool = False,
    optional: bool = True,
    dtype: Any = np.float64,
) -> list[np.ndarray | None]:
    """X, W, R, B, sequence_lens, initial_h[, initial_c, P] (``optional=False``: X, W, R only)."""
    d, n = (2 if direction == "bidirectional" else 1), GATES[op] * H

    def rnd(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng().standard_normal(shape) * scale).astype(dtype)

    state = (d, B, H) if layout == 0 else (B, d, H)
    x = rnd(T, B, N_IN) if layout == 0 else rnd(B, T, N_IN)
    ins = [x, rnd(d, n, N_IN, scale=0.6), rnd(d, n, H, scale=0.6)]
    if not optional:
        return ins
    ins += [rnd(d, 2 * n, scale=0.5), None if lens is None else np.array(lens, np.int32), rnd(*state)]
    if op == "LSTM":
        ins += [rnd(*state), rnd(d, 3 * H) if peepholes else None]
    return ins


def make_model(op: str, inputs: list, opset: int = 14, outputs: tuple[int, ...] | None = None, **attrs: Any):
    """A one-node model; ``outputs``: which of Y, Y_h, Y_c the model uses (default all)."""
    n_out = 3 if op == "LSTM" else 2
    attrs.setdefault("hidden_size", H)
    model = node_model(op, inputs, attrs=attrs, n_outputs=n_out, opset=opset)
    if outputs is not None:
        node = model.graph.node[0]
        for k in range(n_out):
            if k not in outputs:
                node.output[k] = ""
        kept = [o for o in model.graph.output if o.name in set(node.output)]
        del model.graph.output[:]
        model.graph.output.extend(kept)
    return model


def feeds_of(model: onnx.ModelProto, inputs: list) -> dict[str, np.ndarray]:
    return {i.name: inputs[int(i.name[2:])] for i in model.graph.input}


def check_reference(op: str, inputs: list, opset: int = 14, outputs=None, **attrs: Any) -> None:
    """float64 gradients of every float input against finite differences, on onnx.reference."""
    model = make_model(op, inputs, opset, outputs, **attrs)
    feeds = feeds_of(model, inputs)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds))
    check_graphs(graphs)
    # 16 random elements per value: every value and gate block is probed, at a third of the cost
    result = check_gradients(
        model, feeds, wrt=list(feeds), backend="reference", graphs=graphs, max_elements=16
    )
    assert result.ok, result.report()


# ---- the reference kernels are onnxruntime's semantics ---------------------------------------
KERNEL_CASES = [
    # alpha is consumed by the activations that take one: LeakyRelu gets 0.3, not the second value
    ("RNN", "bidirectional", {"activations": ["Tanh", "LeakyRelu"], "activation_alpha": [0.3, 0.2]}),
    ("RNN", "reverse", {"clip": 0.8}),
    ("GRU", "reverse", {"linear_before_reset": 1, "clip": 0.8}),
    ("GRU", "bidirectional", {"activations": ["HardSigmoid", "LeakyRelu", "Sigmoid", "Softplus"]}),
    ("LSTM", "bidirectional", {"clip": 0.8, "input_forget": 1}),
    ("LSTM", "reverse", {"activations": ["Sigmoid", "Elu", "ScaledTanh"], "activation_alpha": [0.5, 0.7]}),
]


@pytest.mark.parametrize(("op", "direction", "attrs"), KERNEL_CASES)
def test_numpy_kernels_match_onnxruntime(op: str, direction: str, attrs: dict) -> None:
    inputs = make_inputs(op, direction, lens=[3, 0], peepholes=True, dtype=np.float32)
    model = make_model(op, inputs, direction=direction, **attrs)
    got = run_model(model)(feeds_of(model, inputs))
    want = np_recurrent(op, *inputs, direction=direction, **attrs)
    for g, w in zip(got.values(), want):
        assert_allclose_scaled(g, w, rtol=1e-4)


# ---- float64 gradients against finite differences --------------------------------------------
@pytest.mark.parametrize(
    ("op", "direction"), list(itertools.product(GATES, ["forward", "reverse", "bidirectional"]))
)
def test_directions_with_lengths(op: str, direction: str) -> None:
    """Every optional input; one sequence shorter than the steps, one empty."""
    check_reference(op, make_inputs(op, direction, lens=[2, 0]), direction=direction)


@pytest.mark.parametrize("op", list(GATES))
def test_batch_major_layout(op: str) -> None:
    inputs = make_inputs(op, "bidirectional", lens=[2, 3], layout=1)
    check_reference(op, inputs, direction="bidirectional", layout=1)


@pytest.mark.parametrize("outputs", [None, (0,), (1,)], ids=["all", "Y", "Y_h"])
@pytest.mark.parametrize("op", list(GATES))
def test_batch_major_layout_on_onnxruntime(op: str, outputs: tuple[int, ...] | None) -> None:
    """onnxruntime refuses layout=1: the forward runs the time-major node between Transposes. Its
    outputs equal the batch-major definition, its gradients finite differences (float32) and those
    of the time-major model on transposed inputs."""
    inputs = make_inputs(op, "bidirectional", lens=[2, 3], layout=1, peepholes=True, dtype=np.float32)
    model = make_model(op, inputs, outputs=outputs, direction="bidirectional", layout=1)
    feeds = feeds_of(model, inputs)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds))
    assert all(
        helper.get_attribute_value(a) == 0
        for nd in graphs.forward.graph.node
        for a in nd.attribute
        if a.name == "layout"
    )
    out = run_model(graphs.forward)(feeds)
    want = np_recurrent(op, *inputs, direction="bidirectional", layout=1)
    for k, o in enumerate(model.graph.node[0].output):
        if o:
            assert_allclose_scaled(out[o], want[k], rtol=1e-4)
    result = check_gradients(model, feeds, wrt=list(feeds), graphs=graphs, rtol=2e-2, atol=2e-3, eps=1e-2)
    assert result.ok, result.report()
    # the time-major model on transposed inputs has the transposed gradients
    moved = [None if x is None else x for x in inputs]
    for slot in (0, 5, 6):
        if slot < len(moved) and moved[slot] is not None:
            moved[slot] = np.ascontiguousarray(moved[slot].transpose(1, 0, 2))
    model0 = make_model(op, moved, outputs=outputs, direction="bidirectional")
    cot = {o: rng().standard_normal(out[o].shape).astype(np.float32) for o in graphs.grad_inputs}
    perms = {0: (1, 2, 0, 3), 1: (1, 0, 2), 2: (1, 0, 2)}  # batch-major cotangents to time-major
    names = list(model.graph.node[0].output)
    cot0 = {o: np.ascontiguousarray(c.transpose(perms[names.index(o)])) for o, c in cot.items()}
    _, grads = run_gradients(graphs, feeds, cot)
    graphs0 = build_gradient(model0, trainable=[], inputs_requiring_grad=list(feeds))
    _, grads0 = run_gradients(graphs0, feeds_of(model0, moved), cot0)
    for name, g in grads.items():
        slot = int(name[2:])
        g0 = grads0[name].transpose(1, 0, 2) if slot in (0, 5, 6) else grads0[name]
        assert_allclose_scaled(g, g0, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("op", list(GATES))
def test_opset_7_without_optional_inputs(op: str) -> None:
    check_reference(op, make_inputs(op, "reverse", optional=False), opset=7, direction="reverse")


@pytest.mark.parametrize("op", list(GATES))
def test_clip(op: str) -> None:
    inputs = make_inputs(op, "bidirectional", lens=[2, 3], peepholes=True)
    check_reference(op, inputs, direction="bidirectional", clip=0.7)


@pytest.mark.parametrize(
    ("op", "attrs"),
    [
        (
            "RNN",
            {"activations": ["Relu", "Affine"], "activation_alpha": [0.5, 1.5], "activation_beta": [0, 0.3]},
        ),
        ("RNN", {"activations": ["LeakyRelu", "ThresholdedRelu"], "activation_alpha": [0.2, -0.1]}),
        (
            "GRU",
            {"activations": ["HardSigmoid", "LeakyRelu", "Sigmoid", "Softplus"], "activation_alpha": [0.3]},
        ),
        ("GRU", {"activations": ["Sigmoid", "Elu", "Sigmoid", "Softsign"]}),
        (
            "LSTM",
            {
                "activations": ["Sigmoid", "ScaledTanh", "Tanh", "HardSigmoid", "Tanh", "Affine"],
                "activation_alpha": [0.8, 0.3, 1.2],
                "activation_beta": [1.1, 0.5, -0.2],
            },
        ),
    ],
)
def test_explicit_activations(op: str, attrs: dict) -> None:
    """Activations differing between the directions, with their alpha/beta."""
    inputs = make_inputs(op, "bidirectional", lens=[3, 2], peepholes=True)
    check_reference(op, inputs, direction="bidirectional", **attrs)


@pytest.mark.parametrize(("direction", "lbr"), [("forward", 1), ("bidirectional", 1), ("reverse", 0)])
def test_gru_linear_before_reset(direction: str, lbr: int) -> None:
    check_reference(
        "GRU", make_inputs("GRU", direction, lens=[2, 3]), direction=direction, linear_before_reset=lbr
    )


@pytest.mark.parametrize(("peepholes", "forget"), [(True, 0), (True, 1), (False, 1)])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_lstm_peepholes_and_input_forget(peepholes: bool, forget: int, direction: str) -> None:
    inputs = make_inputs("LSTM", direction, lens=[3, 1], peepholes=peepholes)
    check_reference("LSTM", inputs, direction=direction, input_forget=forget)


@pytest.mark.parametrize(("op", "outputs"), [("RNN", (1,)), ("GRU", (0,)), ("LSTM", (2,)), ("LSTM", (1, 2))])
def test_subsets_of_outputs(op: str, outputs: tuple[int, ...]) -> None:
    """Y is read back from the node even when the model does not use it."""
    check_reference(
        op, make_inputs(op, "bidirectional", lens=[3, 2]), outputs=outputs, direction="bidirectional"
    )


def test_lengths_at_run_time() -> None:
    """sequence_lens as a graph input (saved for the backward) rather than a constant."""
    inputs = make_inputs("GRU", "bidirectional", lens=[1, 3])
    model = make_model("GRU", inputs, direction="bidirectional")
    lens = model.graph.initializer.pop()
    model.graph.input.append(helper.make_tensor_value_info(lens.name, lens.data_type, [B]))
    feeds = feeds_of(model, inputs)
    floats = [k for k, v in feeds.items() if v.dtype.kind == "f"]
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=floats)
    assert lens.name in graphs.saved
    result = check_gradients(model, feeds, wrt=floats, backend="reference", graphs=graphs, max_elements=16)
    assert result.ok, result.report()


def test_full_lengths_need_no_mask() -> None:
    """Constant lengths all equal to the steps: the backward is the one without sequence_lens."""
    inputs = make_inputs("LSTM", "reverse", lens=[T, T])
    model = make_model("LSTM", inputs, direction="reverse")
    ops = {
        n.op_type
        for n in build_gradient(model, trainable=[], inputs_requiring_grad=["in0"]).backward.graph.node
    }
    assert not {"Where", "ReverseSequence", "Less"} & ops
    check_reference("LSTM", inputs, direction="reverse")


def test_what_the_forward_saves() -> None:
    """Inputs, weights and Y (added to the node): no gate, no cell state; one Scan per recursion."""
    inputs = make_inputs("LSTM", "bidirectional", lens=[3, 2], peepholes=True)
    model = make_model("LSTM", inputs, outputs=(1,), direction="bidirectional")
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in1", "in2"])
    node = graphs.forward.graph.node[0]
    assert node.output[0] and node.output[0] != "out0"  # Y asked of the node
    assert set(graphs.saved) == {"in0", "in1", "in2", "in3", "in5", "in6", "in7", node.output[0]}
    ops = [n.op_type for n in graphs.backward.graph.node]
    assert ops.count("Scan") == 2  # the cell states forward, the gradients backward
    assert not {"RNN", "GRU", "LSTM", "Loop", "Einsum"} & set(ops)


# ---- float32 on onnxruntime ------------------------------------------------------------------
ORT_CASES = [
    ("RNN", "bidirectional", {"activations": ["Relu", "Tanh"], "clip": 2.0}),
    ("GRU", "reverse", {}),
    ("GRU", "bidirectional", {"linear_before_reset": 1}),
    ("LSTM", "forward", {}),
    ("LSTM", "bidirectional", {"input_forget": 1, "clip": 1.5}),
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("op", "direction", "attrs"), ORT_CASES)
def test_onnxruntime_float32(op: str, direction: str, attrs: dict, dynamic: bool) -> None:
    """The backward graph on onnxruntime in float32 equals its float64 run on onnx.reference."""
    inputs = make_inputs(op, direction, lens=[3, 1], peepholes=True)
    grads = []
    for dtype, backend in ((np.float64, "reference"), (np.float32, "onnxruntime")):
        ins = [a if a is None or a.dtype.kind != "f" else a.astype(dtype) for a in inputs]
        model = node_model(
            op,
            ins,
            attrs={"hidden_size": H, "direction": direction, **attrs},
            n_outputs=3 if op == "LSTM" else 2,
            opset=14,
            dynamic=dynamic,
        )
        feeds = feeds_of(model, ins)
        graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds))
        out = run_model(graphs.forward, backend)(feeds)
        cot = {
            o: np.cos(np.arange(out[o].size)).reshape(out[o].shape).astype(dtype) for o in graphs.grad_inputs
        }
        grads.append(run_gradients(graphs, feeds, cot, backend)[1])
    for name, g64 in grads[0].items():
        assert_allclose_scaled(grads[1][name], g64, rtol=2e-4, err_msg=name)


# ---- against torch ---------------------------------------------------------------------------
TORCH_ORDER = {"RNN": [0], "GRU": [1, 0, 2], "LSTM": [0, 3, 1, 2]}  # ONNX gate block k = torch block


def torch_to_onnx_rows(op: str, t: torch.Tensor) -> np.ndarray:
    """A torch weight or bias gradient with its gate blocks in ONNX order."""
    blocks = np.split(t.detach().numpy(), GATES[op], axis=0)
    return np.concatenate([blocks[k] for k in TORCH_ORDER[op]], axis=0)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # torch's exporter
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.parametrize(
    ("op", "kw"),
    [("LSTM", {"bidirectional": True}), ("GRU", {"bidirectional": True}), ("RNN", {"nonlinearity": "relu"})],
)
def test_versus_torch(op: str, kw: dict) -> None:
    """An exported torch layer: every gradient (inputs, initial states, weights) equals torch's."""
    torch.manual_seed(0)
    steps, batch, inp, hid = 6, 3, 5, 7
    layer = getattr(torch.nn, op)(inp, hid, **kw)
    dirs = 2 if kw.get("bidirectional") else 1
    x, h0, c0 = torch.randn(steps, batch, inp), torch.randn(dirs, batch, hid), torch.randn(dirs, batch, hid)
    args = (x, (h0, c0)) if op == "LSTM" else (x, h0)
    names = ["x", "h0", "c0"] if op == "LSTM" else ["x", "h0"]
    buf = io.BytesIO()
    torch.onnx.export(layer, args, buf, dynamo=False, opset_version=14, input_names=names)
    model = onnx.load_from_string(buf.getvalue())
    graphs = build_gradient(model, inputs_requiring_grad=names)
    feeds = dict(zip(names, (t.numpy() for t in (x, h0, c0))))
    _, ours = run_gradients(graphs, feeds)

    leaves = [t.clone().requires_grad_(True) for t in (x, h0, c0)]
    out = layer(leaves[0], (leaves[1], leaves[2]) if op == "LSTM" else leaves[1])
    states = out[1] if op == "LSTM" else (out[1],)
    sum(o.sum() for o in (out[0], *states)).backward()
    for name, leaf in zip(names, leaves):
        assert_allclose_scaled(ours[name], leaf.grad.numpy(), rtol=1e-4, err_msg=name)

    params = dict(layer.named_parameters())
    n = GATES[op] * hid
    by_shape = {numpy_helper.to_array(t).shape: t.name for t in model.graph.initializer}
    sfx = ["_l0", "_l0_reverse"][:dirs]
    expected = {
        (dirs, n, inp): [torch_to_onnx_rows(op, params[f"weight_ih{s}"].grad) for s in sfx],
        (dirs, n, hid): [torch_to_onnx_rows(op, params[f"weight_hh{s}"].grad) for s in sfx],
        (dirs, 2 * n): [
            np.concatenate([torch_to_onnx_rows(op, params[f"bias_{k}{s}"].grad) for k in ("ih", "hh")])
            for s in sfx
        ],
    }
    for shape, per_dir in expected.items():
        assert_allclose_scaled(ours[by_shape[shape]], np.stack(per_dir), rtol=1e-4, err_msg=str(shape))


# ---- what is not supported -------------------------------------------------------------------
def test_unknown_activation_is_reported() -> None:
    inputs = make_inputs("GRU")
    model = make_model("GRU", inputs, activations=["Sigmoid", "Gelu"])
    with pytest.raises(
        GradientNotImplementedError, match=r"GRU node .*unsupported activation\(s\) \['gelu'\]"
    ):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])


def test_opset_1_has_no_rule() -> None:
    """The pre-7 forms (output_sequence attribute) are not differentiated."""
    model = make_model("RNN", make_inputs("RNN", optional=False), opset=1, output_sequence=1)
    for out, shape in zip(model.graph.output, [(T, 1, B, H), (1, B, H)]):
        out.CopyFrom(helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, shape))
    with pytest.raises(GradientNotImplementedError, match=r"no gradient rule .*'RNN'.*opset 1"):
        build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
