"""Optimizers that update numpy parameter arrays in place, with the math of ``torch.optim``.

Their hyperparameters, defaults and updates are the definitions of the optimizer registry
(:mod:`onnxgrad.train.optimizers`), whose programs this module runs on numpy arrays.

They work on the live buffers of :attr:`onnxgrad.ForwardBackward.parameters`: an update made by
:meth:`Optimizer.step` is what the next forward sees, with no copy. Apart from the optimizer state
(momentum, moments), each parameter gets at most two scratch buffers, allocated once; a step
allocates nothing else. ``lr`` is a number or a schedule (:mod:`onnxgrad.train.schedules`, or any
callable ``step -> lr``), read once per step: changing it never rebuilds anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import InputError
from .optimizers import Definition, Program, Value, definition, evaluate_scalar
from .schedules import LearningRate, as_schedule

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adam",
    "AdamW",
    "Optimizer",
    "clip_grad_norm",
    "clip_grad_value",
    "optimizer_class",
]


class Optimizer:
    """Base class: holds the parameters by name, their state and scratch buffers.

    ``params``: name -> float numpy array, updated in place. Replacing an array elsewhere (e.g. with
    ``ForwardBackward.set_parameters``) detaches it from the optimizer: build a new one then.
    ``lr``: a number, or a schedule ``step -> lr`` evaluated at :attr:`iterations` on each step.
    """

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate) -> None:
        self.params: dict[str, np.ndarray] = {}
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or not np.issubdtype(p.dtype, np.floating):
                raise InputError(f"parameter {name!r} must be a floating-point numpy array")
            if not p.flags.writeable:
                raise InputError(f"parameter {name!r} is read-only: it cannot be updated in place")
            self.params[name] = p
        self.schedule = as_schedule(lr)
        self.iterations = 0  # updates made so far: the step the schedule is evaluated at
        self.lr = self._scheduled_lr()
        self.state: dict[str, dict[str, Any]] = {name: {} for name in self.params}
        self._scratch: dict[str, list[np.ndarray]] = {name: [] for name in self.params}

    def _scheduled_lr(self) -> float:
        lr = float(self.schedule(self.iterations))
        _check_non_negative(lr=lr)
        return lr

    def step(self, grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update from ``grads`` (name -> gradient); parameters without one are left."""
        unknown = [k for k in grads if k not in self.params]
        if unknown:
            raise InputError(f"gradients given for {unknown}, which are not optimizer parameters")
        checked = []
        for name, grad in grads.items():
            p = self.params[name]
            grad = np.asarray(grad)
            if grad.shape != p.shape:
                raise InputError(f"gradient of {name!r} has shape {grad.shape}, the parameter has {p.shape}")
            checked.append((name, p, grad))
        self.lr = self._scheduled_lr()
        for name, p, grad in checked:
            self._update(name, p, grad)
        self.iterations += 1

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step counter and a copy of the per-parameter state (momenta, moments, counts)."""
        state = {
            name: {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in s.items()}
            for name, s in self.state.items()
        }
        return {"iterations": self.iterations, "state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, so the next step is the one that would have come."""
        state = state_dict["state"]
        if set(state) != set(self.params):
            raise InputError(
                f"the optimizer state is for parameters {sorted(state)}, "
                f"this optimizer has {sorted(self.params)}"
            )
        for name, values in state.items():
            p = self.params[name]
            restored = {}
            for key, value in values.items():
                if isinstance(value, np.ndarray):
                    if value.shape != p.shape:
                        raise InputError(f"state {key!r} of {name!r} has shape {value.shape}, not {p.shape}")
                    value = np.array(value, dtype=p.dtype, copy=True)
                restored[key] = value
            self.state[name] = restored
        self.iterations = int(state_dict["iterations"])
        self.lr = self._scheduled_lr()

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        raise NotImplementedError

    def _buffer(self, name: str, index: int) -> np.ndarray:
        """Scratch buffer ``index`` of parameter ``name``, allocated on first use."""
        bufs = self._scratch[name]
        while len(bufs) <= index:
            bufs.append(np.empty_like(self.params[name]))
        return bufs[index]


def _check_non_negative(**values: float) -> None:
    for key, value in values.items():
        if not value >= 0:
            raise InputError(f"{key} must be >= 0, got {value}")


def _add_scaled(p: np.ndarray, alpha: float, x: np.ndarray, scratch: np.ndarray) -> None:
    """``p += alpha * x`` through ``scratch`` (which may be ``x`` itself), without allocating."""
    np.multiply(x, alpha, out=scratch)
    p += scratch


