"""Fixtures of tests/federated: Flower's SuperLink and SuperNodes on loopback, ended after the tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .cluster import Cluster


@pytest.fixture
def new_cluster(tmp_path: Path) -> Iterator[Callable]:
    """A factory of clusters (nodes, environment of the nodes) for one test, all ended after it."""
    made: list[Cluster] = []

    def make(nodes: int, env: dict[str, str] | None = None) -> Cluster:
        made.append(Cluster(tmp_path / f"flower{len(made)}", nodes=nodes, env=env))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            c.close()
