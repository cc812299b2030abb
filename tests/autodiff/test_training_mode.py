"""Training mode: Dropout and BatchNormalization gradient rules in training mode (rules/elementwise.py
and rules/norm.py), and switching a model between training and inference (autodiff/modes.py).

Dropout is random, so its gradient is checked against the mask its forward drew (through
ForwardBackward); BatchNormalization in training mode against float64 finite differences and
torch's batch_norm(training=True); set_training_mode on a torch-exported Conv-BatchNorm-Dropout net
in both directions, against torch in eval and train mode.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.autodiff.modes import ModeSwitch, set_training_mode
from onnxgrad.errors import GradientNotImplementedError, ModelError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import assert_allclose_scaled, check_gradients, node_model, run_gradients
from tests.autodiff.random_data import pos, rnd


def model_of(nodes: list, inputs: list, outputs: list, inits: list = (), opset: int = 15) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


def vi(name: str, dtype: int, shape: Any) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def scalar(name: str, value: Any) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value), name)


# ---- Dropout --------------------------------------------------------------------------------
def dropout_model(
    ratio: float | None, training: bool | None, mask_output: bool, dtype: int = TensorProto.DOUBLE
) -> onnx.ModelProto:
    """x -> Dropout -> y (and its mask); ``None`` for ratio/training: a graph input fed at run time."""
    inputs, inits = [vi("x", dtype, ["N", 5])], []
    for name, value, t in (("ratio", ratio, dtype), ("training", training, TensorProto.BOOL)):
        if value is None:
            inputs.append(vi(name, t, []))
        else:
            arr = np.array(value, dtype=np.float32 if name == "ratio" else np.bool_)
            inits.append(numpy_helper.from_array(arr, name))
    outputs = [vi("y", dtype, ["N", 5])] + ([vi("mask", TensorProto.BOOL, ["N", 5])] if mask_output else [])
    node = helper.make_node("Dropout", ["x", "ratio", "training"], [o.name for o in outputs])
    return model_of([node], inputs, outputs, inits, opset=13)


def run_dropout(model: onnx.ModelProto, feeds: dict[str, Any], seed: int = 0) -> tuple[Any, ...]:
    """(y, mask or None, dy, dx) from one forward and backward through ForwardBackward."""
    fb = onnxgrad.ForwardBackward(model, trainable=[], inputs_requiring_grad=["x"], outputs=["y"])
    res = fb.forward(feeds, training=True)
    y = res.outputs[0]
    dy = np.random.default_rng(seed).standard_normal(y.shape).astype(y.dtype)
    dx = res.backward({"y": dy})["x"]
    return y, res.outputs[1] if len(res.outputs) > 1 else None, dy, dx


@pytest.mark.parametrize("dtype", [TensorProto.DOUBLE, TensorProto.FLOAT])
def test_dropout_gradient_is_the_forward_mask(dtype: int) -> None:
    x = rnd(64, 5).astype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
    y, mask, dy, dx = run_dropout(dropout_model(0.3, True, mask_output=True, dtype=dtype), {"x": x})
    assert 0 < mask.sum() < mask.size  # some dropped, some kept
    scale = np.float32(1 / (1 - np.float32(0.3))) if dtype == TensorProto.FLOAT else 1 / (1 - np.float32(0.3))
    np.testing.assert_allclose(y, x * mask * scale, rtol=1e-6)
    np.testing.assert_allclose(dx, dy * mask * scale, rtol=1e-6)
    assert np.all(dx[y == 0] == 0.0)  # exactly zero where the forward dropped


def test_dropout_mask_not_in_the_model() -> None:
    """The rule asks the Dropout node for its mask output: still the mask of this forward."""
    x = rnd(64, 5)
    y, _, dy, dx = run_dropout(dropout_model(0.5, True, mask_output=False), {"x": x})
    kept = y != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_array_equal(dx[~kept], 0.0)
    np.testing.assert_allclose(dx[kept], dy[kept] * 2.0, rtol=1e-15)
    np.testing.assert_allclose(y[kept], x[kept] * 2.0, rtol=1e-15)


def test_dropout_ratio_and_training_mode_at_run_time() -> None:
    model = dropout_model(None, None, mask_output=True)
    x = rnd(64, 5)
    y, mask, dy, dx = run_dropout(model, {"x": x, "ratio": np.array(0.25), "training": np.array(True)})
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(dx, dy * mask / 0.75, rtol=1e-15)
    # not training: the identity, whatever the ratio
    y, mask, dy, dx = run_dropout(model, {"x": x, "ratio": np.array(0.25), "training": np.array(False)})
    assert mask.all()
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, dy)
    # ratio 0 while training: nothing dropped, nothing scaled
    y, mask, dy, dx = run_dropout(model, {"x": x, "ratio": np.array(0.0), "training": np.array(True)})
    np.testing.assert_array_equal(dx, dy)


def test_dropout_default_ratio() -> None:
    model = dropout_model(0.5, True, mask_output=True)
    node = model.graph.node[0]
    node.input[1] = ""  # no ratio: 0.5
    model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == "ratio"))
    _, mask, dy, dx = run_dropout(model, {"x": rnd(64, 5)})
    np.testing.assert_allclose(dx, dy * mask * 2.0, rtol=1e-15)


def test_dropout_training_before_opset_7_is_unsupported() -> None:
    model = node_model("Dropout", [rnd(3, 4)], attrs={"is_test": 0}, opset=6)
    with pytest.raises(GradientNotImplementedError, match="opset 12"):
        build_gradient(model, inputs_requiring_grad=["in0"])


# ---- BatchNormalization in training mode ------------------------------------------------------
BN_SHAPES = [(4, 3), (2, 3, 5), (2, 3, 4, 3), (2, 2, 3, 2, 2)]
BN_IDS = ["0d", "1d", "2d", "3d"]


def bn_inputs(shape: tuple) -> list[np.ndarray]:
    c = shape[1]
    return [rnd(*shape), rnd(c), rnd(c), rnd(c), pos(c)]


def check_bn_training(model: onnx.ModelProto, inputs: list[np.ndarray], wrt: list[str]) -> None:
    """Finite differences of Y only: the running statistics outputs carry no gradient."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=wrt, outputs=["out0"])
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    result = check_gradients(model, feeds, graphs=graphs)
    assert result.ok, result.report()


