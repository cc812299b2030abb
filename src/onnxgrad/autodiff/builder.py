"""Graph building that reads like the math.

A :class:`Var` is a tensor of the graph under construction. Python arithmetic on Vars emits ONNX
nodes (``dy * y * (1 - y)``), ``g.MatMul(a, b)`` emits any ONNX op, and numbers become constants of
the right dtype. Forward values are Vars too: reading one from the backward graph is what marks it as
*saved* (an output of the forward graph handed to the backward), so the forward keeps exactly the
tensors the rules read, and nothing else.

:class:`GradBuilder` is made of three pieces: its scope (:mod:`onnxgrad.autodiff.scope`: names, the
tape of values the backward reads, the forward graph's additions, child scopes for subgraphs), its
shape helpers (:mod:`onnxgrad.autodiff.shapes`), and the node emission of this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputTypeError
from ..model.graph import Dim, np_dtype
from .scope import Scope, Value
from .shapes import INT64, ShapeHelpers

BOOL = TensorProto.BOOL

BOOL_OPS = {  # ops whose result is boolean (no gradient flows through them)
    "Equal",
    "Greater",
    "Less",
    "GreaterOrEqual",
    "LessOrEqual",
    "Not",
    "And",
    "Or",
    "Xor",
    "IsNaN",
    "IsInf",
}
_INT64_OPS = {"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "Range", "SequenceLength"}
# ops whose output is a sequence of tensors
_SEQUENCE_OPS = {
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceInsert",
    "SequenceErase",
    "SplitToSequence",
    "SequenceMap",
}
# scatters whose reduction onnxruntime's CPU provider has no float16 / bfloat16 kernel for
# ("MLFloat16 data type is not supported with ScatterND ... when reduction is 'add'"): they run in
# float32 between two Casts (exact for max / min, one rounding instead of one per addition for add)
_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_FLOAT32_REDUCTIONS = {"ScatterND", "ScatterElements"}


class Var(Value):
    """A tensor value of the graph being built (see :class:`~onnxgrad.autodiff.scope.Value`), with
    arithmetic: each operator is one ONNX node, and numbers become constants of this Var's dtype."""

    __slots__ = ()

    def __add__(self, o: Any) -> Var:
        return self.g.op("Add", self, o)

    def __radd__(self, o: Any) -> Var:
        return self.g.op("Add", o, self)

    def __sub__(self, o: Any) -> Var:
        return self.g.op("Sub", self, o)

    def __rsub__(self, o: Any) -> Var:
        return self.g.op("Sub", o, self)

    def __mul__(self, o: Any) -> Var:
        return self.g.op("Mul", self, o)

    def __rmul__(self, o: Any) -> Var:
        return self.g.op("Mul", o, self)

    def __truediv__(self, o: Any) -> Var:
        return self.g.op("Div", self, o)

    def __rtruediv__(self, o: Any) -> Var:
        return self.g.op("Div", o, self)

    def __pow__(self, o: Any) -> Var:
        return self.g.op("Pow", self, o)

    def __neg__(self) -> Var:
        return self.g.op("Neg", self)

    def __gt__(self, o: Any) -> Var:
        return self.g.op("Greater", self, o)

    def __lt__(self, o: Any) -> Var:
        return self.g.op("Less", self, o)

    def __ge__(self, o: Any) -> Var:
        return self.g.op("GreaterOrEqual", self, o)

    def __le__(self, o: Any) -> Var:
        return self.g.op("LessOrEqual", self, o)

    def __matmul__(self, o: Var) -> Var:
        return self.g.op("MatMul", self, o)

    __hash__ = object.__hash__


