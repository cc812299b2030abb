"""The seed interface's inputs (issue 39): every combination of a value (numpy, the public
``onnxruntime.OrtValue``, the C-level ``OrtValue``) and a container (a list, onnxgrad's
``OrtValueVector`` filled by ``append`` or ``push_back``, onnxruntime's ``C.OrtValueVector``)
either gives the forward's result or an onnxgrad error."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi import _pybind_state as C

from onnxgrad.compat import OrtGradientForwardBackward, OrtValueVector
from onnxgrad.errors import InputTypeError

from .test_onnxcustom_calls import linear  # noqa: F401 - the fixture

VALUES = {
    "numpy": lambda a: a,
    "public": ort.OrtValue.ortvalue_from_numpy,
    "C": lambda a: ort.OrtValue.ortvalue_from_numpy(a)._ortvalue,
}


def _ours(method: str):
    def fill(items):
        vector = OrtValueVector()
        for item in items:
            getattr(vector, method)(item)
        return vector

    return fill


def _onnxruntime(items):
    vector = C.OrtValueVector()
    for item in items:
        vector.push_back(item)  # onnxruntime's own method: it takes C-level OrtValues
    return vector


CONTAINERS = {
    "list": list,
    "ours.append": _ours("append"),
    "ours.push_back": _ours("push_back"),
    "onnxruntime": _onnxruntime,
}
# what onnxgrad cannot take: numpy arrays in a vector of OrtValues (say so, with what to do)
REFUSED = {("numpy", "ours.append"), ("numpy", "ours.push_back")}
# onnxruntime's own push_back takes only its C-level OrtValue (or a DLPack capsule): it raises
# its TypeError in the caller's line, before onnxgrad sees the vector
ONNXRUNTIME_REFUSES = {("numpy", "onnxruntime"), ("public", "onnxruntime")}


@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("kind", list(VALUES))
def test_every_value_in_every_container(linear, kind, container):  # noqa: F811
    fb, X, _, coef, intercept = linear
    fn = fb.new_instance()
    arrays = [X[:4], coef, intercept]
    values = [VALUES[kind](a) for a in arrays]
    if (kind, container) in ONNXRUNTIME_REFUSES:
        with pytest.raises(TypeError):
            CONTAINERS[container](values)
        return
    if (kind, container) in REFUSED:
        with pytest.raises(
            InputTypeError, match=r"wrap an array with onnxruntime\.OrtValue\.ortvalue_from_numpy"
        ):
            CONTAINERS[container](values)
        return
    inputs = CONTAINERS[container](values)
    assert len(inputs) == 3
    (prediction,) = fn.forward(inputs, training=True)
    np.testing.assert_allclose(prediction.numpy(), X[:4] @ coef + intercept, rtol=1e-5, atol=1e-4)
    grads = fn.backward([np.ones((4, 1), np.float32)])
    np.testing.assert_allclose(grads[2].numpy(), [4.0], rtol=1e-6)


def test_push_back_is_seen_from_python_and_from_cpp(linear):  # noqa: F811
    """onnxruntime's push_back on onnxgrad's vector stored the value in the C++ vector only:
    ``forward(vector)`` then said it got 0 values."""
    _, X, _, coef, _ = linear
    vector = OrtValueVector()
    vector.push_back(ort.OrtValue.ortvalue_from_numpy(X[:2]))
    vector.push_back(ort.OrtValue.ortvalue_from_numpy(coef)._ortvalue)
    vector.push_back(None)
    assert len(vector) == 3 and vector[2] is None
    np.testing.assert_array_equal(vector[0].numpy(), X[:2])
    assert C.OrtValueVector.__len__(vector) == 3  # the C++ side holds them too
    assert vector.element_type_at(1) == vector.element_type_at(0)
    capsule = np.arange(3, dtype=np.float32).__dlpack__()  # the capsule keeps its array alive
    vector.push_back(capsule)
    np.testing.assert_array_equal(vector[3].numpy(), [0, 1, 2])
    with pytest.raises(InputTypeError, match="holds OrtValues or DLPack capsules, not str"):
        vector.push_back("x")
    with pytest.raises(InputTypeError, match="push_back_batch is not supported"):
        vector.push_back_batch([])


@pytest.mark.parametrize("odd", ["abc", object()])
def test_values_that_are_not_arrays(linear, odd):  # noqa: F811
    fb, _, _, coef, intercept = linear
    with pytest.raises(
        InputTypeError, match=r"value 0 is a .* inputs and gradients are numeric arrays or OrtValues"
    ):
        fb.new_instance().forward([odd, coef, intercept])


def test_a_vector_built_by_the_class(linear):  # noqa: F811
    fb, X, _, coef, intercept = linear
    assert isinstance(fb, OrtGradientForwardBackward)
    vector = OrtValueVector([ort.OrtValue.ortvalue_from_numpy(a) for a in (X[:3], coef, intercept)])
    (prediction,) = fb.new_instance().forward(vector)
    np.testing.assert_allclose(prediction.numpy(), X[:3] @ coef + intercept, rtol=1e-5, atol=1e-4)