@pytest.mark.parametrize(("shape", "opset"), list(zip(BN_SHAPES, [14, 15, 14, 15])), ids=BN_IDS)
def test_batch_norm_training(shape: tuple, opset: int) -> None:
    inputs = bn_inputs(shape)
    attrs = {"training_mode": 1, "epsilon": 1e-3, "momentum": 0.8}
    for dynamic in (False, True):
        model = node_model(
            "BatchNormalization", inputs, attrs=attrs, opset=opset, n_outputs=3, dynamic=dynamic
        )
        check_bn_training(model, inputs, ["in0", "in1", "in2"])


def test_batch_norm_training_opset9_form() -> None:
    """Before opset 14, asking for the statistics outputs is training mode (as onnxruntime runs it)."""
    inputs = bn_inputs((3, 2, 4))
    model = node_model("BatchNormalization", inputs, opset=9, n_outputs=5)
    for out in model.graph.output[1:]:  # statistics, per channel: ONNX infers no shape for them
        out.type.CopyFrom(model.graph.input[1].type)
    check_bn_training(model, inputs, ["in0", "in1", "in2"])


@pytest.mark.parametrize(("shape", "opset"), list(zip(BN_SHAPES, [14, 15, 14, 15])), ids=BN_IDS)
def test_batch_norm_training_running_statistics_gradients(shape: tuple, opset: int) -> None:
    """A loss reading the running mean and variance: their gradients reach input_mean, input_var
    (times the momentum) and X (through the batch statistics), as finite differences say."""
    inputs = bn_inputs(shape)
    attrs = {"training_mode": 1, "epsilon": 1e-3, "momentum": 0.8}
    for dynamic in (False, True):
        model = node_model(
            "BatchNormalization", inputs, attrs=attrs, opset=opset, n_outputs=3, dynamic=dynamic
        )
        feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
        for outputs in (["out0", "out1", "out2"], ["out1"], ["out2"], ["out1", "out2"]):
            graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds), outputs=outputs)
            result = check_gradients(model, feeds, graphs=graphs)
            assert result.ok, (outputs, result.report())


def test_batch_norm_training_running_statistics_opset9_form() -> None:
    """Before opset 14: the running statistics are outputs 1 and 2 (the saved ones carry none)."""
    inputs = bn_inputs((3, 2, 4))
    model = node_model("BatchNormalization", inputs, attrs={"momentum": 0.7}, opset=9, n_outputs=5)
    for out in model.graph.output[1:]:
        out.type.CopyFrom(model.graph.input[1].type)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(feeds), outputs=["out1", "out2"])
    result = check_gradients(model, feeds, graphs=graphs)
    assert result.ok, result.report()


