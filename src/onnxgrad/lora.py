"""LoRA: trainable low-rank adapters beside the weights of a frozen ONNX model.

:func:`add_adapters` rewrites every MatMul/Gemm that reads a chosen weight ``W`` so that it computes
``y = x W + (alpha / rank) * dropout(x) A B``, with ``A`` random (kaiming-uniform, as PEFT) and ``B``
zeros: the adapted model starts equal to the base. The adapted model names its default trainable set
in ``metadata_props`` (``onnxgrad.trainable``: exactly the adapters), so ``build_gradient``,
``ForwardBackward``, ``OnnxModule``, ``Trainer`` and ``onnxgrad.artifacts.generate`` train only them
by default. :func:`merge` folds the adapters into the weights (a plain model again);
:func:`save_adapters` / :func:`load_adapters` keep the adapters apart from the base (safetensors
layout, or ``.npz``).

Where the weight sits, as exporters write it:

* ``MatMul(x, W)`` (``W``: ``[in, out]``): ``A`` is ``[in, r]``, ``B`` is ``[r, out]``;
* ``MatMul(W, x)`` (``W``: ``[out, in]``): ``y = W x + s * B (A x)``, ``A`` ``[r, in]``, ``B`` ``[out, r]``;
* ``Gemm(x, W)`` with ``transB`` (``W``: ``[out, in]``, torch's Linear) or without (``[in, out]``),
  ``transA``, ``alpha`` honoured; the bias stays as it is.

Quantized weights (QLoRA: the adapters are float, the quantized product stays as it is, frozen):

* ``DequantizeLinear(q, scale, zero_point)`` feeding MatMul/Gemm as above (``quantize_static`` QDQ,
  ``MatMulNBitsQuantizer(quant_format=QDQ)``): int8/uint8/int4/uint4..., per tensor, per axis or
  blocked; ``q`` is the weight (targets match its name, or the name without ``_quantized`` /
  ``_DQ_Q4`` ...);
* ``com.microsoft.MatMulNBits(x, q, scales, ...)`` (``q`` packed, ``W`` ``[N, K]``): as ``Gemm``
  with ``transB``; the adapter adds to its output, bias included;
* ``MatMulInteger`` of ``quantize_dynamic``: ``DynamicQuantizeLinear(x) -> MatMulInteger(x_q, q)
  -> Cast -> Mul(x_scale * w_scale)``: the adapter reads the float ``x`` and adds to the Mul's output.

The adapters' gradient is the one of the graph onnxruntime runs when its
``DequantizeLinear -> MatMul`` to ``MatMulNBits`` fusion is off: with it on, onnxruntime computes the
forward with ``x`` quantized to int8 per block (``session.qdq_matmulnbits_accuracy_level``, 4 by
default) while the backward differentiates the float product. :func:`session_options` gives the
options that keep what runs equal to what is differentiated (pass them as ``session_options=`` to
``ForwardBackward`` / ``OnnxModule`` / ``Trainer`` and to the serving session).
:func:`merge` on a quantized base writes float weights (see there).

onnxruntime serves adapters itself: :func:`serving_model` gives the adapted model whose adapters are
inputs with initializer defaults (zeros: no adapter active is the base model), :func:`save_ort_adapter`
writes a ``.onnx_adapter`` file (``onnxruntime.AdapterFormat``) that ``onnxruntime.LoraAdapter`` and
``RunOptions.add_active_adapter`` switch per request over one ``InferenceSession``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .autodiff.params import TRAINABLE_KEY
from .deps import require_onnxruntime
from .errors import GradientWarning, InputError
from .model.contrib_schemas import MS_DOMAIN
from .model.graph import FLOAT_TYPES, np_dtype, to_array, unique_name
from .model.load import load_model

LORA_KEY = "onnxgrad.lora"  # metadata_props: JSON description of the adapters (see _Adapter)

Targets = str | Iterable[str] | Callable[[str], bool]


@dataclass
class _Adapter:
    weight: str  # the base initializer
    a: str
    b: str
    scale: float
    layout: str  # "right": delta = A @ B is W's shape; "left": B @ A; "right_t": (A @ B).T
    nodes: list[str]  # names of the nodes added (removed by merge)
    outputs: list[list[str]]  # [original output, renamed base output] per adapted node
    kind: str = "float"  # "float", or the quantized base: "dq", "nbits", "integer" (see _Weight)
    source: str = ""  # "dq": the DequantizeLinear's output, the float weight the MatMul/Gemm read
    inputs: list[str] | None = None  # "nbits"/"integer": the float input x of each adapted product

    def delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.layout == "left":
            d = b @ a
        else:
            d = a @ b
            if self.layout == "right_t":
                d = d.T
        return self.scale * d


def _matcher(targets: Targets) -> Callable[[str], bool]:
    if callable(targets):
        return targets
    pats = [targets] if isinstance(targets, str) else list(targets)
    return lambda name: any(name == p or fnmatch.fnmatchcase(name, p) for p in pats)


def add_adapters(
    model: onnx.ModelProto | str | os.PathLike | bytes,
    targets: Targets = "*",
    *,
    rank: int = 8,
    alpha: float | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> onnx.ModelProto:
    """A copy of ``model`` with LoRA adapters beside the chosen weights, the base frozen.

    ``targets``: initializer names or glob patterns (``"*attn*"``), or a predicate on the name (a
    weight that ``torch.onnx.export(dynamo=True)`` renamed is also matched by its torch name,
    ``"layers.0.q.weight"``, and its adapters take that name); only
    2-D floating-point initializers read as the weight of a MatMul or Gemm (and by nothing else) are
    adapted, and the integer weights of quantized products (see the module's docstring: behind
    DequantizeLinear, in MatMulNBits, in quantize_dynamic's MatMulInteger), also matched by the name
    without the quantizer's suffix (``W_quantized``, ``W_Q4`` -> ``W``), which their adapters take.
    A name given exactly that cannot be adapted raises :class:`InputError`; patterns skip
    what does not fit. ``alpha`` (default ``rank``) scales the update by ``alpha / rank``;
    ``dropout`` > 0 adds a Dropout on the adapter's input (active in training mode only).
    """
    if rank < 1:
        raise InputError(f"rank must be at least 1, got {rank}")
    src = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    if any(p.key == LORA_KEY for p in out.metadata_props):
        raise InputError("the model already has LoRA adapters: merge them first (onnxgrad.lora.merge)")
    graph = out.graph
    scale = float(rank if alpha is None else alpha) / rank
    inits = {t.name: t for t in graph.initializer}
    uses: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, i in enumerate(node.input):
            if i in inits:
                uses.setdefault(i, []).append((node, k))
    exact = set() if callable(targets) else ({targets} if isinstance(targets, str) else set(targets))
    match = _matcher(targets)
    alias = _module_names(uses)
    rng = np.random.default_rng(seed)
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node if n.name}
    adapters: list[_Adapter] = []
    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # index of the adapted node -> nodes after it
    all_nodes = list(graph.node)  # kept alive: ids of proto wrappers are stable only while they live
    index = {id(n): k for k, n in enumerate(all_nodes)}
    readers = _readers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    graph_outputs = {o.name for o in graph.output}
    for name, t in inits.items():
        known = alias.get(name) or _quantized_alias(name)  # val_12 -> its torch name; W_quantized -> W
        if not match(name) and not (known and match(known)):
            continue
        if t.data_type in FLOAT_TYPES:
            why = _unfit(t, uses.get(name, []))
            found = None if why else _Weight("float", tuple(t.dims), t.data_type, uses[name])
        else:
            found = _quantized_weight(t, uses.get(name, []), readers, producers, inits, graph_outputs)
            why, found = (found, None) if isinstance(found, str) else (None, found)
        if found is None:
            if name in exact or known in exact:
                raise InputError(f"cannot put an adapter beside {name!r}: {why}")
            continue
        shape = found.shape
        layout = found.layout or _layout(*found.sites[0])
        if layout == "left":  # W [out, in] on the left: A [r, in], B [out, r]
            a_shape, b_shape, fan_in = (rank, shape[1]), (shape[0], rank), shape[1]
        elif layout == "right_t":  # Gemm transB: W [out, in]
            a_shape, b_shape, fan_in = (shape[1], rank), (rank, shape[0]), shape[1]
        else:  # W [in, out]
            a_shape, b_shape, fan_in = (shape[0], rank), (rank, shape[1]), shape[0]
        if found.layout is None and any(_layout(n, k) != layout for n, k in found.sites):
            if name in exact or known in exact:
                raise InputError(f"cannot put an adapter beside {name!r}: read in different layouts")
            continue
        # PEFT: nn.init.kaiming_uniform_(A, a=sqrt(5)) -> bound = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        dt = np_dtype(found.dtype)
        a_val = rng.uniform(-bound, bound, size=a_shape).astype(dt)
        b_val = np.zeros(b_shape, dtype=dt)
        a_name = unique_name(f"{known or name}.lora_A", taken)
        b_name = unique_name(f"{known or name}.lora_B", taken)
        graph.initializer.extend(
            [numpy_helper.from_array(a_val, a_name), numpy_helper.from_array(b_val, b_name)]
        )
        ad = _Adapter(name, a_name, b_name, scale, layout, [], [], found.kind, found.source)
        if found.kind in ("nbits", "integer"):
            ad.inputs = [found.input_of(n) for n, _ in found.sites]
        for (node, k), x in zip(found.sites, ad.inputs or [None] * len(found.sites), strict=True):
            extra = _adapt_node(node, k, ad, dropout, taken, found.dtype, x)
            new_nodes.setdefault(index[id(node)], []).extend(extra)
        adapters.append(ad)
    if not adapters:
        raise InputError("no weight matched the targets: nothing to adapt")
    nodes = list(graph.node)
    del graph.node[:]
    for k, n in enumerate(nodes):
        graph.node.append(n)
        graph.node.extend(new_nodes.get(k, []))
    names = [n for ad in adapters for n in (ad.a, ad.b)]
    info = {"rank": rank, "alpha": float(rank if alpha is None else alpha), "dropout": dropout}
    info["adapters"] = [ad.__dict__ for ad in adapters]
    _set_meta(out, TRAINABLE_KEY, json.dumps(names))
    _set_meta(out, LORA_KEY, json.dumps(info))
    return out


_SCOPES = "pkg.torch.onnx.name_scopes"


def _module_names(uses: dict[str, list[tuple[onnx.NodeProto, int]]]) -> dict[str, str]:
    """``<module path>.weight`` for initializers that ``torch.onnx.export(dynamo=True)`` renamed
    (it folds ``Linear``'s transposed weight into a new ``val_N``), from the reading node's
    ``pkg.torch.onnx.name_scopes``: targets may name the torch weight (``"layers.0.q.weight"``)."""
    out: dict[str, str] = {}
    for name, readers in uses.items():
        paths = set()
        for node, k in readers:
            if node.op_type not in ("MatMul", "Gemm") or (node.op_type == "Gemm" and k != 1):
                break
            scopes = next((p.value for p in node.metadata_props if p.key == _SCOPES), None)
            if scopes is None:
                break
            try:
                parts = json.loads(scopes.replace("'", '"'))
            except ValueError:
                break
            # module paths from the root, each in full ('', 'model', 'model.q'), then the op (linear)
            if len(parts) < 2 or not parts[-2]:
                break
            paths.add(parts[-2] + ".weight")
        else:
            if len(paths) == 1:
                out[name] = paths.pop()
    return out


def _unfit(t: onnx.TensorProto, uses: list[tuple[onnx.NodeProto, int]]) -> str | None:
    if t.data_type not in FLOAT_TYPES:
        return "not floating-point"
    if len(t.dims) != 2:
        return f"not 2-D (shape {list(t.dims)})"
    if not uses:
        return "no node reads it"
    for node, k in uses:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm"):
            return f"read by {node.op_type} node {node.name!r}, not only by MatMul/Gemm"
        if node.op_type == "Gemm" and k != 1:
            return f"it is not the B operand of Gemm node {node.name!r}"
    return None


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
        shape = (int(_attr(node0, "N", 0)), int(_attr(node0, "K", 0)))
        for node, _ in uses:
            if (int(_attr(node, "N", 0)), int(_attr(node, "K", 0))) != shape or any(
                i and i not in inits for i in node.input[2:5]
            ):
                return f"MatMulNBits node {node.name!r} reads it differently or has non-constant scales"
            if len(node.input) > 4 and node.input[4]:
                return f"MatMulNBits node {node.name!r} has a g_idx input (act-order)"
        dtype = inits[node0.input[2]].data_type
        for node, _ in uses:
            if int(_attr(node, "accuracy_level", 0)) >= 2:
                warnings.warn(
                    f"MatMulNBits node {node.name!r} has accuracy_level="
                    f"{int(_attr(node, 'accuracy_level', 0))}: onnxruntime quantizes its input to a lower "
                    "precision, the gradients are those of the float product (set accuracy_level to 0 "
                    "or 1 to train what runs)",
                    GradientWarning,
                    stacklevel=3,
                )
        xs = {n.output[0]: n.input[0] for n, _ in uses}
        return _Weight("nbits", shape, dtype, uses, layout="right_t", x_inputs=xs)
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


def _unpack_nbits(node: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]) -> np.ndarray:
    """The ``[N, K]`` float64 weight of a MatMulNBits node: ``bits`` values per byte, low bits first,
    ``(q - zero point) * scale`` per block of ``block_size`` along K."""
    bits, block = int(_attr(node, "bits", 4)), int(_attr(node, "block_size", 0))
    n, k = int(_attr(node, "N", 0)), int(_attr(node, "K", 0))
    per_byte = 8 // bits
    mask = (1 << bits) - 1

    def unpack(packed: np.ndarray, count: int) -> np.ndarray:
        packed = packed.reshape(packed.shape[0], -1).astype(np.int64)
        values = np.stack([(packed >> (bits * j)) & mask for j in range(per_byte)], axis=-1)
        return values.reshape(packed.shape[0], -1)[:, :count]

    blocks = -(-k // block)
    q = unpack(to_array(inits[node.input[1]]), blocks * block).reshape(n, blocks, block).astype(np.float64)
    scales = to_array(inits[node.input[2]]).astype(np.float64).reshape(n, blocks, 1)
    zp_name = node.input[3] if len(node.input) > 3 else ""
    if not zp_name:
        zero: Any = float(2 ** (bits - 1))
    else:
        zp = to_array(inits[zp_name])
        if zp.dtype == np.uint8:
            zero = unpack(zp.reshape(n, -1), blocks).astype(np.float64).reshape(n, blocks, 1)
        else:
            zero = zp.astype(np.float64).reshape(n, blocks, 1)
    return ((q - zero) * scales).reshape(n, blocks * block)[:, :k]


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
        return _unpack_nbits(reader, inits)
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
    Pass them as ``session_options=`` to ``ForwardBackward`` / ``OnnxModule`` and to the
    ``InferenceSession`` serving the model (``Trainer`` picks them itself for such models)."""
    require_onnxruntime()
    from .runtime.runner import exact_nbits_options

    return exact_nbits_options(options)


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _layout(node: onnx.NodeProto, k: int) -> str:
    if node.op_type == "Gemm":
        return "right_t" if _attr(node, "transB", 0) else "right"
    return "left" if k == 0 else "right"


def _adapt_node(
    node: onnx.NodeProto,
    k: int,
    ad: _Adapter,
    dropout: float,
    taken: set[str],
    dtype: int,
    x: str | None = None,
) -> list[onnx.NodeProto]:
    """Adapter nodes beside ``node`` (the product's last node, its output renamed); ``x``: the float
    input of the product when it is not ``node``'s own (MatMulInteger's chain)."""
    y = node.output[0]
    base = unique_name(f"{y}_base", taken)
    node.output[0] = base
    if x is None:
        x = node.input[1 - k] if node.op_type == "MatMul" else node.input[0]
    stem = node.name or y
    nodes: list[onnx.NodeProto] = []

    def add(op: str, ins: list[str], **attrs: Any) -> str:
        name = unique_name(f"{stem}/lora/{op}", taken)
        o = unique_name(f"{stem}/lora/{op.lower()}_out", taken)
        nodes.append(helper.make_node(op, ins, [o], name=name, **attrs))
        ad.nodes.append(name)
        return o

    def constant(label: str, value: float) -> str:
        out = unique_name(f"{stem}/lora/{label}", taken)
        name = unique_name(f"{stem}/lora/Constant", taken)
        array = np.array(value, dtype=np_dtype(dtype))
        nodes.append(helper.make_node("Constant", [], [out], name=name, value=numpy_helper.from_array(array)))
        ad.nodes.append(name)
        return out

    if node.op_type == "Gemm" and _attr(node, "transA", 0):
        x = add("Transpose", [x], perm=[1, 0])
    if dropout > 0:
        x = add("Dropout", [x, constant("ratio", dropout)])
    scale = ad.scale * (float(_attr(node, "alpha", 1.0)) if node.op_type == "Gemm" else 1.0)
    if ad.layout == "left":  # y = W x + s * B (A x)
        low = add("MatMul", [ad.a, x])
        up = add("MatMul", [ad.b, low])
    else:
        low = add("MatMul", [x, ad.a])
        up = add("MatMul", [low, ad.b])
    scaled = add("Mul", [up, constant("scale", scale)])
    name = unique_name(f"{stem}/lora/Add", taken)
    nodes.append(helper.make_node("Add", [base, scaled], [y], name=name))
    ad.nodes.append(name)
    ad.outputs.append([y, base])
    scopes = [p for p in node.metadata_props if p.key == _SCOPES]  # in the adapted node's layer
    for n in nodes:
        n.metadata_props.extend(scopes)
    return nodes


def _set_meta(model: onnx.ModelProto, key: str, value: str) -> None:
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=key, value=value)


def _adapters(model: onnx.ModelProto) -> tuple[dict[str, Any], list[_Adapter]]:
    for p in model.metadata_props:
        if p.key == LORA_KEY:
            info = json.loads(p.value)
            return info, [_Adapter(**a) for a in info["adapters"]]
    raise InputError("the model has no LoRA adapters (made by onnxgrad.lora.add_adapters)")


def adapter_names(model: onnx.ModelProto) -> list[str]:
    """The adapters' initializer names (A and B of each adapted weight)."""
    return [n for ad in _adapters(model)[1] for n in (ad.a, ad.b)]


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


def with_values(model: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``values`` hold those values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name in values:
            arr = np.asarray(values[t.name], dtype=np_dtype(t.data_type))
            if tuple(arr.shape) != tuple(t.dims):
                raise InputError(f"{t.name!r} has shape {list(t.dims)}, got {list(arr.shape)}")
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
    return out


# ---- saving adapters apart -------------------------------------------------------------------
_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16"}


def save_adapters(
    model: onnx.ModelProto, path: str | os.PathLike, values: Mapping[str, Any] | None = None
) -> None:
    """Write the adapters of ``model`` (or ``values``, e.g. ``ForwardBackward.parameters``, for the
    same names) to ``path``: a ``.npz`` archive, else the safetensors layout (the adapters' settings
    in its ``__metadata__``)."""
    info, adapters = _adapters(model)
    inits = {t.name: t for t in model.graph.initializer}
    values = dict(values or {})
    arrays = {}
    for ad in adapters:
        for n in (ad.a, ad.b):
            arrays[n] = np.ascontiguousarray(values[n] if n in values else to_array(inits[n]))
    meta = json.dumps(info)
    path = os.fspath(path)
    if path.endswith(".npz"):
        np.savez(path, __lora__=np.array(meta), **arrays)
        return
    header: dict[str, Any] = {"__metadata__": {LORA_KEY: meta}}
    offset = 0
    for n, arr in arrays.items():
        if arr.dtype.name not in _ST_DTYPES:
            raise InputError(f"adapter {n!r} has dtype {arr.dtype}, which safetensors does not store here")
        header[n] = {
            "dtype": _ST_DTYPES[arr.dtype.name],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in arrays.values():
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())


def read_adapters(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The settings and the arrays of an adapter file written by :func:`save_adapters`."""
    path = os.fspath(path)
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["__lora__"]))
            return meta, {k: z[k] for k in z.files if k != "__lora__"}
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise InputError(f"{path!r} is not a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise InputError(f"{path!r} is not a safetensors file (header past the end)")
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header.pop("__metadata__", {}).get(LORA_KEY, "{}"))
    except (ValueError, AttributeError) as exc:
        raise InputError(f"{path!r} is not a safetensors file of adapters: {exc}") from exc
    body = data[8 + n :]
    rev = {v: k for k, v in _ST_DTYPES.items()}
    arrays = {}
    for name, h in header.items():
        try:
            start, end = (int(v) for v in h["data_offsets"])
            shape = [int(d) for d in h["shape"]]
            dt = _np_from_st(rev[h["dtype"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{path!r}: tensor {name!r} has a corrupt header entry") from exc
        if not 0 <= start <= end <= len(body) or any(d < 0 for d in shape):
            raise InputError(f"{path!r}: tensor {name!r} lies outside the file")
        if math.prod(shape) * dt.itemsize != end - start:
            raise InputError(f"{path!r}: tensor {name!r} has {end - start} bytes for shape {shape}")
        arrays[name] = np.frombuffer(body[start:end], dtype=dt.newbyteorder("<")).astype(dt).reshape(shape)
    return meta, arrays


# ---- onnxruntime's own adapter format --------------------------------------------------------
def serving_model(model: onnx.ModelProto | str | os.PathLike | bytes) -> onnx.ModelProto:
    """The adapted ``model`` (from :func:`add_adapters`) made to serve adapters through
    onnxruntime: every adapter (A and B) is a graph input whose default (an initializer of the same
    name) is zeros, so with no adapter active it computes the base model, and an
    ``onnxruntime.LoraAdapter`` written by :func:`save_ort_adapter` for any fine-tune of the same
    :func:`add_adapters` call (same targets, rank and alpha) overrides them per request::

        session = onnxruntime.InferenceSession(serving_model(adapted).SerializeToString())
        adapter = onnxruntime.LoraAdapter()
        adapter.Load("task1.onnx_adapter")
        options = onnxruntime.RunOptions()
        options.add_active_adapter(adapter)
        session.run(None, feeds, options)
    """
    src = load_model(model)
    _, adapters = _adapters(src)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    names = {n for ad in adapters for n in (ad.a, ad.b)}
    present = {i.name for i in out.graph.input}
    for t in out.graph.initializer:
        if t.name in names:
            zeros = np.zeros(tuple(t.dims), dtype=np_dtype(t.data_type))
            t.CopyFrom(numpy_helper.from_array(zeros, t.name))
            if t.name not in present:
                out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    out.ir_version = max(out.ir_version, 4)  # initializers as overridable inputs: IR 4 on
    return out


def save_ort_adapter(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    values: Mapping[str, Any] | None = None,
    *,
    adapter_version: int = 1,
    model_version: int = 1,
) -> None:
    """Write the adapters of ``model`` (or ``values`` for the same names, e.g.
    ``ForwardBackward.parameters``) as an onnxruntime adapter file (``.onnx_adapter``, through
    ``onnxruntime.AdapterFormat``), for the model of :func:`serving_model`."""
    require_onnxruntime()
    import onnxruntime as ort

    _, adapters = _adapters(model)
    inits = {t.name: t for t in model.graph.initializer}
    values = dict(values or {})
    params = {}
    for ad in adapters:
        for n in (ad.a, ad.b):
            arr = np.ascontiguousarray(values[n] if n in values else to_array(inits[n]))
            want = (tuple(inits[n].dims), np_dtype(inits[n].data_type))
            if (arr.shape, arr.dtype) != want:
                raise InputError(
                    f"adapter {n!r} must be {want[1]} of shape {list(want[0])}, "
                    f"got {arr.dtype} {list(arr.shape)}"
                )
            params[n] = ort.OrtValue.ortvalue_from_numpy(arr)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(adapter_version)
    fmt.set_model_version(model_version)
    fmt.set_parameters(params)
    fmt.export_adapter(os.path.abspath(os.fspath(path)))


def read_ort_adapter(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The parameters (name -> array) of an onnxruntime adapter file."""
    require_onnxruntime()
    import onnxruntime as ort

    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise InputError(f"no adapter file {path!r}")
    try:
        fmt = ort.AdapterFormat.read_adapter(path)
    except Exception as exc:  # onnxruntime raises RuntimeError / its own Fail
        raise InputError(f"{path!r} is not an onnxruntime adapter file: {exc}") from exc
    return {n: np.array(v.numpy()) for n, v in fmt.get_parameters().items()}


def _np_from_st(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def load_adapters(
    base: onnx.ModelProto | str | os.PathLike | bytes, path: str | os.PathLike
) -> onnx.ModelProto:
    """``base`` (the model without adapters) with the adapters saved in ``path`` put back: the same
    adapted model that :func:`save_adapters` saw, its adapters holding the saved values."""
    meta, arrays = read_adapters(path)
    if not meta.get("adapters"):
        raise InputError(f"{os.fspath(path)!r} holds no LoRA settings")
    weights = [a["weight"] for a in meta["adapters"]]
    adapted = add_adapters(
        base, weights, rank=int(meta["rank"]), alpha=meta["alpha"], dropout=meta["dropout"]
    )
    _, adapters = _adapters(adapted)
    saved = {a["weight"]: a for a in meta["adapters"]}
    values = {}
    for ad in adapters:
        s = saved[ad.weight]
        values[ad.a], values[ad.b] = arrays[s["a"]], arrays[s["b"]]
    return with_values(adapted, values)
