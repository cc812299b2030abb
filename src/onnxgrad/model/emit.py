"""Writing ONNX nodes into an existing graph: the emitter every graph-writing part of onnxgrad shares.

An :class:`Emitter` appends nodes to a ``GraphProto`` under fresh value and node names (prefixed, never
clashing with a name the graph has), writes constants as ``Constant`` nodes of the graph's float type
unless told otherwise, and puts ``axes`` where the opset wants them (an input from opset 13 for
``Unsqueeze`` / ``ReduceSum``, 18 for the other reductions; an attribute before). Its users: the
losses (:mod:`onnxgrad.train.losses`), the optimizer update graphs (:mod:`onnxgrad.artifacts.optim`,
:mod:`onnxgrad.compat.training.graphs`), the training step (:mod:`onnxgrad.artifacts.generate`) and
the WebGPU rewrites (:mod:`onnxgrad.artifacts.webgpu`)::

    e = Emitter(model.graph, opset=18, dtype=TensorProto.FLOAT, prefix="loss")
    d = e.op("Sub", "y", "target")
    e.op("ReduceMean", e.op("Mul", d, d), out="loss", keepdims=0)

(The gradient rules write backward graphs with :class:`onnxgrad.autodiff.builder.GradBuilder`
instead, which also tracks saved values and scopes.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import np_dtype, unique_name

__all__ = ["Emitter"]


class Emitter:
    """Appends nodes to ``graph`` with fresh names under ``prefix``.

    ``opset``: the model's default-domain opset (it decides how ``axes`` are written). ``dtype``: the
    ONNX element type of :meth:`const` values when none is given (the type of the values the
    emitted nodes compute on). :attr:`taken` holds every name in use; add to it the names the caller
    will create itself, so that :meth:`fresh` never hands them out.
    """

    def __init__(self, graph: onnx.GraphProto, opset: int, dtype: int, prefix: str) -> None:
        self.graph, self.opset, self.dtype, self.prefix = graph, opset, dtype, prefix
        self.taken = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
        self.taken |= {i.name for i in graph.initializer}
        self.taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node}

    def fresh(self, hint: str) -> str:
        """A name no value or node of the graph has: ``prefix/hint``, numbered when taken."""
        return unique_name(f"{self.prefix}/{hint}", self.taken)

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        """Append one ``op_type`` node reading ``inputs`` (``""`` for an omitted optional input) with
        the attributes ``attrs``; returns its output's name, ``out`` or a fresh one."""
        out = out or self.fresh(op_type.lower())
        self.graph.node.append(
            helper.make_node(op_type, list(inputs), [out], name=self.fresh(op_type), **attrs)
        )
        return out

    def const(self, value: Any, dtype: int | None = None) -> str:
        """A ``Constant`` node holding ``value`` as ``dtype`` (default: the emitter's ``dtype``).

        A node, not an initializer: a floating-point initializer would count as trainable.
        """
        arr = np.asarray(value, dtype=np_dtype(self.dtype if dtype is None else dtype))
        return self.op("Constant", value=numpy_helper.from_array(arr))

    def axes_op(self, op_type: str, x: str, axes: Sequence[int] | None, **attrs: Any) -> str:
        """``op_type`` with ``axes`` as an input where the opset wants one, else an attribute.

        ``axes=None`` reduces over every axis.
        """
        if axes is None:
            return self.op(op_type, x, **attrs)
        since = {"Unsqueeze": 13, "ReduceSum": 13}.get(op_type, 18)  # other reductions: 18
        if self.opset >= since:
            return self.op(op_type, x, self.const(list(axes), TensorProto.INT64), **attrs)
        return self.op(op_type, x, axes=list(axes), **attrs)
