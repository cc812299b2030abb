"""The optimizers of the registry (:mod:`onnxgrad.train.optimizers`) written as ONNX nodes.

Each update is the definition's program, the one the numpy optimizers (:mod:`onnxgrad.train.optim`)
run, operation for operation and in the same order, so that the one-graph step gives the same
numbers: the scalars that numpy computes in Python floats (bias
corrections, ``-lr / bias1``, ``1 - lr wd``) are computed here in double from the ``lr`` (double)
and ``step`` (int64, the number of updates already made) inputs, then cast to the parameter's type,
as numpy rounds a Python float meeting a float32 array. Tensor arithmetic stays in the parameter's
type. ``scalar_dtype=FLOAT`` computes those scalars in float32 instead (after one Cast of ``lr`` and
of ``step``), for runtimes without float64 kernels: WebGPU (:mod:`onnxgrad.artifacts.webgpu`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from onnx import TensorProto

from ..errors import InputError, NotFoundError
from ..model.emit import Emitter
from ..train.optim import OPTIMIZERS
from ..train.optimizers import Definition, Program, Value, definition

__all__ = ["OPTIMIZERS", "STATE_KEYS", "emit_program", "emit_updates", "hyperparameters"]

DOUBLE = TensorProto.DOUBLE


@dataclass(frozen=True)
class Param:
    name: str  # the graph input holding the parameter
    grad: str  # the value holding its gradient
    dtype: int  # ONNX element type


def hyperparameters(optimizer: str, options: Mapping[str, Any]) -> dict:
    """The optimizer's hyperparameters with defaults filled in and validated (the registry's),
    as JSON values."""
    hyper = definition(optimizer).resolve(options)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in hyper.items()}


def STATE_KEYS(optimizer: str, hyper: dict) -> list[str]:
    """The state tensors each parameter carries, in order (same names as the numpy state)."""
    return list(definition(optimizer).slots(hyper))


def emit_updates(
    e: Emitter,
    optimizer: str,
    hyper: dict,
    params: list[Param],
    state: dict[tuple[str, str], str],
    lr: str,
    step: str,
    scalar_dtype: int = DOUBLE,
) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """Append the update nodes of the torch-family ``optimizer``: (param -> its new value,
    (param, key) -> new state value). ``lr`` is a double scalar, ``step`` an int64 scalar (the
    updates already made); ``scalar_dtype``: the type the per-step scalars are computed in
    (DOUBLE as numpy, or FLOAT)."""
    return emit_program(e, definition(optimizer), hyper, params, state, lr, step, scalar_dtype, DOUBLE)


def emit_program(
    e: Emitter,
    spec: Definition,
    hyper: Mapping[str, Any],
    params: list[Param],
    state: Mapping[tuple[str, str], str],
    lr: str,
    step: str,
    scalar_dtype: int = DOUBLE,
    lr_dtype: int = DOUBLE,
    step_base: int = 0,
) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """The program of ``spec`` (any family) for ``hyper`` emitted once per parameter of ``params``;
    its per-step scalars are emitted once, in ``scalar_dtype`` (``lr`` is of type ``lr_dtype``).
    ``step_base``: the value the int64 ``step`` holds at the first update (0: ``step`` counts the
    updates already made; 1: it is the index of this update, as onnxruntime-training feeds it)."""
    if scalar_dtype not in (DOUBLE, TensorProto.FLOAT):
        raise InputError(f"optimizer scalars are computed in double or float, not type {scalar_dtype}")
    program = spec.program(dict(hyper))
    scalars = _Scalars(e, program, lr, step, scalar_dtype, lr_dtype, step_base)
    new_params: dict[str, str] = {}
    new_state: dict[tuple[str, str], str] = {}
    for p in params:
        outputs = _emit_one(e, program, p, {k: state[(p.name, k)] for k in program.slots}, scalars)
        new_params[p.name] = outputs["p"]
        new_state.update({(p.name, k): outputs[k] for k in program.slots})
    return new_params, new_state


def _emit_one(e: Emitter, program: Program, p: Param, slots: dict[str, str], s: _Scalars) -> dict[str, str]:
    """The tensor instructions of ``program`` for parameter ``p``, in its type."""
    names: dict[int, str] = {}
    inputs = {"p": p.name, "g": p.grad, **slots}

    def arg(a: Value | float) -> str:
        if not isinstance(a, Value):
            return e.const(a, p.dtype)
        if a.scalar:
            return s.cast(s.value(a), p.dtype)
        return inputs[a.input] if a.input is not None else names[a.id]

    for instr in program.instructions:
        if instr.out.scalar:
            continue
        if instr.op == "where":
            names[instr.out.id] = e.op(
                "Where", s.value(instr.args[0]), arg(instr.args[1]), arg(instr.args[2])
            )
        else:
            names[instr.out.id] = e.op(_ONNX[instr.op], *(arg(a) for a in instr.args))
    return {k: arg(v) for k, v in program.outputs.items()}


_ONNX = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "sqrt": "Sqrt", "neg": "Neg", "pow": "Pow"}


class _Scalars:
    """The per-step scalars of a program, emitted once per graph in ``dtype`` (double, or float
    after one Cast of ``lr`` and of ``step``) and cast once per parameter type."""

    def __init__(
        self,
        e: Emitter,
        program: Program,
        lr: str,
        step: str,
        dtype: int = DOUBLE,
        lr_dtype: int = DOUBLE,
        step_base: int = 0,
    ) -> None:
        self.e, self.dtype, self.step_base = e, dtype, step_base
        self._producers = {i.out.id: i for i in program.instructions}
        lr = lr if dtype == lr_dtype else e.op("Cast", lr, to=dtype)
        self._lr, self._step = lr, step
        self._values: dict[Any, str] = {}
        self._cache: dict[tuple, str] = {}

    def _input(self, name: str) -> str:
        e = self.e
        if name == "lr":
            return self._lr
        if name == "t":  # the 1-based index of this update, as Adam's state["step"]
            t = e.op("Cast", self._step, to=self.dtype)
            return t if self.step_base == 1 else e.op("Add", t, e.const(1.0 - self.step_base, self.dtype))
        if name == "first":  # no update made yet: SGD's momentum buffer starts as the gradient
            return e.op("Equal", self._step, e.const(self.step_base, TensorProto.INT64))
        raise NotFoundError(f"no per-step scalar {name!r}; have lr, t, first")

    def value(self, v: Value) -> str:
        """The name of scalar value ``v`` of the program (``v.id`` is unique to its program)."""
        key = (v.input,) if v.input is not None else v
        if key in self._values:
            return self._values[key]
        if v.input is not None:
            out = self._input(v.input)
        else:
            out = self._emit(self._producers[v.id])
        self._values[key] = out
        return out

    def _emit(self, instr: Any) -> str:
        e, dt = self.e, self.dtype
        args = [self.value(a) if isinstance(a, Value) else a for a in instr.args]
        if instr.op == "one_minus_pow":
            beta, t = args
            if dt != DOUBLE:
                return _one_minus_power(e, beta, t, dt)
            return e.op("Sub", e.const(1.0, dt), e.op("Pow", e.const(beta, dt), t))
        return e.op(_ONNX[instr.op], *(a if isinstance(a, str) else e.const(a, dt) for a in args))

    def cast(self, value: str, dtype: int) -> str:
        key = ("cast", value, dtype)
        if key not in self._cache:
            self._cache[key] = value if dtype == self.dtype else self.e.op("Cast", value, to=dtype)
        return self._cache[key]


def _one_minus_power(e: Emitter, beta: float, t: str, dtype: int) -> str:
    """``1 - beta**t`` in float32 as ``-expm1(t ln beta)``, within a few ulps of the double value.

    ``1 - Pow(float32(beta), t)`` would lose digits twice: float32(0.999) is 1.3e-5 away from 0.999
    relative to ``1 - 0.999``, and the subtraction cancels. ``ln beta`` is taken in double here;
    expm1 is its Taylor series (Horner, 11 terms) where ``|u| < 0.5`` and ``exp(u) - 1`` elsewhere.
    """
    u = e.op("Mul", t, e.const(math.log(beta) if beta > 0 else -math.inf, dtype))
    series = e.const(1.0, dtype)
    for k in range(11, 1, -1):  # 1 + u/2 (1 + u/3 (... (1 + u/11)))
        series = e.op(
            "Add", e.const(1.0, dtype), e.op("Mul", e.op("Mul", u, e.const(1.0 / k, dtype)), series)
        )
    small = e.op("Mul", u, series)
    large = e.op("Sub", e.op("Exp", u), e.const(1.0, dtype))
    expm1 = e.op("Where", e.op("Greater", u, e.const(-0.5, dtype)), small, large)
    return e.op("Neg", expm1)
