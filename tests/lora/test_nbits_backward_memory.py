"""The backward of MatMulNBits keeps 4-bit (and 8-bit) weights packed: onnxruntime must not
constant-fold their dequantization into a float (N, K) initializer of the backward session (the
optimized graph onnxruntime writes is read back), and the gradients stay those of the dequantized
weight (finite differences, and dY W with W dequantized independently)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnxgrad
from onnxgrad import lora
from onnxgrad.autodiff import build_gradient
from onnxgrad.runtime.runner import default_options
from onnxgrad.testing import assert_allclose_scaled, run_gradients

from ..autodiff.test_rules_contrib import check, contrib_model, quantize, rnd
from .quantized_models import quantized

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def _float_initializers(backward: onnx.ModelProto, tmp_path: Path) -> dict[str, int]:
    """name -> element count of the float initializers of ``backward`` once onnxruntime optimized it
    (default graph optimizations, constant folding included)."""
    options = default_options()
    options.optimized_model_filepath = str(tmp_path / "backward_optimized.onnx")
    ort.InferenceSession(backward.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    return {t.name: int(np.prod(t.dims)) for t in optimized.graph.initializer if t.data_type in FLOATS}


@pytest.mark.parametrize(
    ("bits", "k", "block", "zero_points"),
    [
        (4, 64, 16, "none"),
        (4, 48, 16, "uint8"),  # 3 blocks: an odd count of packed zero points
        (4, 40, 16, "float"),  # K not a multiple of the block
        (8, 32, 16, "uint8"),
    ],
)
def test_backward_holds_no_dequantized_weight(
    bits: int, k: int, block: int, zero_points: str, tmp_path: Path
) -> None:
    n = 24
    a = rnd(2, 3, k)
    packed, scales, zp, w = quantize(rnd(n, k), bits, block, zero_points)
    inputs = [a, packed, scales, zp]
    attrs = {"K": k, "N": n, "bits": bits, "block_size": block}
    # the weight, its scales and zero points are initializers, as in a deployed model
    model = contrib_model("MatMulNBits", inputs, ["y"], attrs, constant=(1, 2, 3))
    graphs = build_gradient(model, trainable=[], inputs_requiring_grad=["in0"])
    floats = _float_initializers(graphs.backward, tmp_path)
    assert all(size < n * k for size in floats.values()), floats
    dy = rnd(2, 3, n)
    _, grads = run_gradients(graphs, {"in0": a}, {"y": dy})
    assert_allclose_scaled(grads["in0"], dy @ w, rtol=1e-5)
    check(model, inputs)


def test_qlora_backward_of_a_quantized_model_keeps_weights_packed(tmp_path: Path) -> None:
    """A model quantized by onnxruntime's MatMulNBitsQuantizer, with adapters: the backward
    session's optimized graph holds no float initializer as large as a quantized weight."""
    q = lora.add_adapters(quantized("int4_nbits", tmp_path), ["W1", "W2"], rank=4)
    sizes = [
        int(onnx.helper.get_attribute_value(a))
        for node in q.graph.node
        if node.op_type == "MatMulNBits"
        for a in node.attribute
        if a.name in ("K", "N")
    ]
    smallest = min(sizes[i] * sizes[i + 1] for i in range(0, len(sizes), 2))
    fb = onnxgrad.ForwardBackward(q, session_options=lora.session_options())
    floats = _float_initializers(fb.graphs.backward, tmp_path)
    assert all(size < smallest for size in floats.values()), floats
