"""Shared set-up and helpers of the gradient-rule tests (``test_rules_*.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_gradients, node_model, run_model
from tests.autodiff.random_data import reseed, rng


@pytest.fixture(autouse=True)
def fresh_random_data(request: pytest.FixtureRequest) -> None:
    """:func:`~tests.autodiff.random_data.rnd` and ``pos`` draw from a generator seeded by the
    test's own id: the same data whatever ran before, in any order, with or without xdist."""
    reseed(request.node.nodeid)


# ---- shared helpers of the test_rules_*.py files ---------------------------------------------
F32 = np.float32
D = TensorProto.DOUBLE


def f32(*arrays: np.ndarray | None) -> list[np.ndarray | None]:
    """The arrays as float32 (``None`` stays ``None``)."""
    return [None if a is None else a.astype(F32) for a in arrays]


def dynamic_model(
    op: str, inputs: Sequence[np.ndarray | None], dims: dict[int, Sequence[int]], **kw: Any
) -> onnx.ModelProto:
    """A one-node model where input i has symbolic dims at positions ``dims[i]``, the rest static.

    (``node_model(dynamic=True)`` makes every dim of every input symbolic, weights included.)
    """
    return declared_symbolic(node_model(op, inputs, **kw), dims)


SPATIAL = {0: (0, 2, 3, 4)}  # ``dims`` of the batch and spatial dims of input 0 (up to 3-D images)
# a test's ``dims`` argument: every dim static, then batch and spatial dims of input 0 symbolic (an
# export with dynamic H/W): shape-dependent rules take another path then, which must agree
DECLARED = pytest.mark.parametrize("dims", [None, SPATIAL], ids=["static", "symbolic"])


def declared_symbolic(model: onnx.ModelProto, dims: dict[int, Sequence[int]] | None) -> onnx.ModelProto:
    """``model`` with dims ``dims[i]`` of input ``in{i}`` made symbolic (those past its rank are
    ignored, so :data:`SPATIAL` fits 1-D to 3-D images) and its value types inferred again from
    them; ``None`` leaves the model as it is."""
    if dims is None:
        return model
    return testing.declare_symbolic(model, {f"in{i}": axes for i, axes in dims.items()})


def check_model(
    model: onnx.ModelProto,
    inputs: Sequence[np.ndarray | None],
    wrt: Sequence[int] | None = None,
    **kw: Any,
) -> None:
    """Finite-difference check of a model fed ``inputs`` (``in{i}`` gets ``inputs[i]``): the gradients
    of the inputs ``wrt`` (default: every float one)."""
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    if wrt is None:
        names = [n for n, v in feeds.items() if v.dtype.kind == "f"]
    else:
        names = [f"in{i}" for i in wrt]
    result = check_gradients(model, feeds, wrt=names, **kw)
    assert result.ok, result.report()


