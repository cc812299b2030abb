"""The optimizer registry: one definition of each optimizer, below every front end.

A :class:`Definition` names an optimizer, its hyperparameters with their defaults, the state
tensors each parameter carries (*slots*), its formula family (``"torch"``: ``torch.optim``'s
updates; ``"onnxruntime-training"``: the ``AdamWOptimizer`` (``adam_mode=1``) and
``SGDOptimizerV2`` kernels of onnxruntime-training 1.19.2) and its update, written once as a
*formula* against the tiny :class:`Ops` interface. Tracing a formula gives a :class:`Program`, a
straight-line list of elementwise instructions that every backend runs:

* the numpy optimizers (:mod:`onnxgrad.train.optim`) execute it in place, in buffers planned once;
* the ONNX update graphs (:mod:`onnxgrad.artifacts.optim`) emit it as nodes: the one-graph step of
  :func:`onnxgrad.artifacts.generate` and the optimizer model of :mod:`onnxgrad.compat.training`.

Both backends run the same operations in the same order and types, so the numpy step and the ONNX
step give the same numbers. Values of a program are *tensors* (per parameter, in its type) or
*scalars* (per step, the same for every parameter: computed in double, or in float32 for the
onnxruntime-training family whose learning rate is a float32, then cast once to the parameter's
type, as numpy rounds a Python float meeting a float32 array). The scalar inputs are ``lr``, ``t``
(the 1-based index of this update) and ``first`` (whether no update was made yet).

:data:`DEFAULT_OPTIMIZER` (``"adamw"``) is the optimizer every front end uses when none is named,
and :data:`DEFAULT_LR` (1e-3, the default of ``torch.optim.Adam`` and ``AdamW``) its learning rate
when none is given; options are always passed as one mapping, ``optimizer_options=``
(:func:`optimizer_options`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = [
    "DEFAULT_LR",
    "DEFAULT_OPTIMIZER",
    "DEFINITIONS",
    "LR_MAX",
    "ORT",
    "TORCH",
    "Definition",
    "Instruction",
    "Ops",
    "Program",
    "Value",
    "check_lr",
    "definition",
    "optimizer_options",
]

DEFAULT_OPTIMIZER = "adamw"
DEFAULT_LR = 1e-3  # torch.optim.Adam's and AdamW's: every front end's learning rate when none is given
TORCH, ORT = "torch", "onnxruntime-training"  # the formula families
SCALAR_INPUTS = ("lr", "t", "first")


# ---- programs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Value:
    """A value of a program: ``scalar`` ones are per step, the others per parameter (tensors)."""

    id: int
    scalar: bool
    input: str | None = None  # "p", "g", a slot name, or a scalar input; None when computed


Arg = Value | float


@dataclass(frozen=True)
class Instruction:
    """``out = op(*args)``; an argument is a :class:`Value` or a Python float constant."""

    op: str
    args: tuple[Arg, ...]
    out: Value


@dataclass
class Program:
    """A traced formula: instructions in order, and the value each output (``"p"``, every slot)
    takes after the update."""

    instructions: list[Instruction]
    outputs: dict[str, Value]
    slots: tuple[str, ...]
    scalar_float32: bool  # per-step scalars computed in float32 rather than double


TENSOR_OPS = ("add", "sub", "mul", "div", "sqrt", "where")
SCALAR_OPS = ("add", "sub", "mul", "div", "sqrt", "neg", "pow", "one_minus_pow")


class Ops:
    """What a formula writes with: elementwise ``add``, ``sub``, ``mul``, ``div``, ``sqrt``,
    ``where(cond, a, b)``; on scalars also ``neg``, ``pow(base, t)`` and ``one_minus_pow(beta, t)``
    (``1 - beta**t``, computed without cancellation where scalars are float32). The scalar inputs
    are :attr:`lr`, :attr:`t` and :attr:`first`. Calls record instructions (it traces)."""

    def __init__(self) -> None:
        self.instructions: list[Instruction] = []
        self._ids = 0
        self.lr, self.t, self.first = (self._input(n, scalar=True) for n in SCALAR_INPUTS)

    def _input(self, name: str, scalar: bool) -> Value:
        self._ids += 1
        return Value(self._ids, scalar, name)

    def _emit(self, op: str, *args: Arg) -> Value:
        values = [a for a in args if isinstance(a, Value)]
        if not values:
            raise InputError(f"optimizer formula: {op} of constants only; compute it in Python")
        scalar = all(v.scalar for v in (values[1:] if op == "where" else values))
        if op not in (SCALAR_OPS if scalar else TENSOR_OPS):
            raise InputError(f"optimizer formula: no {'scalar' if scalar else 'tensor'} op {op!r}")
        self._ids += 1
        out = Value(self._ids, scalar)
        self.instructions.append(
            Instruction(op, tuple(float(a) if not isinstance(a, Value) else a for a in args), out)
        )
        return out

    def add(self, a: Arg, b: Arg) -> Value:
        return self._emit("add", a, b)

    def sub(self, a: Arg, b: Arg) -> Value:
        return self._emit("sub", a, b)

    def mul(self, a: Arg, b: Arg) -> Value:
        return self._emit("mul", a, b)

    def div(self, a: Arg, b: Arg) -> Value:
        return self._emit("div", a, b)

    def sqrt(self, a: Value) -> Value:
        return self._emit("sqrt", a)

    def neg(self, a: Value) -> Value:
        return self._emit("neg", a)

    def pow(self, base: float, t: Value) -> Value:
        return self._emit("pow", base, t)

    def one_minus_pow(self, beta: float, t: Value) -> Value:
        return self._emit("one_minus_pow", beta, t)

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        """``a`` where the scalar ``cond`` holds, else ``b``."""
        if not cond.scalar:
            raise InputError("optimizer formula: where() takes a scalar condition")
        return self._emit("where", cond, a, b)


Formula = Callable[[Ops, Mapping[str, Any], Value, Value, dict[str, Value]], tuple[Value, dict[str, Value]]]


# ---- definitions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Definition:
    """One optimizer: everything the numpy step, the ONNX step and the compat graphs are made from."""

    name: str
    family: str  # TORCH or ORT
    defaults: Mapping[str, Any]  # every hyperparameter and its default
    slots: Callable[[Mapping[str, Any]], tuple[str, ...]]  # state tensors per parameter, by hyper
    formula: Formula
    validate: Callable[[dict[str, Any]], None] = lambda hyper: None  # may normalize in place
    counts_steps: bool = False  # numpy keeps state["step"], the updates made to each parameter
    doc: str = ""
    nonnegative: tuple[str, ...] = ()  # state slots that are >= 0 by construction (second moments)
    _programs: dict = field(default_factory=dict, compare=False, repr=False)

    def resolve(self, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The hyperparameters: ``options`` over the defaults, validated (:class:`InputError` for an
        unknown name or a bad value)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise InputError(
                f"unknown option(s) {unknown} of optimizer {self.name!r}; it takes {sorted(self.defaults)}"
            )
        hyper = {**self.defaults, **options}
        self.validate(hyper)
        return hyper

    def program(self, hyper: Mapping[str, Any]) -> Program:
        """The formula traced for ``hyper`` (cached)."""
        key = tuple(sorted((k, _hashable(v)) for k, v in hyper.items()))
        if key not in self._programs:
            o = Ops()
            slots = tuple(self.slots(hyper))
            p, g = o._input("p", scalar=False), o._input("g", scalar=False)
            state = {s: o._input(s, scalar=False) for s in slots}
            new_p, new_state = self.formula(o, hyper, p, g, state)
            if set(new_state) != set(slots):
                raise InputError(
                    f"optimizer {self.name!r}: the formula updates {sorted(new_state)}, not {slots}"
                )
            self._programs[key] = Program(
                o.instructions, {"p": new_p, **new_state}, slots, scalar_float32=self.family == ORT
            )
        return self._programs[key]


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list | tuple) else v


# the largest rate (and hyperparameter) a float32 update holds: float32's largest value
LR_MAX = float(np.finfo(np.float32).max)
NOT_A_RATE = (str, bytes, bool, np.bool_)  # convert to a float, yet no learning rate


def as_float(value: Any) -> float | None:
    """``float(value)``, or ``None`` when it does not convert."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_lr(lr: Any) -> float:
    """The learning rate as a float: a real number (no string, no bool), finite, >= 0 and at
    most :data:`LR_MAX` (float32's largest value), :class:`InputError` otherwise.

    The one check of every door that takes a learning rate (the numpy optimizers and so
    :class:`~onnxgrad.train.Trainer` and ``onnxgrad train``, :func:`onnxgrad.artifacts.generate` and
    ``onnxgrad artifacts``, :class:`onnxgrad.artifacts.Runner`, each value a schedule returns; the
    JavaScript ``checkLearningRate`` holds the same rule): a negative rate climbs the loss, an
    infinite or NaN one turns every parameter into NaN, and one beyond float32's range overflows the
    float32 update (every parameter inf or NaN while the step reports a normal loss)."""
    value = None if isinstance(lr, NOT_A_RATE) else as_float(lr)
    if value is None:
        raise InputError(f"lr must be a number >= 0, got {lr!r}")
    if not (math.isfinite(value) and value >= 0):
        raise InputError(
            f"lr must be >= 0, got {value}: a finite number (a negative rate climbs the loss, an "
            "infinite or NaN one makes every parameter NaN)"
        )
    if value > LR_MAX:
        raise InputError(
            f"lr must be at most {LR_MAX} (float32's largest value), got {value}: a larger rate "
            "overflows the float32 update (every parameter inf or NaN)"
        )
    return value


