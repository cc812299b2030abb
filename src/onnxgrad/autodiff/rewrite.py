"""Rewrites of the forward graph that keep every value the model computes and make its gradient
cheaper. They run on the model before differentiation.

- ``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``: ReLU is monotonic, so both give the same
  values and pick the same window elements, but ReLU (and its gradient mask) then runs on the
  pooled tensor, 4x smaller for the usual 2x2 pool, and the full-size activation is not saved for
  the backward. Conv-ReLU-MaxPool is the building block of most CNNs.

- ``BatchNormalization`` in training mode (opset 14+, float and double) is computed, in the
  forward graph only, as ``xc = x - mean(x)``, ``y = xc * (scale / sqrt(mean(xc^2) + eps)) + bias``
  (:func:`centered_batch_norms`), the mean taken twice as in the backward
  (:func:`~onnxgrad.autodiff.rules.norm.standardize`): ``x - m`` is exact near the mean, but
  ``m = mean(x)`` is rounded to float32 (half a unit in the last place: 3e-5 at 1000) and its value
  depends on the order of the kernel's summation, which differs between CPUs (vector width,
  threads); the mean of the differences measures that rounding and a second subtraction removes it.
  With the mean taken once, one unit in the last place of the mean of a channel of mean 1000 (what
  another summation order gives) moved the gradients of a BN-conv-BN-ReLU stack 2.2e-1 from
  float64 torch; taken twice, 1.4e-5 whichever way the mean rounds (torch: 1.2e-5).
  onnxruntime's kernel applies the batch statistics as one
  ``x * a + b``: for a channel whose mean is large next to its spread, the rounding of ``x * a`` is
  of the order of ``mean / std`` units in the last place of y, noise that no later layer removes
  (BatchNorm on inputs of mean 1000 and std 1: 3e-5 rms in y, where torch's centered kernel leaves
  4e-8 besides a per-channel shift; gradients of a BN-conv-BN-ReLU stack 4.5e-2 off float64
  torch instead of 1e-5). The gradient rule is unchanged: it reads x and recomputes the statistics.

- RNN, GRU and LSTM in batch-major layout (``layout=1``), which onnxruntime refuses to load,
  become the time-major node between Transposes: X and the initial states are transposed in, Y and
  the final states back out, under their original names.

- Scan-8 (batch axis 0, sequence axis 1) becomes the Loops it means: over the batch, and inside
  over the steps, each step running the unchanged body on ``x[b, t]`` (``t`` counted from the end
  of the sequence for a reversed input). With ``sequence_lens``, steps past an element's length
  keep its states and output zeros (masks; floating-point states and outputs only). Loops of
  opset 1 keep the model's opset, and the Loop rule differentiates them (Scan's own rule starts
  at opset 9).

- The int32 bias of a quantized ``Gemm``/``Conv`` (``quantize_static``'s QDQ:
  ``DequantizeLinear(b_quantized, b_scale)`` where ``b_scale`` = ``x_scale * w_scale``, the scales
  of the DequantizeLinear nodes feeding the product) reads its scale as
  ``Mul(x_scale, w_scale)`` (:func:`_tied_bias_scales`): the same value, but a trained
  ``x_scale`` or ``w_scale`` now moves the bias scale with it. onnxruntime's QDQ fusion (``QGemm``,
  ``QLinearConv``, at its default optimization level) computes the bias with ``x_scale * w_scale``
  whatever ``b_scale`` holds: with ``b_scale`` a separate constant, the trained model and the one a
  default session runs differed (0.05 of an output of 3.8 for a 10 % change of one weight scale).
  The saved model keeps the ``Mul`` of two constants, which onnxruntime folds before fusing.

- GroupQueryAttention with packed QKV or ``do_rotary=1`` (onnxruntime-genai's model builder)
  becomes a Split, two RotaryEmbeddings and GroupQueryAttention on the turned Q and K
  (:mod:`.unfuse`): the same outputs, each piece with its rule.

Measured and left out: ``MatMul(x, W) + b`` (+ ReLU) on a batch of sequences as one ``Gemm``
between reshapes (what onnxruntime does itself when every dim is static). onnxruntime's Gemm
writes the broadcast bias first and accumulates onto it, and applies the ReLU in a second pass: the
anchor transformer's forward took 19.7 ms with it, 18.9 ms without.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..model.graph import ValueInfo, all_names, node_operands, np_dtype, unique_name
from .unfuse import unfused_group_query_attention


def rewrite_for_training(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (changed in place and returned) with the rewrites above applied to its main graph,
    whose nodes must be in topological order (they stay so)."""
    taken = all_names(model.graph)
    unfused_group_query_attention(model, taken)
    _relu_after_max_pool(model.graph, taken)
    _time_major_recurrences(model.graph, taken)
    _tied_bias_scales(model.graph, taken)
    if any(o.domain in ("", "ai.onnx") and o.version < 9 for o in model.opset_import):
        _scan8_as_loops(model.graph, taken)
    return model


