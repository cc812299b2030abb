"""GroupQueryAttention as onnxruntime-genai's model builder writes it, in the form the rules read.

The builder fuses a decoder's attention into one ``com.microsoft`` ``GroupQueryAttention`` node that
reads the packed projection ``[Q | K | V]`` (key and value inputs empty) and turns Q and K by the
rotary embedding itself (``do_rotary=1``, the ``cos_cache`` and ``sin_cache`` inputs). Before
differentiation such a node becomes what it computes: a ``Split`` of the packed input into Q, K and
V, one ``com.microsoft`` ``RotaryEmbedding`` for Q and one for K (the same kernel onnxruntime calls
inside GroupQueryAttention), and GroupQueryAttention on the turned Q and K with ``do_rotary=0``.
onnxruntime computes the same outputs bit for bit (``tests/lora/test_genai_builder.py`` checks it),
and each piece has its rule: the attention's, the rotation's (the opposite rotation), the split's.

Positions are those onnxruntime gives the rotation when the node has no ``position_ids`` input: on
a first prompt (sequence length = ``total_sequence_length``) ``0 .. S-1`` for every sequence; else
the ``S`` positions ending at ``seqlens_k[b]``, that is ``seqlens_k[b] + 1 - S + s``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model.contrib_schemas import MS_DOMAIN
from ..model.graph import unique_name
from ..model.infer import infer_value_infos

_COS, _SIN, _POSITIONS = 7, 8, 9  # GroupQueryAttention's rotary inputs


def unfused_group_query_attention(model: onnx.ModelProto, taken: set[str]) -> None:
    """Every GroupQueryAttention of ``model``'s main graph that packs Q, K and V or turns them itself,
    as a Split, two RotaryEmbeddings and a GroupQueryAttention on separate, turned Q and K (in place;
    nodes stay in topological order). Models of opset below 13 are left as they are."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 13 or not any(_fused(node) for node in graph.node):
        return
    infos = infer_value_infos(model)  # the packed input's width, when static, splits it by constants
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if _fused(node):
            info = infos.get(node.input[0])
            width = info.shape[-1] if info is not None and info.shape else None
            nodes += _unfused(node, graph, taken, width if isinstance(width, int) else None)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _fused(node: onnx.NodeProto) -> bool:
    if node.op_type != "GroupQueryAttention" or node.domain != MS_DOMAIN:
        return False
    return _packed(node) or bool(_attr(node, "do_rotary", 0))


def _packed(node: onnx.NodeProto) -> bool:
    return not (len(node.input) > 2 and node.input[1] and node.input[2])


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(helper.get_attribute_value(a)) for a in node.attribute if a.name == name), default)


class _Nodes:
    """The nodes that replace one GroupQueryAttention, with fresh names for their values."""

    def __init__(self, prefix: str, taken: set[str]) -> None:
        self.prefix, self.taken = prefix, taken
        self.nodes: list[onnx.NodeProto] = []

    def name(self, hint: str) -> str:
        return unique_name(f"{self.prefix}/{hint}", self.taken)

    def op(
        self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: object
    ) -> list[str]:
        outs = [self.name(f"{op_type}_out") for _ in range(outputs)]
        node = helper.make_node(
            op_type, list(inputs), outs, name=self.name(op_type), domain=domain or None, **attrs
        )
        self.nodes.append(node)
        return outs

    def one(self, op_type: str, *inputs: str, **attrs: object) -> str:
        return self.op(op_type, *inputs, **attrs)[0]

    def const(self, value: np.ndarray) -> str:
        return self.one("Constant", value=numpy_helper.from_array(value, self.name("value")))


