"""Shared set-up of the gradient-rule tests."""

from __future__ import annotations

import pytest

from tests.autodiff.random_data import reseed


@pytest.fixture(autouse=True)
def fresh_random_data(request: pytest.FixtureRequest) -> None:
    """:func:`~tests.autodiff.random_data.rnd` and ``pos`` draw from a generator seeded by the
    test's own id: the same data whatever ran before, in any order, with or without xdist."""
    reseed(request.node.nodeid)
