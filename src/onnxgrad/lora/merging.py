"""Merging: the adapters folded into their weights, a plain model again."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff.params import TRAINABLE_KEY
from ..model.graph import to_array, unique_name
from ..model.load import load_model
from .adapters import LORA_KEY, _adapters
from .quantized import _quantized_alias, dequantized_weight


def merge(model: onnx.ModelProto | str | os.PathLike | bytes) -> onnx.ModelProto:
    """A plain model: the adapters folded into their weights (``W + alpha/rank * A B``) and their
    nodes removed; it computes what the adapted model computes (in inference mode).

    On a quantized base the merged weights are **float** (``dequantized W + alpha/rank * A B``, in
    the type of the product) and the quantized product becomes a float MatMul (DequantizeLinear
    folded, MatMulNBits -> MatMul (+ Add of its bias), quantize_dynamic's chain -> MatMul): the
    model gives the adapted model's outputs up to float rounding (without the dynamic
    quantization of the activations) and its adapted weights take 4 bytes an element again. A
    :class:`UserWarning` says so. Re-quantizing is not done: rounding costs what was trained
    (measured in ``docs/finetune_deployed.md``: +2.6 % on the training loss of a 4-bit MLP); to
    keep the quantized base exactly, serve the adapters apart (:func:`serving_model`,
    :func:`save_ort_adapter`).
    """
    src = load_model(model)
    _, adapters = _adapters(src)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    drop_nodes = {n for ad in adapters for n in ad.nodes}
    drop_inits = {n for ad in adapters for n in (ad.a, ad.b)}
    rename = {base: y for ad in adapters for y, base in ad.outputs}
    new_w: dict[str, onnx.TensorProto] = {}
    replaced: dict[str, list[onnx.NodeProto]] = {}  # quantized product's last node's output -> float nodes
    quantized = [ad for ad in adapters if ad.kind != "float"]
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {n.name for n in graph.node if n.name} | {i.name for i in graph.input}
    for ad in adapters:
        d = ad.delta(to_array(inits[ad.a]).astype(np.float64), to_array(inits[ad.b]).astype(np.float64))
        if ad.kind == "float":
            w = to_array(inits[ad.weight])
            merged = (w.astype(np.float64) + d).astype(w.dtype)
            new_w[ad.weight] = numpy_helper.from_array(merged, ad.weight)
            continue
        dt = to_array(inits[ad.a]).dtype
        merged = (dequantized_weight(src, ad.weight) + d).astype(dt)
        if ad.kind == "dq":  # the DequantizeLinear's output becomes the float initializer
            graph.initializer.append(numpy_helper.from_array(merged, ad.source))
            replaced[ad.source] = []
            continue
        float_name = unique_name(_quantized_alias(ad.weight) or f"{ad.weight}_float", taken)
        if ad.kind == "nbits":
            merged = merged.T  # [N, K] -> [K, N]
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(merged), float_name))
        by_out = {n.output[0]: n for n in graph.node}
        for (_, base), x in zip(ad.outputs, ad.inputs or [], strict=True):
            node = by_out[base]
            name = unique_name(f"{node.name or base}/merged/MatMul", taken)
            bias = node.input[5] if ad.kind == "nbits" and len(node.input) > 5 else ""
            if bias:
                product = unique_name(f"{base}_product", taken)
                replaced[base] = [
                    helper.make_node("MatMul", [x, float_name], [product], name=name),
                    helper.make_node("Add", [product, bias], [base], name=unique_name(f"{name}_bias", taken)),
                ]
            else:
                replaced[base] = [helper.make_node("MatMul", [x, float_name], [base], name=name)]
    if quantized:
        warnings.warn(
            f"merge: {len(quantized)} quantized weight(s) ({', '.join(ad.weight for ad in quantized)}) "
            "are written as float weights (dequantized + the adapters' update), not re-quantized",
            UserWarning,
            stacklevel=2,
        )
    nodes = []
    for n in graph.node:
        if n.name in drop_nodes and n.name:
            continue
        nodes.extend(replaced.get(n.output[0], [n]) if n.output else [n])
    for n in nodes:
        for j, o in enumerate(n.output):
            if o in rename:
                n.output[j] = rename[o]
    del graph.node[:]
    graph.node.extend(_without_dead_nodes(nodes, {o.name for o in graph.output}) if quantized else nodes)
    if quantized:  # the quantized weights, scales, zero points nothing reads any more
        read = {i for n in graph.node for i in _all_inputs(n)} | {o.name for o in graph.output}
        drop_inits |= {t.name for t in graph.initializer if t.name not in read}
    kept = [new_w.get(t.name, t) for t in graph.initializer if t.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    keep_inputs = [i for i in graph.input if i.name not in drop_inits]
    del graph.input[:]
    graph.input.extend(keep_inputs)
    meta = [p for p in out.metadata_props if p.key not in (LORA_KEY, TRAINABLE_KEY)]
    del out.metadata_props[:]
    out.metadata_props.extend(meta)
    return out


def _all_inputs(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads, those its subgraphs read from outside included."""
    names = {i for i in node.input if i}
    for a in node.attribute:
        for g in [a.g] if a.HasField("g") else list(a.graphs):
            for n in g.node:
                names |= _all_inputs(n)
    return names


def _without_dead_nodes(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` less those whose outputs nothing reads (repeatedly: a chain goes as a whole)."""
    while True:
        read = set(outputs)
        for n in nodes:
            read |= _all_inputs(n)
        kept = [n for n in nodes if any(o in read for o in n.output if o)]
        if len(kept) == len(nodes):
            return nodes
        nodes = kept
