"""QLoRA on a tiny GPT-2 (transformers, random weights, torch.onnx.export(dynamo=True)) quantized by
onnxruntime: ``quantize_dynamic`` (int8, every Gemm and MatMul) and ``MatMulNBitsQuantizer`` (4 bits:
the MatMul of the head; the Gemms keep float weights and float adapters). Ten training steps follow
the float GPT-2 holding the dequantized weights and the same adapters."""

from __future__ import annotations

import functools
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
def _gpt2() -> tuple[onnx.ModelProto, np.ndarray]:
    model, ids = _export(None)
    return model, ids.numpy()


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
    ("kind", "quantized_count", "rtol"), [("int4_nbits", 1, 1e-4), ("int8_dynamic", 9, 3e-2)]
)
def test_qlora_gpt2_follows_dequantized_float_model(
    kind: str, quantized_count: int, rtol: float, tmp_path: Path
) -> None:
    base, ids = _gpt2()
    q, deq = _quantize(kind, base, tmp_path)
    assert len(deq) == quantized_count
    adapted = lora.add_adapters(q, "*", rank=4, alpha=8)
    names = lora.adapter_names(adapted)
    assert len(names) == 2 * 9  # 4 weights a layer, 2 layers, and the head
    ref = lora.add_adapters(lora.with_values(base, deq), "*", rank=4, alpha=8)
    assert sorted(lora.adapter_names(ref)) == sorted(names)
    shapes = {t.name: tuple(t.dims) for t in adapted.graph.initializer}
    r = np.random.default_rng(0)
    start = {n: (r.standard_normal(shapes[n]) * 0.05).astype(np.float32) for n in names}
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)

    def losses(model: onnx.ModelProto, options: object) -> list[float]:
        fb = onnxgrad.ForwardBackward(lora.with_values(model, start), session_options=options)
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
            fb.set_parameters({n: fb.parameters[n] - 0.1 * g for n, g in grads.items()})
        return out

    got, want = losses(adapted, lora.session_options()), losses(ref, None)
    print(
        f"GPT-2 {kind}: loss {got[0]:.4f} -> {got[-1]:.4f} (float reference {want[0]:.4f} -> {want[-1]:.4f})"
    )
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=rtol)