class _Defined(Optimizer):
    """An optimizer of the registry (:mod:`onnxgrad.train.optimizers`): its hyperparameters are
    the definition's (defaults filled in, validated, also set as attributes), its update the
    definition's program, run in place in the parameter, its state and scratch buffers."""

    definition: Definition

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate, **options: Any) -> None:
        super().__init__(params, lr)
        self.hyperparameters: dict[str, Any] = self.definition.resolve(options)
        for key, value in self.hyperparameters.items():
            setattr(self, key, value)
        self._program = self.definition.program(self.hyperparameters)
        self._plan = _plan(self._program)
        # (lr, t, first) -> the per-step operands; a list, not a tuple: Trainer.setup() records
        # an optimizer's plain and tuple attributes as its settings
        self._operands: list[Any] = [None, []]

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        state, program, plan = self.state[name], self._program, self._plan
        slots = program.slots
        if self.definition.counts_steps:
            t = state.get("step", 0) + 1
            first = t == 1
        else:
            t, first = self.iterations + 1, bool(slots) and slots[0] not in state
        if first:
            for slot in slots:
                state.setdefault(slot, np.zeros_like(p))
        key = (self.lr, t, first)
        if self._operands[0] != key:  # the per-step scalars and constants, shared by the parameters
            self._operands = [key, _scalars(program, plan, *key)]
        scratch = self._scratch[name]
        if len(scratch) < plan.buffers:  # allocated on first use
            self._buffer(name, plan.buffers - 1)
        values = [p, grad, *[state[s] for s in slots], *scratch, *self._operands[1]]
        for fn, get, unary, out in plan.steps:
            if unary:
                fn(get(values), out=values[out])
            else:
                fn(*get(values), out=values[out])
        for home, source in plan.copies:
            np.copyto(values[home], values[source])
        if self.definition.counts_steps:
            state["step"] = t


class SGD(_Defined):
    """Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay.

    Same update as ``torch.optim.SGD``: ``d = g + wd p``; ``b = d`` on the first step, then
    ``b = μ b + (1 - dampening) d``; ``d = d + μ b`` (Nesterov) or ``d = b``; ``p -= lr d``.
    Options (defaults): ``momentum`` (0), ``nesterov`` (False), ``weight_decay`` (0),
    ``dampening`` (0).
    """

    definition = definition("sgd")

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate, **options: Any) -> None:
        super().__init__(params, lr, **options)


class Adam(_Defined):
    """Adam with bias correction and L2 weight decay, the update of ``torch.optim.Adam``.
    Options (defaults): ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (0)."""

    definition = definition("adam")

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate = 1e-3, **options: Any) -> None:
        super().__init__(params, lr, **options)


class AdamW(_Defined):
    """Adam with decoupled weight decay (``torch.optim.AdamW``): ``p *= 1 - lr wd``, then Adam on
    the raw gradient. The decay follows the scheduled learning rate. Options (defaults):
    ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (0.01)."""

    definition = definition("adamw")

    def __init__(self, params: Mapping[str, np.ndarray], lr: LearningRate = 1e-3, **options: Any) -> None:
        super().__init__(params, lr, **options)


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
"""The numpy optimizer of each torch-family definition of the registry, by name."""


def optimizer_class(spec: Definition) -> type[Optimizer]:
    """The numpy optimizer of any definition of the registry: the class of :data:`OPTIMIZERS`
    for torch's family, a new one for others (onnxruntime-training's ``AdamWOptimizer`` run on
    numpy arrays, e.g. to compare with the compat optimizer model)."""
    for cls in OPTIMIZERS.values():
        if cls.definition is spec:  # type: ignore[attr-defined]
            return cls
    return type(spec.name, (_Defined,), {"definition": spec, "__doc__": spec.doc})


# ---- running a program in place ----------------------------------------------------------------
def _where(cond: bool, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    chosen = a if cond else b
    if chosen is not out:
        np.copyto(out, chosen)


_UFUNCS = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "sqrt": np.sqrt}
_UFUNCS["where"] = _where
Location = tuple[str, Any]  # ("in", "p" | "g" | a slot) | ("buf", scratch index)


