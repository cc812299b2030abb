"""The registry of gradient rules, keyed by (domain, op type) and aware of opset versions.

A rule is ``fn(g, n) -> [grad of input 0, grad of input 1, ...]`` where ``g`` is the
:class:`~onnxgrad.autodiff.builder.GradBuilder` and ``n`` the :class:`NodeContext` of the node being
differentiated; ``None`` in the result means "no gradient" (the engine only asks for what it needs,
see ``n.needs``). Rules register next to their definition with :func:`rule`; elementwise ops come
from a formula table (:func:`formulas`); ops whose gradient is zero or that stop it use :func:`zero`.
Each registration records the module it came from (:attr:`Rule.module`), which ``onnxgrad coverage``
shows as the op's rule file.

The registry imports no rule: rule modules register into it when imported (``autodiff/__init__.py``
imports :mod:`.rules`; :mod:`onnxgrad.pythonop` registers the PythonOp rule the same way, from above).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..model.graph import to_array
from .builder import GradBuilder, Var

RuleFn = Callable[[GradBuilder, "NodeContext"], Sequence["Var | None"]]


@dataclass
class NodeContext:
    """What a rule sees of the forward node it differentiates."""

    node: onnx.NodeProto
    inputs: list[Var | None]  # forward values (None for absent optional inputs)
    outputs: list[Var | None]  # forward values (None for absent optional outputs)
    dout: list[Var | None]  # gradient of each output; None where no gradient flows
    needs: list[bool]  # which inputs need a gradient
    opset: int  # opset of the node's domain in the model
    g: GradBuilder = field(repr=False)

    @property
    def x(self) -> Var:
        return self.inputs[0]  # type: ignore[return-value]

    @property
    def y(self) -> Var:
        return self.outputs[0]  # type: ignore[return-value]

    @property
    def dy(self) -> Var:
        return self.dout[0]  # type: ignore[return-value]

    def attr(self, name: str, default: Any = None) -> Any:
        """The node's attribute ``name`` as a Python value, or ``default``."""
        for a in self.node.attribute:
            if a.name == name:
                value = helper.get_attribute_value(a)
                return value.decode() if isinstance(value, bytes) else value
        return default

    def const_input(self, i: int) -> np.ndarray | None:
        """Value of input ``i`` when it is known before running (initializer or Constant)."""
        if i >= len(self.node.input) or not self.node.input[i]:
            return None
        t = self.g.consts.get(self.node.input[i])
        return None if t is None else to_array(t)

    def dout_or_zeros(self, i: int) -> Var:
        """Gradient of output ``i``, materialised as zeros where none flows."""
        d = self.dout[i]
        return d if d is not None else self.g.zeros_like(self.outputs[i])  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rule:
    op_type: str
    domain: str
    since: int
    fn: RuleFn | None
    kind: str  # "rule", "formula", "zero"
    note: str = ""
    module: str = ""  # the module that registered it (``onnxgrad.autodiff.rules.pool``)

    @property
    def file(self) -> str:
        """The registering module as a path under the package: ``rules/pool.py``, ``pythonop/gradient.py``."""
        parts = self.module.split(".")
        if parts[:1] == ["onnxgrad"]:
            parts = parts[1:]
        if parts[:2] == ["autodiff", "rules"]:
            parts = parts[1:]
        return "/".join(parts) + ".py" if self.module else "?"


_RULES: dict[tuple[str, str], list[Rule]] = {}


def _add(r: Rule) -> None:
    versions = _RULES.setdefault((r.domain, r.op_type), [])
    versions[:] = [v for v in versions if v.since != r.since] + [r]
    versions.sort(key=lambda v: v.since)


def rule(*op_types: str, domain: str = "", since: int = 1) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the gradient rule of ``op_types`` for opsets >= ``since``."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in op_types:
            _add(Rule(op, domain, since, fn, "rule", module=fn.__module__))
        return fn

    return deco


def zero(*op_types: str, domain: str = "", note: str = "") -> None:
    """Declare ops whose outputs carry no gradient (comparisons, shapes, rounding, random...)."""
    module = _caller_module()
    for op in op_types:
        _add(Rule(op, domain, 1, None, "zero", note, module))


def formulas(
    op_type: str,
    *per_input: Callable[..., Any] | None,
    broadcast: bool = False,
    since: int = 1,
    domain: str = "",
) -> None:
    """Register an op from one formula per input, in the style of PyTorch's derivatives.yaml.

    Each formula is a lambda whose parameter names say what it reads: ``x`` (unary) or ``a``, ``b``
    (binary) for the inputs, ``y`` for the output, ``dy`` for the output gradient, and any other name
    for the node attribute of that name (defaulting to the lambda's default, then the ONNX schema's).
    With ``broadcast`` the results are summed back to each input's shape.
    """
    params = [list(inspect.signature(f).parameters.values()) if f else [] for f in per_input]

    def fn(g: GradBuilder, n: NodeContext) -> list[Var | None]:
        names = ["x"] if len(per_input) == 1 else ["a", "b", "c"][: len(per_input)]
        env: dict[str, Any] = dict(zip(names, n.inputs))
        env["y"], env["dy"] = n.y, n.dy
        grads: list[Var | None] = []
        for i, (f, ps) in enumerate(zip(per_input, params)):
            if f is None or not n.needs[i]:
                grads.append(None)
                continue
            kwargs = {}
            for p in ps:
                if p.name in env:
                    kwargs[p.name] = env[p.name]
                else:
                    default = None if p.default is inspect.Parameter.empty else p.default
                    kwargs[p.name] = n.attr(p.name, _schema_default(n, p.name, default))
            grad = f(**kwargs)
            if broadcast:
                grad = g.unbroadcast(grad, n.inputs[i], n.y.shape)
            grads.append(grad)
        return grads

    fn.__name__ = f"grad_{op_type}"
    _add(Rule(op_type, domain, since, fn, "formula", module=_caller_module()))


def _caller_module() -> str:
    """Name of the module that called the registering function (:func:`zero`, :func:`formulas`)."""
    return str(sys._getframe(2).f_globals.get("__name__", ""))


def _schema_default(n: NodeContext, name: str, default: Any) -> Any:
    if default is not None:
        return default
    try:
        schema = onnx.defs.get_schema(n.node.op_type, n.opset, n.node.domain)
        attr = schema.attributes.get(name)
        if attr is not None and attr.default_value.name:
            return helper.get_attribute_value(attr.default_value)
    except Exception:
        pass
    return None


def lookup(domain: str, op_type: str, opset: int) -> Rule | None:
    """The rule for ``op_type`` at ``opset``: the newest registered version not after it."""
    domain = "" if domain == "ai.onnx" else domain
    found = None
    for r in _RULES.get((domain, op_type), ()):
        if r.since <= opset:
            found = r
    return found


def supported_ops() -> dict[str, str]:
    """Every op with a gradient rule: ``"Relu"`` for the standard domain, ``"domain.Op"`` otherwise.

    The value says how: ``"rule"`` (a dedicated function), ``"formula"`` (from the formula table),
    ``"zero"`` (no gradient flows through it).
    """
    out = {}
    for (domain, op), versions in sorted(_RULES.items()):
        out[op if not domain else f"{domain}.{op}"] = versions[-1].kind
    return out


def rules_table() -> list[Rule]:
    """Every registered rule version, sorted by domain, op and version."""
    return [r for key in sorted(_RULES) for r in _RULES[key]]