class GradBuilder(Scope[Var], ShapeHelpers[Var]):
    """Builds the backward graph, and the few additions the forward graph needs for it.

    It is a :class:`~onnxgrad.autodiff.scope.Scope` (names, the tape of saved values, forward-graph
    additions, child scopes for subgraphs) with the shape helpers of
    :class:`~onnxgrad.autodiff.shapes.ShapeHelpers`; this class emits the nodes: :meth:`op` (or
    ``g.MatMul(a, b)`` for any ONNX op), :meth:`const`, and the zeros and sums rules need.
    """

    value_type = Var

    # ---- emitting nodes ----------------------------------------------------------------------
    def const(self, value: Any, dtype: int | None = None) -> Var:
        """A constant tensor; ints default to int64, floats need ``dtype``."""
        if dtype is None:
            arr = np.asarray(value)
            if arr.dtype.kind in "iub" and arr.dtype != np.bool_:
                arr = arr.astype(np.int64)
            dtype = helper.np_dtype_to_tensor_dtype(arr.dtype)
        else:
            arr = np.asarray(value, dtype=np_dtype(dtype))

        def make() -> Var:
            name = self.fresh("const")
            tensor = numpy_helper.from_array(arr, name)
            if tensor.data_type != dtype:  # bfloat16 and friends
                tensor = helper.make_tensor(name, dtype, arr.shape, arr.flatten().tolist())
            self.initializers[name] = tensor
            return Var(self, name, dtype, tuple(arr.shape))

        return self.once(("const", dtype, arr.shape, arr.tobytes()), make)

    def _operand(self, x: Any, like: Var | None) -> Var | None:
        if x is None or isinstance(x, Var):
            return x
        if isinstance(x, list | tuple) or (isinstance(x, np.ndarray) and x.dtype.kind in "iu"):
            return self.const(np.asarray(x, dtype=np.int64))
        if like is None:
            raise InputTypeError(f"cannot tell the dtype of constant {x!r}")
        return self.const(x, like.dtype)

    def op(
        self,
        op_type: str,
        *inputs: Any,
        outputs: int = 1,
        dtype: int | None = None,
        shape: tuple[Dim, ...] | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> Any:
        """Emit one backward node; returns its output Var (or a tuple when ``outputs > 1``)."""
        like = next((x for x in inputs if isinstance(x, Var)), None)
        ins = [self._operand(x, like) for x in inputs]
        if op_type in _FLOAT32_REDUCTIONS and attrs.get("reduction") not in (None, "none"):
            half = ins[0].dtype if ins[0] is not None else None
            if half in _HALF:
                data, upd = (self.op("Cast", ins[i], to=TensorProto.FLOAT) for i in (0, 2))
                y = self.op(op_type, data, ins[1], upd, shape=shape, **attrs)
                return self.op("Cast", y, to=half, shape=shape)
        names = [self.read(x) if x is not None else "" for x in ins]
        out_dtype = dtype if dtype is not None else _result_dtype(op_type, ins, attrs)
        outs = [self.fresh(op_type.lower()) for _ in range(outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, names, outs, domain=domain or None, **attrs))
        seq = op_type in _SEQUENCE_OPS or (op_type == "Identity" and bool(ins) and ins[0].sequence)
        vars_ = tuple(Var(self, n, out_dtype, shape, sequence=seq) for n in outs)
        return vars_[0] if outputs == 1 else vars_

    def __getattr__(self, op_type: str) -> Any:
        # g.MatMul(a, b) == g.op("MatMul", a, b): ONNX op names start with a capital letter.
        if op_type[:1].isupper():
            return lambda *a, **k: self.op(op_type, *a, **k)
        raise AttributeError(op_type)

    # ---- zeros and sums ----------------------------------------------------------------------
    def zeros_like(self, x: Var) -> Var:
        """Zeros with the shape and dtype of ``x`` (for a sequence: a sequence of zero tensors).

        Made once per forward value: every rule asking for zeros like it shares them.
        """
        if not x.forward:
            return self._zeros(x)
        return self.once(("zeros", x.name), lambda: self._zeros(x))

    def _zeros(self, x: Var) -> Var:
        if x.sequence:
            shapes = self.op("SplitToSequence", self.shape_of(x), axis=0, keepdims=0, dtype=INT64)
            body = self.map_body(
                lambda i, o: [helper.make_node("ConstantOfShape", i, [o], value=zero_tensor(x.dtype))],
                [INT64],
                x.dtype,
            )
            return self.op("SequenceMap", shapes, body=body, dtype=x.dtype, shape=x.shape)
        return self.op(
            "ConstantOfShape", self.shape_of(x), value=zero_tensor(x.dtype), dtype=x.dtype, shape=x.shape
        )

    def sum(self, parts: Sequence[Var]) -> Var | None:
        """The sum of gradient contributions (``None`` for none); sequences add element by element."""
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        if not parts[0].sequence:
            return self.op("Sum", *parts, shape=parts[0].shape)
        body = self.map_body(
            lambda i, o: [helper.make_node("Sum", i, [o])], [p.dtype for p in parts], parts[0].dtype
        )
        return self.op("SequenceMap", *parts, body=body, shape=parts[0].shape)


def zero_tensor(dtype: int) -> onnx.TensorProto:
    """A one-element zero tensor of ``dtype`` (the ``value`` of a ConstantOfShape)."""
    zero = numpy_helper.from_array(np.zeros(1, dtype=np_dtype(dtype)))
    if zero.data_type != dtype:  # bfloat16 and friends
        zero = helper.make_tensor("", dtype, [1], [0.0])
    return zero


def _result_dtype(op_type: str, ins: list[Var | None], attrs: dict[str, Any]) -> int:
    if op_type in BOOL_OPS:
        return BOOL
    if op_type in _INT64_OPS:
        return INT64
    if op_type == "Cast":
        return int(attrs["to"])
    if op_type == "Where":
        return ins[1].dtype if ins[1] is not None else ins[2].dtype  # type: ignore[union-attr]
    first = next((x for x in ins if x is not None), None)
    return first.dtype if first is not None else TensorProto.FLOAT


# ---- functions used by formulas: each is one ONNX node --------------------------------------
def where(cond: Var, a: Any, b: Any) -> Var:
    """``Where(cond, a, b)``; numbers take the dtype of the other branch."""
    like = a if isinstance(a, Var) else b
    g = cond.g
    return g.op("Where", cond, g._operand(a, like), g._operand(b, like))


def _unary(op_type: str):
    def f(x: Var) -> Var:
        return x.g.op(op_type, x)

    f.__name__ = op_type.lower()
    f.__doc__ = f"``{op_type}(x)`` as one ONNX node."
    return f


exp = _unary("Exp")
log = _unary("Log")
sqrt = _unary("Sqrt")
sign = _unary("Sign")
sigmoid = _unary("Sigmoid")
tanh = _unary("Tanh")
erf = _unary("Erf")
abs_ = _unary("Abs")
cos = _unary("Cos")
sin = _unary("Sin")


def cast(x: Var, like: Var) -> Var:
    """``x`` cast to the dtype of ``like`` (no node when it already has it)."""
    return x if x.dtype == like.dtype else x.g.op("Cast", x, to=like.dtype)
