"""``onnxgrad.export``: a torch module to ONNX, custom autograd Functions kept as PythonOp nodes.

``torch.onnx.export`` (both exporters) inlines a custom ``torch.autograd.Function``'s forward and
loses its backward. Here the TorchScript exporter runs with a symbolic for ``prim::PythonOp`` (the
node tracing records for each ``Function.apply``): the chosen Functions become ``com.microsoft``
PythonOp nodes carrying every attribute of the original schema, the others are inlined as usual,
and the rest of the module is standard ONNX. Non-tensor arguments are stored by value (see
:mod:`onnxgrad.model.pythonop_spec`); anything that cannot be is refused with :class:`PythonOpError`.

A kept Function's ``forward`` runs with the tracer paused (as ORTModule's exporter did): its body
never enters the trace, so bodies torch cannot trace (collectives, an ``OnnxModule``, captured
parameters) export, and in-place writes do not leak into the outer graph; a write without
``ctx.mark_dirty`` into a tensor the module reads again is refused. Reentrant
``torch.utils.checkpoint`` exports its body as standard ONNX. The node's outputs keep their traced
shapes in a static export, or the shapes the Function's ``infer_shape`` declares (ORTModule's
convention). Every failure inside a Function during the export is a :class:`PythonOpError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import threading
import types
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
from torch.autograd.function import _is_setup_context_defined

from ..deps import function_apply_wrapped
from ..errors import PythonOpError
from ..model.graph import MAX_IR_VERSION, ir_version_for
from ..model.pythonop_spec import MS_DOMAIN, PYTHON_OP, encode_constants
from ..pythonop.executor import TORCH_TO_ONNX
from ..pythonop.registry import qualified_name, register_function

_SYMBOLIC = "prim::PythonOp"  # a Function torch traced through (one not kept as PythonOp)
_CALL_ATTR = "onnxgrad_call"  # on the exported node until _shapes_kept reads it
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
    with _EXPORT_LOCK, warnings.catch_warnings(), state.hooks(), _no_ir_dump():
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
    _shapes_kept(model, state)
    if output_names is None:
        _rename_outputs(model)
    _finish(model)
    if register:
        for cls in state.exported.values():
            register_function(cls)
    return model


class _Call:
    """One kept ``Function.apply`` as its forward ran: what the PythonOp node needs beyond the trace."""

    def __init__(self, cls: type, args: Sequence[Any], outs: Sequence[Any], mutated: list[int]) -> None:
        self.cls = cls
        self.name = qualified_name(cls)
        self.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.inputs = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        self.outputs = [(o.dtype, tuple(int(d) for d in o.shape)) for o in outs]
        self.mutated = mutated  # tensor inputs written in place without ctx.mark_dirty


class _ExportState:
    """What one export records: the wrappers of ``Function.apply`` / ``forward`` and the symbolic of
    ``prim::PythonOp``."""

    def __init__(self, wanted: set[str] | None, training: bool, dynamic: bool) -> None:
        self.wanted = wanted
        self.training = training
        self.dynamic = dynamic  # dynamic axes: PythonOp outputs keep their rank, not the traced sizes
        self.exported: dict[str, type] = {}
        self.calls: list[_Call] = []
        self.error: Exception | None = None
        self._patched: dict[type, Any] = {}  # class -> its own forward, put back on exit

    def keeps(self, cls: type) -> bool:
        """Whether calls of ``cls`` become PythonOp nodes (the others are inlined)."""
        return self.wanted is None or qualified_name(cls) in self.wanted

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Wrap ``Function.apply`` and the ``forward`` of every Function class for the export.

        The ``forward`` wrappers work even where the module holds ``MyFunction.apply`` bound before
        the export; ``apply`` sees calls that look it up (and patches classes defined since).
        """
        for cls in _function_classes():
            self._patch(cls)
        try:
            with function_apply_wrapped(self.apply):
                yield
        finally:
            for cls, forward in self._patched.items():
                cls.forward = forward
            self._patched.clear()

    def _patch(self, cls: type) -> None:
        own = cls.__dict__.get("forward")
        function = own.__func__ if isinstance(own, staticmethod) else own
        if cls in self._patched or not isinstance(function, types.FunctionType):
            return
        self._patched[cls] = own

        @functools.wraps(function)  # the signature apply binds default arguments with
        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch._C._get_tracing_state() is None:
                return function(*args, **kwargs)
            try:
                return self.forward(cls, function, *args, **kwargs)
            except PythonOpError as exc:  # torch may wrap it on the way out: export raises this one
                self.error = self.error or exc
                raise

        cls.forward = staticmethod(forward)

    def apply(self, cls: type, call: Any, *args: Any, **kwargs: Any) -> Any:
        """``cls.apply(*args)`` during the export (calls that look ``apply`` up)."""
        if torch._C._get_tracing_state() is None:
            return call(*args, **kwargs)
        try:
            if cls is _checkpoint_function():
                # reentrant torch.utils.checkpoint: the checkpointed body, traced as plain ONNX
                # (its gradient is then onnxgrad's; recomputing gives the same one)
                run_function, _preserve_rng_state, *inputs = args
                return run_function(*inputs)
            for klass in cls.__mro__:
                if isinstance(klass, type) and issubclass(klass, torch.autograd.Function):
                    self._patch(klass)
            out = call(*args, **kwargs)
        except PythonOpError as exc:
            self.error = self.error or exc
            raise
        except Exception as exc:
            if self.keeps(cls):
                error = PythonOpError(
                    f"exporting a call of {qualified_name(cls)} failed: {type(exc).__name__}: {_brief(exc)}"
                )
            else:
                error = _inline_error(qualified_name(cls), exc)
            self.error = self.error or error
            raise error from exc
        _tensor_outputs(qualified_name(cls), out)
        return out

    def forward(self, owner: type, original: Any, *args: Any, **kwargs: Any) -> Any:
        """The ``forward`` of a Function class while torch traces the module.

        Called by ``apply`` while torch traces, after torch recorded the call as a ``prim::PythonOp``
        node: for a kept Function the body runs with the tracer paused, so nothing of it enters the
        trace (a body torch cannot trace, with collectives, an ``OnnxModule``, a checkpoint, exports;
        in-place writes do not leak into the outer graph). The PythonOp node calls the real forward
        at run time anyway.
        """
        tracing = torch._C._get_tracing_state()
        new_style = _is_setup_context_defined(owner.setup_context)
        ctx = None if new_style or not args else args[0]
        cls = getattr(type(ctx), "_forward_cls", owner) if ctx is not None else owner
        node = tracing.graph().insertPoint().prev()  # the prim::PythonOp of this call
        if node is None or node.kind() != _SYMBOLIC:  # forward called directly, not by apply
            return original(*args, **kwargs)
        if not self.keeps(cls):
            try:
                out = original(*args, **kwargs)
            except PythonOpError:
                raise
            except Exception as exc:
                raise _inline_error(qualified_name(cls), exc) from exc
            _tensor_outputs(qualified_name(cls), out)
            _check_inlinable(qualified_name(cls), node)
            return out
        name = qualified_name(cls)
        inputs = args if ctx is None else args[1:]
        tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
        torch._C._set_tracing_state(None)
        try:
            # what the forward writes into: the version counter, or the data (collectives do not
            # count their writes)
            versions = [t._version for t in tensors]
            before = [t.detach().clone() for t in tensors]
            try:
                out = original(*args, **kwargs)
            except PythonOpError:
                raise
            except Exception as exc:
                raise PythonOpError(
                    f"{name}.forward raised {type(exc).__name__} while onnxgrad.export ran it: {_brief(exc)}"
                ) from exc
            outs = _tensor_outputs(name, out)
            dirty = getattr(ctx, "dirty_tensors", None) or ()
            mutated = [
                k
                for k, t in enumerate(tensors)
                if not any(t is d for d in dirty)
                and (t._version != versions[k] or not _same(t.detach(), before[k]))
            ]
            call = _Call(cls, inputs, outs, mutated)  # reads sizes: not while tracing
        finally:
            torch._C._set_tracing_state(tracing)
        node.i_(_CALL_ATTR, len(self.calls))
        self.calls.append(call)
        # When apply returns, torch copies the nodes traced since the call into the node as its body
        # (unused here) and reads each new output's trace for that copy: one placeholder each, a
        # dead constant once torch points the output at the node.
        for o in outs:
            # an input returned as is (not dirty) keeps its trace: torch returns a view of it
            if any(o is d for d in dirty) or not any(o is t for t in tensors):
                torch._C._set_value_trace(o, tracing.graph().insertConstant(0))
        return out

    # ---- the symbolic: trace nodes -> ONNX nodes ------------------------------------------------
    def symbolic(self, g: Any, *args: Any, **attrs: Any) -> Any:
        """``prim::PythonOp``: a kept Function becomes a PythonOp node, the others are inlined."""
        try:
            node = g.original_node
            cls = getattr(node.pyobj(), "__self__", None)
            if not isinstance(cls, type) or not issubclass(cls, torch.autograd.Function):
                raise PythonOpError(
                    f"cannot export Python operator {node.pyname()!r}: not an autograd.Function"
                )
            if not self.keeps(cls):
                return _inline(g, node, args)
            call = attrs.get(_CALL_ATTR)
            rec = self.calls[call] if call is not None else None
            if rec is not None:
                _check_mutated(rec, node)
            self.exported[qualified_name(cls)] = cls
            return _python_op(g, node, cls, args, self.training, self.dynamic, call)
        except Exception as exc:
            self.error = self.error or exc
            raise


