"""Step graphs that onnxruntime-web's ``webgpu`` provider runs on the GPU (target
``onnxruntime-web-webgpu``).

:func:`lower_for_webgpu` rewrites the forms the gradient rules write for onnxruntime's CPU
provider, where they are the fastest, into forms the WebGPU kernels of onnxruntime-web 1.30 accept,
compute right and keep on the GPU (found by running the digits MLP and CNN in headless chromium):

* ``MatMul(ones[M], rows)``, a bias gradient (``GradBuilder.sum_leading``: 1.7-5x faster than
  ReduceSum on the CPU), becomes ``ReduceSum(rows, axes=[0])``: WebGPU's MatMul refuses a 1-D
  operand ("Can't use matmul on the given tensors"); any other 1-D operand is unsqueezed to 2-D.
* MaxPool's gradient routes dY with a ``MaxUnpool``, at the ``Indices`` output or, for windows that
  tile X, at an ArgMax of each window computed in the forward; WebGPU's MaxPool computes no
  ``Indices`` and has no MaxUnpool. For windows that tile the input (strides equal to the
  kernel, no padding, dilation 1) the window's argmax is recomputed from X and Y: each window's
  elements equal to Y, the first of them in row-major order (onnxruntime's choice on ties, its
  ``>`` comparison keeps the first maximum) receives dY. Other MaxPools are refused.
* ``LogSoftmax`` (no WebGPU kernel) becomes ``x - max - log(sum(exp(x - max)))``.
* A Conv weight gradient by im2col unfolds X with a grouped Conv (one group per channel, one
  shared one-hot kernel); WebGPU's grouped Conv computes it wrongly, so it runs as one ungrouped
  Conv over the channels folded into the batch (:func:`_fold_groups`). Over one channel the unfold
  is a 3-D Conv of depth 1, which WebGPU lacks: it runs as a 2-D Conv (:func:`_conv_2d`). Other
  grouped Convs of the group sizes WebGPU gets wrong run as one Conv per group
  (:func:`_split_groups`).

The optimizer's scalars are computed in float32 for this target (:mod:`onnxgrad.artifacts.optim`);
only the two ``Cast`` nodes reading the ``lr`` (double) and ``step`` (int64) inputs run on the CPU.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import InputError
from ..model.emit import Emitter
from ..model.graph import opset_of, to_array
from ..model.infer import infer_value_infos

__all__ = ["WEBGPU", "lower_for_webgpu"]

WEBGPU = "onnxruntime-web-webgpu"


def lower_for_webgpu(model: onnx.ModelProto) -> None:
    """Rewrite ``model`` in place so that onnxruntime-web's WebGPU kernels accept every node."""
    g = model.graph
    infos = infer_value_infos(model)
    producers = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    scratch = onnx.GraphProto()
    e = Emitter(scratch, opset_of(model), TensorProto.FLOAT, "webgpu")
    e.taken |= {v.name for v in (*g.input, *g.output, *g.value_info, *g.initializer)}
    e.taken |= {o for n in g.node for o in n.output} | {n.name for n in g.node}
    pools: dict[str, onnx.NodeProto] = {}  # Indices output -> its MaxPool
    outputs = {o.name for o in g.output}
    nodes: list[onnx.NodeProto] = []

    def rank(name: str) -> int | None:
        info = infos.get(name)
        return None if info is None or info.shape is None else len(info.shape)

    def emit(make) -> None:
        del scratch.node[:]
        make()
        nodes.extend(scratch.node)

    for n in g.node:
        if n.op_type == "MatMul" and 1 in (rank(n.input[0]), rank(n.input[1])):
            emit(lambda n=n: _matmul_2d(e, n, rank(n.input[0]), rank(n.input[1]), producers, g))
        elif n.op_type == "MaxPool" and len(n.output) > 1 and n.output[1]:
            users = readers.get(n.output[1], [])
            if n.output[1] in outputs:
                raise InputError(_pool_refusal(n, "the model outputs its Indices"))
            if any(u.op_type != "MaxUnpool" or u.input[1] != n.output[1] for u in users):
                raise InputError(_pool_refusal(n, "its gradient reads the Indices beyond one MaxUnpool"))
            pools[n.output[1]] = n
            kept = onnx.NodeProto()
            kept.CopyFrom(n)
            del kept.output[1:]
            nodes.append(kept)
        elif n.op_type == "MaxUnpool" and n.input[1] in pools:
            emit(lambda n=n: _pool_grad(e, pools[n.input[1]], n, infos))
        elif n.op_type == "MaxUnpool" and _argmax_pool(n, producers, readers) is not None:
            emit(lambda n=n: _pool_grad(e, _argmax_pool(n, producers, readers), n, infos))
        elif n.op_type == "LogSoftmax":
            emit(lambda n=n: _log_softmax(e, n, rank(n.input[0])))
        elif n.op_type == "Conv" and _flat_depth_kernel(n, producers, g) is not None:
            emit(lambda n=n: _conv_2d(e, n, _flat_depth_kernel(n, producers, g)))
        elif n.op_type == "Conv" and _shared_group_kernel(n, producers, g) is not None:
            emit(lambda n=n: _fold_groups(e, n, _shared_group_kernel(n, producers, g), rank(n.input[0])))
        elif n.op_type == "Conv" and _miscomputed_groups(n, infos) is not None:
            emit(lambda n=n: _split_groups(e, n, _miscomputed_groups(n, infos)))
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    _drop_dead(g)


