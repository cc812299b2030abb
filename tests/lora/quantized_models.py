"""A float MLP and its quantized forms as onnxruntime's quantizers write them, for the QLoRA tests.

The float model: ``x [N, 32] -> MatMul W1 [32, 64] + b1 -> Relu -> MatMul W2 [64, 8] -> y``. Its
quantized forms (``KINDS``):

* ``int4_qdq``: ``MatMulNBitsQuantizer(quant_format=QDQ)``: blocked uint4 DequantizeLinear (block 16);
* ``int8_qdq``: weight-only int8 DequantizeLinear written here, W1 per tensor, W2 per channel;
* ``int4_nbits``: ``MatMulNBitsQuantizer`` (``com.microsoft.MatMulNBits``, packed zero points);
* ``int8_dynamic``: ``quantize_dynamic`` (DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul);
* ``int8_static``: ``quantize_static`` QDQ per channel, activations quantized too.

:func:`dequantized_weights` computes the weights each quantized model uses with onnxruntime's own
kernels (or by the documented formula for MatMulInteger), independently of ``onnxgrad.lora``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxgrad.testing import model_values

F32 = np.float32
KINDS = ("int4_qdq", "int8_qdq", "int4_nbits", "int8_dynamic", "int8_static")
EXACT_KINDS = ("int4_qdq", "int8_qdq", "int4_nbits")  # weight-only: the float reference is exact
IN, HIDDEN, OUT = 32, 64, 8


def float_mlp(seed: int = 0) -> onnx.ModelProto:
    """The float model (opset 21, IR 10)."""
    r = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((r.standard_normal((IN, HIDDEN)) * 0.3).astype(F32), "W1"),
        numpy_helper.from_array((r.standard_normal(HIDDEN) * 0.1).astype(F32), "b1"),
        numpy_helper.from_array((r.standard_normal((HIDDEN, OUT)) * 0.3).astype(F32), "W2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def _weight_only_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """W1 per tensor, W2 per output channel (axis 1), int8 symmetric, behind DequantizeLinear."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    kept = [t for t in out.graph.initializer if t.name not in ("W1", "W2")]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    dq_nodes = []
    for name, per_channel in (("W1", False), ("W2", True)):
        w = inits[name]
        scale = (np.abs(w).max(axis=0) if per_channel else np.abs(w).max()) / 127.0
        q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
        zp = np.zeros_like(scale, dtype=np.int8)
        out.graph.initializer.extend(
            [
                numpy_helper.from_array(q, f"{name}_quantized"),
                numpy_helper.from_array(np.asarray(scale, F32), f"{name}_scale"),
                numpy_helper.from_array(zp, f"{name}_zero_point"),
            ]
        )
        dq_nodes.append(
            helper.make_node(
                "DequantizeLinear",
                [f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"],
                [f"{name}_dequantized"],
                name=f"{name}_dq",
                axis=1,
            )
        )
    for node in out.graph.node:
        for k, i in enumerate(node.input):
            if i in ("W1", "W2"):
                node.input[k] = f"{i}_dequantized"
    nodes = dq_nodes + list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def quantized(kind: str, tmp_path: Path, seed: int = 0) -> onnx.ModelProto:
    """The float model quantized as ``kind`` says (see the module's docstring)."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = float_mlp(seed)
    if kind == "int8_qdq":
        return _weight_only_int8(model)
    src, dst = tmp_path / "float.onnx", tmp_path / f"{kind}.onnx"
    onnx.save(model, src)
    if kind in ("int4_qdq", "int4_nbits"):
        fmt = QuantFormat.QDQ if kind == "int4_qdq" else QuantFormat.QOperator
        quantizer = MatMulNBitsQuantizer(model, block_size=16, is_symmetric=False, quant_format=fmt)
        quantizer.process()
        return quantizer.model.model
    if kind == "int8_dynamic":
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8)
        return onnx.load(dst)
    r = np.random.default_rng(seed + 1)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": r.standard_normal((16, IN)).astype(F32)} for _ in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return onnx.load(dst)


def dequantized_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """W1 and W2 ([in, out], float32) as the quantized ``model`` uses them: the output of its
    DequantizeLinear nodes and of MatMulNBits on an identity matrix as onnxruntime computes them,
    ``(q - zero point) * scale`` for MatMulInteger."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        weight = next((i for i in node.input if i.startswith(("W1", "W2")) and i in inits), None)
        if weight is None:
            continue
        name = weight[:2]
        if node.op_type == "DequantizeLinear":
            feeds = {"x": np.zeros((1, IN), F32)}
            out[name] = model_values(model, feeds)[node.output[0]].astype(F32)
        elif node.op_type == "MatMulNBits":
            k = next(a.i for a in node.attribute if a.name == "K")
            one = onnx.ModelProto()
            one.CopyFrom(model)
            one.graph.ClearField("node")
            one.graph.node.append(node)
            one.graph.node[0].input[0] = "x"
            kept = [t for t in one.graph.initializer if t.name in node.input]
            one.graph.ClearField("initializer")
            one.graph.initializer.extend(kept)
            one.graph.ClearField("input")
            one.graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [k, k]))
            one.graph.ClearField("output")
            one.graph.output.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
            import onnxruntime as ort

            session = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"])
            out[name] = session.run(None, {"x": np.eye(k, dtype=F32)})[0]  # eye @ W^T: [K, N]
        elif node.op_type == "MatMulInteger":
            q = inits[weight].astype(np.float64)
            zp = inits[node.input[3]].astype(np.float64)
            out[name] = ((q - zp) * inits[f"{name}_scale"].astype(np.float64)).astype(F32)
    assert set(out) == {"W1", "W2"}, out.keys()
    return out