def _function_classes() -> list[type]:
    """Every ``torch.autograd.Function`` subclass defined so far."""
    seen: dict[type, None] = {}
    todo = [torch.autograd.Function]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen[sub] = None
                todo.append(sub)
    return list(seen)


def _check_inlinable(name: str, node: Any) -> None:
    """torch inlines a Function's traced body only when it reads nothing but the Function's
    arguments (otherwise it fails later with ``unordered_map::at``): say so, naming the Function."""
    known = {v.unique() for v in node.inputs()}

    def check(nodes: Iterable[Any]) -> None:
        for n in nodes:
            for v in n.inputs():
                if v.unique() not in known:
                    raise _inline_error(
                        name,
                        None,
                        "its forward reads a tensor it does not take as an argument (a parameter "
                        "or a captured tensor)",
                    )
            for block in n.blocks():
                known.update(v.unique() for v in block.inputs())
                check(block.nodes())
            known.update(o.unique() for o in n.outputs())

    body = list(node.owningBlock().nodes())
    check(body[next(i for i, n in enumerate(body) if n == node) + 1 :])


_IR_DUMP = "Torch IR graph at exception"  # torch appends the whole traced graph after it


@contextlib.contextmanager
def _no_ir_dump() -> Iterator[None]:
    """Keep torch's exporter from printing the traced graph to stdout when a step fails (its
    ``Torch IR graph at exception: graph(...)``, hundreds of lines on a real model: torch turns its
    ONNX log on for every export). Its log calls, by name through ``torch._C``, are dropped for the
    export's duration (under ``_EXPORT_LOCK``); the error raised says what failed (:func:`_brief`)."""
    original = getattr(torch._C, "_jit_onnx_log", None)
    if original is None:
        yield
        return
    torch._C._jit_onnx_log = lambda *args: None
    try:
        yield
    finally:
        torch._C._jit_onnx_log = original


