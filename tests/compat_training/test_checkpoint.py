"""The ``checkpoint`` file both ways with onnxruntime-training 1.19.2, folders it wrote, and the
errors of the compat API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad.compat.training as og
from onnxgrad.compat.training import checkpoint_file
from onnxgrad.errors import InputError, NotFoundError, OnnxGradRuntimeError

from . import scenarios
from .test_scenarios import _bn_eval, close

DATA = Path(__file__).resolve().parents[1] / "data" / "ort_training"
ORT = DATA / "ort1192"


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(DATA / "recorded.json") as f:
        return json.load(f)


def test_1192_folder_keeps_training(recorded):
    """1.19.2's own folder (com.microsoft kernels in training_model.onnx) and its checkpoint saved
    after 5 steps with the optimizer state: onnxgrad trains on with 1.19.2's numbers."""
    model = onnx.load(ORT / "training_model.onnx")
    assert {n.domain for n in model.graph.node} >= {"com.microsoft"}
    ours = scenarios.continue_from(og, str(ORT), str(ORT / "checkpoint_step5"), lr=0.01)
    close(ours["losses"], recorded["resume"]["second"])
    close(ours["params"], recorded["resume"]["params"])
    assert ours["lr_loaded"] == pytest.approx(1e-3)  # the checkpoint's initial learning rate


def test_1192_folder_from_scratch(recorded):
    _state, module, opt = scenarios._session(og, str(ORT))
    x, y = scenarios.data("classes")
    losses = scenarios._train(module, opt, x, y, 0.01)
    close(losses, recorded["adamw_cross_entropy"]["losses"])
    assert module.input_names() == ["input", "labels"]
    assert module.output_names() == ["onnx::loss::2"]  # 1.19.2's name, kept


def test_checkpoint_written_by_onnxgrad_loads_in_1192(tmp_path):
    """tools/record_ort_training.py loaded tests/data/ort_training/ours/checkpoint (written by
    scenarios.write_checkpoint on onnxgrad) in 1.19.2 and trained 10 steps: onnxgrad, from the same
    file, gives the same numbers; and writing it again gives the same content."""
    with open(DATA / "ours_in_ort.json") as f:
        theirs = json.load(f)
    ours = scenarios.continue_from(og, str(ORT), str(DATA / "ours" / "checkpoint"))
    close(ours["losses"], theirs["losses"])
    close(ours["params"], theirs["params"])
    assert (
        ours["properties"] == theirs["properties"] == {"best": 0.25, "epoch": 5, "note": "written elsewhere"}
    )
    close(ours["lr_loaded"], theirs["lr_loaded"])
    again = tmp_path / "checkpoint"
    scenarios.write_checkpoint(og, str(tmp_path / "work"), str(again))
    a, b = checkpoint_file.load(again), checkpoint_file.load(DATA / "ours" / "checkpoint")
    close({**a.trainable}, {**b.trainable}, rtol=1e-5)
    assert (a.properties, a.groups[0].step, a.groups[0].initial_lr) == (
        b.properties,
        5,
        b.groups[0].initial_lr,
    )


def test_checkpoint_round_trip(tmp_path):
    data = checkpoint_file.load(ORT / "checkpoint_step5")
    assert list(data.trainable) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    (group,) = data.groups
    assert (group.name, group.step) == ("group0", 5)
    assert list(group.states["fc1.weight"]) == ["momentum0", "momentum1"]
    data.frozen = {"stat": np.arange(3, dtype=np.int64)}
    data.properties = {"i": -7, "f": 0.5, "s": "é"}
    back = checkpoint_file.loads(checkpoint_file.dumps(data))
    for name, value in {**data.trainable, **data.frozen}.items():
        got = {**back.trainable, **back.frozen}[name]
        assert got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    for p, moments in group.states.items():
        for m, value in moments.items():
            np.testing.assert_array_equal(back.groups[0].states[p][m], value)
    assert back.properties == {"i": -7, "f": 0.5, "s": "é"}
    data.nominal = True
    nominal = checkpoint_file.loads(checkpoint_file.dumps(data))
    assert nominal.nominal and nominal.trainable["fc1.weight"].shape == (4, 8)
    assert len(checkpoint_file.dumps(data)) < len(checkpoint_file.dumps(back))  # no tensor data


def test_bad_checkpoint_files(tmp_path):
    with pytest.raises(InputError, match="no 'ODTC' file identifier"):
        checkpoint_file.loads(b"\x00" * 64)
    raw = (ORT / "checkpoint").read_bytes()
    with pytest.raises(InputError, match="damaged"):
        checkpoint_file.loads(raw[:40])
    with pytest.raises(InputError, match="is a folder"):
        og.api.CheckpointState.load_checkpoint(ORT)
    with pytest.raises(InputError, match="no checkpoint file"):
        og.api.CheckpointState.load_checkpoint(tmp_path / "missing")


