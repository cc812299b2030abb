"""Which initializers are one parameter stored several times (tied), and which are several
parameters stored once (aliases): found, tied, untied.

Which initializers train at all is :mod:`onnxgrad.autodiff.trainable`; :func:`select_parameters
<onnxgrad.autodiff.params.select_parameters>` asks both.

**Aliases.** The TorchScript exporter deduplicates initializers by value: a freshly initialised
model's zero biases and ones LayerNorm weights become ONE initializer, read under each parameter's
name through an ``Identity`` node (BERT: 20 biases and LayerNorm weights). A real tie (one tensor
used twice, GPT-2's head) is never written so: it is one initializer read directly, or a folded
transposed copy of it. Equal constant tensors are equal by accident (the tie rules below never tie
them either), so an ``Identity`` of a floating-point initializer that holds one value repeated is a
*value* alias: :func:`split_aliases` makes each such output its own initializer (a copy of the
value), trained apart as torch trains them. An ``Identity`` of any other initializer is a use of it,
as before (it is not split: a copy of distinct values would be tied back anyway).

**Merged constants.** The dynamo exporter's optimizer merges equal initializers too, and reads the
one left directly: a fresh BERT's zero biases are one ``model.embeddings.LayerNorm.bias`` read by
15 nodes. Its node metadata still tells the modules apart (``pkg.torch.onnx.name_scopes``): a
torch parameter (``InputSpec.kind`` PARAMETER) holding one value repeated, read by nodes of modules
other than its own, is split too (:func:`split_aliases`): the nodes of each other module read a
copy named after that module (``model.encoder.layer.0.attention.self.query.bias``), trained apart
as torch trains them. A module applied several times (ALBERT's shared layer) reads its parameter
from its own module each time: one parameter, as in torch. Without that metadata nothing tells a
merge from a sharing: :func:`shared_constants` finds such initializers (one value repeated, read by
several nodes), every front end warns (:func:`~onnxgrad.autodiff.params.select_parameters`),
``onnxgrad info`` lists them, and :func:`split_shared` gives each node its own copy.

**Tied weights.** Exporters fold a transposed copy of a tied embedding (GPT-2's ``lm_head``), so the
file holds two initializers for one parameter. Two floating-point initializers are *one parameter*
when one is bit-equal to the other, to a transpose of it, to a cast of it, or to a cast of a
transpose of it; and both have at least :data:`TIE_MIN_SIZE` values, not all equal (small and
constant tensors, such as zero biases or LayerNorm weights at initialization, are equal by
accident); and neither is a graph input (those can be fed at run time). With ``tie_weights=True``
(the default) such a group is trained as one: the first member (in initializer order, among those
the others can be computed from, preferring one named in ``trainable=``) stays the parameter and
the others are computed from it by ``Identity``/``Transpose``/``Cast`` nodes, so the gradients of
every use add up, as in torch. :func:`untie` turns those nodes back into initializers (what
``to_onnx()`` returns). A group is tied when one of its members is trainable.

**Broadcast copies.** Constant folding also stores a parameter expanded over a batch or a sequence
(BERT's token-type row repeated for every token, ViT's ``cls_token`` for every image, BART's position
rows for every sequence). An initializer ``B`` is *one parameter* with ``A`` when ``B`` equals,
bit for bit, ``np.broadcast_to`` of ``A`` or of a contiguous block of its rows (``A[k:k+n]``, one row
or more), reshaped as needed: every axis of ``B`` along which it repeats holds exact copies, ``B`` is
strictly larger than that core, the core holds at least :data:`BROADCAST_MIN_DISTINCT` distinct
values (and, when no initializer holds it, is no gathered copy, below), both have the same type,
``A`` is itself no broadcast (repeats along no axis) nor the copy of another initializer, and ``B``
is in no group of equal, transposed or cast copies. ``B`` is then computed from ``A`` by
``Slice``/``Reshape``/``Expand`` nodes (its gradient sums over the copies
back into ``A``, as torch's does) and :func:`untie` writes it back.
When no initializer holds the core (the exporter folded the parameter away: ViT's ``cls_token`` is
stored only as ``expand``, 2x1x32), the core becomes a new initializer, ``B_core`` (``B`` cut to
length 1 along its repeated axes), which is the parameter; :func:`untie` writes ``B`` back and drops
``B_core``. Types must match exactly (no cast).

**Gathered copies.** A relative-position bias is a small table read through a constant index
(``table[index]``: Swin's 49 x heads table spread over 16 x 16 window positions, T5's buckets);
exporters fold the gather and keep only the copy, one per layer, the table gone. A table is a table
when the graph says so: equal values alone never tie weights (a checkpoint rounded through bfloat16
or float16, a float16 model, a weight fake-quantized or round-tripped through int8 holds few distinct
values, each many times, and torch trains every element apart). An initializer ``B`` left untied by
the rules above is a gathered copy only when

- the graph reads it as an *attention-score bias* (:func:`score_biases`): every read (through
  ``Identity``, ``Cast``, ``Reshape``, ``Unsqueeze``, ``Expand``...) is an ``Add`` whose sum reaches
  a ``Softmax`` through elementwise and layout ops only, and its last two axes (the query and key
  positions) are at least 2 long; and
- its values are a table spread over those positions by one index shared by every head: the
  positions ``(i, j)`` fall into *classes*, those holding equal values in every slice of the leading
  axes (every head; copies over the batch count once), and either each class covers at least
  :data:`GATHER_MIN_REPEAT` positions on average with at least :data:`BROADCAST_MIN_DISTINCT` table
  entries (classes x distinct slices), or, fewer repeats, the bias is over 1-D relative positions
  (constant along the diagonals of its last two axes, at least :data:`RELATIVE_MIN_DISTINCT`
  entries: T5's buckets over a short sequence, 9 classes over 25 positions, 36 entries for 4 heads,
  which the dynamo exporter keeps as a folded ``slice_1``).

The table is rebuilt as a new initializer ``B_core`` (one entry per class and head, in order of
first appearance) and ``B`` is computed from it by a ``Gather`` with the constant index map, so each
entry trains once, its gradient summed over every position that reads it, as torch sums it into its
table. A rounded checkpoint's values repeat by accident in one head and not in the others, so its
classes are single positions: nothing is tied. (A table whose entries are equal, such as Swin's
all-zero table at initialization, cannot be told from a constant and is trained elementwise.)
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError
from ..model.graph import FLOAT_TYPES, all_names, np_dtype, to_array, unique_name
from .trainable import TORCH_KIND, _dtype_name

TIE_MIN_SIZE = 256
"""The fewest values an initializer needs to be tied to another (smaller ones agree by accident)."""

BROADCAST_MIN_DISTINCT = 16
"""The fewest distinct values the core of a broadcast copy needs (see the module's documentation)."""

GATHER_MIN_REPEAT = 4
"""A gathered copy holds at most 1/this as many classes of positions as positions (see above)."""

RELATIVE_MIN_DISTINCT = 8
"""The fewest table entries of a bias over 1-D relative positions that repeats too little for
:data:`GATHER_MIN_REPEAT` (an identity or banded initialisation, constant along its diagonals too,
holds two or three per head)."""


@dataclass(frozen=True)
class Tie:
    """``name`` is ``source``, transposed by ``perm`` (when given), cast to ``to`` (when given); or
    for a broadcast copy: rows ``rows[0]:rows[1]`` of ``source`` (when given), reshaped to ``shape``
    (when given), expanded to ``expand``; or for a gathered copy: ``source[gather]`` (``gather``: the
    int64 index map, of the copy's shape, into the 1-D table ``source``)."""

    name: str
    source: str
    perm: tuple[int, ...] | None = None
    to: int | None = None
    rows: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None
    expand: tuple[int, ...] | None = None
    made: bool = False  # source is a new initializer: the core of ``name``, made by tie_parameters
    gather: np.ndarray | None = field(default=None, compare=False, repr=False)  # index into source

    def core(self, value: np.ndarray) -> np.ndarray:
        """For a ``made`` tie: the source's value, from the value of ``name``."""
        if self.gather is not None:
            table = np.empty(int(self.gather.max()) + 1, value.dtype)
            table[self.gather.ravel()] = value.ravel()  # the copies of one entry are equal
            return table
        assert self.shape is not None
        return np.ascontiguousarray(value[tuple(slice(0, d) for d in self.shape)])

    @property
    def how(self) -> str:
        """How ``name`` is computed from ``source``, in words (``onnxgrad info``)."""
        if self.gather is not None:
            return f"gather of {int(self.gather.max()) + 1} entries over {list(self.gather.shape)}"
        parts = []
        if self.rows is not None:
            parts.append(f"rows {self.rows[0]}:{self.rows[1]}")
        if self.shape is not None and not self.made:
            parts.append(f"reshape {list(self.shape)}")
        if self.expand is not None:
            parts.append(f"expand to {list(self.expand)}")
        if self.perm is not None:
            parts.append(f"transpose {list(self.perm)}")
        if self.to is not None:
            parts.append(f"cast to {_dtype_name(self.to)}")
        return " then ".join(parts) or "identical"

    def compute(self, value: np.ndarray) -> np.ndarray:
        """This tied value, from the value of ``source``."""
        if self.gather is not None:
            return np.ascontiguousarray(value[self.gather])
        if self.rows is not None:
            value = value[self.rows[0] : self.rows[1]]
        if self.shape is not None:
            value = value.reshape(self.shape)
        if self.expand is not None:
            value = np.broadcast_to(value, self.expand)
        if self.perm is not None:
            value = np.transpose(value, self.perm)
        if self.to is not None:
            value = value.astype(np_dtype(self.to))
        return np.ascontiguousarray(value)


# ---- aliases ------------------------------------------------------------------------------------
def split_aliases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` with each ``Identity`` of a floating-point initializer in its main graph replaced by
    an initializer of its own (a copy of the value, named as the Identity's output), and the
    parameters the dynamo exporter merged read apart (see the module's documentation); and those
    aliases as name -> the initializer they were read from.
    ``model`` itself when it has none; a copy otherwise. Aliases that are graph outputs, and those
    of initializers that are also graph inputs (fed at run time), are left alone."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    fixed = {o.name for o in graph.output} | {i.name for i in graph.input}
    aliases: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
            continue
        src, dst = node.input[0], node.output[0]
        free = src not in fixed and dst not in fixed and dst not in inits
        if free and src in inits and inits[src].data_type in FLOAT_TYPES and _constant(inits[src]):
            aliases[dst] = src
    merged = _merged_by_exporter(model)
    if merged:  # several parameters the dynamo exporter merged: each module reads its own
        model, copies = _give_copies(model, merged)
        split, more = split_aliases(model) if aliases else (model, {})
        return split, {**copies, **more}
    if not aliases:
        return model, {}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [
        n for n in out.graph.node if not (n.op_type == "Identity" and n.output and n.output[0] in aliases)
    ]
    del out.graph.node[:]
    out.graph.node.extend(keep)
    for dst, src in aliases.items():
        copy = TensorProto()
        copy.CopyFrom(inits[src])
        copy.name = dst
        out.graph.initializer.append(copy)
    return out, aliases


def _constant(t: TensorProto) -> bool:
    flat = to_array(t).ravel()
    return bool(flat.size) and bool((flat == flat[0]).all())


_SCOPES = "pkg.torch.onnx.name_scopes"  # the dynamo exporter's module path of each node


def shared_constants(
    model: onnx.ModelProto, names: Iterable[str] | None = None
) -> dict[str, list[onnx.NodeProto]]:
    """Floating-point initializers of ``model``'s main graph (among ``names``, default all) that
    hold one value repeated (two elements or more) and that several nodes read directly: name ->
    those nodes, in graph order. An exporter that merged equal parameters stores them so (see the
    module's documentation); so does a layer applied several times."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    fixed = {o.name for o in graph.output} | {i.name for i in graph.input}
    wanted = set(inits) if names is None else set(names) & set(inits)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for i in dict.fromkeys(node.input):
            if i in wanted:
                readers.setdefault(i, []).append(node)
    out = {}
    for name, nodes in readers.items():
        t = inits[name]
        if len(nodes) < 2 or name in fixed or t.data_type not in FLOAT_TYPES:
            continue
        if int(np.prod(t.dims, dtype=np.int64)) >= 2 and _constant(t):
            out[name] = nodes
    return out


def merge_suspects(model: onnx.ModelProto, names: Iterable[str] | None = None) -> dict[str, list[str]]:
    """The :func:`shared_constants` among ``names`` that the file does not explain (no module known
    for some reader; readers all in the parameter's own module are a layer applied several times):
    name -> the names of the nodes that read it."""
    out = {}
    for name, nodes in shared_constants(model, names).items():
        groups = _owner_groups(name, nodes)
        if groups is None or len(groups) > 1:
            out[name] = [n.name or n.output[0] for n in nodes]
    return out


def _module(node: onnx.NodeProto) -> str | None:
    """The module path of the torch call ``node`` came from (dynamo metadata), or None."""
    raw = next((p.value for p in node.metadata_props if p.key == _SCOPES), None)
    try:
        scopes = ast.literal_eval(raw) if raw is not None else None
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2 or not all(isinstance(x, str) for x in scopes):
        return None
    return scopes[-2]  # the last entry is the call itself


def _kind(model: onnx.ModelProto, name: str) -> str | None:
    for v in (*model.graph.value_info, *model.graph.input, *model.graph.initializer):
        if v.name == name:
            for p in v.metadata_props:
                if p.key == TORCH_KIND:
                    return p.value
    return None


def _owner_groups(name: str, nodes: list[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]] | None:
    """The readers ``nodes`` of parameter ``name`` grouped by module (``""``: its own module), when
    every reader's module is known; None otherwise."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    groups: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        module = _module(node)
        if module is None:
            return None
        mine = module == owner or module.startswith(f"{owner}.") if owner else True
        groups.setdefault("" if mine else module, []).append(node)
    return groups


def _give_copies(
    model: onnx.ModelProto, plans: dict[str, dict[str, list[onnx.NodeProto]]]
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of ``model`` where, for each initializer of ``plans`` (name -> copy name -> readers),
    the readers of each copy read a new initializer of that name holding the same value (with the
    original's value_info, renamed); and the copies as copy -> original."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    infos = {v.name: v for v in graph.value_info}
    position = {id(n): k for k, n in enumerate(model.graph.node)}
    made: dict[str, str] = {}
    for name, copies in plans.items():
        for copy_name, readers in copies.items():
            for node in readers:
                target = graph.node[position[id(node)]]
                for k, i in enumerate(target.input):
                    if i == name:
                        target.input[k] = copy_name
            tensor = TensorProto()
            tensor.CopyFrom(inits[name])
            tensor.name = copy_name
            graph.initializer.append(tensor)
            if name in infos:
                info = onnx.ValueInfoProto()
                info.CopyFrom(infos[name])
                info.name = copy_name
                graph.value_info.append(info)
            made[copy_name] = name
    return out, made


def _copy_names(
    name: str, groups: dict[str, list[onnx.NodeProto]], taken: set[str]
) -> dict[str, list[onnx.NodeProto]]:
    """Copy name -> readers, for every group of ``groups`` but the one keeping ``name`` (its own
    module's, else the first): ``<module>.<leaf>`` (a torch parameter's name) when free."""
    leaf = name.rsplit(".", 1)[-1]
    keep = "" if "" in groups else next(iter(groups))
    plan: dict[str, list[onnx.NodeProto]] = {}
    for k, (module, readers) in enumerate(groups.items()):
        if module == keep:
            continue
        wanted = f"{module}.{leaf}" if module and not module.startswith("#") else f"{name}_{k}"
        copy_name = unique_name(wanted, taken)
        taken.add(copy_name)
        plan[copy_name] = readers
    return plan


def _merged_by_exporter(model: onnx.ModelProto) -> dict[str, dict[str, list[onnx.NodeProto]]]:
    """The torch parameters the dynamo exporter merged (see the module's documentation): name ->
    copy name -> the nodes that read it."""
    taken = all_names(model.graph)
    plans = {}
    for name, nodes in shared_constants(model).items():
        if _kind(model, name) != "PARAMETER":
            continue
        groups = _owner_groups(name, nodes)
        if groups is None or len(groups) < 2:
            continue  # unknown modules, or one module applied several times: one parameter
        plans[name] = _copy_names(name, groups, taken)
    return plans


def split_shared(model: onnx.ModelProto, names: Iterable[str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` where each node reading one of the initializers ``names`` (default: every
    initializer :func:`shared_constants` finds, one value repeated read by several nodes) reads a
    copy of its own, so that they train apart: the way to keep apart parameters that an exporter
    merged (the dynamo exporter's optimizer on a freshly initialised model) when the file does not
    say which modules read them. The first reader keeps the name; a reader whose torch module is
    known (dynamo metadata) reads ``<module>.<leaf>``, another ``<name>_<k>``. :class:`InputError`
    for a name that is no initializer read by several nodes."""
    found = shared_constants(model) if names is None else None
    if names is not None:
        names = [names] if isinstance(names, str) else list(dict.fromkeys(names))
        graph = model.graph
        inits = {i.name for i in graph.initializer}
        found = {}
        for name in names:
            readers = [n for n in graph.node if name in n.input]
            if name not in inits or len(readers) < 2:
                raise InputError(f"{name!r} is not an initializer that several nodes read (split_shared)")
            found[name] = readers
    taken = all_names(model.graph)
    plans = {}
    for name, nodes in found.items():
        groups = _owner_groups(name, nodes)
        if groups is None or len(groups) < 2:  # no module known: a copy per node
            groups = {f"#{k}": [node] for k, node in enumerate(nodes)}
        plans[name] = _copy_names(name, groups, taken)
    return _give_copies(model, plans)[0]


# ---- tied weights --------------------------------------------------------------------------------
Extremes = tuple[np.generic, np.generic]  # (minimum, maximum) of a tensor


def find_ties(model: onnx.ModelProto, candidates: Iterable[str], prefer: Iterable[str] = ()) -> list[Tie]:
    """Ties among ``candidates`` (initializer names): for each group of initializers that are one
    parameter, one :class:`Tie` per member computed from the group's parameter."""
    graph = model.graph
    declared = {i.name for i in graph.input}
    inits = {i.name: i for i in graph.initializer}
    wanted = [n for n in dict.fromkeys(candidates) if n in inits and n not in declared]
    order = {n: k for k, n in enumerate(inits)}
    prefer = list(prefer)
    values: dict[str, np.ndarray] = {}
    extremes: dict[str, Extremes] = {}  # (min, max): a cheap reject of most pairs
    buckets: dict[tuple, list[str]] = {}
    for n in wanted:
        t = inits[n]
        if t.data_type not in FLOAT_TYPES or int(np.prod(t.dims, dtype=np.int64)) < TIE_MIN_SIZE:
            continue
        v = to_array(t)
        flat = v.ravel()
        if not np.isfinite(flat).all() or (flat == flat[0]).all():
            continue
        values[n] = v
        extremes[n] = (flat.min(), flat.max())
        buckets.setdefault(tuple(sorted(t.dims)), []).append(n)
    ties: list[Tie] = []
    for names in buckets.values():
        if len(names) < 2:
            continue
        # pairs (a, b) where b is computed exactly from a
        derive: dict[tuple[str, str], Tie] = {}
        for a, b in _candidate_pairs(names, extremes):
            back = derive.get((b, a))
            if back is not None and back.to is None:  # a transpose or a copy goes both ways
                perm = None if back.perm is None else tuple(int(i) for i in np.argsort(back.perm))
                derive[(a, b)] = Tie(b, a, perm)
                continue
            tie = _derivation(a, values[a], b, values[b], inits[a].data_type, inits[b].data_type)
            if tie is not None:
                derive[(a, b)] = tie
        ties.extend(_groups(names, derive, order, prefer))
    ties.extend(_broadcast_ties(model, wanted, ties, order, prefer, values))
    ties.extend(_gather_ties(model, wanted, ties))
    return ties


def _gather_ties(model: onnx.ModelProto, wanted: list[str], ties: list[Tie]) -> list[Tie]:
    """Gathered copies among ``wanted`` that no tie in ``ties`` holds: attention-score biases each
    computed from a new table of its entries (see the module's documentation)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    taken = set(inits) | {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    taken |= {t.source for t in ties}
    grouped = {t.name for t in ties} | {t.source for t in ties}
    biases = score_biases(model)
    out: list[Tie] = []
    for n in wanted:
        t = inits[n]
        if n in grouped or n not in biases or t.data_type not in FLOAT_TYPES:
            continue
        index = gather_index(to_array(t))
        if index is not None:
            out.append(Tie(n, unique_name(f"{n}_core", taken), made=True, gather=index))
    return out


def gather_index(v: np.ndarray) -> np.ndarray | None:
    """The index map (int64, of ``v``'s shape) of ``v`` as a gathered copy of a table, or None when
    its values are no such copy (see the module's documentation): positions (the last two axes)
    are classed by their values in every slice of the leading axes, and a table entry is one class
    in one distinct slice, numbered in order of first appearance."""
    if v.ndim < 2 or v.shape[-1] < 2 or v.shape[-2] < 2:
        return None
    v = np.ascontiguousarray(v)
    if not np.isfinite(v).all():
        return None
    positions = v.shape[-1] * v.shape[-2]
    rows = _bits(v).reshape(-1, positions)  # one row per slice of the leading axes (each head)
    _, first_row, unique_of = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    rank_of_unique = np.argsort(np.argsort(first_row))  # distinct slices in order of appearance
    slice_of = rank_of_unique[unique_of.ravel()]  # each row's distinct slice: batch copies are one
    slices = rows[np.sort(first_row)]
    _, class_of = np.unique(slices.T, axis=0, return_inverse=True)  # positions equal in every slice
    class_of = class_of.ravel()
    classes, n_slices = int(class_of.max()) + 1, slices.shape[0]
    entries = classes * n_slices
    if entries == 1:
        return None  # one value: a constant
    many = entries >= BROADCAST_MIN_DISTINCT and classes * GATHER_MIN_REPEAT <= positions
    relative = entries >= RELATIVE_MIN_DISTINCT and classes < positions and _relative_positions(v)
    if not (many or relative):
        return None
    key = (slice_of[:, None] * classes + class_of[None, :]).ravel()
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first)] = np.arange(first.size)  # entries in order of first appearance
    return rank[inverse.ravel()].reshape(v.shape)


# ops a score bias may pass through on its way to the Softmax: elementwise and layout ops
_TO_SOFTMAX = {
    "Add", "Sub", "Mul", "Div", "Where", "Identity", "Cast", "CastLike", "Reshape", "Unsqueeze",
    "Squeeze", "Expand", "Transpose", "Flatten",
}  # fmt: skip
# ops an initializer may be read through before its Add (input 0 only)
_BIAS_LAYOUT = {"Identity", "Cast", "CastLike", "Reshape", "Unsqueeze", "Squeeze", "Expand", "Flatten"}
_SOFTMAX_DEPTH = 8  # nodes between a bias's Add and its Softmax, at most


def score_biases(model: onnx.ModelProto) -> set[str]:
    """The initializers of ``model``'s main graph that the graph reads as attention-score biases:
    every read, through layout ops, is an ``Add`` whose sum reaches a ``Softmax`` through at most
    :data:`_SOFTMAX_DEPTH` elementwise or layout ops (the form of a relative-position bias added to
    ``q k^T``, Swin's and T5's)."""
    graph = model.graph
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, i in enumerate(node.input):
            if i:
                consumers.setdefault(i, []).append((node, k))
    outputs = {o.name for o in graph.output}

    def standard(node: onnx.NodeProto) -> bool:
        return node.domain in ("", "ai.onnx")

    def softmax_after(value: str) -> bool:
        seen, frontier = {value}, [value]
        for _ in range(_SOFTMAX_DEPTH):
            nxt = []
            for name in frontier:
                for node, _k in consumers.get(name, []):
                    if not standard(node):
                        continue
                    if node.op_type == "Softmax":
                        return True
                    if node.op_type in _TO_SOFTMAX:
                        nxt.extend(o for o in node.output if o and o not in seen)
                        seen.update(node.output)
            frontier = nxt
        return False

    def reads(name: str, depth: int = 0) -> list[tuple[onnx.NodeProto, int]] | None:
        found = []
        if name in outputs or depth > _SOFTMAX_DEPTH:
            return None
        for node, k in consumers.get(name, []):
            if standard(node) and node.op_type in _BIAS_LAYOUT and k == 0 and node.output:
                inner = reads(node.output[0], depth + 1)
                if inner is None:
                    return None
                found.extend(inner)
            else:
                found.append((node, k))
        return found

    out = set()
    for init in graph.initializer:
        if init.data_type not in FLOAT_TYPES or len(init.dims) < 2 or min(init.dims[-2:]) < 2:
            continue
        uses = reads(init.name)
        if uses and all(standard(n) and n.op_type == "Add" and softmax_after(n.output[0]) for n, _ in uses):
            out.add(init.name)
    return out


def _relative_positions(v: np.ndarray) -> bool:
    """Whether ``v`` is constant, bit for bit, along every diagonal of its last two axes (each
    square of them at least 2 x 2): ``v[..., i, j]`` depends on ``j - i`` only, the form of a bias
    over 1-D relative positions (T5's buckets), which no trained weight takes by accident."""
    if v.ndim < 2 or v.shape[-1] < 2 or v.shape[-2] < 2:
        return False
    b = _bits(v)
    return bool((b[..., 1:, 1:] == b[..., :-1, :-1]).all())


def _bits(v: np.ndarray) -> np.ndarray:
    return v.view(np.dtype(f"u{v.dtype.itemsize}"))


def _core(v: np.ndarray) -> tuple[np.ndarray, bool]:
    """``v`` (as bits) with every axis along which it repeats exactly cut to length 1, and whether
    there was one."""
    core = _bits(v)
    repeated = False
    for axis in range(core.ndim):
        if core.shape[axis] < 2:
            continue
        first = core[(slice(None),) * axis + (slice(0, 1),)]
        second = core[(slice(None),) * axis + (slice(1, 2),)]
        if first.flat[0] != second.flat[0] or not np.array_equal(first, second):  # cheap rejects
            continue
        if np.array_equal(core, np.broadcast_to(first, core.shape)):
            core, repeated = first, True
    return core, repeated


def _broadcast_ties(
    model: onnx.ModelProto,
    wanted: list[str],
    ties: list[Tie],
    order: dict[str, int],
    prefer: list[str],
    cache: dict[str, np.ndarray],
) -> list[Tie]:
    """Ties of initializers that are a broadcast of another's rows (see the module's documentation)."""
    inits = {i.name: i for i in model.graph.initializer}
    taken = set(inits) | {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output}
    grouped = {t.name for t in ties} | {t.source for t in ties}
    copies = {t.name for t in ties}
    values: dict[str, np.ndarray] = {}
    cores: dict[str, np.ndarray] = {}
    for n in wanted:
        t = inits[n]
        if t.data_type not in FLOAT_TYPES or int(np.prod(t.dims, dtype=np.int64)) < BROADCAST_MIN_DISTINCT:
            continue
        v = cache.get(n)  # checked already (finite, not all equal)
        if v is None:
            v = to_array(t)
            if v.ndim == 0 or not np.isfinite(v).all():
                continue
        core, repeated = _core(v)
        values[n] = v
        if repeated:
            cores[n] = core
    rank = {n: (prefer.index(n) if n in prefer else len(prefer), order[n]) for n in values}
    biases = score_biases(model) if cores else set()
    sources = sorted((n for n in values if n not in cores and n not in copies), key=lambda n: rank[n])
    out: list[Tie] = []
    for b, core in cores.items():
        if b in grouped or np.unique(core).size < BROADCAST_MIN_DISTINCT:
            continue
        flat = core.ravel()
        matched = False
        for a in sources:
            va = values[a]
            if va.dtype != values[b].dtype or va.size < flat.size:
                continue
            row = va.size // va.shape[0]
            if flat.size % row:
                continue
            n_rows = flat.size // row
            table = _bits(va).reshape(va.shape[0], row)
            found = None
            for k in np.flatnonzero(table[: va.shape[0] - n_rows + 1, 0] == flat[0]):
                if np.array_equal(table[k : k + n_rows].ravel(), flat):
                    found = int(k)
                    break
            if found is None:
                continue
            matched = True
            rows = None if n_rows == va.shape[0] else (found, found + n_rows)
            shape = None if tuple(core.shape) == (n_rows, *va.shape[1:]) else tuple(core.shape)
            out.append(Tie(b, a, rows=rows, shape=shape, expand=tuple(values[b].shape)))
            break
        # no initializer holds the core: it becomes a new one, the parameter; unless the copy is an
        # attention-score bias whose core is a gathered copy (T5's decoder position bias expanded
        # over the batch): a gather then
        if not matched and not (b in biases and gather_index(values[b]) is not None):
            source = unique_name(f"{b}_core", taken)
            out.append(Tie(b, source, shape=tuple(core.shape), expand=tuple(values[b].shape), made=True))
    return out


def _candidate_pairs(names: list[str], extremes: dict[str, Extremes]) -> list[tuple[str, str]]:
    """The ordered pairs of ``names`` (in the order of ``itertools.permutations``) that may be one
    parameter: their extremes match (:func:`_same_extremes`). Pairs of one dtype are found by
    grouping on the extremes' bits, so a model's many same-shaped weights cost no pairwise work."""
    index = {n: k for k, n in enumerate(names)}
    groups: dict[tuple[str, bytes, bytes], list[str]] = {}
    for n in names:
        lo, hi = extremes[n]
        groups.setdefault((lo.dtype.str, lo.tobytes(), hi.tobytes()), []).append(n)
    pairs = [p for group in groups.values() for p in itertools.permutations(group, 2)]
    if len({extremes[n][0].dtype for n in names}) > 1:  # casts: across dtypes, compared in pairs
        pairs += [
            (a, b)
            for a, b in itertools.permutations(names, 2)
            if extremes[a][0].dtype != extremes[b][0].dtype and _same_extremes(extremes[a], extremes[b])
        ]
    return sorted(pairs, key=lambda p: (index[p[0]], index[p[1]]))


def _same_extremes(a: Extremes, b: Extremes) -> bool:
    """Whether a tensor of extremes ``a`` can be a transpose or a cast of one of extremes ``b``.

    Transposing keeps the minimum and the maximum, and a cast rounds monotonically, so the cast of
    the extremes are the extremes of the cast: unequal extremes rule a pair out without looking at
    the tensors (the comparison of a 24-layer model's 96 same-shaped weights went from 0.7 s to
    milliseconds). A dtype numpy cannot cast between says nothing: the pair is compared in full.
    """
    (lo_a, hi_a), (lo_b, hi_b) = a, b
    try:
        with np.errstate(all="ignore"):  # a cast may overflow to inf: then unequal, as it should
            lo, hi = np.asarray(lo_a).astype(lo_b.dtype), np.asarray(hi_a).astype(hi_b.dtype)
        return bool(lo == lo_b and hi == hi_b)
    except (TypeError, ValueError):
        return True


_SAMPLE = 64  # elements compared before whole tensors


def _derivation(a: str, va: np.ndarray, b: str, vb: np.ndarray, ta: int, tb: int) -> Tie | None:
    """The tie computing ``b`` from ``a`` bit for bit, or None."""
    to = None if ta == tb else tb
    perms: list[tuple[int, ...] | None] = [None]
    if va.ndim <= 4:
        perms += [p for p in itertools.permutations(range(va.ndim)) if p != tuple(range(va.ndim))]
    # a few elements first (cheap), then the whole tensor
    rng = np.random.default_rng(0)
    where = tuple(rng.integers(0, d, _SAMPLE) for d in vb.shape)
    for perm in perms:
        tie = Tie(b, a, perm, to)
        if (va.shape if perm is None else tuple(va.shape[i] for i in perm)) != vb.shape:
            continue
        source = list(where)
        if perm is not None:
            for k, p in enumerate(perm):
                source[p] = where[k]
        sample = va[tuple(source)]
        if to is not None:
            sample = sample.astype(vb.dtype)
        if sample.tobytes() != vb[where].tobytes():  # one differs: no need to look at all
            continue
        got = va if perm is None else np.transpose(va, perm)  # a view: no copy
        if to is not None:
            got = got.astype(vb.dtype)
        bits = np.dtype(f"u{vb.dtype.itemsize}")
        if got.dtype == vb.dtype and np.array_equal(got.view(bits), vb.view(bits)):  # bit for bit
            return tie
    return None


def _groups(
    names: list[str], derive: dict[tuple[str, str], Tie], order: dict[str, int], prefer: list[str]
) -> list[Tie]:
    ties: list[Tie] = []
    done: set[str] = set()
    rank = {n: (prefer.index(n) if n in prefer else len(prefer), order[n]) for n in names}
    for a in sorted(names, key=lambda n: rank[n]):
        if a in done:
            continue
        members = [b for b in names if b != a and b not in done and (a, b) in derive]
        if not members:
            continue
        done.add(a)
        for b in members:
            done.add(b)
            ties.append(derive[(a, b)])
    return ties


def tie_parameters(model: onnx.ModelProto, ties: list[Tie]) -> onnx.ModelProto:
    """A copy of ``model`` whose tied initializers are computed from their parameter by nodes put
    first in the graph."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not ties:
        return out
    graph = out.graph
    tied = {t.name for t in ties}
    made = [t for t in ties if t.made]
    if made:
        inits = {i.name: i for i in graph.initializer}
        cores = [numpy_helper.from_array(t.core(to_array(inits[t.name])), t.source) for t in made]
        graph.initializer.extend(cores)
    for k in reversed(range(len(graph.initializer))):  # in place: no copy of the other weights
        if graph.initializer[k].name in tied:
            del graph.initializer[k]
    taken = {n.name for n in graph.node} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.initializer}
    nodes = []
    for t in ties:
        src = t.source
        if t.expand is not None:
            nodes.extend(_broadcast_nodes(t, taken))
            continue
        if t.gather is not None:
            index = unique_name(f"{t.name}_index", taken)
            value = numpy_helper.from_array(t.gather, index)
            nodes.append(helper.make_node("Constant", [], [index], name=_node_name(t, taken), value=value))
            nodes.append(helper.make_node("Gather", [src, index], [t.name], name=_node_name(t, taken)))
            continue
        if t.perm is not None:
            dst = t.name if t.to is None else unique_name(f"{t.name}_transposed", taken)
            name = _node_name(t, taken)
            nodes.append(helper.make_node("Transpose", [src], [dst], name=name, perm=list(t.perm)))
            src = dst
        if t.to is not None:
            nodes.append(helper.make_node("Cast", [src], [t.name], name=_node_name(t, taken), to=t.to))
        if t.perm is None and t.to is None:
            nodes.append(helper.make_node("Identity", [src], [t.name], name=_node_name(t, taken)))
    rest = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + rest)
    return out


def _node_name(t: Tie, taken: set[str]) -> str:
    return unique_name(f"onnxgrad_tie_{t.name}", taken)


def _broadcast_nodes(t: Tie, taken: set[str]) -> list[onnx.NodeProto]:
    """Slice, Reshape and Expand computing the broadcast copy ``t`` from its source; their int64
    arguments are Constant nodes (named as tie nodes, so that :func:`untie` drops them too)."""
    nodes: list[onnx.NodeProto] = []

    def const(label: str, value: list[int]) -> str:
        out = unique_name(f"{t.name}_{label}", taken)
        taken.add(out)
        tensor = numpy_helper.from_array(np.array(value, np.int64), out)
        nodes.append(helper.make_node("Constant", [], [out], name=_node_name(t, taken), value=tensor))
        return out

    def step(op: str, inputs: list[str], label: str, last: bool) -> str:
        out = t.name if last else unique_name(f"{t.name}_{label}", taken)
        taken.add(out)
        nodes.append(helper.make_node(op, inputs, [out], name=_node_name(t, taken)))
        return out

    assert t.expand is not None
    src = t.source
    if t.rows is not None:
        args = [const("starts", [t.rows[0]]), const("ends", [t.rows[1]]), const("axes", [0])]
        src = step("Slice", [src, *args], "rows", False)
    if t.shape is not None and not t.made:
        src = step("Reshape", [src, const("shape", list(t.shape))], "reshaped", False)
    step("Expand", [src, const("expand", list(t.expand))], "expanded", True)
    return nodes


def untie(model: onnx.ModelProto, ties: Iterable[Tie]) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with each tied value that nodes compute from an
    initializer made an initializer again, holding the value computed from the parameter's."""
    ties = list(ties)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    new = []
    for t in ties:
        if t.source in inits:
            new.append(numpy_helper.from_array(t.compute(to_array(inits[t.source])), t.name))
    if not new:
        return model
    names = {t.name for t in new}
    producers = {}
    for node in graph.node:
        for o in node.output:
            producers[o] = node
    drop = set()
    stack = [producers.get(n) for n in names]
    while stack:  # the tie nodes computing them, arguments (Constant nodes) included
        node = stack.pop()
        if node is None or id(node) in drop or not node.name.startswith("onnxgrad_tie_"):
            continue
        drop.add(id(node))
        stack.extend(producers.get(i) for i in node.input if i)
    keep = [n for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new)
    made = {t.source for t in ties if t.made}
    for k in reversed(range(len(graph.initializer))):  # cores made by tie_parameters: gone again
        if graph.initializer[k].name in made:
            del graph.initializer[k]
    return model
