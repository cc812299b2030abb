"""onnxgrad.sklearn: ONNX models (built by hand or converted from scikit-learn) fitted further as
scikit-learn estimators, on diabetes, digits and iris."""

from __future__ import annotations

import itertools
import pickle
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxgrad.errors import InputError
from onnxgrad.model.graph import ir_version_for

pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")

from sklearn.base import clone
from sklearn.datasets import load_diabetes, load_digits, load_iris
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LinearRegression, LogisticRegression, SGDRegressor
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from onnxgrad.sklearn import OnnxClassifier, OnnxRegressor


def linear_logits(n_in: int, n_out: int) -> onnx.ModelProto:
    """A float32 linear model ``logits = X W + b`` initialised at zero: nothing learnt yet."""
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["X", "W", "b"], ["logits"])],
        "linear",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", n_out])],
        initializer=[
            numpy_helper.from_array(np.zeros((n_in, n_out), np.float32), "W"),
            numpy_helper.from_array(np.zeros(n_out, np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = ir_version_for(model.opset_import)
    return model


@pytest.fixture(scope="module")
def diabetes():
    X, y = load_diabetes(return_X_y=True)
    return train_test_split(X, y, random_state=0)


@pytest.fixture(scope="module")
def sgd_diabetes(diabetes):
    """A barely trained SGDRegressor (5 passes): the starting point to fit further."""
    X_tr, _, y_tr, _ = diabetes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return SGDRegressor(max_iter=5, random_state=0).fit(X_tr, y_tr)


def test_regressor_fits_a_converted_model_further(diabetes, sgd_diabetes):
    X_tr, X_te, y_tr, y_te = diabetes
    reg = OnnxRegressor(sgd_diabetes, lr=1.0, epochs=25, batch_size=32).fit(X_tr, y_tr)
    curve = reg.loss_curve_
    assert len(curve) == reg.n_iter_ == 25 and curve[-1] < curve[0] / 1.5
    reference = LinearRegression().fit(X_tr, y_tr).score(X_te, y_te)
    assert sgd_diabetes.score(X_te, y_te) < reference - 0.2  # the start was far off
    assert reg.score(X_te, y_te) > reference - 0.03
    pred = reg.predict(X_te)
    assert pred.shape == (len(X_te),)
    # the trained ONNX model predicts the same, with a plain onnxruntime session
    sess = ort.InferenceSession(reg.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"X": X_te.astype(np.float32)})[0].ravel(), pred, rtol=1e-6)


def test_warm_start_continues_and_cold_start_restarts(diabetes, sgd_diabetes):
    """warm_start: the second fit starts where the first ended. Without it, from the wrapped model."""
    X_tr, _, y_tr, _ = diabetes
    coef = sgd_diabetes.coef_.copy()
    cold = OnnxRegressor(sgd_diabetes, lr=1.0, epochs=3)
    first = cold.fit(X_tr, y_tr).loss_curve_
    assert cold.fit(X_tr, y_tr).loss_curve_ == first  # restarted: the very same run
    warm = OnnxRegressor(sgd_diabetes, lr=1.0, epochs=3, warm_start=True)
    assert warm.fit(X_tr, y_tr).loss_curve_ == first
    curve = warm.fit(X_tr, y_tr).loss_curve_
    assert warm.n_iter_ == 6 and curve[:3] == first  # the curve goes on, as scikit-learn's does
    second = curve[3:]
    assert second[0] < first[-1] < first[0]  # continued from the end of the first fit
    assert second[-1] < second[0]
    np.testing.assert_array_equal(sgd_diabetes.coef_, coef)  # the wrapped model is left alone


def test_pipeline_and_grid_search_on_iris():
    X, y = load_iris(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, random_state=0, stratify=y)
    pipe = make_pipeline(StandardScaler(), OnnxClassifier(linear_logits(4, 3), epochs=15, batch_size=16))
    search = GridSearchCV(pipe, {"onnxclassifier__lr": [1e-3, 0.1]}, cv=3).fit(X_tr, y_tr)
    assert search.best_params_ == {"onnxclassifier__lr": 0.1}
    reference = make_pipeline(StandardScaler(), LogisticRegression()).fit(X_tr, y_tr).score(X_te, y_te)
    assert search.score(X_te, y_te) >= reference - 0.05
    clf = search.best_estimator_[-1]
    assert clf._output_kind_ == "logits"  # a hand-built logits model: cross-entropy on them
    proba = search.predict_proba(X_te)
    np.testing.assert_allclose(proba.sum(axis=1), 1, rtol=1e-6)
    np.testing.assert_array_equal(search.predict(X_te), clf.classes_[proba.argmax(axis=1)])


@pytest.fixture(scope="module")
def digits():
    X, y = load_digits(return_X_y=True)
    return train_test_split(X / 16, y, random_state=0, stratify=y)


def test_classifier_fits_a_converted_mlp_on_digits(digits):
    """MLPClassifier's ONNX ends in Softmax: the loss is the cross-entropy on the logits before it."""
    X_tr, X_te, y_tr, y_te = digits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        start = MLPClassifier(hidden_layer_sizes=(32,), max_iter=2, random_state=0).fit(X_tr, y_tr)
    clf = OnnxClassifier(start, lr=1e-2, epochs=8, batch_size=64).fit(X_tr, y_tr)
    curve = clf.loss_curve_
    assert all(b < a for a, b in itertools.pairwise(curve[:4])) and curve[-1] < curve[0] / 5
    reference = LogisticRegression(max_iter=500).fit(X_tr, y_tr).score(X_te, y_te)
    assert start.score(X_te, y_te) < 0.6
    assert clf.score(X_te, y_te) >= reference - 0.03
    assert clf._output_kind_ == "probabilities"
    proba = clf.predict_proba(X_te)
    np.testing.assert_allclose(proba.sum(axis=1), 1, rtol=1e-5)
    # the converted model keeps its label output, now from the trained weights
    sess = ort.InferenceSession(clf.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    labels, probabilities = sess.run(["label", "probabilities"], {"X": X_te.astype(np.float32)})
    np.testing.assert_array_equal(labels, clf.predict(X_te))
    np.testing.assert_allclose(probabilities, proba, rtol=1e-6)
    # pickled: predicts the same, and trains on
    restored = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(restored.predict(X_te), clf.predict(X_te))
    assert restored.partial_fit(X_tr, y_tr).n_iter_ == 9


def test_binary_probabilities_without_softmax():
    """skl2onnx's binary LogisticRegression makes probabilities by Sigmoid and a division: the loss
    is then the negative log-likelihood of those probabilities."""
    X, y = load_iris(return_X_y=True)
    y = np.where(y == 2, "virginica", "other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        start = LogisticRegression(max_iter=2).fit(X, y)
    clf = OnnxClassifier(start, lr=0.05, epochs=20, batch_size=16).fit(X, y)
    assert clf._output_kind_ == "probabilities"
    assert list(clf.classes_) == ["other", "virginica"]
    assert clf.loss_curve_[-1] < clf.loss_curve_[0] / 2
    assert clf.score(X, y) > max(start.score(X, y), 0.9)
    assert set(clf.predict(X)) == {"other", "virginica"}


def test_params_clone_and_partial_fit(digits, sgd_diabetes):
    X_tr, _, y_tr, _ = digits
    clf = OnnxClassifier(linear_logits(64, 10), lr=0.05, batch_size=128)
    params = clf.get_params()
    assert params["lr"] == 0.05 and params["warm_start"] is False and params["scores"] == "auto"
    assert clf.set_params(lr=0.1, epochs=2) is clf and clf.lr == 0.1
    for _ in range(2):
        clf.partial_fit(X_tr[:600], y_tr[:600], classes=np.arange(10))
    assert clf.n_iter_ == 2 and clf.trainer_.optimizer.iterations == 10  # one optimizer throughout
    assert clf.loss_curve_[1] < clf.loss_curve_[0]
    twin = clone(clf)
    assert twin.get_params()["lr"] == 0.1 and not hasattr(twin, "onnx_model_")
    # a fitted scikit-learn model given as `model` stays fitted in clones (shared, never changed)
    reg = OnnxRegressor(sgd_diabetes)
    assert clone(reg).model is sgd_diabetes
    with pytest.raises(InputError, match="classes must be passed on the first call"):
        OnnxClassifier(linear_logits(64, 10)).partial_fit(X_tr, y_tr)


def test_sample_weight_zero_drops_samples():
    """Full-batch training: zero weights on a third of the samples equal training on the rest.

    (Not on every other sample: iris then keeps 25 samples of each class, the bias gradient at the
    zero start is exactly 0, and Adam turns the float32 rounding noise of that 0, which depends on
    the order of the sum, into full-size steps.)"""
    X, y = load_iris(return_X_y=True)
    keep = np.arange(len(X)) % 3 != 0
    kwargs = {"lr": 0.1, "epochs": 5, "batch_size": 200, "shuffle": False}
    weighted = OnnxClassifier(linear_logits(4, 3), **kwargs).fit(X, y, sample_weight=keep.astype(float))
    half = OnnxClassifier(linear_logits(4, 3), **kwargs).fit(X[keep], y[keep])
    np.testing.assert_allclose(weighted.loss_curve_, half.loss_curve_, rtol=1e-5)
    np.testing.assert_allclose(weighted.predict_proba(X), half.predict_proba(X), rtol=1e-4, atol=1e-6)


def test_errors():
    X, y = load_iris(return_X_y=True)
    with pytest.raises(InputError, match="no model"):
        OnnxRegressor().fit(X, y)
    with pytest.raises(InputError, match=r"output 'logits' scores 2 classes, y has 3"):
        OnnxClassifier(linear_logits(4, 2)).fit(X, y)
    with pytest.raises(InputError, match="loss must be 'mse', 'l1' or 'huber'"):
        OnnxRegressor(linear_logits(4, 1), loss="hinge").fit(X, y)
    clf = OnnxClassifier(linear_logits(4, 3), epochs=1, warm_start=True).fit(X, y)
    with pytest.raises(InputError, match=r"labels \[7\] not among the classes"):
        clf.fit(X, np.where(y == 2, 7, y))
    with pytest.raises(InputError, match="X has 3 features, the estimator was fitted with 4"):
        clf.predict(X[:, :3])


@pytest.mark.parametrize("estimator", [MLPClassifier(max_iter=30, random_state=0), LogisticRegression()])
def test_to_onnx_labels_are_the_classes_fit_saw(estimator) -> None:
    """A string-class model fitted further on other labels: to_onnx's label output agrees with
    predict (the class table rewritten), or is refused naming both sets when it cannot hold them."""
    r = np.random.default_rng(0)
    X = r.normal(size=(60, 4)).astype(np.float32)
    k = r.integers(0, 3, 60)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        estimator.fit(X, np.array(["cat", "dog", "fish"])[k])
        clf = OnnxClassifier(estimator, max_iter=2).fit(X, np.array(["a", "b", "c"])[k])
    session = ort.InferenceSession(clf.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    labels = session.run(["label"], {session.get_inputs()[0].name: X})[0]
    np.testing.assert_array_equal(labels, clf.predict(X))
    assert set(clf.predict(X)) <= {"a", "b", "c"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf = OnnxClassifier(estimator, max_iter=2).fit(X, k)
    with pytest.raises(InputError, match=r"classes \['cat', 'dog', 'fish'\].*fit saw \[0, 1, 2\]"):
        clf.to_onnx()


def test_to_onnx_refuses_an_argmax_label_output_for_other_classes() -> None:
    """A label output that is the ArgMax index gives 0 .. C-1: fine for those classes, refused
    (naming both) for others."""
    model = linear_logits(4, 3)
    model.graph.node.append(helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("label", onnx.TensorProto.INT64, ["N"]))
    r = np.random.default_rng(0)
    X = r.normal(size=(30, 4)).astype(np.float32)
    k = r.integers(0, 3, 30)
    clf = OnnxClassifier(model, scores="logits", max_iter=2).fit(X, k)
    session = ort.InferenceSession(clf.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(["label"], {"X": X})[0], clf.predict(X))
    clf = OnnxClassifier(model, scores="logits", max_iter=2).fit(X, np.array([3, 5, 7])[k])
    both = r"index of the best class \(0 .. 2\), fit saw the classes \[3, 5, 7\]"
    with pytest.raises(InputError, match=both):
        clf.to_onnx()
