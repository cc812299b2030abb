"""Building blocks of custom losses, as in ``onnxruntime.training.onnxblock.blocks``.

A :class:`Block` subclass composes other blocks in its ``build`` method; each block appends nodes
to the model of the enclosing ``with onnxblock.base(model):`` and returns the name of the value it
made. Besides onnxruntime-training's blocks (Add, Sub, Mul, Div, Pow, ReduceMean, ReduceSum,
Sigmoid, Log, Neg, Abs, Constant, Clip, Cast, PassThrough, InputLike, Linear, LabelEncoder,
SequenceConstruct, ReduceAllL2), the same pattern gives ReduceMin, ReduceMax, Exp, Sqrt, Relu,
Tanh and Softmax, whose gradients onnxgrad has.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ....errors import InputError
from ....model.graph import without_weights
from ....storage import PROTOBUF_LIMIT, tensor_bytes
from . import _accessor
from ._accessor import generate_graph_name

__all__ = [
    "Abs", "Add", "Block", "Cast", "Clip", "Constant", "Div", "Exp", "InputLike", "LabelEncoder",
    "Linear", "Log", "Mul", "Neg", "PassThrough", "Pow", "ReduceAllL2", "ReduceMax", "ReduceMean",
    "ReduceMin", "ReduceSum", "Relu", "SequenceConstruct", "Sigmoid", "Softmax", "Sqrt", "Sub",
    "Tanh",
]  # fmt: skip


class Block(ABC):
    """Base class of every block: subclasses implement ``build`` and are called like functions.

    ``self.base`` is the model being built (set when the block is called); ``build`` appends nodes
    to it and returns the output name(s).
    """

    def __init__(self, temp_file_name: str = "temp.onnx") -> None:
        self.base: onnx.ModelProto | None = None

    @abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append this block's nodes to ``self.base``; return the name(s) of its output(s)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build on the current base model, then :meth:`_finish`; return the build's output(s)."""
        self.base = _accessor.current().model
        output = self.build(*args, **kwargs)
        self._finish(output)
        return output

    def _finish(self, output: Any) -> None:
        """After the build: check that the base is still a valid ONNX model."""
        try:
            onnx.checker.check_model(without_weights(self.base))  # weights over 2 GB cannot be serialized
        except onnx.checker.ValidationError as exc:
            raise InputError(f"block {type(self).__name__} made an invalid model: {exc}") from exc

    def infer_shapes_on_base(self) -> onnx.ModelProto:
        """The base model with its shapes inferred (its weights as inputs when they would not fit
        in one protobuf: 2 GB)."""
        base = _accessor.current().model
        if tensor_bytes(base) >= PROTOBUF_LIMIT:
            base = without_weights(base)
        return onnx.shape_inference.infer_shapes(base)


def _node(model: onnx.ModelProto, op: str, inputs: list[str], **attrs: Any) -> str:
    out = generate_graph_name(f"{op.lower()}_output")
    model.graph.node.append(helper.make_node(op, inputs, [out], name=generate_graph_name(op), **attrs))
    return out


def _float_initializer(model: onnx.ModelProto, hint: str, value: float) -> str:
    name = generate_graph_name(hint)
    model.graph.initializer.append(helper.make_tensor(name, TensorProto.FLOAT, [1], [value]))
    return name


class _BinaryOp(Block):
    """The ONNX op ``_op_name`` on two inputs (subclasses made by :func:`_binary`)."""

    _op_name: str

    def build(self, input_name1: str, input_name2: str) -> str:
        return _node(self.base, self._op_name, [input_name1, input_name2])


def _binary(name: str, doc: str) -> type[_BinaryOp]:
    """The block class ``name`` of the binary ONNX op of that name."""
    return type(name, (_BinaryOp,), {"_op_name": name, "__doc__": doc, "__module__": __name__})


Add = _binary("Add", "``a + b``.")
Sub = _binary("Sub", "``a - b``.")
Mul = _binary("Mul", "``a * b``.")
Div = _binary("Div", "``a / b``.")


class Pow(Block):
    """``x ** exponent`` (the exponent a float constant)."""

    def __init__(self, exponent: float) -> None:
        super().__init__()
        self._exponent = exponent

    def build(self, pow_input_name: str) -> str:
        exponent = _float_initializer(self.base, "pow_exponent", self._exponent)
        return _node(self.base, "Pow", [pow_input_name, exponent])


