"""Data helpers: inputs checked and cast with clear errors, seeded mini-batches, CSV and NPZ files."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from onnxgrad.errors import InputError
from onnxgrad.model.graph import ValueInfo
from onnxgrad.train import BatchLoader, as_feeds, load_dataset, split

INPUTS = {
    "x": ValueInfo("x", TensorProto.FLOAT, ("N", 3)),
    "target": ValueInfo("target", TensorProto.INT64, ("N",)),
}


def test_as_feeds_casts_within_a_kind():
    feeds = as_feeds({"x": np.ones((4, 3)), "target": np.array([0.0, 1.0, 2.0, 1.0])}, INPUTS)
    assert feeds["x"].dtype == np.float32 and feeds["target"].dtype == np.int64
    np.testing.assert_array_equal(feeds["target"], [0, 1, 2, 1])
    x = np.ones((4, 3), np.float32)
    assert as_feeds({"x": x, "target": np.zeros(4, np.int64)}, INPUTS)["x"] is x  # no copy needed
    # a (N,) target for an (N, 1) input gains its trailing axis
    col = {"y": ValueInfo("y", TensorProto.DOUBLE, (None, 1))}
    assert as_feeds({"y": np.arange(5.0)}, col)["y"].shape == (5, 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"x": np.ones((4, 3))}, r"no array for input\(s\) \['target'\]"),
        (
            {"x": np.ones((4, 3)), "target": np.zeros(4), "w": np.ones(4)},
            r"arrays \['w'\] that are not model inputs",
        ),
        (
            {"x": np.ones((4, 3)), "target": np.array([0, 0.5, 1, 1])},
            "expects integers .* non-integers such as 0.5",
        ),
        (
            {"x": np.array([["a"] * 3] * 4), "target": np.zeros(4)},
            "input 'x' has dtype str32, the model expects float32",
        ),
        (
            {"x": np.ones((4, 2)), "target": np.zeros(4)},
            r"input 'x' expects shape \[N, 3\], the data has shape \(4, 2\)",
        ),
        ({"x": np.ones((4, 3)), "target": np.zeros(5)}, "same number of samples"),
        ({"x": np.ones((4, 3)), "target": np.int64(1)}, "must have a sample dimension"),
    ],
)
def test_as_feeds_errors(data, message):
    with pytest.raises(InputError, match=message):
        as_feeds(data, INPUTS)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_cover_the_data_once_per_pass(drop_last):
    data = {"a": np.arange(10), "b": np.arange(10) * 10}
    loader = BatchLoader(data, 4, drop_last=drop_last, rng=7)
    assert len(loader) == (2 if drop_last else 3)
    passes = [[b for b in loader] for _ in range(2)]
    for batches in passes:
        seen = np.concatenate([b["a"] for b in batches])
        assert len(seen) == (8 if drop_last else 10) and len(set(seen)) == len(seen)
        for b in batches:
            np.testing.assert_array_equal(b["b"], b["a"] * 10)  # rows stay aligned
    assert not np.array_equal(passes[0][0]["a"], passes[1][0]["a"])  # a new order each pass
    again = [b["a"] for b in BatchLoader(data, 4, drop_last=drop_last, rng=7)]
    np.testing.assert_array_equal(np.concatenate(again), np.concatenate([b["a"] for b in passes[0]]))


def test_unshuffled_batches_are_views():
    x = np.arange(10.0)
    batches = list(BatchLoader({"x": x}, 4, shuffle=False))
    assert [len(b["x"]) for b in batches] == [4, 4, 2]
    assert all(np.shares_memory(b["x"], x) for b in batches)
    with pytest.raises(InputError, match="batch_size must be a positive integer"):
        BatchLoader({"x": x}, 0)
    with pytest.raises(InputError, match="leaves no batch"):
        BatchLoader({"x": x}, 20, drop_last=True)


def test_split():
    data = {"x": np.arange(20), "y": -np.arange(20)}
    train, val = split(data, 0.25, seed=1)
    assert len(train["x"]) == 15 and len(val["x"]) == 5
    assert sorted(np.concatenate([train["x"], val["x"]])) == list(range(20))
    np.testing.assert_array_equal(val["y"], -val["x"])
    with pytest.raises(InputError, match=r"must be in \(0, 1\)"):
        split(data, 1.5)


def write(path, text):
    path.write_text(text)
    return path


def test_load_dataset_csv_and_npz(tmp_path):
    csv = write(tmp_path / "d.csv", "a,b,label,c\n1,2,0,3\n4,5,1,6\n\n7,8,2,9\n")
    data = load_dataset(csv, INPUTS, target="label")
    np.testing.assert_array_equal(data["x"], [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    np.testing.assert_array_equal(data["target"], [0, 1, 2])
    data = load_dataset(csv, INPUTS, target="label", features=["c", "b", "a"])
    np.testing.assert_array_equal(data["x"][0], [3, 2, 1])
    np.savez(tmp_path / "d.npz", x=np.ones((2, 3)), y=np.array([1, 0]))
    data = load_dataset(tmp_path / "d.npz", INPUTS, target="y")
    assert data["x"].dtype == np.float32 and list(data["target"]) == [1, 0]


@pytest.mark.parametrize(
    ("name", "text", "kwargs", "message"),
    [
        (
            "d.csv",
            "a,b,c,label\n1,2,3,0\n",
            {"target": "y"},
            r"no column 'y' in .* \(columns: \['a', 'b', 'c', 'label'\]\)",
        ),
        (
            "d.csv",
            "a,b,label\n1,2,0\n",
            {"target": "label"},
            "input 'x' expects 3 features per row, .* has 2 feature columns",
        ),
        ("d.csv", "a,b,c,label\n1,2,x,0\n", {"target": "label"}, "line 2, column 'c': 'x' is not a number"),
        ("d.csv", "a,b,c,label\n1,2,3\n", {"target": "label"}, "line 2: 3 fields, the header has 4"),
        (
            "d.csv",
            "a,b,c,label\n1,2,3,0.5\n",
            {"target": "label"},
            r"the target 'label' \(input 'target'\) expects integers",
        ),
        (
            "d.csv",
            "a,b,c,label\n1,2,3,0\n",
            {"target": "label", "features": ["a", "z", "c"]},
            r"no column\(s\) \['z'\]",
        ),
        ("d.csv", "a,a,c,label\n", {"target": "label"}, "duplicate column names"),
        ("d.txt", "", {"target": "label"}, "expected a .csv or .npz file"),
    ],
)
def test_load_dataset_errors(tmp_path, name, text, kwargs, message):
    path = write(tmp_path / name, text)
    with pytest.raises(InputError, match=message):
        load_dataset(path, INPUTS, **kwargs)


def test_load_dataset_npz_errors(tmp_path):
    np.savez(tmp_path / "d.npz", features=np.ones((2, 3)), y=np.zeros(2))
    with pytest.raises(
        InputError, match=r"no array for model input\(s\) \['x'\] \(arrays: \['features', 'y'\]\)"
    ):
        load_dataset(tmp_path / "d.npz", INPUTS, target="y")
    with pytest.raises(InputError, match="the target array 'label' is not in"):
        load_dataset(tmp_path / "d.npz", INPUTS, target="label")
    with pytest.raises(InputError, match="does not exist"):
        load_dataset(tmp_path / "missing.csv", INPUTS, target="label")
