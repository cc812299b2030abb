"""Which standard ONNX ops have no kernel in onnxruntime (CPU) and onnxruntime-web (wasm).

    python tools/ort_op_coverage.py DIR [OPSET]    # writes DIR/<op>.onnx, one node each
    node tools/ort_op_coverage.mjs DIR             # -> DIR/result.json (NODE_PATH: both packages)

Each model holds one node of the op at opset 21 (or OPSET) (its inputs typed with the first float type its
schema allows, else the first type), so that session creation looks the kernel up. A session that
fails with "Could not find an implementation" (or NOT_IMPLEMENTED) means no kernel for that op and
type; other failures (missing attributes, shape errors) are left out. The table of
``onnxgrad.artifacts.targets`` comes from this.
"""

from __future__ import annotations

import os
import sys

import onnx
from onnx import defs, helper

OPSET = 21
PREFERRED = ["tensor(float)", "tensor(int64)", "tensor(bool)", "tensor(string)"]


def _type(schema: defs.OpSchema, type_str: str) -> onnx.TypeProto | None:
    allowed = None
    for c in schema.type_constraints:
        if c.type_param_str == type_str:
            allowed = list(c.allowed_type_strs)
    if allowed is None:
        allowed = [type_str]
    pick = next((p for p in PREFERRED if p in allowed), allowed[0])
    if not pick.startswith("tensor("):
        return None
    elem = helper.np_dtype_to_tensor_dtype(helper.tensor_dtype_to_np_dtype(_ELEMS[pick[7:-1]]))
    return helper.make_tensor_type_proto(elem, None)


_ELEMS = {
    "float": onnx.TensorProto.FLOAT, "double": onnx.TensorProto.DOUBLE, "float16": onnx.TensorProto.FLOAT16,
    "int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32, "int8": onnx.TensorProto.INT8,
    "uint8": onnx.TensorProto.UINT8, "bool": onnx.TensorProto.BOOL, "int16": onnx.TensorProto.INT16,
    "uint16": onnx.TensorProto.UINT16, "uint32": onnx.TensorProto.UINT32, "uint64": onnx.TensorProto.UINT64,
    "bfloat16": onnx.TensorProto.BFLOAT16, "string": onnx.TensorProto.STRING,
}  # fmt: skip


def main(out: str, opset: int = OPSET) -> None:
    global OPSET
    OPSET = opset
    os.makedirs(out, exist_ok=True)
    for schema in defs.get_all_schemas_with_history():
        if schema.domain != "" or schema.deprecated:
            continue
        try:
            schema = defs.get_schema(schema.name, OPSET, "")
        except Exception:
            continue
        if schema.since_version > OPSET or os.path.exists(os.path.join(out, f"{schema.name}.onnx")):
            continue
        try:
            inputs, names = [], []
            for k, p in enumerate(schema.inputs):
                t = _type(schema, p.type_str)
                if t is None:
                    raise ValueError("non-tensor input")
                vi = helper.make_value_info(f"in{k}", t)
                inputs.append(vi)
                names.append(vi.name)
            outputs = []
            for k, p in enumerate(schema.outputs):
                t = _type(schema, p.type_str)
                if t is None:
                    raise ValueError("non-tensor output")
                outputs.append(helper.make_value_info(f"out{k}", t))
            node = helper.make_node(schema.name, names, [o.name for o in outputs])
            graph = helper.make_graph([node], schema.name, inputs, outputs)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
            model.ir_version = 10
            onnx.save(model, os.path.join(out, f"{schema.name}.onnx"))
        except Exception as exc:  # an op this simple generator cannot build
            print(f"skip {schema.name}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else OPSET)
