"""Activation recomputation (gradient checkpointing): saved values rebuilt in the backward.

By default the forward hands the backward every value a rule reads (``GradBuilder.saved``). With
``build_gradient(..., recompute=...)`` a chosen part of them is not saved: the backward graph holds
copies of the forward nodes that rebuild them from values that stay saved. The forward nodes are cut
into *segments* (typically one per transformer layer); a recomputed value is rebuilt inside its own
segment only, reading the values that enter the segment, which stay saved (the segment boundaries).

``recompute`` is one of:

* ``"all"``: one segment, every node: the backward rebuilds everything from the inputs and the
  parameters (the fewest saved values, about one more forward of work; on a chain of layers no
  lower peak, since the backward rebuilds every activation before the first gradient and each is
  read again by its own layer's gradient: ``"layers"`` is what lowers the peak);
* ``"layers"``: one segment per layer, the layer found from node names (``/layers.3/...``,
  ``/h.0/...``, ``/0/...``: the first path component that is or ends with a number) or, for the
  dynamo exporter's nodes, from their module path (:func:`layer_of`);
* a string or list of strings: node-name prefixes, one segment each; a ``*`` matches within one
  path component, and each different text it matches is its own segment (``"/layers.*/"``: one
  segment per layer);
* an int: a budget in bytes for the saved values; whole layers (as for ``"layers"``), the largest
  first, are recomputed until the estimate fits. Sizes come from the static shapes of the graph; a
  symbolic dimension counts as 1, so with a dynamic batch the budget is per sample;
* a callable ``node -> segment key or None``.

An option other than a budget that selects no node (a wrong-case ``"Layers"``, prefixes matching no
node name, unnamed nodes, a callable returning ``None`` everywhere) raises :class:`InputError`.

Only deterministic nodes of the standard domain without subgraphs, whose op means the same in the
backward's opset, are copied; the others' outputs stay saved (Dropout, random ops, If/Loop/Scan,
custom domains). Each recomputed node is placed in the backward just before the first node that
reads it, so that the segment's activations are alive only while its own gradients are computed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import onnx
from onnx import defs

from ..errors import InputError
from ..model.graph import RANDOM_OPS, node_operands, np_dtype
from .builder import GradBuilder

Recompute = str | Iterable[str] | int | Callable[[onnx.NodeProto], Any] | None

_RANDOM = RANDOM_OPS | {"Dropout"}  # a recomputed draw would differ from the forward's
_LAYER = re.compile(r"^(.*?/(?:[^/]*[._])?\d+/)")


def layer_of(node: onnx.NodeProto) -> str | None:
    """The layer of a node: the prefix of its name up to a numbered component (``/layers.3/``,
    ``/h.0/``, ``/0/``), else, for ``torch.onnx.export(dynamo=True)`` (nodes named ``node_MatMul_3``),
    its module path up to the first number (``model.layers.3``, from ``pkg.torch.onnx.name_scopes``);
    ``None`` outside any layer."""
    m = _LAYER.match(node.name)
    if m:
        return m.group(1)
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            # module paths from the root, each in full: '', 'model', 'model.layers', 'model.layers.3'
            parts = [x.strip(" '\"") for x in p.value.strip("[]").split(",")]
            for part in parts[:-1]:  # the last one names the op
                if part and part.rsplit(".", 1)[-1].isdigit():
                    return part
    return None


def segmenter(spec: Recompute) -> Callable[[onnx.NodeProto], Any] | None:
    """The segment function of a ``recompute=`` value other than a budget (``None``: nothing)."""
    if spec is None or spec is False:
        return None
    if callable(spec):
        return spec
    if spec == "all":
        return lambda node: "all"
    if spec == "layers":
        return layer_of
    prefixes = [spec] if isinstance(spec, str) else list(spec)
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise InputError(f"recompute= takes {_CHOICES}, got {spec!r}")
    pats = [_prefix(p) for p in prefixes]

    def seg(node: onnx.NodeProto) -> str | None:
        for pat in pats:
            m = pat.match(node.name)
            if m:
                return m.group(0)
        return None

    return seg


_CHOICES = (
    "'all', 'layers', node-name prefixes (a '*' within one path component), a byte budget or a callable"
)


def _check_selects(
    spec: Recompute, seg: Callable[[onnx.NodeProto], Any] | None, nodes: Sequence[onnx.NodeProto]
) -> None:
    """:class:`InputError` when ``spec`` (other than a budget) selects no node of the forward, or
    one of its prefixes matches no node name: an option that selects nothing would silently keep
    every activation."""
    if seg is None or callable(spec):
        if seg is not None and not any(seg(n) is not None for n in nodes):
            raise InputError("recompute=: the callable returned None for every node: nothing to recompute")
        return
    if spec == "all":
        return
    named = [n.name for n in nodes if n.name]
    if spec == "layers":
        if not any(layer_of(n) is not None for n in nodes):
            some = ", ".join(repr(n) for n in named[:5]) or "none: the nodes have no names"
            raise InputError(
                "recompute='layers' found no layer: no node name has a numbered component (/layers.3/, "
                f"/h.0/, /0/) nor a dynamo module path with one (node names: {some}); pass node-name "
                "prefixes, a callable or 'all'"
            )
        return
    prefixes = [spec] if isinstance(spec, str) else list(spec)  # type: ignore[arg-type]
    unmatched = [p for p in prefixes if not any(_prefix(p).match(n) for n in named)]
    if not unmatched:
        return
    near = [p for p in unmatched if p.lower() in ("all", "layers")]
    if near:
        raise InputError(
            f"recompute={near[0]!r} is not an option (they are lowercase): recompute= takes {_CHOICES}"
        )
    off = [p for p in unmatched if p.lower() in ("none", "false", "off", "no")]
    if off:
        raise InputError(
            f"recompute={off[0]!r} is a node-name prefix that matches nothing: to recompute nothing, "
            "pass recompute=None (the Python value, not a string)"
        )
    if not named:
        raise InputError(
            f"recompute={spec!r}: the model's nodes have no names, so no node-name prefix can match; "
            "use 'all', a byte budget or a callable"
        )
    raise InputError(
        f"recompute={spec!r}: the prefixes {unmatched} match no node name (node names begin like "
        f"{', '.join(repr(n) for n in named[:5])}); recompute= takes {_CHOICES}"
    )


def _prefix(prefix: str) -> re.Pattern[str]:
    """A node-name prefix of ``recompute=``: a ``*`` matches within one path component."""
    return re.compile("^" + ".*?".join(re.escape(part) for part in prefix.split("*")).replace(".*?", "[^/]*"))


def _same_meaning(node: onnx.NodeProto, model_version: int, backward_version: int) -> bool:
    if model_version == backward_version:
        return True
    try:
        a = defs.get_schema(node.op_type, model_version, "")
        b = defs.get_schema(node.op_type, backward_version, "")
    except Exception:
        return False
    return a.since_version == b.since_version


def _copyable(node: onnx.NodeProto, model_version: int, backward_version: int) -> bool:
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM:
        return False
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return False
    return _same_meaning(node, model_version, backward_version)


def _nbytes(g: GradBuilder, name: str) -> int:
    info = g.infos.get(name)
    if info is None or info.shape is None:
        return 0
    dims = [d if isinstance(d, int) else 1 for d in info.shape]
    try:
        size = np_dtype(info.dtype)().itemsize
    except Exception:
        size = 4
    return math.prod(dims) * size


def saved_bytes(g: GradBuilder, names: Iterable[str]) -> int:
    """Estimated bytes of the values ``names`` (static shapes; a symbolic dimension counts as 1)."""
    return sum(_nbytes(g, n) for n in names)


def apply_recompute(
    g: GradBuilder,
    nodes: Sequence[onnx.NodeProto],
    fed: set[str],
    spec: Recompute,
    model_version: int,
) -> list[onnx.NodeProto]:
    """Turn the saved values that ``spec`` selects into recomputed ones (see the module doc).

    ``fed``: values the caller feeds to the forward (inputs, trainable values). Edits ``g.saved``
    and ``g.nodes``; returns the forward nodes copied into the backward.
    """
    if spec is None or spec is False:
        return []
    producer = {o: n for n in [*nodes, *g.fwd_nodes] for o in n.output if o}
    if isinstance(spec, int) and not isinstance(spec, bool):
        seg = _budget_segments(g, producer, fed, spec)
    else:
        seg = segmenter(spec)
        _check_selects(spec, seg, nodes)
    if seg is None:
        return []
    copyable: dict[int, bool] = {}

    def can_copy(node: onnx.NodeProto) -> bool:
        k = id(node)
        if k not in copyable:
            copyable[k] = _copyable(node, model_version, g.opset)
        return copyable[k]

    selected = []
    for name in g.saved:
        node = producer.get(name)
        if name in fed or node is None or not can_copy(node) or seg(node) is None:
            continue
        selected.append((name, seg(node)))
    if not selected:
        return []
    for name, _ in selected:
        del g.saved[name]
    copies: dict[int, onnx.NodeProto] = {}  # id(forward node) -> its copy, in the order made
    kept: set[str] = {o for n in g.nodes for o in n.output if o}  # made by the backward already

    def keep(name: str) -> None:
        g.read(g.fwd(name))  # saved (or a constant copied, or a fed value)
        kept.add(name)

    def ensure(name: str, key: Any) -> None:
        if not name or name in kept or name in g.saved or name in g.initializers:
            return
        node = producer.get(name)
        if name in fed or name in g.consts or node is None:
            keep(name)
            return
        if id(node) in copies:
            return
        if not can_copy(node) or seg(node) != key:  # a segment boundary: stays saved
            keep(name)
            return
        copies[id(node)] = node  # reserved before the inputs: no cycles in a sorted graph
        for i in node_operands(node):
            ensure(i, key)

    for name, key in selected:
        ensure(name, key)
    # the copies, renamed where an output also stays saved (a backward input) or is not needed
    made: list[onnx.NodeProto] = []
    for node in copies.values():
        again = onnx.NodeProto()
        again.CopyFrom(node)
        stem = node.name or node.op_type
        again.name = g.fresh(f"recompute{stem}" if stem.startswith("/") else f"recompute/{stem}")
        for j, o in enumerate(again.output):
            if o and (o in g.saved or o in fed):
                again.output[j] = g.fresh(f"{o}_again")
        made.append(again)
    g.nodes[:] = _place(made, g.nodes)
    return made


MARK = "onnxgrad.recompute"  # metadata_props of a backward graph holding recomputed nodes


def runs_in_graph_order(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is a backward graph with recomputed nodes, which onnxruntime must run with
    its priority-based execution order (the session maker sets it on a copy of the options).

    The default order is a depth-first walk from the outputs, which rebuilds a layer's activations
    as soon as any gradient depends on them and so keeps every layer's alive at once (measured on a
    4-layer transformer: no saving at all); the priority-based order follows the graph's order,
    where each recomputed node sits just before its first reader.
    """
    return any(p.key == MARK for p in model.metadata_props)


