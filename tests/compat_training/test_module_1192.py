"""``api.Module`` as 1.19.2 behaves: ``OrtValue`` inputs give ``OrtValue`` outputs, and a nominal
checkpoint (names and shapes, no values) refuses every step until its values are copied in, with
1.19.2's ``RuntimeError`` messages, where onnxgrad used to train on zeros."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest

import onnxgrad.compat.training as og
from onnxgrad.errors import InputError, OnnxGradRuntimeError

from . import scenarios


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """The MLP with cross entropy and AdamW, and its nominal checkpoint."""
    work = str(tmp_path_factory.mktemp("nominal"))
    scenarios._generate(
        og, work, scenarios.mlp(), og.artifacts.LossType.CrossEntropyLoss, nominal_checkpoint=True
    )
    return work


def module_of(folder: str, checkpoint: str = "checkpoint") -> og.api.Module:
    state = og.api.CheckpointState.load_checkpoint(os.path.join(folder, checkpoint))
    return og.api.Module(
        os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx")
    )


def test_ortvalue_inputs_give_ortvalue_outputs(folder):
    x, y = scenarios.data("classes", n=8)
    for training in (True, False):
        arrays, values = module_of(folder).train(training), module_of(folder).train(training)
        expected = arrays(x, y)
        assert isinstance(expected, np.ndarray)
        got = values(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y))
        assert isinstance(got, ort.OrtValue)
        assert got.shape() == [] and got.data_type() == "tensor(float)"
        np.testing.assert_array_equal(got.numpy(), expected)
        # one numpy input among them: numpy outputs (1.19.2's rule)
        mixed = values(x, ort.OrtValue.ortvalue_from_numpy(y))
        assert isinstance(mixed, np.ndarray)
        np.testing.assert_array_equal(mixed, expected)
    # the gradients of an OrtValue training step are those of the numpy one
    arrays, values = module_of(folder), module_of(folder)
    arrays(x, y)
    values(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y))
    for name in scenarios.PARAMS:
        np.testing.assert_array_equal(
            arrays._state.parameters[name].grad, values._state.parameters[name].grad
        )


def test_ortvalue_outputs_of_several_losses(tmp_path):
    work = str(tmp_path)
    scenarios._generate(
        og, work, scenarios.mlp(), og.artifacts.LossType.MSELoss, additional_output_names=["logits"]
    )
    module = module_of(work)
    x, y = scenarios.data("floats", n=8)
    loss, logits = module(x, y)
    got = module(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y))
    assert isinstance(got, tuple) and [type(v) for v in got] == [ort.OrtValue, ort.OrtValue]
    assert got[1].shape() == [8, 3]
    np.testing.assert_array_equal(got[0].numpy(), loss)
    np.testing.assert_array_equal(got[1].numpy(), logits)


LOAD_FIRST = "Please load the model parameters first."


def test_nominal_checkpoint_refuses_to_run_until_filled(folder):
    nominal = og.api.CheckpointState.load_checkpoint(os.path.join(folder, "nominal_checkpoint"))
    module = og.api.Module(
        os.path.join(folder, "training_model.onnx"), nominal, os.path.join(folder, "eval_model.onnx")
    )
    optimizer = og.api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    x, y = scenarios.data("classes", n=8)
    # names and sizes are known; values are not
    assert all(name in nominal.parameters for name in scenarios.PARAMS)
    assert len(nominal.parameters) == 4
    assert module.get_parameters_size() == 4 * 8 + 8 + 8 * 3 + 3
    with pytest.raises(
        RuntimeError,
        match=r"^Cannot get parameter from a nominal state\. Please load the parameter states first$",
    ):
        nominal.parameters["fc1.weight"]
    with pytest.raises(OnnxGradRuntimeError, match="Please load the parameter states first"):
        list(nominal.parameters)
    with pytest.raises(
        OnnxGradRuntimeError,
        match=r"^Cannot copy parameter to a nominal state\. Please load all the parameter states first$",
    ):
        nominal.parameters["fc1.weight"] = np.ones((4, 8), np.float32)
    refusals = {
        "Cannot copy parameters from a nominal checkpoint state": module.get_contiguous_parameters,
        "Cannot perform TrainStep with a nominal state": lambda: module.train()(x, y),
        "Cannot perform EvalStep with a nominal state": lambda: module.eval()(x, y),
        "Cannot fetch named parameters from a nominal checkpoint state": optimizer.step,
        "Cannot export the model with a nominal state": lambda: module.export_model_for_inferencing(
            os.path.join(folder, "never.onnx"), ["logits"]
        ),
    }
    for what, call in refusals.items():
        with pytest.raises(OnnxGradRuntimeError) as caught:
            call()
        assert str(caught.value) == f"{what}. {LOAD_FIRST}"
        assert isinstance(caught.value, RuntimeError)  # 1.19.2 raised RuntimeError
    assert not os.path.exists(os.path.join(folder, "never.onnx"))
    assert optimizer._group.step == 0  # nothing happened

    full = module_of(folder)
    buffer = full.get_contiguous_parameters()
    with pytest.raises(
        OnnxGradRuntimeError,
        match=r"all parameters need to be loaded into the model \(trainable_only = false\)",
    ):
        module.copy_buffer_to_parameters(buffer, trainable_only=True)
    module.copy_buffer_to_parameters(buffer, trainable_only=False)
    # filled: it trains exactly as the complete checkpoint does
    full_optimizer = og.api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), full)
    for m in (module, full):
        m.train()
    np.testing.assert_array_equal(module(x, y), full(x, y))
    optimizer.step()
    full_optimizer.step()
    np.testing.assert_array_equal(
        module.get_contiguous_parameters().numpy(), full.get_contiguous_parameters().numpy()
    )
    np.testing.assert_array_equal(
        nominal.parameters["fc2.bias"].data, full._state.parameters["fc2.bias"].data
    )


def test_an_ort_format_file_is_not_a_module_file(tmp_path):
    work = str(tmp_path)
    scenarios._generate(og, work, scenarios.mlp(), og.artifacts.LossType.MSELoss, ort_format=True)
    state = og.api.CheckpointState.load_checkpoint(os.path.join(work, "checkpoint"))
    with pytest.raises(InputError, match=r"is in the ORT format.*pass the \.onnx file"):
        og.api.Module(os.path.join(work, "training_model.ort"), state)


def test_returned_ortvalues_own_their_memory(folder):
    """``.numpy()`` of an OrtValue that is dropped at once (``m.get_contiguous_parameters().numpy()``)
    stays the parameters: it once viewed a freed temporary array and read garbage."""
    module = module_of(folder, "checkpoint")
    expected = np.concatenate(
        [module._state._values()[n].astype(np.float32).ravel() for n in module._buffer_names(False)]
    )
    x, y = scenarios.data("classes", n=8)
    loss = module(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y)).numpy()
    want_loss = float(module(x, y))
    for _ in range(20):
        view = module.get_contiguous_parameters().numpy()
        loss = module(ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(y)).numpy()
        _ = [np.full(expected.size, 7.0, np.float32) for _ in range(4)]  # reuse the freed memory
        np.testing.assert_array_equal(view, expected)
        assert float(loss) == want_loss
