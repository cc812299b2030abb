"""Data for training: model inputs checked and cast, mini-batches, splits, CSV and NPZ files.

:func:`as_feeds` turns user arrays into what a model's inputs accept, with errors that name the
input, the expected and the given dtype or shape. :class:`BatchLoader` cuts mini-batches (shuffled
with a seeded generator, optionally dropping the last partial batch). :func:`load_dataset` reads a
``.csv`` or ``.npz`` file into arrays named after the model inputs (the ``onnxgrad train`` command).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..errors import InputError
from ..model.graph import ValueInfo, np_dtype

__all__ = ["BatchLoader", "as_feeds", "check_indices", "index_bounds", "load_dataset", "read_csv", "split"]

Data = Mapping[str, Any]


def _shape_text(shape: Sequence[Any] | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _cast(name: str, arr: np.ndarray, expected: np.dtype) -> np.ndarray:
    # `name` is how errors call the input, e.g. "input 'x'" or "the target 'y' (input 'target')"
    """``arr`` as ``expected``: floats from any number, integers from integral values only."""
    kind = arr.dtype.kind
    if expected.kind == "f" and kind in "fiub":
        return arr.astype(expected, copy=False)
    if expected.kind in "iu" and kind in "iub":
        return arr.astype(expected, copy=False)
    if expected.kind in "iu" and kind == "f":
        integral = np.isfinite(arr) & (arr == np.round(arr))
        if not integral.all():
            bad = arr[~integral].flat[0]
            raise InputError(
                f"{name} expects integers ({expected}), the data has non-integers such as {float(bad):g}"
            )
        return arr.astype(expected)
    if expected.kind == "b" and kind == "b":
        return arr
    raise InputError(f"{name} expects {expected}, the data has dtype {arr.dtype}")


def _fit_shape(name: str, arr: np.ndarray, info: ValueInfo) -> np.ndarray:
    """Check ``arr``'s shape against the input's; a missing trailing size-1 axis is added (a view)."""
    shape = info.shape
    if shape is None:
        return arr
    if arr.ndim + 1 == len(shape) and shape[-1] == 1:  # targets (N,) for an output (N, 1)
        arr = arr.reshape(*arr.shape, 1)
    ok = arr.ndim == len(shape) and all(
        not isinstance(d, int) or d == n for d, n in zip(shape[1:], arr.shape[1:])
    )
    if not ok:
        raise InputError(f"{name} expects shape {_shape_text(shape)}, the data has shape {arr.shape}")
    return arr


def as_feeds(
    data: Data,
    inputs: Mapping[str, ValueInfo],
    *,
    allow_extra: bool = False,
    labels: Mapping[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """``data`` as contiguous arrays of the dtypes and shapes of ``inputs`` (name -> ValueInfo).

    Floats are cast to the input's float type (float64 -> float32 included); integer inputs accept
    integers, or floats holding integral values (class labels read from a CSV file). All arrays must
    share their first dimension (the samples). Raises :class:`InputError` naming the input, or as
    ``labels`` (input name -> description) calls it.
    """
    labels = dict(labels or {})
    missing = [n for n in inputs if n not in data]
    if missing:
        raise InputError(
            f"the data has no array for input(s) {missing} (model inputs: {list(inputs)}; data: {list(data)})"
        )
    extra = [n for n in data if n not in inputs]
    if extra and not allow_extra:
        raise InputError(f"the data has arrays {extra} that are not model inputs ({list(inputs)})")
    feeds = {}
    for name, info in inputs.items():
        arr = np.asarray(data[name])
        label = labels.get(name, f"input {name!r}")
        if arr.ndim == 0:
            raise InputError(f"{label} must have a sample dimension, got a scalar")
        arr = _fit_shape(label, _cast(label, arr, np_dtype(info.dtype)), info)
        feeds[name] = np.ascontiguousarray(arr)
    sizes = {n: a.shape[0] for n, a in feeds.items()}
    if len(set(sizes.values())) > 1:
        raise InputError(f"every array must have the same number of samples (first dimension), got {sizes}")
    return feeds


def index_bounds(model: onnx.ModelProto) -> dict[str, list[tuple[str, int, str]]]:
    """Graph input -> ``(table, rows, node)`` for each Gather that reads it directly as indices
    into an initializer whose size on the gathered axis is known: the bounds a token id must keep,
    ``[-rows, rows)`` as ONNX's Gather takes them. Checked on the data by :func:`check_indices`
    before a run, so that an id beyond the vocabulary is an :class:`InputError`, not an
    onnxruntime failure in the middle of training."""
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    inputs = {i.name for i in model.graph.input} - set(inits)
    bounds: dict[str, list[tuple[str, int, str]]] = {}
    for k, node in enumerate(model.graph.node):
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        table, ids = node.input[0], node.input[1]
        if ids not in inputs or table not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        dims = inits[table]
        if not -len(dims) <= axis < len(dims):
            continue
        bounds.setdefault(ids, []).append((table, int(dims[axis]), node.name or f"#{k}"))
    return bounds


def check_indices(
    data: Mapping[str, np.ndarray], bounds: Mapping[str, list[tuple[str, int, str]]], what: str = "the data"
) -> None:
    """Refuse indices outside ``[-rows, rows)`` of the table a Gather reads them into
    (:func:`index_bounds`): an :class:`InputError` naming the input, the value, its row and the
    table."""
    for name, tables in bounds.items():
        if name not in data:
            continue
        arr = np.asarray(data[name])
        if arr.dtype.kind not in "iu" or arr.size == 0:
            continue
        for table, rows, node in tables:
            bad = (arr < -rows) | (arr >= rows)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise InputError(
                    f"input {name!r} of {what} holds index {int(arr[where])} at row {where[0]}"
                    f"{f' (position {list(where)})' if len(where) > 1 else ''}, outside the {rows} rows of "
                    f"{table!r} that Gather {node} reads (indices must lie in [{-rows}, {rows}); "
                    f"{int(bad.sum())} such value(s)): a token id beyond the vocabulary?"
                )


def n_samples(data: Mapping[str, np.ndarray]) -> int:
    """The common first dimension of ``data``'s arrays."""
    return len(next(iter(data.values()))) if data else 0


