"""onnxgrad.testing.assert_allclose_scaled: the bound scales with the tensor's magnitude."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.testing import assert_allclose_scaled


def test_reordered_float32_sum_passes_where_an_absolute_bound_fails() -> None:
    rng = np.random.default_rng(0)
    terms = (100 * rng.standard_normal((64, 512))).astype(np.float32)
    forward = terms.sum(axis=1)  # pairwise order
    backward = np.zeros(64, np.float32)
    for k in range(terms.shape[1] - 1, -1, -1):  # sequential, reversed order
        backward += terms[:, k]
    assert not np.array_equal(forward, backward)
    with pytest.raises(AssertionError):  # the element-wise absolute bound the tests used to have
        np.testing.assert_allclose(forward, backward, rtol=1e-5, atol=1e-5)
    assert_allclose_scaled(forward, backward, rtol=1e-5)


def test_a_wrong_value_fails_and_names_the_bound() -> None:
    want = np.array([[3.0, -1.0], [0.0, 2.0]], np.float32)
    got = want.copy()
    got[1, 0] = 3e-4  # 1e-4 of the magnitude: far above a reorder's error
    with pytest.raises(AssertionError, match=r"bound 1e-05 x max\|expected\| 3 = 3e-05"):
        assert_allclose_scaled(got, want, rtol=1e-5, err_msg="logits")
    assert_allclose_scaled(got, want, rtol=1e-5, scale=100.0)  # an explicit scale


def test_shapes_zeros_nans_and_torch() -> None:
    with pytest.raises(AssertionError, match="shapes differ: \\(3,\\) against \\(1, 3\\)"):
        assert_allclose_scaled(np.zeros(3), np.zeros((1, 3)))
    with pytest.raises(AssertionError):  # all-zero expected: nothing but zeros passes
        assert_allclose_scaled(np.array([0.0, 1e-30]), np.zeros(2))
    assert_allclose_scaled(np.array([np.nan, 1.0]), np.array([np.nan, 1.0]))
    with pytest.raises(AssertionError):
        assert_allclose_scaled(np.array([np.nan, 1.0]), np.array([1.0, 1.0]))
    torch = pytest.importorskip("torch")
    t = torch.ones(2, requires_grad=True) * 2
    assert_allclose_scaled(t, np.full(2, 2.0))
    with pytest.raises(AssertionError):
        assert_allclose_scaled(t, np.full(2, 2.1))