def _constant(name: str, producers: dict, graph: onnx.GraphProto) -> np.ndarray | None:
    """The value of ``name`` when it is a Constant node's or an initializer's, else None."""
    node = producers.get(name)
    if node is None:
        init = next((i for i in graph.initializer if i.name == name), None)
        return None if init is None else to_array(init)
    value = next((a for a in node.attribute if a.name == "value"), None)
    return numpy_helper.to_array(value.t) if node.op_type == "Constant" and value is not None else None


def _shared_group_kernel(n: onnx.NodeProto, producers: dict, graph: onnx.GraphProto) -> np.ndarray | None:
    """The kernel every group of a grouped Conv applies, when each group reads one channel and all
    groups share one constant kernel (the one-hot Conv that unfolds X for the weight gradient,
    ``rules/conv.py``), no bias; else None."""
    group = next((int(a.i) for a in n.attribute if a.name == "group"), 1)
    if group <= 1 or (len(n.input) > 2 and n.input[2]):
        return None
    w = _constant(n.input[1], producers, graph)
    if w is None or w.ndim < 3 or w.shape[1] != 1 or w.shape[0] % group:
        return None
    blocks = w.reshape(group, w.shape[0] // group, *w.shape[1:])
    return blocks[0] if bool(np.all(blocks == blocks[:1])) else None


def _flat_depth_kernel(n: onnx.NodeProto, producers: dict, graph: onnx.GraphProto) -> np.ndarray | None:
    """The 2-D kernel of a 3-D Conv whose constant kernel has depth 1 and that neither pads, strides
    nor dilates along depth (the Conv that unfolds one channel, ``rules/conv.py``), no bias; else None."""
    if len(n.input) > 2 and n.input[2]:
        return None
    w = _constant(n.input[1], producers, graph)
    if w is None or w.ndim != 5 or w.shape[2] != 1:
        return None
    attrs = {a.name: list(a.ints) for a in n.attribute if a.name in ("pads", "strides", "dilations")}
    if attrs.get("pads", [0] * 6)[0::3] != [0, 0] or attrs.get("strides", [1])[0] != 1:
        return None
    if attrs.get("dilations", [1])[0] != 1 or any(a.name == "auto_pad" for a in n.attribute):
        return None
    return w[:, :, 0]


def _conv_2d(e: Emitter, n: onnx.NodeProto, kernel: np.ndarray) -> None:
    """A 3-D Conv of depth-1 windows as a 2-D Conv between a Squeeze and an Unsqueeze of the depth
    axis: WebGPU has no 3-D Conv ("Unsupported padding parameter")."""
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    flat = {"group": int(attrs.get("group", 1)), "kernel_shape": list(kernel.shape[2:])}
    for key in ("strides", "dilations"):
        if key in attrs:
            flat[key] = list(attrs[key])[1:]
    if "pads" in attrs:
        flat["pads"] = [p for i, p in enumerate(attrs["pads"]) if i % 3]
    y = e.op("Conv", _squeeze(e, n.input[0], 2, e.fresh("squeeze")), e.const(kernel), **flat)
    if e.opset >= 13:
        e.op("Unsqueeze", y, e.const([2], TensorProto.INT64), out=n.output[0])
    else:
        e.op("Unsqueeze", y, axes=[2], out=n.output[0])


def _miscomputed_groups(n: onnx.NodeProto, infos: dict) -> int | None:
    """The ``group`` of a Conv whose groups onnxruntime-web 1.30's WebGPU Conv computes wrongly:
    more than 4 output channels per group, not a multiple of 4 (measured in chromium: 5, 6 and 9
    per group wrong, with 1 to 4 input channels per group; 1, 2, 3, 4, 8 and 12 right, depthwise
    right, grouped ConvTranspose right); None for the other Convs."""
    group = next((int(a.i) for a in n.attribute if a.name == "group"), 1)
    if group <= 1:
        return None
    info = infos.get(n.input[1])
    outs = info.shape[0] if info is not None and info.shape else None
    if not isinstance(outs, int):
        raise InputError(
            f"Conv {n.name!r}: the onnxruntime-web-webgpu target needs the static output channels of a "
            "grouped Conv (WebGPU computes some group sizes wrongly)"
        )
    per_group = outs // group
    return group if per_group > 4 and per_group % 4 else None


def _split(e: Emitter, x: str, parts: int, axis: int) -> list[str]:
    """``x`` split into ``parts`` equal parts along ``axis``."""
    outs = [e.fresh("part") for _ in range(parts)]
    extra = {"num_outputs": parts} if e.opset >= 18 else {}
    e.graph.node.append(helper.make_node("Split", [x], outs, name=e.fresh("Split"), axis=axis, **extra))
    return outs


def _split_groups(e: Emitter, n: onnx.NodeProto, group: int) -> None:
    """A grouped Conv as one ungrouped Conv per group (inputs, weights and bias split, outputs
    concatenated along the channels): WebGPU computes these group sizes wrongly."""
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name != "group"}
    xs, ws = _split(e, n.input[0], group, 1), _split(e, n.input[1], group, 0)
    bs = _split(e, n.input[2], group, 0) if len(n.input) > 2 and n.input[2] else [None] * group
    ys = [e.op("Conv", x, w, *([b] if b else []), **attrs) for x, w, b in zip(xs, ws, bs)]
    e.op("Concat", *ys, axis=1, out=n.output[0])


