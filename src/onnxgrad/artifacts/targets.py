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
MISSING_KERNELS: dict[str, dict[str, int]] = {
    "onnxruntime": dict(_CPU_GAPS),
    "onnxruntime-web": dict(_CPU_GAPS),  # the wasm backend: the CPU provider compiled to WebAssembly
    "onnxruntime-web-webgpu": dict(_CPU_GAPS),
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
