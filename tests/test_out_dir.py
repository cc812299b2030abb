"""One name for the folder written: ``out_dir`` in Python, ``-o/--out-dir`` on the command line; the
old ``directory=`` keeps working with a DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest

from onnxgrad import build_gradient
from onnxgrad.errors import InputError, InputTypeError
from tests.train.test_trainer import linear


def test_gradient_graphs_save_takes_out_dir(tmp_path):
    graphs = build_gradient(linear())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = graphs.save(out_dir=tmp_path / "a")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["forward.onnx", "backward.onnx"]
    assert graphs.save(tmp_path / "b")[0].endswith("forward.onnx")  # positional, as before
    with pytest.warns(DeprecationWarning, match="directory= is deprecated, use out_dir=") as caught:
        graphs.save(directory=tmp_path / "c")
    assert caught[0].filename == __file__  # the warning points at the caller
    assert (tmp_path / "c" / "backward.onnx").exists()
    with pytest.raises(InputError, match="directory= is the old name of out_dir=: pass out_dir= only"):
        graphs.save(tmp_path / "d", directory=tmp_path / "e")
    with pytest.raises(InputTypeError, match="save\\(\\) needs out_dir"):
        graphs.save()