class BatchLoader:
    """Mini-batches of a dict of arrays, all sliced along their first dimension.

    With ``shuffle``, each pass draws a permutation from ``rng`` (a ``numpy.random.Generator``, or
    a seed), so a run is reproducible, and resumable by saving the generator's state between
    passes. Without it, batches are views of the arrays (no copy). ``drop_last`` skips the last
    batch when it is smaller than ``batch_size``.
    """

    def __init__(
        self,
        data: Mapping[str, np.ndarray],
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        rng: np.random.Generator | int | None = None,
    ) -> None:
        if not isinstance(batch_size, int | np.integer) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.data, self.batch_size = dict(data), int(batch_size)
        self.shuffle, self.drop_last = shuffle, drop_last
        self.rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        self.n = n_samples(self.data)
        if drop_last and self.n < self.batch_size:
            raise InputError(f"drop_last with {self.n} samples and batch_size {batch_size} leaves no batch")

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.batch_size
        return math.ceil(self.n / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        order = self.rng.permutation(self.n) if self.shuffle else None
        for k in range(len(self)):
            lo, hi = k * self.batch_size, min((k + 1) * self.batch_size, self.n)
            if order is None:
                yield {name: arr[lo:hi] for name, arr in self.data.items()}
            else:
                idx = order[lo:hi]
                yield {name: arr[idx] for name, arr in self.data.items()}


def split(
    data: Mapping[str, np.ndarray], fraction: float, seed: int | None = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, validation): a random ``fraction`` of the samples held out, seeded."""
    if not 0 < fraction < 1:
        raise InputError(f"the validation fraction must be in (0, 1), got {fraction}")
    n = n_samples(data)
    n_val = round(n * fraction)
    if n_val < 1 or n_val >= n:
        raise InputError(f"a validation fraction of {fraction} of {n} samples leaves an empty part")
    order = np.random.default_rng(seed).permutation(n)
    val, train = np.sort(order[:n_val]), np.sort(order[n_val:])
    return {k: v[train] for k, v in data.items()}, {k: v[val] for k, v in data.items()}


# ---- files -------------------------------------------------------------------------------------
def read_csv(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """Column names (the header row) and the values as a float64 array (rows, columns)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows:
        raise InputError(f"{os.fspath(path)!r} is empty: a CSV file needs a header row and data rows")
    header = [c.strip() for c in rows[0]]
    if len(set(header)) != len(header):
        raise InputError(f"{os.fspath(path)!r}: duplicate column names in the header {header}")
    values = np.empty((len(rows) - 1, len(header)))
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise InputError(f"{os.fspath(path)!r} line {i}: {len(row)} fields, the header has {len(header)}")
        for j, cell in enumerate(row):
            try:
                values[i - 2, j] = float(cell)
            except ValueError:
                raise InputError(
                    f"{os.fspath(path)!r} line {i}, column {header[j]!r}: {cell!r} is not a number"
                ) from None
    if not len(values):
        raise InputError(f"{os.fspath(path)!r} has a header but no data rows")
    return header, values


def load_dataset(
    path: str | os.PathLike,
    inputs: Mapping[str, ValueInfo],
    *,
    target: str,
    target_input: str = "target",
    features: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Arrays for a training model's ``inputs`` (which include ``target_input``) from a file.

    ``.npz``: one array per model input, named after it; the target array is named ``target``.
    ``.csv``: a header row; the column ``target`` is the target, the other columns (or
    ``features``, in that order) are the features of the model's single data input.
    """
    ext = os.path.splitext(os.fspath(path))[1].lower()
    data_inputs = [n for n in inputs if n != target_input]
    if ext == ".npz":
        if not os.path.exists(path):
            raise InputError(f"data file {os.fspath(path)!r} does not exist")
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        if target not in arrays:
            raise InputError(
                f"the target array {target!r} is not in {os.fspath(path)!r} (arrays: {list(arrays)})"
            )
        missing = [n for n in data_inputs if n not in arrays]
        if missing:
            raise InputError(
                f"{os.fspath(path)!r} has no array for model input(s) {missing} (arrays: {list(arrays)})"
            )
        data = {n: arrays[n] for n in data_inputs}
    elif ext == ".csv":
        if not os.path.exists(path):
            raise InputError(f"data file {os.fspath(path)!r} does not exist")
        if len(data_inputs) != 1:
            raise InputError(
                f"a CSV file feeds a model with one data input; this one has {data_inputs}: use a .npz file"
            )
        header, values = read_csv(path)
        columns = {c: j for j, c in enumerate(header)}
        if target not in columns:
            raise InputError(f"no column {target!r} in {os.fspath(path)!r} (columns: {header})")
        chosen = list(features) if features else [c for c in header if c != target]
        unknown = [c for c in chosen if c not in columns]
        if unknown:
            raise InputError(f"no column(s) {unknown} in {os.fspath(path)!r} (columns: {header})")
        arrays = {target: values[:, columns[target]]}
        feats = values[:, [columns[c] for c in chosen]]
        info = inputs[data_inputs[0]]
        shape = info.shape
        if shape is not None and len(shape) == 2 and isinstance(shape[1], int) and shape[1] != feats.shape[1]:
            raise InputError(
                f"input {info.name!r} expects {shape[1]} features per row, {os.fspath(path)!r} "
                f"has {feats.shape[1]} feature columns {chosen}"
            )
        data = {data_inputs[0]: feats}
    else:
        raise InputError(f"unsupported data file {os.fspath(path)!r}: expected a .csv or .npz file")
    data[target_input] = arrays[target]
    if not len(arrays[target]):
        raise InputError(f"{os.fspath(path)!r} holds 0 samples: there is nothing to train on")
    return as_feeds(data, inputs, labels={target_input: f"the target {target!r} (input {target_input!r})"})