def _number(hyper: Mapping[str, Any], key: str) -> float:
    """``hyper[key]`` as a float: a number (not a bool) whose size float32 holds (the update graphs
    and float32 parameters compute with it: 1e39 overflowed to inf there), :class:`InputError`
    otherwise."""
    value = hyper[key]
    number = None if isinstance(value, bool | str | bytes) else as_float(value)
    if number is None:
        raise InputError(f"{key} must be a number, got {value!r}")
    if math.isfinite(number) and abs(number) > LR_MAX:
        raise InputError(
            f"{key} must fit in float32 (at most {LR_MAX:.4g} in size), got {value!r}: the "
            "update computes in float32, where it would be infinite"
        )
    return number


def _non_negative(hyper: Mapping[str, Any], *names: str) -> None:
    for key in names:
        value = _number(hyper, key)
        if not (math.isfinite(value) and value >= 0):
            raise InputError(f"{key} must be a finite number >= 0, got {hyper[key]!r}")


def _positive(hyper: Mapping[str, Any], *names: str) -> None:
    for key in names:
        value = _number(hyper, key)
        if not (math.isfinite(value) and value > 0):
            raise InputError(f"{key} must be a finite number > 0, got {hyper[key]!r}")


def _check_betas(betas: Any) -> None:
    ok = isinstance(betas, list | tuple) and len(betas) == 2
    ok = ok and all(isinstance(b, int | float | np.floating | np.integer) and 0 <= b < 1 for b in betas)
    if not ok:
        raise InputError(f"betas must be in [0, 1), got {betas!r}")


