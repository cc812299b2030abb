"""Optimizers that update numpy parameter arrays in place, with the math of ``torch.optim``.

Their hyperparameters, defaults and updates are the definitions of the optimizer registry
(:mod:`onnxgrad.train.optimizers`), whose programs this module compiles once into a function of
in-place numpy calls and runs on numpy arrays; small parameters of one type are updated together,
as one flat buffer.

They work on the live buffers of :attr:`onnxgrad.ForwardBackward.parameters`: an update made by
:meth:`Optimizer.step` is what the next forward sees, with no copy (small parameters are gathered
and their new values copied back into them). Apart from the optimizer state (momentum, moments),
each parameter gets at most two scratch buffers (a group of small ones: its flat buffers),
allocated once; a step allocates nothing else. ``lr`` is a number or a schedule
(:mod:`onnxgrad.train.schedules`, or any callable ``step -> lr``), read once per step: changing it
never rebuilds anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import is_
from typing import Any

import numpy as np

from ..errors import InputError
from .optimizers import DEFAULT_LR, Definition, Program, Value, check_lr, definition, evaluate_scalar
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
        return check_lr(self.schedule(self.iterations))

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
        self._apply(checked)
        self.iterations += 1

    def _apply(self, checked: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """The updates of one step: (name, parameter, gradient), checked."""
        for name, p, grad in checked:
            self._update(name, p, grad)

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
    definition's program, compiled once (:func:`_plan`) and run in place in the parameter, its
    state and scratch buffers.

    Small parameters of one type are updated together (:class:`_Group`): gathered into one flat
    buffer, the program run once over all of them, the results copied back. Their state tensors
    are views of the group's flat state, so ``state`` reads as for any other parameter; a state
    tensor replaced from outside (:meth:`load_state_dict`, the one-graph step) is copied in first.
    Each element goes through the same operations in the same types, so the numbers are the same
    bits either way."""

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
        self._groups: list[_Group] | None = None  # built on the first step
        self._group_of: dict[str, _Group] = {}

    def _index(self, state: dict[str, Any]) -> tuple[int, bool]:
        """``(t, first)`` of the next update of a parameter with ``state``."""
        if self.definition.counts_steps:
            t = state.get("step", 0) + 1
            return t, t == 1
        slots = self._program.slots
        return self.iterations + 1, bool(slots) and slots[0] not in state

    def _operands_for(self, t: int, first: bool) -> list[Any]:
        """``[(lr, t, first), the operands of the plan for them]``: the per-step scalars and
        constants, computed once for all the parameters."""
        plan = self._plan
        key = (self.lr, t if plan.reads_t else 0, first and plan.reads_first)
        if self._operands[0] != key:
            self._operands = [key, _scalars(self._program, plan, *key)]
        return self._operands

    def _update(self, name: str, p: np.ndarray, grad: np.ndarray) -> None:
        state, plan = self.state[name], self._plan
        slots = plan.slots
        if slots or plan.reads_t:  # else the operands are the same for every parameter and step
            t, first = self._index(state)
            if first:
                for slot in slots:
                    state.setdefault(slot, np.zeros_like(p))
        else:
            t, first = 0, False
        scratch = self._scratch[name]
        if len(scratch) < plan.buffers:  # allocated on first use
            self._buffer(name, plan.buffers - 1)
        operands = self._operands
        if operands[0] != (self.lr, t if plan.reads_t else 0, first and plan.reads_first):
            operands = self._operands_for(t, first)
        if slots:
            plan.run(p, grad, *[state[s] for s in slots], *scratch, *operands[1])
        else:
            plan.run(p, grad, *scratch, *operands[1])
        if self.definition.counts_steps:
            state["step"] = t

    def _apply(self, checked: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        if self._groups is None:
            self._groups = _groups(self.params, self._plan, self._program.slots)
            self._group_of = {n: g for g in self._groups for n in g.names}
        plan = self._plan
        if not self._groups and not (plan.slots or plan.reads_t or plan.reads_first):
            operands, scratch = self._operands_for(0, False)[1], self._scratch  # one set: no state
            for name, p, grad in checked:
                if len(scratch[name]) < plan.buffers:
                    self._buffer(name, plan.buffers - 1)
                plan.run(p, grad, *scratch[name], *operands)
            return
        if not self._groups:
            super()._apply(checked)
            return
        pending: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        for name, p, grad in checked:
            group = self._group_of.get(name)
            if group is None or grad.dtype != p.dtype:
                self._update(name, p, grad)
            else:
                pending.setdefault(id(group), {})[name] = (p, grad)
        for group in self._groups:
            given = pending.get(id(group))
            if given and not group.run(self, given):
                for name, (p, grad) in given.items():
                    self._update(name, p, grad)


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

    def __init__(
        self, params: Mapping[str, np.ndarray], lr: LearningRate = DEFAULT_LR, **options: Any
    ) -> None:
        super().__init__(params, lr, **options)


class AdamW(_Defined):
    """Adam with decoupled weight decay (``torch.optim.AdamW``): ``p *= 1 - lr wd``, then Adam on
    the raw gradient. The decay follows the scheduled learning rate. Options (defaults):
    ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (0.01)."""

    definition = definition("adamw")

    def __init__(
        self, params: Mapping[str, np.ndarray], lr: LearningRate = DEFAULT_LR, **options: Any
    ) -> None:
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
_UFUNCS = {"add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "sqrt": "sqrt"}
Location = tuple[str, Any]  # ("in", "p" | "g" | a slot) | ("buf", scratch index)


@dataclass
class _Plan:
    """A program compiled for numpy. ``run`` takes, in order, the parameter, its gradient, its
    state slots, ``buffers`` scratch buffers, then the scalars and constants of ``operands``
    (computed once per step), and updates the parameter and its state in place. Each tensor value
    lives in one of the arrays: the parameter and its state are written once their old value is
    read for the last time, a scratch buffer is reused as soon as its value is dead. Planned once
    per program; a step then allocates nothing."""

    run: Callable[..., None]
    steps: list[str]  # the calls ``run`` makes, one line each (its source)
    buffers: int
    operands: list[Value | float]  # the scalar values and constants the steps read, in order
    slots: tuple[str, ...]  # the program's
    # the scalar instructions the operands need, in order: (op, arguments (a value's id or a
    # constant), output id); the scalar inputs they read, by id
    scalar_steps: list[tuple[str, tuple[Any, ...], int]]
    scalar_inputs: dict[int, str]
    reads_t: bool  # whether the operands depend on t (else they are the same at every step)
    reads_first: bool


_PLANS: dict[int, tuple[Program, _Plan]] = {}  # by id; holding the program keeps its id unique


def _plan(program: Program) -> _Plan:
    if id(program) in _PLANS:
        return _PLANS[id(program)][1]
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

    def at(loc: Location) -> str:
        return f"a{index[loc[1]] if loc[0] == 'in' else len(index) + loc[1]}"

    buffers = max(count, 1)
    operands: list[Value | float] = []

    def arg(a: Value | float) -> str:
        if isinstance(a, Value) and not a.scalar:
            return at(where[a.id])
        operands.append(a)
        return f"c{len(operands) - 1}"

    steps = []
    for instr in ins:
        if instr.out.scalar:
            continue
        args, out = [arg(a) for a in instr.args], at(where[instr.out.id])
        if instr.op == "where":  # a scalar condition: copy the chosen operand unless it is there
            cond, a, b = args
            steps.append(f"copyto({out}, {a} if {cond} else {b})" if out not in (a, b) else "")
            if out == b != a:
                steps[-1] = f"if {cond}: copyto({out}, {a})"
            elif out == a != b:
                steps[-1] = f"if not {cond}: copyto({out}, {b})"
        else:  # the output passed positionally: the cheapest ufunc call
            steps.append(f"{_UFUNCS[instr.op]}({', '.join(args)}, {out})")
    steps += [
        f"copyto({at(('in', h))}, {at(where[v.id])})"
        for h, v in program.outputs.items()
        if where[v.id] != ("in", h)
    ]
    steps = [s for s in steps if s]
    needed = {a.id for a in operands if isinstance(a, Value)}
    scalar_steps: list[tuple[str, tuple[Any, ...], int]] = []
    scalar_inputs: dict[int, str] = {}
    for instr in reversed(ins):  # the scalar instructions the operands need, last first
        if instr.out.id in needed:
            scalar_steps.append(
                (instr.op, tuple(a.id if isinstance(a, Value) else a for a in instr.args), instr.out.id)
            )
            needed |= {a.id for a in instr.args if isinstance(a, Value)}
    for instr in ins:
        for a in instr.args:
            if isinstance(a, Value) and a.scalar and a.input is not None and a.id in needed:
                scalar_inputs[a.id] = a.input
    plan = _Plan(
        _compile(steps, len(index) + buffers, len(operands)),
        steps,
        buffers,
        operands,
        program.slots,
        scalar_steps[::-1],
        scalar_inputs,
        "t" in scalar_inputs.values(),
        "first" in scalar_inputs.values(),
    )
    _PLANS[id(program)] = (program, plan)
    return plan


def _compile(steps: list[str], arrays: int, operands: int) -> Callable[..., None]:
    """One Python function making the calls of ``steps`` on its arguments ``a0, a1, ...`` (arrays)
    and ``c0, c1, ...`` (operands): a program run with no interpretation left but the calls.

    The source is made here from a fixed set of numpy functions and numbered argument names; no
    name or constant of a formula or a model reaches it (constants are operands)."""
    params = ", ".join([*(f"a{k}" for k in range(arrays)), *(f"c{k}" for k in range(operands))])
    body = "\n".join(f"    {s}" for s in steps) or "    pass"
    namespace: dict[str, Any] = {"__builtins__": {}, "copyto": np.copyto}
    namespace.update({name: getattr(np, name) for name in _UFUNCS.values()})
    exec(f"def run({params}):\n{body}\n", namespace)
    return namespace["run"]


# ---- many small parameters updated as one ------------------------------------------------------
_GROUP_ELEMENTS_PER_CALL = 512
"""A parameter joins a group when it has at most this many elements per call of the program:
gathering it and copying it back (three copies) costs about what the program's calls over it
alone cost in Python (about half a microsecond each) at that size."""


_GROUP_MIN_CALLS = 32
"""A group is made when it saves at least this many calls a step: its own cost (the gathering
and copying back, the checks) is about that of one call per member and ten calls more."""


class _Group:
    """Parameters of one type updated together: their values and gradients gathered into one flat
    buffer each, the program run once, the new values copied back. Their state lives in flat
    buffers of the group (each parameter's state tensors are views of them)."""

    def __init__(
        self, names: list[str], arrays: list[np.ndarray], slots: tuple[str, ...], buffers: int
    ) -> None:
        self.names, self.arrays = names, arrays
        self.sources = [a.reshape(-1) for a in arrays]  # views of the live parameters
        offsets = np.cumsum([0, *(a.size for a in arrays)])
        dtype = arrays[0].dtype
        self.p, self.g = np.empty(offsets[-1], dtype), np.empty(offsets[-1], dtype)
        self.slots = [np.zeros(offsets[-1], dtype) for _ in slots]
        self.scratch = [np.empty(offsets[-1], dtype) for _ in range(buffers)]

        def views(flat: np.ndarray) -> list[np.ndarray]:
            return [flat[i:j].reshape(a.shape) for i, j, a in zip(offsets[:-1], offsets[1:], arrays)]

        self.p_views = views(self.p)
        self.slot_views = [views(flat) for flat in self.slots]

    def run(self, opt: _Defined, given: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> bool:
        """One update of every parameter of the group; False (nothing done) when it cannot be one
        call: a parameter without a gradient, replaced, or at another step than the others."""
        names = self.names
        if len(given) != len(names):
            return False
        pairs = [given[n] for n in names]
        if not all(map(is_, [pg[0] for pg in pairs], self.arrays)):
            return False
        states = [opt.state[n] for n in names]
        index = opt._index
        indices = [index(s) for s in states]
        if indices.count(indices[0]) != len(indices):
            return False
        t, first = indices[0]
        for slot, views in zip(opt._program.slots, self.slot_views):
            if all(map(is_, [s.get(slot) for s in states], views)):
                continue
            for state, view in zip(states, views):
                current = state.get(slot)
                if current is None:
                    if not first:
                        return False  # as the parameter's own update: its state is incomplete
                    view.fill(0)
                elif current is not view:  # replaced from outside: adopt its values
                    np.copyto(view, current)
                state[slot] = view
        np.concatenate(self.sources, out=self.p)
        np.concatenate([pg[1] for pg in pairs], axis=None, out=self.g)
        opt._plan.run(self.p, self.g, *self.slots, *self.scratch, *opt._operands_for(t, first)[1])
        for dst, src in zip(self.arrays, self.p_views):
            np.copyto(dst, src)
        if opt.definition.counts_steps:
            for state in states:
                state["step"] = t
        return True


def _groups(params: Mapping[str, np.ndarray], plan: _Plan, slots: tuple[str, ...]) -> list[_Group]:
    """The groups of the small parameters of ``params``, one per type: contiguous arrays of at
    most ``_GROUP_ELEMENTS_PER_CALL`` elements per call of ``plan``, sharing no memory with another
    parameter (tied arrays keep their own updates, one after the other), enough of them to save
    ``_GROUP_MIN_CALLS`` calls."""
    shared, end, last = set(), -1, None
    for start, size, name in sorted(
        (p.__array_interface__["data"][0], p.nbytes, name) for name, p in params.items() if p.nbytes
    ):
        if start < end:
            shared |= {name, last}
        if start + size > end:
            end, last = start + size, name
    calls = max(len(plan.steps), 1)
    by_type: dict[np.dtype, list[str]] = {}
    for name, p in params.items():
        if 0 < p.size <= _GROUP_ELEMENTS_PER_CALL * calls and p.flags.c_contiguous and name not in shared:
            by_type.setdefault(p.dtype, []).append(name)
    return [
        _Group(names, [params[n] for n in names], slots, plan.buffers)
        for names in by_type.values()
        if len(names) > 1 and len(names) * calls >= _GROUP_MIN_CALLS
    ]


def _scalars(program: Program, plan: _Plan, lr: float, t: int, first: bool) -> list[Any]:
    """The operands of ``plan`` for one step: scalars in Python floats (double) or float32 as the
    program says, and constants."""
    f32 = program.scalar_float32
    inputs = {"lr": np.float32(lr) if f32 else lr, "t": t, "first": first}
    values: dict[Any, Any] = {k: inputs[name] for k, name in plan.scalar_inputs.items()}
    for op, args, out in plan.scalar_steps:
        values[out] = evaluate_scalar(op, [values[a] if isinstance(a, int) else a for a in args], f32)
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