def _fold_groups(e: Emitter, n: onnx.NodeProto, kernel: np.ndarray, r: int | None) -> None:
    """A Conv whose ``group`` groups read one channel each with one shared kernel, as an ungrouped
    Conv over the channels folded into the batch: (N, C, S...) -> (N C, 1, S...) -> Conv ->
    (N C, k, S'...) -> (N, C k, S'...), the same channel order (channel c, then kernel output j).
    onnxruntime-web 1.30's WebGPU grouped Conv computes this case wrongly (group 4, 9 outputs
    per group: errors of the order of the values, found by the digits CNN's weight gradient)."""
    if r is None:
        raise InputError(f"Conv {n.name!r}: the onnxruntime-web-webgpu target needs the rank of its input")
    i64 = TensorProto.INT64
    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name != "group"}
    spatial = list(range(2, r))
    shape_x = e.op("Shape", n.input[0])
    batch_first = e.op(
        "Concat", e.const([-1, 1], i64), e.op("Gather", shape_x, e.const(spatial, i64)), axis=0
    )
    folded = e.op("Conv", e.op("Reshape", n.input[0], batch_first), e.const(kernel), **attrs)
    out_shape = e.op(
        "Concat",
        e.op("Gather", shape_x, e.const([0], i64)),
        e.const([-1], i64),  # the groups times the kernel's outputs
        e.op("Gather", e.op("Shape", folded), e.const(spatial, i64)),
        axis=0,
    )
    e.op("Reshape", folded, out_shape, out=n.output[0])


