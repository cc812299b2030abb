"""Gradient checks of the onnxruntime contrib ops and their output types (model/contrib_schemas.py).
Their rules sit beside their ONNX twins: rules/elementwise.py, linalg.py, quant.py, norm.py, attention/.

onnxruntime runs these ops in float32 only (FastGelu, QuickGelu and FusedMatMul in float64 too), so
each check compares with central finite differences through onnxruntime in float32 with the
project's float32 tolerances (``check_gradients``' defaults for float32 models).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import build_gradient, supported_ops
from onnxgrad.autodiff.rewrite import rewrite_for_training
from onnxgrad.errors import GradientNotImplementedError
from onnxgrad.model.graph import ir_version_for, onnx_dtype
from onnxgrad.model.infer import infer_value_infos
from onnxgrad.testing import assert_allclose_scaled, check_gradients, run_gradients

MS = "com.microsoft"
RNG = np.random.default_rng(11)


def rnd(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def contrib_model(
    op: str,
    inputs: Sequence[np.ndarray | None],
    outputs: Sequence[str],
    attrs: dict[str, Any] | None = None,
    *,
    domain: str = MS,
    constant: Sequence[int] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    """One ``op`` node: float inputs are graph inputs ``in{i}`` (initializers where listed in
    ``constant``), integer ones initializers; ``outputs`` names its outputs ('' for unused ones),
    declared with the shapes onnxruntime gives them."""
    names, graph_inputs, inits = [], [], []
    for i, x in enumerate(inputs):
        if x is None:
            names.append("")
            continue
        names.append(f"in{i}")
        if x.dtype.kind == "f" and i not in constant:
            graph_inputs.append(helper.make_tensor_value_info(f"in{i}", onnx_dtype(x.dtype), x.shape))
        else:
            inits.append(numpy_helper.from_array(x, f"in{i}"))
    node = helper.make_node(op, names, list(outputs), domain=domain or None, **(attrs or {}))
    untyped = [  # their element types: mask_index is int32, the rest float32
        helper.make_tensor_value_info(o, TensorProto.INT32 if o == "mask_index" else TensorProto.FLOAT, None)
        for o in outputs
        if o
    ]
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    graph = helper.make_graph([node], "g", graph_inputs, untyped, inits)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ir_version_for(model.opset_import)
    feeds = {i.name: inputs[int(i.name[2:])] for i in graph_inputs}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values = session.run(None, feeds)
    del model.graph.output[:]
    for name, value in zip([o for o in outputs if o], values):
        model.graph.output.append(helper.make_tensor_value_info(name, onnx_dtype(value.dtype), value.shape))
    return model


def check(model: onnx.ModelProto, inputs: Sequence[np.ndarray | None], **tol: Any) -> None:
    """Every float graph input against finite differences, every output with a random cotangent."""
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    result = check_gradients(model, feeds, wrt=list(feeds), **tol)
    assert result.ok, result.report()


def check_op(op: str, inputs: Sequence[np.ndarray | None], attrs: dict | None = None, **kw: Any) -> None:
    n_out = kw.pop("n_outputs", 1)
    check(contrib_model(op, inputs, [f"out{k}" for k in range(n_out)], attrs, **kw), inputs)


# ---- activations and matrix products ------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "inputs", "attrs"),
    [
        ("Gelu", [rnd(2, 3, 5)], {}),
        ("QuickGelu", [rnd(2, 3, 5)], {"alpha": 1.3}),
        ("QuickGelu", [rnd(4, 6)], {}),
        ("FastGelu", [rnd(2, 3, 5), rnd(5)], {}),
        ("FastGelu", [rnd(3, 5)], {}),
        ("BiasGelu", [rnd(2, 3, 5), rnd(5)], {}),
    ],
    ids=["gelu", "quickgelu-alpha", "quickgelu", "fastgelu-bias", "fastgelu", "biasgelu"],
)
def test_activations(op: str, inputs: list, attrs: dict) -> None:
    check_op(op, inputs, attrs)


def _gelu_erf_slope(u: np.ndarray) -> np.ndarray:
    """d/du of u Phi(u), Phi the normal CDF, in float64."""
    from math import erf, pi, sqrt

    cdf = 0.5 * (1.0 + np.vectorize(erf)(u / sqrt(2.0)))
    return cdf + u * np.exp(-0.5 * u * u) / sqrt(2.0 * pi)


def _gelu_tanh_slope(u: np.ndarray) -> np.ndarray:
    """d/du of u (1 + tanh(sqrt(2 / pi) (u + 0.044715 u^3))) / 2, in float64."""
    c = np.sqrt(2.0 / np.pi)
    t = np.tanh(c * (u + 0.044715 * u**3))
    return 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * u * u)


def _quick_gelu_slope(u: np.ndarray, alpha: float = 1.702) -> np.ndarray:
    s = 1.0 / (1.0 + np.exp(-alpha * u))
    return s + alpha * u * s * (1.0 - s)


@pytest.mark.parametrize(
    ("op", "slope", "bias"),
    [
        ("FastGelu", _gelu_tanh_slope, True),
        ("FastGelu", _gelu_tanh_slope, False),
        ("BiasGelu", _gelu_erf_slope, True),
        ("Gelu", _gelu_erf_slope, False),
        ("QuickGelu", _quick_gelu_slope, False),
    ],
    ids=["fastgelu-bias", "fastgelu", "biasgelu", "gelu", "quickgelu"],
)
def test_activation_slopes_are_the_analytic_ones(op: str, slope: Any, bias: bool) -> None:
    """The gradients against the op's own derivative in float64, on a grid over [-4, 4].

    The erf and tanh forms of Gelu have derivatives that differ by up to 8.7e-4 (at |u| = 2.02),
    inside float32 finite differences' tolerance, so ``test_activations`` cannot tell them apart.
    Here the bound is float32 rounding. The worst-conditioned term is the tanh form's
    u c (1 + 3 a u^2) (1 - t^2) / 2: one unit in the last place of t moves 1 - t^2 by 2 eps, times at
    most 5 over [-4, 4] (eps = 1.2e-7: 1.2e-6 per unit of t), plus the dozen other float32
    operations, each within eps of the slope (at most 1.13) times dy (at most 1.5). 1e-5 of the
    largest expected value (1.5e-5) allows ten units of error in onnxruntime's tanh and is 58 times
    below the difference between the two forms."""
    u = np.linspace(-4.0, 4.0, 240, dtype=np.float32).reshape(2, -1)
    b = (np.linspace(-0.5, 0.5, u.shape[1]) ** 3).astype(np.float32) if bias else None
    x = u if b is None else (u - b).astype(np.float32)
    inputs = [x] if b is None else [x, b]
    model = contrib_model(op, inputs, ["y"])
    wrt = [f"in{i}" for i in range(len(inputs))]
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=wrt)
    feeds = {f"in{i}": v for i, v in enumerate(inputs)}
    dy = np.linspace(0.5, 1.5, x.size, dtype=np.float32).reshape(x.shape)
    _, grads = run_gradients(graphs, feeds, {"y": dy})
    u64 = x.astype(np.float64) if b is None else x.astype(np.float64) + b.astype(np.float64)
    want = dy * slope(u64)
    assert_allclose_scaled(grads["in0"], want, rtol=1e-5, err_msg=f"{op} dX")
    if b is not None:
        assert_allclose_scaled(grads["in1"], want.sum(axis=0), rtol=1e-5, err_msg=f"{op} dbias")


@pytest.mark.parametrize(
    ("a", "b", "attrs"),
    [
        (rnd(2, 3, 4), rnd(4, 5), {"alpha": 0.5}),
        (rnd(4, 3), rnd(4, 5), {"transA": 1}),
        (rnd(2, 3, 4), rnd(2, 5, 4), {"transB": 1, "alpha": 2.0}),
        (rnd(1, 4, 3), rnd(2, 5, 4), {"transA": 1, "transB": 1}),
    ],
    ids=["batched-alpha", "transA", "transB-batch", "broadcast-both-trans"],
)
def test_fused_matmul(a: np.ndarray, b: np.ndarray, attrs: dict) -> None:
    check_op("FusedMatMul", [a, b], attrs)


def test_fused_matmul_trans_batch_refused() -> None:
    model = contrib_model("FusedMatMul", [rnd(2, 3, 4), rnd(3, 4, 5)], ["y"], {"transBatchA": 1})
    match = r"input 0 \('in0'\) of node .*'FusedMatMul'.*transBatchA=1"
    with pytest.raises(GradientNotImplementedError, match=match):
        build_gradient(model, inputs_requiring_grad=["in0"])


def test_bias_add_rule() -> None:
    """onnxruntime's CPU provider has no BiasAdd kernel: the backward (plain ops) is run alone and
    compared with the sums the op's definition gives."""
    x, bias, skip = rnd(2, 3, 4), rnd(4), rnd(2, 3, 4)
    node = helper.make_node("BiasAdd", ["x", "b", "s"], ["y"], domain=MS)
    values = {"x": x, "b": bias, "s": skip}
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, v.shape) for n, v in values.items()]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 3, 4))]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    model = helper.make_model(helper.make_graph([node], "g", ins, out), opset_imports=opsets)
    model.ir_version = ir_version_for(model.opset_import)
    graphs = build_gradient(model, inputs_requiring_grad=["x", "b", "s"])
    dy = rnd(2, 3, 4)
    session = ort.InferenceSession(graphs.backward.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {graphs.grad_inputs["y"]: dy}
    feeds.update({name: values[name] for name in graphs.saved})
    names = [o.name for o in graphs.backward.graph.output]
    got = dict(zip(names, session.run(None, feeds)))
    np.testing.assert_allclose(got[graphs.grad_outputs["x"]], dy)
    np.testing.assert_allclose(got[graphs.grad_outputs["s"]], dy)
    np.testing.assert_allclose(got[graphs.grad_outputs["b"]], dy.sum((0, 1)), rtol=1e-5, atol=1e-6)


# ---- MatMulNBits -------------------------------------------------------------------------------
def quantize(w: np.ndarray, bits: int, block: int, zero_points: str) -> tuple[np.ndarray, ...]:
    """w (N, K) as MatMulNBits stores it: packed q (N, n_blocks, blob), scales (N n_blocks), zero
    points packed uint8 or float (or None: the default 2^(bits-1)); and the dequantized w."""
    n, k = w.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = w
    wb = padded.reshape(n, blocks, block)
    top = 2**bits - 1
    lo, hi = wb.min(-1), wb.max(-1)
    scales = ((hi - lo) / top).astype(np.float32)
    scales[scales == 0] = 1.0
    if zero_points == "none":
        zp = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    else:
        zp = np.clip(np.round(-lo / scales), 0, top).astype(np.float32)
    q = np.clip(np.round(wb / scales[..., None] + zp[..., None]), 0, top).astype(np.uint8)
    deq = ((q.astype(np.float32) - zp[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
    if bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:
        packed = q
    zp_in: np.ndarray | None = None
    if zero_points == "uint8":
        zq = zp.astype(np.uint8)
        if bits == 4:
            if blocks % 2:
                zq = np.concatenate([zq, np.zeros((n, 1), np.uint8)], axis=1)
            zq = (zq[:, 0::2] | (zq[:, 1::2] << 4)).astype(np.uint8)
        zp_in = zq.reshape(-1)
    elif zero_points == "float":
        zp_in = zp.reshape(-1).astype(np.float32)
    return packed, scales.reshape(-1), zp_in, deq


@pytest.mark.parametrize(
    ("bits", "k", "block", "zero_points", "bias"),
    [
        (4, 32, 16, "none", False),
        (4, 48, 16, "uint8", True),  # 3 blocks: an odd count of packed zero points
        (4, 40, 16, "float", False),  # K not a multiple of the block
        (8, 32, 16, "uint8", True),
    ],
)
def test_matmul_nbits(bits: int, k: int, block: int, zero_points: str, bias: bool) -> None:
    """dA, dbias and the float scales and zero points against finite differences through
    onnxruntime's own MatMulNBits, and dA against dY W with W dequantized here: the layout the rule
    unpacks is onnxruntime's."""
    n = 6
    a = rnd(2, 3, k)
    packed, scales, zp, w = quantize(rnd(n, k), bits, block, zero_points)
    inputs = [a, packed, scales, zp, None, rnd(n) if bias else None]
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    model = contrib_model("MatMulNBits", inputs, ["y"], attrs)
    check(model, inputs)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    from onnxgrad.testing import run_gradients

    dy = rnd(2, 3, n)
    _, grads = run_gradients(graphs, {i.name: inputs[int(i.name[2:])] for i in model.graph.input}, {"y": dy})
    want = dy @ w
    np.testing.assert_allclose(grads["in0"], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- normalizations ----------------------------------------------------------------------------
@pytest.mark.parametrize("outputs", [["y"], ["y", "", "", "sum"]], ids=["y", "y-and-sum"])
@pytest.mark.parametrize("optional", ["all", "no-bias", "no-beta-no-bias"])
def test_skip_layer_norm(outputs: list, optional: str) -> None:
    h = 8
    inputs = [rnd(2, 3, h), rnd(2, 3, h), 1 + rnd(h) * 0.3, rnd(h), rnd(h)]
    if optional != "all":
        inputs[4] = None
    if optional == "no-beta-no-bias":
        inputs = inputs[:3]
    model = contrib_model("SkipLayerNormalization", inputs, outputs, {"epsilon": 1e-5})
    check(model, inputs)


def test_skip_layer_norm_skip_broadcast() -> None:
    h = 8
    inputs = [rnd(2, 3, h), rnd(3, h), 1 + rnd(h) * 0.3, rnd(h)]
    check(contrib_model("SkipLayerNormalization", inputs, ["y"], {"epsilon": 1e-5}), inputs)


@pytest.mark.parametrize("outputs", [["y"], ["y", "", "", "sum"]], ids=["y", "y-and-sum"])
def test_skip_simplified_layer_norm(outputs: list) -> None:
    h = 8
    inputs = [rnd(2, 3, h), rnd(2, 3, h), 1 + rnd(h) * 0.3, rnd(h)]
    check(contrib_model("SkipSimplifiedLayerNormalization", inputs, outputs, {"epsilon": 1e-6}), inputs)


@pytest.mark.parametrize(
    "outputs", [["y", "mean", "inv_std", "sum"], ["y", "", "inv_std"]], ids=["all", "inv-std"]
)
def test_skip_layer_norm_statistics(outputs: list) -> None:
    """The mean and inverse standard deviation outputs carry gradients too."""
    h = 8
    inputs = [rnd(2, 3, h), rnd(2, 3, h), 1 + rnd(h) * 0.3, rnd(h)]
    check(contrib_model("SkipLayerNormalization", inputs, outputs, {"epsilon": 1e-5}), inputs)


def test_skip_simplified_layer_norm_mean_refused() -> None:
    h = 8
    inputs = [rnd(2, 3, h), rnd(2, 3, h), rnd(h)]
    model = contrib_model("SkipSimplifiedLayerNormalization", inputs, ["y", "mean"], {"epsilon": 1e-5})
    with pytest.raises(
        GradientNotImplementedError, match=r"output 1 \('mean'.*'SkipSimplifiedLayerNormalization'"
    ):
        build_gradient(model, inputs_requiring_grad=["in0"])


def test_simplified_layer_norm() -> None:
    """onnxruntime's default-domain op (onnxruntime-genai writes it), which no ONNX opset has."""
    inputs = [rnd(2, 3, 8), 1 + rnd(8) * 0.3]
    model = contrib_model("SimplifiedLayerNormalization", inputs, ["y"], {"epsilon": 1e-6}, domain="")
    check(model, inputs)


@pytest.mark.parametrize("outputs", [["y"], ["y", "mean", "inv_std"]], ids=["y", "y-and-statistics"])
def test_layer_norm_before_opset_17(outputs: list) -> None:
    """LayerNormalization in an opset-16 model: onnxruntime's own kernel, ONNX's op from 17."""
    inputs = [rnd(2, 3, 8), 1 + rnd(8) * 0.3, rnd(8)]
    model = contrib_model("LayerNormalization", inputs, outputs, {"epsilon": 1e-5}, domain="", opset=16)
    check(model, inputs)


@pytest.mark.parametrize(
    "variant", ["segments-positions", "position-ids", "shared-position-ids", "words-only"]
)
def test_embed_layer_norm(variant: str) -> None:
    """Every float input: the three tables (rows gathered, repeated ids), gamma and beta; the sum
    output too where it is used."""
    b, s, h = 2, 4, 8
    ids = np.array([[1, 2, 3, 1], [4, 0, 1, 2]], np.int32)
    seg_ids = np.array([[0, 0, 1, 1], [0, 1, 1, 1]], np.int32)
    inputs: list = [ids, seg_ids, rnd(5, h), rnd(6, h), rnd(2, h), 1 + rnd(h) * 0.3, rnd(h)]
    outputs = ["y", "mask_index"]
    if variant == "position-ids":
        inputs += [None, np.array([[3, 2, 1, 0], [0, 0, 5, 1]], np.int32)]
        outputs.append("sum")
    elif variant == "shared-position-ids":
        inputs += [None, np.array([[3, 2, 1, 3]], np.int32)]
    elif variant == "words-only":
        inputs[1] = inputs[4] = None
    model = contrib_model("EmbedLayerNormalization", inputs, outputs, {"epsilon": 1e-5})
    assert b and s
    check(model, inputs)


# ---- RotaryEmbedding -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "positions", "interleaved", "rot"),
    [
        ("3d", "ids", 0, 0),
        ("3d", "ids", 1, 0),
        ("4d", "ids", 0, 0),
        ("3d", "offset", 0, 0),
        ("3d", "ids", 0, 4),
    ],
    ids=["3d", "interleaved", "4d", "offset", "partial"],
)
def test_rotary_embedding(layout: str, positions: str, interleaved: int, rot: int) -> None:
    """X and both caches (rows gathered by position, repeated positions adding up)."""
    b, s, heads, d = 2, 3, 2, 8
    half = (rot or d) // 2
    angles = RNG.random((6, half)) * 3
    x = rnd(b, s, heads * d) if layout == "3d" else rnd(b, heads, s, d)
    pos = np.array([[0, 1, 2], [2, 1, 4]], np.int64) if positions == "ids" else np.array([1], np.int64)
    inputs = [x, pos, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    attrs = {"interleaved": interleaved}
    if layout == "3d":
        attrs["num_heads"] = heads
    if rot:
        attrs["rotary_embedding_dim"] = rot
    check(contrib_model("RotaryEmbedding", inputs, ["y"], attrs), inputs)


# ---- types, coverage, errors ------------------------------------------------------------------
def test_output_types_are_inferred() -> None:
    """ONNX shape inference leaves contrib outputs untyped; onnxgrad declares dtype and shape."""
    h = 8
    inputs = [rnd(2, 3, h), rnd(2, 3, h), rnd(h)]
    model = contrib_model("SkipLayerNormalization", inputs, ["y", "", "", "sum"], {"epsilon": 1e-5})
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    model.graph.node.append(helper.make_node("MatMul", ["sum", "w"], ["z"]))
    model.graph.initializer.append(numpy_helper.from_array(rnd(h, 5), "w"))
    infos = infer_value_infos(model)
    assert (infos["y"].dtype, infos["y"].shape) == (TensorProto.FLOAT, (2, 3, h))
    assert infos["sum"].shape == (2, 3, h)
    assert infos["z"].shape == (2, 3, 5)


def test_supported_ops_list_the_contrib_ops() -> None:
    ops = supported_ops()
    for op in (
        "FusedMatMul", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd", "SkipLayerNormalization",
        "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization",
        "RotaryEmbedding", "MatMulNBits", "Attention", "MultiHeadAttention", "GroupQueryAttention",
    ):  # fmt: skip
        assert f"com.microsoft.{op}" in ops, op
    assert ops["SimplifiedLayerNormalization"] == "rule"


def test_op_without_rule_names_op_domain_node() -> None:
    inputs = [rnd(2, 3, 8)]
    model = contrib_model("Gelu", inputs, ["y"])
    model.graph.node[0].op_type = "NoSuchGelu"
    model.graph.node[0].name = "mystery"
    with pytest.raises(
        GradientNotImplementedError,
        match=r"no gradient rule for node 'mystery': op 'NoSuchGelu', domain 'com.microsoft'",
    ):
        build_gradient(model, inputs_requiring_grad=["in0"])


def test_unknown_rank_names_the_producer() -> None:
    """A MatMul after an op that inference cannot type: an onnxgrad error naming the MatMul and the
    producer (op, domain) that left the rank unknown, not a bare ValueError."""
    inputs = [rnd(2, 3, 8)]
    model = contrib_model("Gelu", inputs, ["h"])
    model.graph.node[0].op_type = "NoSuchGelu"
    model.graph.node[0].name = "mystery"
    model.graph.node.append(helper.make_node("MatMul", ["h", "w"], ["z"], name="mm"))
    model.graph.initializer.append(numpy_helper.from_array(rnd(8, 5), "w"))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, (2, 3, 5)))
    with pytest.raises(
        GradientNotImplementedError,
        match=r"MatMul 'mm': the rank of input 'h' must be known; it is the output of node 'mystery' "
        r"\(op 'NoSuchGelu', domain 'com.microsoft'\)",
    ):
        build_gradient(model, trainable=["w"])


# ---- attention ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variant", ["plain", "bias-causal", "padding-mask", "lengths-attn-bias", "cross-presents"]
)
def test_multi_head_attention(variant: str) -> None:
    b, s, t, heads, h = 2, 3, 3, 2, 4
    if variant == "cross-presents":
        t = 5
    inputs: list = [rnd(b, s, heads * h), rnd(b, t, heads * h), rnd(b, t, heads * h)]
    attrs: dict[str, Any] = {"num_heads": heads}
    outputs = ["y"]
    if variant == "bias-causal":
        inputs.append(rnd(3 * heads * h))
        attrs["unidirectional"] = 1
    elif variant == "padding-mask":
        inputs += [None, np.array([[1, 1, 0], [1, 1, 1]], np.int32)]
    elif variant == "lengths-attn-bias":
        inputs += [rnd(3 * heads * h), np.array([2, 3], np.int32), rnd(1, heads, s, t)]
        attrs["scale"] = 0.3
    elif variant == "cross-presents":
        outputs = ["y", "pk", "pv"]
    check(contrib_model("MultiHeadAttention", inputs, outputs, attrs), inputs)


@pytest.mark.parametrize(
    "variant", ["plain", "lengths-causal", "raw-mask", "3d-mask-attn-bias", "hidden-sizes"]
)
def test_contrib_attention(variant: str) -> None:
    """X, the packed weights and bias (and attention_bias) against finite differences."""
    b, s, din, heads = 2, 3, 6, 2
    sizes = [8, 8, 8]
    attrs: dict[str, Any] = {"num_heads": heads}
    mask = None
    extra: list = []
    if variant == "lengths-causal":
        mask, attrs["unidirectional"] = np.array([2, 3], np.int32), 1
    elif variant == "raw-mask":
        mask = np.array([[1, 0, 1], [1, 1, 1]], np.int32)
    elif variant == "3d-mask-attn-bias":
        mask = np.array([[[1, 1, 0], [1, 1, 1], [0, 1, 1]]] * 2, np.int32)
        extra = [None, rnd(1, heads, s, s)]
    elif variant == "hidden-sizes":
        sizes = [8, 8, 4]
        attrs["qkv_hidden_sizes"] = sizes
    inputs: list = [rnd(b, s, din), rnd(din, sum(sizes)) * 0.5, rnd(sum(sizes)), mask, *extra]
    while inputs[-1] is None:
        inputs.pop()
    check(contrib_model("Attention", inputs, ["y"], attrs, constant=[]), inputs)


@pytest.mark.parametrize(
    "variant",
    [
        "gqa",
        "mha-presents",
        "padded",
        "empty-past",
        "empty-past-padded",
        "past",
        "past-presents",
        "decode-padded",
    ],
)
def test_group_query_attention(variant: str) -> None:
    """A prompt, with or without a past (onnxruntime's CPU kernel wants head sizes that are
    multiples of 8); the past caches take gradients too. ``decode-padded``: one new token after a
    past of 3 rows of which the second sequence holds 1 (its new key goes to row 1 of present_key,
    and its past rows 1 and 2 are read by no query). Without its present outputs, onnxruntime computes
    a single new token after a past otherwise (in the past's buffer)."""
    b, s, heads, kv_heads, h = 2, 4, 4, 2, 8
    outputs = ["y"]
    if variant in ("mha-presents", "past-presents", "decode-padded"):  # a new token needs them (below)
        outputs = ["y", "pk", "pv"]
    if variant == "mha-presents":
        kv_heads = 4
    past = 2 if variant.startswith("past") else 0
    if past:  # onnxruntime: "batch_size must be 1 when sequence_length > 1 and past context is given"
        b = 1
    if variant == "decode-padded":
        s, past = 1, 3
    lengths = np.array([past + s - 1] * b, np.int32)
    if variant.endswith("padded"):
        lengths = np.array([s - 1, s - 3], np.int32) if not past else np.array([past + s - 1, 1], np.int32)
    caches: list = [None, None]
    if variant.startswith(("past", "empty-past", "decode")):
        caches = [rnd(b, kv_heads, past, h), rnd(b, kv_heads, past, h)]
    inputs: list = [
        rnd(b, s, heads * h), rnd(b, s, kv_heads * h), rnd(b, s, kv_heads * h), *caches,
        lengths, np.array(past + s, np.int32),
    ]  # fmt: skip
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads}
    check(contrib_model("GroupQueryAttention", inputs, outputs, attrs), inputs)


@pytest.mark.parametrize("variant", ["separate", "packed", "interleaved", "partial", "decode-padded"])
def test_group_query_attention_rotary(variant: str) -> None:
    """do_rotary=1 (onnxruntime turns Q and K itself), Q, K, V separate or packed as onnxruntime-genai's
    builder writes them (``interleaved`` pairs; ``partial``: the first 16 of 32 dims turn; one new
    token after a past, the second sequence's past shorter): differentiated unfused
    (autodiff/unfuse.py), which onnxruntime computes bit for bit, against finite differences."""
    b, s, h, rot, past = 2, 3, 16, 16, 0
    if variant == "partial":
        h = 32
    if variant == "decode-padded":
        s, past = 1, 2
    qkv = (
        [rnd(b, s, 4 * h), None, None]
        if variant != "separate"
        else [rnd(b, s, 2 * h), rnd(b, s, h), rnd(b, s, h)]
    )
    caches = [rnd(b, 1, past, h), rnd(b, 1, past, h)] if past else [None, None]
    lengths = np.array([s - 1, s - 2] if not past else [past + s - 1, past + s - 2], np.int32)
    angles = RNG.random((8, rot // 2)) * 3
    inputs: list = [*qkv, *caches, lengths, np.array(past + s, np.int32)]
    inputs += [np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)]
    attrs = {
        "num_heads": 2,
        "kv_num_heads": 1,
        "do_rotary": 1,
        "rotary_interleaved": int(variant == "interleaved"),
    }
    # with a past, onnxruntime computes a single new token only when the node has its present outputs
    outputs = ["y", "pk", "pv"] if past else ["y"]
    model = contrib_model("GroupQueryAttention", inputs, outputs, attrs, constant=[7, 8])
    unfused = rewrite_for_training(onnx.load_from_string(model.SerializeToString()))
    assert "RotaryEmbedding" in {n.op_type for n in unfused.graph.node}
    feeds = {i.name: inputs[int(i.name[2:])] for i in model.graph.input}
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    for got, want in zip(run(unfused), run(model)):
        np.testing.assert_array_equal(got, want)
    check(model, inputs)