def _place(copies: list[onnx.NodeProto], nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each copy inserted just before the first node that needs it (directly or
    through other copies)."""
    by_output = {o: c for c in copies for o in c.output if o}
    done: set[int] = set()
    out: list[onnx.NodeProto] = []

    def emit(c: onnx.NodeProto) -> None:
        stack = [(c, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in done:
                continue
            if ready:
                done.add(id(node))
                out.append(node)
                continue
            stack.append((node, True))
            for i in reversed(node_operands(node)):
                dep = by_output.get(i)
                if dep is not None and id(dep) not in done:
                    stack.append((dep, False))

    for node in nodes:
        for i in node_operands(node):
            dep = by_output.get(i)
            if dep is not None and id(dep) not in done:
                emit(dep)
        out.append(node)
    for c in copies:  # copies nothing reads (cannot happen, but keep the graph whole)
        if id(c) not in done:
            emit(c)
    return out


def _budget_segments(
    g: GradBuilder, producer: dict[str, onnx.NodeProto], fed: set[str], budget: int
) -> Callable[[onnx.NodeProto], Any]:
    """The layers (see :func:`layer_of`) to recompute, largest saved bytes first, until the
    estimated saved bytes fit ``budget``; :class:`InputError` when they fit already or there is
    no layer (nothing would be recomputed)."""
    if budget < 0:
        raise InputError(f"recompute budget must be a number of bytes >= 0, got {budget}")
    total = 0
    per_layer: dict[str, int] = {}
    for name in g.saved:
        if name in fed:
            continue
        b = _nbytes(g, name)
        total += b
        node = producer.get(name)
        layer = layer_of(node) if node is not None else None
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + b
    if total <= budget:  # an option that selects nothing is refused, as the others are
        raise InputError(
            f"recompute={budget}: the saved activations (about {total} bytes, static shapes) already fit "
            "the budget, so nothing would be recomputed (and a Trainer would leave its one-graph step "
            "for nothing): pass recompute=None, or a smaller budget"
        )
    if not per_layer:
        raise InputError(
            f"recompute={budget}: a budget recomputes whole layers, and no node name has a numbered "
            "component (/layers.3/, /h.0/) nor a dynamo module path with one: pass node-name prefixes, "
            "a callable or 'all'"
        )
    chosen: set[str] = set()
    for layer, b in sorted(per_layer.items(), key=lambda kv: -kv[1]):
        if total <= budget:
            break
        chosen.add(layer)
        total -= b
    return lambda node: (lambda layer: layer if layer in chosen else None)(layer_of(node))
