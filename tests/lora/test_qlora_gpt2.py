"""QLoRA on a tiny GPT-2 (transformers, random weights, torch.onnx.export(dynamo=True)) quantized by
onnxruntime: ``quantize_dynamic`` (int8, every Gemm and MatMul) and ``MatMulNBitsQuantizer`` (4 bits:
the MatMul of the head; the Gemms keep float weights and float adapters). Ten training steps follow
the float GPT-2 holding the dequantized weights and the same adapters. ``quantize_static`` (QDQ int8,
activations quantized too) trains under the straight-through estimator."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnxgrad
from onnxgrad import lora

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime.quantization")

from .test_lora_gpt2 import _export

pytestmark = pytest.mark.slow  # one GPT-2 export: about a minute on 2 shared cores


@functools.cache
def _exported() -> tuple[bytes, np.ndarray]:
    model, ids = _export(None)
    return model.SerializeToString(), ids.numpy()


def _gpt2() -> tuple[onnx.ModelProto, np.ndarray]:
    """A fresh copy of the exported model (the quantizers change the model they are given)."""
    data, ids = _exported()
    return onnx.load_from_string(data), ids


def _by_weight(model: onnx.ModelProto) -> dict[str, tuple[str, str]]:
    """The float weight's name (the quantizer's suffix cut) -> the names of its adapters A and B."""
    meta = next(p.value for p in model.metadata_props if p.key == lora.LORA_KEY)
    out = {}
    for ad in json.loads(meta)["adapters"]:
        weight = ad["weight"]
        for suffix in ("_quantized", "_Q4"):
            weight = weight.removesuffix(suffix)
        out[weight] = (ad["a"], ad["b"])
    return out


def _sgd_losses(fb: onnxgrad.ForwardBackward, x: np.ndarray, y: np.ndarray, lr: float) -> list[float]:
    """The cross-entropy of the next tokens ``y`` before each of ten SGD steps on the adapters."""
    out = []
    for _ in range(10):
        res = fb.forward({"ids": x})
        logits = res.outputs[0].astype(np.float64)
        flat = logits.reshape(-1, logits.shape[-1])
        p = np.exp(flat - flat.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(float(-np.log(p[np.arange(len(y)), y]).mean()))
        p[np.arange(len(y)), y] -= 1
        grads = res.backward([(p / len(y)).reshape(logits.shape).astype(np.float32)])
        fb.set_parameters({n: fb.parameters[n] - lr * g for n, g in grads.items()})
    return out


def _quantize(
    kind: str, base: onnx.ModelProto, tmp_path: Path
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(the quantized model, float weight name -> the dequantized value it uses)."""
    if kind == "int4_nbits":
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(base, block_size=16, is_symmetric=True)
        quantizer.process()
        q = quantizer.model.model
        packed = [t.name for t in q.graph.initializer if t.name.endswith("_Q4")]
        return q, {n[: -len("_Q4")]: lora.dequantized_weight(q, n).T for n in packed}
    from onnxruntime.quantization import QuantType, quantize_dynamic

    onnx.save(base, tmp_path / "gpt2.onnx")
    quantize_dynamic(tmp_path / "gpt2.onnx", tmp_path / "gpt2_int8.onnx", weight_type=QuantType.QInt8)
    q = onnx.load(tmp_path / "gpt2_int8.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    deq = {}
    for name, value in inits.items():
        if name.endswith("_quantized"):
            w = name[: -len("_quantized")]
            zp = inits[f"{w}_zero_point"].astype(np.float64)
            deq[w] = ((value.astype(np.float64) - zp) * inits[f"{w}_scale"]).astype(np.float32)
    return q, deq


@pytest.mark.parametrize(
    ("kind", "quantized_count", "rtol"), [("int4_nbits", 1, 1e-4), ("int8_dynamic", 10, 3e-2)]
)
def test_qlora_gpt2_follows_dequantized_float_model(
    kind: str, quantized_count: int, rtol: float, tmp_path: Path
) -> None:
    base, ids = _gpt2()
    q, deq = _quantize(kind, base, tmp_path)
    assert len(deq) == quantized_count  # int8: the 9 products and the embedding table (a Gather)
    adapted = lora.add_adapters(q, "*", rank=4, alpha=8)
    names = lora.adapter_names(adapted)
    assert len(names) == 2 * 9  # 4 weights a layer, 2 layers, and the head
    ref = lora.add_adapters(lora.with_values(base, deq), "*", rank=4, alpha=8)
    # the same weights adapted; the names of the head's adapters may differ (the exporter's torch
    # name is read from the MatMul, which the quantized model no longer has)
    q_ad, ref_ad = _by_weight(adapted), _by_weight(ref)
    assert set(q_ad) == set(ref_ad)
    shapes = {t.name: tuple(t.dims) for t in adapted.graph.initializer}
    r = np.random.default_rng(0)
    start = {n: (r.standard_normal(shapes[n]) * 0.05).astype(np.float32) for n in names}
    ref_start = {ref_ad[w][k]: start[q_ad[w][k]] for w in q_ad for k in (0, 1)}
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)

    def losses(model: onnx.ModelProto, values: dict, options: object) -> list[float]:
        fb = onnxgrad.ForwardBackward(lora.with_values(model, values), session_options=options)
        return _sgd_losses(fb, x, y, 0.1)

    got, want = losses(adapted, start, lora.session_options()), losses(ref, ref_start, None)
    print(
        f"GPT-2 {kind}: loss {got[0]:.4f} -> {got[-1]:.4f} (float reference {want[0]:.4f} -> {want[-1]:.4f})"
    )
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=rtol)


def test_qlora_gpt2_static_qdq_int8_trains(tmp_path: Path) -> None:
    """quantize_static QDQ (int8 weights behind DequantizeLinear, activations quantized): every
    weight of a product gets adapters, and ten steps lower the loss."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    base, ids = _gpt2()
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)
    onnx.save(base, tmp_path / "gpt2.onnx")

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = iter([{"ids": x}])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    quantize_static(
        tmp_path / "gpt2.onnx", tmp_path / "gpt2_qdq.onnx", Reader(), quant_format=QuantFormat.QDQ
    )
    q = onnx.load(tmp_path / "gpt2_qdq.onnx")
    adapted = lora.add_adapters(q, "*", rank=4, alpha=8)
    assert len(lora.adapter_names(adapted)) == 2 * 9
    fb = onnxgrad.ForwardBackward(adapted, session_options=lora.session_options())
    losses = _sgd_losses(fb, x, y, 0.1)
    print(f"GPT-2 int8_static: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.9 * losses[0]
