"""The MatMulNBits layout of onnxgrad.model.nbits, the one that both the gradient rule and
onnxgrad.lora read: checked against onnxruntime's own MatMulNBits kernel (an identity A gives W^T),
then through the rule's backward on a constant (packed, initializer) weight, where the rule
re-packs the zero points for onnxruntime's DequantizeLinear: odd rows and odd block counts
included (4-bit values share bytes across row and block boundaries there)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import build_gradient
from onnxgrad.model.nbits import NBitsLayout, pack_bits, unpack_bits
from onnxgrad.testing import assert_allclose_scaled, run_gradients

F32 = np.float32
CASES = [  # bits, K, block, zero points, N
    (4, 48, 16, "uint8", 3),  # 3 blocks a row, 9 zero points: odd both ways
    (4, 40, 16, "float", 2),  # K not a multiple of the block
    (4, 32, 16, "none", 2),  # the default zero point 2^(bits - 1)
    (8, 32, 16, "uint8", 3),
]


def _model(bits: int, k: int, block: int, zero_points: str, n: int) -> tuple[onnx.ModelProto, NBitsLayout]:
    """``y = a W^T`` through MatMulNBits, its B, scales and zero points initializers."""
    layout = NBitsLayout(bits, block, n, k)
    r = np.random.default_rng(bits * 100 + k + n)
    top = 2**bits
    q = r.integers(0, top, size=(n, layout.blocks, block))
    inits = [
        numpy_helper.from_array(pack_bits(q, bits), "B"),
        numpy_helper.from_array((r.uniform(0.5, 1.5, n * layout.blocks) / top).astype(F32), "scales"),
    ]
    if zero_points == "uint8":
        zq = r.integers(0, top, size=(n, layout.blocks))
        inits.append(numpy_helper.from_array(pack_bits(zq, bits).reshape(-1), "zero_points"))
    elif zero_points == "float":
        inits.append(numpy_helper.from_array(r.uniform(0, top, n * layout.blocks).astype(F32), "zero_points"))
    names = ["a", "B", "scales"] + (["zero_points"] if zero_points != "none" else [])
    node = helper.make_node(
        "MatMulNBits", names, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block
    )
    graph = helper.make_graph(
        [node],
        "nbits",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    return model, layout


def _weight(model: onnx.ModelProto, layout: NBitsLayout) -> np.ndarray:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return layout.dequantize(inits["B"], inits["scales"], inits.get("zero_points"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}bit-K{c[1]}-{c[3]}-N{c[4]}")
def test_layout_reads_what_onnxruntime_computes(case: tuple) -> None:
    import onnxruntime as ort

    model, layout = _model(*case)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (wt,) = session.run(None, {"a": np.eye(layout.k, dtype=F32)})
    w = _weight(model, layout)
    assert w.shape == (layout.n, layout.k)
    assert_allclose_scaled(wt.T, w, rtol=1e-6)  # (q - z) s: one float32 rounding of each product


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}bit-K{c[1]}-{c[3]}-N{c[4]}")
def test_rule_on_a_packed_constant_weight(case: tuple) -> None:
    """dA = dY W, W from the layout above: the rule's DequantizeLinear of B's own bytes and of its
    re-packed zero points."""
    model, layout = _model(*case)
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["a"])
    assert any(n.op_type == "DequantizeLinear" for n in graphs.backward.graph.node)  # the packed path
    r = np.random.default_rng(1)
    a = r.standard_normal((5, layout.k)).astype(F32)
    dy = r.standard_normal((5, layout.n)).astype(F32)
    _, grads = run_gradients(graphs, {"a": a}, {"y": dy})
    assert_allclose_scaled(grads["a"], dy.astype(np.float64) @ _weight(model, layout), rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("count", [1, 6, 7])
def test_pack_and_unpack_are_inverse(bits: int, count: int) -> None:
    values = np.random.default_rng(count).integers(0, 2**bits, size=(3, count))
    packed = pack_bits(values, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, -(-count * bits // 8))
    np.testing.assert_array_equal(unpack_bits(packed, bits, count), values)
    if bits == 4:  # low bits first
        assert packed[0, 0] == values[0, 0] | ((values[0, 1] if count > 1 else 0) << 4)
