"""Weights as users hold them (issue 37 §1): a checkpoint rounded through bfloat16 or float16, a
float16 model, a weight round-tripped through int8 holds few distinct values, each many times. Equal
values alone never tie weights that torch trains apart: each element trains, through every door
(``build_gradient`` / ``ForwardBackward``, ``OnnxModule``, ``Trainer``, ``artifacts.generate``). A
table is a table when the graph says so (an attention-score bias, next to these, still is); and
the tie finder's value tests take any shape (issue 39, planted bug 3)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxgrad
from onnxgrad.artifacts import generate
from onnxgrad.autodiff.params import select_parameters
from onnxgrad.autodiff.ties import _relative_positions, gather_index, score_biases
from onnxgrad.train import Trainer
from tests.models import make_model

RNG = np.random.default_rng(7)
F32 = np.float32
N_IN, N_OUT = 128, 512  # a 512 x 128 Linear: 65,536 weights


def through_bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (to nearest, ties to even) and back to float32."""
    bits = np.ascontiguousarray(a, F32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(F32)


def through_fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(F32)


def through_int8(a: np.ndarray) -> np.ndarray:
    """Per-tensor symmetric int8 quantization and back (fake quantization): at most 255 values."""
    scale = np.abs(a).max() / 127
    return (np.clip(np.round(a / scale), -127, 127) * scale).astype(F32)


ROUNDINGS = {"bf16": through_bf16, "fp16": through_fp16, "int8": through_int8}


def linear(weight: np.ndarray, dtype=F32) -> onnx.ModelProto:
    """y = x @ W + b, W of (in, out) as exporters store a Linear's weight transposed."""
    n_in, n_out = weight.shape
    inits = {"W": weight.astype(dtype), "b": (0.1 * RNG.standard_normal(n_out)).astype(dtype)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    return make_model(nodes, [("x", dtype, ["N", n_in])], [("y", dtype, ["N", n_out])], inits)


def rounded_weight(kind: str) -> np.ndarray:
    w = ROUNDINGS[kind]((0.05 * RNG.standard_normal((N_IN, N_OUT))).astype(F32))
    _, counts = np.unique(w, return_counts=True)
    assert counts.size * 4 <= w.size  # what the old rule took for a gathered table
    return w


@pytest.mark.parametrize("kind", list(ROUNDINGS))
def test_rounded_linear_weight_trains_every_element(kind):
    model = linear(rounded_weight(kind))
    selection = select_parameters(model)
    assert selection.ties == [] and selection.trainable == ["W", "b"]
    graphs = onnxgrad.build_gradient(model)
    assert graphs.trainable == ["W", "b"] and graphs.ties == []
    fb = onnxgrad.ForwardBackward(model)
    assert {n: v.size for n, v in fb.parameters.items()} == {"W": 65536, "b": N_OUT}
    # the gradient of each element is its own: x^T dy, not summed over equal values
    x, dy = RNG.standard_normal((4, N_IN)).astype(F32), RNG.standard_normal((4, N_OUT)).astype(F32)
    grads = fb.forward({"x": x}).backward({"y": dy})
    np.testing.assert_allclose(
        grads["W"], x.T.astype(np.float64) @ dy, rtol=1e-4, atol=1e-5 * np.abs(x).max()
    )


def test_rounded_weight_through_every_door(tmp_path):
    model = linear(rounded_weight("bf16"))
    # Trainer (and so the CLI's train), with a loss appended
    trainer = Trainer(model, loss="mse", progress=False)
    assert {n: v.size for n, v in trainer.parameters.items()} == {"W": 65536, "b": N_OUT}
    # the artifacts the Python runner, Node and the browser train
    art = generate(model, loss="mse", targets=("onnxruntime",))
    assert [(p["name"], p["shape"]) for p in art.manifest["parameters"]] == [
        ("W", [N_IN, N_OUT]),
        ("b", [N_OUT]),
    ]
    # OnnxModule: nn.Parameters
    pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    module = OnnxModule(model)
    assert sorted(p.numel() for p in module.parameters()) == [N_OUT, 65536]


def test_named_trainable_weight_is_what_trains():
    # trainable=["W1"] trains W1 itself, elementwise, not a table rebuilt from its values
    w1, w2 = rounded_weight("bf16"), through_bf16(rounded_weight("fp16").T.copy())
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["y"]),
    ]
    model = make_model(nodes, [("x", F32, ["N", N_IN])], [("y", F32, ["N", N_IN])], {"W1": w1, "W2": w2})
    assert select_parameters(model, ["W1"]).trainable == ["W1"]
    fb = onnxgrad.ForwardBackward(model, trainable=["W1"])
    assert list(fb.parameters) == ["W1"] and fb.parameters["W1"].shape == (N_IN, N_OUT)
    trainer = Trainer(model, loss="mse", trainable=["W1"], progress=False)
    assert list(trainer.parameters) == ["W1"]


