"""Types and shapes of every value of a model: ONNX shape inference, helped where it gives up.

Constants and static shapes are folded first (:mod:`.fold`), ai.onnx.ml outputs and If/Loop/Scan
outputs are typed from a small table and from their subgraphs, the outputs of onnxruntime's contrib
ops (fused models) from :mod:`.contrib_schemas`, and inference runs again.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from .contrib_schemas import contrib_output_infos, has_output_rule
from .fold import fold_for_inference
from .graph import (
    ValueInfo,
    all_subgraphs,
    import_used_domains,
    subgraphs,
    value_info_from_proto,
    without_weights,
)
from .validate import safe_to_propagate_data

# ai.onnx.ml ops that ONNX shape inference leaves untyped: float32 with the shape of input 0.
_ML_ELEMENTWISE = {"Scaler", "Normalizer", "Imputer", "Binarizer"}


def _declaring(model: onnx.ModelProto, added: list[onnx.ValueInfoProto]) -> onnx.ModelProto | None:
    """A copy of ``model`` whose graph also declares ``added``, or None when there is nothing to add."""
    if not added:
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.value_info.extend(added)
    return copy


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        plain = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        # A graph that shape inference rejects may still run; keep what the file declares.
        return model
    # ONNX data propagation allocates ~100-230 bytes per element of every static 1-D value.
    if not safe_to_propagate_data(plain):
        return plain
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:
        return plain


def _type_ml_outputs(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` declaring the outputs of untyped ai.onnx.ml ops, or None if none."""
    typed = {vi.name for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    typed |= {i.name for i in model.graph.initializer}
    shapes = {vi.name: vi for vi in [*model.graph.value_info, *model.graph.input]}
    added = []
    for node in model.graph.node:
        if node.domain != "ai.onnx.ml" or not node.output or node.output[0] in typed:
            continue
        src = shapes.get(node.input[0]) if node.input else None
        if node.op_type in _ML_ELEMENTWISE and src is not None:
            dims = [d.dim_value or d.dim_param or None for d in src.type.tensor_type.shape.dim]
            added.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, dims))
        elif node.op_type == "LinearRegressor":
            targets = next((a.i for a in node.attribute if a.name == "targets"), 1)
            added.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, [None, targets]))
    return _declaring(model, added)


def infer_value_infos(model: onnx.ModelProto) -> dict[str, ValueInfo]:
    """Types and shapes of every value of the model, subgraphs included, after ONNX shape inference.

    ONNX infers nothing for most ai.onnx.ml ops, and gives up on some If, Loop and Scan outputs;
    those are typed (from a small table, from the subgraph outputs) and inference is run again, so
    the values after them keep known ranks.
    """
    # Values that constants and static shapes fix (axes, shapes computed by small graphs ONNX data
    # propagation does not follow) go to inference as Constant nodes, in the copy it works on. A
    # second round uses the shapes the first inferred, only while some rank is still unknown.
    shapes: dict[str, ValueInfo] = {}  # the first round folds what constants alone fix
    infos: dict[str, ValueInfo] = {}
    folded = -1
    for _ in range(3):
        skeleton = without_weights(model)
        import_used_domains(skeleton)
        count = fold_for_inference(skeleton, shapes)
        if count <= folded:
            break  # nothing more is known: the previous round stands
        folded = count
        inferred = _infer(skeleton)
        declared: set[str] = set()
        for _ in range(len(model.graph.node)):
            retyped = (
                _type_ml_outputs(inferred)
                or _type_control_flow_outputs(inferred, declared)
                or _type_contrib_outputs(inferred, declared)
            )
            if retyped is None:
                break
            inferred = _infer(retyped)
        infos = _collect_infos(inferred.graph)
        if not _unknown_ranks(model.graph, infos):
            break
        shapes = infos
    return infos


