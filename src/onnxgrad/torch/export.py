"""``onnxgrad.export``: a torch module to ONNX, custom autograd Functions kept as PythonOp nodes.

``torch.onnx.export`` (both exporters) inlines a custom ``torch.autograd.Function``'s forward and
loses its backward. Here the TorchScript exporter runs with a symbolic for ``prim::PythonOp`` (the
node tracing records for each ``Function.apply``): the chosen Functions become ``com.microsoft``
PythonOp nodes carrying every attribute of the original schema, the others are inlined as usual,
and the rest of the module is standard ONNX. Non-tensor arguments are stored by value (see
:mod:`onnxgrad.model.pythonop_spec`); anything that cannot be is refused with :class:`PythonOpError`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx
import torch

from ..deps import function_apply_observed
from ..errors import PythonOpError
from ..model.graph import MAX_IR_VERSION, ir_version_for
from ..model.pythonop_spec import MS_DOMAIN, PYTHON_OP, encode_constants
from ..pythonop.executor import TORCH_TO_ONNX
from ..pythonop.registry import qualified_name, register_function

_SYMBOLIC = "prim::PythonOp"
_EXPORT_LOCK = threading.Lock()  # the prim::PythonOp symbolic is global to torch


def export(
    module: torch.nn.Module,
    args: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    functions: Iterable[type | str] | None = None,
    opset: int | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Any] | None = None,
    training: bool | None = None,
    register: bool = True,
) -> onnx.ModelProto:
    """Export ``module(*args, **kwargs)`` to ONNX with its custom Functions as PythonOp nodes.

    ``functions``: the Function classes (or ``module.QualName`` names) to keep as PythonOp; ``None``
    keeps every one, the others are inlined. ``opset``: the ai.onnx opset (torch's default when
    ``None``). ``input_names`` default to the names of ``forward``'s tensor parameters,
    ``output_names`` to ``output`` / ``output_0``, ``output_1``... ``training``: the nodes'
    ``training_mode`` (default: ``module.training``); a node exported with 0 keeps no ctx and cannot
    be differentiated. ``register``: register the exported Functions with
    :func:`onnxgrad.register_function`, so this process can run the model right away.
    """
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    wanted = _selection(functions)
    state = _ExportState(wanted, module.training if training is None else training, bool(dynamic_axes))
    if input_names is None:
        input_names = _default_input_names(module, args, kwargs)
    opset_version = opset or _default_opset()
    buf = io.BytesIO()
    with _EXPORT_LOCK, warnings.catch_warnings(), _tensor_outputs_checked(state):
        warnings.simplefilter("ignore", DeprecationWarning)
        previous = _previous_symbolic(opset_version)
        torch.onnx.register_custom_op_symbolic(_SYMBOLIC, state.symbolic, opset_version)
        try:
            torch.onnx.export(
                module,
                args,
                buf,
                kwargs=kwargs or None,
                dynamo=False,
                opset_version=opset_version,
                input_names=list(input_names) or None,
                output_names=list(output_names) if output_names else None,
                dynamic_axes=dict(dynamic_axes) if dynamic_axes else None,
                do_constant_folding=False,  # keeps parameters as the module's named initializers
                keep_initializers_as_inputs=False,
                custom_opsets={MS_DOMAIN: 1},
            )
        except Exception as exc:
            if state.error is not None:  # torch may wrap what the symbolic raised
                raise state.error from exc
            raise
        finally:
            torch.onnx.unregister_custom_op_symbolic(_SYMBOLIC, opset_version)
            if previous is not None:
                torch.onnx.register_custom_op_symbolic(_SYMBOLIC, previous, opset_version)
    if state.error is not None:
        raise state.error
    model = onnx.load_from_string(buf.getvalue())
    if output_names is None:
        _rename_outputs(model)
    _finish(model)
    if register:
        for cls in state.exported.values():
            register_function(cls)
    return model


@contextlib.contextmanager
def _tensor_outputs_checked(state: _ExportState) -> Any:
    """While tracing, a Function whose ``forward`` returns a non-tensor (``return y, 7``) fails with
    a :class:`PythonOpError` naming it, instead of torch's INTERNAL ASSERT in a later pass.

    ``Function.apply`` is wrapped for the duration of the export (under the export lock); calls
    outside a trace, and in other threads, go straight through.
    """

    def observe(cls: type, out: Any) -> None:
        if torch._C._get_tracing_state() is None:
            return
        outs = out if isinstance(out, tuple | list) else (out,)
        bad = [(i, v) for i, v in enumerate(outs) if not isinstance(v, torch.Tensor)]
        if bad:
            i, value = bad[0]
            shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
            error = PythonOpError(
                f"{qualified_name(cls)}.forward returned output {i} of {len(outs)} as "
                f"{type(value).__name__} {shown}: a Function exported as a PythonOp node (or inlined) "
                "may return only tensors. Return it as a tensor (torch.tensor(...)), or keep the "
                "value out of the Function's outputs"
            )
            state.error = state.error or error
            raise error

    with function_apply_observed(observe):
        yield


class _ExportState:
    """The symbolic for ``prim::PythonOp`` and what it saw."""

    def __init__(self, wanted: set[str] | None, training: bool, dynamic: bool) -> None:
        self.wanted = wanted
        self.training = training
        self.dynamic = dynamic  # dynamic axes: PythonOp outputs keep their rank, not the traced sizes
        self.exported: dict[str, type] = {}
        self.error: Exception | None = None

    def symbolic(self, g: Any, *args: Any, **attrs: Any) -> Any:
        try:
            node = g.original_node
            cls = getattr(node.pyobj(), "__self__", None)
            if not isinstance(cls, type) or not issubclass(cls, torch.autograd.Function):
                raise PythonOpError(
                    f"cannot export Python operator {node.pyname()!r}: not an autograd.Function"
                )
            name = qualified_name(cls)
            if self.wanted is not None and name not in self.wanted:
                return _inline(g, node, args)
            self.exported[name] = cls
            return _python_op(g, node, cls, args, self.training, self.dynamic)
        except Exception as exc:
            self.error = self.error or exc
            raise


def _inline(g: Any, node: Any, args: Sequence[Any]) -> Any:
    """Export the traced body of a Function that stays standard ONNX (what torch does by default)."""
    block = next(iter(node.blocks()), None)
    if block is None:
        raise PythonOpError(f"torch recorded no body for {node.pyname()!r}: it cannot be inlined")
    env = dict(g.env)
    tensors = [a for a in args if isinstance(a, torch._C.Value)]
    for inner, outer in zip(block.inputs(), tensors):
        env[inner] = outer
    env = torch._C._jit_pass_onnx_block(
        block, g.block, torch._C._onnx.OperatorExportTypes.ONNX, env, g.values_in_env, True
    )
    outs = [env[o] for o in block.outputs()]
    return outs[0] if len(outs) == 1 else outs


def _onnx_type(value: Any, what: str) -> int:
    dtype = value.type().dtype()
    if dtype not in TORCH_TO_ONNX:
        raise PythonOpError(f"{what} has dtype {dtype}, which ONNX cannot hold")
    return TORCH_TO_ONNX[dtype]


def _rank(value: Any) -> int:
    rank = value.type().dim()
    return -1 if rank is None else int(rank)


def _python_op(g: Any, node: Any, cls: type, args: Sequence[Any], training: bool, dynamic: bool) -> Any:
    func = qualified_name(cls)
    convention = node.cconv()
    if len(convention) != len(args):
        raise PythonOpError(
            f"{func}: torch recorded {len(convention)} arguments, the symbolic got {len(args)}"
        )
    tensors = [a for a, c in zip(args, convention) if c == "d"]
    constants = {i: a for i, (a, c) in enumerate(zip(args, convention)) if c == "c"}
    for i, a in constants.items():
        if isinstance(a, torch.Tensor | torch._C.Value):
            raise PythonOpError(
                f"{func}: argument {i} holds a tensor inside a container; pass tensors directly"
            )
    traced_in = list(node.inputs())
    traced_out = list(node.outputs())
    in_grads = [v.requiresGrad() for v in traced_in]
    # With no input requiring grad at trace time the tracer cannot tell which outputs are
    # differentiable: then every floating-point output is (the ctx knows better at run time).
    out_grads = [
        o.requiresGrad() or (not any(in_grads) and o.type().dtype().is_floating_point) for o in traced_out
    ]
    it = iter(in_grads)
    attrs: dict[str, Any] = {
        "name": cls.__qualname__,  # required by both schema generations of the original
        "func_name": func,
        "input_convention": convention,
        "input_requires_grads": [int(next(it)) if c == "d" else 0 for c in convention],
        "input_tensor_types": [_onnx_type(v, f"{func} input {i}") for i, v in enumerate(traced_in)],
        "input_tensor_ranks": [_rank(v) for v in traced_in],
        "output_tensor_types": [_onnx_type(v, f"{func} output {i}") for i, v in enumerate(traced_out)],
        "output_tensor_ranks": [_rank(v) for v in traced_out],
        "output_tensor_requires_grads": [int(x) for x in out_grads],
        "training_mode": int(training),
        "safe_run_mode": 1,
    }
    attrs.update(encode_constants(convention, constants, func))
    suffix = {int: "i", float: "f", str: "s"}
    kw = {}
    for key, value in attrs.items():
        if isinstance(value, list):
            kind = suffix[type(value[0])] if value else "i"
            kw[f"{key}_{kind}"] = value
        else:
            kw[f"{key}_{suffix[type(value)]}"] = value
    outs = g.op(f"{MS_DOMAIN}::{PYTHON_OP}", *tensors, outputs=1 + len(traced_out), **kw)
    outs[0].setType(torch._C.TensorType.create_from_tensor(torch.zeros((), dtype=torch.int64)))
    for new, old in zip(outs[1:], traced_out):
        rank = old.type().dim()
        new.setType(old.type().with_sizes([None] * rank) if dynamic and rank is not None else old.type())
    rest = list(outs[1:])
    return rest[0] if len(rest) == 1 else rest


# ---- helpers ----------------------------------------------------------------------------------
def _selection(functions: Iterable[type | str] | None) -> set[str] | None:
    if functions is None:
        return None
    names = set()
    for f in [functions] if isinstance(functions, type | str) else functions:
        if isinstance(f, str):
            names.add(f)
        elif isinstance(f, type) and issubclass(f, torch.autograd.Function):
            names.add(qualified_name(f))
        else:
            raise PythonOpError(f"functions= takes torch.autograd.Function classes or names, got {f!r}")
    return names


def _default_opset() -> int:
    from torch.onnx import _constants

    return min(int(_constants.ONNX_DEFAULT_OPSET), 26)


def _previous_symbolic(opset: int) -> Any:
    """A custom ``prim::PythonOp`` symbolic the caller registered (restored after export)."""
    try:
        from torch.onnx._internal.torchscript_exporter import registration

        group = registration.registry.get_function_group(_SYMBOLIC)
        if group is not None and group._functions.overridden(opset):
            return group.get(opset)
    except Exception:  # torch internals moved: nothing to restore
        pass
    return None


def _default_input_names(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[str]:
    if not all(isinstance(a, torch.Tensor) for a in [*args, *kwargs.values()]):
        return []  # nested or non-tensor arguments: torch's own names
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    names: list[str] = []
    for p in params:
        if len(names) == len(args):
            break
        if p.kind == inspect.Parameter.VAR_POSITIONAL:  # *rest -> rest_0, rest_1, ...
            names += [f"{p.name}_{k}" for k in range(len(args) - len(names))]
        elif p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    if len(names) != len(args):
        return []
    return names + list(kwargs)


def _rename_outputs(model: onnx.ModelProto) -> None:
    outs = [o.name for o in model.graph.output]
    names = ["output"] if len(outs) == 1 else [f"output_{i}" for i in range(len(outs))]
    taken = {x for n in model.graph.node for x in [*n.input, *n.output]} | {i.name for i in model.graph.input}
    mapping = {o: n for o, n in zip(outs, names) if o != n and n not in taken}
    for node in model.graph.node:
        node.output[:] = [mapping.get(x, x) for x in node.output]
        node.input[:] = [mapping.get(x, x) for x in node.input]
    for vi in [*model.graph.output, *model.graph.value_info]:
        vi.name = mapping.get(vi.name, vi.name)


def _finish(model: onnx.ModelProto) -> None:
    """IR version onnxruntime loads; com.microsoft imported only where a PythonOp is."""
    used = any(n.domain == MS_DOMAIN for n in model.graph.node)
    kept = [o for o in model.opset_import if o.domain != MS_DOMAIN]
    if used:
        kept.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    del model.opset_import[:]
    model.opset_import.extend(kept)
    model.ir_version = min(
        max(ir_version_for(model.opset_import), min(model.ir_version, MAX_IR_VERSION)), MAX_IR_VERSION
    )
    model.producer_name = "onnxgrad"
