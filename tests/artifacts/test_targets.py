"""generate(targets=...): an op a target runtime has no kernel for is named, with the runtime,
before anything is written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgrad.artifacts import generate, targets
from onnxgrad.demo import build_cnn, build_mlp
from onnxgrad.errors import InputError


def _with_image_decoder() -> onnx.ModelProto:
    """The digits MLP with a second output decoded by ImageDecoder (no kernel in onnxruntime 1.30,
    CPU or wasm), off the gradient's path."""
    model = build_mlp((64, 32, 10), np.random.default_rng(0))
    g = model.graph
    g.input.append(helper.make_tensor_value_info("encoded", TensorProto.UINT8, ["B"]))
    g.node.append(helper.make_node("ImageDecoder", ["encoded"], ["image"]))
    g.output.append(helper.make_tensor_value_info("image", TensorProto.UINT8, ["H", "W", 3]))
    del model.opset_import[:]
    model.opset_import.append(helper.make_opsetid("", 20))
    return model


def test_an_op_without_a_kernel_is_named_with_its_runtime(tmp_path):
    out = tmp_path / "artifacts"
    with pytest.raises(
        InputError, match=r"onnxruntime-web has no kernel for ImageDecoder \(in eval_step.onnx\)"
    ):
        generate(_with_image_decoder(), loss="cross_entropy", out_dir=out, loss_options={"output": "logits"})
    assert not out.exists()
    with pytest.raises(InputError, match=r"onnxruntime has no kernel for ImageDecoder"):
        generate(_with_image_decoder(), loss="cross_entropy", targets=["onnxruntime"], out_dir=out,
                 loss_options={"output": "logits"})  # fmt: skip
    assert not out.exists()
    generate(_with_image_decoder(), loss="cross_entropy", targets=(), loss_options={"output": "logits"})


def test_a_gap_of_one_runtime_only(monkeypatch, tmp_path):
    monkeypatch.setitem(targets.MISSING_KERNELS, "onnxruntime-web", {"MaxUnpool": 1})
    out = tmp_path / "cnn"
    with pytest.raises(
        InputError, match=r"onnxruntime-web has no kernel for MaxUnpool \(in train_step.onnx\)"
    ):
        generate(build_cnn(np.random.default_rng(0)), loss="cross_entropy", out_dir=out)
    assert not out.exists()
    generate(build_cnn(np.random.default_rng(0)), loss="cross_entropy", out_dir=out, targets=["onnxruntime"])
    assert (out / "train_step.onnx").exists()


def test_versioned_gaps_and_unknown_targets():
    model = build_mlp((4, 3), np.random.default_rng(0))
    model.graph.node.append(helper.make_node("Bernoulli", ["logits"], ["coin"]))
    assert targets.missing_kernels(model, "onnxruntime-web") == []  # Bernoulli-15 has one
    model.opset_import[0].version = 22
    assert targets.missing_kernels(model, "onnxruntime-web") == ["Bernoulli"]  # Bernoulli-22 not
    with pytest.raises(InputError, match=r"unknown target runtime 'tensorflow\.js'"):
        targets.missing_kernels(model, "tensorflow.js")


def test_default_targets_accept_the_digits_models():
    for model in (build_mlp((64, 32, 10), np.random.default_rng(0)), build_cnn(np.random.default_rng(0))):
        generate(model, loss="cross_entropy")
