"""Adapters: the LoRA update beside each chosen weight of a model, as :func:`add_adapters` writes
it, and what the adapted model records about them (``metadata_props``)."""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff.params import TRAINABLE_KEY
from ..errors import InputError
from ..model.graph import FLOAT_TYPES, np_dtype, to_array, unique_name
from ..model.load import load_model
from .quantized import _attr, _quantized_alias, _quantized_weight, _readers, _warn_low_precision, _Weight

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
    A TorchScript export (``torch.onnx.export(dynamo=False)``) names the transposed weight of a
    ``Linear`` read by ``MatMul`` ``onnx::MatMul_N``: it is also matched by the module path its
    node's name gives (``/enc/enc.0/MatMul`` -> ``"enc.0.weight"``), in float and ``quantize_dynamic``
    models, and its adapters take that name.
    A name given exactly that cannot be adapted, and a name or pattern that matches no
    initializer, raise :class:`InputError` (naming the weights that can be adapted); patterns skip
    what does not fit (a weight smaller than ``rank``: ``rank > min(in, out)``, refused when named
    exactly). ``alpha`` (default ``rank``) scales the update by ``alpha / rank``;
    ``dropout`` > 0 adds a Dropout on the adapter's input (active in training mode only).
    """
    _check_settings(rank, alpha, dropout)
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
    seen = set()  # every name and alias the targets could match
    low_precision: list[tuple[str, int]] = []
    too_small: list[str] = []  # matched by a pattern, smaller than the rank: skipped
    # exact targets naming a weight that takes no adapter, with why: refused, unless the same name
    # also names one that does (a tied table read by Gather, whose transposed copy dynamo folded
    # for the lm_head MatMul under the same torch name: the copy takes the adapter, as a pattern)
    unfit: list[tuple[set[str], str]] = []
    for name, t in inits.items():
        others = _aliases(name, alias)  # val_12 -> its torch name; W_quantized -> W
        known = others[0] if others else None
        seen |= {name, *others}
        if not match(name) and not any(match(o) for o in others):
            continue
        if t.data_type in FLOAT_TYPES:
            why = _unfit(t, uses.get(name, []))
            found = None if why else _Weight("float", tuple(t.dims), t.data_type, uses[name])
        else:
            found = _quantized_weight(t, uses.get(name, []), readers, producers, inits, graph_outputs)
            why, found = (found, None) if isinstance(found, str) else (None, found)
        if found is None:
            if name in exact or exact & set(others):  # refused unless another weight answers the name
                unfit.append(({name, *others} & exact, f"cannot put an adapter beside {name!r}: {why}"))
            continue
        if rank > min(found.shape):  # an update of rank r needs r <= min(in, out)
            if name in exact or exact & set(others):
                raise InputError(
                    f"rank {rank} is above the size of {name!r} ({list(found.shape)}): an adapter's "
                    f"rank is at most min(in, out) = {min(found.shape)}; pass a smaller rank"
                )
            too_small.append(name)
            continue
        low_precision += found.low_precision or []
        shape = found.shape
        layout = found.layout or _layout(*found.sites[0])
        if layout == "left":  # W [out, in] on the left: A [r, in], B [out, r]
            a_shape, b_shape, fan_in = (rank, shape[1]), (shape[0], rank), shape[1]
        elif layout == "right_t":  # Gemm transB: W [out, in]
            a_shape, b_shape, fan_in = (shape[1], rank), (rank, shape[0]), shape[1]
        else:  # W [in, out]
            a_shape, b_shape, fan_in = (shape[0], rank), (rank, shape[1]), shape[0]
        if found.layout is None and any(_layout(n, k) != layout for n, k in found.sites):
            if name in exact or exact & set(others):
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
    answered = {n for ad in adapters for n in (ad.weight, *_aliases(ad.weight, alias))}
    for targets, why in unfit:
        if not targets & answered:
            raise InputError(why)
    unmatched = [p for p in exact if not any(p == n or fnmatch.fnmatchcase(n, p) for n in seen)]
    if unmatched:
        raise InputError(
            f"the targets {sorted(unmatched)} match no weight of the model; {_adaptable(out, alias)}"
        )
    if not adapters:
        small = f" ({too_small[:10]} are smaller than rank {rank})" if too_small else ""
        raise InputError(f"no weight matched the targets{small}: nothing to adapt; {_adaptable(out, alias)}")
    _warn_low_precision(low_precision)
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


def _check_settings(rank: Any, alpha: Any, dropout: Any) -> None:
    """Refuse settings that are no LoRA: a rank below 1 or not an integer, an ``alpha`` that is not
    a finite number, a ``dropout`` outside ``[0, 1)``."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise InputError(f"rank must be an integer of at least 1, got {rank!r}")
    if alpha is not None and (
        isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.number)) or not math.isfinite(alpha)
    ):
        raise InputError(f"alpha must be a finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.number)) or not 0 <= dropout < 1:
        raise InputError(f"dropout must be a number in [0, 1), got {dropout!r}")


def _aliases(name: str, module_names: Mapping[str, str]) -> list[str]:
    """The other names a target may match for initializer ``name``, the one its adapters take
    first: its torch module path's ``.weight`` (``module_names``, from :func:`_module_names`), the
    float weight's name of a quantized weight (``W_quantized`` -> ``W``), and, for the weight of a
    ``Gemm`` that ``quantize_dynamic`` transposed first (``W_Transposed_quantized``), ``W`` (the
    torch name of a TorchScript export's ``Linear``: ``enc.0.weight``)."""
    plain = _quantized_alias(name)
    torch_name = module_names.get(name) or (module_names.get(plain) if plain else None)
    untransposed = plain[: -len(_TRANSPOSED)] if plain and plain.endswith(_TRANSPOSED) else None
    return list(dict.fromkeys(n for n in (torch_name, untransposed, plain) if n))


_TRANSPOSED = "_Transposed"  # quantize_dynamic's suffix of a Gemm weight it transposed (transB=1)


def _adaptable(model: onnx.ModelProto, module_names: Mapping[str, str]) -> str:
    """What the targets can name: the weights of ``model`` that take an adapter (with their other
    name), for an error message."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers = _readers(graph)
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}
    names = []
    for name, t in inits.items():
        uses = readers.get(name, [])
        if t.data_type in FLOAT_TYPES:
            fit = _unfit(t, uses) is None
        else:
            fit = not isinstance(_quantized_weight(t, uses, readers, producers, inits, outputs), str)
        if fit:
            others = _aliases(name, module_names)
            names.append(f"{name} ({', '.join(others)})" if others else name)
    if not names:
        return "the model has no weight read by MatMul/Gemm (or a quantized product) that an adapter fits"
    more = f" and {len(names) - 20} more" if len(names) > 20 else ""
    return (
        f"the weights that take an adapter (by name, or a name in parentheses): {', '.join(names[:20])}{more}"
    )


_SCOPES = "pkg.torch.onnx.name_scopes"
_PRODUCTS = ("MatMul", "Gemm", "MatMulInteger", "MatMulNBits")  # nodes whose names give module paths


def _module_names(uses: dict[str, list[tuple[onnx.NodeProto, int]]]) -> dict[str, str]:
    """``<module path>.weight`` for initializers that ``torch.onnx.export(dynamo=True)`` renamed
    (it folds ``Linear``'s transposed weight into a new ``val_N``), from the reading node's
    ``pkg.torch.onnx.name_scopes``, and for the ``onnx::MatMul_N`` of a TorchScript export (also
    quantized: ``onnx::MatMul_N_quantized``), from the reading node's name (:func:`_scope_path`):
    targets may name the torch weight (``"layers.0.q.weight"``)."""
    out: dict[str, str] = {}
    for name, readers in uses.items():
        if name.startswith("onnx::"):
            paths = {_scope_path(n.name) if n.op_type in _PRODUCTS and k == 1 else None for n, k in readers}
            if len(paths) == 1 and None not in paths:
                out[_quantized_alias(name) or name] = f"{paths.pop()}.weight"
            continue
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


def _scope_path(node_name: str) -> str | None:
    """The torch module path in a TorchScript node name (``/enc/enc.0/MatMul`` -> ``enc.0``,
    ``/bert/encoder/layer.0/attention/self/query/MatMul`` -> ``bert.encoder.layer.0.attention.self.query``):
    a scope that repeats its parent's name (a container's child, ``enc.0`` under ``enc``) replaces it."""
    parts = node_name.split("/")
    if len(parts) < 3 or parts[0]:
        return None
    path: list[str] = []
    for c in parts[1:-1]:
        if not c:
            return None
        if path and c.startswith(path[-1] + "."):
            path[-1] = c
        else:
            path.append(c)
    return ".".join(path)


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


def _as_arrays(values: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
    """``values`` (name -> array) as NumPy arrays: arrays and lists as they are, torch tensors (a
    module's parameters, which require grad, on any device) detached and copied to the CPU;
    anything else raises :class:`InputError` naming it. This module does not import torch."""
    out = {}
    for name, value in (values or {}).items():
        if callable(getattr(value, "detach", None)) and callable(getattr(value, "cpu", None)):
            value = value.detach().cpu()  # a torch tensor
            if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16: widened, cast back later
                value = value.float()
            value = value.numpy()
        try:
            out[name] = np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InputError(f"values[{name!r}] is no array ({type(value).__name__}): {exc}") from exc
        if out[name].dtype == object:
            raise InputError(f"values[{name!r}] is no array of numbers ({type(value).__name__})")
    return out


def _adapter_arrays(model: onnx.ModelProto, values: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The adapters' arrays (A and B of each adapted weight, by name), C-contiguous: the value in
    ``values`` (e.g. ``ForwardBackward.parameters``) where it has one, else the model's initializer."""
    inits = {t.name: t for t in model.graph.initializer}
    values = values or {}
    return {
        n: np.ascontiguousarray(values[n] if n in values else to_array(inits[n]))
        for n in adapter_names(model)
    }


def with_values(model: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers named in ``values`` hold those values (arrays, or
    torch tensors: :func:`_as_arrays`)."""
    values = _as_arrays(values)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in out.graph.initializer:
        if t.name in values:
            arr = np.asarray(values[t.name], dtype=np_dtype(t.data_type))
            if tuple(arr.shape) != tuple(t.dims):
                raise InputError(f"{t.name!r} has shape {list(t.dims)}, got {list(arr.shape)}")
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
    return out
