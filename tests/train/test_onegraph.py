"""Trainer's one-graph step (onnxgrad.train.onegraph): taken where the model allows, the same
parameters, optimizer state and losses as forward + backward + the numpy optimizer; the
two-session path otherwise, with a debug log saying why."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxgrad.demo import build_cnn, build_mlp
from onnxgrad.errors import OnnxGradRuntimeError
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import Adam, Callback, Cosine, Trainer

RNG = np.random.default_rng(0)
X = RNG.random((96, 12), dtype=np.float32)
Y = RNG.integers(0, 5, 96)

CASES = [
    ("adamw", {"weight_decay": 0.05}, 1e-2),
    ("adam", {"weight_decay": 1e-3, "betas": (0.8, 0.99)}, Cosine(1e-2, total_steps=24)),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}, 0.05),
    ("sgd", {"momentum": 0.5, "dampening": 0.1}, 0.05),
    ("sgd", {}, 0.1),
]


def _trainer(one_graph: bool, optimizer="adamw", options=None, lr=1e-2, model=None, **kw) -> Trainer:
    model = model if model is not None else build_mlp((12, 16, 5), np.random.default_rng(1))
    return Trainer(
        model, loss="cross_entropy", optimizer=optimizer, lr=lr, optimizer_options=options,
        batch_size=16, seed=3, progress=False, one_graph=one_graph, **kw,
    )  # fmt: skip


def _losses(trainer: Trainer) -> list[float]:
    losses: list[float] = []
    trainer.callbacks.append(_Record(losses))
    return losses


class _Record(Callback):
    def __init__(self, out: list[float]) -> None:
        self.out = out

    def on_batch_end(self, trainer, step, logs):
        self.out.append(logs["loss"])


@pytest.mark.parametrize(("optimizer", "options", "lr"), CASES)
def test_one_graph_matches_two_sessions(optimizer, options, lr):
    one, two = _trainer(True, optimizer, options, lr), _trainer(False, optimizer, options, lr)
    assert one.step_path == "one graph" and two.step_path == "two sessions"
    params_before = one.parameters  # the live buffers stay the same arrays
    l1, l2 = _losses(one), _losses(two)
    one.fit({"pixels": X, "target": Y}, epochs=4)  # 24 steps
    two.fit({"pixels": X, "target": Y}, epochs=4)
    assert_allclose_scaled(l1, l2, rtol=1e-5)
    for name, p in two.parameters.items():
        assert one.parameters[name] is params_before[name]
        assert_allclose_scaled(one.parameters[name], p, rtol=1e-5, err_msg=name)
    s1, s2 = one.optimizer.state_dict(), two.optimizer.state_dict()
    assert s1["iterations"] == s2["iterations"] == 24
    for name, state in s2["state"].items():
        assert set(s1["state"][name]) == set(state)
        for key, value in state.items():
            assert_allclose_scaled(s1["state"][name][key], value, rtol=1e-5)
    assert one.history["lr"] == two.history["lr"]


def test_checkpoint_of_one_path_resumes_in_the_other(tmp_path):
    data = {"pixels": X, "target": Y}
    full = _trainer(True)
    full.fit(data, epochs=4)
    first = _trainer(True)
    first.fit(data, epochs=2, checkpoint=tmp_path / "ck.npz")
    second = _trainer(False)
    second.fit(data, epochs=4, resume=tmp_path / "ck.npz")
    for name, p in full.parameters.items():
        assert_allclose_scaled(second.parameters[name], p, rtol=1e-5)


def test_cnn_takes_the_one_graph_path():
    rng = np.random.default_rng(1)  # its own generator: the same data whichever tests ran before
    x = rng.random((48, 1, 8, 8), dtype=np.float32)
    y = rng.integers(0, 10, 48)
    one = _trainer(True, model=build_cnn(np.random.default_rng(0)))
    two = _trainer(False, model=build_cnn(np.random.default_rng(0)))
    assert one.step_path == "one graph"
    one.fit({"pixels": x, "target": y}, epochs=2)
    two.fit({"pixels": x, "target": y}, epochs=2)
    for name, p in two.parameters.items():
        assert_allclose_scaled(one.parameters[name], p, rtol=1e-4, err_msg=name)


def test_a_non_finite_loss_stops_before_any_update():
    x = X.copy()
    x[20] = np.nan
    trainer = _trainer(True, shuffle=False)
    with pytest.raises(OnnxGradRuntimeError, match="batch 2"):
        trainer.fit({"pixels": x, "target": Y}, epochs=1)
    assert trainer.optimizer.iterations == 1
    after_one = _trainer(True, shuffle=False)
    after_one.fit({"pixels": X[:16], "target": Y[:16]}, epochs=1)
    for name, p in after_one.parameters.items():
        np.testing.assert_array_equal(trainer.parameters[name], p)


def _with_dropout() -> onnx.ModelProto:
    """The MLP with a Dropout after its hidden Relu."""
    model = build_mlp((12, 16, 5), np.random.default_rng(1))
    nodes = []
    for n in model.graph.node:
        nodes.append(n)
        if n.op_type == "Relu":
            out = n.output[0]
            n.output[0] = out + "_pre"
            nodes.append(helper.make_node("Dropout", [out + "_pre"], [out], seed=1))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


class _MyAdam(Adam):
    pass


@pytest.mark.parametrize("case", ["dropout", "optimizer class", "disabled"])
def test_fallback_to_two_sessions_says_why(case, caplog):
    caplog.set_level(logging.DEBUG, logger="onnxgrad.train.onegraph")
    if case == "dropout":
        trainer = _trainer(True, model=_with_dropout())
        assert "Dropout" in caplog.text
    elif case == "optimizer class":
        trainer = _trainer(True, optimizer=_MyAdam)
        assert "_MyAdam" in caplog.text
    else:
        trainer = _trainer(False)
    assert trainer.step_path == "two sessions"
    trainer.fit({"pixels": X, "target": Y}, epochs=1)
    assert np.isfinite(trainer.history["loss"][-1])


def test_sklearn_front_end_takes_the_one_graph_path():
    pytest.importorskip("sklearn")
    from onnxgrad.sklearn import OnnxClassifier

    model = build_mlp((12, 16, 5), np.random.default_rng(1))
    clf = OnnxClassifier(model, epochs=2, batch_size=16, lr=1e-2).fit(X, Y)
    assert clf.trainer_.step_path == "one graph"
    assert clf.score(X, Y) > 0.2


def test_the_command_line_takes_the_one_graph_path(tmp_path, caplog, capsys):
    from onnxgrad.cli import main

    caplog.set_level(logging.DEBUG, logger="onnxgrad.train.onegraph")
    path = tmp_path / "clf.onnx"
    onnx.save(build_mlp((12, 16, 5), np.random.default_rng(1)), path)
    np.savez(tmp_path / "d.npz", pixels=X, label=Y)
    argv = [
        "train",
        str(path),
        "--data",
        str(tmp_path / "d.npz"),
        "--target",
        "label",
        "--loss",
        "cross_entropy",
    ]
    argv += ["--epochs", "2", "--optimizer", "adamw", "-o", str(tmp_path / "out.onnx"), "--no-progress"]
    assert main(argv) == 0
    assert "one-graph training step used: AdamW" in caplog.text
    assert "trained" in capsys.readouterr().out
