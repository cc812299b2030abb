"""Trained scales of a QDQ model (quantize_static): the model onnxruntime runs at its default
optimization level (QGemm, whose bias scale is x_scale * w_scale) is the model trained."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad

ort = pytest.importorskip("onnxruntime")
IN, HIDDEN, OUT = 16, 32, 4
SCALES = ["W1_scale", "W2_scale", "x_scale", "a_scale"]


def _qdq_gemm_mlp(tmp_path: Path) -> onnx.ModelProto:
    """x -> Gemm (bias) -> Relu -> Gemm (bias), quantized by quantize_static (QDQ, per tensor): the
    biases are int32 behind DequantizeLinear with the scale x_scale * w_scale."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    r = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((r.standard_normal((HIDDEN, IN)) * 0.3).astype(np.float32), "W1"),
        numpy_helper.from_array((r.standard_normal(HIDDEN) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((r.standard_normal((OUT, HIDDEN)) * 0.3).astype(np.float32), "W2"),
        numpy_helper.from_array((r.standard_normal(OUT) * 0.1).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Gemm", ["a", "W2", "b2"], ["y"], transB=1, name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
        inits,
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
        tmp_path / "f.onnx",
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"x": r.standard_normal((16, IN)).astype(np.float32)} for _ in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantize_static(
        tmp_path / "f.onnx", tmp_path / "q.onnx", Reader(), quant_format=QuantFormat.QDQ, per_channel=False
    )
    return onnx.load(tmp_path / "q.onnx")


def _default_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """What a user serving the trained model gets: every optimization (the QDQ fusion included)."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_trained_scales_run_the_same_in_a_default_session(tmp_path: Path) -> None:
    q = _qdq_gemm_mlp(tmp_path)
    r = np.random.default_rng(1)
    x = r.standard_normal((64, IN)).astype(np.float32)
    target = r.standard_normal((64, OUT)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onnxgrad.errors.GradientWarning)  # the straight-through rule
        fb = onnxgrad.ForwardBackward(q, trainable=SCALES)
    before = {k: v.copy() for k, v in fb.parameters.items()}
    for _ in range(20):
        res = fb.forward({"x": x})
        err = res.outputs[0] - target
        grads = res.backward([2 * err / err.size])
        fb.set_parameters({k: v - 1e-5 * grads[k] for k, v in fb.parameters.items()})
    moved = {k: float(np.abs(fb.parameters[k] / before[k] - 1).max()) for k in SCALES}
    assert min(moved.values()) > 1e-3, moved  # every scale trained
    evaluated = fb.forward({"x": x}, training=False).outputs[0]
    served = _default_session(fb.to_onnx()).run(None, {"x": x})[0]
    # the fused kernel and the float graph round differently (int32 accumulation, then scales)
    np.testing.assert_allclose(served, evaluated, rtol=0, atol=1e-5 * np.abs(evaluated).max())


def test_trainer_evaluate_is_what_a_default_session_gives(tmp_path: Path) -> None:
    from onnxgrad.train import Trainer

    q = _qdq_gemm_mlp(tmp_path)
    r = np.random.default_rng(2)
    x = r.standard_normal((64, IN)).astype(np.float32)
    target = r.standard_normal((64, OUT)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onnxgrad.errors.GradientWarning)
        trainer = Trainer(
            q, loss="mse", trainable=SCALES, optimizer="sgd", lr=1e-5, batch_size=16, progress=False
        )
        trainer.fit({"x": x, "target": target}, epochs=3)
        loss = trainer.evaluate({"x": x, "target": target})
    loss = loss["loss"] if isinstance(loss, dict) else loss
    served = _default_session(trainer.to_onnx()).run(None, {"x": x})[0]
    assert abs(float(np.mean((served - target) ** 2)) - float(loss)) <= 1e-5 * float(loss)


def test_the_bias_reads_the_product_of_the_scales(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onnxgrad.errors.GradientWarning)
        graphs = onnxgrad.build_gradient(_qdq_gemm_mlp(tmp_path), trainable=["W1_scale"])
    forward = graphs.forward.graph
    producer = {o: n for n in forward.node for o in n.output}
    (bias_dq,) = [n for n in forward.node if n.op_type == "DequantizeLinear" and n.output[0] == "b1"]
    scale = producer[bias_dq.input[1]]
    if scale.op_type == "Reshape":  # to the stored scale's shape
        scale = producer[scale.input[0]]
    assert scale.op_type == "Mul" and sorted(scale.input) == ["W1_scale", "x_scale"]
    assert "b1_quantized_scale" not in {t.name for t in forward.initializer}


def test_scales_do_not_train_by_default(tmp_path: Path) -> None:
    """The bias's Mul(x_scale, w_scale) does not make the scales weights: with no trainable= a QDQ
    model has nothing to train, and every front end says so (docs/quantized.md), pointing to
    trainable= and lora.add_adapters; named, the scales train."""
    from onnxgrad.autodiff.params import select_parameters
    from onnxgrad.autodiff.prepare import prepare
    from onnxgrad.train import Trainer

    q = _qdq_gemm_mlp(tmp_path)
    selection = select_parameters(prepare(q).checked.proto)  # the graph after the bias rewrite
    assert selection.trainable == []
    assert {selection.reasons[s] for s in SCALES} == {"quantization scale"}
    said = r"nothing to differentiate.*trainable=\[\.\.\.\].*onnxgrad\.lora\.add_adapters"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", onnxgrad.errors.GradientWarning)
        with pytest.raises(onnxgrad.errors.InputError, match=said):
            onnxgrad.ForwardBackward(q)
        with pytest.raises(onnxgrad.errors.InputError, match=said):
            Trainer(q, loss="mse", lr=1e-5, batch_size=16, progress=False)
        assert sorted(onnxgrad.ForwardBackward(q, trainable=SCALES).parameters) == sorted(SCALES)
