"""The default trainable set as exporters write models outside the zoo (issue 21): what the file
declares first (torch's input kinds on value_info, the optimizer's folded constants), Swin's -100
mask, gathered relative-position copies tied to a rebuilt table, and TorchScript's Identity aliases
of equal constants trained apart; and what ``onnxgrad info`` says about each."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad.autodiff.params import select_parameters
from onnxgrad.autodiff.trainable import FOLDED_FROM, TORCH_KIND, decisions
from tests.models import make_model

RNG = np.random.default_rng(1)
F32 = np.float32


def rnd(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(F32)


def added(inits: dict[str, np.ndarray], shape=(4, 8)):
    """y = x * w + each of ``inits`` in turn (w: a weight)."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["h0"])]
    names = list(inits)
    for k, n in enumerate(names):
        nodes.append(helper.make_node("Add", [f"h{k}", n], ["y" if k == len(names) - 1 else f"h{k + 1}"]))
    return make_model(
        nodes, [("x", F32, list(shape))], [("y", F32, list(shape))], {"w": rnd(*shape), **inits}
    )


def meta(proto, key: str, value: str) -> None:
    entry = proto.metadata_props.add()
    entry.key, entry.value = key, value


def test_torch_kinds_declared_on_value_info_come_first():
    # torch 2.13's dynamo exporter writes the kind on graph.value_info, not on the initializer; a
    # declared parameter trains even where its value looks like a mask, a buffer never does
    model = added({"buf": rnd(4, 8), "p": np.where(rnd(4, 8) > 0, 0.0, -1e4).astype(F32), "c": rnd(4, 8)})
    for name, kind in (("buf", "BUFFER"), ("p", "PARAMETER"), ("c", "CONSTANT_TENSOR")):
        vi = model.graph.value_info.add()
        vi.name = name
        meta(vi, TORCH_KIND, kind)
    got = {n: (d.trainable, d.reason) for n, d in decisions(model).items()}
    assert got == {
        "w": (True, "read as a weight"),
        "buf": (False, "torch buffer"),
        "p": (True, "torch parameter"),
        "c": (False, "torch constant"),
    }


def test_constants_the_exporter_folded_from_no_module_tensor():
    # T5's all-zero cross-attention bias, Wav2Vec2's GroupNorm ones: folded from computed values only
    model = added(
        {"zeros": np.zeros((4, 8), F32), "ones": np.ones((4, 8), F32), "bias": np.zeros((4, 8), F32)}
    )
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((4, 8), F32), "table"))
    model.graph.node.append(helper.make_node("Add", ["y", "table"], ["y2"]))
    model.graph.output[0].name = "y2"
    for name, sources in (
        ("zeros", "['_to_copy_3', 'mul_13', 'ones', 'zeros', 'val_4']"),
        ("ones", "['val_13', 'val_14', 'model.encoder.lifted_tensor_0']"),  # a lifted constant
        ("bias", "['model.layer.bias', 'val_2']"),  # a module tensor: a parameter, reshaped
        ("table", "not a list"),
    ):
        vi = model.graph.value_info.add()
        vi.name = name
        meta(vi, FOLDED_FROM, sources)
    got = {n: (d.trainable, d.reason) for n, d in decisions(model).items()}
    assert got["zeros"] == (False, "folded constant")
    assert got["ones"] == (False, "folded constant")
    assert got["bias"] == (True, "read as a weight")
    assert got["table"] == (True, "read as a weight")


def test_swin_shifted_window_mask_of_minus_100():
    mask = np.where(rnd(4, 8) > 0, 0.0, -100.0).astype(F32)
    small = np.where(rnd(4, 8) > 0, 0.0, -10.0).astype(F32)  # -10 is a value, not a mask
    got = {n: d.reason for n, d in decisions(added({"mask": mask, "small": small})).items()}
    assert got["mask"] == "additive mask"
    assert got["small"] == "read as a weight"


# ---- gathered copies -------------------------------------------------------------------------------
def scored(inits: dict[str, np.ndarray], shape) -> onnx.ModelProto:
    """Attention scores: y = Softmax(x * w + each of ``inits`` in turn), the graph of a
    relative-position bias added to ``q k^T`` (x * w stands for the product)."""
    model = added(inits, shape=shape)
    model.graph.node[-1].output[0] = "scores"
    model.graph.node.append(helper.make_node("Softmax", ["scores"], ["y"], axis=-1))
    return model


