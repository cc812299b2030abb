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
from onnxgrad.testing import assert_allclose_scaled
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


def test_compose_keeps_one_node_per_value_when_the_backward_recomputes_a_view():
    """The backward makes Flatten's output again under its forward name rather than saving it;
    compose (and so the step graph) keeps the forward's node alone, and gives the gradients of
    the two-session path."""
    import onnxruntime as ort

    from onnxgrad import ForwardBackward
    from onnxgrad.autodiff.compose import compose
    from onnxgrad.autodiff.engine import build_gradient
    from onnxgrad.train import add_loss

    model = add_loss(make_fixture.model_of("cnn"), "cross_entropy")
    graphs = build_gradient(model, outputs=["loss"])
    recomputed = {o for n in graphs.backward.graph.node for o in n.output} & {
        o for n in graphs.forward.graph.node for o in n.output
    }
    assert recomputed  # the case this test is about (the Flatten of the CNN)
    both = compose(graphs)
    outputs = [o for n in both.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    data = make_fixture.batch_at(make_fixture.digits("cnn"), 0)
    seed = {graphs.grad_inputs["loss"]: np.ones((), np.float32)}
    got = ort.InferenceSession(both.SerializeToString()).run(None, {**data, **seed})
    by_name = dict(zip([o.name for o in both.graph.output], got))
    fb = ForwardBackward(model, outputs=["loss"])
    grads = fb.forward(data).backward({"loss": np.ones((), np.float32)})
    for name, grad in grads.items():
        assert_allclose_scaled(by_name[graphs.grad_outputs[name]], grad, rtol=1e-5)
