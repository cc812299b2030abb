"""2-D convolutions in onnxruntime's blocked channel layout when their weight is a graph input.

onnxruntime's fastest CPU convolutions are its NCHWc kernels (the ``com.microsoft.nchwc`` domain:
``ReorderInput``, ``Conv``, ``ReorderOutput``), channels in blocks of 16 (AVX-512) or 8 (AVX2). Its
optimizer writes them only for a Conv whose weight is a constant initializer, and reorders that
weight once. onnxgrad's sessions take trainable weights as inputs, so every Conv fell back to the
generic im2col kernel. :func:`blocked_convs` writes the blocked form itself, the weight reordered by
ordinary ops (Reshape, Transpose: a small tensor) at every run:

* ``Conv(X, W, B)`` -> ``ReorderOutput(nchwc.Conv(ReorderInput(X), blocked(W), B))``;
* the input gradient ``ConvTranspose(dY, W)`` of a stride-1 Conv -> the same, a Conv of dY with W
  flipped and its channel axes swapped.

Measured (``bench/routes.py``, docs/performance.md): on VGG-style 3x3 convolutions (batch 32,
32-64 channels) the forward Conv 0.73-0.81x the time of the generic kernel (as fast as the
initializer form), the input gradient 0.79-0.85x, the whole forward + backward about 0.9x; results
within float32 rounding (4e-7 relative).

Rewritten: 2-D Convs with ``group`` 1, dilations 1, explicit pads, float32 and a static weight
shape whose input channels are whole blocks (reordered) or fewer than one block (read as NCHW, as
onnxruntime does for a first layer); output channels are padded with zero filters to whole blocks
and dropped by ``ReorderOutput``. Sessions on other execution providers, and CPUs without NCHWc
kernels or whose kernels disagree with this layout (checked once per process), are left alone.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

NCHWC = "com.microsoft.nchwc"
log = logging.getLogger(__name__)


@functools.cache
def block_size() -> int:
    """MLAS's NCHWc channel block on this CPU (16 with AVX-512, 8 with AVX2); 0 where onnxruntime
    has no NCHWc kernels, or where the blocked form written here does not give the generic kernels'
    results (checked once on random data, so a layout this module does not know is never used:
    then one warning line says the pass is off, and why).
    """
    block = native_block_size()
    if block and not _agrees(block):
        log.warning(
            "onnxruntime writes NCHWc Convs with blocks of %d channels on this CPU, but the blocked "
            "form onnxgrad writes for weights fed at run time disagrees with its generic kernels: "
            "those Convs run on the generic kernels (slower, same results)",
            block,
        )
        return 0
    return block


@functools.cache
def native_block_size() -> int:
    """The NCHWc channel block onnxruntime's own optimizer uses on this CPU (0: it writes no NCHWc
    Conv), whether or not the form written here agrees with it (:func:`block_size`).

    Read once from the graph onnxruntime's optimizer writes for a probe Conv of 4 output channels
    (its reordered weight is padded to one block).
    """
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.ones((4, 4, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "probe", [x], [y], [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = os.path.join(tmp, "probe.onnx")
        options.log_severity_level = 3  # onnxruntime warns that the saved graph is CPU-specific
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimized = onnx.load(options.optimized_model_filepath)
        except Exception:  # no CPU provider, or the file not written: no blocked kernels
            return 0
    inits = {t.name: t for t in optimized.graph.initializer}
    for node in optimized.graph.node:
        if node.domain == NCHWC and node.op_type == "Conv" and node.input[1] in inits:
            block = int(inits[node.input[1]].dims[0])
            return block if block > 1 else 0
    return 0


def _agrees(block: int) -> bool:
    """Whether the blocked Conv and ConvTranspose written for ``block`` give the generic kernels'
    results on random data (a sum of 18 block products each: float32 rounding allowed)."""
    c, odd = 2 * block, block // 2 + 1
    shapes = {"x": [2, 3, 5, 6], "u": [c, 3, 3, 3], "w": [odd, c, 3, 3], "b": [odd], "v": [odd, c, 3, 3]}
    nodes = [  # an NCHW input (3 channels), blocked inputs, output channels off the block
        helper.make_node("Conv", ["x", "u"], ["g"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["g", "w", "b"], ["h"], pads=[1, 0, 1, 2]),
        helper.make_node("ConvTranspose", ["h", "v"], ["y"], pads=[0, 1, 2, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "check",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in shapes.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    blocked = _rewrite(model, block, None)
    if sum(n.domain == NCHWC and n.op_type == "Conv" for n in blocked.graph.node) != 3:
        return False
    rng = np.random.default_rng(0)
    feeds = {k: rng.uniform(-1, 1, s).astype(np.float32) for k, s in shapes.items()}
    try:
        want, got = (
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[
                0
            ]
            for m in (model, blocked)
        )
    except Exception:
        return False
    terms = 9 * c  # products per result of each Conv; each sums the one before
    scale = float(np.abs(want).max())
    return bool(np.allclose(got, want, rtol=0, atol=4 * terms * np.finfo(np.float32).eps * scale))


def _cpu_only(providers: Sequence[Any]) -> bool:
    names = [p[0] if isinstance(p, tuple) else p for p in providers]
    return bool(names) and all(n == "CPUExecutionProvider" for n in names)


def _float_shapes(graph: onnx.GraphProto) -> dict[str, list[int] | None]:
    """The static shape of every float32 value the graph declares (None where a dim is not static)."""
    shapes: dict[str, list[int] | None] = {}
    for vi in [*graph.input, *graph.value_info]:
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.elem_type == TensorProto.FLOAT and t.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            shapes[vi.name] = None if None in dims else dims  # type: ignore[assignment]
    return shapes


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class _Rewriter:
    """Emits the blocked form of the Convs of one graph."""

    def __init__(self, graph: onnx.GraphProto, block: int, shapes_from: onnx.GraphProto | None) -> None:
        self.block = block
        self.shapes = _float_shapes(graph)
        if shapes_from is not None:  # the forward's weights, where this graph declares no dims
            known = {
                t.name: list(t.dims) for t in shapes_from.initializer if t.data_type == TensorProto.FLOAT
            }
            known.update((k, v) for k, v in _float_shapes(shapes_from).items() if v is not None)
            self.shapes.update((k, v) for k, v in known.items() if self.shapes.get(k) is None)
        self.initializers = {t.name for t in graph.initializer}
        self.taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
        self.taken |= self.initializers
        self.nodes: list[onnx.NodeProto] = []
        self.new_inits: list[onnx.TensorProto] = []
        self.count = 0

    def fresh(self, base: str) -> str:
        while True:
            self.count += 1
            name = f"{base}_nchwc{self.count}"
            if name not in self.taken:
                self.taken.add(name)
                return name

    def const(self, values: list[int]) -> str:
        name = self.fresh("shape")
        self.new_inits.append(numpy_helper.from_array(np.array(values, np.int64), name))
        return name

    def op(self, op_type: str, inputs: list[str], base: str, domain: str = "", **attrs: Any) -> str:
        out = self.fresh(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], domain=domain or None, **attrs))
        return out

    def weight(self, w: str) -> list[int] | None:
        """The static (O, I, kh, kw) of a weight fed at run time; None for an initializer (onnxruntime
        blocks those itself) or a shape not known here."""
        if w in self.initializers:
            return None
        shape = self.shapes.get(w)
        return shape if shape is not None and len(shape) == 4 else None

    def geometry_ok(self, a: dict[str, Any]) -> bool:
        return (
            a.get("group", 1) == 1
            and a.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
            and all(d == 1 for d in a.get("dilations", [1, 1]))
        )

    def takes(self, o: int, i: int) -> bool:
        """Whether the blocked kernels take a Conv of ``i`` input channels to ``o`` outputs: inputs
        in whole blocks (reordered), or fewer than one block (read as NCHW, onnxruntime's form for a
        first layer); outputs padded to whole blocks."""
        return o > 0 and (i % self.block == 0 or i < self.block)

    def emit(
        self, x: str, w: str, bias: str | None, out: str, o: int, i: int, kh: int, kw: int, a: dict
    ) -> None:
        """``out = Conv(x, w, bias)`` (``w``: (o, i, kh, kw)) on the blocked kernels.

        The weight goes to MLAS's filter layout, its output channels padded with zeros to whole
        blocks: OIHWBiBo ``(O/B, I/B, kh, kw, Bi, Bo)`` for blocked inputs, OIHWBo
        ``(O/B, I, kh, kw, Bo)`` for an NCHW input; ``ReorderOutput`` drops the padded channels.
        """
        b = self.block
        o_pad = -(-o // b) * b
        if o_pad != o:
            w = self.op("Pad", [w, self.const([0, 0, 0, 0, o_pad - o, 0, 0, 0])], w)
            if bias:
                bias = self.op("Pad", [bias, self.const([0, o_pad - o])], bias)
        if i % b == 0:
            view, perm = [o_pad // b, b, i // b, b, kh, kw], [0, 2, 4, 5, 3, 1]
            x = self.op("ReorderInput", [x], x, domain=NCHWC)
        else:
            view, perm = [o_pad // b, b, i, kh, kw], [0, 2, 3, 4, 1]
        wv = self.op("Reshape", [w, self.const(view)], w)
        wt = self.op("Transpose", [wv], w, perm=perm)
        wb = self.op("Reshape", [wt, self.const([o_pad, i, kh, kw])], w)
        yb = self.op("Conv", [x, wb, *([bias] if bias else [])], out, domain=NCHWC, **a)
        self.nodes.append(helper.make_node("ReorderOutput", [yb], [out], domain=NCHWC, channels=o))

    def conv(self, node: onnx.NodeProto) -> bool:
        """``Conv(X, W[, B])`` -> the blocked form; False (nothing emitted) when it does not apply."""
        a = _attrs(node)
        shape = self.weight(node.input[1])
        if shape is None or not self.geometry_ok(a):
            return False
        o, i, kh, kw = shape
        if not self.takes(o, i):
            return False
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        self.emit(node.input[0], node.input[1], bias, node.output[0], o, i, kh, kw, a)
        return True

    def conv_transpose(self, node: onnx.NodeProto) -> bool:
        """A stride-1 ``ConvTranspose(dY, W[, B])`` -> the blocked Conv of dY with W flipped, its
        channel axes swapped, and pads ``k - 1 - p``."""
        a = _attrs(node)
        shape = self.weight(node.input[1])
        if shape is None or not self.geometry_ok(a) or "output_shape" in a:
            return False
        if any(s != 1 for s in a.get("strides", [1, 1])) or any(a.get("output_padding", [0, 0])):
            return False
        c_in, c_out, kh, kw = shape  # ConvTranspose's W: (channels of dY, channels of the result, ...)
        pads = a.get("pads", [0, 0, 0, 0])
        conv_pads = [kh - 1 - pads[0], kw - 1 - pads[1], kh - 1 - pads[2], kw - 1 - pads[3]]
        if not self.takes(c_out, c_in) or min(conv_pads) < 0:
            return False
        w = node.input[1]
        swapped = self.op("Transpose", [w], w, perm=[1, 0, 2, 3])
        ends = self.const([-(2**62), -(2**62)])
        flipped = self.op(
            "Slice", [swapped, self.const([-1, -1]), ends, self.const([2, 3]), self.const([-1, -1])], w
        )
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        attrs = {"kernel_shape": [kh, kw], "pads": conv_pads}
        self.emit(node.input[0], flipped, bias, node.output[0], c_out, c_in, kh, kw, attrs)
        return True


def blocked_convs(
    model: onnx.ModelProto, providers: Sequence[Any], shapes_from: onnx.ModelProto | None = None
) -> onnx.ModelProto:
    """``model`` with its eligible Convs (and stride-1 ConvTransposes) in the blocked layout, for a
    session on ``providers``; ``model`` itself when nothing applies (it is never modified).

    ``shapes_from``: a model whose initializers and inputs give the static shapes of weights that
    ``model`` declares without dims (a backward graph's, from its forward).
    """
    if not _cpu_only(providers):
        return model
    if not any(n.op_type in ("Conv", "ConvTranspose") and not n.domain for n in model.graph.node):
        return model
    block = block_size()  # probed once, for the first model that has a Conv
    return _rewrite(model, block, shapes_from.graph if shapes_from is not None else None) if block else model


def _rewrite(model: onnx.ModelProto, block: int, shapes_from: onnx.GraphProto | None) -> onnx.ModelProto:
    """``model`` with the Convs :class:`_Rewriter` takes blocked for ``block``; itself when none."""
    r = _Rewriter(model.graph, block, shapes_from)
    changed = False
    for node in model.graph.node:
        done = False
        if not node.domain and node.op_type == "Conv":
            done = r.conv(node)
        elif not node.domain and node.op_type == "ConvTranspose":
            done = r.conv_transpose(node)
        if not done:
            r.nodes.append(node)
        changed = changed or done
    if not changed:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(r.nodes)
    out.graph.initializer.extend(r.new_inits)
    if not any(o.domain == NCHWC for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(NCHWC, 1))
    return out
