"""Graphs with PythonOp / PythonOpGrad nodes on stock onnxruntime: partitioned around the Python nodes.

A graph is cut into onnxruntime sub-sessions and Python calls between them. Each node gets a *level*:
the largest number of Python nodes on a path from the graph inputs to it, itself included. The run
is: onnxruntime stage 0, the Python nodes of level 1, onnxruntime stage 1, the Python nodes of level
2, ... so independent Python nodes share one cut and plain ONNX nodes run as few sessions as the
dependencies allow. Tensors cross as ``OrtValue`` <-> ``torch.Tensor`` through DLPack, without
copies; onnxruntime never reuses the buffer of a value it handed out, so PyTorch may keep it.

Measured against onnxruntime-extensions' Python custom ops (see docs/performance.md, "PythonOp
overhead"): those copy every tensor element by element (about 50-70 ns per element, 3 ms for 64k
floats), fix one type signature per op type for the whole process, and turn Python exceptions into
strings; the partition costs one extra session call per level, shares buffers and re-raises the
Function's own exceptions.

Safety of shared buffers: on its first call a node runs on copies of its inputs, and records which
inputs the Function modifies in place (``mark_dirty`` or not) and which values fed by the caller
(inputs, parameters) it saves; later calls copy exactly those, so a Function never writes into a
buffer that onnxruntime or the caller still reads, and never keeps a caller's buffer that may change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ..autodiff.engine import GradientGraphs
from ..deps import ortvalue_from_capsule
from ..errors import OnnxGradRuntimeError, PythonOpError
from ..model.graph import all_subgraphs, node_operands, topological_order
from ..model.pythonop_spec import (
    PYTHON_OP,
    check_tensor,
    describe,
    is_python_node,
    parse_backward,
    parse_forward,
)
from ..runtime.runner import BaseRunner, make_session
from ..runtime.values import C, OrtValueLike, contiguous, from_numpy, from_torch, run, to_torch, unwrap
from .registry import Functions, contexts, resolve_function


# ---- tensors across the boundary --------------------------------------------------------------
def to_ort(t: torch.Tensor) -> C.OrtValue:
    """An OrtValue sharing ``t``'s buffer through DLPack, which keeps ``t`` alive as long as needed
    (a copy only for a strided view); :mod:`onnxgrad.deps` picks how bool crosses."""
    return from_torch(t.detach())


TORCH_TO_ONNX = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
    torch.complex64: TensorProto.COMPLEX64,
    torch.complex128: TensorProto.COMPLEX128,
}


def onnx_type_of(t: torch.Tensor) -> int:
    """The ONNX element type of a torch tensor (0 when ONNX has none)."""
    return TORCH_TO_ONNX.get(t.dtype, TensorProto.UNDEFINED)


# ---- Python nodes -------------------------------------------------------------------------------
@dataclass
class _Context:
    """What a PythonOpGrad needs of one forward call."""

    func_name: str
    leaves: list[torch.Tensor | None]  # per tensor input: the leaf that requires grad, or None
    shapes: list[tuple[torch.Size, torch.dtype]]  # per tensor input, for zero gradients
    outputs: list[Any]  # per tensor output: its autograd edge, or None (not differentiable)


def _call(where: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except PythonOpError:
        raise
    except Exception as exc:
        raise PythonOpError(f"{where}: {what} raised {type(exc).__name__}: {exc}") from exc


class _ThrowAwayCtx:
    """The ctx of a direct ``forward`` call (``safe_run_mode=0`` in inference): bookkeeping is a no-op."""

    saved_tensors = ()

    def __init__(self, n_args: int) -> None:
        self.needs_input_grad = (False,) * n_args

    def save_for_backward(self, *tensors: Any) -> None:
        pass

    mark_dirty = mark_non_differentiable = save_for_forward = save_for_backward

    def set_materialize_grads(self, value: bool) -> None:
        pass


_NO_HANDLE: list[C.OrtValue] = []


def _no_handle() -> C.OrtValue:
    """The ctx output of a call that keeps nothing (handle 0), shared: nobody writes to it."""
    if not _NO_HANDLE:
        _NO_HANDLE.append(ortvalue_from_capsule(np.zeros((), np.int64).__dlpack__()))
    return _NO_HANDLE[0]


class PythonOpKernel:
    """Runs one PythonOp node: ``Function.apply`` on the node's tensors and constants."""

    def __init__(self, node: onnx.NodeProto, cls: type, caller_owned: Sequence[bool]) -> None:
        self.node, self.cls = node, cls
        self.spec = parse_forward(node)
        self.where = f"{describe(node)} ({self.spec.func_name})"
        self.caller_owned = list(caller_owned)
        self.n_outputs = len(node.output) - 1
        # (position, label, dtype, rank) of each input the node records a dtype or rank for
        self.checks = _checks(node.input, self.spec.input_types, self.spec.input_ranks, 0)
        # Learned on the first call (of any kind / in training): inputs to copy before the call.
        self._dirty: set[int] | None = None
        self._saved: set[int] | None = None

    def __call__(self, inputs: Sequence[C.OrtValue], training: bool) -> list[C.OrtValue]:
        spec = self.spec
        keep = training and spec.training_mode
        data = [to_torch(ov) for ov in inputs]
        for i, label, want_type, want_rank in self.checks:
            t = data[i]
            check_tensor(self.where, label, want_type, want_rank, onnx_type_of(t), t.dim())
        copy = self._copy_set(len(data), keep)
        with torch.enable_grad() if keep else torch.no_grad():
            leaves: list[torch.Tensor | None] = []
            args = []
            for i, t in enumerate(data):
                leaf = None
                if keep and spec.requires_grad[i] and (t.is_floating_point() or t.is_complex()):
                    leaf = t.detach().requires_grad_()
                    t = leaf
                leaves.append(leaf)
                args.append(t.clone() if i in copy else t)  # type: ignore[operator]
            versions = [a._version for a in args]
            call = self.cls.apply
            if not keep and not spec.safe_run_mode:  # the original's fast path: no autograd node
                call = partial(self.cls.forward, _ThrowAwayCtx(len(spec.convention)))
            outs = _call(self.where, f"{spec.func_name}.forward", call, *spec.arguments(args))
        outs = self._check_outputs(outs)
        self._learn(args, versions, outs, keep)
        handle_value = _no_handle()
        if keep:
            edges = [
                torch.autograd.graph.get_gradient_edge(o) if o.requires_grad and flag else None
                for o, flag in zip(outs, spec.output_requires_grad)
            ]
            if any(e is not None for e in edges) and any(x is not None for x in leaves):
                shapes = [(t.shape, t.dtype) for t in data]
                handle = contexts.add(_Context(spec.func_name, leaves, shapes, edges))
                # DLPack keeps the holder alive exactly as long as some OrtValue or tensor holds it
                handle_value = ortvalue_from_capsule(contexts.handle_value(handle).__dlpack__())
        return [handle_value, *[to_ort(o) for o in outs]]

    def _check_outputs(self, outs: Any) -> list[torch.Tensor]:
        outs = list(outs) if isinstance(outs, tuple | list) else [outs]
        expected = self.n_outputs
        if len(outs) != expected or not all(isinstance(o, torch.Tensor) for o in outs):
            kinds = [type(o).__name__ for o in outs]
            raise PythonOpError(
                f"{self.where}: forward returned {len(outs)} value(s) {kinds}, the node expects "
                f"{expected} tensor(s)"
            )
        for i, (o, t) in enumerate(zip(outs, self.spec.output_types)):
            if t and onnx_type_of(o) != t:
                raise PythonOpError(
                    f"{self.where}: output {i} has dtype {o.dtype}, the node records "
                    f"{helper.tensor_dtype_to_string(t)}"
                )
        for i, (o, r) in enumerate(zip(outs, self.spec.output_ranks)):
            if r >= 0 and o.dim() != r:
                raise PythonOpError(
                    f"{self.where}: output {i} has rank {o.dim()} (shape {tuple(o.shape)}), the node "
                    f"records rank {r} (output_tensor_ranks)"
                )
        return outs

    def _copy_set(self, n: int, keep: bool) -> set[int]:
        copy = set(range(n)) if self._dirty is None else set(self._dirty)
        if keep:
            owned = {i for i in range(n) if self.caller_owned[i]}
            copy |= owned if self._saved is None else self._saved
        return copy

    def _learn(
        self, args: list[torch.Tensor], versions: list[int], outs: list[torch.Tensor], keep: bool
    ) -> None:
        """Record the inputs written in place, and (training) the caller's buffers the ctx saved."""
        if self._dirty is None:
            self._dirty = {i for i, (a, v) in enumerate(zip(args, versions)) if a._version != v}
        if keep and self._saved is None:
            node = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
            try:
                ptrs = {t.data_ptr() for t in getattr(node, "saved_tensors", ()) if t.numel()}
            except RuntimeError:  # nothing saved, or already released
                ptrs = set()
            self._saved = {
                i for i, a in enumerate(args) if self.caller_owned[i] and a.numel() and a.data_ptr() in ptrs
            }


