"""Shared by the OnnxModule tests: a small float64 network and its TorchScript export."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")


def export_net(net, example):
    """``net`` exported with the TorchScript exporter, input ``x`` with a dynamic batch."""
    import onnx

    buf = io.BytesIO()
    torch.onnx.export(net, (example,), buf, dynamo=False, input_names=["x"], dynamic_axes={"x": {0: "batch"}})
    return onnx.load_from_string(buf.getvalue())


@pytest.fixture
def net64():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
