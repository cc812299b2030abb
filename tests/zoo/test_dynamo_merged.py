"""Freshly initialised transformers exported by the dynamo exporter with its optimizer on (the
default): it merges the equal zero biases and ones LayerNorm weights of different layers into one
initializer read by every layer (issue 37 §13: logits 0.24 from torch after 10 steps). Its node
metadata says which module reads it, so each module's parameter trains apart, under torch's name,
through ``Trainer`` and ``artifacts.generate`` + ``Runner``; ALBERT's shared layer stays one."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from tests.zoo._util import model_and_inputs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

from onnxgrad.artifacts import Runner, generate  # noqa: E402
from onnxgrad.autodiff.params import select_parameters  # noqa: E402
from onnxgrad.train import Trainer  # noqa: E402

STEPS, LR = 10, 0.05


@pytest.fixture(scope="module", params=["bert_fresh", "albert_fresh"])
def case(request):
    module, inputs = model_and_inputs(request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(copy.deepcopy(module), inputs, dynamo=True, verbose=False).model_proto
    trained = copy.deepcopy(module)
    with torch.no_grad():
        before = module(*inputs)
    target = torch.randn(before.shape, generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(trained(*inputs), target).backward()
        opt.step()
    with torch.no_grad():
        after = trained(*inputs).numpy()
    feeds = {i.name: t.numpy() for i, t in zip(model.graph.input, inputs)}
    return module, model, feeds, target.numpy(), before.numpy(), after


def _close(model, feeds, before, after):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)[0]
    moved = np.abs(after - before).max()
    assert moved > 1e-3
    # float32 noise over 10 SGD steps is ~1e-6 of the outputs; merged parameters moved them by 0.24
    np.testing.assert_allclose(got, after, rtol=0, atol=1e-4 * moved + 1e-5 * np.abs(after).max())


def test_each_parameter_is_one_initializer(case):
    module, model, *_ = case
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file says which modules read each: nothing to warn
        selection = select_parameters(model)
    assert len(selection.trainable) == len(list(module.parameters()))
    names = dict(module.named_parameters())
    assert all(alias in names for alias in selection.aliases)  # torch's names


def test_trainer_follows_torch(case):
    _, model, feeds, target, before, after = case
    trainer = Trainer(model, loss="mse", optimizer="sgd", lr=LR, batch_size=len(target), shuffle=False,
                      progress=False)  # fmt: skip
    trainer.fit({**feeds, "target": target}, epochs=STEPS)
    _close(trainer.to_onnx(), feeds, before, after)


def test_artifacts_runner_follows_torch(case, tmp_path):
    _, model, feeds, target, before, after = case
    generate(model, loss="mse", optimizer="sgd", lr=LR, out_dir=tmp_path, targets=("onnxruntime",))
    runner = Runner(tmp_path)
    for _ in range(STEPS):
        runner.step({**feeds, "target": target})
    _close(runner.to_onnx(), feeds, before, after)
