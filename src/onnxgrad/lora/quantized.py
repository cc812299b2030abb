"""Quantized weights: recognising the integer weight of a quantized product (behind
DequantizeLinear, in MatMulNBits, in quantize_dynamic's MatMulInteger chain), its float value, and
the session options under which onnxruntime runs such a model as onnxgrad differentiates it."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..deps import require_onnxruntime
from ..errors import GradientWarning, InputError
from ..model.contrib_schemas import MS_DOMAIN
from ..model.graph import to_array
from ..model.nbits import NBitsLayout, dequantize_nbits

# ---- quantized weights ------------------------------------------------------------------------
_QUANT_SUFFIXES = ("_quantized", "_DQ_Q4", "_DQ_Q8", "_DQ_Q2", "_Q4", "_Q8", "_Q2")


def _quantized_alias(name: str) -> str | None:
    """The float weight's name in what onnxruntime's quantizers write (``W1_quantized``, ``W1_Q4``,
    ``W1_DQ_Q4`` -> ``W1``), None for other names."""
    for suffix in _QUANT_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return None


@dataclass
class _Weight:
    """A weight :func:`add_adapters` can adapt: ``kind`` "float" (the initializer itself), "dq"
    (``DequantizeLinear`` of it feeds MatMul/Gemm: ``sites`` are those readers), "nbits"
    (``MatMulNBits`` nodes) or "integer" (``sites`` are the final ``Mul`` of each
    ``MatMulInteger -> Cast -> Mul`` chain); ``shape``: the float weight as the product reads it;
    ``layout`` fixed by the kind (None: from each site as for float weights)."""

    kind: str
    shape: tuple[int, ...]
    dtype: int  # the float type of the product
    sites: list[tuple[onnx.NodeProto, int]]
    layout: str | None = None
    source: str = ""
    x_inputs: dict[str, str] | None = None  # site node name or output -> float input
    low_precision: list[tuple[str, int]] | None = None  # MatMulNBits nodes of accuracy_level >= 2

    def input_of(self, node: onnx.NodeProto) -> str:
        assert self.x_inputs is not None
        return self.x_inputs[node.output[0]]


def _readers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, i in enumerate(node.input):
            if i:
                out.setdefault(i, []).append((node, k))
    return out


def _quantized_weight(
    t: onnx.TensorProto,
    uses: list[tuple[onnx.NodeProto, int]],
    readers: dict[str, list[tuple[onnx.NodeProto, int]]],
    producers: dict[str, onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
    graph_outputs: set[str],
) -> _Weight | str:
    """How the integer initializer ``t`` is the weight of a quantized product, or why it is not."""
    if not uses:
        return "no node reads it"
    ops = {(n.domain or "", n.op_type) for n, _ in uses}
    if ops == {("", "DequantizeLinear")} or ops == {("ai.onnx", "DequantizeLinear")}:
        if len(uses) != 1 or uses[0][1] != 0:
            return "read by several DequantizeLinear nodes"
        dq = uses[0][0]
        if any(i and i not in inits for i in dq.input[1:]):
            return f"the scale or zero point of DequantizeLinear node {dq.name!r} is not an initializer"
        if len(t.dims) != 2:
            return f"not 2-D (shape {list(t.dims)})"
        out = dq.output[0]
        sites = readers.get(out, [])
        if out in graph_outputs or not sites:
            return f"the output of DequantizeLinear node {dq.name!r} is not only read by MatMul/Gemm"
        for node, k in sites:
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
                return (
                    f"its dequantized value is read by {node.op_type} node {node.name!r}, "
                    "not only by MatMul/Gemm"
                )
            if node.op_type == "Gemm" and k != 1:
                return f"its dequantized value is not the B operand of Gemm node {node.name!r}"
        dtype = inits[dq.input[1]].data_type  # the scale's type is the output's
        return _Weight("dq", tuple(t.dims), dtype, sites, source=out)
    if ops == {(MS_DOMAIN, "MatMulNBits")}:
        if any(k != 1 for _, k in uses):
            return "not the B input of MatMulNBits"
        node0 = uses[0][0]
        layout = NBitsLayout.of(node0)
        shape = (layout.n, layout.k)
        for node, _ in uses:
            if NBitsLayout.of(node) != layout or any(i and i not in inits for i in node.input[2:5]):
                return f"MatMulNBits node {node.name!r} reads it differently or has non-constant scales"
            if len(node.input) > 4 and node.input[4]:
                return f"MatMulNBits node {node.name!r} has a g_idx input (act-order)"
        dtype = inits[node0.input[2]].data_type
        levels = [(n.name, int(_attr(n, "accuracy_level", 0))) for n, _ in uses]
        low = [(name, level) for name, level in levels if level >= 2]
        xs = {n.output[0]: n.input[0] for n, _ in uses}
        return _Weight("nbits", shape, dtype, uses, layout="right_t", x_inputs=xs, low_precision=low)
    if ops == {("", "MatMulInteger")} or ops == {("ai.onnx", "MatMulInteger")}:
        if len(t.dims) != 2:
            return f"not 2-D (shape {list(t.dims)})"
        sites, xs, dtype = [], {}, None
        for node, k in uses:
            chain = _integer_chain(node, k, readers, producers, inits)
            if isinstance(chain, str):
                return chain
            mul, x, dtype = chain
            sites.append((mul, 0))
            xs[mul.output[0]] = x
        assert dtype is not None
        return _Weight("integer", tuple(t.dims), dtype, sites, layout="right", x_inputs=xs)
    first = uses[0][0]
    return f"read by {first.op_type} node {first.name!r}, not a weight of a product onnxgrad knows"


def _integer_chain(
    mmi: onnx.NodeProto,
    k: int,
    readers: dict[str, list[tuple[onnx.NodeProto, int]]],
    producers: dict[str, onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
) -> tuple[onnx.NodeProto, str, int] | str:
    """``quantize_dynamic``'s ``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W) -> Cast -> Mul``:
    (the Mul, x, the float type), or why ``mmi`` is not in such a chain."""
    why = (
        f"MatMulInteger node {mmi.name!r} is not in quantize_dynamic's "
        "DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul chain"
    )
    if k != 1 or any(i and i not in inits for i in mmi.input[3:4]):
        return why
    dql = producers.get(mmi.input[0])
    if dql is None or dql.op_type != "DynamicQuantizeLinear" or dql.output[0] != mmi.input[0]:
        return why
    after = readers.get(mmi.output[0], [])
    if len(after) != 1 or after[0][0].op_type != "Cast":
        return why
    cast = after[0][0]
    after = readers.get(cast.output[0], [])
    if len(after) != 1 or after[0][0].op_type != "Mul":
        return why
    mul = after[0][0]
    if _weight_scale(mul, cast.output[0], dql, producers, inits) is None:
        return why
    return mul, dql.input[0], int(_attr(cast, "to", 1))


def _weight_scale(
    mul: onnx.NodeProto,
    product: str,
    dql: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    inits: dict[str, onnx.TensorProto],
) -> str | None:
    """The weight's scale initializer in ``Mul(product, Mul(x_scale, w_scale))``, else None."""
    other = mul.input[1] if mul.input[0] == product else mul.input[0]
    scales = producers.get(other)
    if scales is None or scales.op_type != "Mul" or dql.output[1] not in scales.input:
        return None
    w_scale = scales.input[1] if scales.input[0] == dql.output[1] else scales.input[0]
    return w_scale if w_scale in inits else None


