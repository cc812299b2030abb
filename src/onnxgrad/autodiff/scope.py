"""Scopes of a gradient build: names, the tape of values the backward reads, forward-graph additions.

A :class:`Scope` is the backward of one graph: the model's graph, or a subgraph of it (an If branch, a
Loop or Scan body: see :meth:`Scope.child`), or a subgraph of the backward itself (the body of a Scan
the backward runs). Every value a backward node reads goes through :meth:`Scope.read`, which keeps
the *tape*:

* a forward value is *saved*: the forward hands it to the backward (``saved``), once however often it
  is read;
* a known tensor of the forward (a non-trainable initializer, a ``Constant`` output: ``consts``) is
  copied into the backward's ``initializers`` instead;
* a value of an enclosing scope is read by name (ONNX subgraphs see the values of the graphs around
  them); a forward one is saved or copied by the scope that defines it.

Names are one name space over all the scopes of a build, so a fresh name never shadows another.
:class:`~onnxgrad.autodiff.builder.GradBuilder` is a scope, with op emission and shape helpers on top.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import NotFoundError
from ..model.graph import Dim, Shaped, ValueInfo


class Value(Shaped):
    """A tensor (or a sequence of tensors) of a scope: its name, element type and (when known) shape.

    ``g`` is the scope that made it. ``forward`` is true for values of the forward graph: reading one
    from the backward saves it, or copies it when it is a known tensor. ``sequence`` marks a sequence
    of tensors (``dtype`` and ``shape`` are then those of its elements). The builder's values
    (:class:`~onnxgrad.autodiff.builder.Var`) add arithmetic that emits nodes.
    """

    __slots__ = ("dtype", "forward", "g", "name", "sequence", "shape")

    def __init__(
        self,
        g: Any,
        name: str,
        dtype: int,
        shape: tuple[Dim, ...] | None = None,
        forward: bool = False,
        sequence: bool = False,
    ) -> None:
        self.g, self.name, self.dtype, self.shape, self.forward = g, name, dtype, shape, forward
        self.sequence = sequence

    def __repr__(self) -> str:
        where = "fwd" if self.forward else "bwd"
        kind = "seq " if self.sequence else ""
        dtype = helper.tensor_dtype_to_string(self.dtype)
        return f"{type(self).__name__}({self.name!r}, {kind}{dtype}, {self.shape}, {where})"

    @property
    def info(self) -> ValueInfo:
        """The type of this value, with its name."""
        return ValueInfo(self.name, self.dtype, self.shape, self.sequence)


class Names:
    """One name space for every scope of a build: each name is handed out once."""

    def __init__(self, taken: Iterable[str]) -> None:
        self.taken = set(taken)
        self._counter = 0

    def fresh(self, hint: str) -> str:
        """A name not taken yet, made from ``hint``; it is taken from now on."""
        while True:
            self._counter += 1
            name = f"{hint}__{self._counter}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def reserve(self, name: str) -> str:
        """``name`` itself if free, else a fresh variant; the result is taken from now on."""
        if name not in self.taken:
            self.taken.add(name)
            return name
        return self.fresh(name)


V = TypeVar("V", bound=Value)  # the builder's kind of value
S = TypeVar("S", bound="Scope[Any]")


class Scope(Generic[V]):
    """The backward of one graph: its nodes, its tape, and the additions its forward graph needs.

    ``infos`` are the forward values' types (shared by every scope of a build); ``consts`` the forward's
    known tensors, which the backward copies instead of saving; ``taken_names`` the names the model
    uses already. ``nodes`` and ``initializers`` make the backward graph; ``saved`` holds the forward
    values it reads; ``fwd_nodes`` the nodes to add to the forward graph (``Shape`` of a value, say).
    """

    value_type: type[V]  # the values a scope makes: the builder's Var

    def __init__(
        self,
        infos: dict[str, ValueInfo],
        consts: dict[str, onnx.TensorProto],
        taken_names: Iterable[str],
        opset: int,
    ) -> None:
        self.infos = infos
        self.consts = consts
        self.opset = opset
        self.names = Names(taken_names)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.saved: dict[str, ValueInfo] = {}
        self.fwd_nodes: list[onnx.NodeProto] = []
        self.versions: dict[str, int] = {}  # opset of each domain of the model ("" for ai.onnx)
        # Gather output -> table row that gets no gradient (torch Embedding's padding_idx)
        self.padding_rows: dict[str, int] = {}
        self.producers: dict[str, onnx.NodeProto] = {}  # forward value -> its node (for errors)
        self.parent: Scope[V] | None = None
        self.local: set[str] = set()  # forward values this scope defines (for a child scope)
        self._fwd_values: dict[str, V] = {}
        self._made: dict[Hashable, V] = {}  # see once
        self._extra_outputs: dict[str, str] = {}  # forward node output slot -> name

    # ---- child scopes ---------------------------------------------------------------------------
    def child(self: S, local: Iterable[str] = (), consts: dict[str, onnx.TensorProto] | None = None) -> S:
        """A scope for a subgraph of the graph this scope builds.

        For the backward of a forward subgraph (an If branch, a Loop or Scan body), ``local`` are the
        subgraph's own values and ``consts`` its known tensors; the child's ``saved`` are then the
        values of the forward subgraph that the backward subgraph reads (its rule exports them). For a
        subgraph of the backward alone (a Scan body), both are empty. Either way the child shares the
        name space, the value types and the opsets, and reads any value of an enclosing scope by name:
        the scope that defines a forward one saves or copies it.
        """
        sub = type(self)(self.infos, {**self.consts, **(consts or {})}, (), self.opset)
        sub.names, sub.versions, sub.parent, sub.local = self.names, self.versions, self, set(local)
        sub.producers = self.producers
        return sub

    def outer(self, var: Value) -> V:
        """A value of the enclosing scope (forward or backward) as a value of this child scope, read
        (so saved or copied in the parent's scope when it is a forward value there)."""
        assert self.parent is not None and var.g is self.parent
        self.parent.read(var)
        return self.value_type(self, var.name, var.dtype, var.shape, sequence=var.sequence)

    def is_outer(self, var: Value) -> bool:
        """Whether ``var`` is a forward value of an enclosing scope (not one this child defines)."""
        return self.parent is not None and var.forward and var.name not in self.local

    # ---- names and the tape ---------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """A name no value of any graph of the build uses."""
        return self.names.fresh(hint)

    def reserve(self, name: str) -> str:
        """``name`` itself if free, else a fresh variant; the result is reserved."""
        return self.names.reserve(name)

    def fwd(self, name: str) -> V:
        """The forward value ``name`` (saved only once a backward node reads it)."""
        var = self._fwd_values.get(name)
        if var is None:
            info = self.infos.get(name)
            if info is None:
                raise NotFoundError(f"{name!r} is not a value of the forward graph")
            var = self.value_type(self, name, info.dtype, info.shape, forward=True, sequence=info.sequence)
            self._fwd_values[name] = var
        return var

    def once(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value ``make()`` returned the first time this scope was asked for ``key``: what a
        scope makes once and shares (a constant, the shape of a forward value, zeros like it)."""
        var = self._made.get(key)
        if var is None:
            var = self._made[key] = make()
        return var

    def read(self, var: Value) -> str:
        """Record that this scope's backward reads ``var``; returns the name to read it by.

        A forward value is saved (a known tensor: copied into the backward), by the scope that
        defines it when that is an enclosing one; any other value is read as it is.
        """
        if self.is_outer(var):
            assert self.parent is not None
            self.parent.read(self.parent.fwd(var.name))
        elif var.forward:
            const = self.consts.get(var.name)
            if const is not None:
                self.initializers.setdefault(var.name, const)
            elif var.name not in self.saved:
                self.saved[var.name] = var.info
        return var.name

    # ---- additions to the forward graph ---------------------------------------------------------
    def new_fwd_value(self, hint: str, info: ValueInfo) -> str:
        """Reserve a name for a value added to this scope's forward graph, of type ``info``."""
        name = self.fresh(hint)
        self.infos[name] = ValueInfo(name, info.dtype, info.shape, info.sequence)
        self.local.add(name)
        return name

    def fwd_op(
        self,
        op_type: str,
        *inputs: Value,
        dtype: int,
        shape: tuple[Dim, ...] | None = None,
        sequence: bool = False,
        **attrs: Any,
    ) -> V:
        """Emit a node into the *forward* graph (e.g. ``Shape``); its output is saved when read."""
        info = ValueInfo("", dtype, shape, sequence)
        name = self.new_fwd_value(f"{inputs[0].name}_{op_type.lower()}", info)
        self.fwd_nodes.append(helper.make_node(op_type, [x.name for x in inputs], [name], **attrs))
        return self.fwd(name)

    def fwd_const(self, value: Any) -> V:
        """A constant of the *forward* graph (a ``Constant`` node), e.g. an index for a forward op."""
        arr = np.asarray(value)
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)

        def make() -> V:
            info = ValueInfo("", helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(arr.shape))
            name = self.new_fwd_value("fwd_const", info)
            self.fwd_nodes.append(
                helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr))
            )
            self.consts[name] = numpy_helper.from_array(arr, name)  # the backward copies, never saves, it
            return self.fwd(name)

        return self.once(("fwd_const", arr.dtype.str, arr.shape, arr.tobytes()), make)

    def extra_output(
        self, node: onnx.NodeProto, slot: int, dtype: int, shape: tuple[Dim, ...] | None = None
    ) -> V:
        """Output ``slot`` of a forward node, adding it to the node when the model left it unused.

        Used where the forward op computes what the backward needs anyway (MaxPool indices,
        LayerNormalization mean and inverse standard deviation).
        """
        if slot < len(node.output) and node.output[slot]:
            return self.fwd(node.output[slot])
        key = f"{id(node)}:{slot}"
        name = self._extra_outputs.get(key)
        if name is None:
            name = self.new_fwd_value(f"{node.output[0]}_out{slot}", ValueInfo("", dtype, shape))
            while len(node.output) <= slot:
                node.output.append("")
            node.output[slot] = name
            self._extra_outputs[key] = name
        return self.fwd(name)