class _UnaryOp(Block):
    def __init__(self, op_name: str, **attributes: Any) -> None:
        super().__init__()
        self._op_name = op_name
        self._attributes = attributes

    def build(self, input_name: str) -> str:
        return _node(self.base, self._op_name, [input_name], **self._attributes)


def _unary(name: str, doc: str, **fixed: Any) -> type[_UnaryOp]:
    def __init__(self, **attributes: Any) -> None:
        _UnaryOp.__init__(self, name, **{**fixed, **attributes})

    return type(name, (_UnaryOp,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


class _Reduce(_UnaryOp):
    """A reduction over every axis."""

    def __init__(self, keepdims: bool = True) -> None:
        super().__init__(type(self).__name__, keepdims=int(keepdims))


class ReduceMean(_Reduce):
    """The mean of every element."""


class ReduceSum(_Reduce):
    """The sum of every element."""


class ReduceMin(_Reduce):
    """The smallest element (its gradient goes to the smallest elements)."""


class ReduceMax(_Reduce):
    """The largest element (its gradient goes to the largest elements)."""


Sigmoid = _unary("Sigmoid", "``1 / (1 + exp(-x))``.")
Log = _unary("Log", "The natural logarithm.")
Neg = _unary("Neg", "``-x``.")
Abs = _unary("Abs", "``|x|``.")
Exp = _unary("Exp", "``exp(x)``.")
Sqrt = _unary("Sqrt", "The square root.")
Relu = _unary("Relu", "``max(x, 0)``.")
Tanh = _unary("Tanh", "The hyperbolic tangent.")
Softmax = _unary("Softmax", "Softmax along ``axis`` (default -1).", axis=-1)


class Constant(Block):
    """A float constant of shape ``[1]``, as onnxruntime-training writes it."""

    def __init__(self, value_float: float) -> None:
        super().__init__()
        self._value = value_float

    def build(self) -> str:
        return _float_initializer(self.base, "initializer", self._value)


class Clip(Block):
    """``x`` clipped to ``[clip_min, clip_max]`` (either may be ``None``)."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None) -> None:
        super().__init__()
        self._min, self._max = clip_min, clip_max

    def build(self, clip_input_name: str) -> str:
        low = "" if self._min is None else _float_initializer(self.base, "clip_min", self._min)
        high = "" if self._max is None else _float_initializer(self.base, "clip_max", self._max)
        return _node(self.base, "Clip", [clip_input_name, low, high])


class Cast(Block):
    """``x`` cast to the ONNX element type ``to``."""

    def __init__(self, to: int) -> None:
        super().__init__()
        self._to = to

    def build(self, cast_input_name: str) -> str:
        return _node(self.base, "Cast", [cast_input_name], to=self._to)


class PassThrough(Block):
    """Returns its inputs unchanged (no loss: the model computes it)."""

    def build(self, *input_names: str) -> tuple[str, ...]:
        return input_names


def _find_value(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto | None:
    for vi in (*model.graph.input, *model.graph.output):
        if vi.name == name:
            return vi
    return None


class InputLike(Block):
    """A new graph input with the type and shape of the graph input or output ``like``."""

    def __init__(self, like: str) -> None:
        super().__init__()
        self._like = like

    def build(self, input_name: str | None = None) -> str:
        found = _find_value(self.base, self._like)
        if found is None:
            raise InputError(f"InputLike: the model has no graph input or output named {self._like!r}")
        cloned = copy.deepcopy(found)
        cloned.name = input_name or generate_graph_name("input")
        self.base.graph.input.append(cloned)
        return cloned.name


def node_arg_exists(model: onnx.ModelProto, name: str) -> bool:
    """Whether ``name`` is a graph input, output, initializer or node output of ``model``."""
    g = model.graph
    names = {v.name for v in (*g.input, *g.output, *g.initializer)} | {o for n in g.node for o in n.output}
    return name in names


class Linear(Block):
    """``x @ W + b`` (one Gemm, ``alpha`` and ``beta`` its attributes), with new initializers
    ``W`` of shape ``[in_features, out_features]`` and ``b`` of ``[out_features]`` drawn from the
    standard normal distribution (numpy's global generator: seed it for repeatable weights), as
    onnxruntime-training 1.19.2 makes them. Train them by naming them in ``requires_grad``
    (``linear.weight`` / ``linear.bias`` names of the form ``onnx::linear.weight::<n>``)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, alpha: float = 1.0, beta: float = 1.0
    ) -> None:
        super().__init__()
        if int(in_features) < 1 or int(out_features) < 1:
            raise InputError(f"Linear needs sizes >= 1, got {in_features}, {out_features}")
        self._shape = (int(in_features), int(out_features))
        self._bias, self._alpha, self._beta = bool(bias), float(alpha), float(beta)

    def build(self, linear_input_name: str) -> str:
        init = self.base.graph.initializer
        weight = generate_graph_name("linear.weight")
        init.append(numpy_helper.from_array(np.random.randn(*self._shape).astype(np.float32), weight))
        inputs = [linear_input_name, weight]
        if self._bias:
            bias = generate_graph_name("linear.bias")
            init.append(numpy_helper.from_array(np.random.randn(self._shape[1]).astype(np.float32), bias))
            inputs.append(bias)
        return _node(self.base, "Gemm", inputs, alpha=self._alpha, beta=self._beta)


_ML_DOMAIN = "ai.onnx.ml"


class LabelEncoder(Block):
    """``ai.onnx.ml`` LabelEncoder: maps each key to its value (int64, float or string keys and
    values), unknown keys to the default of the output type. Typically on the labels, before a
    loss; it takes no gradient. The model gets the ``ai.onnx.ml`` opset (version 2) when it lacks
    one, where 1.19.2 left that to the caller."""

    def __init__(
        self,
        default_float: float = 0.0,
        default_int64: int = -1,
        default_string: str = "_Unused",
        keys_floats: list[float] | None = None,
        keys_int64s: list[int] | None = None,
        keys_strings: list[str] | None = None,
        values_floats: list[float] | None = None,
        values_int64s: list[int] | None = None,
        values_strings: list[str] | None = None,
    ) -> None:
        super().__init__()
        keys = {"keys_floats": keys_floats, "keys_int64s": keys_int64s, "keys_strings": keys_strings}
        values = {
            "values_floats": values_floats,
            "values_int64s": values_int64s,
            "values_strings": values_strings,
        }
        given_keys = {k: v for k, v in keys.items() if v is not None}
        given_values = {k: v for k, v in values.items() if v is not None}
        if len(given_keys) != 1 or len(given_values) != 1:
            raise InputError("LabelEncoder takes exactly one of keys_* and exactly one of values_*")
        (kname, kvals), (vname, vvals) = next(iter(given_keys.items())), next(iter(given_values.items()))
        if len(kvals) != len(vvals):
            raise InputError(f"LabelEncoder: {len(kvals)} keys but {len(vvals)} values")
        self._attributes = {
            "default_float": float(default_float),
            "default_int64": int(default_int64),
            "default_string": str(default_string),
            kname: list(kvals),
            vname: list(vvals),
        }

    def build(self, label_encoder_input_name: str) -> str:
        base = self.base
        if not any(o.domain == _ML_DOMAIN for o in base.opset_import):
            base.opset_import.append(helper.make_opsetid(_ML_DOMAIN, 2))
        out = generate_graph_name("label_encoder.output")
        base.graph.node.append(
            helper.make_node(
                "LabelEncoder",
                [label_encoder_input_name],
                [out],
                name=generate_graph_name("LabelEncoder"),
                domain=_ML_DOMAIN,
                **self._attributes,
            )
        )
        return out


class SequenceConstruct(Block):
    """The sequence of its input tensors (all of one type)."""

    def build(self, *sequence_input_names: str) -> str:
        if not sequence_input_names:
            raise InputError("SequenceConstruct needs at least one input")
        return _node(self.base, "SequenceConstruct", list(sequence_input_names))


class ReduceAllL2(Block):
    """The L2 norm of all the elements of all its inputs, ``sqrt(sum_i sum(x_i ** 2))``, a float
    scalar. 1.19.2 wrote a ``com.microsoft`` ReduceAllL2 node, a training kernel stock onnxruntime
    lacks; this block writes standard ops (ReduceSumSquare per input, Sum, Sqrt) that stock
    onnxruntime runs and onnxgrad differentiates."""

    def build(self, *reduce_node_input_names: str) -> str:
        if not reduce_node_input_names:
            raise InputError("ReduceAllL2 needs at least one input")
        squares = [_node(self.base, "ReduceSumSquare", [x], keepdims=0) for x in reduce_node_input_names]
        total = squares[0] if len(squares) == 1 else _node(self.base, "Sum", squares)
        return _node(self.base, "Sqrt", [total])