def _warn_low_precision(nodes: list[tuple[str, int]]) -> None:
    """One :class:`GradientWarning` naming the ``MatMulNBits`` nodes of ``accuracy_level`` >= 2
    (activations in lower precision) among the adapted products."""
    if not nodes:
        return
    named = ", ".join(f"{n!r} (accuracy_level={level})" for n, level in nodes[:10]) + (
        " ..." if len(nodes) > 10 else ""
    )
    warnings.warn(
        f"{len(nodes)} adapted MatMulNBits node(s) compute in low precision: {named}: onnxruntime quantizes "
        "their input to a lower precision, the gradients are those of the float product (set "
        "accuracy_level to 0 or 1 to train what runs)",
        GradientWarning,
        stacklevel=3,
    )


def _dequantize_linear(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """The value (float64) of a DequantizeLinear node of constant inputs: per tensor, per axis or
    blocked."""
    q = to_array(inits[node.input[0]]).astype(np.float64)
    s = to_array(inits[node.input[1]]).astype(np.float64)
    z = to_array(inits[node.input[2]]).astype(np.float64) if len(node.input) > 2 and node.input[2] else 0.0
    axis = int(_attr(node, "axis", 1)) % q.ndim
    block = int(_attr(node, "block_size", 0))

    def spread(v: Any) -> Any:
        if np.ndim(v) == 0:
            return v
        if block:
            return np.repeat(v, block, axis=axis).take(range(q.shape[axis]), axis=axis)
        shape = [1] * q.ndim
        shape[axis] = -1
        return np.reshape(v, shape)

    return (q - spread(z)) * spread(s)


def dequantized_weight(model: onnx.ModelProto, weight: str) -> np.ndarray:
    """The float64 value that the quantized product of ``model`` uses for the integer initializer
    ``weight`` (as :func:`add_adapters` finds it), in the shape the product reads: ``[in, out]`` for
    MatMulInteger and a DequantizeLinear read by MatMul, ``[N, K]`` for MatMulNBits."""
    inits = {t.name: t for t in model.graph.initializer}
    readers = _readers(model.graph)
    producers = {o: n for n in model.graph.node for o in n.output}
    if weight not in inits:
        raise InputError(f"the model has no initializer {weight!r}")
    found = _quantized_weight(
        inits[weight],
        readers.get(weight, []),
        readers,
        producers,
        inits,
        {o.name for o in model.graph.output},
    )
    if isinstance(found, str):
        raise InputError(f"{weight!r} is not a quantized weight: {found}")
    reader = readers[weight][0][0]
    if found.kind == "dq":
        return _dequantize_linear(reader, inits)
    if found.kind == "nbits":
        return dequantize_nbits(reader, inits)
    mmi, mul = reader, found.sites[0][0]
    cast = readers[mmi.output[0]][0][0]
    scale_name = _weight_scale(mul, cast.output[0], producers[mmi.input[0]], producers, inits)
    assert scale_name is not None  # _integer_chain checked it
    w_scale = to_array(inits[scale_name])
    q = to_array(inits[weight]).astype(np.float64)
    zp = to_array(inits[mmi.input[3]]).astype(np.float64) if len(mmi.input) > 3 and mmi.input[3] else 0.0
    return (q - zp) * w_scale.astype(np.float64)


def session_options(options: Any = None) -> Any:
    """``onnxruntime.SessionOptions`` (``options``, or onnxgrad's defaults) under which onnxruntime
    computes a QLoRA model as the graph onnxgrad differentiates: its DequantizeLinear -> MatMul
    fusion into MatMulNBits computes in float (accuracy level 1) instead of quantizing the
    activations to int8 (level 4, its default; measured 0.4 % of the output's scale on a 4-bit MLP).
    Every session onnxgrad makes gets them by default for such models (``ForwardBackward``,
    ``OnnxModule``, ``Trainer``, ``artifacts.Runner``: :func:`onnxgrad.runtime.options.session_options_for`);
    pass them to the ``InferenceSession`` serving the model, or to add the setting to options of
    your own (``options`` is changed in place and returned)."""
    require_onnxruntime()
    from ..runtime.options import exact_nbits_options

    return exact_nbits_options(options)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default
