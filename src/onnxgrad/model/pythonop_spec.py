"""The attributes of ``com.microsoft`` PythonOp / PythonOpGrad nodes, read and written.

A PythonOp stands for one call ``Function.apply(*args)``. ``input_convention`` has one character per
argument: ``d`` for a tensor (an ONNX input, in order) and ``c`` for a constant, kept in typed side
tables whose ``*_positions`` are indices into the full argument list:

* ``input_{int,float,bool}_scalars`` (+ ``_positions``); floats are stored as float32 (``FLOATS``),
  so onnxgrad writes the exact Python floats beside them, as a float64 tensor attribute in the same
  order: ``input_float_scalars_exact`` (and ``input_float_tuples_exact`` for the tuples), which it
  reads instead (``1/3`` stays ``1/3``, ``1e-50`` and ``1e40`` stay themselves, where the float32
  table holds 0.33333334, 0 and inf). A file without them (a foreign exporter's) gives the float32
  values, widened, and a :class:`UserWarning` names the arguments whose float32 value is not the
  shortest decimal it prints as (``0.1``, ``1/3``, ``1e-5``: most likely rounded from what the
  exporting code passed; ``0.5`` or ``2.0`` are exact and say nothing);
* ``input_{int,float,bool}_tuples``: every tuple of one element type concatenated, with
  ``_tuple_begins[i]`` where tuple ``i`` starts and ``_tuple_positions[i]`` its argument index;
* onnxgrad's additions, because a file must not hold raw memory addresses: ``input_none_positions``
  (arguments that are ``None``) and ``input_string_scalars`` + ``input_string_scalar_positions``
  (``str`` arguments, stored by value). The original ``input_pointer_scalars`` (a CPython address,
  valid only in the exporting process) is refused when read.

Both spellings found in real files are read: ``func_name``/``name``,
``input_convention``/``call_convention``, ``input_requires_grads``/``input_tensor_requires_grads``.
Both schema generations of the original mark ``name`` required, so onnxgrad writes it (the class's
``__qualname__``, as the original did) next to ``func_name`` (``module.QualName``, which takes
precedence when both are present); :func:`complete_class_names` adds ``name`` to nodes of files that
only have ``func_name`` (earlier onnxgrad exports, newer ORT exporters) so that they pass the checker.

``input_tensor_types`` / ``input_tensor_ranks`` are checked against the tensors a node receives
when it runs (a dtype of 0 or a rank of -1 means "not recorded"). The old ``inplace`` flag is
refused when set: onnxgrad never lets a Function's output reuse an input buffer the runtime owns
(a Function writing in place is run on a copy, see :mod:`onnxgrad.pythonop.executor`).
This module does not import torch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import PythonOpError

MS_DOMAIN = "com.microsoft"
PYTHON_OP = "PythonOp"
PYTHON_OP_GRAD = "PythonOpGrad"

_FLOAT_TYPES = {TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE}
_SCALAR_KINDS = ("int", "float", "bool")


def is_python_node(node: onnx.NodeProto) -> bool:
    """True for a com.microsoft PythonOp or PythonOpGrad node."""
    return node.domain == MS_DOMAIN and node.op_type in (PYTHON_OP, PYTHON_OP_GRAD)


def has_python_nodes(*models: onnx.ModelProto) -> bool:
    """True when any of ``models`` has a PythonOp or PythonOpGrad node in its main graph."""
    return any(is_python_node(n) for m in models for n in m.graph.node)


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as Python values (strings decoded)."""
    out: dict[str, Any] = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        out[attr.name] = value
    return out


def describe(node: onnx.NodeProto) -> str:
    """``PythonOp node 'name'`` for messages."""
    return f"{node.op_type} node {node.name or '<unnamed>'!r}"


