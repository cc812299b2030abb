"""Backward ops onnxruntime's CPU provider has no float16 kernel for run in float32 between Casts.

onnxruntime 1.32 refuses float16 ScatterND with any reduction and ScatterElements with ``add`` or
``mul`` ("MLFloat16 data type is not supported with ScatterND opset 16 when reduction is 'add'"):
the gradients of Gather (an embedding), GatherND, GatherElements and the reducing scatters use them.
Each float16 gradient is compared with the float32 gradient of the same model (the float32 rules are
checked against finite differences in test_rules_indexing.py) within float16 rounding of its scale.
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxgrad
from onnxgrad.testing import node_model, run_model

RNG = np.random.default_rng(0)


def _grads(op: str, inputs: list, dtype: type, attrs: dict | None = None) -> dict[str, np.ndarray]:
    cast = [a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs]
    model = node_model(op, cast, attrs=attrs)
    feeds = {i.name: cast[int(i.name[2:])] for i in model.graph.input}
    shape = run_model(model)(feeds)["out0"].shape
    cot = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    return onnxgrad.gradients(model, feeds, {"out0": cot}, wrt=list(feeds))


CASES = {
    # an embedding: repeated rows add up (ScatterND add)
    "Gather": ([RNG.standard_normal((6, 4)), np.array([[1, 3, 1], [5, 1, 0]])], {}),
    "Gather-axis1": ([RNG.standard_normal((3, 5)), np.array([4, 0, 4, 2])], {"axis": 1}),
    "GatherND": ([RNG.standard_normal((4, 3)), np.array([[2], [0], [2]])], {}),
    "GatherElements": ([RNG.standard_normal((3, 4)), np.array([[0, 2, 2, 1], [2, 2, 0, 1]])], {}),
    # scatters whose forward has a float16 kernel, whose gradient scatters with a reduction: ties of
    # a max shared (ScatterElements add), duplicate writes found by a scatter-max of ordinals
    "ScatterElements-max": (
        [RNG.standard_normal((3, 4)), np.array([[0, 1, 1, 2], [0, 1, 2, 2]]), RNG.standard_normal((2, 4))],
        {"reduction": "max"},
    ),
    "ScatterND": ([RNG.standard_normal((4, 3)), np.array([[1], [3], [1]]), RNG.standard_normal((3, 3))], {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_float16_gradient_matches_float32(case):
    inputs, attrs = CASES[case]
    op = case.split("-")[0]
    got = _grads(op, inputs, np.float16, attrs)
    want = _grads(op, inputs, np.float32, attrs)
    assert set(got) == set(want)
    for name, w in want.items():
        assert got[name].dtype == np.float16, name
        scale = float(np.abs(w).max())
        # float16 keeps 11 bits: inputs, products and the result each round once or twice
        assert np.abs(got[name].astype(np.float32) - w).max() <= 4e-3 * scale + 1e-4, name
