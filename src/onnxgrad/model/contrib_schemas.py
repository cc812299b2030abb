"""Output types and shapes of the onnxruntime contrib ops that fused (deployed) models hold.

ONNX shape inference knows no ``com.microsoft`` schema (and not onnxruntime's own opset-1
``LayerNormalization`` / ``SimplifiedLayerNormalization`` of the default domain): their outputs come
out untyped, and every value after them has an unknown rank. :func:`contrib_output_infos` gives each
output of these ops its element type and rank, with the dimensions that follow from the inputs'
(the layouts of onnxruntime's ContribOperators.md); :func:`onnxgrad.model.infer.infer_value_infos`
declares them and runs inference again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import TensorProto, helper

from .graph import ORT_DEFAULT_DOMAIN_OPS, Dim, ValueInfo

MS_DOMAIN = "com.microsoft"

Infos = Sequence[ValueInfo | None]  # the node's inputs ("" or untyped: None)
OutputRule = Callable[[onnx.NodeProto, Infos], list[ValueInfo | None]]


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _like(info: ValueInfo | None, dtype: int | None = None) -> ValueInfo | None:
    if info is None:
        return None
    return ValueInfo("", info.dtype if dtype is None else dtype, info.shape)


def _stats(x: ValueInfo | None, axis: int, dtype: int) -> ValueInfo | None:
    """Per-row statistics of a normalization over the axes [axis, rank): those axes kept as 1."""
    if x is None or x.shape is None:
        return None
    rank = len(x.shape)
    axis %= rank
    return ValueInfo("", dtype, (*x.shape[:axis], *(1,) * (rank - axis)))


def _same(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    return [_like(ins[0] if ins else None)]


def _skip_norm(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """output, mean, inv_std_var (float, (..., 1)), input_skip_bias_sum."""
    x = ins[0]
    stats = _stats(x, -1, TensorProto.FLOAT)
    return [_like(x), stats, stats, _like(x)]


def _layer_norm(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """Y, then the statistics in ``stash_type`` (LayerNormalization: mean, inv_std_var;
    SimplifiedLayerNormalization: inv_std_var)."""
    x = ins[0]
    stash = int(_attr(node, "stash_type", TensorProto.FLOAT))  # type: ignore[arg-type]
    stats = _stats(x, int(_attr(node, "axis", -1)), stash)  # type: ignore[arg-type]
    return [_like(x), stats, stats]


def _fused_matmul(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    a, b = ins[0], ins[1] if len(ins) > 1 else None
    if a is None or b is None or a.shape is None or b.shape is None or min(len(a.shape), len(b.shape)) < 2:
        return [None]
    if _attr(node, "transBatchA", 0) or _attr(node, "transBatchB", 0):
        rank = max(len(a.shape), len(b.shape))
        return [ValueInfo("", a.dtype, (None,) * rank)]
    rows = a.shape[-1] if _attr(node, "transA", 0) else a.shape[-2]
    cols = b.shape[-2] if _attr(node, "transB", 0) else b.shape[-1]
    batch_a, batch_b = a.shape[:-2], b.shape[:-2]
    rank = max(len(batch_a), len(batch_b))
    batch: list[Dim] = []
    for k in range(rank):
        da = batch_a[k - rank + len(batch_a)] if k - rank + len(batch_a) >= 0 else 1
        db = batch_b[k - rank + len(batch_b)] if k - rank + len(batch_b) >= 0 else 1
        batch.append(da if db == 1 else db if da == 1 else da if da == db else None)
    return [ValueInfo("", a.dtype, (*batch, rows, cols))]


def _matmul_nbits(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    a = ins[0]
    if a is None or a.shape is None:
        return [None]
    return [ValueInfo("", a.dtype, (*a.shape[:-1], int(_attr(node, "N"))))]  # type: ignore[arg-type]


def _embed_layer_norm(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """output and embedding_sum (B, S, hidden) in the embeddings' type, mask_index int32 (B,)."""
    ids, words = ins[0], ins[2] if len(ins) > 2 else None
    if words is None:
        return [None, None, None]
    b, s = (ids.shape[0], ids.shape[1]) if ids is not None and ids.shape is not None else (None, None)
    hidden = words.shape[-1] if words.shape is not None else None
    out = ValueInfo("", words.dtype, (b, s, hidden))
    return [out, ValueInfo("", TensorProto.INT32, (b,)), out]


def _heads_out(b: Dim, s: Dim, hidden: Dim, dtype: int, present_rank: int, n: int) -> list[ValueInfo | None]:
    out: list[ValueInfo | None] = [ValueInfo("", dtype, (b, s, hidden))]
    out += [ValueInfo("", dtype, (None,) * present_rank) for _ in range(n)]
    return out


