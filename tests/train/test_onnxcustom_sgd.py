"""onnxcustom's SGD pieces in onnxgrad.train: the 'optimal' learning rate (:class:`Optimal`) and
the elastic penalty (:class:`ElasticPenalty`). The expected numbers are computed here with numpy
from the formulas of onnxcustom's ``training/sgd_learning_rate.py`` (``LearningRateSGD``) and
``training/sgd_learning_penalty.py`` / ``utils/onnx_function.py`` (``ElasticLearningPenalty``), and
checked against scikit-learn's own ``SGDRegressor(learning_rate='optimal')``."""

from __future__ import annotations

import functools
import itertools
import math
import pickle
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.errors import InputError
from onnxgrad.model.graph import ir_version_for
from onnxgrad.train import SGD, Adam, ElasticPenalty, Optimal, Trainer


def onnxcustom_optimal_rates(eta0: float, alpha: float, n: int) -> list[float]:
    """``LearningRateSGD(eta0, alpha, learning_rate='optimal').loop(n)``, step by step as written
    there: ``init_learning_rate`` then ``update_learning_rate(i + 1)`` after each value."""
    typw = np.sqrt(1.0 / np.sqrt(alpha))
    heuristic = typw / max(1.0, (1 + typw) * 2)
    optimal_init = 1.0 / (heuristic * alpha)
    optimal_fact = eta0 / (1.0 / (alpha * optimal_init))
    values, value = [], eta0
    for i in range(n):
        values.append(value)
        value = optimal_fact / (alpha * (optimal_init + i + 1))
    return values


