"""The record of a training run: one dict per epoch (``loss``, ``val_loss``, ``lr``, metrics,
seconds), read by key, plotted, and written as CSV or JSON."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InputError, NotFoundError
from .plot import plot_curves

__all__ = ["History", "plain"]


class History:
    """One record (a dict) per epoch; ``history["loss"]`` is the list of one key across epochs."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = ()) -> None:
        self.records: list[dict[str, Any]] = [dict(r) for r in records]

    def append(self, record: Mapping[str, Any]) -> None:
        self.records.append(dict(record))

    def __getitem__(self, key: str) -> list[Any]:
        if not any(key in r for r in self.records):
            raise NotFoundError(f"no {key!r} in the history (keys: {self.keys()})")
        return [r.get(key, math.nan) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[str]:
        return list(dict.fromkeys(k for r in self.records for k in r))

    def to_dict(self) -> dict[str, list[Any]]:
        return {k: self[k] for k in self.keys()}

    def plot(
        self, path: str | os.PathLike, keys: Sequence[str] | None = None, title: str | None = None
    ) -> str:
        """A PNG of the loss curves (default: ``loss`` and ``val_loss``) against the epoch."""
        keys = list(keys) if keys is not None else [k for k in ("loss", "val_loss") if k in self.keys()]
        epochs = self["epoch"] if self.records else []
        return plot_curves({k: self[k] for k in keys}, path, x=epochs, title=title)

    def __repr__(self) -> str:
        last = self.records[-1] if self.records else {}
        return f"History({len(self)} epochs, last={last})"

    def save(self, path: str | os.PathLike) -> str:
        """Write the history, one row per epoch: CSV (``.csv``: a header of every key, empty cells
        where an epoch lacks one) or JSON (``.json``: a list of records); returns the path."""
        path = os.fspath(path)
        kind = os.path.splitext(path)[1].lower()
        if kind not in (".csv", ".json"):
            raise InputError(f"history file {path!r}: expected a .csv or .json file")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", newline="") as f:
            if kind == ".json":
                json.dump([{k: plain(v) for k, v in r.items()} for r in self.records], f, indent=1)
                f.write("\n")
            else:
                writer = csv.DictWriter(f, fieldnames=self.keys())
                writer.writeheader()
                writer.writerows({k: plain(v) for k, v in r.items()} for r in self.records)
        os.replace(tmp, path)
        return path


def plain(value: Any) -> Any:
    """A value as JSON or CSV writes it (numpy scalars as Python numbers, tuples as lists)."""
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value