def _unfused(
    node: onnx.NodeProto, graph: onnx.GraphProto, taken: set[str], width: int | None
) -> list[onnx.NodeProto]:
    """The nodes computing ``node`` unfused (see the module docstring); ``width``: the last dim of
    the packed input when static (the split sizes are then constants, which the rules need)."""
    heads, kv_heads = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
    if heads < 1 or kv_heads < 1:  # not a valid node: left to the rule and onnxruntime to refuse
        return [node]
    inputs = list(node.input) + [""] * (12 - len(node.input))
    b = _Nodes(node.name or "GroupQueryAttention", taken)
    q, k, v = inputs[0], inputs[1], inputs[2]
    shape = ""  # of the query input, made when needed

    def dims(start: int) -> str:
        """Dimension ``start`` of the query input (B, S, D), as a 1-element int64 tensor."""
        nonlocal shape
        shape = shape or b.one("Shape", inputs[0])
        return b.one(
            "Slice", shape, b.const(np.array([start], np.int64)), b.const(np.array([start + 1], np.int64))
        )

    if _packed(node):  # [Q | K | V] along the last axis: head size H = D / (N + 2 Nkv)
        if width is not None:
            size = width // (heads + 2 * kv_heads)
            sizes = b.const(np.array([heads * size, kv_heads * size, kv_heads * size], np.int64))
        else:
            one = b.one("Div", dims(2), b.const(np.array([heads + 2 * kv_heads], np.int64)))
            sizes = b.one("Mul", one, b.const(np.array([heads, kv_heads, kv_heads], np.int64)))
        q, k, v = b.op("Split", q, sizes, outputs=3, axis=-1)
    if _attr(node, "do_rotary", 0):
        positions = inputs[_POSITIONS] or _positions(b, dims(1), inputs[5], inputs[6])
        rotary: dict[str, object] = {"interleaved": _attr(node, "rotary_interleaved", 0)}
        cos = next((t for t in graph.initializer if t.name == inputs[_COS]), None)
        if cos is not None and len(cos.dims) == 2:
            rotary["rotary_embedding_dim"] = 2 * int(cos.dims[1])
        cos_sin = (inputs[_COS], inputs[_SIN])
        q = b.one("RotaryEmbedding", q, positions, *cos_sin, domain=MS_DOMAIN, num_heads=heads, **rotary)
        k = b.one("RotaryEmbedding", k, positions, *cos_sin, domain=MS_DOMAIN, num_heads=kv_heads, **rotary)
    attention = onnx.NodeProto()
    attention.CopyFrom(node)
    del attention.input[:]
    attention.input.extend([q, k, v, *inputs[3:_COS], "", "", "", *inputs[10:]])
    while attention.input and not attention.input[-1]:
        del attention.input[-1]
    kept = [a for a in node.attribute if a.name not in ("do_rotary", "rotary_interleaved")]
    del attention.attribute[:]
    attention.attribute.extend(kept)
    return [*b.nodes, attention]


def _positions(b: _Nodes, length: str, seqlens_k: str, total: str) -> str:
    """(B, S) int64 positions of the new tokens (``length``: S, a 1-element int64 tensor), as
    onnxruntime's GroupQueryAttention numbers them without a position_ids input: 0 .. S-1 on a
    first prompt (S = total_sequence_length), else seqlens_k[b] + 1 - S + s."""
    total64 = b.one("Cast", b.one("Reshape", total, b.const(np.array([-1], np.int64))), to=TensorProto.INT64)
    first = b.one("Equal", length, total64)
    last = b.one("Cast", seqlens_k, to=TensorProto.INT64)
    start = b.one("Sub", b.one("Add", last, b.const(np.array(1, np.int64))), length)
    start = b.one("Where", first, b.const(np.array(0, np.int64)), start)
    count = b.one("Squeeze", length, b.const(np.array([0], np.int64)))
    steps = b.one("Range", b.const(np.array(0, np.int64)), count, b.const(np.array(1, np.int64)))
    return b.one(
        "Add",
        b.one("Unsqueeze", start, b.const(np.array([1], np.int64))),
        b.one("Unsqueeze", steps, b.const(np.array([0], np.int64))),
    )
