"""Shape helpers of the gradient builder: shapes as values, sums over axes, undoing broadcasting.

Rules call them on the builder (``g.shape_of(x)``, ``g.unbroadcast(dy, x, y.shape)``): they are a mixin
of :class:`~onnxgrad.autodiff.builder.GradBuilder`, built on its op emission (``op``, ``const``) and its
scope (:mod:`onnxgrad.autodiff.scope`: forward-graph additions, child scopes). A shape known at build
time becomes a constant; one known only at run time is computed once, in the forward graph, for a
forward value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model.graph import Dim, ValueInfo, np_dtype
from .scope import V, Value

INT64 = TensorProto.INT64


class ShapeHelpers(Generic[V]):
    """Shape helpers of the builder (a mixin: see the module's documentation)."""

    def shape_of(self, x: Value) -> V:
        """``Shape(x)`` as an int64 Var: a constant when static, else computed in the forward.

        For a sequence: its elements' shapes stacked, an ``[n, rank]`` tensor (computed by a Loop in
        the forward, so that it also works below opset 17, which brought ``SequenceMap``).
        """
        static = x.static_shape
        if static is not None and not x.sequence:
            return self.const(np.array(static, dtype=np.int64))
        if not x.forward:
            if not x.sequence:
                return self.op("Shape", x)
            body = self.map_body(lambda i, o: [helper.make_node("Shape", i, [o])], [x.dtype], INT64)
            shapes = self.op("SequenceMap", x, body=body, dtype=INT64)
            return self.op(
                "ConcatFromSequence", shapes, axis=0, new_axis=1, dtype=INT64, shape=(None, x.rank)
            )
        if self.is_outer(x):  # computed once in the scope that defines x, not at every iteration
            return self.outer(self.parent.shape_of(self.parent.fwd(x.name)))
        if x.sequence:
            return self.once(("shape", x.name), lambda: self._fwd_sequence_shapes(x))
        return self.once(("shape", x.name), lambda: self.fwd_op("Shape", x, dtype=INT64, shape=(x.rank,)))

    def length_of(self, x: Value) -> V:
        """``SequenceLength(x)`` of a forward sequence, computed once in the forward graph."""
        if self.is_outer(x):
            return self.outer(self.parent.length_of(self.parent.fwd(x.name)))
        return self.once(("length", x.name), lambda: self.fwd_op("SequenceLength", x, dtype=INT64, shape=()))

    def _fwd_sequence_shapes(self, x: Value) -> V:
        length = self.length_of(x)
        i, cond, cond_out, elem, shape = (self.fresh(h) for h in ("i", "cond", "cond", "elem", "shape"))
        body = helper.make_graph(
            [
                helper.make_node("Identity", [cond], [cond_out]),
                helper.make_node("SequenceAt", [x.name, i], [elem]),
                helper.make_node("Shape", [elem], [shape]),
            ],
            "element_shapes",
            [
                helper.make_tensor_value_info(i, INT64, []),
                helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
            ],
            [
                helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
                helper.make_tensor_value_info(shape, INT64, None if x.rank is None else [x.rank]),
            ],
        )
        name = self.new_fwd_value(f"{x.name}_shapes", ValueInfo("", INT64, (None, x.rank)))
        self.fwd_nodes.append(helper.make_node("Loop", [length.name, ""], [name], body=body))
        return self.fwd(name)

    def map_body(
        self, make: Callable[[list[str], str], list[onnx.NodeProto]], in_dtypes: Sequence[int], out_dtype: int
    ) -> onnx.GraphProto:
        """The body of a ``SequenceMap``: ``make(input names, output name)`` returns its nodes."""
        ins = [self.fresh("elem") for _ in in_dtypes]
        out = self.fresh("mapped")
        return helper.make_graph(
            make(ins, out),
            "map",
            [helper.make_tensor_value_info(n, d, None) for n, d in zip(ins, in_dtypes)],
            [helper.make_tensor_value_info(out, out_dtype, None)],
        )

    def reduce_sum(self, x: Value, axes: Sequence[int] | Value, keepdims: bool) -> V:
        """``ReduceSum(x)`` over ``axes`` (ints or an int64 Var)."""
        axes_v = axes if isinstance(axes, Value) else self.const(np.array(list(axes), dtype=np.int64))
        return self.op("ReduceSum", x, axes_v, keepdims=int(keepdims))

    def sum_leading(
        self, x: Value, lead: int, rest: tuple[Dim, ...], lead_dims: tuple[Dim, ...] | None = None
    ) -> V:
        """``x`` summed over its first ``lead`` axes (of sizes ``lead_dims`` when known; the other
        axes have shape ``rest``).

        A bias gradient: for float tensors with static ``rest``, ones(M) @ x.reshape(M, K) is one
        matrix-vector product, measured 1.7-5x faster than onnxruntime's ReduceSum over leading axes
        (256 x 512: 0.096 -> 0.017 ms; 2048 x 1024: 0.46 -> 0.27 ms).
        """
        if not self._sum_by_matmul(x, rest, lead_dims):
            return self.reduce_sum(x, list(range(lead)), keepdims=False)
        k = math.prod(rest)  # type: ignore[arg-type]
        rows = x
        if lead != 1 or len(rest) != 1:
            rows = self.op("Reshape", x, self.const(np.array([-1, k], dtype=np.int64)))
        out = self.op("MatMul", self._ones_for(rows, lead_dims, x.dtype), rows, dtype=x.dtype, shape=(k,))
        if len(rest) == 1:
            return out
        return self.op("Reshape", out, self.const(np.array(rest, dtype=np.int64)), shape=rest)

    def _sum_by_matmul(self, x: Value, rest: tuple[Dim, ...], lead_dims: tuple[Dim, ...] | None) -> bool:
        if x.dtype not in (TensorProto.FLOAT, TensorProto.DOUBLE) or x.sequence or self.opset < 15:
            return False  # onnxruntime's MatMul: float and double; Shape(end=) needs opset 15
        if not rest or not all(isinstance(d, int) and d > 0 for d in rest):
            return False
        if lead_dims is not None and all(isinstance(d, int) for d in lead_dims):
            # Small tensors: one ReduceSum beats a product
            return math.prod(lead_dims) * math.prod(rest) >= 4096  # type: ignore[arg-type]
        return True

    def _ones_for(self, rows: Value, lead_dims: tuple[Dim, ...] | None, dtype: int) -> V:
        """ones(M) for the M rows of ``rows``: a constant when M is static, else made at run time,
        once per symbolic leading shape (the bias gradients of a model share one)."""
        one = np.ones(1, np_dtype(dtype))
        if lead_dims is not None and all(isinstance(d, int) for d in lead_dims):
            return self.const(np.ones(math.prod(lead_dims), np_dtype(dtype)), dtype)  # type: ignore[arg-type]

        def make() -> V:
            count = self.op("Shape", rows, end=1, dtype=INT64)
            return self.op("ConstantOfShape", count, value=numpy_helper.from_array(one), dtype=dtype)

        if lead_dims is None or None in lead_dims:
            return make()
        return self.once(("ones", dtype, lead_dims), make)

    def dim(self, x: Value, axis: int) -> int | V:
        """Size of ``x`` along ``axis``: an int when static, else a 1-D int64 Var of length 1."""
        if x.shape is not None and -len(x.shape) <= axis < len(x.shape):
            d = x.shape[axis]
            if isinstance(d, int):
                return d
        return self.op("Gather", self.shape_of(x), [axis], dtype=INT64, shape=(1,))

    def shape_vector(self, parts: Sequence[int | Value]) -> V:
        """A 1-D int64 shape from ints and 1-D int64 Vars (such as :meth:`dim`'s), one constant
        when every part is an int."""
        if all(isinstance(p, int) for p in parts):
            return self.const(np.array(parts, dtype=np.int64))
        pieces: list[Any] = []
        run: list[int] = []
        for p in parts:
            if isinstance(p, int):
                run.append(p)
                continue
            if run:
                pieces.append(self.const(np.array(run, dtype=np.int64)))
                run = []
            pieces.append(p)
        if run:
            pieces.append(self.const(np.array(run, dtype=np.int64)))
        singles = all(isinstance(p, int) or p.shape == (1,) for p in parts)
        return self.op("Concat", *pieces, axis=0, dtype=INT64, shape=(len(parts),) if singles else None)

    def reshape(self, x: Value, like: Value) -> V:
        """``x`` reshaped to the shape of forward value ``like``; a size 0 in that shape (static,
        or possible at run time) is a size, not Reshape's "copy this dim" (``allowzero``)."""
        static = like.static_shape
        zero = 1 if static is None or 0 in static else None
        return self.op("Reshape", x, self.shape_of(like), shape=like.shape, allowzero=zero)

    def unbroadcast(self, grad: Value, target: Value, result_shape: tuple[Dim, ...] | None) -> V:
        """Sum ``grad`` (of shape ``result_shape``) down to the shape of ``target``, undoing broadcasting.

        Static and symbolic shapes are resolved at build time; dims that cannot be decided there
        are handled by a small shape computation at run time.
        """
        ts, rs = target.shape, result_shape
        if ts is not None and rs is not None and len(ts) <= len(rs):
            lead = len(rs) - len(ts)
            axes = list(range(lead))
            decided = True
            for i, (t, r) in enumerate(zip(ts, rs[lead:])):
                if t == 1:
                    if r != 1:
                        axes.append(lead + i)
                elif isinstance(t, int) or (t is not None and t == r):
                    continue
                else:
                    decided = False
                    break
            if decided:
                if not axes:
                    return grad  # type: ignore[return-value]
                if len(axes) == lead:
                    return self.sum_leading(grad, lead, ts, rs[:lead])
                if lead == 0:
                    return self.reduce_sum(grad, axes, keepdims=True)
                return self.reshape(self.reduce_sum(grad, axes, keepdims=False), target)
        # Run-time path: reduce every axis where the (left-padded) target shape is 1.
        tshape = self.shape_of(target)
        gshape = self.op("Shape", grad, dtype=INT64)
        lead_n = self.op("Sub", self.op("Size", gshape), self.op("Size", tshape))
        ones = self.op(
            "ConstantOfShape",
            self.op("Reshape", lead_n, [1]),
            value=numpy_helper.from_array(np.ones(1, dtype=np.int64)),
            dtype=INT64,
        )
        padded = self.op("Concat", ones, tshape, axis=0)
        axes_v = self.op("Squeeze", self.op("NonZero", self.op("Equal", padded, self.const(1))), [0])
        summed = self.op("ReduceSum", grad, axes_v, keepdims=1, noop_with_empty_axes=1)
        return self.op("Reshape", summed, tshape, shape=target.shape)
