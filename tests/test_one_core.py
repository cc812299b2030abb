"""One core under every front end: each door trains the same parameters and raises the same errors.

``build_gradient``, ``ForwardBackward``, ``OnnxModule``, ``Trainer`` and ``generate``'s step graph
take ``trainable=`` / ``frozen=`` and hand them to one function,
:func:`onnxgrad.autodiff.params.select_parameters`. The models hold what exporters write: an
embedding whose transposed copy is the output head (one parameter stored twice: tied), a zero bias
read a second time through an Identity as another layer's (two parameters stored once: apart), and
a BatchNormalization (running statistics: never trained).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np
import onnx
import pytest

from onnxgrad import ForwardBackward
from onnxgrad.artifacts import Runner, generate
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import InputError
from onnxgrad.model.load import CheckedModel
from onnxgrad.testing import assert_allclose_scaled
from onnxgrad.train import Trainer
from onnxgrad.train.losses import add_loss
from tests.artifacts.test_artifacts import batchnorm_model
from tests.artifacts.test_generate_parameters import VOCAB, aliased_model, tied_model

Names = Iterable[str] | None


# ---- the doors: (model, trainable, frozen) -> the parameters they train ------------------------
def by_build_gradient(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str]) -> list[str]:
    return build_gradient(model, trainable=trainable, frozen=frozen).trainable


def by_forward_backward(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str]) -> list[str]:
    return ForwardBackward(model, trainable=trainable, frozen=frozen).graphs.trainable


def by_onnx_module(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str]) -> list[str]:
    pytest.importorskip("torch")
    from onnxgrad.torch import OnnxModule

    module = OnnxModule(model, trainable=trainable, frozen=frozen)
    return [module.onnx_names[n] for n, _ in module.named_parameters()]


def by_trainer(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str]) -> list[str]:
    trainer = Trainer(model, loss="mse", trainable=trainable, frozen=frozen, progress=False)
    return trainer.fb.graphs.trainable


def by_generate(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str]) -> list[str]:
    art = generate(model, loss="mse", optimizer="sgd", trainable=trainable, frozen=frozen)
    params = [p["name"] for p in art.manifest["parameters"]]
    # the step graph takes exactly those as parameters; every other initializer is a constant in it
    step_inputs = {i.name for i in art.train_step.graph.input}
    assert set(params) <= step_inputs
    # a frozen name is a constant of the step graph, or a running statistic it carries
    kept = {i.name for i in art.train_step.graph.initializer} | {b["name"] for b in art.manifest["buffers"]}
    for name in frozen:
        assert name in kept and name not in params, f"frozen {name!r} is trained by the step graph"
    return params


DOORS: list[Callable[[onnx.ModelProto, Names, Iterable[str]], list[str]]] = [
    by_build_gradient, by_forward_backward, by_onnx_module, by_trainer, by_generate,
]  # fmt: skip

CASES = [
    # (model, trainable, frozen, the parameters every door trains)
    (tied_model, None, (), ["b", "emb"]),
    (tied_model, None, ["head"], ["b"]),  # either copy of a tied parameter freezes it
    (tied_model, None, ["emb"], ["b"]),
    (tied_model, ["emb", "b"], ["b"], ["emb"]),
    (aliased_model, None, (), ["W1", "W2", "b1", "b2"]),
    (aliased_model, None, ["b1"], ["W1", "W2", "b2"]),  # the alias trains apart, and freezes apart
    (aliased_model, ["b2", "W1"], (), ["W1", "b2"]),
    (batchnorm_model, None, (), ["W1", "W2", "b1", "b2", "beta", "gamma"]),
    (batchnorm_model, None, ["gamma", "beta", "mean"], ["W1", "W2", "b1", "b2"]),
]


@pytest.mark.parametrize(("make", "trainable", "frozen", "expected"), CASES)
def test_every_door_trains_the_same_parameters(make, trainable, frozen, expected):
    model = make()
    chosen = {door.__name__: sorted(door(model, trainable, frozen)) for door in DOORS}
    assert chosen == {name: expected for name in chosen}


def _errors(model: onnx.ModelProto, trainable: Names, frozen: Iterable[str], doors=DOORS) -> dict[str, str]:
    """The error each door raises: all must be InputError."""
    found = {}
    for door in doors:
        with pytest.raises(InputError) as info:
            door(model, trainable, frozen)
        found[door.__name__] = f"{type(info.value).__name__}: {info.value}"
    return found


@pytest.mark.parametrize(
    ("make", "trainable", "frozen", "message"),
    [
        (tied_model, None, ["nope"], r"frozen names \['nope'\] are not floating-point initializers of the"),
        (tied_model, ["emb"], ["ids"], r"frozen names \['ids'\] are not floating-point initializers of the"),
        (aliased_model, None, ["W1", "W2", "b1", "b2"], r"^nothing to train: every parameter is frozen$"),
        (tied_model, None, ["head", "b"], r"^nothing to train: every parameter is frozen$"),
    ],
)  # fmt: skip
def test_every_door_raises_the_same_error(make, trainable, frozen, message):
    errors = _errors(make(), trainable, frozen)
    assert len(set(errors.values())) == 1, errors
    with pytest.raises(InputError, match=message):
        by_build_gradient(make(), trainable, frozen)


def test_running_statistics_are_refused_by_every_training_door():
    """Where BatchNormalization follows the training flag (every door but ``build_gradient``, which
    differentiates the file as it is: in inference mode the statistics are read as weights)."""
    errors = _errors(batchnorm_model(), ["W1", "mean"], (), DOORS[1:])
    assert len(set(errors.values())) == 1, errors
    message = next(iter(errors.values()))
    assert message.startswith("InputError: ['mean'] are running statistics"), message
    assert by_build_gradient(batchnorm_model(), ["W1", "mean"], ()) == ["W1", "mean"]


def test_a_door_given_chosen_parameters_refuses_another_choice():
    """Graphs and a ForwardBackward have their parameters: a trainable= or frozen= given with them
    is an error, not ignored."""
    with pytest.raises(InputError, match=r"^trainable= and frozen= need a model: GradientGraphs"):
        ForwardBackward(build_gradient(tied_model()), frozen=["b"])
    fb = ForwardBackward(CheckedModel(add_loss(tied_model(), "mse")), outputs=["loss"])
    with pytest.raises(InputError, match=r"^trainable= and frozen= go to the ForwardBackward given"):
        Trainer(fb, frozen=["b"], progress=False)
    with pytest.raises(InputError, match=r"^nothing to train: the model has no trainable initializer$"):
        inputs_only = ForwardBackward(
            CheckedModel(add_loss(aliased_model(), "mse")), trainable=[], inputs_requiring_grad=["x"]
        )
        Trainer(inputs_only, progress=False)


# ---- training through three doors: the same losses ---------------------------------------------
STEPS, LR = 3, 0.1
# float32 losses of the same computation in another order (one graph against two sessions,
# numpy's update against the step graph's): each of the N * 32 squared errors carries a relative
# error of a few float32 eps, which the mean does not grow; 3 steps of SGD then carry it through
# parameters of norm about 1. 64 eps bounds that with a margin and stays far below what training a
# different set of parameters changes (the first update alone moves the loss by about 1e-2 here).
RTOL = 64 * float(np.finfo(np.float32).eps)


def _batch(make) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    if make is tied_model:
        return {
            "ids": rng.integers(0, VOCAB, 8),
            "target": rng.standard_normal((8, VOCAB)).astype(np.float32),
        }
    if make is aliased_model:
        return {"x": rng.standard_normal((8, 4)).astype(np.float32), "target": np.zeros((8, 4), np.float32)}
    return {
        "pixels": rng.standard_normal((8, 8)).astype(np.float32),
        "target": rng.standard_normal((8, 4)).astype(np.float32),
    }


def sgd_by_forward_backward(model, frozen, batch) -> tuple[list[float], dict[str, np.ndarray]]:
    fb = ForwardBackward(CheckedModel(add_loss(model, "mse")), frozen=frozen, outputs=["loss"])
    losses, at = [], fb.output_names.index("loss")
    for _ in range(STEPS):
        result = fb.forward(batch)
        losses.append(float(result.outputs[at]))
        grads = result.backward({"loss": np.ones_like(result.outputs[at])})
        for name, value in fb.parameters.items():  # the live buffers: plain SGD in numpy
            value -= np.float32(LR) * grads[name]
    return losses, dict(fb.parameters)


def sgd_by_trainer(model, frozen, batch) -> tuple[list[float], dict[str, np.ndarray]]:
    trainer = Trainer(
        model, loss="mse", optimizer="sgd", lr=LR, batch_size=len(batch["target"]), shuffle=False,
        progress=False, frozen=frozen,
    )  # fmt: skip
    trainer.fit(batch, epochs=STEPS)
    return list(trainer.history["loss"]), dict(trainer.parameters)


def sgd_by_generate(model, frozen, batch, tmp_path) -> tuple[list[float], dict[str, np.ndarray]]:
    generate(model, loss="mse", optimizer="sgd", lr=LR, frozen=frozen, out_dir=tmp_path)
    runner = Runner(tmp_path, lr=LR)
    losses = [runner.step(batch) for _ in range(STEPS)]
    return losses, runner.parameters


@pytest.mark.parametrize(
    ("make", "frozen"),
    [(tied_model, ["head"]), (tied_model, ()), (aliased_model, ["b1"]), (batchnorm_model, ["gamma", "W2"])],
)
def test_three_sgd_steps_agree_across_doors(make, frozen, tmp_path):
    model, batch = make(), _batch(make)
    start = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    want_losses, want_params = sgd_by_forward_backward(model, frozen, batch)
    assert want_losses[-1] < want_losses[0]  # it trains
    for losses, params in (
        sgd_by_trainer(model, frozen, batch),
        sgd_by_generate(model, frozen, batch, tmp_path),
    ):
        assert_allclose_scaled(losses, want_losses, rtol=RTOL)
        assert sorted(params) == sorted(want_params)
        for name, value in want_params.items():
            assert_allclose_scaled(params[name], value, rtol=RTOL, err_msg=name)
    for name in frozen:  # frozen: neither trained nor handed out as a parameter
        assert name not in want_params
    for name, value in want_params.items():
        if name in start:
            assert not np.array_equal(value, start[name]), f"{name} did not train"


# ---- the doors above: the command line and the scikit-learn estimators -------------------------
def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def test_command_line_freezes_as_every_door(tmp_path, capsys):
    from onnxgrad.cli import main

    path = tmp_path / "tied.onnx"
    onnx.save(tied_model(), path)
    assert main(["grad", str(path), "-o", str(tmp_path / "g"), "--frozen", "head"]) == 0
    assert "trainable (1): b\n" in capsys.readouterr().out
    np.savez(tmp_path / "d.npz", **_batch(tied_model))
    out = tmp_path / "trained.onnx"
    argv = ["train", str(path), "--data", str(tmp_path / "d.npz"), "--target", "target", "--loss", "mse"]
    argv += ["--epochs", "2", "--optimizer", "sgd", "--lr", "0.1", "-o", str(out), "--no-progress"]
    assert main([*argv, "--frozen", "emb"]) == 0
    before, after = _initializers(tied_model()), _initializers(onnx.load(out))
    np.testing.assert_array_equal(after["emb"], before["emb"])  # both copies of the frozen parameter
    np.testing.assert_array_equal(after["head"], before["head"])
    assert not np.array_equal(after["b"], before["b"])
    capsys.readouterr()
    assert main([*argv, "--frozen", "nope"]) == 2
    assert "error: frozen names ['nope'] are not floating-point initializers" in capsys.readouterr().err


def test_estimators_freeze_as_every_door():
    from onnxgrad.demo import build_mlp
    from onnxgrad.sklearn import OnnxRegressor

    model = build_mlp((8, 16, 1), np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = x[:, 0] - 2 * x[:, 1]
    est = OnnxRegressor(model, frozen=["fc1.weight"], epochs=2, lr=1e-2).fit(x, y)
    assert est.get_params()["frozen"] == ["fc1.weight"]
    assert sorted(est.trainer_.parameters) == sorted(by_build_gradient(model, None, ["fc1.weight"]))
    before, after = _initializers(model), _initializers(est.onnx_model_)
    np.testing.assert_array_equal(after["fc1.weight"], before["fc1.weight"])
    assert not np.array_equal(after["fc2.weight"], before["fc2.weight"])
    with pytest.raises(InputError) as info:
        OnnxRegressor(model, frozen=["nope"], epochs=1).fit(x, y)
    with pytest.raises(InputError, match=re.escape(str(info.value))):
        by_build_gradient(model, None, ["nope"])
