"""The per-test random data of the gradient-rule tests (random_data.py, seeded in conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.autodiff.random_data import pos, rnd


def test_random_data_depend_only_on_the_test(request: pytest.FixtureRequest) -> None:
    """Each test draws from its own generator: data do not depend on the tests run before."""
    from tests.autodiff.random_data import seeded

    want = seeded(request.node.nodeid)
    np.testing.assert_array_equal(rnd(2, 3), want.standard_normal((2, 3)))
    np.testing.assert_array_equal(pos(4), want.random(4) + 0.5)
