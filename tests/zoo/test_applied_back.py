"""Weights trained from an artifacts folder, applied back to the exported file (issue 37 §3):
``with_parameters(model, runner.parameters)`` is the runner's own trained model, on GPT-2 (its head
a folded transposed copy of the token embedding: the copy follows), on TorchScript's fresh BERT (20
biases and norm weights read through Identity aliases: written apart) and the dynamo exporter's
fresh BERT (merged parameters: written apart)."""

from __future__ import annotations

import warnings

import numpy as np
import onnxruntime as ort
import pytest

from tests.zoo._util import exported, feeds_of, model_and_inputs

pytest.importorskip("torch")
pytest.importorskip("transformers")

from onnxgrad.artifacts import Runner, generate
from onnxgrad.train import with_parameters


def _dynamo_optimized(name: str):
    import torch

    pytest.importorskip("onnxscript")
    module, inputs = model_and_inputs(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, inputs, dynamo=True, verbose=False).model_proto


@pytest.mark.parametrize(
    ("name", "exporter"), [("gpt2", "dynamo"), ("bert_fresh", "torchscript"),
                           ("bert_fresh", "dynamo-optimized")],
)  # fmt: skip
def test_with_parameters_gives_the_runners_model(name, exporter, tmp_path):
    model = _dynamo_optimized(name) if exporter == "dynamo-optimized" else exported(name, exporter)
    _, inputs = model_and_inputs(name)
    feeds = feeds_of(model, inputs)
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    target = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    generate(model, loss="mse", optimizer="sgd", lr=0.5, out_dir=tmp_path, targets=("onnxruntime",))
    runner = Runner(tmp_path)
    for _ in range(3):
        runner.step({**feeds, "target": target})
    applied = with_parameters(model, runner.parameters)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, feeds
        )[0]

    want = run(runner.to_onnx())
    assert np.abs(want - out).max() > 1e-3  # trained
    np.testing.assert_allclose(run(applied), want, rtol=0, atol=1e-5 * np.abs(want).max())