def swin_copy(heads: int = 2, window: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Swin's relative-position bias: table ((2w-1)^2, heads), index (w*w, w*w), copy
    table[index] as (1, heads, w*w, w*w)."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + window - 1
    index = rel[0] * (2 * window - 1) + rel[1]
    table = rnd((2 * window - 1) ** 2, heads)
    return table, index, np.ascontiguousarray(table[index].transpose(2, 0, 1)[None])


def test_gathered_copy_trains_one_table_as_torch():
    torch = pytest.importorskip("torch")
    table, index, copy = swin_copy()
    model = scored({"bias": copy}, shape=copy.shape)
    selection = select_parameters(model)
    assert [(t.name, t.source, t.how) for t in selection.ties] == [
        ("bias", "bias_core", "gather of 98 entries over [1, 2, 16, 16]")
    ]
    fb = onnxgrad.ForwardBackward(model)
    assert sorted(fb.parameters) == ["bias_core", "w"]
    core = fb.parameters["bias_core"]
    assert sorted(core.tolist()) == sorted(table.ravel().tolist())
    x, dy = rnd(*copy.shape), rnd(*copy.shape)
    grads = fb.forward({"x": x}).backward({"y": dy})
    t = torch.tensor(table, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(fb.parameters["w"], dtype=torch.float64)
    scores = torch.tensor(x, dtype=torch.float64) * w + t[torch.tensor(index)].permute(2, 0, 1)[None]
    (torch.softmax(scores, -1) * torch.tensor(dy, dtype=torch.float64)).sum().backward()
    want = {float(v): float(g) for v, g in zip(table.ravel(), t.grad.numpy().ravel())}
    got = grads["bias_core"]
    np.testing.assert_allclose(got, [want[float(v)] for v in core], rtol=1e-5, atol=1e-5 * np.abs(got).max())
    fb.set_parameters({"bias_core": 2 * core})  # written back as the copy, the table dropped
    out = {i.name: numpy_helper.to_array(i) for i in fb.to_onnx().graph.initializer}
    assert sorted(out) == ["bias", "w"]
    np.testing.assert_array_equal(out["bias"], 2 * copy)


def test_gathered_copy_expanded_over_the_batch_is_one_gather():
    # T5's decoder bias: buckets gathered over (heads, q, k), then expanded over the batch
    *_, copy = swin_copy()
    batched = np.broadcast_to(copy, (2, *copy.shape[1:])).copy()
    (tie,) = select_parameters(scored({"bias": batched}, shape=batched.shape)).ties
    assert (tie.source, tie.how) == ("bias_core", "gather of 98 entries over [2, 2, 16, 16]")


def t5_copy(positions: int, heads: int = 4, buckets: int = 32, causal: bool = False) -> np.ndarray:
    """T5's position bias over ``positions`` tokens, (1, heads, q, k): one bucket per offset k - q
    (a table of ``buckets`` entries per head), float32's lowest above the diagonal when ``causal``."""
    table = rnd(buckets, heads)
    offset = np.arange(positions)[None, :] - np.arange(positions)[:, None]
    copy = table[offset + positions].transpose(2, 0, 1)[None]
    if causal:
        copy = np.where(offset > 0, np.finfo(F32).min, copy)
    return np.ascontiguousarray(copy, dtype=F32)


def test_relative_position_bias_over_few_positions_is_a_gathered_copy():
    # 5 positions: 36 distinct values in 100, too few repeats to count, but constant along diagonals
    bias = t5_copy(5)
    decoder = np.broadcast_to(t5_copy(3, causal=True), (2, 4, 3, 3)).copy()  # 13 distinct values
    (tie,) = select_parameters(scored({"bias": bias}, shape=bias.shape)).ties
    assert (tie.name, tie.source, tie.how) == ("bias", "bias_core", "gather of 36 entries over [1, 4, 5, 5]")
    # 3 buckets and the causal mask's lowest value, per head
    (tie,) = select_parameters(scored({"dec": decoder}, shape=decoder.shape)).ties
    assert (tie.source, tie.how) == ("dec_core", "gather of 16 entries over [2, 4, 3, 3]")


def test_no_gather_tie_without_repeats_or_distinct_entries():
    _, index, _ = swin_copy()
    few = np.arange(8, dtype=F32)[index % 8][None, None]  # 8 distinct values: too few to tell
    zeros = np.zeros((1, 2, 16, 16), F32)  # Swin's table at initialization: a constant
    weight = rnd(1, 2, 16, 16)  # no repeats
    model = scored({"few": few.repeat(2, 1), "zeros": zeros, "weight": weight}, shape=(1, 2, 16, 16))
    assert select_parameters(model).ties == []
    # constant along the diagonals, as a relative-position bias is, but an initialisation: identity,
    # banded (three values)
    eye = np.broadcast_to(np.eye(16, dtype=F32), (1, 2, 16, 16)).copy()
    banded = (eye + 0.5 * np.roll(eye, 1, axis=-1) - 0.25 * np.roll(eye, -1, axis=-1)).astype(F32)
    assert select_parameters(scored({"eye": eye, "banded": banded}, shape=(1, 2, 16, 16))).ties == []


# ---- aliases ---------------------------------------------------------------------------------------
def aliased_model():
    """TorchScript's deduplication: ``b1`` and ``g1`` read ``b0``/``g0`` (zeros, ones) through
    Identity; ``r1`` reads a random ``r0`` through Identity (a use, not an alias)."""
    nodes = [
        helper.make_node("Identity", ["b0"], ["b1"]),
        helper.make_node("Identity", ["g0"], ["g1"]),
        helper.make_node("Identity", ["r0"], ["r1"]),
        helper.make_node("Mul", ["x", "g0"], ["h0"]),
        helper.make_node("Add", ["h0", "b0"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("Mul", ["h2", "g1"], ["h3"]),
        helper.make_node("Add", ["h3", "b1"], ["h4"]),
        helper.make_node("Mul", ["h4", "r1"], ["y"]),
    ]
    inits = {"b0": np.zeros(8, F32), "g0": np.ones(8, F32), "r0": rnd(8)}
    return make_model(nodes, [("x", F32, [4, 8])], [("y", F32, [4, 8])], inits)


def test_identity_aliases_of_equal_constants_train_apart():
    torch = pytest.importorskip("torch")
    model = aliased_model()
    selection = select_parameters(model)
    assert selection.aliases == {"b1": "b0", "g1": "g0"}
    assert selection.trainable == ["b0", "g0", "r0", "b1", "g1"]
    fb = onnxgrad.ForwardBackward(model)
    x, dy = rnd(4, 8), rnd(4, 8)
    grads = fb.forward({"x": x}).backward({"y": dy})
    p = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in fb.parameters.items()}
    xt = torch.tensor(x, dtype=torch.float64)
    y = (torch.tanh(xt * p["g0"] + p["b0"]) * p["g1"] + p["b1"]) * p["r0"]
    (y * torch.tensor(dy, dtype=torch.float64)).sum().backward()
    for n, t in p.items():
        np.testing.assert_allclose(grads[n], t.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    assert not np.allclose(grads["b0"], grads["b1"])  # one parameter would have had their sum
    fb.set_parameters({"b1": np.full(8, 0.5, F32)})
    out = {i.name: numpy_helper.to_array(i) for i in fb.to_onnx().graph.initializer}
    np.testing.assert_array_equal(out["b0"], np.zeros(8, F32))
    np.testing.assert_array_equal(out["b1"], np.full(8, 0.5, F32))


def test_info_shows_each_decision_aliases_and_rebuilt_tables(tmp_path, capsys):
    import onnx

    from onnxgrad.cli import main

    _, _, copy = swin_copy()
    model = aliased_model()
    model.graph.initializer.append(numpy_helper.from_array(copy, "bias"))
    model.graph.initializer.append(
        numpy_helper.from_array(np.where(rnd(4, 8) > 0, 0, -100).astype(F32), "mask")
    )
    model.graph.input.append(helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, list(copy.shape)))
    model.graph.node.extend(
        [
            helper.make_node("Add", ["y", "mask"], ["y1"]),
            helper.make_node("Add", ["s", "bias"], ["s1"]),  # an attention-score bias
            helper.make_node("Softmax", ["s1"], ["y2"]),
        ]
    )
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y1", onnx.TensorProto.FLOAT, [4, 8]))
    model.graph.output.append(helper.make_tensor_value_info("y2", onnx.TensorProto.FLOAT, list(copy.shape)))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]

    def row(*start: str) -> str:
        return next(" ".join(r) for r in rows if r[: len(start)] == list(start))

    assert row("b0", "float") == "b0 float [8] 8 read as a weight"
    assert row("b1", "float") == "b1 float [8] 8 read as a weight; Identity alias of b0, apart"
    assert row("b1", "b0") == "b1 b0"  # the aliases table
    assert row("bias_core") == "bias_core float [98] 98 rebuilt from bias"
    assert row("bias_core", "bias") == "bias_core bias gather of 98 entries over [1, 2, 16, 16]"
    assert row("mask") == "mask float [4, 8] additive mask"
