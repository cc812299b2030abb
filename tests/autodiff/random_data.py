"""Random test data, one generator per test.

Each test gets a fresh generator seeded from its own id (the autouse fixture in ``conftest.py``), so
its data never depend on which tests ran before it, in its file or in another file importing these
helpers (``test_rules_losses.py`` running first used to change the data of the pooling and
normalization tests).
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

_CURRENT = [np.random.default_rng(1234)]


def seeded(key: str) -> np.random.Generator:
    """A fresh generator whose seed depends only on ``key``."""
    return np.random.default_rng(zlib.crc32(key.encode()))


def reseed(key: str) -> None:
    """Make :func:`rng` a fresh generator seeded by ``key`` (done before each test)."""
    _CURRENT[0] = seeded(key)


def rng() -> np.random.Generator:
    """The current test's generator."""
    return _CURRENT[0]


def rnd(*shape: int, dtype: Any = np.float64) -> np.ndarray:
    return rng().standard_normal(shape).astype(dtype)


def pos(*shape: int) -> np.ndarray:
    return rng().random(shape) + 0.5
