"""The Attention rule on the ONNX backend node tests that return ``qk_matmul_output``.

The models and inputs come from onnx's own test-case generators (``onnx.backend.test.case.node``),
the ones its backend test data is written from, so the check follows the installed onnx. Every
output carries a gradient (random cotangents), qk_matmul_output included: in the default mode 0
(scaled Q K^T, the attribute absent) with and without a past cache, and in mode 3 in float16 with
``softmax_precision`` float.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgrad import testing
from onnxgrad.autodiff.engine import build_gradient
from onnxgrad.model.graph import ir_version_for
from onnxgrad.testing import check_gradients


@functools.cache
def _cases() -> dict[str, tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    from onnx.backend.test.case import node as cases

    with warnings.catch_warnings(), np.errstate(all="ignore"):  # the other ops' generators warn
        warnings.simplefilter("ignore")
        collected = cases.collect_testcases("Attention")
    out = {}
    for case in collected:
        inputs = case.data_sets[0][0] if case.data_sets else []
        feeds = {i.name: np.asarray(x) for i, x in zip(case.model.graph.input, inputs)}
        out[case.name] = (case.model, feeds)
    return out


def backend_case(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The model and first data set of the backend node test ``name``."""
    cases = _cases()
    if name not in cases:
        pytest.skip(f"onnx {onnx.__version__} has no backend node test {name}")
    return cases[name]


@pytest.mark.parametrize(
    "name",
    [
        "test_attention_4d_with_qk_matmul",
        "test_attention_3d_with_past_and_present_qk_matmul",
        "test_attention_4d_with_past_and_present_qk_matmul",
    ],
)
def test_backend_attention_qk_matmul_output_mode0(name: str) -> None:
    """The mode attribute is absent (mode 0): the mode-3 copy of the node that gives the
    probabilities must set it, and keep present_key/value where there is a past cache (onnxruntime
    refuses past_key without present_key). Before: gradients 10-67x off, or a failing session."""
    model, feeds = backend_case(name)
    result = check_gradients(model, feeds, wrt=[k for k, v in feeds.items() if v.dtype.kind == "f"])
    assert result.ok, result.report()


def _as_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float64 copy of a float16 Attention model, softmax in float64 (no softmax_precision)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for v in [*out.graph.input, *out.graph.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    node = out.graph.node[0]
    kept = [a for a in node.attribute if a.name != "softmax_precision"]
    del node.attribute[:]
    node.attribute.extend(kept)
    return out


def test_backend_attention_mode3_softmax_precision_float16() -> None:
    """float16 Q, K, V, a boolean mask with a fully masked row, softmax in float32, the mode-3
    output used. Finite differences in float16 measure rounding only, so: the float64 copy of the
    model matches finite differences (on onnx.reference: onnxruntime gives NaN on the fully masked
    row), and the float16 gradients from onnxruntime match the float64 ones within float16's
    precision, relative to the gradient's magnitude."""
    model, feeds = backend_case("test_attention_24_qk_matmul_output_mode3_softmax_precision")
    wrt = [k for k, v in feeds.items() if v.dtype.kind == "f"]
    double = _as_double(model)
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float16 else v for k, v in feeds.items()}
    result = check_gradients(double, feeds64, wrt=wrt, backend="reference")
    assert result.ok, result.report()

    rng = np.random.default_rng(3)
    graphs16 = build_gradient(model, trainable=[], inputs_requiring_grad=wrt)
    graphs64 = build_gradient(double, trainable=[], inputs_requiring_grad=wrt)
    out16, _ = testing.run_gradients(graphs16, feeds)
    cot = {o: rng.standard_normal(out16[o].shape) for o in graphs16.grad_inputs}
    _, grads16 = testing.run_gradients(graphs16, feeds, {o: c.astype(np.float16) for o, c in cot.items()})
    _, grads64 = testing.run_gradients(graphs64, feeds64, cot, backend="reference")
    for name in wrt:
        assert grads16[name].dtype == np.float16
        want = grads64[name]
        assert np.all(np.isfinite(grads16[name]))
        np.testing.assert_allclose(grads16[name].astype(np.float64), want, atol=2e-2 * np.abs(want).max())


