"""Reverse-mode autodiff over an ONNX graph: one forward graph and one backward graph, both plain ONNX.

The whole pass in one screen (:func:`build_gradient`):

0. rewrite the model where a form with the same values has a cheaper gradient (``rewrite.py``);
1. mark the values that *require grad* (flowing forward from the trainable initializers and chosen
   inputs through ops that carry a gradient) and those that *reach* an output that takes a gradient;
2. walk the nodes in reverse topological order; for every node with an output in both sets, sum the
   gradients of its outputs and call its rule, which returns gradients for its inputs;
3. the forward graph is the model with trainable initializers turned into inputs, plus, as outputs,
   exactly the values the backward read (see :class:`~onnxgrad.autodiff.scope.Scope`).

Steps 1 and 2 are :mod:`~onnxgrad.autodiff.backward` (:func:`~.backward.mark`,
:func:`~.backward.reverse_pass`), which the rules of If, Loop and Scan (``rules/control_flow.py``) also
run on their branches and bodies.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import helper

from ..errors import GradientWarning, InputError, InputTypeError, ModelError, renamed_argument
from ..model.fold import known_tensors
from ..model.graph import (
    MIN_BACKWARD_OPSET,
    ValueInfo,
    all_names,
    check_model,
    constant_values,
    ir_version_for,
    opset_of,
    sort_nodes,
    to_array,
    topological_order,
    unique_scope_names,
)
from ..model.infer import infer_value_infos
from ..model.load import CheckedModel, load_model
from ..model.pythonop_spec import complete_class_names
from .backward import QUANTIZED_MODES, cut_message, cut_paths, mark, reverse_pass, straight_through_message
from .builder import GradBuilder, Var
from .params import Tie, checked_names, padding_rows, select_parameters
from .recompute import MARK as RECOMPUTE_MARK
from .recompute import Recompute, apply_recompute
from .rewrite import centered_batch_norms, rewrite_for_training


@dataclass
class GradientGraphs:
    """The result of :func:`build_gradient`.

    ``forward`` takes the model inputs and the trainable values (``trainable``, whose current values
    are kept as overridable initializers) and returns the model outputs followed by the values the
    backward needs. ``backward`` takes the ``saved`` values and one gradient per entry of
    ``grad_inputs`` and returns one gradient per entry of ``grad_outputs``.
    """

    forward: onnx.ModelProto
    backward: onnx.ModelProto
    trainable: list[str]
    inputs_requiring_grad: list[str]
    saved: list[str]
    outputs: list[str]  # user outputs of the forward graph, in order
    grad_inputs: dict[str, str] = field(default_factory=dict)  # user output -> backward input
    grad_outputs: dict[str, str] = field(default_factory=dict)  # wrt name -> backward output
    # initializers computed from a trainable one (tied weights, see autodiff/params.py)
    ties: list[Tie] = field(default_factory=list)
    quantized: str = "ste"  # the build_gradient(quantized=) choice these graphs were built with

    @property
    def wrt(self) -> list[str]:
        """Names whose gradients the backward returns: trainable values, then inputs."""
        return list(self.grad_outputs)

    def __repr__(self) -> str:
        inits = {i.name for i in self.forward.graph.initializer}
        inputs = [i.name for i in self.forward.graph.input if i.name not in inits]
        return (
            f"GradientGraphs(inputs={inputs}, outputs={self.outputs}, trainable={len(self.trainable)} "
            f"tensors, inputs_requiring_grad={self.inputs_requiring_grad}, saved={len(self.saved)} values, "
            f"forward={len(self.forward.graph.node)} nodes, backward={len(self.backward.graph.node)} nodes)"
        )

    def save(
        self, out_dir: str | os.PathLike | None = None, *, directory: str | os.PathLike | None = None
    ) -> list[str]:
        """Write ``forward.onnx`` and ``backward.onnx`` into the folder ``out_dir`` (made when
        missing); returns the paths. ``directory=`` is its old name (deprecated)."""
        out_dir = renamed_argument(out_dir, directory, new_name="out_dir", old_name="directory")
        if out_dir is None:
            raise InputTypeError("save() needs out_dir, the folder to write")
        os.makedirs(out_dir, exist_ok=True)
        paths = []
        for name, proto in (("forward", self.forward), ("backward", self.backward)):
            path = os.path.join(os.fspath(out_dir), f"{name}.onnx")
            onnx.save(proto, path)
            paths.append(path)
        return paths


def build_gradient(
    model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
    *,
    trainable: Iterable[str] | None = None,
    inputs_requiring_grad: Iterable[str] = (),
    outputs: Iterable[str] | None = None,
    tie_weights: bool = True,
    recompute: Recompute = None,
    quantized: str = "ste",
    frozen: Iterable[str] = (),
) -> GradientGraphs:
    """Build the forward and backward graphs of ``model``.

    ``trainable``: initializer names to differentiate (``None``: the model's parameters, leaving
    out exponents, epsilons, shapes, masks and other constants; see
    :mod:`onnxgrad.autodiff.params`). ``frozen``: names left out of those (freezing any copy of a
    tied parameter freezes the parameter; the rules of
    :func:`~onnxgrad.autodiff.params.select_parameters`, which every front end shares).
    ``tie_weights``: initializers that hold one parameter (equal,
    or equal up to a transpose or a cast) are trained as one, the others computed from it
    (``GradientGraphs.ties``); ``False`` trains them apart.
    ``inputs_requiring_grad``: graph inputs whose gradients the backward also returns.
    ``outputs``: outputs that take a gradient (``None``: every floating-point output); the others
    are treated as having a zero gradient, and parameters that none of these outputs depends on
    are not trained (a :class:`UserWarning` names them; see ``select_parameters``).
    ``quantized``: the gradient through quantization ops (QuantizeLinear, DynamicQuantizeLinear and
    the integer products they feed; see ``docs/quantized.md``): ``"ste"`` (default) the
    straight-through estimator of quantization-aware training, ``"zero"`` none (they stop the
    gradient), ``"refuse"`` a :class:`~onnxgrad.errors.GradientNotImplementedError` where a gradient
    would cross a rounding. DequantizeLinear's gradient in its scale is exact in every mode but
    ``"zero"``.

    A trainable value whose every path to the outputs is cut by an op without a gradient gets
    zeros and a :class:`~onnxgrad.errors.GradientWarning` naming it and the op.
    """
    if quantized not in QUANTIZED_MODES:
        raise InputError(f"quantized must be one of {list(QUANTIZED_MODES)}, got {quantized!r}")
    outputs = None if outputs is None else list(outputs)
    selection = select_parameters(
        _prepare(load_model(model)), trainable, frozen=frozen, tie_weights=tie_weights, outputs=outputs
    )
    model = selection.model
    graph = model.graph
    nodes = list(graph.node)
    infos = infer_value_infos(model)
    opset = opset_of(model)
    versions = {"" if i.domain == "ai.onnx" else i.domain: i.version for i in model.opset_import}

    inits = {i.name: i for i in graph.initializer}
    graph_inputs = [i.name for i in graph.input if i.name not in inits]
    trainable_names = selection.trainable
    input_names = _select_inputs(graph_inputs, infos, inputs_requiring_grad)
    out_names = [o.name for o in graph.output]
    grad_outs = _select_outputs(out_names, infos, outputs)
    wrt = trainable_names + input_names

    # 1. which values require grad, which reach an output with a gradient
    marks = mark(nodes, wrt, grad_outs, infos, versions, quantized)

    # 2. reverse pass
    # Known tensors are copied into the backward rather than saved; an initializer that is also a
    # graph input can be overridden at run time, so it is not one of them.
    overridable = set(trainable_names) | {i.name for i in graph.input}
    consts = {k: v for k, v in constant_values(model).items() if k not in overridable}
    consts.update(known_tensors(model, infos, overridable))  # axes and shapes computed from constants
    taken = set(infos) | all_names(graph)
    g = GradBuilder(infos, consts, taken, max(opset, MIN_BACKWARD_OPSET))
    g.versions = versions
    g.quantized = quantized  # type: ignore[attr-defined]  # read by rules/quant.py (quantized_mode)
    g.straight_through = []  # type: ignore[attr-defined]  # rounding nodes passed through (rules/quant.py)
    g.padding_rows = padding_rows(model, trainable_names)  # torch Embedding(padding_idx=...)
    g.producers = {o: node for node in nodes for o in node.output if o}
    grads: dict[str, list[Var]] = {}
    grad_inputs: dict[str, str] = {}
    for out in grad_outs:
        info = infos[out]
        grad_inputs[out] = g.reserve(f"{out}_grad")
        grads.setdefault(out, []).append(Var(g, grad_inputs[out], info.dtype, info.shape))
    stopped: list[tuple[onnx.NodeProto, str]] = []
    reverse_pass(g, nodes, marks, grads, grad_outs, stopped)
    ungraded = [w for w in trainable_names if not grads.get(w)]
    cuts = cut_paths(nodes, ungraded, grad_outs, marks, stopped, versions, quantized) if ungraded else {}
    if cuts:
        warnings.warn(cut_message(cuts, quantized), GradientWarning, stacklevel=2)
    if g.straight_through:  # type: ignore[attr-defined]
        warnings.warn(straight_through_message(g.straight_through), GradientWarning, stacklevel=2)  # type: ignore[attr-defined]

    grad_outputs: dict[str, str] = {}
    final: list[tuple[str, Var]] = []
    for w in wrt:
        total = g.sum(grads.get(w, []))
        if total is None:  # the outputs do not depend on it
            total = g.zeros_like(g.fwd(w))
        final.append((w, total))
    _name_outputs(g, final, grad_outputs)
    _recompute_views(g, nodes, set(graph_inputs) | set(trainable_names))
    copied = []
    if recompute is not None:
        fed = set(graph_inputs) | set(trainable_names) | {i.name for i in graph.input}
        copied = apply_recompute(g, nodes, fed, recompute, versions.get("", opset))

    # 3. assemble both models
    forward = _forward_model(model, nodes, g, trainable_names, infos)
    backward = _backward_model(model, g, grad_inputs, grad_outputs, infos)
    if copied:  # the runtime runs it in graph order (see recompute.runs_in_graph_order)
        backward.metadata_props.add(key=RECOMPUTE_MARK, value=str(len(copied)))
    saved = list(g.saved)
    return GradientGraphs(
        forward=forward,
        backward=backward,
        trainable=trainable_names,
        inputs_requiring_grad=input_names,
        saved=saved,
        outputs=out_names,
        grad_inputs=grad_inputs,
        grad_outputs=grad_outputs,
        ties=selection.ties,
        quantized=quantized,
    )


# Ops whose output is their input's buffer read with another shape.
_VIEWS = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


def _recompute_views(g: GradBuilder, nodes: Sequence[onnx.NodeProto], fed: set[str]) -> None:
    """A saved view (Reshape, Flatten, Squeeze, Unsqueeze, Identity with constant parameters) of a
    value that is saved anyway or fed by the caller is made again in the backward, not saved.

    The backward then holds one buffer where the forward would hand over two views of it (and
    onnxruntime copies a graph output that is a view of an input or of another output). A Reshape
    to a fixed shape reads through views before it: a reshape of a reshape is a reshape.
    """
    producer = {o: n for n in nodes for o in n.output}
    for name in list(g.saved):
        node = producer.get(name)
        if node is None or node.op_type not in _VIEWS or node.domain not in ("", "ai.onnx"):
            continue
        params = [i for i in node.input[1:] if i]
        if not node.input or any(p not in g.consts for p in params) or not _same_in_backward(node):
            continue
        src = node.input[0]
        fixed = node.op_type == "Reshape" and params and 0 not in to_array(g.consts[params[0]]).tolist()
        while fixed and src not in g.saved and src not in fed:
            view = producer.get(src)
            if view is None or view.op_type not in _VIEWS or view.domain not in ("", "ai.onnx"):
                break
            src = view.input[0]
        if src not in g.saved and src not in fed:
            continue
        del g.saved[name]
        again = onnx.NodeProto()
        again.CopyFrom(node)
        again.input[0] = g.read(g.fwd(src))
        for p in params:
            g.read(g.fwd(p))  # constants: copied into the backward
        g.nodes.insert(0, again)


def _same_in_backward(node: onnx.NodeProto) -> bool:
    """Whether ``node`` means the same in the backward graph's opset (at least 13): Squeeze and
    Unsqueeze took their axes as an attribute before opset 13, Reshape its shape before opset 5."""
    if node.op_type in ("Squeeze", "Unsqueeze", "Reshape"):
        return not any(a.name in ("axes", "shape") for a in node.attribute)
    return True


# ---- selection and validation ----------------------------------------------------------------
def _prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    ordered = topological_order(copy.graph)  # the checker insists on sorted nodes; we sort them
    del copy.graph.node[:]
    copy.graph.node.extend(ordered)
    complete_class_names(copy.graph)  # PythonOp nodes of files that have func_name but no name
    check_model(copy)
    unique_scope_names(copy.graph)  # sibling branches may reuse a name (optimum's merged decoders)
    if copy.functions:  # model-local functions: differentiate their bodies
        from onnx import inliner

        copy = inliner.inline_local_functions(copy)
    return rewrite_for_training(copy)


def _select_inputs(graph_inputs: list[str], infos: dict[str, ValueInfo], names: Iterable[str]) -> list[str]:
    return _checked_values(names, graph_inputs, "input", infos, "have")


def _select_outputs(
    out_names: list[str], infos: dict[str, ValueInfo], outputs: Iterable[str] | None
) -> list[str]:
    if outputs is None:  # floating-point tensors (a sequence output takes a gradient only if named)
        return [o for o in out_names if _is_float(infos, o) and not infos[o].sequence]
    return _checked_values(outputs, out_names, "output", infos, "take")


def _checked_values(
    names: Iterable[str], among: list[str], kind: str, infos: dict[str, ValueInfo], verb: str
) -> list[str]:
    """``names`` without repeats, each one of ``among`` (the model's inputs or outputs, ``kind``)
    and floating-point (a value that can ``verb`` a gradient)."""

    def problem(n: str) -> str | None:
        if n not in among:
            return f"{n!r} is not an {kind} of the model ({kind}s: {among})"
        if not _is_float(infos, n):
            return f"{kind} {n!r} is not floating-point: it cannot {verb} a gradient"
        return None

    return checked_names(names, problem)


def _is_float(infos: dict[str, ValueInfo], name: str) -> bool:
    info = infos.get(name)
    return info is not None and info.is_float


# ---- assembling the two models ---------------------------------------------------------------
def _name_outputs(g: GradBuilder, final: list[tuple[str, Var]], grad_outputs: dict[str, str]) -> None:
    """Give each wrt gradient its output name, renaming the producing node when that is safe."""
    producers = {o: node for node in g.nodes for o in node.output}
    reads: dict[str, int] = {}
    for node in g.nodes:
        for i in node.input:
            reads[i] = reads.get(i, 0) + 1
    used: set[str] = set()
    renamed: dict[str, str] = {}  # a value already renamed to an earlier output keeps that name
    for w, var in final:
        name = g.reserve(f"{w}_grad")
        node = producers.get(var.name)
        if node is not None and var.name not in used and not reads.get(var.name):
            node.output[list(node.output).index(var.name)] = name
            producers[name] = node
            renamed[var.name] = name
        else:
            g.nodes.append(helper.make_node("Identity", [renamed.get(var.name) or g.read(var)], [name]))
        used.add(var.name)
        grad_outputs[w] = name


def _opsets(model: onnx.ModelProto, default_version: int, extra: Iterable[onnx.NodeProto]) -> list:
    domains = {imp.domain: imp.version for imp in model.opset_import if imp.domain not in ("", "ai.onnx")}
    needed = {n.domain for n in extra if n.domain not in ("", "ai.onnx")}
    ops = [helper.make_opsetid("", default_version)]
    ops += [helper.make_opsetid(d, v) for d, v in domains.items() if d in needed]
    return ops


def _forward_model(
    model: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    g: GradBuilder,
    trainable: list[str],
    infos: dict[str, ValueInfo],
) -> onnx.ModelProto:
    graph = model.graph
    inputs = list(graph.input)
    declared = {i.name for i in inputs}
    inputs += [infos[t].to_proto() for t in trainable if t not in declared]
    input_names = {i.name for i in inputs}
    outputs = list(graph.output)
    out_names = {o.name for o in outputs}
    for name, info in g.saved.items():
        if name not in input_names and name not in out_names:
            outputs.append(info.to_proto())
            out_names.add(name)
    fwd_graph = helper.make_graph(
        # control-flow rules may add inputs to a forward node
        sort_nodes(centered_batch_norms(list(nodes), infos, opset_of(model), g.fresh) + g.fwd_nodes),
        graph.name or "forward",
        inputs,
        outputs,
        initializer=list(graph.initializer),
        value_info=list(graph.value_info),
        sparse_initializer=list(graph.sparse_initializer),
    )
    fwd = helper.make_model(
        fwd_graph,
        opset_imports=list(model.opset_import),
        producer_name="onnxgrad",
        functions=list(model.functions),
    )
    fwd.ir_version = max(ir_version_for(model.opset_import), min(model.ir_version, 13))
    fwd.metadata_props.extend(model.metadata_props)  # the model's (LoRA adapters: onnxgrad.lora)
    return fwd


def _backward_model(
    model: onnx.ModelProto,
    g: GradBuilder,
    grad_inputs: dict[str, str],
    grad_outputs: dict[str, str],
    infos: dict[str, ValueInfo],
) -> onnx.ModelProto:
    # Inputs are declared by rank only: onnxruntime rejects a feed whose dims differ from the
    # declared ones, and ONNX shape inference and onnxruntime disagree on a few ops (pooling
    # with ceil_mode drops a last window starting in the padding in onnxruntime only).
    inputs = [info.rank_only().to_proto() for info in g.saved.values()]
    for out, name in grad_inputs.items():
        inputs.append(infos[out].rank_only().to_proto(name))
    outputs = [infos[w].to_proto(name) for w, name in grad_outputs.items()]
    bwd_graph = helper.make_graph(
        g.nodes, "backward", inputs, outputs, initializer=list(g.initializers.values())
    )
    opsets = _opsets(model, g.opset, g.nodes)
    bwd = helper.make_model(bwd_graph, opset_imports=opsets, producer_name="onnxgrad")
    bwd.ir_version = ir_version_for(opsets)
    return bwd


def check_graphs(graphs: GradientGraphs) -> None:
    """Run ``onnx.checker`` with ``full_check`` on both graphs (raises :class:`ModelError`)."""
    for name, proto in (("forward", graphs.forward), ("backward", graphs.backward)):
        try:
            onnx.checker.check_model(proto, full_check=True)
        except Exception as exc:
            raise ModelError(f"the {name} graph does not pass the ONNX checker: {exc}") from exc
