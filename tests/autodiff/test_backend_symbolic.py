"""The ONNX backend node tests of the shape-dependent ops, with every input dim declared symbolic.

A model exported with dynamic axes gives the rules symbolic dims, where their static-shape paths
(constants computed when building) give way to shapes read at run time. Each backend test case of
these ops (from onnx's own test-case generators, ``onnx.backend.test.case.node``) is built twice,
as given and with every dim of its floating-point inputs symbolic: the gradients must agree, and
none may be refused with symbolic dims (issue 37 §0 measured 81 refusals and, in Conv's, wrong
gradients). Both run on onnxruntime, or onnx.reference where onnxruntime has no kernel. Cases
refused at static shapes too are left out.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import FLOAT_TYPES

OPS = [
    "AffineGrid",
    "DFT",
    "AveragePool",
    "CausalConvWithState",
    "Conv",
    "ConvTranspose",
    "LpPool",
    "MaxPool",
    "Pad",
    "Reshape",
    "Resize",
    "RoiAlign",
    "Slice",
    "SwiGLU",
]


@functools.cache
def _cases(op: str) -> list[tuple[str, onnx.ModelProto, dict[str, np.ndarray]]]:
    """The backend test cases of ``op`` (one-node models and their first data set).

    Its generator class is run on its own: ``collect_testcases`` fills one module-wide list, once
    per process, with the cases of the op first asked for (test_rules_attention_backend.py asks for
    Attention's); that list is left as it was found.
    """
    import importlib
    import pkgutil

    from onnx.backend.test.case import node as cases

    module_name = next(
        m.name for m in pkgutil.iter_modules(cases.__path__) if m.name.replace("_", "") == op.lower()
    )
    saved = (list(cases._NodeTestCases), cases._TargetOpType, dict(cases._existing_names))
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            generator = getattr(importlib.import_module(f"{cases.__name__}.{module_name}"), op)
            cases._NodeTestCases.clear()
            cases._existing_names.clear()
            cases._TargetOpType = op
            for name in vars(generator):
                if name.startswith("export"):
                    np.random.seed(0)  # as onnx's generators are run
                    getattr(generator, name)()
            collected = list(cases._NodeTestCases)
    finally:
        cases._NodeTestCases[:] = saved[0]
        cases._TargetOpType = saved[1]
        cases._existing_names.clear()
        cases._existing_names.update(saved[2])
    out = []
    for case in collected:
        if [n.op_type for n in case.model.graph.node] != [op]:  # a function op's expanded form
            continue
        feeds = {i.name: np.asarray(x) for i, x in zip(case.model.graph.input, case.data_sets[0][0])}
        if any(v.dtype.kind == "f" for v in feeds.values()):
            out.append((case.name, case.model, feeds))
    return out


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str]) -> dict[str, np.ndarray]:
    """The gradients of ``wrt`` for cotangents drawn from a fixed seed, on onnxruntime when it
    runs the graphs, else on onnx.reference."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=wrt)
    for backend in ("onnxruntime", "reference"):
        try:
            out = testing.run_model(graphs.forward, backend)(feeds)  # type: ignore[arg-type]
        except Exception:
            if backend == "reference":
                raise
            continue
        gen = np.random.default_rng(0)
        cot = {o: gen.standard_normal(np.shape(out[o])).astype(out[o].dtype) for o in graphs.grad_inputs}
        return testing.run_gradients(graphs, feeds, cot, backend)[1]  # type: ignore[arg-type]
    raise AssertionError("unreachable")


def _symbolic(model: onnx.ModelProto) -> onnx.ModelProto:
    axes = {
        i.name: range(len(i.type.tensor_type.shape.dim))
        for i in model.graph.input
        if i.type.tensor_type.elem_type in FLOAT_TYPES
    }
    return testing.declare_symbolic(model, axes)


@pytest.mark.parametrize("op", OPS)
def test_backend_cases_with_symbolic_dims(op: str) -> None:
    cases = _cases(op)
    if not cases:
        pytest.skip(f"onnx {onnx.__version__} has no backend test case of {op}")
    for name, model, feeds in cases:
        wrt = [k for k, v in feeds.items() if v.dtype.kind == "f"]
        try:
            want = _gradients(model, feeds, wrt)
        except GradientNotImplementedError:  # refused whatever the shapes (DFT's irfft form)
            continue
        got = _gradients(_symbolic(model), feeds, wrt)
        for w in wrt:
            # the same sums in another order: a few roundings of the dtype (measured: float16 at
            # most 1.1e-3 of the largest gradient, 1.1 eps), far below a lost row or a wrong window
            rtol = 16 * float(np.finfo(want[w].dtype).eps)
            testing.assert_allclose_scaled(got[w], want[w], rtol=rtol, err_msg=f"{name}: {w}")
