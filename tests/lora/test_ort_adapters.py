"""Adapters in onnxruntime's own format: two fine-tunes of one (4-bit or float) base, written as
``.onnx_adapter`` files, served by one InferenceSession through onnxruntime.LoraAdapter and
RunOptions.add_active_adapter, against the merged models and the base."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import lora
from onnxgrad.errors import InputError
from onnxgrad.testing import assert_allclose_scaled

from .quantized_models import IN, OUT, float_mlp, quantized

ort = pytest.importorskip("onnxruntime")
F32 = np.float32


def _fine_tune(adapted: onnx.ModelProto, target_fn, seed: int) -> dict[str, np.ndarray]:
    """The adapters after 20 SGD steps of an MSE loss towards ``target_fn(x)``."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((32, IN)).astype(F32)
    target = target_fn(x).astype(F32)
    fb = onnxgrad.ForwardBackward(adapted, session_options=lora.session_options())
    first = last = None
    for _ in range(20):
        res = fb.forward({"x": x})
        err = res.outputs[0] - target
        last = float((err**2).mean())
        first = last if first is None else first
        grads = res.backward([(2.0 / err.size) * err])
        fb.set_parameters({n: fb.parameters[n] - 0.02 * g for n, g in grads.items()})
    assert last < first  # it trained
    return dict(fb.parameters)


@pytest.mark.parametrize("base_kind", ["int4_nbits", "float"])
def test_one_session_serves_two_fine_tunes(base_kind: str, tmp_path: Path) -> None:
    base = float_mlp() if base_kind == "float" else quantized(base_kind, tmp_path)
    adapted = lora.add_adapters(base, ["W1", "W2"], rank=4)
    tasks = {
        "sin": _fine_tune(adapted, lambda x: np.sin(3 * x[:, :OUT]), 1),
        "abs": _fine_tune(adapted, lambda x: np.abs(x[:, OUT : 2 * OUT]), 2),
    }
    serving = lora.serving_model(adapted)
    names = set(lora.adapter_names(adapted))
    assert names <= {i.name for i in serving.graph.input}  # overridable: inputs with defaults
    options = lora.session_options()
    session = ort.InferenceSession(serving.SerializeToString(), options, ["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(3).standard_normal((8, IN)).astype(F32)}
    outputs = {}
    for task, values in tasks.items():
        path = tmp_path / f"{task}.onnx_adapter"
        lora.save_ort_adapter(adapted, path, values)
        read = lora.read_ort_adapter(path)
        assert sorted(read) == sorted(names)
        for n in names:
            np.testing.assert_array_equal(read[n], values[n])
        adapter = ort.LoraAdapter()
        adapter.Load(str(path))
        run_options = ort.RunOptions()
        run_options.add_active_adapter(adapter)
        outputs[task] = session.run(None, feeds, run_options)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the quantized base merges to float weights, with a warning
            merged = lora.merge(lora.with_values(adapted, values))
        want = ort.InferenceSession(merged.SerializeToString(), options, ["CPUExecutionProvider"])
        assert_allclose_scaled(outputs[task], want.run(None, feeds)[0], rtol=1e-5, err_msg=task)
    assert np.abs(outputs["sin"] - outputs["abs"]).max() > 1e-2 * np.abs(outputs["sin"]).max()
    base_session = ort.InferenceSession(base.SerializeToString(), options, ["CPUExecutionProvider"])
    no_adapter = session.run(None, feeds)[0]
    np.testing.assert_array_equal(no_adapter, base_session.run(None, feeds)[0])


def test_adapter_file_errors(tmp_path: Path) -> None:
    adapted = lora.add_adapters(float_mlp(), ["W1"], rank=2)
    with pytest.raises(
        InputError, match=r"adapter 'W1.lora_B' must be float32 of shape \[2, 64\], got float32 \[3, 64\]"
    ):
        lora.save_ort_adapter(adapted, tmp_path / "bad.onnx_adapter", {"W1.lora_B": np.zeros((3, 64), F32)})
    not_adapter = tmp_path / "model.onnx_adapter"
    not_adapter.write_bytes(b"not an adapter at all")
    with pytest.raises(InputError, match=r"is not an onnxruntime adapter file"):
        lora.read_ort_adapter(not_adapter)
    with pytest.raises(InputError, match=r"no adapter file"):
        lora.read_ort_adapter(tmp_path / "missing.onnx_adapter")
    with pytest.raises(InputError, match=r"the model has no LoRA adapters"):
        lora.serving_model(float_mlp())


def test_head_trained_model_is_refused(tmp_path: Path) -> None:
    """A model whose to_onnx names a trained head (W2 beside W1's adapters) cannot become an
    onnxruntime adapter file: the head would be lost, as with values= holding it."""
    adapted = lora.add_adapters(float_mlp(), ["W1"], rank=2)
    fb = onnxgrad.ForwardBackward(adapted, trainable=[*lora.adapter_names(adapted), "W2"])
    x = np.random.default_rng(0).standard_normal((4, IN)).astype(F32)
    grads = fb.forward({"x": x}).backward([np.ones((4, OUT), F32)])
    fb.set_parameters({n: v - 0.1 * grads[n] for n, v in fb.parameters.items()})
    with pytest.raises(InputError, match=r"says weights that are not adapters trained: \['W2'\]; an onnx"):
        lora.save_ort_adapter(fb.to_onnx(), tmp_path / "head.onnx_adapter")
    with pytest.raises(InputError, match=r"differ from the model's: \['W2'\]; an onnxruntime adapter file"):
        lora.save_ort_adapter(adapted, tmp_path / "head.onnx_adapter", fb.parameters)
    lora.save_ort_adapter(adapted, tmp_path / "ok.onnx_adapter")  # adapters only: fine