def test_batch_norm_training_running_statistics_gradients_of_ones() -> None:
    """backward(None) puts ones on every output, the running statistics included."""
    inputs = bn_inputs((3, 2, 4))
    x = inputs[0]
    model = node_model("BatchNormalization", inputs, attrs={"training_mode": 1}, opset=15, n_outputs=3)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0", "in3", "in4"])
    assert set(graphs.grad_inputs) == {"out0", "out1", "out2"}
    feeds = {f"in{i}": a for i, a in enumerate(inputs)}
    fb = onnxgrad.ForwardBackward(graphs)
    only_y = fb.forward(feeds).backward({"out0": np.ones((3, 2, 4))})
    ones = fb.forward(feeds).backward(None)
    np.testing.assert_allclose(ones["in3"], np.full(2, 0.9))
    np.testing.assert_allclose(ones["in4"], np.full(2, 0.9))
    centered = x - x.mean(axis=(0, 2), keepdims=True)
    extra = 0.1 * (1 + 2 * centered) / 12  # (1 - momentum) (d rm + 2 (x - mean) d rv) / M
    np.testing.assert_allclose(ones["in0"], only_y["in0"] + extra, rtol=1e-10, atol=1e-12)
    assert not only_y["in3"].any() and not only_y["in4"].any()


@pytest.mark.parametrize("shape", BN_SHAPES[1:3], ids=BN_IDS[1:3])
def test_batch_norm_training_versus_torch(shape: tuple) -> None:
    """float64: output, running mean and gradients of x, scale and bias as torch's training mode;
    the running variance uses the biased batch variance in ONNX (the unbiased one in torch)."""
    x, s, b, m, v = bn_inputs(shape)
    eps, momentum = 2.0**-10, 0.75  # exact in the float attributes
    attrs = {"training_mode": 1, "epsilon": eps, "momentum": momentum}
    model = node_model("BatchNormalization", [x, s, b, m, v], attrs=attrs, opset=15, n_outputs=3)
    feeds = {"in0": x, "in1": s, "in2": b, "in3": m, "in4": v}
    graphs = build_gradient(
        model, trainable=[], inputs_requiring_grad=["in0", "in1", "in2"], outputs=["out0"]
    )
    cot = np.random.default_rng(0).standard_normal(x.shape)
    out, ours = run_gradients(graphs, feeds, {"out0": cot})
    y = out["out0"]
    tx, ts, tb = (torch.tensor(a, requires_grad=True) for a in (x, s, b))
    rm, rv = torch.tensor(m), torch.tensor(v)
    ty = F.batch_norm(tx, rm, rv, ts, tb, training=True, momentum=1 - momentum, eps=eps)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    for name, t in (("in0", tx), ("in1", ts), ("in2", tb)):
        np.testing.assert_allclose(ours[name], t.grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
    axes = (0, *range(2, x.ndim))
    np.testing.assert_allclose(out["out1"], rm.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["out2"], momentum * v + (1 - momentum) * x.var(axis=axes), rtol=1e-12)


# ---- set_training_mode ----------------------------------------------------------------------
class Net(torch.nn.Module):
    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.drop = torch.nn.Dropout(p)
        self.fc = torch.nn.Linear(3 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x)))).flatten(1))


def export(net: torch.nn.Module, mode: torch.onnx.TrainingMode) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():  # torch deprecates its TorchScript exporter's options
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.zeros(2, 2, 4, 4),),
            buf,
            dynamo=False,
            training=mode,
            opset_version=15,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
            do_constant_folding=False,
        )
    return onnx.load_from_string(buf.getvalue())


@pytest.fixture(scope="module")
def net() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # trained-looking statistics, so eval and training differ
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
        net.bn.weight.uniform_(0.5, 1.5)
    return net


