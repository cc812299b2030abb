"""The same numbers everywhere: 200 steps of the digits MLP and of a LeNet-style CNN from the same
start give the same losses in onnxgrad.artifacts.Runner and in onnxgrad.train.Trainer (both of its
step paths). Node and the browser are checked against the same Runner losses in test_js.py and
test_web.py (js/test/make_fixture.py writes both models)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from onnxgrad.artifacts import Runner, generate
from onnxgrad.train import Callback, Trainer

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "js" / "test"))
import make_fixture

RTOL = 1e-4


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_batch_end(self, trainer, step, logs):
        self.losses.append(logs["loss"])


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_runner_and_trainer_give_the_same_200_losses(kind, tmp_path):
    data = make_fixture.digits(kind)
    steps, lr = make_fixture.STEPS, make_fixture.LR
    generate(make_fixture.model_of(kind), loss="cross_entropy", optimizer="adamw", lr=lr, out_dir=tmp_path)
    runner = Runner(tmp_path, threads=1)
    expected = [runner.step(make_fixture.batch_at(data, k)) for k in range(steps)]
    assert expected[-1] < 0.5 * expected[0]
    # the Runner's batches one after the other, as one epoch without shuffling
    batches = [make_fixture.batch_at(data, k) for k in range(steps)]
    epoch = {name: np.concatenate([b[name] for b in batches]) for name in data}
    for one_graph in (True, False):
        record = _Record()
        trainer = Trainer(
            make_fixture.model_of(kind), loss="cross_entropy", optimizer="adamw", lr=lr,
            batch_size=make_fixture.BATCH, shuffle=False, progress=False, callbacks=[record],
            one_graph=one_graph,
        )  # fmt: skip
        assert trainer.step_path == ("one graph" if one_graph else "two sessions")
        trainer.fit(epoch, epochs=1)
        np.testing.assert_allclose(record.losses, expected, rtol=RTOL, atol=1e-6, err_msg=trainer.step_path)
        for name, p in runner.parameters.items():
            np.testing.assert_allclose(trainer.parameters[name], p, rtol=1e-3, atol=1e-5, err_msg=name)
