"""The parts of onnxgrad.federated that run without a deployment: what travels, the check of a
reply, a node's local training, the refusals."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("flwr", reason="the federated extra (flwr) is not installed")

from onnxgrad.artifacts import generate
from onnxgrad.errors import InputError
from onnxgrad.federated import GlobalModel, Spec, client_app
from onnxgrad.federated.client import _Local, _steps
from onnxgrad.federated.server import check_strategy
from onnxgrad.train import Trainer

from .test_flower import _linear

DATA = {
    "x": np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32),
    "target": np.random.default_rng(1).normal(size=(10, 2)).astype(np.float32),
}


def _local(model, **kw) -> _Local:
    options = {
        "loss": "mse",
        "loss_options": None,
        "optimizer": "sgd",
        "lr": 0.1,
        "optimizer_options": None,
        "local_epochs": 1,
        "local_steps": None,
        "batch_size": None,
        "trainable": None,
        "frozen": (),
        "metrics": None,
        "seed": 0,
    }
    return _Local(model=model, **{**options, **kw})


def test_only_what_trains_travels() -> None:
    """The server's arrays are the trainable parameters; a frozen one stays out, and the node's reply
    holds the arrays it was sent, updated."""
    model = _linear()
    glob = GlobalModel(model, frozen=["b"])
    assert list(glob.initial) == ["W"]
    local = _local(model, frozen=["b"])
    updated, loss, n = local.train(dict(glob.initial), DATA, seed=0)
    assert list(updated) == ["W"] and n == 10
    trainer = Trainer(model, loss="mse", optimizer="sgd", lr=0.1, batch_size=10, frozen=["b"], progress=False)
    trainer.fit(DATA, epochs=1)
    np.testing.assert_allclose(updated["W"], trainer.parameters["W"], rtol=0, atol=1e-6)
    assert loss == pytest.approx(trainer.history["loss"][0])
    written = {t.name: t for t in glob.to_onnx(updated).graph.initializer}
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(written["W"]), updated["W"])


def test_a_node_refuses_arrays_it_does_not_train() -> None:
    local = _local(_linear(), frozen=["b"])
    with pytest.raises(InputError, match=r"the server sent arrays \['W', 'b'\], this node trains \['W'\]"):
        local.train(dict(GlobalModel(_linear()).initial), DATA, seed=0)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda v: {**v, "extra": v["W"]}, r"unknown arrays \['extra'\]"),
        (lambda v: {"W": v["W"]}, r"missing arrays \['b'\]"),
        (lambda v: {**v, "W": v["W"][:2]}, r"array 'W' has shape \[2, 2\], the model's is \[4, 2\]"),
        (
            lambda v: {**v, "b": v["b"].astype(np.float64)},
            r"array 'b' has dtype float64, the model's is float32",
        ),
        (lambda v: {**v, "b": np.full_like(v["b"], np.nan)}, r"array 'b' holds NaN or infinite values"),
    ],
)
def test_a_bad_reply_is_named(change, reason) -> None:
    values = GlobalModel(_linear()).initial
    spec = Spec.of(values)
    assert spec.problem(values) is None
    problem = spec.problem(change(values))
    assert problem is not None
    assert re.fullmatch(reason, problem)


def test_local_steps_make_that_many_batches() -> None:
    """``local_steps=N`` at batch ``b``: N mini-batches of ``b`` (passes after passes), in order."""
    drawn = _steps(DATA, 4, 5, seed=0)
    assert len(drawn["x"]) == 20  # 2 full batches per pass of 10 samples, 3 passes
    local = _local(_linear(), local_steps=5, batch_size=4)
    trainer = local._trainer(4, shuffle=False, seed=0)
    trainer.fit(drawn, epochs=1)
    assert trainer.updates == 5
    # more examples asked per step than the node has: a step is the node's full batch
    local = _local(_linear(), local_steps=3, batch_size=64)
    updated, _, n = local.train(dict(GlobalModel(_linear()).initial), DATA, seed=0)
    assert n == 10
    trainer = Trainer(_linear(), loss="mse", optimizer="sgd", lr=0.1, batch_size=10, progress=False)
    trainer.fit(DATA, epochs=3)  # three full-batch steps
    for name, value in trainer.parameters.items():
        np.testing.assert_allclose(updated[name], value, rtol=0, atol=1e-6)


def test_an_artifacts_folder_has_its_own_loss(tmp_path: Path) -> None:
    generate(_linear(), loss="mse", optimizer="sgd", out_dir=tmp_path / "folder")
    with pytest.raises(InputError, match=r"do not pass \['loss'\]"):
        client_app(tmp_path / "folder", lambda context: DATA, loss="mse")
    with pytest.raises(InputError, match="trainable= and frozen= were chosen when the artifacts folder"):
        GlobalModel(tmp_path / "folder", frozen=["b"])


def test_fedprox_with_a_proximal_term_is_refused() -> None:
    from flwr.serverapp.strategy import FedProx

    with pytest.raises(InputError, match=r"FedProx\(proximal_mu=0.1\) asks the nodes to add a proximal term"):
        check_strategy(FedProx(proximal_mu=0.1))
    check_strategy(FedProx(proximal_mu=0.0))


def test_client_side_privacy_is_refused_server_side_kept() -> None:
    """The client-side wrappers need nodes that clip (Flower's clipping mods), which client_app does
    not: their noise would protect nothing, silently."""
    from flwr.serverapp.strategy import (
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideFixedClipping,
        FedAvg,
    )

    client = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(), noise_multiplier=0.0, clipping_norm=1e-3, num_sampled_clients=2
    )
    with pytest.raises(InputError, match=r"DifferentialPrivacyClientSideFixedClipping relies on the nodes"):
        check_strategy(client)
    server = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(), noise_multiplier=0.0, clipping_norm=1e-3, num_sampled_clients=2
    )
    check_strategy(server)
    check_strategy(FedAvg())


def test_bad_local_settings() -> None:
    with pytest.raises(InputError, match="local_steps must be an integer >= 1 or None, got 0"):
        client_app(_linear(), lambda context: DATA, loss="mse", local_steps=0)
    with pytest.raises(InputError, match="data must be a function context -> arrays"):
        client_app(_linear(), DATA, loss="mse")