def ops(model: onnx.ModelProto, op: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op]


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def const_value(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def test_training_export_switched_to_inference(net: Net) -> None:
    switched = set_training_mode(export(net, torch.onnx.TrainingMode.TRAINING), training=False)
    assert isinstance(switched, ModeSwitch) and switched.running_stats == {}
    model = switched.model
    (bn,) = ops(model, "BatchNormalization")
    assert helper.get_node_attr_value(bn, "training_mode") == 0 and len(bn.output) == 1
    (drop,) = ops(model, "Dropout")
    assert len(drop.input) < 3 or not drop.input[2]  # no training_mode input: inference
    x = np.random.default_rng(0).standard_normal((5, 2, 4, 4)).astype(np.float32)
    net.eval()
    with torch.no_grad():
        expected = net(torch.tensor(x)).numpy()
    assert_allclose_scaled(run(model, {"x": x})["y"], expected, rtol=1e-5)


def torch_train_step(net: Net, x: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Output and parameter gradients of a train-mode forward (Dropout off), sum of outputs as loss."""
    net.train()
    net.drop.p = 0.0
    net.zero_grad()
    y = net(torch.tensor(x))
    y.sum().backward()
    net.drop.p = 0.3
    return y.detach().numpy(), {k: p.grad.numpy() for k, p in net.named_parameters()}


def test_inference_export_switched_to_training(net: Net) -> None:
    """BatchNorm in training mode: batch statistics, gradients and running statistics as torch's
    (torch wrote Dropout out of the inference export, so the network has none)."""
    state = {k: v.clone() for k, v in net.state_dict().items()}
    model = export(net, torch.onnx.TrainingMode.EVAL)
    switched = set_training_mode(model, training=True)
    stats = switched.running_stats
    assert set(stats) == {"bn.running_mean", "bn.running_var"} == set(switched.buffers)
    (bn,) = ops(switched.model, "BatchNormalization")
    assert helper.get_node_attr_value(bn, "training_mode") == 1
    assert list(bn.output[1:]) == [stats["bn.running_mean"], stats["bn.running_var"]]
    outputs = {o.name for o in switched.model.graph.output}
    assert set(stats.values()) <= outputs
    trainable = [i.name for i in switched.model.graph.initializer if i.name not in stats]
    fb = onnxgrad.ForwardBackward(switched.model, trainable=trainable)
    x = np.random.default_rng(1).standard_normal((5, 2, 4, 4)).astype(np.float32)
    res = fb.forward({"x": x})
    ours = res.backward({"y": np.ones((5, 2), np.float32)})
    y, expected = torch_train_step(net, x)
    assert_allclose_scaled(res.outputs[0], y, rtol=1e-4)
    # conv.bias's gradient is 0 up to rounding (the batch statistics remove any bias): measured
    # against the magnitude of all the gradients, which the rounding errors come from
    scale = max(float(np.abs(g).max()) for g in expected.values())
    for name, grad in expected.items():
        assert_allclose_scaled(ours[name], grad, rtol=1e-4, scale=scale, err_msg=name)
    # the new running mean is torch's; the running variance uses the biased batch variance
    new = dict(zip(fb.output_names, res.outputs))
    assert_allclose_scaled(new[stats["bn.running_mean"]], net.bn.running_mean.numpy(), rtol=1e-5)
    net.load_state_dict(state)


def test_running_statistics_written_back(net: Net) -> None:
    """Feeding each step's new statistics back: two steps match torch's running mean after two steps."""
    state = {k: v.clone() for k, v in net.state_dict().items()}
    switched = set_training_mode(export(net, torch.onnx.TrainingMode.EVAL), training=True)
    stats = switched.running_stats
    sess = ort.InferenceSession(switched.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    current = {k: const_value(switched.model, k) for k in stats}
    rng = np.random.default_rng(2)
    for _ in range(2):
        x = rng.standard_normal((4, 2, 4, 4)).astype(np.float32)
        out = dict(zip(names, sess.run(None, {"x": x, **current})))
        current = {k: out[v] for k, v in stats.items()}
        torch_train_step(net, x)
    assert_allclose_scaled(current["bn.running_mean"], net.bn.running_mean.numpy(), rtol=1e-5)
    net.load_state_dict(state)


def test_untrained_statistics_get_initializers_of_their_own() -> None:
    """torch writes a fresh BatchNorm's statistics as Identity of its scale and bias (same ones and
    zeros): switching to training gives them initializers, so writing them back leaves scale alone."""
    model = export(Net(), torch.onnx.TrainingMode.EVAL)
    assert any(n.op_type == "Identity" and n.output[0] == "bn.running_var" for n in model.graph.node)
    switched = set_training_mode(model, training=True)
    assert not ops(switched.model, "Identity")
    np.testing.assert_array_equal(const_value(switched.model, "bn.running_var"), np.ones(3, np.float32))
    np.testing.assert_array_equal(const_value(switched.model, "bn.running_mean"), np.zeros(3, np.float32))


def test_round_trip(net: Net) -> None:
    """training export -> inference -> training: the Dropout trains again and its gradient is its mask."""
    model = export(net, torch.onnx.TrainingMode.TRAINING)
    back = set_training_mode(set_training_mode(model, training=False).model, training=True)
    assert set(back.running_stats) == {"bn.running_mean", "bn.running_var"}
    (drop,) = ops(back.model, "Dropout")
    assert const_value(back.model, drop.input[2])
    fb = onnxgrad.ForwardBackward(back.model, trainable=[], inputs_requiring_grad=["x"], outputs=["y"])
    x = np.random.default_rng(3).standard_normal((6, 2, 4, 4)).astype(np.float32)
    res = fb.forward({"x": x})
    dx = res.backward({"y": np.ones((6, 2), np.float32)})["x"]
    assert np.isfinite(dx).all() and np.abs(dx).sum() > 0


def test_statistics_outputs_still_read_become_copies() -> None:
    """Inference drops the running statistics outputs; one still read elsewhere is the input one."""
    inputs = [vi("x", TensorProto.FLOAT, [4, 2, 3])]
    values = {"s": [1.0, 2.0], "b": [0.0, 1.0], "m": [0.5, -1.0], "v": [2.0, 3.0]}
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in values.items()]
    nodes = [
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1),
        helper.make_node("Identity", ["rm"], ["rm_out"]),
    ]
    outputs = [
        vi("y", TensorProto.FLOAT, [4, 2, 3]),
        vi("rm_out", TensorProto.FLOAT, [2]),
        vi("rv", TensorProto.FLOAT, [2]),
    ]
    model = set_training_mode(model_of(nodes, inputs, outputs, inits), training=False).model
    out = run(model, {"x": np.ones((4, 2, 3), np.float32)})
    np.testing.assert_array_equal(out["rm_out"], [0.5, -1.0])
    np.testing.assert_array_equal(out["rv"], [2.0, 3.0])


def test_old_opsets() -> None:
    x = [vi("x", TensorProto.FLOAT, [2, 3])]
    y = [vi("y", TensorProto.FLOAT, [2, 3])]
    model = model_of([helper.make_node("Dropout", ["x"], ["y"], ratio=0.5)], x, y, opset=11)
    assert set_training_mode(model, training=False).model.graph.node[0] == model.graph.node[0]
    with pytest.raises(ModelError, match="opset 12 or later"):
        set_training_mode(model, training=True)
    bn_inits = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in "sbmv"]
    bn = model_of(
        [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])], x, y, bn_inits, opset=9
    )
    with pytest.raises(ModelError, match="opset 14 or later"):
        set_training_mode(bn, training=True)


def test_refusals() -> None:
    x = [vi("x", TensorProto.FLOAT, [2, 3])]
    y = [vi("y", TensorProto.FLOAT, [2, 3])]
    body = helper.make_graph(
        [helper.make_node("Dropout", ["x"], ["d"])], "body", [], [vi("d", TensorProto.FLOAT, [2, 3])]
    )
    cond = [scalar("c", True)]
    model = model_of([helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)], x, y, cond)
    with pytest.raises(ModelError, match="inside a subgraph"):
        set_training_mode(model, training=False)
    inits = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in "sbv"]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=0),
        helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"]),
    ]
    model = model_of(nodes, x, y, inits, opset=15)
    with pytest.raises(ModelError, match="computed by the graph"):
        set_training_mode(model, training=True)


@pytest.mark.parametrize("training", [False, True])
def test_a_constant_node_training_flag_left_unread_is_dropped(net: Net, training: bool) -> None:
    """TorchScript's training=TRAINING feeds Dropout's training_mode from a Constant node: switched
    (to inference: no flag; to training: onnxgrad's shared flag), that Constant is read by nothing
    and is dropped (onnxruntime folds it to an initializer and warns 'Removing initializer' at each
    session)."""
    model = export(net, torch.onnx.TrainingMode.TRAINING)
    (drop,) = ops(model, "Dropout")
    flag = drop.input[2]
    assert any(n.op_type == "Constant" and flag in n.output for n in model.graph.node)
    switched = set_training_mode(model, training=training).model
    read = {i for n in switched.graph.node for i in n.input} | {o.name for o in switched.graph.output}
    unread = [o for n in switched.graph.node if n.op_type == "Constant" for o in n.output if o not in read]
    assert unread == []
    assert flag not in {o for n in switched.graph.node for o in n.output}
