"""``com.microsoft`` PythonOp and PythonOpGrad, version 1, registered with ``onnx.defs``.

With them registered, ``onnx.checker.check_model(full_check=True)`` and ``onnx.shape_inference``
accept models holding these nodes. Every attribute spelling found in real files is declared. Required,
as in the original's schemas (seeds 000, 001, 002): ``name`` on both nodes, and on PythonOp the
type, rank and gradient-flag tables of its tensors (``input_tensor_types``, ``input_tensor_ranks``,
``output_tensor_types``, ``output_tensor_ranks``, ``output_tensor_requires_grads``), on PythonOpGrad
``output_tensor_requires_grads``. Attributes with two spellings in real files
(``input_convention``/``call_convention``, ``input_requires_grads``/``input_tensor_requires_grads``,
``output_convention``) stay optional here: which one is present is checked when a node runs.

Files with ``func_name`` but no ``name`` (written by earlier onnxgrad versions and newer ORT
exporters) fail ``onnx.checker`` with these schemas; onnxgrad's own entry points
(:func:`onnxgrad.build_gradient` and what builds on it) add ``name`` to their copy first
(:func:`~onnxgrad.model.pythonop_spec.complete_class_names`), and the runtime reads either spelling.

Shape inference gives output 0 of PythonOp an int64 scalar (the ctx handle) and every other output
the dtype and rank its ``output_tensor_types`` / ``output_tensor_ranks`` record, with unknown dimensions.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto
from onnx.defs import OpSchema

from ..deps import register_onnx_schema
from .pythonop_spec import MS_DOMAIN, PYTHON_OP, PYTHON_OP_GRAD

_ANY_TENSOR = [
    f"tensor({t})"
    for t in (
        "bool",
        "complex128",
        "complex64",
        "double",
        "float",
        "float16",
        "bfloat16",
        "int16",
        "int32",
        "int64",
        "int8",
        "string",
        "uint16",
        "uint32",
        "uint64",
        "uint8",
    )
]

_A = OpSchema.AttrType
_COMMON = {
    "name": (_A.STRING, "Name of the custom class (required; onnxgrad writes its __qualname__)."),
    "func_name": (_A.STRING, "Class of the autograd.Function, fully qualified 'module.QualName'."),
    "inplace": (_A.INT, "Old flag: outputs reuse input memory."),
    "safe_run_mode": (_A.INT, "1 (default): run through apply with autograd bookkeeping."),
    "comment": (_A.STRING, "Free text."),
    "input_tensor_types": (_A.INTS, "ONNX dtype of each tensor input."),
    "input_tensor_ranks": (_A.INTS, "Rank of each tensor input."),
    "input_tensor_requires_grads": (_A.INTS, "Older spelling of the per-input gradient flags."),
    "output_tensor_types": (_A.INTS, "ONNX dtype of each tensor output (ctx excluded)."),
    "output_tensor_ranks": (_A.INTS, "Rank of each tensor output (ctx excluded)."),
    "output_tensor_requires_grads": (_A.INTS, "Which tensor outputs carry a gradient."),
}
_FORWARD = {
    "input_convention": (_A.STRING, "One char per apply argument: 'd' tensor, 'c' constant."),
    "call_convention": (_A.STRING, "Older spelling of input_convention."),
    "input_requires_grads": (_A.INTS, "Per apply argument: does it need a gradient."),
    "training_mode": (_A.INT, "1: the ctx is kept for a backward; 0: inference only."),
    "tensor_reuse_map": (_A.INTS, "Per output: the input it aliases, or -1."),
    "input_pointer_scalars": (_A.INTS, "Original: raw object addresses (refused when run)."),
    "input_pointer_scalar_positions": (_A.INTS, "Positions of input_pointer_scalars."),
    "input_none_positions": (_A.INTS, "onnxgrad: positions of None arguments."),
    "input_string_scalars": (_A.STRINGS, "onnxgrad: str arguments, by value."),
    "input_string_scalar_positions": (_A.INTS, "onnxgrad: positions of input_string_scalars."),
    "input_float_scalars_exact": (_A.TENSOR, "onnxgrad: input_float_scalars as float64, exact."),
    "input_float_tuples_exact": (_A.TENSOR, "onnxgrad: input_float_tuples as float64, exact."),
}
for _kind, _type in (("int", _A.INTS), ("float", _A.FLOATS), ("bool", _A.INTS)):
    _FORWARD[f"input_{_kind}_scalars"] = (_type, f"Python {_kind} arguments.")
    _FORWARD[f"input_{_kind}_scalar_positions"] = (_A.INTS, f"Positions of the {_kind} arguments.")
    _FORWARD[f"input_{_kind}_tuples"] = (_type, f"All {_kind} tuples, concatenated.")
    _FORWARD[f"input_{_kind}_tuple_begins"] = (_A.INTS, f"Start of each {_kind} tuple.")
    _FORWARD[f"input_{_kind}_tuple_positions"] = (_A.INTS, f"Positions of the {_kind} tuples.")
_BACKWARD = {
    "output_convention": (_A.STRING, "The forward's input_convention."),
    "input_convention": (_A.STRING, "Seen in some files instead of output_convention."),
    "bw_tensor_reuse_map": (_A.INTS, "Per output: the input it aliases, or -1."),
}


# Required in the original's schemas, and spelled one way in every generation.
_REQUIRED_FORWARD = {
    "name",
    "input_tensor_types",
    "input_tensor_ranks",
    "output_tensor_types",
    "output_tensor_ranks",
    "output_tensor_requires_grads",
}
_REQUIRED_BACKWARD = {"name", "output_tensor_requires_grads"}


def _attributes(
    table: dict[str, tuple[OpSchema.AttrType, str]], required: set[str]
) -> list[OpSchema.Attribute]:
    return [OpSchema.Attribute(n, t, doc, required=n in required) for n, (t, doc) in sorted(table.items())]


def _tensor_type(elem_type: int, rank: int | None) -> onnx.TypeProto:
    tp = onnx.TypeProto()
    tp.tensor_type.elem_type = elem_type
    if rank is not None and rank >= 0:
        tp.tensor_type.shape.SetInParent()
        for _ in range(rank):
            tp.tensor_type.shape.dim.add()
    return tp


def _ints(ctx: onnx.shape_inference.InferenceContext, name: str) -> list[int]:
    attr = ctx.get_attribute(name)
    return list(attr.ints) if attr is not None else []


def _set_recorded_outputs(ctx: onnx.shape_inference.InferenceContext, first: int) -> None:
    types, ranks = _ints(ctx, "output_tensor_types"), _ints(ctx, "output_tensor_ranks")
    for i in range(first, ctx.get_num_outputs()):
        k = i - first
        if k < len(types) and ctx.has_output(i):
            ctx.set_output_type(i, _tensor_type(types[k], ranks[k] if k < len(ranks) else None))


def _infer_python_op(ctx: onnx.shape_inference.InferenceContext) -> None:
    ctx.set_output_type(0, _tensor_type(TensorProto.INT64, 0))
    _set_recorded_outputs(ctx, 1)


def _infer_python_op_grad(ctx: onnx.shape_inference.InferenceContext) -> None:
    _set_recorded_outputs(ctx, 0)


def _variadic(name: str, min_arity: int) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(
        name,
        "T",
        param_option=OpSchema.FormalParameterOption.Variadic,
        is_homogeneous=False,
        min_arity=min_arity,
    )


def _ctx(name: str) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(name, "TInt64", "Handle of the autograd ctx of one call.")


def _schemas() -> list[OpSchema]:
    constraints = [("T", _ANY_TENSOR, "Any tensor."), ("TInt64", ["tensor(int64)"], "The ctx handle.")]
    forward = OpSchema(
        PYTHON_OP,
        MS_DOMAIN,
        1,
        "One call Function.apply(*args) of a torch.autograd.Function: inputs are the tensor "
        "arguments, output 0 the ctx handle, then the tensor outputs.",
        inputs=[_variadic("inputs", 0)],
        outputs=[_ctx("context"), _variadic("outputs", 0)],
        type_constraints=constraints,
        attributes=_attributes({**_COMMON, **_FORWARD}, _REQUIRED_FORWARD),
    )
    forward.set_type_and_shape_inference_function(_infer_python_op)
    backward = OpSchema(
        PYTHON_OP_GRAD,
        MS_DOMAIN,
        1,
        "Function.backward(ctx, *grads) for the PythonOp whose ctx handle is input 0: then one "
        "gradient per forward output (empty where none; older files append the N forward outputs). "
        "Outputs: the gradients of the forward's tensor inputs, empty where none is needed.",
        inputs=[_ctx("context"), _variadic("inputs", 0)],
        outputs=[_variadic("outputs", 0)],
        type_constraints=constraints,
        attributes=_attributes({**_COMMON, **_BACKWARD}, _REQUIRED_BACKWARD),
    )
    backward.set_type_and_shape_inference_function(_infer_python_op_grad)
    return [forward, backward]


def register_schemas() -> None:
    """Register both schemas with ``onnx.defs`` (once; replacing other registrations of them)."""
    for schema in _schemas():
        try:
            existing = onnx.defs.get_schema(schema.name, schema.since_version, schema.domain)
        except onnx.defs.SchemaError:
            existing = None
        if existing is not None:
            if existing.doc == schema.doc:
                continue  # ours, already there
            onnx.defs.deregister_schema(schema.name, schema.since_version, schema.domain)
        register_onnx_schema(schema)


register_schemas()
