"""Gradient checks of DFT (rules/spectral.py) against float64 finite differences and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import onnxgrad.autodiff.rules.spectral  # noqa: F401  (registers the rules until rules/__init__ does)
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.testing import check_op, node_model, run_gradients
from tests.autodiff.random_data import rnd  # one generator per test (conftest.py)

# (input shape, dft_length, onesided, inverse, axis)
DFT_CASES = [
    ((2, 5, 1), None, 0, 0, 1),
    ((2, 5, 2), None, 0, 0, 1),
    ((2, 6, 2), None, 0, 1, 1),
    ((2, 6, 1), None, 1, 0, 1),
    ((2, 5, 1), None, 1, 0, 1),
    ((2, 5, 2), 7, 0, 0, 1),
    ((2, 5, 2), 3, 0, 1, 1),
    ((2, 6, 1), 8, 1, 0, 1),
    ((3, 2, 4, 2), None, 0, 0, 2),
    ((3, 4, 2, 1), None, 0, 0, 1),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("opset", [17, 20])
@pytest.mark.parametrize(("shape", "length", "onesided", "inverse", "axis"), DFT_CASES)
def test_dft(
    opset: int, shape: tuple, length: int | None, onesided: int, inverse: int, axis: int, dynamic: bool
) -> None:
    """``dynamic``: every dim of the input symbolic, its last (real or complex) too: the lengths
    are read at run time (was refused)."""
    inputs: list = [rnd(*shape), None if length is None else np.int64(length)]
    attrs = {"onesided": onesided, "inverse": inverse}
    if opset >= 20:
        inputs.append(np.int64(axis - len(shape)))  # the negative form of the axis input
    else:
        attrs["axis"] = axis
    check_op("DFT", inputs, attrs=attrs, opset=opset, dynamic=dynamic)


def test_dft_versus_torch() -> None:
    """A one-sided real DFT of length 8 is torch.fft.rfft(x, n=8)."""
    x = rnd(3, 6)
    model = node_model("DFT", [x[..., None], np.int64(8)], attrs={"onesided": 1, "axis": 1}, opset=17)
    cot = rnd(3, 5, 2)
    graphs = build_gradient(model, inputs_requiring_grad=["in0"])
    _, grads = run_gradients(graphs, {"in0": x[..., None]}, {"out0": cot})
    xt = torch.tensor(x, requires_grad=True)
    z = torch.view_as_real(torch.fft.rfft(xt, n=8, dim=1))
    (z * torch.tensor(cot)).sum().backward()
    np.testing.assert_allclose(grads["in0"][..., 0], xt.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "symbolic"])
def test_dft_inverse_one_sided_refused(dynamic: bool) -> None:
    """irfft (onnxruntime takes a half spectrum in, a real signal out): the rule took it for a
    one-sided output and gave a gradient of the wrong shape; refused."""
    model = node_model(
        "DFT", [rnd(1, 6, 10, 2)], attrs={"axis": 1, "inverse": 1, "onesided": 1}, opset=17, dynamic=dynamic
    )
    with pytest.raises(GradientNotImplementedError, match=r"'DFT'.*inverse one-sided DFT"):
        build_gradient(model, inputs_requiring_grad=["in0"])