def _first(attrs: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in attrs:
            return attrs[n]
    return default


def class_name(node: onnx.NodeProto) -> str:
    """The Function class a PythonOp/PythonOpGrad node names (``func_name``, or ``name`` in older
    files; ``func_name`` wins when both are set), or ``""`` when it names none."""
    for key in ("func_name", "name"):
        for attr in node.attribute:
            if attr.name == key and attr.s:
                return attr.s.decode("utf-8", "replace")
    return ""


def function_name(node: onnx.NodeProto) -> str:
    """:func:`class_name`, or :class:`PythonOpError` when the node names no class."""
    name = class_name(node)
    if not name:
        raise PythonOpError(f"{describe(node)} names no function: it has neither 'func_name' nor 'name'")
    return name


def complete_class_names(graph: onnx.GraphProto) -> int:
    """Add ``name`` (= ``func_name``) to the PythonOp/PythonOpGrad nodes of ``graph`` that lack it.

    Both schema generations of the original mark ``name`` required, and the schema registered by
    :mod:`.schemas` says so too; files written by onnxgrad before it wrote ``name``, and by newer ORT
    exporters, only have ``func_name``. onnxgrad's own loaders call this on their copy of a model
    before the ONNX checker sees it. Returns the number of nodes changed.
    """
    changed = 0
    for node in graph.node:
        if not is_python_node(node) or any(a.name == "name" for a in node.attribute):
            continue
        func = next((a.s for a in node.attribute if a.name == "func_name" and a.s), None)
        if func is not None:
            node.attribute.append(helper.make_attribute("name", func.decode()))
            changed += 1
    return changed


def _check_inplace(attrs: dict[str, Any], where: str) -> None:
    if attrs.get("inplace", 0):
        raise PythonOpError(
            f"{where} sets inplace={attrs['inplace']}, which onnxgrad does not support: its outputs "
            "would reuse input buffers that onnxruntime or the caller still owns. Set inplace to 0 "
            "(or remove it): a Function that writes into its inputs still runs, on a copy"
        )


def _typed(attrs: dict[str, Any], n: int, where: str, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``{what}_tensor_types`` / ``_ranks`` (empty when not recorded), checked against ``n`` tensors."""
    types = tuple(int(t) for t in attrs.get(f"{what}_tensor_types", ()))
    ranks = tuple(int(r) for r in attrs.get(f"{what}_tensor_ranks", ()))
    for key, values in ((f"{what}_tensor_types", types), (f"{what}_tensor_ranks", ranks)):
        if values and len(values) != n:
            raise PythonOpError(f"{where}: {key} has {len(values)} entries for {n} tensor(s)")
    return types, ranks


def check_tensor(where: str, label: str, want_type: int, want_rank: int, dtype: int, rank: int) -> None:
    """Raise :class:`PythonOpError` when a tensor's ONNX dtype or rank differs from the node's record
    (``input_tensor_types`` / ``input_tensor_ranks``; 0 and -1 mean "not recorded")."""
    if want_type and dtype != want_type:
        raise PythonOpError(
            f"{where}: {label} is {_type_name(dtype)} of rank {rank}, the node declares "
            f"{_type_name(want_type)} (input_tensor_types)"
        )
    if want_rank >= 0 and rank != want_rank:
        raise PythonOpError(
            f"{where}: {label} has rank {rank}, the node declares rank {want_rank} (input_tensor_ranks)"
        )


def _type_name(dtype: int) -> str:
    try:
        return helper.tensor_dtype_to_string(dtype).removeprefix("TensorProto.")
    except (KeyError, ValueError):
        return f"type {dtype}"


def _flags(values: Sequence[int] | None, count: int, default: Sequence[bool]) -> tuple[bool, ...]:
    if values is None:
        return tuple(default)
    flags = [bool(v) for v in values][:count]
    return tuple(flags + list(default[len(flags) :]))


@dataclass(frozen=True)
class ForwardSpec:
    """What a PythonOp node asks for: ``func_name.apply(*arguments)``."""

    func_name: str
    convention: str  # one 'd' (tensor) or 'c' (constant) per apply argument
    constants: dict[int, Any]  # argument position -> value
    input_types: tuple[int, ...]  # ONNX dtype of each tensor argument (empty when not recorded)
    input_ranks: tuple[int, ...]  # rank of each tensor argument (empty when not recorded)
    requires_grad: tuple[bool, ...]  # per tensor argument
    output_types: tuple[int, ...]  # per tensor output (ctx excluded)
    output_ranks: tuple[int, ...]
    output_requires_grad: tuple[bool, ...]
    training_mode: bool
    safe_run_mode: bool

    def arguments(self, tensors: Sequence[Any]) -> list[Any]:
        """The ``apply`` arguments: ``tensors`` at the ``d`` positions, constants elsewhere."""
        it = iter(tensors)
        return [next(it) if c == "d" else self.constants[i] for i, c in enumerate(self.convention)]


def parse_forward(node: onnx.NodeProto) -> ForwardSpec:
    """Read and validate a PythonOp node's attributes (either spelling)."""
    attrs = node_attributes(node)
    where = describe(node)
    func = function_name(node)
    convention = _first(attrs, "input_convention", "call_convention")
    if convention is None:
        raise PythonOpError(f"{where} ({func}) has no 'input_convention' (or 'call_convention')")
    if set(convention) - {"c", "d"}:
        raise PythonOpError(f"{where} ({func}): input_convention {convention!r} may hold only 'c' and 'd'")
    n_in = convention.count("d")
    if n_in != len(node.input):
        raise PythonOpError(
            f"{where} ({func}): input_convention {convention!r} has {n_in} tensor argument(s) "
            f"but the node has {len(node.input)} input(s)"
        )
    _check_inplace(attrs, f"{where} ({func})")
    constants = decode_constants(attrs, where, func)
    for pos, c in enumerate(convention):
        if c == "c" and pos not in constants:
            raise PythonOpError(f"{where} ({func}): constant argument {pos} has no value in the attributes")
        if c == "d" and pos in constants:
            raise PythonOpError(f"{where} ({func}): argument {pos} is a tensor but also has a constant value")
    extra = [p for p in constants if p >= len(convention)]
    if extra:
        raise PythonOpError(f"{where} ({func}): constants at positions {extra} beyond input_convention")
    in_types, in_ranks = _typed(attrs, n_in, f"{where} ({func})", "input")
    float_in = [t in _FLOAT_TYPES for t in in_types] if len(in_types) == n_in else [True] * n_in
    req = _first(attrs, "input_requires_grads", "input_tensor_requires_grads")
    if req is not None and len(req) == len(convention) and len(req) != n_in:
        req = [r for r, c in zip(req, convention) if c == "d"]  # one flag per argument
    n_out = max(len(node.output) - 1, 0)
    out_types = tuple(attrs.get("output_tensor_types", ()))
    float_out = [t in _FLOAT_TYPES for t in out_types] if len(out_types) == n_out else [True] * n_out
    return ForwardSpec(
        func_name=func,
        convention=convention,
        constants=constants,
        input_types=in_types,
        input_ranks=in_ranks,
        requires_grad=_flags(req, n_in, float_in),
        output_types=out_types,
        output_ranks=tuple(attrs.get("output_tensor_ranks", ())),
        output_requires_grad=_flags(attrs.get("output_tensor_requires_grads"), n_out, float_out),
        training_mode=bool(attrs.get("training_mode", 0)),
        safe_run_mode=bool(attrs.get("safe_run_mode", 1)),
    )


@dataclass(frozen=True)
class BackwardSpec:
    """What a PythonOpGrad node asks for: ``func_name.backward(ctx, *grads)``."""

    func_name: str
    convention: str  # the forward's input_convention
    n_grads: int | None  # gradient inputs after the ctx (None: known only from the ctx)
    input_types: tuple[int, ...] = ()  # ONNX dtype of each gradient input (empty when not recorded)
    input_ranks: tuple[int, ...] = ()  # rank of each gradient input (empty when not recorded)


def parse_backward(node: onnx.NodeProto) -> BackwardSpec:
    """Read a PythonOpGrad node; both input layouts (1 + N and the older 1 + 2N) are accepted."""
    attrs = node_attributes(node)
    where = describe(node)
    func = function_name(node)
    convention = _first(attrs, "output_convention", "input_convention", "call_convention")
    if convention is None:
        raise PythonOpError(f"{where} ({func}) has no 'output_convention'")
    _check_inplace(attrs, f"{where} ({func})")
    if not node.input or not node.input[0]:
        raise PythonOpError(f"{where} ({func}): input 0 must be the ctx handle of the forward")
    n_outputs = convention.count("d")
    if len(node.output) > n_outputs:
        raise PythonOpError(
            f"{where} ({func}): {len(node.output)} outputs but output_convention {convention!r} has "
            f"{n_outputs} tensor argument(s)"
        )
    types = attrs.get("input_tensor_types")
    n_grads: int | None = len(types) if types else None
    if n_grads is not None and len(node.input) not in (1 + n_grads, 1 + 2 * n_grads):
        raise PythonOpError(
            f"{where} ({func}): {len(node.input)} inputs, expected 1 + {n_grads} (ctx, one gradient per "
            f"forward output) or 1 + 2 x {n_grads} (older layout, followed by the forward outputs)"
        )
    ranks = tuple(int(r) for r in attrs.get("input_tensor_ranks", ()))
    if ranks and n_grads is not None and len(ranks) != n_grads:
        raise PythonOpError(
            f"{where} ({func}): input_tensor_ranks has {len(ranks)} entries for {n_grads} gradient(s)"
        )
    return BackwardSpec(
        func_name=func,
        convention=convention,
        n_grads=n_grads,
        input_types=tuple(int(t) for t in types or ()),
        input_ranks=ranks,
    )


# ---- constants ------------------------------------------------------------------------------------
def decode_constants(
    attrs: dict[str, Any],
    where: str = "PythonOp",
    func: str = "",
    found: list[tuple[int, float]] | None = None,
) -> dict[int, Any]:
    """Argument position -> Python value, from the typed side tables. ``found``, when given, gets
    the (position, value) of each float argument read from the float32 table alone that is likely
    rounded (:func:`warn_rounded_floats` says so once per model)."""
    out: dict[int, Any] = {}
    label = f"{where} ({func})" if func else where

    def put(pos: int, value: Any) -> None:
        if pos in out:
            raise PythonOpError(f"{label}: two constants are given for argument {pos}")
        out[pos] = value

    convert = {"int": int, "float": float, "bool": bool}
    rounded: list[tuple[int, float]] = []  # float arguments read from float32 only, likely rounded
    for kind in _SCALAR_KINDS:
        values = attrs.get(f"input_{kind}_scalars", [])
        if kind == "float":
            values = _exact_floats(attrs, "input_float_scalars", label, rounded, positions=True)
        positions = attrs.get(f"input_{kind}_scalar_positions", [])
        if len(values) != len(positions):
            raise PythonOpError(
                f"{label}: input_{kind}_scalars and input_{kind}_scalar_positions differ in length"
            )
        for pos, v in zip(positions, values):
            put(pos, convert[kind](v))
        flat = attrs.get(f"input_{kind}_tuples", [])
        if kind == "float":
            flat = _exact_floats(attrs, "input_float_tuples", label, rounded, positions=False)
        begins = list(attrs.get(f"input_{kind}_tuple_begins", []))
        positions = attrs.get(f"input_{kind}_tuple_positions", [])
        if len(begins) != len(positions) or any(b > len(flat) for b in begins):
            raise PythonOpError(f"{label}: malformed input_{kind}_tuple_begins / _positions")
        ends = [*begins[1:], len(flat)]
        for pos, b, e in zip(positions, begins, ends):
            put(pos, tuple(convert[kind](v) for v in flat[b:e]))
    for pos in attrs.get("input_none_positions", []):
        put(pos, None)
    strings = attrs.get("input_string_scalars", [])
    positions = attrs.get("input_string_scalar_positions", [])
    if len(strings) != len(positions):
        raise PythonOpError(f"{label}: input_string_scalars and _positions differ in length")
    for pos, s in zip(positions, strings):
        put(pos, s)
    if found is not None:
        found.extend(rounded)
    if attrs.get("input_pointer_scalar_positions"):
        raise PythonOpError(
            f"{label}: arguments {list(attrs['input_pointer_scalar_positions'])} are stored as raw "
            "memory addresses of the exporting process (input_pointer_scalars), which cannot be "
            "used: re-export the model with onnxgrad.export, which stores None and str by value"
        )
    return out


def warn_rounded_floats(nodes: Iterable[onnx.NodeProto]) -> None:
    """One :class:`UserWarning` naming every PythonOp node of ``nodes`` whose float arguments are
    read from the float32 table without their exact values and are likely rounded (a foreign
    exporter's file): called once per model checked, not per parse of a node (the gradient rule and
    each runtime read a node again). A malformed node is left to :func:`parse_forward` to refuse."""
    said = []
    for node in nodes:
        if node.op_type != PYTHON_OP or node.domain != MS_DOMAIN:
            continue
        rounded: list[tuple[int, float]] = []
        try:
            decode_constants(node_attributes(node), found=rounded)
        except PythonOpError:
            continue
        if rounded:
            args = ", ".join(f"{pos} = {v!r}" for pos, v in rounded[:8])
            said.append(f"{describe(node)} ({function_name(node)}): {args}")
    if said:
        more = f" and {len(said) - 8} more nodes" if len(said) > 8 else ""
        warnings.warn(
            f"float arguments of {'; '.join(said[:8])}{more} are read from the nodes' float32 tables "
            "(input_float_scalars / input_float_tuples) without the exact values "
            "(input_float_scalars_exact, written by onnxgrad.export): they are most likely rounded from "
            "what the exporting code passed; re-export with onnxgrad.export to keep them exact",
            UserWarning,
            stacklevel=4,
        )


def _exact_floats(
    attrs: dict[str, Any], key: str, label: str, rounded: list[tuple[int, float]], *, positions: bool
) -> list[float]:
    """The float table ``key`` (``input_float_scalars`` / ``input_float_tuples``) as Python floats:
    its exact companion ``key + "_exact"`` (float64) where present, checked to round to the
    float32 table; else the float32 values, those that are likely rounded added to ``rounded``
    (argument position, value) for one warning."""
    stored = [float(v) for v in attrs.get(key, [])]
    exact = attrs.get(f"{key}_exact")
    if exact is not None:
        values = (
            [float(v) for v in numpy_helper.to_array(exact).reshape(-1)]
            if isinstance(exact, onnx.TensorProto)
            else [float(v) for v in exact]
        )
        with np.errstate(over="ignore"):  # 1e40 rounds to inf in the float32 table
            pairs = [(np.float32(e), np.float32(f)) for e, f in zip(values, stored)]
        if len(values) != len(stored):
            raise PythonOpError(
                f"{label}: {key}_exact holds {len(values)} values where {key} holds {len(stored)}: the "
                "node was edited inconsistently; fix or remove one of them"
            )
        same = all(e == f or (np.isnan(e) and np.isnan(f)) for e, f in pairs)
        if not same:
            raise PythonOpError(
                f"{label}: {key}_exact {values[:8]} does not round to {key} {stored[:8]}: the node was "
                "edited inconsistently; fix or remove one of them"
            )
        return values
    if positions:
        where = attrs.get("input_float_scalar_positions", [])
    else:  # a tuple's values: the argument of the tuple each belongs to
        where = [-1] * len(stored)
        begins = attrs.get("input_float_tuple_begins", [])
        for begin, owner in zip(begins, attrs.get("input_float_tuple_positions", [])):
            where[begin:] = [owner] * max(len(stored) - begin, 0)
    for pos, v in zip(where, stored):
        if _likely_rounded(v):
            rounded.append((int(pos), v))
    return stored


def _likely_rounded(value: float) -> bool:
    """Whether a float32 value is not the number its shortest float32 decimal says (``0.1`` is
    0.100000001490116..., ``0.5`` is 0.5): the sign that a float64 was rounded to it."""
    if not math.isfinite(value):
        return False
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-")) != value


def _tuple_kind(value: tuple) -> str | None:
    if all(isinstance(v, bool) for v in value):
        return "bool"  # before int: bool is a subclass of int (an empty tuple counts as bool)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "int"
    if all(isinstance(v, float) for v in value):
        return "float"
    return None


def encode_constants(convention: str, constants: dict[int, Any], func: str) -> dict[str, Any]:
    """The attributes storing ``constants`` (position -> value); refuses what cannot be stored. The
    float arguments' exact values are float64 arrays (``input_float_scalars_exact``,
    ``input_float_tuples_exact``: tensor attributes)."""
    attrs: dict[str, list] = {}

    def add(key: str, value: Any) -> None:
        attrs.setdefault(key, []).append(value)

    for pos in sorted(constants):
        value = constants[pos]
        if isinstance(value, bool):
            add("input_bool_scalars", int(value))
            add("input_bool_scalar_positions", pos)
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise PythonOpError(f"{func}: argument {pos} = {value} does not fit in int64")
            add("input_int_scalars", value)
            add("input_int_scalar_positions", pos)
        elif isinstance(value, float):
            add("input_float_scalars", value)
            add("input_float_scalar_positions", pos)
            add("input_float_scalars_exact", value)
        elif isinstance(value, tuple) and _tuple_kind(value) is not None:
            kind = _tuple_kind(value)
            flat = attrs.setdefault(f"input_{kind}_tuples", [])
            add(f"input_{kind}_tuple_begins", len(flat))
            add(f"input_{kind}_tuple_positions", pos)
            flat.extend(int(v) if kind == "bool" else v for v in value)
            if kind == "float":
                attrs.setdefault("input_float_tuples_exact", []).extend(value)
        elif value is None:
            add("input_none_positions", pos)
        elif isinstance(value, str):
            add("input_string_scalars", value)
            add("input_string_scalar_positions", pos)
        else:
            raise PythonOpError(
                f"{func}: argument {pos} of apply() is a {type(value).__name__}, which a PythonOp "
                "node cannot store. Supported non-tensor arguments: int, float, bool, None, str, and "
                "tuples of ints, of floats or of bools (pass other settings through the Function's "
                "module-level state, or as tensors)"
            )
    for key in ("input_float_scalars_exact", "input_float_tuples_exact"):  # float64 tensors
        if key in attrs:
            attrs[key] = np.array(attrs[key], dtype=np.float64)  # type: ignore[assignment]
    return attrs