class PythonOpGradKernel:
    """Runs one PythonOpGrad node: the backward of the forward call its ctx handle names."""

    def __init__(self, node: onnx.NodeProto, cls: type) -> None:
        self.node, self.cls = node, cls
        self.spec = parse_backward(node)
        self.where = f"{describe(node)} ({self.spec.func_name})"
        self.output_names = list(node.output)
        # the incoming gradients (inputs 1..N) the node records a dtype or rank for
        self.checks = _checks(node.input[1:], self.spec.input_types, self.spec.input_ranks, 1)

    def __call__(self, inputs: Sequence[C.OrtValue | None], training: bool) -> list[C.OrtValue]:
        handle = int(inputs[0].numpy())  # type: ignore[union-attr]  # a 0-d int64
        ctx: _Context = contexts.get(handle, self.where)
        try:
            grads = [to_torch(g) if g is not None else None for g in inputs[1 : 1 + len(ctx.outputs)]]
            for i, label, want_type, want_rank in self.checks:  # i: position in ``inputs``
                g = grads[i - 1] if i - 1 < len(grads) else None
                if g is not None:
                    check_tensor(self.where, label, want_type, want_rank, onnx_type_of(g), g.dim())
            # the older layout appends the forward outputs: only the first N are gradients
            pairs = [(e, g) for e, g in zip(ctx.outputs, grads) if e is not None and g is not None]
            wrt = [(i, leaf) for i, leaf in enumerate(ctx.leaves) if leaf is not None]
            found: dict[int, torch.Tensor | None] = {}
            if pairs and wrt:
                res = _call(
                    self.where,
                    f"{self.spec.func_name}.backward",
                    torch.autograd.grad,
                    [e for e, _ in pairs],
                    [leaf for _, leaf in wrt],
                    [g for _, g in pairs],
                    allow_unused=True,  # backward may return None: a zero gradient
                )
                found = {i: r for (i, _), r in zip(wrt, res)}
        finally:
            contexts.release(handle)
        outs = []
        for i, name in enumerate(self.output_names):
            if not name:
                outs.append(None)
                continue
            g = found.get(i)
            if g is None:
                shape, dtype = ctx.shapes[i]
                g = torch.zeros(shape, dtype=dtype)
            outs.append(to_ort(g))
        return outs


