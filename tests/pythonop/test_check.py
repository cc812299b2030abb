"""The gradient checker on models holding PythonOp nodes: ``check_gradients``, ``check_nodes`` and
``onnxgrad check`` run the registered Functions as the doors do, so a custom backward that is 10 %
off is caught and a right one passes."""

from __future__ import annotations

import pytest
import torch

import onnxgrad
from onnxgrad.cli import main
from onnxgrad.pythonop import unregister_function
from onnxgrad.testing import check_gradients, check_nodes


class _Cube(torch.autograd.Function):
    """x**3, with the backward scaled by ``factor`` (1: right)."""

    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _Cube.factor * 3 * g * x**2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return _Cube.apply(self.fc(x))


@pytest.fixture
def cube_model(monkeypatch):
    """(model, feeds) of Linear -> _Cube in float64, _Cube registered for the test."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    onnxgrad.register_function(_Cube)
    model = onnxgrad.export(_Net().double(), (x,))
    yield model, {"x": x.numpy()}
    unregister_function(_Cube)


@pytest.mark.parametrize("factor", [1.0, 1.1])
def test_check_gradients_and_check_nodes_run_registered_functions(cube_model, monkeypatch, factor, no_leaks):
    model, feeds = cube_model
    monkeypatch.setattr(_Cube, "factor", factor)
    whole = check_gradients(model, feeds)
    nodes = {c.op_type: c for c in check_nodes(model, feeds)}
    assert nodes["Gemm"].status == "ok"
    if factor == 1.0:
        assert whole.ok and not whole.nondiff, whole.report()
        assert nodes["PythonOp"].status == "ok", nodes["PythonOp"]
    else:
        assert not whole.ok and {m.name for m in whole.mismatches} >= {"fc.weight", "fc.bias"}
        for m in whole.mismatches:  # the analytic gradient is 10 % larger than the numeric one
            assert m.analytic == pytest.approx(1.1 * m.numeric, rel=1e-4), m
        assert nodes["PythonOp"].status == "FAIL" and nodes["PythonOp"].checked_in == "float64 onnxruntime"


def test_onnxgrad_check_runs_registered_functions(cube_model, monkeypatch, tmp_path, capsys):
    model, _ = cube_model
    path = tmp_path / "cube.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["check", str(path)]) == 0, capsys.readouterr().out
    assert "PythonOp" in capsys.readouterr().out
    monkeypatch.setattr(_Cube, "factor", 1.1)
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "not a registered function/op" not in out, out