def _scan8_as_loops(graph: onnx.GraphProto, taken: set[str]) -> None:
    """Scan-8 nodes as nested Loops (see the module docstring)."""
    if not any(_is(node, "Scan") for node in graph.node):
        return
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        scan_inputs = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        if not _is(node, "Scan") or not scan_inputs:
            nodes.append(node)  # nothing to scan: left as it is (no rule)
            continue
        nodes.extend(_scan8_loops(node, taken))
    del graph.node[:]
    graph.node.extend(nodes)


def _scan8_loops(node: onnx.NodeProto, taken: set[str]) -> list[onnx.NodeProto]:
    """The Loops of one Scan-8 node. Opset 8 has no int64 Constant: sizes come from Shape, Slice
    and Squeeze, the number 1 from Size; the Loops run on their trip counts alone."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    body: onnx.GraphProto = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    dirs = list(attrs.get("directions") or [0] * m)
    operands = list(node.input[1:])
    n_state = len(operands) - m
    i64, boolean = onnx.TensorProto.INT64, onnx.TensorProto.BOOL
    scalar = helper.make_tensor_value_info
    lens = node.input[0] if node.input and node.input[0] else None
    floats = (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
    if lens is not None and any(v.type.tensor_type.elem_type not in floats for v in body.output):
        return [node]  # masking the steps past a length needs floating-point states and outputs

    def fresh(hint: str) -> str:
        return unique_name(hint, taken)

    def leading(x: str, nodes: list[onnx.NodeProto]) -> tuple[str, str]:
        """(size of x along axis 0, the number 1), both int64 scalars."""
        shape, vec, size, one = fresh(f"{x}_shape"), fresh(f"{x}_dim0"), fresh(f"{x}_len"), fresh("one")
        nodes += [
            helper.make_node("Shape", [x], [shape]),
            helper.make_node("Slice", [shape], [vec], starts=[0], ends=[1], axes=[0]),
            helper.make_node("Squeeze", [vec], [size], axes=[0]),
            helper.make_node("Size", [vec], [one]),
        ]
        return size, one

    # Outer Loop body (batch element b): the states and scan inputs of b, their step counts.
    b, bcond = fresh("scan_b"), fresh("scan_batch_cond")
    outer: list[onnx.NodeProto] = []
    states_b = [fresh(f"{x}_b") for x in operands[:n_state]]
    elements = [fresh(f"{x}_b") for x in operands[n_state:]]  # x[b]: (T, ...)
    for x, xb in zip(operands, [*states_b, *elements]):
        outer.append(helper.make_node("Gather", [x, b], [xb], axis=0))
    steps, one = leading(elements[0], outer)

    length = steps
    if lens is not None:  # this element's length
        length = fresh("scan_length")
        outer.append(helper.make_node("Gather", [lens, b], [length], axis=0))

    # Inner Loop body: step t of element b, the original body's nodes on x[b, t].
    t, cond = fresh("scan_t"), fresh("scan_cond")
    inner: list[onnx.NodeProto] = []
    valid = None
    if lens is not None:  # step t < length (Less takes floats at opset 8)
        tf, lf, valid, valid_i = fresh("t_float"), fresh("length_float"), fresh("valid"), fresh("valid_int")
        inner += [
            helper.make_node("Cast", [t], [tf], to=onnx.TensorProto.FLOAT),
            helper.make_node("Cast", [length], [lf], to=onnx.TensorProto.FLOAT),
            helper.make_node("Less", [tf, lf], [valid]),
            helper.make_node("Cast", [valid], [valid_i], to=i64),
        ]
    for k, (inp, elem) in enumerate(zip(body.input[n_state:], elements)):
        index = t
        if dirs[k]:  # reversed: step t reads x[b, length - 1 - t] (0 past the length)
            last, index = fresh("last_step"), fresh("reversed_t")
            inner.append(helper.make_node("Sub", [length, one], [last]))
            inner.append(helper.make_node("Sub", [last, t], [index]))
            if valid is not None:
                clamped = fresh("reversed_t_valid")
                inner.append(helper.make_node("Mul", [index, valid_i], [clamped]))
                index = clamped
        inner.append(helper.make_node("Gather", [elem, index], [inp.name], axis=0))
    inner += list(body.node)
    cond_out = fresh("scan_cond_out")
    inner.append(helper.make_node("Identity", [cond], [cond_out]))
    inner_inputs = [scalar(t, i64, []), scalar(cond, boolean, []), *body.input[:n_state]]
    results_inner = list(body.output)
    if valid is not None:  # past the length: states unchanged, outputs zero
        masks: dict[int, tuple[str, str]] = {}
        results_inner = []
        for k, o in enumerate(body.output):
            dtype = o.type.tensor_type.elem_type
            if dtype not in masks:
                on, off, invalid = fresh("mask"), fresh("mask_off"), fresh("invalid")
                inner += [
                    helper.make_node("Cast", [valid], [on], to=dtype),
                    helper.make_node("Not", [valid], [invalid]),
                    helper.make_node("Cast", [invalid], [off], to=dtype),
                ]
                masks[dtype] = (on, off)
            on, off = masks[dtype]
            masked = fresh(f"{o.name}_masked")
            if k < n_state:
                kept, old = fresh(f"{o.name}_new"), fresh(f"{o.name}_old")
                inner += [
                    helper.make_node("Mul", [on, o.name], [kept]),
                    helper.make_node("Mul", [off, body.input[k].name], [old]),
                    helper.make_node("Add", [kept, old], [masked]),
                ]
            else:
                inner.append(helper.make_node("Mul", [on, o.name], [masked]))
            vi = onnx.ValueInfoProto(name=masked)
            vi.type.CopyFrom(o.type)
            results_inner.append(vi)
    inner_outputs = [scalar(cond_out, boolean, []), *results_inner]
    inner_dummy = n_state == 0  # Loop-1 wants a loop-carried value: a dummy where there is none
    if inner_dummy:
        dummy_in, dummy_out = fresh("scan_dummy"), fresh("scan_dummy_out")
        inner.append(helper.make_node("Identity", [dummy_in], [dummy_out]))
        inner_inputs.append(scalar(dummy_in, i64, []))
        inner_outputs.insert(1, scalar(dummy_out, i64, []))
    inner_graph = helper.make_graph(
        inner,
        fresh(f"{body.name or 'scan'}_steps"),
        inner_inputs,
        inner_outputs,
        initializer=body.initializer,
    )
    inner_graph.value_info.extend(body.value_info)

    results = [fresh(f"{o}_b") for o in node.output]
    carried_in = [one] if inner_dummy else states_b
    carried_out = [fresh("scan_dummy_final")] if inner_dummy else []
    outer.append(helper.make_node("Loop", [steps, "", *carried_in], carried_out + results, body=inner_graph))
    outer_cond, outer_dummy_in, outer_dummy_out = (
        fresh("scan_batch_cond_out"),
        fresh("scan_batch_dummy"),
        fresh("scan_batch_dummy_out"),
    )
    outer.append(helper.make_node("Identity", [bcond], [outer_cond]))
    outer.append(helper.make_node("Identity", [outer_dummy_in], [outer_dummy_out]))
    per_batch = []  # per element b: the final states, and the scan outputs stacked over the steps
    for k, (name, o) in enumerate(zip(results, body.output)):
        vi = onnx.ValueInfoProto(name=name)
        vi.type.CopyFrom(o.type)
        if k >= n_state and vi.type.tensor_type.HasField("shape"):
            vi.type.tensor_type.shape.dim.insert(0, onnx.TensorShapeProto.Dimension(dim_param=fresh("steps")))
        per_batch.append(vi)
    outer_graph = helper.make_graph(
        outer,
        fresh(f"{body.name or 'scan'}_batch"),
        [scalar(b, i64, []), scalar(bcond, boolean, []), scalar(outer_dummy_in, i64, [])],
        [scalar(outer_cond, boolean, []), scalar(outer_dummy_out, i64, []), *per_batch],
    )
    main: list[onnx.NodeProto] = []
    batch, one_main = leading(operands[0], main)
    main.append(
        helper.make_node(
            "Loop",
            [batch, "", one_main],
            [fresh("scan_batch_dummy_final"), *node.output],
            body=outer_graph,
            name=node.name,
        )
    )
    return main


_RECURRENT = ("RNN", "GRU", "LSTM")


def _time_major_recurrences(graph: onnx.GraphProto, taken: set[str]) -> None:
    """Batch-major RNN/GRU/LSTM nodes as time-major ones between Transposes (same values)."""
    if not any(_is(node, op) for node in graph.node for op in _RECURRENT):
        return
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        layout = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "layout"), 0)
        if not any(_is(node, op) for op in _RECURRENT) or not layout:
            nodes.append(node)
            continue
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for a in new.attribute:
            if a.name == "layout":
                a.i = 0
        # X (B, T, I) -> (T, B, I); initial_h, initial_c (B, D, H) -> (D, B, H)
        for slot in (0, 5, 6):
            if slot < len(node.input) and node.input[slot]:
                moved = unique_name(f"{node.input[slot]}_time_major", taken)
                nodes.append(helper.make_node("Transpose", [node.input[slot]], [moved], perm=[1, 0, 2]))
                new.input[slot] = moved
        after = []
        for slot, out in enumerate(node.output):
            if not out:
                continue
            moved = unique_name(f"{out}_time_major", taken)
            new.output[slot] = moved
            perm = [2, 0, 1, 3] if slot == 0 else [1, 0, 2]  # Y (T, D, B, H) -> (B, T, D, H)
            after.append(helper.make_node("Transpose", [moved], [out], perm=perm))
        nodes += [new, *after]
    del graph.node[:]
    graph.node.extend(nodes)


def _tied_bias_scales(graph: onnx.GraphProto, taken: set[str]) -> None:
    """``DequantizeLinear(b_q, b_scale)`` feeding a Gemm's or Conv's bias reads ``Mul(x_scale,
    w_scale)`` (reshaped to ``b_scale``'s shape) instead of ``b_scale`` where ``b_q`` is int32 and
    ``b_scale`` equals that product to float32 rounding: see the module's docstring."""
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def dq_scale(value: str) -> str | None:
        dq = producer.get(value)
        if dq is None or not _is(dq, "DequantizeLinear") or len(dq.input) < 2 or dq.input[1] not in inits:
            return None
        return dq.input[1]

    made: dict[tuple[str, str], str] = {}
    new_nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    for node in graph.node:
        if not (_is(node, "Gemm") or _is(node, "Conv")) or len(node.input) < 3 or not node.input[2]:
            continue
        x_scale, w_scale, b_scale = (dq_scale(i) for i in node.input[:3])
        if x_scale is None or w_scale is None or b_scale is None or b_scale in (x_scale, w_scale):
            continue
        bias_dq = producer[node.input[2]]
        b_q = inits.get(bias_dq.input[0])
        if b_q is None or b_q.data_type != TensorProto.INT32:
            continue
        xs, ws = numpy_helper.to_array(inits[x_scale]), numpy_helper.to_array(inits[w_scale])
        bs = numpy_helper.to_array(inits[b_scale])
        product = xs * ws
        if xs.size != 1 or product.dtype != bs.dtype or product.size != bs.size:
            continue
        if not np.allclose(product.reshape(-1), bs.reshape(-1), rtol=4 * np.finfo(bs.dtype).eps, atol=0):
            continue
        if (x_scale, w_scale) not in made:
            out = unique_name(f"{b_scale}_tied", taken)
            new_nodes.append(
                helper.make_node("Mul", [x_scale, w_scale], [out], name=unique_name(f"{out}/Mul", taken))
            )
            if product.shape != bs.shape:
                shape = unique_name(f"{b_scale}_tied_shape", taken)
                graph.initializer.append(numpy_helper.from_array(np.array(bs.shape, np.int64), shape))
                shaped = unique_name(f"{b_scale}_tied_shaped", taken)
                new_nodes.append(
                    helper.make_node(
                        "Reshape", [out, shape], [shaped], name=unique_name(f"{shaped}/Reshape", taken)
                    )
                )
                out = shaped
            made[(x_scale, w_scale)] = out
        bias_dq.input[1] = made[(x_scale, w_scale)]
        replaced.add(b_scale)
    if not new_nodes:
        return
    nodes = [*new_nodes, *graph.node]  # they read initializers only: first, the graph stays sorted
    del graph.node[:]
    graph.node.extend(nodes)
    read = {i for n in graph.node for i in node_operands(n)} | {v.name for v in (*graph.input, *graph.output)}
    kept = [t for t in graph.initializer if t.name in read or t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)  # the stored bias scales nothing reads now (onnxruntime would warn)


def _relu_after_max_pool(graph: onnx.GraphProto, taken: set[str]) -> None:
    uses = Counter(name for node in graph.node for name in node_operands(node))
    outputs = {o.name for o in graph.output}
    position = {out: i for i, node in enumerate(graph.node) for out in node.output}
    for i_pool, pool in enumerate(graph.node):
        if not _is(pool, "MaxPool") or not pool.input or pool.input[0] not in position:
            continue
        i_relu = position[pool.input[0]]
        relu = graph.node[i_relu]
        if not _is(relu, "Relu") or uses[relu.output[0]] != 1 or relu.output[0] in outputs:
            continue
        if not _commutes(pool):
            continue
        pooled = unique_name(f"{pool.output[0]}_before_relu", taken)
        new_pool, new_relu = onnx.NodeProto(), onnx.NodeProto()
        new_pool.CopyFrom(pool)
        new_pool.input[0], new_pool.output[0] = relu.input[0], pooled
        new_relu.CopyFrom(relu)
        new_relu.input[0], new_relu.output[0] = pooled, pool.output[0]
        # MaxPool takes ReLU's place (its only input, x, is known there), ReLU takes MaxPool's.
        graph.node[i_relu].CopyFrom(new_pool)
        graph.node[i_pool].CopyFrom(new_relu)


def _is(node: onnx.NodeProto, op_type: str) -> bool:
    return node.op_type == op_type and node.domain in ("", "ai.onnx")


def _commutes(pool: onnx.NodeProto) -> bool:
    """Whether ReLU commutes with this MaxPool: only its values are used (not its Indices), and
    every window holds at least one element of X (a window of padding alone gives -inf, not 0)."""
    if len(pool.output) > 1 and pool.output[1]:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in pool.attribute}
    kernel = list(attrs.get("kernel_shape", []))
    if not kernel:
        return False
    dilations = list(attrs.get("dilations") or [1] * len(kernel))
    pads = list(attrs.get("pads") or [0] * 2 * len(kernel))
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    return all(p < extents[i % len(kernel)] for i, p in enumerate(pads))


