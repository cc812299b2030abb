"""Fixtures of tests/federated: Flower's SuperLink and SuperNodes on loopback, ended after the tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="the federated extra (flwr) is not installed")

from .cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One SuperLink and two SuperNodes for the tests of a module."""
    c = Cluster(tmp_path_factory.mktemp("flower"), nodes=2)
    try:
        yield c
    finally:
        c.close()


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