# torch.optim.SGD: d = g + wd p; b = d on the first step, then b = μ b + (1 - dampening) d;
# d = d + μ b (Nesterov) or d = b; p -= lr d
def _sgd(o: Ops, h: Mapping[str, Any], p: Value, g: Value, s: dict[str, Value]):
    d = o.add(o.mul(p, h["weight_decay"]), g) if h["weight_decay"] else g
    neg_lr = o.neg(o.lr)
    if not h["momentum"]:
        return o.add(p, o.mul(d, neg_lr)), {}
    later = o.mul(s["momentum_buffer"], h["momentum"])
    later = o.add(later, o.mul(d, 1.0 - h["dampening"]) if h["dampening"] else d)
    buf = o.where(o.first, d, later)
    if h["nesterov"]:  # p -= lr d; p -= lr μ b
        new_p = o.add(o.add(p, o.mul(d, neg_lr)), o.mul(buf, o.mul(neg_lr, h["momentum"])))
    else:
        new_p = o.add(p, o.mul(buf, neg_lr))
    return new_p, {"momentum_buffer": buf}


def _validate_sgd(h: dict[str, Any]) -> None:
    _non_negative(h, "momentum", "weight_decay", "dampening")
    h["momentum"], h["weight_decay"], h["dampening"] = map(
        float, (h["momentum"], h["weight_decay"], h["dampening"])
    )
    h["nesterov"] = bool(h["nesterov"])
    if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise InputError("Nesterov momentum requires momentum > 0 and dampening = 0")


