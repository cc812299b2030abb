"""Would onnx-ir make the gradient build smaller and not slower? (issue 14)

Times, on the 24-layer anchor transformer of ``compare_torch.py --build-layers``, our own protobuf
helpers (``onnxgrad.model.graph``) against onnx-ir's proto round trip and the passes that would
replace them. Run: ``.venv/bin/python bench/ir_eval.py`` (onnx-ir comes with the zoo extra).
docs/architecture.md records the figures and the decision they led to.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import onnx_ir as ir
import onnx_ir.passes.common as common
import torch

import onnxgrad
from onnxgrad.model.graph import all_names, constant_values, topological_order
from onnxgrad.model.infer import infer_value_infos

sys.path.insert(0, ".")
from bench import anchors

torch.manual_seed(0)
stack = torch.nn.Sequential(*[anchors.EncoderLayer() for _ in range(24)])
model = anchors.export(stack, anchors.example_input("transformer", batch=1))
print(f"24-layer transformer: {len(model.graph.node)} nodes, {model.ByteSize() / 1e6:.0f} MB")


def med(f: Callable[[], object], n: int = 5) -> float:
    """Median milliseconds of ``f`` over ``n`` runs."""
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def ir_round():
    m = ir.from_proto(model)
    return ir.to_proto(m)


def ir_sort():
    m = ir.from_proto(model)
    common.TopologicalSortPass()(m)
    return ir.to_proto(m)


def ir_sort_only_load():
    m = ir.from_proto(model)
    common.TopologicalSortPass()(m)


def ours_sort():
    topological_order(model.graph)


def ours_names():
    all_names(model.graph)


def ir_names():
    m = ir.from_proto(model)
    common.NameFixPass()(m)


def ours_consts():
    constant_values(model)


def build():
    onnxgrad.build_gradient(model)


for name, f in [
    ("build_gradient (whole)", build),
    ("ours: topological_order", ours_sort),
    ("ours: all_names", ours_names),
    ("ours: constant_values", ours_consts),
    ("onnx-ir: from_proto", lambda: ir.from_proto(model)),
    ("onnx-ir: from_proto+to_proto", ir_round),
    ("onnx-ir: from_proto+TopologicalSortPass", ir_sort_only_load),
    ("onnx-ir: from_proto+sort+to_proto", ir_sort),
    ("onnx-ir: from_proto+NameFixPass", ir_names),
    ("shape inference (ours, infer_value_infos)", lambda: infer_value_infos(model)),
]:
    print(f"{name:45s} {med(f):9.1f} ms")
