"""The on-device compat API refuses what 1.19.2 got wrong or crashed on (issues 38 §7, 39):
labels that do not match the batch, duplicate export outputs, checkpoint properties that the
file cannot hold; and its training model keeps the base model's opset, as 1.19.2's did."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad.compat.training as og
from onnxgrad.compat.training.opset import lower_opset
from onnxgrad.errors import InputError

from . import scenarios
from .test_scenarios import close

DATA = Path(__file__).resolve().parents[1] / "data" / "ort_training"


def _opset(path) -> int:
    return next(o.version for o in onnx.load(path).opset_import if o.domain in ("", "ai.onnx"))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cls"))
    scenarios._generate(og, work, scenarios.mlp(), og.artifacts.LossType.CrossEntropyLoss)
    return work


# ---- labels and the batch (38 §7) --------------------------------------------------------------
@pytest.mark.parametrize("labels", [np.array([1]), np.array([1, 1, 1, 1, 1])])
def test_labels_must_match_the_batch(classifier, labels):
    """Labels of shape (1,) for a batch of 4 were broadcast by SoftmaxCrossEntropyLoss: the loss of
    row 0, its gradient 4 times."""
    state, module, _ = scenarios._session(og, classifier)
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    message = (
        rf"inputs 'input' and 'labels' disagree on dimension 'batch': 'input' has 4 .* has {len(labels)}"
    )
    with pytest.raises(InputError, match=message):
        module(x, labels.astype(np.int64))
    assert all(not p.grad.any() for _, p in state.parameters)  # nothing accumulated
    module.eval()
    with pytest.raises(InputError, match=message):
        module(x, labels.astype(np.int64))


def test_labels_of_the_wrong_type_or_rank(classifier):
    _, module, _ = scenarios._session(og, classifier)
    x = np.zeros((4, 4), np.float32)
    # int32 labels are cast, as every door casts them (the input contract); a fraction is refused
    np.testing.assert_array_equal(module(x, np.zeros(4, np.int32)), module(x, np.zeros(4, np.int64)))
    with pytest.raises(
        InputError, match=r"input 'labels' expects integers \(int64\), the data has non-integers"
    ):
        module(x, np.full(4, 0.5, np.float32))
    with pytest.raises(InputError, match=r"input 'labels' has rank 2"):
        module(x, np.zeros((4, 1), np.int64))
    with pytest.raises(InputError, match=r"'input' has 4 .* 'target' has 2|disagree"):
        work = os.path.join(os.path.dirname(classifier), "mse")
        scenarios._generate(og, work, scenarios.mlp(), og.artifacts.LossType.MSELoss)
        _, mse, _ = scenarios._session(og, work)
        mse(x, np.zeros((2, 3), np.float32))


@pytest.mark.parametrize("folder", ["ours", "ort1192"])
def test_class_labels_outside_the_classes_are_refused(classifier, folder):
    """onnxruntime's SoftmaxCrossEntropyLoss read a label -1 as class C - 1 (a silent wrong loss)
    and failed inside GatherElements on a label C: refused as every onnxgrad door refuses them, in
    both modes, for onnxgrad's folders and the rebuilt steps of 1.19.2's."""
    _, module, _ = scenarios._session(og, classifier if folder == "ours" else str(DATA / "ort1192"))
    n_in = next(i for i in module._graph.model.graph.input if i.name == module.input_names()[0])
    x = np.zeros((4, n_in.type.tensor_type.shape.dim[1].dim_value), np.float32)
    classes = module._graph.labels["labels"]["classes"]
    for training in (True, False):
        module.train(training)
        for bad in (-1, classes, -100):
            labels = np.array([0, 1, bad, 0], np.int64)
            with pytest.raises(
                InputError,
                match=rf"input 'labels' holds class {bad} at row 2: class labels must lie in "
                rf"\[0, {classes}\)",
            ):
                module(x, labels)
        assert np.isfinite(module(x, np.array([0, 1, classes - 1, 0], np.int64)))


def test_the_ignore_index_of_the_loss_may_be_fed(tmp_path):
    work = str(tmp_path)
    scenarios._generate(og, work, scenarios.mlp(), og.onnxblock.loss.CrossEntropyLoss(ignore_index=-1))
    _, module, _ = scenarios._session(og, work)
    assert module._graph.labels == {"labels": {"classes": 3, "ignore_index": -1}}
    x = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    ignored = float(module(x, np.array([0, 1, -1, 2], np.int64)))
    np.testing.assert_allclose(ignored, float(module(x[[0, 1, 3]], np.array([0, 1, 2], np.int64))), rtol=1e-6)
    with pytest.raises(
        InputError, match=r"holds class -100 at row 2: .*only ignore_index -1 may lie outside"
    ):
        module(x, np.array([0, 1, -100, 2], np.int64))


# ---- export (39) -------------------------------------------------------------------------------
def test_export_refuses_duplicate_outputs(classifier, tmp_path):
    _, module, _ = scenarios._session(og, classifier)
    with pytest.raises(InputError, match=r"graph_output_names lists \['logits'\] more than once"):
        module.export_model_for_inferencing(str(tmp_path / "inf.onnx"), ["logits", "logits"])
    assert not (tmp_path / "inf.onnx").exists()


# ---- checkpoint properties (38, 39) ------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e300, r"1e\+300 does not fit the checkpoint's float32 properties"),
        (-1e39, r"-1e\+39 does not fit the checkpoint's float32"),
        (2**63, r"9223372036854775808 does not fit the checkpoint's int64 properties"),
        (-(2**63) - 1, r"-9223372036854775809 does not fit"),
    ],
)
def test_properties_the_file_cannot_hold_are_refused_at_assignment(classifier, tmp_path, value, message):
    state, _, _ = scenarios._session(og, classifier)
    state.properties["kept"] = 1
    with pytest.raises(InputError, match=message):
        state.properties["p"] = value
    assert "p" not in state.properties
    og.api.CheckpointState.save_checkpoint(state, str(tmp_path / "c"))  # still saves


@pytest.mark.parametrize("value", [2**63 - 1, -(2**63), 3.4e38, float("inf"), "1e300"])
def test_properties_at_the_limits_round_trip(classifier, tmp_path, value):
    state, _, _ = scenarios._session(og, classifier)
    state.properties["p"] = value
    og.api.CheckpointState.save_checkpoint(state, str(tmp_path / "c"))
    back = og.api.CheckpointState.load_checkpoint(str(tmp_path / "c")).properties["p"]
    assert back == (float(np.float32(value)) if isinstance(value, float) else value)


# ---- the base opset (39) -----------------------------------------------------------------------
@pytest.mark.parametrize("opset", [13, 14, 16])
def test_the_training_model_keeps_the_base_opset(opset, tmp_path):
    """1.19.2 kept the base opset (onnxruntime's test_save_ort_format asserts it); the ORT-format
    file follows, and the numbers are 1.19.2's (recorded at opset 17)."""
    with open(DATA / "recorded.json") as f:
        theirs = json.load(f)["adamw_cross_entropy"]
    work = str(tmp_path / "w")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "written at opset 18"
        scenarios._generate(
            og, work, scenarios.mlp(opset=opset), og.artifacts.LossType.CrossEntropyLoss, ort_format=True
        )
    assert _opset(os.path.join(work, "training_model.onnx")) == opset
    assert _opset(os.path.join(work, "eval_model.onnx")) == opset
    ort.InferenceSession(os.path.join(work, "training_model.ort"))  # the ORT-format file loads
    state, module, opt = scenarios._session(og, work)
    x, y = scenarios.data("classes")
    close(scenarios._train(module, opt, x, y, 0.01), theirs["losses"])
    close(scenarios._params(state), theirs["params"])


def test_the_opset_rises_with_a_warning_when_it_must(tmp_path):
    """GatherElements' gradient is a ScatterElements with reduction="add" (opset 16): an opset-13
    base gets an opset-18 training model, and a warning naming the node."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    idx = numpy_helper.from_array(np.array([[0, 1, 2, 0]], np.int64), "idx")
    graph = helper.make_graph(
        [
            helper.make_node("GatherElements", ["w", "idx"], ["g"], axis=0),
            helper.make_node("Mul", ["x", "g"], ["y"]),
        ],
        "gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [w, idx],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    work = str(tmp_path / "w")
    with pytest.warns(
        UserWarning, match=r"written at opset 18, above the base model's opset 13: the ScatterElements"
    ):
        scenarios._generate(og, work, model, og.artifacts.LossType.MSELoss, requires_grad=["w"])
    assert _opset(os.path.join(work, "training_model.onnx")) == 18


def _model(nodes, inputs, outputs, inits=(), opset=18):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def test_lower_opset_rewrites_reduce_axes_and_shape_slices():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    axes = numpy_helper.from_array(np.array([1, 2], np.int64), "axes")
    model = _model(
        [
            helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=0),
            helper.make_node("Shape", ["x"], ["s"], start=1, end=-1),
            helper.make_node("Shape", ["x"], ["t"], start=-1),
        ],
        [x],
        [
            helper.make_tensor_value_info("m", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("s", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("t", TensorProto.INT64, [1]),
        ],
        [axes],
    )
    lowered = lower_opset(model, 13)
    assert isinstance(lowered, onnx.ModelProto), lowered
    assert lowered.opset_import[0].version == 13
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString()).run(None, feed)
    got = ort.InferenceSession(lowered.SerializeToString()).run(None, feed)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert [list(v) for v in got[1:]] == [[3], [4]]


def test_lower_opset_says_why_it_cannot():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    out = helper.make_tensor_value_info("m", TensorProto.FLOAT, None)
    dynamic = _model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("ReduceMax", ["x", "s"], ["m"]),
        ],
        [x],
        [out],
    )
    assert "axes computed at run time" in lower_opset(dynamic, 17)
    group = _model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("CastLike", ["r", "x"], ["m"])], [x], [out]
    )
    assert "CastLike node 'm' has no definition at opset 14" in lower_opset(group, 14)
    assert "below 13" in lower_opset(group, 12)
    assert lower_opset(group, 18) is group


@pytest.mark.parametrize("lr", [-1.0, float("nan"), float("inf")])
def test_the_optimizer_refuses_a_bad_learning_rate_as_every_door_does(classifier, lr):
    _, _, opt = scenarios._session(og, classifier)
    with pytest.raises(InputError, match=rf"lr must be >= 0, got {lr}: a finite number"):
        opt.set_learning_rate(lr)
    assert opt.get_learning_rate() == pytest.approx(1e-3)