@dataclass
class _Plan:
    """A program compiled for numpy. The values an update reads are, in order, the parameter, its
    gradient, its state slots, ``buffers`` scratch buffers, then the scalars and constants of
    ``operands`` (computed once per step). Each tensor value lives in one of the arrays: the
    parameter and its state are updated in place once their old value is read for the last time,
    a scratch buffer is reused as soon as its value is dead. Planned once per program; a step
    then allocates nothing."""

    steps: list[tuple[Any, Any, bool, int]]  # (ufunc, itemgetter of its arguments, unary, output)
    copies: list[tuple[int, int]]  # (output array, array holding its final value)
    buffers: int
    operands: list[Value | float]  # the scalar values and constants the steps read, in order


_PLANS: dict[int, _Plan] = {}


def _plan(program: Program) -> _Plan:
    if id(program) in _PLANS:
        return _PLANS[id(program)]
    ins = program.instructions
    end = len(ins)
    last: dict[int, int] = {}
    uses: dict[int, int] = {}
    inputs: dict[str, Value] = {}
    for i, instr in enumerate(ins):
        for a in instr.args:
            if isinstance(a, Value):
                last[a.id] = i
                uses[a.id] = uses.get(a.id, 0) + 1
                if a.input is not None and not a.scalar:
                    inputs[a.input] = a
    for v in program.outputs.values():
        last[v.id] = end
    producer = {instr.out.id: instr for instr in ins}
    home_of: dict[int, str] = {}  # the values that may be written into an output's own array
    for home, v in program.outputs.items():
        while v.input is None and v.id not in home_of:
            home_of[v.id] = home  # then follow the operand it accumulates into
            instr = producer[v.id]
            tensors = [a for a in instr.args if isinstance(a, Value) and not a.scalar]
            acc = instr.args[2] if instr.op == "where" else (tensors[0] if tensors else None)
            if not isinstance(acc, Value) or acc.input is not None or uses.get(acc.id) != 1:
                break
            v = acc
    index = {name: k for k, name in enumerate(("p", "g", *program.slots))}
    where: dict[int, Location] = {v.id: ("in", name) for name, v in inputs.items()}
    free: list[int] = []
    count = 0
    for i, instr in enumerate(ins):
        if instr.out.scalar:
            continue
        dying = [a.id for a in instr.args if isinstance(a, Value) and not a.scalar and last[a.id] == i]
        home = home_of.get(instr.out.id)
        out: Location | None = None
        if home is not None and (home not in inputs or last[inputs[home].id] <= i):
            out = ("in", home)
        else:
            out = next((where[v] for v in dying if where[v][0] == "buf"), None)
            if out is None:
                if free:
                    out = ("buf", free.pop())
                else:
                    out, count = ("buf", count), count + 1
        where[instr.out.id] = out
        free.extend({where[v][1] for v in dying if where[v][0] == "buf" and where[v] != out})
    for v in program.outputs.values():
        where.setdefault(v.id, ("in", v.input))

    def at(loc: Location) -> int:
        return index[loc[1]] if loc[0] == "in" else len(index) + loc[1]

    buffers = max(count, 1)
    operands: list[Value | float] = []

    def arg(a: Value | float) -> int:
        if isinstance(a, Value) and not a.scalar:
            return at(where[a.id])
        operands.append(a)
        return len(index) + buffers + len(operands) - 1

    steps = []
    for instr in ins:
        if not instr.out.scalar:
            positions = [arg(a) for a in instr.args]
            out = at(where[instr.out.id])
            steps.append((_UFUNCS[instr.op], itemgetter(*positions), len(positions) == 1, out))
    copies = [(index[h], at(where[v.id])) for h, v in program.outputs.items() if where[v.id] != ("in", h)]
    plan = _PLANS[id(program)] = _Plan(steps, copies, buffers, operands)
    return plan


def _scalars(program: Program, plan: _Plan, lr: float, t: int, first: bool) -> list[Any]:
    """The operands of ``plan`` for one step: scalars in Python floats (double) or float32 as the
    program says, and constants."""
    f32 = program.scalar_float32
    values: dict[int, Any] = {}
    inputs = {"lr": np.float32(lr) if f32 else lr, "t": t, "first": first}
    for instr in program.instructions:
        for a in instr.args:
            if isinstance(a, Value) and a.scalar and a.input is not None:
                values[a.id] = inputs[a.input]
        if instr.out.scalar:
            args = [values[a.id] if isinstance(a, Value) else a for a in instr.args]
            values[instr.out.id] = evaluate_scalar(instr.op, args, f32)
    return [values[a.id] if isinstance(a, Value) else a for a in plan.operands]