def _is_ones(name: str, producers: dict, graph: onnx.GraphProto) -> bool:
    """Whether ``name`` holds ones only: a Constant, an initializer or a ConstantOfShape of 1."""
    node = producers.get(name)
    if node is None:
        init = next((i for i in graph.initializer if i.name == name), None)
        return init is not None and bool(np.all(to_array(init) == 1))
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Constant" and "value" in attrs:
        return bool(np.all(numpy_helper.to_array(attrs["value"].t) == 1))
    if node.op_type == "ConstantOfShape" and "value" in attrs:
        return bool(np.all(numpy_helper.to_array(attrs["value"].t) == 1))
    return False


def _matmul_2d(e: Emitter, n: onnx.NodeProto, ra: int | None, rb: int | None, producers, graph) -> None:
    """``n`` (a MatMul with a 1-D operand) written with 2-D operands, or as a ReduceSum."""
    a, b, out = n.input[0], n.input[1], n.output[0]
    if ra == 1 and rb == 2 and _is_ones(a, producers, graph):
        e.axes_op("ReduceSum", b, [0], keepdims=0, out=out)  # ones @ rows: the column sums
        return
    if ra == 1 and rb == 1:  # vector . vector: (1, K) @ (K, 1), then a scalar
        prod = e.op("MatMul", _unsqueeze(e, a, 0), _unsqueeze(e, b, 1))
        e.op("Reshape", prod, e.const(np.zeros(0, np.int64), TensorProto.INT64), out=out)
    elif ra == 1:  # (1, K) @ (..., K, N), then drop the 1
        _squeeze(e, e.op("MatMul", _unsqueeze(e, a, 0), b), -2, out)
    else:  # (..., M, K) @ (K, 1), then drop the 1
        _squeeze(e, e.op("MatMul", a, _unsqueeze(e, b, 1)), -1, out)


def _unsqueeze(e: Emitter, x: str, axis: int) -> str:
    if e.opset >= 13:
        return e.op("Unsqueeze", x, e.const([axis], TensorProto.INT64))
    return e.op("Unsqueeze", x, axes=[axis])


def _squeeze(e: Emitter, x: str, axis: int, out: str) -> str:
    if e.opset >= 13:
        return e.op("Squeeze", x, e.const([axis], TensorProto.INT64), out=out)
    return e.op("Squeeze", x, axes=[axis], out=out)


def _pool_refusal(n: onnx.NodeProto, why: str) -> str:
    return (
        f"MaxPool {n.name!r}: the onnxruntime-web-webgpu target has no MaxPool Indices nor MaxUnpool, "
        f"and {why}; its gradient without Indices needs windows that tile the input (strides equal "
        "to kernel_shape, no padding, dilations 1, storage_order 0, known spatial sizes)"
    )


def _argmax_pool(unpool: onnx.NodeProto, producers: dict, readers: dict) -> onnx.NodeProto | None:
    """The MaxPool whose windows' argmax places ``unpool``'s indices, when they come from one.

    For windows that tile X, the MaxPool rule (``rules/pool.py``) leaves the forward MaxPool without
    Indices and computes each window's first maximum with an ArgMax over X viewed window by window
    (Slice, Reshape, Transpose); the indices are that argmax plus int64 offsets (Add, Mul, Cast,
    GreaterOrEqual, Div). Trace back through those to the ArgMax, then to X and the MaxPool reading
    it. None for any other MaxUnpool.
    """
    todo, arg = [unpool.input[1]], None
    while todo and arg is None:
        node = producers.get(todo.pop())
        if node is not None and node.op_type == "ArgMax":
            arg = node
        elif node is not None and node.op_type in ("Add", "Mul", "Cast", "GreaterOrEqual", "Div"):
            todo.extend(i for i in node.input if i)
    if arg is None:
        return None
    x = arg.input[0]
    while (node := producers.get(x)) is not None and node.op_type in ("Reshape", "Transpose", "Slice"):
        x = node.input[0]
    pools = [r for r in readers.get(x, []) if r.op_type == "MaxPool" and len([o for o in r.output if o]) == 1]
    return pools[0] if len(pools) == 1 else None