_BRIEF = 2000  # characters of an exception's message kept in a PythonOpError


def _brief(exc: BaseException | None) -> str:
    """``exc``'s message for a :class:`PythonOpError`: without the traced graph torch appends
    (``Torch IR graph at exception: graph(...)``, hundreds of lines on a real model), and at most
    ``_BRIEF`` characters (the full exception stays chained as ``__cause__``)."""
    text = str(exc).split(_IR_DUMP, 1)[0].rstrip()
    if len(text) > _BRIEF:
        text = f"{text[:_BRIEF]} ... ({len(text) - _BRIEF} more characters in the chained exception)"
    return text


def _inline_error(name: str, exc: Exception | None, why: str | None = None) -> PythonOpError:
    why = why or f"torch failed to trace it ({type(exc).__name__}: {_brief(exc)})"
    return PythonOpError(
        f"{name} is not in functions=, so its forward would be inlined as standard ONNX, but {why}. "
        "Keep it as a PythonOp node: add it to functions= (or leave functions=None)"
    )


def _checkpoint_function() -> type | None:
    """``torch.utils.checkpoint.CheckpointFunction`` (reentrant checkpoint), when torch has it."""
    import torch.utils.checkpoint

    return getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal data, NaN equal to NaN (a NaN left in place is not a write)."""
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _tensor_outputs(name: str, out: Any) -> list[torch.Tensor]:
    """The outputs of a call as a list; a non-tensor (``return y, 7``) is a :class:`PythonOpError`
    naming the Function (torch would fail later with an INTERNAL ASSERT)."""
    outs = list(out) if isinstance(out, tuple | list) else [out]
    bad = [(i, v) for i, v in enumerate(outs) if not isinstance(v, torch.Tensor)]
    if bad:
        i, value = bad[0]
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        raise PythonOpError(
            f"{name}.forward returned output {i} of {len(outs)} as "
            f"{type(value).__name__} {shown}: a Function exported as a PythonOp node (or inlined) "
            "may return only tensors. Return it as a tensor (torch.tensor(...)), or keep the "
            "value out of the Function's outputs"
        )
    return outs


def _check_mutated(rec: _Call, node: Any) -> None:
    """A tensor the forward wrote into without ``ctx.mark_dirty`` must not be read after the call:
    the ONNX graph would read the value from before the write."""
    for k in rec.mutated:
        value = node.inputsAt(k)
        if any(u.user.isAfter(node) for u in value.uses()):
            raise PythonOpError(
                f"{rec.name}.forward writes into argument {rec.positions[k]} of apply() in place "
                "without ctx.mark_dirty, and the module reads that tensor again after the call: the "
                "exported graph cannot carry the write. Call ctx.mark_dirty on it and return it, or "
                "write into a copy (x = x.clone())"
            )


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


def _python_op(
    g: Any, node: Any, cls: type, args: Sequence[Any], training: bool, dynamic: bool, call: int | None
) -> Any:
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
    if call is not None:
        attrs[_CALL_ATTR] = call  # read back and removed by _shapes_kept
    suffix = {int: "i", float: "f", str: "s"}
    kw = {}
    for key, value in attrs.items():
        if isinstance(value, np.ndarray):  # the exact float64 values: a tensor attribute
            kw[f"{key}_t"] = torch.from_numpy(value)
        elif isinstance(value, list):
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


# ---- output shapes ------------------------------------------------------------------------------
def _shapes_kept(model: onnx.ModelProto, state: _ExportState) -> None:
    """Give each PythonOp output the shape its Function declares (``infer_shape``) or, in a static
    export, the traced one, where torch's shape inference left symbolic dims; downstream values that
    carry the same symbolic dims get the same sizes."""
    types = {v.name: v.type for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    for init in model.graph.initializer:
        types.setdefault(init.name, onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims)))
    if any(getattr(c.cls, "infer_shape", None) is not None for c in state.calls):
        # the shapes a rule reads: torch leaves intermediate values untyped
        inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
        for vi in inferred:
            types.setdefault(vi.name, vi.type)
    renames: dict[str, Any] = {}
    conflicts: set[str] = set()
    wanted: dict[str, tuple[list[int | str | None], int]] = {}
    for node in model.graph.node:
        if node.domain != MS_DOMAIN or node.op_type != PYTHON_OP:
            continue
        keep = [a for a in node.attribute if a.name != _CALL_ATTR]
        marks = [a.i for a in node.attribute if a.name == _CALL_ATTR]
        del node.attribute[:]
        node.attribute.extend(keep)
        if not marks:
            continue
        rec = state.calls[marks[0]]
        shapes = _declared_shapes(node, rec, types)
        if shapes is None:
            if state.dynamic:
                continue
            shapes = [list(shape) for _, shape in rec.outputs]
        for name, shape, (dtype, _) in zip(node.output[1:], shapes, rec.outputs):
            wanted[name] = (shape, TORCH_TO_ONNX[dtype])
            current = types.get(name)
            # a later PythonOp reading this output sees the shape given here
            types[name] = onnx.helper.make_tensor_type_proto(TORCH_TO_ONNX[dtype], shape)
            if current is None or not current.tensor_type.HasField("shape"):
                continue
            for dim, want in zip(current.tensor_type.shape.dim, shape):
                if not dim.HasField("dim_param") or want is None or want == dim.dim_param:
                    continue
                if renames.setdefault(dim.dim_param, want) != want:
                    conflicts.add(dim.dim_param)
    for key in conflicts:
        del renames[key]
    declared = {v.name for v in [*model.graph.value_info, *model.graph.output]}
    for name, (shape, elem_type) in wanted.items():
        if name not in declared:
            model.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))
    for vi in [*model.graph.value_info, *model.graph.output]:
        if not vi.type.tensor_type.HasField("shape"):
            continue
        for dim in vi.type.tensor_type.shape.dim:
            want = renames.get(dim.dim_param) if dim.HasField("dim_param") else None
            if isinstance(want, int):
                dim.Clear()
                dim.dim_value = want
            elif isinstance(want, str):
                dim.dim_param = want


def _declared_shapes(
    node: onnx.NodeProto, rec: _Call, types: Mapping[str, onnx.TypeProto]
) -> list[list[int | str | None]] | None:
    """The output shapes ``rec.cls.infer_shape(node, input shapes, input dtypes)`` declares (the
    ORTModule convention), checked against the traced call; ``None`` when the class has no rule."""
    rule = getattr(rec.cls, "infer_shape", None)
    if rule is None:
        return None
    in_shapes: list[list[int | str | None] | None] = []
    in_types: list[int] = []
    for name, dtype in zip(node.input, rec.inputs):
        t = types.get(name)
        shape = None
        if t is not None and t.tensor_type.HasField("shape"):
            shape = [
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in t.tensor_type.shape.dim
            ]
        in_shapes.append(shape)
        in_types.append(TORCH_TO_ONNX[dtype])
    where = f"{rec.name}.infer_shape"
    try:
        result = rule(node, in_shapes, in_types)
        shapes, dtypes = result
        shapes, dtypes = list(shapes), [int(d) for d in dtypes]
    except Exception as exc:
        raise PythonOpError(
            f"{where} failed ({type(exc).__name__}: {_brief(exc)}); it must return (output shapes, output "
            "dtypes), one of each per tensor output"
        ) from exc
    n = len(rec.outputs)
    if len(shapes) != n or len(dtypes) != n:
        raise PythonOpError(
            f"{where} returned {len(shapes)} shape(s) and {len(dtypes)} dtype(s) for {n} tensor output(s)"
        )
    checked: list[list[int | str | None]] = []
    for i, (shape, dtype, (t_dtype, t_shape)) in enumerate(zip(shapes, dtypes, rec.outputs)):
        if dtype != TORCH_TO_ONNX[t_dtype]:
            raise PythonOpError(
                f"{where} declares output {i} as {onnx.helper.tensor_dtype_to_string(dtype)}, the traced "
                f"call returned {t_dtype}"
            )
        if shape is None:
            checked.append([None] * len(t_shape))
            continue
        shape = [d if isinstance(d, str) or d is None else int(d) for d in shape]
        traced = list(t_shape)
        if len(shape) != len(traced) or any(isinstance(d, int) and d != t for d, t in zip(shape, traced)):
            raise PythonOpError(
                f"{where} declares output {i} with shape {shape}, the traced call returned shape {traced}"
            )
        checked.append(shape)
    return checked


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