def _unknown_ranks(graph: onnx.GraphProto, infos: dict[str, ValueInfo]) -> bool:
    """Whether a standard-domain or contrib node of ``graph`` has an output of unknown rank."""
    for node in graph.node:
        if node.domain in ("", "ai.onnx") or has_output_rule(node):
            for out in node.output:
                if out and (out not in infos or infos[out].shape is None):
                    return True
    return False


def _collect_infos(graph: onnx.GraphProto) -> dict[str, ValueInfo]:
    infos: dict[str, ValueInfo] = {}
    # Values of subgraphs (If branches, Loop and Scan bodies) too: ONNX names are unique across scopes.
    for g in [graph, *all_subgraphs(graph)]:
        for vi in list(g.value_info) + list(g.input) + list(g.output):
            info = value_info_from_proto(vi)
            if info is not None and info.dtype != TensorProto.UNDEFINED:
                old = infos.get(vi.name)
                # Prefer the more specific of two declarations (a shape beats no shape).
                if old is None or (old.shape is None and info.shape is not None):
                    infos[vi.name] = info
        for init in g.initializer:
            infos[init.name] = ValueInfo(init.name, init.data_type, tuple(init.dims))
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value":
                        t = attr.t
                        infos[node.output[0]] = ValueInfo(node.output[0], t.data_type, tuple(t.dims))
    return infos


def _type_contrib_outputs(model: onnx.ModelProto, declared: set[str]) -> onnx.ModelProto | None:
    """A copy of ``model`` declaring the outputs of onnxruntime contrib ops that shape inference left
    untyped (see :mod:`.contrib_schemas`), or None if there are none. Each name is declared once."""
    infos = _collect_infos(model.graph)
    added = []
    for node in model.graph.node:
        if not has_output_rule(node):
            continue
        for info in contrib_output_infos(node, infos):
            if info is None or info.name in declared:
                continue
            old = infos.get(info.name)
            if old is not None and old.shape is not None:
                continue
            declared.add(info.name)
            infos[info.name] = info
            added.append(info.to_proto())
    return _declaring(model, added)


def _type_control_flow_outputs(model: onnx.ModelProto, declared: set[str]) -> onnx.ModelProto | None:
    """A copy of ``model`` declaring the ranks of the If, Loop and Scan outputs that shape inference
    left without one (they follow from the subgraph outputs), or None if there are none.

    ``declared`` collects the names declared so far: each is declared once, whatever inference does.
    """
    infos = _collect_infos(model.graph)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    added = False
    for graph in [copy.graph, *all_subgraphs(copy.graph)]:
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or node.op_type not in ("If", "Loop", "Scan"):
                continue
            for k, out in enumerate(node.output):
                if out and out not in declared and (out not in infos or infos[out].shape is None):
                    info = _control_flow_output(node, k, infos)
                    if info is not None:
                        declared.add(out)
                        graph.value_info.append(
                            ValueInfo(out, info.dtype, info.shape, info.sequence).to_proto()
                        )
                        infos[out] = info
                        added = True
    return copy if added else None


def _control_flow_output(node: onnx.NodeProto, k: int, infos: dict[str, ValueInfo]) -> ValueInfo | None:
    """The type of output ``k`` of an If, Loop or Scan from its subgraphs' outputs (dims unknown)."""
    if node.op_type == "If":
        found = [infos.get(b.output[k].name) for b in subgraphs(node) if k < len(b.output)]
        extra = 0
    else:
        body = subgraphs(node)[0]
        if node.op_type == "Loop":
            carried, first = len(node.input) - 2, 1
        else:
            scanned = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
            carried, first = len(node.input) - scanned, 0
        found = [infos.get(body.output[first + k].name)] if first + k < len(body.output) else []
        extra = 0 if k < carried else 1  # scan outputs stack one value per iteration
    known = [f for f in found if f is not None and f.shape is not None]
    if not known or len({f.rank for f in known}) != 1:
        return None
    return ValueInfo("", known[0].dtype, (None,) * (len(known[0].shape) + extra), known[0].sequence)  # type: ignore[arg-type]