def _adam_formula(decoupled: bool) -> Formula:
    """torch.optim.Adam (L2 decay added to the gradient) or AdamW (``p *= 1 - lr wd`` first):
    ``m ← m + (1-β1)(g - m)``, ``v ← β2 v + (1-β2) g²``,
    ``p += (-lr √(1-β2^t) / (1-β1^t)) m / (√v + eps √(1-β2^t))``.

    torch divides the tensor ``√v`` by ``√(1-β2^t)``; multiplying the two per-step scalars by it
    instead is the same value in one pass fewer per parameter (13), within two float32 roundings
    of torch's order (``docs/performance.md``, optimizer updates)."""

    def adam(o: Ops, h: Mapping[str, Any], p: Value, g: Value, s: dict[str, Value]):
        beta1, beta2 = h["betas"]
        wd = h["weight_decay"]
        if wd and decoupled:
            p_in = o.mul(p, o.sub(1.0, o.mul(o.lr, wd)))
        else:
            p_in = p
            if wd:
                g = o.add(o.mul(p, wd), g)
        m, v = s["exp_avg"], s["exp_avg_sq"]
        new_m = o.add(m, o.mul(o.sub(g, m), 1.0 - beta1))
        new_v = o.add(o.mul(v, beta2), o.mul(o.mul(g, g), 1.0 - beta2))
        root2 = o.sqrt(o.one_minus_pow(beta2, o.t))
        denom = o.add(o.sqrt(new_v), o.mul(root2, h["eps"]))
        step_size = o.div(o.mul(o.neg(o.lr), root2), o.one_minus_pow(beta1, o.t))
        new_p = o.add(p_in, o.mul(o.div(new_m, denom), step_size))
        return new_p, {"exp_avg": new_m, "exp_avg_sq": new_v}

    return adam


def _validate_adam(h: dict[str, Any]) -> None:
    _check_betas(h["betas"])
    _positive(h, "eps")
    _non_negative(h, "weight_decay")
    h["betas"] = (float(h["betas"][0]), float(h["betas"][1]))
    h["eps"], h["weight_decay"] = float(h["eps"]), float(h["weight_decay"])


# onnxruntime-training 1.19.2, AdamWOptimizer with adam_mode=1 (Hugging Face's AdamW):
# m = α m + (1-α) g; v = β v + (1-β) g²; lr_t = lr √(1-β^t) / (1-α^t) (when correct_bias);
# p = p - lr_t m / (√v + ε); then p = p - (lr wd) p when weight_decay > 0
def _ort_adamw(o: Ops, h: Mapping[str, Any], p: Value, g: Value, s: dict[str, Value]):
    alpha, beta = h["alpha"], h["beta"]
    m = o.add(o.mul(s["momentum0"], alpha), o.mul(g, 1.0 - alpha))
    v = o.add(o.mul(s["momentum1"], beta), o.mul(o.mul(g, g), 1.0 - beta))
    lr_t = o.lr
    if h["correct_bias"]:
        lr_t = o.div(o.mul(o.lr, o.sqrt(o.sub(1.0, o.pow(beta, o.t)))), o.sub(1.0, o.pow(alpha, o.t)))
    new_p = o.sub(p, o.mul(lr_t, o.div(m, o.add(o.sqrt(v), h["epsilon"]))))
    if h["weight_decay"] > 0:
        new_p = o.sub(new_p, o.mul(o.mul(o.lr, h["weight_decay"]), new_p))
    return new_p, {"momentum0": m, "momentum1": v}


def _validate_ort_adamw(h: dict[str, Any]) -> None:
    if int(h["adam_mode"]) != 1:
        raise InputError(
            "AdamWOptimizer with adam_mode=0 (torch's variant) is not supported; 1.19.2 writes 1"
        )
    _check_betas((h["alpha"], h["beta"]))
    _positive(h, "epsilon")
    _non_negative(h, "weight_decay")
    for k in ("alpha", "beta", "epsilon", "weight_decay"):
        h[k] = float(h[k])
    h["correct_bias"], h["adam_mode"] = int(bool(h["correct_bias"])), 1


def _ort_sgd(o: Ops, h: Mapping[str, Any], p: Value, g: Value, s: dict[str, Value]):
    return o.sub(p, o.mul(o.lr, g)), {}  # SGDOptimizerV2: p = p - lr g