def grads(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    wrt: Sequence[str],
    backend: testing.Backend = "onnxruntime",
    seed: int = 0,
) -> tuple[Any, Any, dict]:
    """Forward output 0, the cotangent used and the gradients of ``wrt`` of a model."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(wrt))
    out = run_model(graphs.forward, backend)(feeds)
    name = model.graph.output[0].name
    cot = np.random.default_rng(seed).standard_normal(out[name].shape).astype(out[name].dtype)
    bfeeds = {s: out[s] if s in out else feeds[s] for s in graphs.saved}
    bfeeds[graphs.grad_inputs[name]] = cot
    res = run_model(graphs.backward, backend)(bfeeds)
    return out[name], cot, {w: res[graphs.grad_outputs[w]] for w in wrt}


def versus_torch(
    op: str,
    inputs: list[np.ndarray],
    attrs: dict[str, Any],
    fn: Callable[..., torch.Tensor],
    backend: testing.Backend = "onnxruntime",
    opset: int = 18,
    needs: Sequence[int] | None = None,
    dims: dict[int, Sequence[int]] | None = None,
) -> None:
    """Compare output and input gradients of a one-node model with torch autograd (float64);
    ``dims``: the input dims declared symbolic (:func:`declared_symbolic`), None for all static."""
    model = declared_symbolic(node_model(op, inputs, attrs=attrs, opset=opset), dims)
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    wrt = [f"in{i}" for i in (needs if needs is not None else range(len(inputs)))]
    y, cot, ours = grads(model, feeds, wrt, backend)
    ts = [torch.tensor(a, requires_grad=f"in{i}" in wrt) for i, a in enumerate(inputs)]
    ty = fn(*ts)
    ty.backward(torch.tensor(cot))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-10)
    for w in wrt:
        expected = ts[int(w[2:])].grad
        np.testing.assert_allclose(ours[w], expected.numpy(), rtol=1e-8, atol=1e-10, err_msg=w)


def graph_model(
    nodes: list[onnx.NodeProto], inputs: list, outputs: list, opset: int = 18, inits=()
) -> onnx.ModelProto:
    """A model from nodes, value-info inputs and outputs and initializer tensors, as they are."""
    m = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits)),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    m.ir_version = ir_version_for(m.opset_import)
    return m


def model(nodes, inputs, outputs, inits=(), opset: int = 18):
    """A model from nodes, (name, dtype, shape) inputs and outputs, and numpy initializers."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "m",
        [vi(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s) for n, t, s in inputs],
        [vi(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version_for(m.opset_import)
    return onnx.shape_inference.infer_shapes(m)  # types the outputs left open


def assert_ok(result) -> None:
    """Fail with the report of a gradient check that failed."""
    assert result.ok, result.report()


def check(
    op: str,
    inputs: Sequence[np.ndarray | None],
    attrs: dict[str, Any],
    *,
    opset: int = 18,
    wrt: Sequence[int] | None = None,
    backend: testing.Backend = "onnxruntime",
    dynamic: bool = False,
    **tol: Any,
) -> None:
    """Finite-difference check of the gradients of the inputs ``wrt`` (default: every float one);
    ``dynamic`` makes every dim of every float input symbolic."""
    model = node_model(op, inputs, attrs=attrs, opset=opset, dynamic=dynamic)
    feeds = {i.name: np.asarray(inputs[int(i.name[2:])]) for i in model.graph.input}
    if not model.graph.output[0].type.tensor_type.HasField("shape"):  # inference gave up
        y = testing.run_model(node_model(op, inputs, attrs=attrs, opset=opset), backend)(feeds)["out0"]
        ensure_output_shape(model, y.shape, dynamic)
    names = list(feeds) if wrt is None else [f"in{i}" for i in wrt]
    result = check_gradients(model, feeds, wrt=names, backend=backend, **tol)
    assert result.ok, result.report()


def symbolic(model: onnx.ModelProto, dims: dict[int, Sequence[int]]) -> onnx.ModelProto:
    """Make dims ``dims[i]`` of input ``in{i}`` symbolic (the others stay static)."""
    for inp in model.graph.input:
        for j in dims.get(int(inp.name[2:]), ()):
            inp.type.tensor_type.shape.dim[j].dim_param = f"{inp.name}_d{j}"
    return model


def i64(values: Any) -> np.ndarray:
    """``values`` as an int64 array."""
    return np.asarray(values, dtype=np.int64)


def runtime_inputs(model: onnx.ModelProto, *names: str) -> onnx.ModelProto:
    """Turn initializers (index tensors) into graph inputs: nothing is known about them when building."""
    for name in names:
        init = next(t for t in model.graph.initializer if t.name == name)
        model.graph.initializer.remove(init)
        model.graph.input.append(helper.make_tensor_value_info(name, init.data_type, list(init.dims)))
    return model


def untyped_outputs_ranked(model: onnx.ModelProto, rank: int) -> onnx.ModelProto:
    """Give outputs shape inference left without a shape ``rank`` unknown dims (the checker wants one)."""
    for out in model.graph.output:
        t = out.type.tensor_type
        if not t.HasField("shape"):
            for _ in range(rank):
                t.shape.dim.add()
    return model


def check_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray], **kw: Any) -> None:
    """Finite-difference check of a model's gradients for every float feed."""
    wrt = [k for k, v in feeds.items() if v.dtype.kind == "f"]
    result = check_gradients(model, feeds, wrt=wrt, **kw)
    assert result.ok, result.report()


def gradients(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: Sequence[str], cot: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Output 0, its cotangent and the gradients of ``wrt`` of a model, on onnxruntime."""
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=list(wrt))
    name = model.graph.output[0].name
    out = run_model(graphs.forward)(feeds)
    if cot is None:
        cot = rng().standard_normal(out[name].shape)
    _, res = testing.run_gradients(graphs, feeds, {name: cot})
    return out[name], cot, res


def ensure_output_shape(model: onnx.ModelProto, shape: Sequence[int], dynamic: bool = False) -> None:
    """Declare the shape of output 0 where ONNX shape inference gave up (the checker wants one on
    graph outputs): static, or of that rank with unknown dims. Shared by the other test modules."""
    out = model.graph.output[0].type.tensor_type
    if not out.HasField("shape"):
        for d in shape:
            dim = out.shape.dim.add()
            if not dynamic:
                dim.dim_value = d
