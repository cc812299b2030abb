"""Reverse-mode autodiff on ONNX graphs: the engine, the rule registry and the rules."""

from . import rules  # noqa: F401  (importing the rules registers them)
from .engine import GradientGraphs, build_gradient, check_graphs
from .registry import NodeContext, formulas, rule, rules_table, supported_ops, zero

__all__ = [
    "GradientGraphs",
    "NodeContext",
    "build_gradient",
    "check_graphs",
    "formulas",
    "rule",
    "rules_table",
    "supported_ops",
    "zero",
]
