"""One model computing outputs and gradients: the forward and backward graphs joined by name.

``compose(build_gradient(model))`` takes the model inputs, the output cotangents (the backward's
``grad_inputs``, as inputs) and keeps the trainable values as initializers; it returns the model
outputs followed by the gradients (``graphs.grad_outputs``). The saved values connect the two
halves by name. Since it is plain ONNX again, it can itself be differentiated: this is how
onnxgrad gets second-order gradients (gradient penalties, Hessian-vector products...)::

    graphs = build_gradient(model, inputs_requiring_grad=["x"])
    both = compose(graphs)
    second = build_gradient(both, inputs_requiring_grad=["x"], outputs=[graphs.grad_outputs["x"]])
"""

from __future__ import annotations

import onnx
from onnx import helper, version_converter

from ..errors import InputError
from ..model.graph import all_names, ir_version_for, sort_nodes
from .engine import GradientGraphs


def _opset(model: onnx.ModelProto) -> dict[str, int]:
    return {("" if i.domain == "ai.onnx" else i.domain): i.version for i in model.opset_import}


def compose(graphs: GradientGraphs, name: str = "forward_backward") -> onnx.ModelProto:
    """The forward and backward graphs of ``graphs`` as one model (see the module docstring).

    Inputs: the forward's inputs other than the trainable values, then one cotangent per entry of
    ``graphs.grad_inputs`` (named as in the backward). Outputs: ``graphs.outputs`` then the
    gradients, named ``graphs.grad_outputs[w]``. The forward is converted to the backward's opset
    when that is higher (the backward is written at opset 18 or more).
    """
    fwd, bwd = graphs.forward, graphs.backward
    opsets = _opset(fwd)
    target = _opset(bwd).get("", 18)
    if opsets.get("", target) < target:
        fwd = version_converter.convert_version(fwd, target)
        opsets = _opset(fwd)
    for domain, version in _opset(bwd).items():
        opsets[domain] = max(opsets.get(domain, version), version)

    trainable = set(graphs.trainable)
    inits = list(fwd.graph.initializer)
    defined = {i.name for i in inits} | {o for n in fwd.graph.node for o in n.output}
    # the backward copies forward constants it reads under their forward name: keep one of each
    inits += [t for t in bwd.graph.initializer if t.name not in defined]
    inputs = [i for i in fwd.graph.input if i.name not in trainable]
    inputs += [i for i in bwd.graph.input if i.name in graphs.grad_inputs.values()]
    fwd_outputs = {o.name: o for o in fwd.graph.output}
    outputs = [fwd_outputs[o] for o in graphs.outputs] + list(bwd.graph.output)
    taken = all_names(fwd.graph)
    clash = [o.name for o in bwd.graph.output if o.name in taken]
    if clash:  # build_gradient reserves fresh names; a clash means the graphs were edited
        raise InputError(f"backward outputs {clash} are also forward values")
    # the backward recomputes some cheap forward values (Flatten, Reshape...) under their forward
    # names instead of saving them: in one graph the forward's node already defines them
    recomputed = [n for n in bwd.graph.node if n.output and all(o in defined for o in n.output)]
    bwd_nodes = [n for n in bwd.graph.node if not any(n is r for r in recomputed)]
    graph = helper.make_graph(
        sort_nodes(list(fwd.graph.node) + bwd_nodes),
        name,
        inputs,
        outputs,
        initializer=inits,
        value_info=list(fwd.graph.value_info),
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
        producer_name="onnxgrad",
        functions=list(fwd.functions),
    )
    model.ir_version = ir_version_for(model.opset_import)
    return model
