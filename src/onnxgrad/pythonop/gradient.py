"""The gradient of a PythonOp is a PythonOpGrad: the Function's own ``backward``, not its derivative.

Importing this module registers the rule (the schemas belong to the model layer). No torch.
"""

from __future__ import annotations

from typing import Any

from onnx import helper

from ..autodiff.builder import GradBuilder, Var
from ..autodiff.registry import NodeContext, rule
from ..errors import GradientNotImplementedError
from ..model.pythonop_spec import (
    MS_DOMAIN,
    PYTHON_OP,
    PYTHON_OP_GRAD,
    describe,
    node_attributes,
    parse_forward,
)

# Older spellings replaced when the rule records which inputs need a gradient.
_OLD_SPELLINGS = ("input_tensor_requires_grads",)


def _set_attribute(node: Any, name: str, value: list[int]) -> None:
    kept = [a for a in node.attribute if a.name != name and a.name not in _OLD_SPELLINGS]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.append(helper.make_attribute(name, value))


@rule(PYTHON_OP, domain=MS_DOMAIN)
def grad_python_op(g: GradBuilder, n: NodeContext) -> list[Var | None]:
    """d(inputs) = Function.backward(ctx, *d(outputs)), as one PythonOpGrad node.

    Inputs: the ctx handle (saved from the forward; nothing else is saved, the Function keeps what
    it needs in its ctx), then the gradient of each tensor output, empty where none flows or the
    output is not differentiable. Outputs: one per tensor input, empty where no gradient is needed.
    The forward node's ``input_requires_grads`` is set to what is needed, so that
    ``ctx.needs_input_grad`` tells the Function the truth.
    """
    node = n.node
    spec = parse_forward(node)
    if not spec.training_mode:
        raise GradientNotImplementedError(
            f"{describe(node)} calls {spec.func_name} with training_mode=0 (exported in eval mode): it "
            "keeps no ctx for a backward; export the module in train mode to differentiate it"
        )
    attrs = node_attributes(node)
    needs = list(n.needs)
    it = iter(needs)
    _set_attribute(node, "input_requires_grads", [int(next(it)) if c == "d" else 0 for c in spec.convention])

    n_out = len(node.output) - 1
    grads = [
        n.dout[i + 1] if spec.output_requires_grad[i] and n.dout[i + 1] is not None else None
        for i in range(n_out)
    ]
    in_types = list(attrs.get("input_tensor_types") or [v.dtype if v else 0 for v in n.inputs])
    in_ranks = list(
        attrs.get("input_tensor_ranks") or [v.rank if v and v.rank is not None else -1 for v in n.inputs]
    )
    out_types = list(spec.output_types or [v.dtype if v else 0 for v in n.outputs[1:]])
    out_ranks = list(spec.output_ranks or [v.rank if v and v.rank is not None else -1 for v in n.outputs[1:]])
    bw_attrs: dict[str, Any] = {
        "func_name": spec.func_name,
        "output_convention": spec.convention,
        "input_tensor_types": out_types,
        "input_tensor_ranks": out_ranks,
        "input_tensor_requires_grads": [int(d is not None) for d in grads],
        "output_tensor_types": in_types,
        "output_tensor_ranks": in_ranks,
        "output_tensor_requires_grads": [int(x) for x in needs],
        "safe_run_mode": int(spec.safe_run_mode),
    }
    if "comment" in attrs:
        bw_attrs["comment"] = attrs["comment"]
    count = max((i + 1 for i, need in enumerate(needs) if need), default=0)
    if count == 0 or all(d is None for d in grads):  # only non-differentiable outputs have gradients
        return [None] * len(needs)
    made = g.op(
        PYTHON_OP_GRAD,
        n.outputs[0],
        *grads,
        outputs=count,
        domain=MS_DOMAIN,
        **{k: v for k, v in bw_attrs.items() if v != []},
    )
    made = made if isinstance(made, tuple) else (made,)
    grad_node = g.nodes[-1]
    if not grad_node.name:  # errors of the backward name the forward node it differentiates
        grad_node.name = f"{node.name or spec.func_name}_Grad"
    # required by both schema generations; make_node would take ``name=`` for the node's own name
    grad_node.attribute.append(helper.make_attribute("name", attrs.get("name") or spec.func_name))
    result: list[Var | None] = []
    for i, x in enumerate(n.inputs):
        if i >= count or not needs[i] or x is None:
            if i < count:
                grad_node.output[i] = ""
            result.append(None)
            continue
        result.append(Var(g, made[i].name, x.dtype, x.shape))
    return result
