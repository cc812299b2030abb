"""onnxgrad.testing.check_op: the keywords of node_model build the one-node model, the others reach
check_gradients (tolerances, probes, seed)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.testing import check_op


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape)


def test_model_options_build_the_node():
    x = _x(2, 3, 4)
    result = check_op("Transpose", [x], attrs={"perm": [2, 0, 1]}, opset=13, dynamic=True)
    assert set(result.analytic) == {"in0"} and result.analytic["in0"].shape == (2, 3, 4)
    # the second input as an initializer: its gradient is checked too (a float initializer)
    result = check_op("Mul", [x, _x(4)], constant=[1])
    assert set(result.analytic) == {"in0", "in1"}
    result = check_op("Split", [_x(4, 2)], attrs={"axis": 0, "num_outputs": 2}, n_outputs=2)
    assert result.ok and set(result.analytic) == {"in0"}


def test_other_options_reach_check_gradients():
    x = _x(5, 6)
    assert check_op("Tanh", [x], max_elements=4).probed == {"in0": 4}
    assert check_op("Tanh", [x], max_elements=7, seed=3).probed == {"in0": 7}
    # a tolerance far below float64 finite differences' error fails the check: the tolerance arrived
    with pytest.raises(AssertionError, match="gradient check of Tanh failed"):
        check_op("Tanh", [x], rtol=0.0, atol=1e-300)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'tolerance'"):
        check_op("Tanh", [_x(3)], tolerance=1e-3)