def test_qk_output_mode_attribute_absent_is_mode0() -> None:
    """A hand-made node without the attribute, float64, a past cache: y, present_key/value and qk
    all carry gradients."""
    rng = np.random.default_rng(0)
    values = {
        "q": rng.standard_normal((1, 2, 3, 4)),
        "k": rng.standard_normal((1, 2, 5, 4)),
        "v": rng.standard_normal((1, 2, 5, 4)),
        "pk": rng.standard_normal((1, 2, 2, 4)),
        "pv": rng.standard_normal((1, 2, 2, 4)),
    }
    node = helper.make_node("Attention", ["q", "k", "v", "", "pk", "pv"], ["y", "kk", "vv", "qk"], scale=0.5)
    infos = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, x.shape) for n, x in values.items()]
    outs = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in ("y", "kk", "vv", "qk")]
    graph = helper.make_graph([node], "g", infos, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = ir_version_for(model.opset_import)
    model = onnx.shape_inference.infer_shapes(model)
    result = check_gradients(model, values, wrt=list(values))
    assert result.ok, result.report()


def test_backend_attention_mode3_softmax_precision_differences_must_step_over_float32() -> None:
    """Why float64 finite differences on a float64 copy that KEEPS ``softmax_precision`` (float)
    are no reference: the evaluator casts the logits to float32 before the softmax, so a step of
    1e-6 (the float64 default) moves a logit by ~3e-7, a few units in the last place of float32:
    the differences are quantized, exactly 0 for some elements of Q whose gradient is not, 5x the
    gradient for others. That is the "relative 36, -0.0082 where the differences give 0" of the
    report; onnxgrad's rule was right (the copy without softmax_precision matches, above).

    With a step the float32 softmax resolves, the differences agree with onnxgrad's gradient of
    the same float64 copy, within what the float32 cast and the step allow: one evaluation of the
    loss ``L = <c_Y, P V> + <c_qk, P>`` is off by at most ``e = u (1 + 2 max |logit|) sum_ij P_ij
    (|c_qk,ij| + sum_d |c_Y,id| |V_jd|)`` (u the float32 unit roundoff: each P_ij moves by u P_ij
    from its own cast and by 2 u max |logit| P_ij through the softmax of the rounded logits), so
    a central difference at step h by e / h; its truncation error is estimated by the change from
    h to h / 2 (the error is O(h^2): D(h) - D(h/2) is 3/4 of D(h)'s), plus that one's rounding.
    """
    model, feeds = backend_case("test_attention_24_qk_matmul_output_mode3_softmax_precision")
    kept = onnx.ModelProto()
    kept.CopyFrom(model)  # float64 inputs and outputs, softmax_precision (float) kept
    for v in [*kept.graph.input, *kept.graph.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float16 else v for k, v in feeds.items()}

    small = check_gradients(kept, feeds64, wrt=["Q"], backend="reference", max_elements=8)  # step 1e-6
    quantized = [m for m in small.mismatches if m.numeric == 0.0 and abs(m.analytic) > 1e-4]
    assert quantized, small.report()  # the reference of the report: zero where the gradient is not

    graphs = build_gradient(kept, trainable=[], inputs_requiring_grad=["Q"])
    fwd = testing.run_model(graphs.forward, "reference")
    out = fwd(feeds64)
    rng = np.random.default_rng(5)
    cot = {o: rng.standard_normal(out[o].shape) for o in graphs.grad_inputs}
    _, grads = testing.run_gradients(graphs, feeds64, cot, backend="reference")

    def central(idx: tuple[int, ...], step: float) -> float:
        """(L(Q + step e_idx) - L(Q - step e_idx)) / (2 step)."""
        ends = []
        for sign in (1, -1):
            q = feeds64["Q"].copy()
            q[idx] += sign * step
            res = fwd({**feeds64, "Q": q})
            ends.append(float(sum(np.sum(res[o] * c) for o, c in cot.items())))
        return (ends[0] - ends[1]) / (2 * step)

    probs, v = out["qk_matmul_output"], feeds64["V"]  # (B, H, Sq, Skv), (B, H, Skv, D)
    c_y, c_qk = np.abs(cot["Y"]), np.abs(cot["qk_matmul_output"])
    logits = np.einsum("bhsd,bhtd->bhst", feeds64["Q"], feeds64["K"]) / np.sqrt(v.shape[-1])
    u = float(np.finfo(np.float32).eps) / 2
    weights = c_qk + np.einsum("bhsd,bhtd->bhst", c_y, np.abs(v))
    e = u * (1 + 2 * float(np.abs(logits).max())) * float((probs * weights).sum())
    h = 1e-2
    assert not grads["Q"][:, :, 0].any()  # the fully masked query row: Y and P are 0 whatever Q
    for b, head, d in np.ndindex(grads["Q"].shape[0], grads["Q"].shape[1], grads["Q"].shape[3]):
        idx = (b, head, 1, d)  # the attending row
        d_h, d_half = central(idx, h), central(idx, h / 2)
        bound = e / h + 2 * e / h + abs(d_h - d_half) * 4 / 3
        assert abs(grads["Q"][idx] - d_h) <= bound, (idx, grads["Q"][idx], d_h, bound)
