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
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .autodiff.params import TRAINABLE_KEY
from .errors import InputError
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
    adapted. A name given exactly that cannot be adapted raises :class:`InputError`; patterns skip
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
    index = {id(n): k for k, n in enumerate(graph.node)}
    for name, t in inits.items():
        known = alias.get(name)  # the torch name of a weight the exporter renamed (val_12)
        if not match(name) and not (known and match(known)):
            continue
        why = _unfit(t, uses.get(name, []))
        if why is not None:
            if name in exact or known in exact:
                raise InputError(f"cannot put an adapter beside {name!r}: {why}")
            continue
        w = to_array(t)
        node0, k0 = uses[name][0]
        layout = _layout(node0, k0)
        if layout == "left":  # W [out, in] on the left: A [r, in], B [out, r]
            a_shape, b_shape, fan_in = (rank, w.shape[1]), (w.shape[0], rank), w.shape[1]
        elif layout == "right_t":  # Gemm transB: W [out, in]
            a_shape, b_shape, fan_in = (w.shape[1], rank), (rank, w.shape[0]), w.shape[1]
        else:  # W [in, out]
            a_shape, b_shape, fan_in = (w.shape[0], rank), (rank, w.shape[1]), w.shape[0]
        if any(_layout(n, k) != layout for n, k in uses[name]):
            if name in exact:
                raise InputError(f"cannot put an adapter beside {name!r}: read in different layouts")
            continue
        # PEFT: nn.init.kaiming_uniform_(A, a=sqrt(5)) -> bound = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
        dt = np_dtype(t.data_type)
        a_val = rng.uniform(-bound, bound, size=a_shape).astype(dt)
        b_val = np.zeros(b_shape, dtype=dt)
        a_name = unique_name(f"{known or name}.lora_A", taken)
        b_name = unique_name(f"{known or name}.lora_B", taken)
        graph.initializer.extend(
            [numpy_helper.from_array(a_val, a_name), numpy_helper.from_array(b_val, b_name)]
        )
        ad = _Adapter(name, a_name, b_name, scale, layout, [], [])
        for node, k in uses[name]:
            extra = _adapt_node(node, k, ad, dropout, taken, t.data_type)
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
    node: onnx.NodeProto, k: int, ad: _Adapter, dropout: float, taken: set[str], dtype: int
) -> list[onnx.NodeProto]:
    y = node.output[0]
    base = unique_name(f"{y}_base", taken)
    node.output[0] = base
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
    nodes removed; it computes what the adapted model computes (in inference mode)."""
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
    for ad in adapters:
        w = to_array(inits[ad.weight])
        d = ad.delta(to_array(inits[ad.a]).astype(np.float64), to_array(inits[ad.b]).astype(np.float64))
        merged = (w.astype(np.float64) + d).astype(w.dtype)
        new_w[ad.weight] = numpy_helper.from_array(merged, ad.weight)
    nodes = [n for n in graph.node if n.name not in drop_nodes]
    for n in nodes:
        for j, o in enumerate(n.output):
            if o in rename:
                n.output[j] = rename[o]
    del graph.node[:]
    graph.node.extend(nodes)
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