def _checks(
    names: Sequence[str], types: Sequence[int], ranks: Sequence[int], offset: int
) -> list[tuple[int, str, int, int]]:
    """``(position, label, dtype, rank)`` for each named input that has a recorded dtype or rank."""
    out = []
    for k, name in enumerate(names):
        want_type = types[k] if k < len(types) else 0
        want_rank = ranks[k] if k < len(ranks) else -1
        if name and (want_type or want_rank >= 0):
            out.append((k + offset, f"input {k + offset} ({name!r})", want_type, want_rank))
    return out


# ---- the partitioned graph --------------------------------------------------------------------
@dataclass
class _Stage:
    """Plain ONNX nodes run as one onnxruntime session (made on first use, typed by the values fed)."""

    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    inits: list[onnx.TensorProto]
    session: ort.InferenceSession | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _PyStep:
    node: onnx.NodeProto
    kernel: Any
    # Names copied out of the protobuf once: reading a NodeProto's fields costs microseconds.
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.inputs, self.outputs = list(self.node.input), list(self.node.output)


class PythonGraph:
    """One ONNX graph holding PythonOp/PythonOpGrad nodes, run as onnxruntime stages and Python calls.

    ``functions`` / ``allow_import``: see :func:`~onnxgrad.pythonop.registry.resolve_function`; every
    class is resolved here, so a model naming an unknown class fails before anything runs.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        providers: list[Any],
        session_options: ort.SessionOptions | None = None,
        *,
        functions: Functions = None,
        allow_import: bool | Iterable[str] = False,
    ) -> None:
        self.model = model
        self.providers, self.options = providers, session_options
        for sub in all_subgraphs(model.graph):
            bad = next((n for n in sub.node if is_python_node(n)), None)
            if bad is not None:
                raise PythonOpError(
                    f"{describe(bad)} sits inside an If/Loop/Scan body, which is not supported"
                )
        self.nodes = topological_order(model.graph)
        self.inits = {i.name: i for i in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input]
        caller = set(self.input_names) | set(self.inits)
        self.kernels: dict[int, Any] = {}
        for node in self.nodes:
            if is_python_node(node):
                where = describe(node)
                spec = parse_forward(node) if node.op_type == PYTHON_OP else parse_backward(node)
                cls = resolve_function(spec.func_name, functions, allow_import, where)
                if node.op_type == PYTHON_OP:
                    kernel: Any = PythonOpKernel(node, cls, [x in caller for x in node.input])
                else:
                    kernel = PythonOpGradKernel(node, cls)
                self.kernels[id(node)] = kernel
        # Initializers read by Python nodes: the arrays are kept, the OrtValues only borrow them.
        self._const_values: dict[str, tuple[np.ndarray, C.OrtValue]] = {}
        self._plans: dict[tuple, list[Any]] = {}
        self._lock = threading.Lock()

    def run(
        self, values: Mapping[str, OrtValueLike], wanted: Sequence[str], training: bool
    ) -> dict[str, C.OrtValue]:
        """Compute ``wanted`` from ``values``; returns name -> OrtValue for each of them."""
        key = (tuple(wanted), frozenset(values))
        plan = self._plans.get(key)
        if plan is None:
            with self._lock:
                plan = self._plans.setdefault(key, self._plan(wanted, set(values)))
        env: dict[str, C.OrtValue] = {k: unwrap(v) for k, v in values.items()}
        for step in plan:
            if isinstance(step, _Stage):
                self._run_stage(step, env)
            else:
                ins = [self._value(env, x) if x else None for x in step.inputs]
                for name, ov in zip(step.outputs, step.kernel(ins, training)):
                    if name:
                        env[name] = ov
        try:
            return {w: env[w] for w in wanted}
        except KeyError as exc:
            raise OnnxGradRuntimeError(
                f"the graph {self.model.graph.name!r} does not compute {exc}"
            ) from None

    # ---- planning ----------------------------------------------------------------------------
    def _plan(self, wanted: Sequence[str], fed: set[str]) -> list[Any]:
        needed = set(wanted)
        used = []
        for node in reversed(self.nodes):
            if any(o in needed for o in node.output if o):
                used.append(node)
                needed.update(x for x in node_operands(node) if x)
        used.reverse()
        level: dict[str, int] = {}
        by_level: dict[int, list[onnx.NodeProto]] = {}
        for node in used:
            lv = max((level.get(x, 0) for x in node_operands(node) if x), default=0)
            lv += int(is_python_node(node))
            for o in node.output:
                level[o] = lv
            by_level.setdefault(lv, []).append(node)
        steps: list[Any] = []
        for lv in sorted(by_level):
            nodes = by_level[lv]
            steps += [_PyStep(n, self.kernels[id(n)]) for n in nodes if is_python_node(n)]
            plain = [n for n in nodes if not is_python_node(n)]
            if plain:
                steps.append(plain)
        # Each stage outputs what a later step or the caller reads.
        later: set[str] = set(wanted)
        for i in range(len(steps) - 1, -1, -1):
            step = steps[i]
            nodes = step if isinstance(step, list) else [step.node]
            if isinstance(step, list):
                steps[i] = self._stage(step, fed, later)
            for n in nodes:
                later.update(x for x in node_operands(n) if x)
        return steps

    def _stage(self, nodes: list[onnx.NodeProto], fed: set[str], later: set[str]) -> _Stage:
        produced = {o for n in nodes for o in n.output if o}
        inputs, inits = [], []
        for x in dict.fromkeys(x for n in nodes for x in node_operands(n) if x):
            if x in produced:
                continue
            if x in self.inits and x not in fed:
                inits.append(self.inits[x])
            else:
                inputs.append(x)
        outputs = [o for n in nodes for o in n.output if o and o in later]
        return _Stage(nodes, inputs, outputs, inits)

    # ---- running -----------------------------------------------------------------------------
    def _value(self, env: dict[str, C.OrtValue], name: str) -> C.OrtValue:
        ov = env.get(name)
        if ov is not None:
            return ov
        const = self._const_values.get(name)
        if const is None:
            if name not in self.inits:
                raise OnnxGradRuntimeError(f"value {name!r} is neither fed nor computed")
            arr = contiguous(onnx.numpy_helper.to_array(self.inits[name]))
            const = self._const_values.setdefault(name, (arr, from_numpy(arr)))
        return const[1]

    def _run_stage(self, stage: _Stage, env: dict[str, C.OrtValue]) -> None:
        if stage.session is None:
            with stage.lock:
                if stage.session is None:
                    stage.session = self._session(stage, env)
        feeds = {name: self._value(env, name) for name in stage.inputs}
        try:
            results = run(stage.session, feeds, stage.outputs)
        except Exception as exc:
            raise OnnxGradRuntimeError(
                f"onnxruntime failed on the graph {self.model.graph.name!r} "
                f"(nodes {stage.nodes[0].name or stage.nodes[0].op_type}...): {exc}"
            ) from exc
        env.update(zip(stage.outputs, results))

    def _session(self, stage: _Stage, env: dict[str, C.OrtValue]) -> ort.InferenceSession:
        # Typed by the values fed, shapes left open: the parts see exactly what the whole would.
        inputs = [
            helper.make_tensor_value_info(name, self._value(env, name).element_type(), None)
            for name in stage.inputs
        ]
        outputs = [onnx.ValueInfoProto(name=o) for o in stage.outputs]
        graph = helper.make_graph(stage.nodes, self.model.graph.name or "stage", inputs, outputs, stage.inits)
        model = helper.make_model(
            graph, opset_imports=list(self.model.opset_import), functions=list(self.model.functions)
        )
        model.ir_version = self.model.ir_version
        label = f"a part of the graph {self.model.graph.name!r}"
        return make_session(model, self.providers, self.options, label=label)


# ---- the Runner interface ---------------------------------------------------------------------
class PythonOpRunner(BaseRunner):
    """The :class:`~onnxgrad.runtime.runner.BaseRunner` of graphs with Python nodes: each graph runs
    as a :class:`PythonGraph` (onnxruntime stages and Python calls)."""

    def __init__(
        self,
        graphs: GradientGraphs,
        providers: list[Any],
        session_options: ort.SessionOptions | None = None,
        *,
        functions: Functions = None,
        allow_import: bool | Iterable[str] = False,
    ) -> None:
        forward = self._setup(graphs)
        kw = {"functions": functions, "allow_import": allow_import}
        self.fwd = PythonGraph(forward, providers, session_options, **kw)
        self.bwd = PythonGraph(graphs.backward, providers, session_options, **kw)

    def _run_forward(
        self, values: Mapping[str, OrtValueLike], wanted: list[str], training: bool
    ) -> Mapping[str, C.OrtValue]:
        return self.fwd.run(values, wanted, training)

    def _run_backward(self, feeds: Mapping[str, OrtValueLike], wanted: list[str]) -> Mapping[str, C.OrtValue]:
        return self.bwd.run(feeds, wanted, True)


def run_model(
    model: onnx.ModelProto,
    feeds: Mapping[str, Any],
    *,
    training: bool = True,
    providers: Sequence[Any] | None = None,
    functions: Functions = None,
    allow_import: bool | Iterable[str] = False,
) -> list[np.ndarray]:
    """Run a whole model holding Python nodes (e.g. a file of the original exporter where forward
    and backward share one graph) on numpy arrays; returns its outputs."""
    graph = PythonGraph(
        model, list(providers or ["CPUExecutionProvider"]), functions=functions, allow_import=allow_import
    )
    arrays = {k: contiguous(v) for k, v in feeds.items()}  # kept alive while running
    wanted = [o.name for o in model.graph.output]
    env = graph.run({k: from_numpy(a) for k, a in arrays.items()}, wanted, training)
    return [np.array(env[o].numpy(), copy=True) for o in wanted]