def test_generate_refuses_what_cannot_mean_anything(tmp_path):
    model = scenarios.mlp()
    loss = og.artifacts.LossType.MSELoss
    with pytest.raises(InputError, match="custom_op_library is not supported"):
        og.artifacts.generate_artifacts(model, ["fc1.weight"], loss=loss, custom_op_library="lib.so")
    with pytest.raises(InputError, match=r"frozen and require gradient.*fc1\.weight"):
        og.artifacts.generate_artifacts(model, ["fc1.weight"], ["fc1.weight"], loss=loss)
    with pytest.raises(InputError, match=r"requires_grad names \['nope'\]"):
        og.artifacts.generate_artifacts(model, ["nope"], loss=loss, artifact_directory=tmp_path)
    with pytest.raises(InputError, match="loss must be a LossType"):
        og.artifacts.generate_artifacts(model, ["fc1.weight"], loss="mse", artifact_directory=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_api_errors(tmp_path):
    folder = tmp_path / "ort"
    shutil.copytree(ORT, folder)
    state = og.api.CheckpointState.load_checkpoint(folder / "checkpoint")
    with pytest.raises(InputError, match="pass eval_model_uri"):
        og.api.Module(folder / "training_model.onnx", state)
    module = og.api.Module(folder / "training_model.onnx", state, folder / "eval_model.onnx")
    with pytest.raises(InputError, match=r"takes 2 input\(s\) \['input', 'labels'\], got 1"):
        module(np.zeros((2, 4), np.float32))
    with pytest.raises(InputError, match="the buffer has 3 elements, the parameters 67"):
        module.copy_buffer_to_parameters(np.zeros(3, np.float32))
    with pytest.raises(InputError, match="no AdamWOptimizer or SGDOptimizerV2"):
        og.api.Optimizer(folder / "eval_model.onnx", module)
    opt = og.api.Optimizer(folder / "optimizer_model.onnx", module)
    with pytest.raises(InputError, match="larger than total_step_count"):
        og.api.LinearLRScheduler(opt, 10, 3, 0.1)
    with pytest.raises(InputError, match="values are int, float or str"):
        state.properties["bad"] = [1, 2]
    with pytest.raises(NotFoundError, match="Parameter nope not found"):
        state.parameters["nope"]
    with pytest.raises(InputError, match=r"has shape \(3,\), got \(2,\)"):
        state.parameters["fc2.bias"] = np.zeros(2, np.float32)


def test_1192_batchnorm_folder_trains_and_evaluates(recorded):
    """1.19.2's folder of a training-mode BatchNormalization: its eval model did not load in 1.19.2
    (a BatchNormalization with three outputs outside training mode); onnxgrad rebuilds both steps
    from it, trains with 1.19.2's numbers (running statistics included) and evaluates."""
    theirs = recorded["batchnorm"]
    folder = DATA / "ort1192_bn"
    state, module, opt = scenarios._session(og, str(folder))
    x, y = scenarios.data("one")
    close(scenarios._train(module, opt, x, y, 0.01), theirs["losses"])
    close(scenarios._params(state), theirs["params"])
    module.eval()
    loss = float(module(x, y))
    close(loss, _bn_eval(scenarios._params(state), x, y), rtol=1e-5)


def test_onnxblock_errors():
    ob = og.onnxblock
    with pytest.raises(InputError, match=r"call them inside 'with onnxblock\.base"):
        ob.blocks.Add()("a", "b")
    with (
        pytest.raises(InputError, match="custom_op_library is not supported"),
        ob.custom_op_library("lib.so"),
    ):
        pass
    with pytest.raises(InputError, match="Reduction max not supported"):
        ob.loss.MSELoss(reduction="max")

    class Loss(ob.TrainingBlock):
        def build(self, output_name):
            return ob.loss.MSELoss()(output_name)

    with pytest.raises(OnnxGradRuntimeError, match="build the training model first"):  # 1.19.2: RuntimeError
        Loss().parameters()
    model = scenarios.mlp()
    with ob.base(model), pytest.raises(InputError, match="InputLike: the model has no graph input or output"):
        ob.blocks.InputLike("nope")("t")
    with ob.empty_base(), pytest.raises(InputError, match="made an invalid model"):
        ob.blocks.Add()("undefined_a", "undefined_b")
