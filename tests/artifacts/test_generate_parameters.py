"""generate(trainable=, frozen=): the parameters of the step are those every front end trains.

Two small models hold what exporters write: a token embedding whose transposed copy is the output
head (one parameter stored twice, tied), and a zero bias read a second time through an Identity node
as another layer's (two parameters stored once, trained apart). The deprecated ``requires_grad`` still
works, with a DeprecationWarning.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxgrad.artifacts import Runner, generate
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import InputError
from onnxgrad.torch import OnnxModule
from tests.artifacts.test_artifacts import batchnorm_model, small_mlp
from tests.models import make_model

VOCAB, DIM = 32, 16  # 512 values: enough for the tie rules (TIE_MIN_SIZE)


def tied_model() -> onnx.ModelProto:
    """ids -> embedding -> + b -> @ embedding^T (stored as its own initializer, ``head``)."""
    emb = np.random.default_rng(0).standard_normal((VOCAB, DIM)).astype(np.float32)
    inits = {"emb": emb, "b": np.full(DIM, 0.5, np.float32), "head": np.ascontiguousarray(emb.T)}
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"]),
        helper.make_node("Add", ["e", "b"], ["h"]),
        helper.make_node("MatMul", ["h", "head"], ["logits"]),
    ]
    return make_model(nodes, [("ids", np.int64, ["N"])], [("logits", np.float32, ["N", VOCAB])], inits)


def aliased_model() -> onnx.ModelProto:
    """x @ W1 + b1 -> @ W2 + b2, where b2 is stored only as b1, read through an Identity (as the
    TorchScript exporter stores equal zero biases)."""
    rng = np.random.default_rng(1)
    inits = {
        "W1": rng.standard_normal((4, 4)).astype(np.float32),
        "W2": rng.standard_normal((4, 4)).astype(np.float32),
        "b1": np.zeros(4, np.float32),
    }
    nodes = [
        helper.make_node("Identity", ["b1"], ["b2"]),
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["y"]),
    ]
    return make_model(nodes, [("x", np.float32, ["N", 4])], [("y", np.float32, ["N", 4])], inits)


def _params(art) -> list[str]:
    return [p["name"] for p in art.manifest["parameters"]]


def _torch_parameters(model: onnx.ModelProto) -> list[str]:
    module = OnnxModule(model)
    return [module.onnx_names[n] for n, _ in module.named_parameters()]


@pytest.mark.parametrize("make", [tied_model, aliased_model, small_mlp, batchnorm_model])
def test_default_is_what_every_front_end_trains(make):
    model = make()
    art = generate(model, loss="mse", optimizer="sgd")
    assert _params(art) == build_gradient(model).trainable
    assert sorted(_params(art)) == sorted(_torch_parameters(model))


def test_tied_copies_train_as_one_and_freeze_together(tmp_path):
    model = tied_model()
    assert _params(generate(model, loss="mse", optimizer="sgd")) == ["emb", "b"]
    for name in ("emb", "head"):  # either copy names the parameter
        art = generate(model, loss="mse", optimizer="sgd", frozen=[name], out_dir=tmp_path / name)
        assert _params(art) == ["b"]
        # both copies stay constants of the step, with the file's values
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in art.train_step.graph.initializer}
        np.testing.assert_array_equal(inits["head"], inits["emb"].T)
    runner = Runner(tmp_path / "head")
    batch = {"ids": np.arange(4), "target": np.zeros((4, VOCAB), np.float32)}
    before = runner.evaluate(batch)["loss"]
    for _ in range(3):
        runner.step(batch)
    assert runner.evaluate(batch)["loss"] < before


def test_aliases_train_apart_and_freeze_apart():
    model = aliased_model()
    assert _params(generate(model, loss="mse", optimizer="sgd")) == ["W1", "W2", "b1", "b2"]
    art = generate(model, loss="mse", optimizer="sgd", frozen=["b1"])
    assert _params(art) == ["W1", "W2", "b2"]
    art = generate(model, loss="mse", optimizer="sgd", trainable=["b2", "W1"])
    assert _params(art) == ["b2", "W1"]


def test_requires_grad_is_deprecated_but_works():
    model = small_mlp()
    with pytest.warns(DeprecationWarning, match=r"pass trainable= and frozen= by keyword"):
        art = generate(model, ["fc2.weight", "fc2.bias"], ["fc2.bias"], loss="cross_entropy")
    assert _params(art) == ["fc2.weight"]
    with pytest.warns(DeprecationWarning, match=r"generate\(requires_grad=\) is deprecated: pass trainable="):
        art = generate(model, requires_grad=["fc1.weight"], loss="cross_entropy")
    assert _params(art) == ["fc1.weight"]
    with pytest.raises(TypeError, match="trainable= and its deprecated name requires_grad both"):
        generate(model, requires_grad=["fc1.weight"], trainable=["fc1.weight"], loss="cross_entropy")
    with pytest.raises(TypeError, match="takes 1 positional argument but 4 were given"):
        generate(model, ["fc1.weight"], [], [], loss="cross_entropy")


def test_bad_names_are_input_errors():
    model = small_mlp()
    with pytest.raises(InputError, match=r"frozen names \['nope'\] are not floating-point initializers"):
        generate(model, loss="cross_entropy", frozen=["nope"])
    with pytest.raises(InputError, match=r"trainable name 'nope' is not an initializer of the model"):
        generate(model, loss="cross_entropy", trainable=["nope"])
    with pytest.raises(InputError, match="nothing to train: every parameter is frozen"):
        generate(model, loss="cross_entropy", frozen=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
    with pytest.raises(InputError, match=r"\['mean'\] are running statistics"):
        generate(batchnorm_model(), loss="cross_entropy", trainable=["W1", "mean"])


def test_every_one_graph_step_trains_a_tied_model_alike(tmp_path):
    """Trainer's one-graph step (which tied weights used to send to the two-session path), its
    two-session path and the artifacts' runner: the same losses and parameters."""
    from onnxgrad.testing import assert_allclose_scaled
    from onnxgrad.train import Trainer

    rng = np.random.default_rng(0)
    data = {"ids": rng.integers(0, VOCAB, 48), "target": rng.standard_normal((48, VOCAB)).astype(np.float32)}
    results = []
    for one_graph in (True, False):
        trainer = Trainer(
            tied_model(), loss="mse", optimizer="adamw", lr=1e-2, batch_size=16, shuffle=False,
            progress=False, one_graph=one_graph,
        )  # fmt: skip
        assert trainer.step_path == ("one graph" if one_graph else "two sessions")
        trainer.fit(data, epochs=2)
        results.append((trainer.history["loss"], trainer.parameters))
    generate(tied_model(), loss="mse", optimizer="adamw", lr=1e-2, out_dir=tmp_path)
    runner = Runner(tmp_path)
    losses = []
    for _ in range(2):
        steps = [runner.step({k: v[i : i + 16] for k, v in data.items()}) for i in range(0, 48, 16)]
        losses.append(float(np.mean(steps)))
    results.append((losses, runner.parameters))
    want_losses, want_params = results[1]
    assert list(want_params) == ["emb", "b"]
    for losses, params in (results[0], results[2]):
        assert_allclose_scaled(losses, want_losses, rtol=1e-5)
        assert list(params) == list(want_params)
        for name, value in want_params.items():
            assert_allclose_scaled(params[name], value, rtol=1e-5, err_msg=name)


def test_command_line_passes_trainable_and_frozen_by_keyword(tmp_path, capsys):
    import json
    import warnings

    from onnxgrad.cli import main

    path = tmp_path / "tied.onnx"
    onnx.save(tied_model(), path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the command line uses no old spelling
        argv = ["artifacts", str(path), "--loss", "mse", "-o", str(tmp_path / "a")]
        assert main([*argv, "--trainable", "head", "b", "--frozen", "b"]) == 0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert [p["name"] for p in manifest["parameters"]] == ["head"]  # the tie's copy named, trained as one
    assert "parameters (1): head" in capsys.readouterr().out