# ---- gradient clipping -------------------------------------------------------------------------
def clip_grad_norm(grads: dict[str, np.ndarray], max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient of ``grads`` by one factor so that their global norm is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``; returns the global norm before clipping.

    The global norm is the ``norm_type``-norm of the per-gradient norms (``inf``: the largest
    absolute value); the factor is ``max_norm / (norm + 1e-6)`` when below 1. Arrays are scaled in
    place (a read-only one is replaced in ``grads`` by a scaled copy). A non-finite norm raises
    :class:`InputError`: scaling by it would turn every gradient into NaN.
    """
    _check_positive(max_norm=max_norm, norm_type=norm_type)
    if not grads:
        return 0.0
    if math.isinf(norm_type):
        total = max(float(np.max(np.abs(g))) if g.size else 0.0 for g in grads.values())
    else:
        norms = [np.linalg.norm(g.ravel().astype(np.float64), ord=norm_type) for g in grads.values()]
        total = float(np.linalg.norm(np.asarray(norms), ord=norm_type))
    if not math.isfinite(total):
        raise InputError(f"the gradients' global norm is {total}: they cannot be clipped")
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for name, g in grads.items():
            if g.flags.writeable:
                g *= coef
            else:
                grads[name] = g * np.asarray(coef, dtype=g.dtype)
    return total


def clip_grad_value(grads: dict[str, np.ndarray], clip_value: float) -> None:
    """Clip every gradient element to ``[-clip_value, clip_value]``, as
    ``torch.nn.utils.clip_grad_value_`` (in place; a read-only array is replaced by a clipped copy)."""
    _check_positive(clip_value=clip_value)
    for name, g in grads.items():
        if g.flags.writeable:
            np.clip(g, -clip_value, clip_value, out=g)
        else:
            grads[name] = np.clip(g, -clip_value, clip_value)


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise InputError(f"{key} must be > 0, got {value}")


class ElasticPenalty(Optimizer):
    """onnxcustom's ``ElasticLearningPenalty(l1, l2)``: another optimizer whose parameters are
    shrunk before each of its updates, ``W ← (1 - 2 l2) W - l1 sign(W)``.

    As in onnxcustom, the shrinking does not depend on the learning rate, and the gradient the
    inner optimizer applies is the data loss's alone (computed at the weights before the shrink).
    The penalty onnxcustom added to the loss it reported, ``l1 Σ|W| + l2 Σ W²``, is
    :meth:`penalty`. The defaults, 0.01 each, are what onnxcustom applied whatever it was given
    (its class defaulted to 0.5 but never passed its values to the ONNX functions, whose defaults
    were 0.01). ``optimizer``: the inner optimizer's class (:class:`SGD` by default), built
    with ``lr`` and ``options``. For the :class:`~onnxgrad.train.Trainer`, give the class and
    ``optimizer_options={"l1": ..., "l2": ...}``; for the scikit-learn estimators, a factory such as
    ``functools.partial(ElasticPenalty, lr=0.01, l1=1e-4, l2=1e-4)``.
    """

    def __init__(
        self,
        params: Mapping[str, np.ndarray],
        lr: LearningRate,
        l1: float = 0.01,
        l2: float = 0.01,
        optimizer: type[Optimizer] = SGD,
        **options: Any,
    ) -> None:
        _check_non_negative(l1=l1, l2=l2)
        if l2 > 0.5:
            raise InputError(f"l2 must be <= 0.5 (the shrinking factor 1 - 2 l2 would be negative), got {l2}")
        self.inner = optimizer(params, lr=lr, **options)
        super().__init__(self.inner.params, self.inner.schedule)
        self.state = self.inner.state  # one state: checkpoints hold the inner optimizer's
        self.l1, self.l2 = float(l1), float(l2)

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        sign = self._buffer(name, 0)
        np.sign(p, out=sign)
        p *= 1.0 - 2.0 * self.l2
        _add_scaled(p, -self.l1, sign, sign)
        self.inner.lr, self.inner.iterations = self.lr, self.iterations
        self.inner._update(name, p, grad)

    def penalty(self, params: Mapping[str, np.ndarray] | None = None) -> float:
        """``Σ_W l1 Σ|W| + l2 Σ W²`` over ``params`` (default: the parameters it updates)."""
        values = self.params if params is None else params
        return float(
            sum(
                self.l1 * np.abs(w).sum(dtype=np.float64) + self.l2 * np.square(w, dtype=np.float64).sum()
                for w in values.values()
            )
        )