def _attention(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """output (B, S, v_hidden); present (2, B, N, T, H)."""
    x, w = ins[0], ins[1] if len(ins) > 1 else None
    if x is None or x.shape is None:
        return [None, None]
    sizes = list(_attr(node, "qkv_hidden_sizes", []) or [])  # type: ignore[arg-type]
    hidden: Dim = None
    if sizes:
        hidden = int(sizes[2])
    elif w is not None and w.shape is not None and isinstance(w.shape[-1], int):
        hidden = w.shape[-1] // 3
    return _heads_out(x.shape[0], x.shape[1], hidden, x.dtype, 5, 1)


def _multi_head_attention(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """output (B, S, v_hidden); present_key, present_value (B, N, T, H); qk (B, N, S, T).

    v_hidden: N H of a packed query (B, S, N, 3, H) or packed key/value (B, L, N, 2, H), else
    value's last dim (3-D) or N H (4-D), else the query's."""
    q, k = ins[0], ins[1] if len(ins) > 1 else None
    v = ins[2] if len(ins) > 2 else None
    if q is None or q.shape is None:
        return [None] * 4

    def heads_times_size(x: ValueInfo, n: int, h: int) -> Dim:
        assert x.shape is not None
        heads, size = x.shape[n], x.shape[h]
        return heads * size if isinstance(heads, int) and isinstance(size, int) else None

    hidden: Dim = q.shape[-1] if len(q.shape) == 3 else None
    if len(q.shape) == 5:
        hidden = heads_times_size(q, 2, 4)
    elif k is not None and k.shape is not None and len(k.shape) == 5:
        hidden = heads_times_size(k, 2, 4)
    elif v is not None and v.shape is not None:
        hidden = v.shape[2] if len(v.shape) == 3 else heads_times_size(v, 1, 3)
    out = _heads_out(q.shape[0], q.shape[1], hidden, q.dtype, 4, 2)
    return [*out, ValueInfo("", q.dtype, (None,) * 4)]


def _group_query_attention(node: onnx.NodeProto, ins: Infos) -> list[ValueInfo | None]:
    """output (B, S, num_heads H); present_key, present_value (B, kv_num_heads, T, H)."""
    q, k = ins[0], ins[1] if len(ins) > 1 else None
    if q is None or q.shape is None:
        return [None] * 3
    heads, kv_heads = int(_attr(node, "num_heads", 0)), int(_attr(node, "kv_num_heads", 0))  # type: ignore[arg-type]
    width = q.shape[2] if len(q.shape) == 3 else None
    hidden: Dim = width
    if (k is None or k.shape is None) and isinstance(width, int) and heads and kv_heads:  # packed QKV
        hidden = width // (heads + 2 * kv_heads) * heads
    return _heads_out(q.shape[0], q.shape[1], hidden, q.dtype, 4, 2)


_MS_RULES: dict[str, OutputRule] = {
    "Gelu": _same,
    "FastGelu": _same,
    "BiasGelu": _same,
    "QuickGelu": _same,
    "BiasAdd": _same,
    "RotaryEmbedding": _same,
    "FusedMatMul": _fused_matmul,
    "MatMulNBits": _matmul_nbits,
    "SkipLayerNormalization": _skip_norm,
    "SkipSimplifiedLayerNormalization": _skip_norm,
    "EmbedLayerNormalization": _embed_layer_norm,
    "Attention": _attention,
    "MultiHeadAttention": _multi_head_attention,
    "GroupQueryAttention": _group_query_attention,
}
# onnxruntime's own ops of the default domain (opset 1), which no ONNX opset has
_DEFAULT_RULES: dict[str, OutputRule] = {
    "SimplifiedLayerNormalization": _layer_norm,
    "LayerNormalization": _layer_norm,
}
assert set(_DEFAULT_RULES) == ORT_DEFAULT_DOMAIN_OPS


def has_output_rule(node: onnx.NodeProto) -> bool:
    """Whether :func:`contrib_output_infos` types this node's outputs."""
    if node.domain == MS_DOMAIN:
        return node.op_type in _MS_RULES
    return node.domain in ("", "ai.onnx") and node.op_type in _DEFAULT_RULES


def contrib_output_infos(node: onnx.NodeProto, infos: dict[str, ValueInfo]) -> list[ValueInfo | None]:
    """The type of each output of a contrib node (``None`` where it does not follow), named."""
    table = _MS_RULES if node.domain == MS_DOMAIN else _DEFAULT_RULES
    fn = table.get(node.op_type)
    if fn is None:
        return [None] * len(node.output)
    ins = [infos.get(i) if i else None for i in node.input]
    found = fn(node, ins)
    out: list[ValueInfo | None] = []
    for k, name in enumerate(node.output):
        info = found[k] if k < len(found) else None
        out.append(None if info is None or not name else ValueInfo(name, info.dtype, info.shape))
    return out