def _pool_grad(e: Emitter, pool: onnx.NodeProto, unpool: onnx.NodeProto, infos) -> None:
    """dX of ``pool`` without Indices: dY at the first element of each window equal to Y."""
    attrs = {a.name: helper.get_attribute_value(a) for a in pool.attribute}
    kernel = [int(k) for k in attrs["kernel_shape"]]
    nsp = len(kernel)
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    x, y, dy, out = pool.input[0], pool.output[0], unpool.input[0], unpool.output[0]
    info = infos.get(x)
    sizes = None if info is None or info.shape is None else list(info.shape)[2:]
    if (
        [int(s) for s in attrs.get("strides", kernel)] != kernel
        or any(attrs.get("pads", [0]))
        or any(int(d) != 1 for d in attrs.get("dilations", [1]))
        or int(attrs.get("storage_order", 0))
        or auto_pad not in ("NOTSET", "VALID")
        or sizes is None
        or len(sizes) != nsp
        or not all(isinstance(s, int) for s in sizes)
        or (int(attrs.get("ceil_mode", 0)) and any(s % k for s, k in zip(sizes, kernel)))
    ):
        raise InputError(_pool_refusal(pool, "its windows do not tile the input"))
    tiles = [s // k for s, k in zip(sizes, kernel)]
    covered = [t * k for t, k in zip(tiles, kernel)]
    i64 = TensorProto.INT64
    if covered != sizes:  # the last rows and columns no window reaches get no gradient
        x = e.op(
            "Slice", x, e.const([0] * nsp, i64), e.const(covered, i64), e.const(list(range(2, 2 + nsp)), i64)
        )
    split = [0, 0, *(v for t, k in zip(tiles, kernel) for v in (t, k))]
    single = [0, 0, *(v for t in tiles for v in (t, 1))]
    x6 = e.op("Reshape", x, e.const(split, i64))
    y6 = e.op("Reshape", y, e.const(single, i64))
    dy6 = e.op("Reshape", dy, e.const(single, i64))
    dtype = infos[pool.input[0]].dtype if pool.input[0] in infos else TensorProto.FLOAT
    # each element's priority within its window: the first in row-major order ranks highest
    count = math.prod(kernel)
    rank = (count - np.arange(count)).reshape([1, 1, *(v for k in kernel for v in (1, k))])
    hit = e.op("Equal", x6, y6)
    zero = e.const(0.0, dtype)
    priority = e.op("Where", hit, e.const(rank.astype(np.float32), dtype), zero)
    window_axes = [3 + 2 * i for i in range(nsp)]
    best = e.axes_op("ReduceMax", priority, window_axes, keepdims=1)
    first = e.op("Equal", priority, best)
    routed = e.op("Where", first, e.op("Where", hit, dy6, zero), zero)
    if covered == sizes:
        e.op("Reshape", routed, e.const([0, 0, *covered], i64), out=out)
        return
    dx = e.op("Reshape", routed, e.const([0, 0, *covered], i64))
    pads = [0] * (2 + nsp) + [0, 0, *(s - c for s, c in zip(sizes, covered))]
    e.op("Pad", dx, e.const(pads, i64), zero, out=out)


def _log_softmax(e: Emitter, n: onnx.NodeProto, r: int | None) -> None:
    axis = next((int(helper.get_attribute_value(a)) for a in n.attribute if a.name == "axis"), -1)
    if axis < 0 and r is not None:
        axis += r
    shifted = e.op("Sub", n.input[0], e.axes_op("ReduceMax", n.input[0], [axis], keepdims=1))
    total = e.axes_op("ReduceSum", e.op("Exp", shifted), [axis], keepdims=1)
    e.op("Sub", shifted, e.op("Log", total), out=n.output[0])


def _drop_dead(g: onnx.GraphProto) -> None:
    """Drop the nodes no output needs (the ones vectors of rewritten bias gradients)."""
    needed = {o.name for o in g.output}
    keep = []
    for node in reversed(list(g.node)):
        subgraph_reads = {
            i for a in node.attribute for s in (a.g, *a.graphs) for m in s.node for i in m.input
        }
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            needed |= subgraph_reads
    del g.node[:]
    g.node.extend(reversed(keep))
