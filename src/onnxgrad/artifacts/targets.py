"""Which runtimes can run a step graph: the standard ops without a kernel in each.

onnxruntime-web's wasm backend is onnxruntime's CPU execution provider compiled to WebAssembly
("full ONNX operator coverage", onnxruntime-web's README), so its gaps are the CPU provider's. The
table was measured, not copied: ``tools/ort_op_coverage.py`` writes a one-node model for every
standard op (float inputs where the schema allows, at a given opset) and
``tools/ort_op_coverage.mjs`` creates a session for each on onnxruntime-web 1.30.0 (wasm, in Node)
and onnxruntime-node 1.30.0; an op whose session fails with "Could not find an implementation" has
no kernel. At opset 21 both lack ``ImageDecoder`` alone; at opset 24 they also lack the opset-22
versions of ``Bernoulli``, ``GlobalLpPool``, ``RandomNormalLike``, ``RandomUniformLike`` and
``RoiAlign``. No standard op was found in onnxruntime (CPU) but not in onnxruntime-web (wasm).
Non-standard domains (``com.microsoft``...) are refused for every target anyway.

``onnxruntime-web-webgpu`` is onnxruntime-web's WebGPU provider (its default bundle, JSEP). An op
without a WebGPU kernel does not fail there: onnxruntime runs it on the CPU (wasm) and copies tensors
between the two inside every step, so the table lists the ops whose one-node model
(``tools/ort_op_coverage.py DIR OPSET``, float inputs) the provider's verbose log reports as "webgpu
kernel not found in registries", measured by ``tools/ort_webgpu_coverage.mjs`` in headless chromium
on its software adapter at opsets 13, 18, 21 and 24 (an op missing at 13 is listed from opset 1).
``MaxUnpool``, which that generator cannot build without attributes, has no WebGPU kernel either
(the digits CNN's step failed on it). The step graphs generated for this target
(:mod:`onnxgrad.artifacts.webgpu`) avoid every op of the table but ``Identity`` (removed by
onnxruntime's graph optimizer before placement) and ``Size`` (an int64 shape computation, which
onnxruntime places on the CPU for every provider); those two are not refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import onnx

from ..errors import InputError
from ..model.graph import subgraphs

__all__ = ["DEFAULT_TARGETS", "MISSING_KERNELS", "check_targets", "missing_kernels"]

# op -> the lowest model opset at which the runtime has no kernel for it (checked on 1.30.0)
_CPU_GAPS: dict[str, int] = {
    "ImageDecoder": 1,
    "Bernoulli": 22,
    "GlobalLpPool": 22,
    "RandomNormalLike": 22,
    "RandomUniformLike": 22,
    "RoiAlign": 22,
}
# op -> the lowest model opset at which onnxruntime-web 1.30.0's WebGPU provider has no kernel for it
# fmt: off
_WEBGPU_GAPS: dict[str, int] = {
    "Acos": 24, "Acosh": 24, "AffineGrid": 21, "And": 1, "Asin": 24, "Asinh": 24, "Atan": 24, "Atanh": 24,
    "Attention": 24, "Bernoulli": 18, "BitwiseAnd": 18, "BitwiseNot": 18, "BitwiseOr": 18, "BitwiseXor": 18,
    "BlackmanWindow": 18, "CastLike": 18, "Celu": 1, "CenterCropPad": 18, "Col2Im": 18, "Compress": 1,
    "ConstantOfShape": 1, "Conv": 24, "ConvInteger": 1, "ConvTranspose": 24, "Cos": 24, "Cosh": 24,
    "DeformConv": 21, "DequantizeLinear": 24, "Det": 1, "Dropout": 1, "DynamicQuantizeLinear": 1, "Elu": 24,
    "EyeLike": 1, "Flatten": 24, "GlobalAveragePool": 24, "GlobalLpPool": 1, "GlobalMaxPool": 24,
    "GridSample": 21, "HammingWindow": 18, "HannWindow": 18, "HardSigmoid": 24, "HardSwish": 24,
    "Hardmax": 1, "Identity": 1, "InstanceNormalization": 24, "IsInf": 1, "IsNaN": 1, "LogSoftmax": 1,
    "LpNormalization": 1, "MatMulInteger": 1, "Max": 1, "MaxUnpool": 1, "Mean": 1,
    "MeanVarianceNormalization": 1, "MelWeightMatrix": 18, "Min": 1, "Mish": 18, "Mod": 1,
    "NegativeLogLikelihoodLoss": 1, "NonMaxSuppression": 1, "NonZero": 1, "OneHot": 1,
    "OptionalGetElement": 18, "OptionalHasElement": 18, "Or": 1, "PRelu": 1, "Pad": 24, "QLinearConv": 1,
    "QLinearMatMul": 1, "QuantizeLinear": 1, "RMSNormalization": 24, "RandomNormalLike": 1,
    "RandomUniformLike": 1, "Reshape": 24, "ReverseSequence": 1, "RoiAlign": 1, "RotaryEmbedding": 24,
    "Round": 1, "STFT": 18, "ScatterElements": 1, "Selu": 1, "Shape": 24, "Shrink": 1, "Sign": 1, "Sin": 24,
    "Sinh": 24, "Size": 1, "SoftmaxCrossEntropyLoss": 1, "Softplus": 1, "Softsign": 1, "Squeeze": 24,
    "StringConcat": 21, "StringNormalizer": 1, "StringSplit": 21, "Sum": 1, "Swish": 24, "Tan": 24,
    "TensorScatter": 24, "ThresholdedRelu": 24, "TopK": 1, "Transpose": 24, "Trilu": 18, "Unique": 1,
    "Unsqueeze": 24, "Xor": 1,
}
# fmt: on
_WEBGPU_ON_CPU_BY_DESIGN = ("Identity", "Size")
MISSING_KERNELS: dict[str, dict[str, int]] = {
    "onnxruntime": dict(_CPU_GAPS),
    "onnxruntime-web": dict(_CPU_GAPS),  # the wasm backend: the CPU provider compiled to WebAssembly
    "onnxruntime-web-webgpu": {
        **{op: v for op, v in _WEBGPU_GAPS.items() if op not in _WEBGPU_ON_CPU_BY_DESIGN},
        **{op: min(v, _WEBGPU_GAPS.get(op, v)) for op, v in _CPU_GAPS.items()},
    },
}
DEFAULT_TARGETS = ("onnxruntime", "onnxruntime-web")


def _op_types(graph: onnx.GraphProto) -> set[tuple[str, str]]:
    ops = {(n.domain, n.op_type) for n in graph.node}
    for n in graph.node:
        for sub in subgraphs(n):
            ops |= _op_types(sub)
    return ops


def missing_kernels(model: onnx.ModelProto, target: str) -> list[str]:
    """The standard ops of ``model`` (subgraphs included) that ``target`` has no kernel for."""
    if target not in MISSING_KERNELS:
        raise InputError(f"unknown target runtime {target!r}; known: {sorted(MISSING_KERNELS)}")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    gaps = MISSING_KERNELS[target]
    return sorted(
        op
        for domain, op in _op_types(model.graph)
        if domain in ("", "ai.onnx") and opset >= gaps.get(op, 10**9)
    )


def check_targets(models: Mapping[str, onnx.ModelProto], targets: Iterable[str]) -> None:
    """Raise :class:`InputError` naming each op and runtime when a model of ``models`` (file name ->
    model) uses an op one of ``targets`` has no kernel for."""
    problems = []
    for target in targets:
        for file, model in models.items():
            ops = missing_kernels(model, target)
            if ops:
                problems.append(f"{target} has no kernel for {', '.join(ops)} (in {file})")
    if problems:
        raise InputError(
            "the artifacts would not run on every target runtime: " + "; ".join(problems)
            + ". Pass targets= without that runtime, or replace the op in the model"
        )  # fmt: skip
