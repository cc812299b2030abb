"""Switching a model between training and inference behaviour.

Two ops behave differently when training: Dropout (drops and rescales; the identity at inference)
and BatchNormalization (normalizes with the batch's own statistics and outputs updated running
statistics; uses the running statistics at inference). Exporters fix the mode when writing the
file (``torch.onnx.export`` writes the inference form unless told
``training=torch.onnx.TrainingMode.TRAINING``); :func:`set_training_mode` rewrites it either way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError
from ..model.graph import check_model, node_operands, opset_of, subgraphs, unique_name
from ..model.infer import infer_value_infos
from ..model.load import CheckedModel, load_model

_SWITCHED = ("Dropout", "BatchNormalization")


@dataclass(frozen=True)
class ModeSwitch:
    """The result of :func:`set_training_mode`.

    ``model``: the switched copy. ``running_stats``: in training mode, for every running statistic
    a BatchNormalization reads (its ``input_mean`` / ``input_var``, an initializer or a graph input),
    the graph output that carries its updated value after a forward pass: write that value back
    into the initializer to keep the statistics running (initializers are also made graph inputs,
    so a session can be fed the current values instead of being rebuilt). Running statistics are
    buffers, not parameters: leave them out of the trainable values (:attr:`buffers`).
    """

    model: onnx.ModelProto
    running_stats: dict[str, str] = field(default_factory=dict)

    @property
    def buffers(self) -> list[str]:
        """Names of the running statistics (not to be trained)."""
        return list(self.running_stats)


def set_training_mode(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes, training: bool
) -> ModeSwitch:
    """A copy of ``model`` with every Dropout and BatchNormalization in training or inference mode.

    Dropout (opset 12+) gets a constant ``training_mode`` input; BatchNormalization (opset 14+) the
    ``training_mode`` attribute, and in training mode its running-statistics outputs, which become
    graph outputs (see :class:`ModeSwitch`). Switching to inference drops those outputs (values
    still read elsewhere become copies of the running statistics, which inference leaves as they
    are). Older opsets can only be switched to inference (their Dropout is the identity); for
    training, convert the model first (``onnx.version_converter.convert_version(model, 15)``).
    Only the main graph is switched: a Dropout or BatchNormalization inside a subgraph
    (``If``/``Loop``/``Scan`` body) raises :class:`ModelError`. Model-local functions that contain
    one are inlined first.
    """
    proto = onnx.ModelProto()
    proto.CopyFrom(load_model(model))
    if any(node.op_type in _SWITCHED for f in proto.functions for node in f.node):
        from onnx import inliner

        proto = inliner.inline_local_functions(proto)
    graph = proto.graph
    _refusesubgraphs(graph)
    opset = opset_of(proto, "")
    switch = _Switcher(proto, training, opset)
    for node in list(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Dropout":
            switch.dropout(node)
        elif node.op_type == "BatchNormalization":
            switch.batch_norm(node)
    switch.finish()
    check_model(proto)
    return ModeSwitch(proto, switch.running_stats)


def _refusesubgraphs(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        for sub in subgraphs(node):
            inner = next((m for m in _all_nodes(sub) if m.op_type in _SWITCHED), None)
            if inner is not None:
                raise ModelError(
                    f"{inner.op_type} node {inner.name!r} is inside a subgraph of {node.op_type} node "
                    f"{node.name!r}: set_training_mode only switches nodes of the main graph"
                )


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for sub in subgraphs(node):
            yield from _all_nodes(sub)


class _Switcher:
    """The rewrites of :func:`set_training_mode`, with the bookkeeping they share."""

    def __init__(self, model: onnx.ModelProto, training: bool, opset: int) -> None:
        self.model, self.graph, self.training, self.opset = model, model.graph, training, opset
        g = model.graph
        self.taken = {i.name for i in [*g.input, *g.output, *g.initializer, *g.value_info]}
        self.taken |= {o for n in g.node for o in n.output}
        self.inits = {i.name: i for i in g.initializer}
        self.graph_inputs = {i.name for i in g.input}
        self.graph_outputs = {o.name for o in g.output}
        self.running_stats: dict[str, str] = {}
        self._flag: str | None = None
        self._cleared: set[str] = set()  # training_mode inputs taken off Dropouts switched to inference
        self._new_outputs: list[tuple[str, str]] = []  # (output name, statistic it updates)

    def fresh(self, hint: str) -> str:
        return unique_name(hint, self.taken)

    def _refuse_training(self, node: onnx.NodeProto, need: int) -> None:
        raise ModelError(
            f"{node.op_type} node {node.name!r}: the model imports opset {self.opset}, where "
            f"{node.op_type} has no training mode switch (opset {need} or later); convert the "
            "model first, e.g. onnx.version_converter.convert_version(model, 15)"
        )

    # ---- Dropout ---------------------------------------------------------------------------
    def dropout(self, node: onnx.NodeProto) -> None:
        """Opset 12+: ``training_mode`` input = a shared constant. Older: inference only."""
        if self.opset < 12:
            if self.training:
                self._refuse_training(node, 12)
            if self.opset < 7:
                _set_int_attr(node, "is_test", 1)
            return
        if not self.training:  # no training_mode input is inference: no flag for onnxruntime to drop
            if len(node.input) > 2:
                self._cleared.add(node.input[2])
                node.input[2] = ""  # an empty optional input: absent; the node keeps its arity
            return
        if self._flag is None:
            self._flag = self.fresh("dropout_training_mode")
            self.graph.initializer.append(numpy_helper.from_array(np.array(self.training), self._flag))
        while len(node.input) < 3:
            node.input.append("")
        if node.input[2] and node.input[2] != self._flag:
            self._cleared.add(node.input[2])  # the file's own flag, unread now
        node.input[2] = self._flag

    # ---- BatchNormalization ----------------------------------------------------------------
    def batch_norm(self, node: onnx.NodeProto) -> None:
        """Opset 14+: ``training_mode`` attribute, running statistics as outputs when training."""
        if self.training:
            if self.opset < 14:
                self._refuse_training(node, 14)
            _set_int_attr(node, "training_mode", 1)
            while len(node.output) < 3:
                node.output.append("")
            for slot, stat_slot in ((1, 3), (2, 4)):
                stat = self._writable(node, node.input[stat_slot])
                if stat in self.running_stats:
                    raise ModelError(
                        f"running statistic {stat!r} is read by more than one BatchNormalization node"
                    )
                if not node.output[slot]:
                    node.output[slot] = self.fresh(f"{stat}_updated")
                if node.output[slot] not in self.graph_outputs:
                    self._new_outputs.append((node.output[slot], stat))
                    self.graph_outputs.add(node.output[slot])
                self.running_stats[stat] = node.output[slot]
                if stat not in self.graph_inputs:  # overridable: a session can be fed the current value
                    init = self.inits[stat]
                    self.graph.input.append(helper.make_tensor_value_info(stat, init.data_type, init.dims))
                    self.graph_inputs.add(stat)
            return
        if self.opset >= 14:
            _set_int_attr(node, "training_mode", 0)
        elif self.opset < 7:
            _set_int_attr(node, "is_test", 1)
        self._drop_statistics_outputs(node)

    def _drop_statistics_outputs(self, node: onnx.NodeProto) -> None:
        """Keep only Y. A running statistic still read elsewhere becomes a copy of the input one
        (inference leaves it unchanged); the saved batch statistics of old opsets have no
        inference value."""
        used = self.graph_outputs | {i for n in self.graph.node for i in n.input}
        copies = []
        for slot, name in enumerate(node.output[1:], start=1):
            if not name or name not in used:
                continue
            if slot > 2:
                raise ModelError(
                    f"BatchNormalization node {node.name!r}: output {name!r} (batch statistics) is used, "
                    "but it exists only in training mode"
                )
            copy = helper.make_node("Identity", [node.input[slot + 2]], [name], name=f"{name}_inference")
            copies.append(copy)
        del node.output[1:]
        at = list(self.graph.node).index(node) + 1  # before the nodes reading them: the graph stays sorted
        for k, copy in enumerate(copies):
            self.graph.node.insert(at + k, copy)

    def _writable(self, node: onnx.NodeProto, name: str) -> str:
        """``name`` as an initializer (or graph input) the caller can overwrite.

        Exporters may share one tensor between statistics and other values (torch writes an
        untrained BatchNorm's running statistics as ``Identity`` of its scale and bias, which hold
        the same ones and zeros) or write them as ``Constant`` nodes: such a statistic gets an
        initializer of its own, with the same value.
        """
        if name in self.inits or name in self.graph_inputs:
            return name
        producers = {o: n for n in self.graph.node for o in n.output}
        value = self._known_value(name, producers)
        if value is None:
            raise ModelError(
                f"BatchNormalization node {node.name!r}: running statistic {name!r} is computed by the "
                "graph; in training mode it must be an initializer or a graph input to be updated"
            )
        self.graph.node.remove(producers[name])
        init = numpy_helper.from_array(value, name)
        self.graph.initializer.append(init)
        self.inits[name] = init
        return name

    def _known_value(self, name: str, producers: dict[str, onnx.NodeProto]) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer, a ``Constant`` or ``Identity`` of one."""
        if name in self.inits:
            return np.array(numpy_helper.to_array(self.inits[name]))
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "Identity":
            return self._known_value(node.input[0], producers)
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return np.array(numpy_helper.to_array(node.attribute[0].t))
        return None

    def finish(self) -> None:
        """Declare the new graph outputs, typed like the statistics they update; drop the
        ``training_mode`` flags nothing reads any more, initializers or ``Constant`` nodes
        (onnxruntime would warn once per session)."""
        read = {i for n in self.graph.node for i in node_operands(n)} | self.graph_outputs
        unread = self._cleared - read - self.graph_inputs
        if unread:  # an initializer, or a Constant node (a TorchScript export's training=TRAINING)
            kept = [t for t in self.graph.initializer if t.name not in unread]
            del self.graph.initializer[:]
            self.graph.initializer.extend(kept)
            nodes = [n for n in self.graph.node if not (n.op_type == "Constant" and set(n.output) <= unread)]
            del self.graph.node[:]
            self.graph.node.extend(nodes)
        if not self._new_outputs:
            return
        infos = infer_value_infos(self.model)
        self.graph.output.extend(infos[stat].to_proto(out) for out, stat in self._new_outputs)


def _set_int_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def follows_training_flag(model: onnx.ModelProto) -> bool:
    """Whether a runtime should switch ``model`` with :func:`set_training_mode` for training and
    inference: it has a BatchNormalization, or a Dropout whose ``training_mode`` is not already a
    graph input the caller feeds."""
    fed = {i.name for i in model.graph.input}
    for node in model.graph.node:
        if node.op_type == "BatchNormalization":
            return True
        if node.op_type == "Dropout" and (len(node.input) < 3 or node.input[2] not in fed):
            return True
    return False