def test_float16_model_trains_every_element():
    w = (0.05 * RNG.standard_normal((N_IN, N_OUT))).astype(np.float16)
    model = linear(w, dtype=np.float16)
    selection = select_parameters(model)
    assert selection.ties == [] and selection.trainable == ["W", "b"]
    fb = onnxgrad.ForwardBackward(model)
    assert fb.parameters["W"].size == 65536 and fb.parameters["W"].dtype == np.float16


# ---- what the graph says is a table ----------------------------------------------------------------
def attention(bias: np.ndarray) -> onnx.ModelProto:
    """Softmax(s + bias): ``bias`` added to attention scores ``s``, as a relative-position bias is."""
    nodes = [
        helper.make_node("Add", ["s", "bias"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["y"]),
    ]
    shape = [2, *bias.shape[1:]]
    return make_model(nodes, [("s", F32, shape)], [("y", F32, shape)], {"bias": bias})


def swin_bias(table: np.ndarray, window: int = 4) -> np.ndarray:
    """``table[index]`` over ``window x window`` positions as (1, heads, w*w, w*w): Swin's bias."""
    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + window - 1
    index = rel[0] * (2 * window - 1) + rel[1]
    return np.ascontiguousarray(table[index].transpose(2, 0, 1)[None])


def test_bf16_relative_position_table_is_still_one_table_per_head():
    # a bf16 table whose entries 0 and 1 are equal in head 0 only: still 49 entries per head (an
    # entry is a class of positions in one head, not a value)
    table = through_bf16(RNG.standard_normal((49, 2)).astype(F32))
    table[1, 0] = table[0, 0]
    model = attention(swin_bias(table))
    (tie,) = select_parameters(model).ties
    assert (tie.name, tie.how) == ("bias", "gather of 98 entries over [1, 2, 16, 16]")
    fb = onnxgrad.ForwardBackward(model)
    core = fb.parameters["bias_core"]
    assert sorted(core.tolist()) == sorted(table.ravel().tolist())


def test_rounded_learned_attention_bias_is_no_table():
    # a learned full attention bias (heads, q, k), rounded through bf16: its values repeat in each
    # head, but at positions no index shares across heads; read as a score bias all the same
    bias = through_bf16((0.02 * RNG.standard_normal((1, 4, 64, 64))).astype(F32))
    _, counts = np.unique(bias, return_counts=True)
    assert counts.size * 4 <= bias.size
    model = attention(bias)
    assert score_biases(model) == {"bias"}
    assert select_parameters(model).ties == []


def test_a_table_only_where_the_graph_reads_a_score_bias():
    copy = swin_bias(RNG.standard_normal((49, 2)).astype(F32))
    assert gather_index(copy) is not None  # the values are a table...
    nodes = [helper.make_node("Mul", ["s", "bias"], ["y"])]  # ... read as a weight: no table
    model = make_model(nodes, [("s", F32, list(copy.shape))], [("y", F32, list(copy.shape))], {"bias": copy})
    assert score_biases(model) == set()
    assert select_parameters(model).ties == []


@pytest.mark.parametrize("shape", [(64,), (1, 64), (64, 1), (1, 1, 64), (64, 1, 1)])
def test_vectors_and_single_rows_or_columns_with_repeats_are_no_table(shape):
    # issue 39, planted bug 3: 1-D, (1, k) and (k, 1) initializers with repeats: no relative-position
    # table, no IndexError, whether read as a weight or added to scores
    values = RNG.standard_normal(16).astype(F32)[RNG.integers(0, 16, 64)].reshape(shape)
    assert not _relative_positions(values)
    assert gather_index(values) is None
    weight = make_model([helper.make_node("Add", ["x", "b"], ["y"])], [("x", F32, list(shape))],
                        [("y", F32, list(shape))], {"b": values})  # fmt: skip
    nodes = [helper.make_node("Add", ["x", "b"], ["s"]), helper.make_node("Softmax", ["s"], ["y"])]
    scores = make_model(nodes, [("x", F32, list(shape))], [("y", F32, list(shape))], {"b": values})
    for model in (weight, scores):
        selection = select_parameters(model)
        assert selection.ties == [] and selection.trainable == ["b"]
        fb = onnxgrad.ForwardBackward(model)
        assert fb.parameters["b"].shape == shape