def centered_batch_norms(
    nodes: list[onnx.NodeProto], infos: dict[str, ValueInfo], opset: int, fresh: Callable[[str], str]
) -> list[onnx.NodeProto]:
    """``nodes`` with every BatchNormalization in training mode (opset 14+, one float or double type
    for all its inputs, known rank) replaced by the centered computation of the module docstring;
    same outputs (Y, and the running statistics when asked for: ``input * momentum + batch
    statistic * (1 - momentum)``, biased variance, as onnxruntime). ``fresh`` names new values."""
    if opset < 14:
        return nodes
    out: list[onnx.NodeProto] = []
    for node in nodes:
        replaced = _centered_batch_norm(node, infos, opset, fresh)
        out.extend(replaced if replaced is not None else [node])
    return out


def _centered_batch_norm(
    node: onnx.NodeProto, infos: dict[str, ValueInfo], opset: int, fresh: Callable[[str], str]
) -> list[onnx.NodeProto] | None:
    if not _is(node, "BatchNormalization") or len(node.input) != 5 or not all(node.input):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if not attrs.get("training_mode", 0) or len(node.output) > 3:
        return None
    types = [infos.get(name) for name in node.input]
    x = types[0]
    if any(t is None for t in types) or x is None or x.rank is None or x.rank < 2:
        return None
    if x.dtype not in (TensorProto.FLOAT, TensorProto.DOUBLE) or any(t.dtype != x.dtype for t in types):  # type: ignore[union-attr]
        return None
    if any(t.rank != 1 for t in types[1:]):  # type: ignore[union-attr]
        return None
    dtype = np_dtype(x.dtype)
    eps, momentum = float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9))
    xname, scale, bias, run_mean, run_var = node.input
    base = node.name or node.output[0]
    nodes: list[onnx.NodeProto] = []

    def const(value: object, np_type: object = dtype) -> str:
        name = fresh(f"{base}_const")
        nodes.append(
            helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np_type)))
        )
        return name

    def add(op: str, *inputs: str, out: str | None = None, **kw: object) -> str:
        name = out or fresh(f"{base}_{op.lower()}")
        nodes.append(helper.make_node(op, list(inputs), [name], **kw))
        return name

    axes = [0, *range(2, x.rank)]

    def mean(v: str) -> str:
        if opset >= 18:
            return add("ReduceMean", v, const(axes, np.int64), keepdims=1)
        return add("ReduceMean", v, axes=axes, keepdims=1)

    def per_channel(p: str) -> str:  # (C,) -> (C, 1, ...): aligned with axis 1 of x
        return add("Unsqueeze", p, const(list(range(1, x.rank - 1)), np.int64)) if x.rank > 2 else p

    first_mean = mean(xname)
    xc0 = add("Sub", xname, first_mean)
    shift = mean(xc0)  # the rounding of first_mean, measured on the (exact) differences
    xc = add("Sub", xc0, shift)
    batch_var = mean(add("Mul", xc, xc))
    factor = add("Div", per_channel(scale), add("Sqrt", add("Add", batch_var, const(eps))))
    add("Add", add("Mul", xc, factor), per_channel(bias), out=node.output[0])
    for slot, running in ((1, run_mean), (2, run_var)):
        if len(node.output) > slot and node.output[slot]:
            batch = add("Add", first_mean, shift) if slot == 1 else batch_var
            flat = add("Reshape", batch, const([-1], np.int64))
            kept = add("Mul", running, const(momentum))
            add("Add", kept, add("Mul", flat, const(1.0 - momentum)), out=node.output[slot])
    return nodes
