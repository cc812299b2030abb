"""The training step as one ONNX graph: forward, loss, backward and optimizer update.

:func:`build_train_step` turns the gradient graphs of a model whose output is a loss
(:func:`~onnxgrad.autodiff.engine.build_gradient` with ``outputs=[loss]``) into one plain ONNX
graph that any stock onnxruntime runs (Python, Node, the browser). Inputs: the batch, ``lr``
(double scalar), ``step`` (int64 scalar: the number of updates already made), every trainable
value, every optimizer state tensor and every running statistic. Outputs: the loss, then the new
value of each of those, named ``next/<input name>``.

Two front ends build it: :func:`onnxgrad.artifacts.generate` (the graph written to
``train_step.onnx``) and :class:`onnxgrad.train.onegraph.OneGraphStep` (the step
:class:`~onnxgrad.train.Trainer` runs in place of forward + backward + the numpy optimizer). Both
give it the graphs of the same parameter choice (:func:`onnxgrad.autodiff.prepare.prepare`), so
it holds no judgement of its own: what trains is what the graphs were built for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..autodiff.compose import compose
from ..autodiff.engine import GradientGraphs
from ..errors import InputError
from ..model.emit import Emitter
from ..model.graph import check_model, ir_version_for, np_dtype, opset_of, subgraphs, unique_name
from ..model.load import CheckedModel
from ..train.losses import LOSS_METADATA, keep_outputs
from .optim import STATE_KEYS, Param, emit_updates
from .webgpu import lower_for_webgpu

__all__ = ["LR", "STEP", "StepGraph", "build_train_step", "lowest_ir_version"]

LR, STEP = "lr", "step"


@dataclass
class StepGraph:
    """The result of :func:`build_train_step`: the model and what its inputs and outputs are.

    ``batch``: the batch inputs, in graph order. ``state``: (parameter, state key) -> the input
    holding that optimizer state tensor. ``feedback``: each output but the loss -> the input it
    feeds at the next step.
    """

    model: onnx.ModelProto
    batch: list[str]
    state: dict[tuple[str, str], str]
    feedback: dict[str, str]


def build_train_step(
    graphs: GradientGraphs,
    params: Mapping[str, onnx.TensorProto],
    stats: Mapping[str, str],
    optimizer: str,
    hyper: dict,
    loss_name: str,
    *,
    webgpu: bool = False,
) -> StepGraph:
    """The step graph of ``graphs`` (built with ``outputs=[loss_name]``): the composed forward and
    backward with the trainable values as inputs, a gradient seed of 1 for the loss, and the update
    of ``optimizer`` (:mod:`onnxgrad.artifacts.optim`, its ``hyper``-parameters filled in) appended.

    ``params``: for each trainable value and running statistic, a tensor proto giving its type and
    shape (its data is not read). ``stats``: running statistic -> the forward output holding its
    new value. ``webgpu``: written in the forms WebGPU runs (:mod:`onnxgrad.artifacts.webgpu`),
    optimizer scalars in float32.
    """
    inits = params
    model = compose(graphs, name="train_step")
    g = model.graph
    fed = {*graphs.trainable, *stats}
    kept = [i for i in g.initializer if i.name not in fed]
    del g.initializer[:]
    g.initializer.extend(kept)
    seed = graphs.grad_inputs[loss_name]
    loss_info = next(o for o in g.output if o.name == loss_name)
    loss_type = loss_info.type.tensor_type.elem_type
    batch = [i for i in g.input if i.name != seed and i.name not in fed]
    declared = {i.name: i for i in g.input}
    taken = {v.name for v in (*g.input, *g.output, *g.initializer, *g.value_info)}
    taken |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    for reserved in (LR, STEP):
        if reserved in taken:
            raise InputError(f"the model already has a value named {reserved!r}, which the step graph needs")
    taken |= {LR, STEP}
    e = Emitter(g, opset_of(model), loss_type, "optimizer")
    e.taken = taken
    g.node.insert(
        0,
        helper.make_node(
            "Constant", [], [seed], name=unique_name("seed", taken),
            value=onnx.numpy_helper.from_array(np.ones((), np_dtype(loss_type))),
        ),
    )  # fmt: skip

    def tensor_input(name: str, elem: int, dims: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, dims)

    params = [tensor_input(n, inits[n].data_type, list(inits[n].dims)) for n in graphs.trainable]
    state_names: dict[tuple[str, str], str] = {}
    state_inputs = []
    for p in params:
        for key in STATE_KEYS(optimizer, hyper):
            name = unique_name(f"{key}/{p.name}", taken)
            state_names[(p.name, key)] = name
            state_inputs.append(tensor_input(name, p.type.tensor_type.elem_type, list(inits[p.name].dims)))
    stat_inputs = [declared.get(n) or tensor_input(n, inits[n].data_type, list(inits[n].dims)) for n in stats]
    scalars = [tensor_input(LR, TensorProto.DOUBLE, []), tensor_input(STEP, TensorProto.INT64, [])]
    del g.input[:]
    g.input.extend([*batch, *scalars, *params, *state_inputs, *stat_inputs])

    updates = [Param(p.name, graphs.grad_outputs[p.name], p.type.tensor_type.elem_type) for p in params]
    scalar_dtype = TensorProto.FLOAT if webgpu else TensorProto.DOUBLE
    new_params, new_state = emit_updates(e, optimizer, hyper, updates, state_names, LR, STEP, scalar_dtype)
    feedback: dict[str, str] = {}  # output -> the input it feeds at the next step
    outputs = [loss_info]
    targets = [(new_params[p.name], p) for p in params]
    targets += [(new_state[k], vi) for k, vi in zip(state_names, state_inputs)]
    targets += [(stats[vi.name], vi) for vi in stat_inputs]
    for value, vi in targets:
        out = unique_name(f"next/{vi.name}", taken)
        g.node.append(helper.make_node("Identity", [value], [out], name=unique_name(f"{out}/id", taken)))
        new = onnx.ValueInfoProto()
        new.CopyFrom(vi)
        new.name = out
        outputs.append(new)
        feedback[out] = vi.name
    del g.output[:]
    g.output.extend(outputs)
    inputs = list(g.input)
    model = keep_outputs(CheckedModel(model), [o.name for o in outputs])  # built by onnxgrad
    del model.graph.input[:]
    model.graph.input.extend(inputs)  # every input stays, even one this optimizer does not read
    # the loss add_loss appended, described (onnxgrad.train.losses.loss_spec): a runner reads from it
    # which labels to refuse before a step; the graph itself makes a label outside [0, C) a NaN loss
    model.metadata_props.extend(p for p in graphs.forward.metadata_props if p.key == LOSS_METADATA)
    _forward_identities(model)
    _keep_transposes_apart(model)
    if webgpu:
        lower_for_webgpu(model)
    _check_standard(model)
    model.ir_version = lowest_ir_version(model)
    check_model(model)
    batch_names = {b.name for b in batch}
    batch_inputs = [i.name for i in model.graph.input if i.name in batch_names]
    return StepGraph(model, batch_inputs, state_names, feedback)


def _forward_identities(model: onnx.ModelProto) -> None:
    """Name the step's outputs at their producers instead of through Identity nodes.

    The value an output-naming Identity reads is renamed to the output's name everywhere (a graph
    output may also feed other nodes), which saves onnxruntime one copy per tensor and step. Values
    that subgraphs read, graph inputs and initializers keep their Identity.
    """
    g = model.graph
    outputs = {o.name for o in g.output}
    fixed = {i.name for i in g.input} | {i.name for i in g.initializer} | outputs
    fixed |= {name for n in g.node for sub in subgraphs(n) for name in _reads(sub)}
    producers = {o for n in g.node for o in n.output}
    renames: dict[str, str] = {}
    drop = []
    for n in g.node:
        if n.op_type != "Identity" or n.output[0] not in outputs:
            continue
        src = n.input[0]
        if src in fixed or src not in producers or src in renames:
            continue
        renames[src] = n.output[0]
        drop.append(n)
    for n in drop:
        g.node.remove(n)
    for n in g.node:
        for k, name in enumerate(n.input):
            if name in renames:
                n.input[k] = renames[name]
        for k, name in enumerate(n.output):
            if name in renames:
                n.output[k] = renames[name]
    infos = [v for v in g.value_info if v.name not in renames]
    del g.value_info[:]
    g.value_info.extend(infos)


def _keep_transposes_apart(model: onnx.ModelProto) -> None:
    """A Transpose of a shared Transpose's output reads it through a no-op Reshape (shape zeros).

    The backward transposes values the forward transposed too (attention's heads: the forward's
    ``K^T`` feeds ``Q K^T``, the backward's ``(K^T)^T`` feeds ``dS K``). Two sessions see the
    forward's value as an input, and onnxruntime folds the second Transpose into the MatMul
    (``FusedMatMul`` with ``transB``). In one graph its MatMul-transpose fusion composes both
    permutations into a new Transpose of the forward's input instead: one more copy per use.
    Through a Reshape, which onnxruntime runs without a copy, the fusion happens as with two
    sessions (anchor transformer step: 11 Transposes -> 8, about 1.5 ms of 74 ms).
    """
    g = model.graph
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    taken = {v.name for v in (*g.input, *g.output, *g.initializer, *g.value_info)}
    taken |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    nodes: list[onnx.NodeProto] = []
    for n in g.node:
        inner = producers.get(n.input[0]) if n.op_type == "Transpose" and n.input else None
        if inner is not None and inner.op_type == "Transpose" and readers[n.input[0]] > 1:
            perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
            if perm is not None:
                zeros, alias = unique_name("same_shape", taken), unique_name(f"{n.input[0]}/alias", taken)
                value = onnx.numpy_helper.from_array(np.zeros(len(perm), np.int64))
                nodes.append(helper.make_node("Constant", [], [zeros], name=zeros, value=value))
                nodes.append(helper.make_node("Reshape", [n.input[0], zeros], [alias], name=alias))
                n.input[0] = alias
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Every name the nodes of ``graph`` and of its nested subgraphs read."""
    names = {i for n in graph.node for i in n.input}
    for n in graph.node:
        for sub in subgraphs(n):
            names |= _reads(sub)
    return names


def lowest_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version the model's opsets allow (opset 18: 8, 21: 10), so that the oldest
    runtimes that know the opset load it."""
    standard = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    try:
        return max(8, helper.find_min_ir_version_for(standard, ignore_unknown=True))
    except Exception:  # pragma: no cover - an onnx without the table
        return ir_version_for(model.opset_import)


def _check_standard(model: onnx.ModelProto) -> None:
    odd = sorted({f"{n.domain}.{n.op_type}" for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if odd:
        raise InputError(
            f"the training step needs ops outside the standard ONNX domain ({odd}); stock onnxruntime "
            "and onnxruntime-web cannot run them"
        )