def _torch_adam(name: str, *, decoupled: bool, weight_decay: float, doc: str) -> Definition:
    """torch.optim.Adam (``decoupled=False``) or AdamW: the same moments, state, checks and
    defaults but ``weight_decay``'s."""
    return Definition(
        name=name,
        family=TORCH,
        defaults={"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay},
        slots=lambda h: ("exp_avg", "exp_avg_sq"),
        formula=_adam_formula(decoupled=decoupled),
        validate=_validate_adam,
        counts_steps=True,
        doc=doc,
        nonnegative=("exp_avg_sq",),
    )


DEFINITIONS: dict[str, Definition] = {
    d.name: d
    for d in (
        Definition(
            name="sgd",
            family=TORCH,
            defaults={"momentum": 0.0, "nesterov": False, "weight_decay": 0.0, "dampening": 0.0},
            slots=lambda h: ("momentum_buffer",) if h["momentum"] else (),
            formula=_sgd,
            validate=_validate_sgd,
            doc="torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay",
        ),
        _torch_adam(
            "adam",
            decoupled=False,
            weight_decay=0.0,
            doc="torch.optim.Adam: bias-corrected moments, L2 weight decay",
        ),
        _torch_adam(
            "adamw",
            decoupled=True,
            weight_decay=1e-2,
            doc="torch.optim.AdamW: Adam with decoupled weight decay (p *= 1 - lr wd)",
        ),
        Definition(
            name="AdamWOptimizer",
            family=ORT,
            defaults={
                "alpha": 0.9,
                "beta": 0.999,
                "epsilon": 1e-8,
                "weight_decay": 0.0,
                "correct_bias": 1,
                "adam_mode": 0,
            },
            slots=lambda h: ("momentum0", "momentum1"),
            formula=_ort_adamw,
            validate=_validate_ort_adamw,
            counts_steps=True,
            nonnegative=("momentum1",),
            doc="onnxruntime-training's AdamWOptimizer node: its attributes and their defaults",
        ),
        Definition(
            name="SGDOptimizerV2",
            family=ORT,
            defaults={},
            slots=lambda h: (),
            formula=_ort_sgd,
            doc="onnxruntime-training's SGDOptimizerV2 node",
        ),
    )
}
"""Every optimizer, by name: torch's family (what ``optimizer="..."`` names in every front end)
and onnxruntime-training's (what :mod:`onnxgrad.compat.training` runs)."""


def definition(name: str, family: str | None = TORCH) -> Definition:
    """The definition named ``name`` (torch's, case-insensitive, by default); :class:`InputError`
    listing the known ones otherwise."""
    known = {d.name.lower(): d for d in DEFINITIONS.values() if family is None or d.family == family}
    found = known.get(str(name).lower())
    if found is None:
        raise InputError(f"unknown optimizer {name!r}; expected one of {[d.name for d in known.values()]}")
    return found


def optimizer_options(
    optimizer_options: Mapping[str, Any] | None, legacy: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The one way to pass options, ``optimizer_options={...}``; options given the old way
    (``legacy``: keywords of ``where``) still work, with a :class:`DeprecationWarning`."""
    options = dict(optimizer_options or {})
    if legacy:
        warnings.warn(
            f"{where}: passing optimizer options as keywords ({', '.join(sorted(legacy))}) is deprecated; "
            "pass optimizer_options={...}",
            DeprecationWarning,
            stacklevel=3,
        )
        both = sorted(set(options) & set(legacy))
        if both:
            raise InputError(f"{where}: {both} given both as keywords and in optimizer_options")
        options.update(legacy)
    return options


def evaluate_scalar(op: str, args: list[Any], float32: bool) -> Any:
    """One scalar instruction in Python (double) or numpy float32 arithmetic."""
    if float32:
        args = [np.float32(a) for a in args]
    one = np.float32(1.0) if float32 else 1.0
    a = args[0]
    if op == "add":
        return a + args[1]
    if op == "sub":
        return a - args[1]
    if op == "mul":
        return a * args[1]
    if op == "div":
        return a / args[1]
    if op == "neg":
        return -a
    if op == "sqrt":
        return np.sqrt(a) if float32 else math.sqrt(a)
    if op == "pow":
        return a ** args[1]
    if op == "one_minus_pow":
        return one - a ** args[1]
    raise InputError(f"no scalar op {op!r}")