@pytest.mark.parametrize(("eta0", "alpha"), [(0.01, 1e-4), (0.1, 1e-2), (0.5, 0.3)])
def test_optimal_reproduces_onnxcustom(eta0, alpha):
    schedule = Optimal(alpha=alpha, eta0=eta0)
    got = [schedule(t) for t in range(50)]
    np.testing.assert_allclose(got, onnxcustom_optimal_rates(eta0, alpha, 50), rtol=1e-12)
    assert got[0] == pytest.approx(eta0) and all(b < a for a, b in itertools.pairwise(got))
    # once per epoch, as onnxcustom's fit changed it: 7 batches per epoch share a rate
    per_epoch = Optimal(alpha=alpha, eta0=eta0, steps_per_epoch=7)
    assert [per_epoch(s) for s in range(7 * 5)] == [got[s // 7] for s in range(7 * 5)]


def test_optimal_without_eta0_is_one_over_alpha_t():
    """eta0=None: 1 / (alpha (t0 + t)), the first value being Bottou's heuristic rate."""
    alpha = 1e-3
    typw = math.sqrt(1 / math.sqrt(alpha))
    eta_b = typw / (2 * (1 + typw))
    schedule = Optimal(alpha=alpha)
    t0 = 1 / (alpha * eta_b)
    assert schedule(0) == pytest.approx(eta_b, rel=1e-12)
    np.testing.assert_allclose([schedule(t) for t in range(10)], [1 / (alpha * (t0 + t)) for t in range(10)])


def test_optimal_with_dloss_1_is_sklearns_sgdregressor():
    """scikit-learn's SGDRegressor(learning_rate='optimal', penalty=None) on one pass, one sample
    per update, is reproduced by a numpy SGD whose rate is Optimal(alpha, dloss=1)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import SGDRegressor

    rng = np.random.default_rng(0)
    X = 0.2 * rng.standard_normal((40, 3))  # small enough for the first rates (about 1) to be stable
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.standard_normal(40)
    alpha = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        sk = SGDRegressor(
            learning_rate="optimal", alpha=alpha, penalty=None, max_iter=1, tol=None, shuffle=False,
            fit_intercept=False, random_state=0,
        ).fit(X, y)  # fmt: skip
    schedule = Optimal(alpha=alpha, dloss=1.0)
    w = np.zeros(3)
    for step, (x, t) in enumerate(zip(X, y)):
        w -= schedule(step) * (x @ w - t) * x  # the gradient of (p - y)² / 2
    np.testing.assert_allclose(w, sk.coef_, rtol=1e-10)
    assert np.abs(w).max() > 0.1  # it moved


def test_optimal_bad_arguments():
    with pytest.raises(InputError, match="alpha must be > 0, got 0"):
        Optimal(alpha=0)
    with pytest.raises(InputError, match="steps_per_epoch must be > 0, got 0"):
        Optimal(steps_per_epoch=0)
    with pytest.raises(InputError, match="eta0 must be >= 0, got -1"):
        Optimal(eta0=-1)


def test_elastic_penalty_step_is_onnxcustoms_update():
    """One step: W <- W (1 - 2 l2) - l1 sign(W) (onnxcustom's update_penalty_elastic_error), then
    the inner optimizer's update with the gradient computed before the shrink."""
    rng = np.random.default_rng(1)
    W = rng.standard_normal((4, 3)).astype(np.float32)
    W[0, 0] = 0.0  # sign(0) = 0: a zero weight stays zero before the gradient step
    b = rng.standard_normal(3).astype(np.float32)
    G = {"W": rng.standard_normal((4, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    l1, l2, lr = 0.01, 0.05, 0.1
    start = {"W": W.copy(), "b": b.copy()}
    expected_penalty = sum(
        l1 * np.abs(v).sum() + l2 * (v.astype(np.float64) ** 2).sum() for v in start.values()
    )
    opt = ElasticPenalty({"W": W, "b": b}, lr=lr, l1=l1, l2=l2)
    assert opt.penalty() == pytest.approx(expected_penalty, rel=1e-6)
    opt.step(G)
    for name, p in (("W", W), ("b", b)):
        w0 = start[name].astype(np.float64)
        expected = w0 * (1 - 2 * l2) - l1 * np.sign(w0) - lr * G[name]
        np.testing.assert_allclose(p, expected, rtol=1e-6, atol=1e-7)
    assert opt.iterations == 1 and opt.lr == lr
    # around Adam: the shrink, then Adam's first step (lr · sign(g) up to eps)
    W2 = start["W"].copy()
    adam = ElasticPenalty({"W": W2}, lr=lr, l1=l1, l2=l2, optimizer=Adam)
    adam.step({"W": G["W"]})
    w0 = start["W"].astype(np.float64)
    np.testing.assert_allclose(
        W2, w0 * (1 - 2 * l2) - l1 * np.sign(w0) - lr * np.sign(G["W"]), rtol=1e-5, atol=1e-6
    )
    assert set(adam.state_dict()["state"]["W"]) == {"step", "exp_avg", "exp_avg_sq"}  # Adam's state


def test_elastic_penalty_defaults_and_bad_arguments():
    p = {"W": np.zeros(3, np.float32)}
    default = ElasticPenalty(p, lr=0.1)  # what onnxcustom's functions applied: 0.01 each
    assert (default.l1, default.l2, type(default.inner)) == (0.01, 0.01, SGD)
    with pytest.raises(InputError, match="l1 must be >= 0, got -1"):
        ElasticPenalty(p, lr=0.1, l1=-1)
    with pytest.raises(InputError, match=r"l2 must be <= 0.5 \(the shrinking factor"):
        ElasticPenalty(p, lr=0.1, l2=0.6)


def linear_model(n_in: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.full((n_in, 1), 0.5, np.float32), "W"),
            numpy_helper.from_array(np.zeros(1, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


def test_elastic_penalty_in_the_trainer_follows_onnxcustoms_loop():
    """Full-batch training of a linear model with the mean squared error: the trainer's weights
    after 15 epochs are those of a numpy loop applying onnxcustom's two updates each step."""
    rng = np.random.default_rng(2)
    X = rng.standard_normal((64, 5)).astype(np.float32)
    y = (X @ np.array([1.0, 0.0, -1.0, 0.0, 2.0]) + 0.3).astype(np.float32).reshape((-1, 1))
    l1, l2, lr = 1e-3, 1e-2, 0.05
    trainer = Trainer(
        linear_model(5), loss="mse", optimizer=ElasticPenalty, lr=lr, optimizer_options={"l1": l1, "l2": l2},
        batch_size=64, shuffle=False, progress=False,
    )  # fmt: skip
    trainer.fit({"X": X, "target": y}, epochs=15)
    W, b = np.full((5, 1), 0.5), np.zeros(1)
    for _ in range(15):
        g = 2 * ((X @ W + b) - y) / len(X)  # d mean((p - y)²) / dp
        gW, gb = X.T @ g, g.sum(axis=0)
        W = W * (1 - 2 * l2) - l1 * np.sign(W) - lr * gW
        b = b * (1 - 2 * l2) - l1 * np.sign(b) - lr * gb
    np.testing.assert_allclose(trainer.parameters["W"], W, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trainer.parameters["b"], b, rtol=1e-4, atol=1e-5)
    losses = trainer.history["loss"]
    assert losses[-1] < losses[0] / 2
    assert trainer.step_path == "two sessions"  # the wrapper's step runs in numpy


def test_elastic_penalty_in_the_sklearn_estimator():
    """A factory (functools.partial, which pickles and clones) as OnnxRegressor's optimizer: the
    penalty pulls the weights towards zero, those of the noise features most."""
    pytest.importorskip("sklearn")
    from sklearn.base import clone

    from onnxgrad.sklearn import OnnxRegressor

    rng = np.random.default_rng(3)
    X = rng.standard_normal((200, 5))
    y = X @ np.array([2.0, 0.0, 0.0, 0.0, -1.0]) + 0.5 * rng.standard_normal(200)
    penalized = functools.partial(ElasticPenalty, lr=0.05, l1=5e-3, l2=0.0)
    plain = functools.partial(SGD, lr=0.05)
    fits = {}
    for name, factory in (("penalized", penalized), ("plain", plain)):
        reg = OnnxRegressor(linear_model(5), optimizer=factory, epochs=20, batch_size=20, shuffle=False)
        fits[name] = reg.fit(X, y)
    w_pen = onnx.numpy_helper.to_array(fits["penalized"].to_onnx().graph.initializer[0]).ravel()
    w_plain = onnx.numpy_helper.to_array(fits["plain"].to_onnx().graph.initializer[0]).ravel()
    assert np.abs(w_pen[1:4]).sum() < 0.6 * np.abs(w_plain[1:4]).sum()  # noise weights pulled in
    assert np.all(np.abs(w_pen[[0, 4]]) < np.abs(w_plain[[0, 4]]))  # every weight shrunk
    assert fits["penalized"].score(X, y) > 0.9
    twin = pickle.loads(pickle.dumps(clone(fits["penalized"])))
    assert twin.get_params()["optimizer"].keywords == {"lr": 0.05, "l1": 5e-3, "l2": 0.0}
