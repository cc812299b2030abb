"""copy_into_ortvaluevector: new values written into a caller's C++ OrtValueVector, in place."""

from __future__ import annotations

import numpy as np

from onnxgrad.deps import C, ortvalue_from_numpy, ortvalue_to_numpy
from onnxgrad.runtime import ortvaluevector


def _vector(*arrays: np.ndarray) -> C.OrtValueVector:
    vector = C.OrtValueVector()
    for a in arrays:
        vector.push_back(ortvalue_from_numpy(a))
    return vector


def test_values_are_written_into_the_vectors_buffers_by_a_session_of_the_policy(monkeypatch):
    made = []

    def spy(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    real = ortvaluevector.make_session
    monkeypatch.setattr(ortvaluevector, "make_session", spy)
    monkeypatch.setattr(ortvaluevector, "_COPY_SESSIONS", {})
    target = _vector(np.zeros((2, 3), np.float32), np.zeros(4, np.int64))
    new = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7, 8, 9, 10], np.int64)]
    assert ortvaluevector.copy_into_ortvaluevector([ortvalue_from_numpy(a) for a in new], target)
    for i, a in enumerate(new):
        np.testing.assert_array_equal(ortvalue_to_numpy(target[i]), a)
    assert len(made) == 1 and made[0][1] == ["CPUExecutionProvider"]  # through make_session, once

    # another shape or count: nothing written, False
    assert not ortvaluevector.copy_into_ortvaluevector([ortvalue_from_numpy(np.ones(3, np.float32))], target)
    assert not ortvaluevector.copy_into_ortvaluevector(
        [ortvalue_from_numpy(np.ones((3, 2), np.float32)), ortvalue_from_numpy(new[1])], target
    )
    np.testing.assert_array_equal(ortvalue_to_numpy(target[0]), new[0])
