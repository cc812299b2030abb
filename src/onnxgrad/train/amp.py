"""Mixed precision: float32 master weights and dynamic loss scaling for float16 / bfloat16 models.

A half-precision model computes in half precision, but its parameters cannot be updated there: an
update ``lr * grad`` below half an ulp of the weight (2^-11 relative in float16, 2^-8 in bfloat16)
is lost, and float16 gradients below 6e-8 flush to zero. As ``torch.amp`` does, training keeps:

- **master weights** (:class:`MasterWeights`): a float32 copy of every half-precision parameter;
  the optimizer updates the copies, which are then rounded into the model's live buffers;
- **dynamic loss scaling** (:class:`LossScaler`, the semantics of ``torch.amp.GradScaler``): the
  backward is seeded with ``scale`` instead of 1, so that small gradients survive in float16; the
  gradients are unscaled in float32; a step whose gradients hold an inf or a NaN is skipped and the
  scale halved; after ``growth_interval`` steps in a row without one, the scale doubles.

:class:`MixedPrecision` ties both to an optimizer; :class:`onnxgrad.train.Trainer` builds one from
its ``master_weights=`` and ``loss_scale=`` arguments. bfloat16 has float32's range: like torch,
``loss_scale="auto"`` scales float16 models only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from ..errors import InputError

__all__ = [
    "LossScaler",
    "MasterWeights",
    "MasterWeightsChoice",
    "MixedPrecision",
    "half_dtype",
    "is_half",
    "mixed_precision",
    "use_master_weights",
]

MasterWeightsChoice = bool | Literal["auto"]


def is_half(dtype: Any) -> bool:
    """float16 or bfloat16: a numpy dtype (ml_dtypes' bfloat16 is one named 'bfloat16') or a
    ``torch.dtype`` (``torch.float16`` / ``torch.bfloat16``, recognised by name: no torch import)."""
    name = dtype.name if isinstance(dtype, np.dtype) else str(dtype).removeprefix("torch.")
    return name in ("float16", "bfloat16")


def use_master_weights(master_weights: MasterWeightsChoice, dtypes: Iterable[Any]) -> bool:
    """Whether the half-precision parameters get float32 master weights: the one rule of every
    front end (``Trainer(master_weights=)``, ``OnnxModule(master_weights=)``).

    ``master_weights``: ``True``, ``False``, or ``"auto"``: master weights when some parameter is
    float16 or bfloat16 (``dtypes``: those of the trainable parameters, numpy or torch dtypes).
    Either way, only the half-precision parameters get a float32 copy; float32 and float64 ones are
    updated as they are.
    """
    if master_weights == "auto":
        return any(is_half(d) for d in dtypes)
    if isinstance(master_weights, bool):
        return master_weights
    raise InputError(f"master_weights must be True, False or 'auto', got {master_weights!r}")


def half_dtype(params: Mapping[str, np.ndarray]) -> np.dtype | None:
    """The half-precision dtype of ``params`` (float16 first), ``None`` when none is half."""
    halves = {np.asarray(p).dtype for p in params.values() if is_half(np.asarray(p).dtype)}
    if not halves:
        return None
    return np.dtype(np.float16) if np.dtype(np.float16) in halves else halves.pop()


class LossScaler:
    """Dynamic loss scaling with the semantics and defaults of ``torch.amp.GradScaler``.

    ``init_scale``: the first scale; ``growth_factor`` / ``backoff_factor``: what the scale is
    multiplied by after ``growth_interval`` good steps in a row / after a step with an inf or NaN
    gradient (which is skipped). ``dynamic=False`` keeps ``init_scale`` for good (a static scale;
    steps with inf or NaN gradients are still skipped).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        dynamic: bool = True,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise InputError(f"init_scale must be a finite number > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise InputError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise InputError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise InputError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.dynamic = growth_interval, bool(dynamic)
        self.good_steps = 0  # steps in a row without inf / NaN since the scale last changed
        self.skipped = 0  # steps skipped so far

    def unscale(self, grads: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], bool]:
        """The gradients in float32 divided by the scale, and whether any holds an inf or a NaN."""
        out, found = {}, False
        inv = np.float32(1.0 / self.scale)
        for name, g in grads.items():
            g32 = np.asarray(g, dtype=np.float32) * inv
            found = found or not bool(np.isfinite(g32).all())
            out[name] = g32
        return out, found

    def update(self, found_inf: bool) -> None:
        """After a step: back off (the step was skipped) or count it, growing every interval."""
        if found_inf:
            self.skipped += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale *= self.backoff_factor
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped = int(state["skipped"])


class MasterWeights:
    """float32 copies of the half-precision arrays of ``live`` (the model's parameter buffers).

    :attr:`params` is what an optimizer updates: the float32 copy of each half-precision parameter,
    the live array itself for the others. :meth:`sync` rounds the copies into the live buffers.
    """

    def __init__(self, live: Mapping[str, np.ndarray]) -> None:
        self.live = dict(live)
        self.master = {k: v.astype(np.float32) for k, v in self.live.items() if is_half(v.dtype)}
        self.params = {k: self.master.get(k, v) for k, v in self.live.items()}

    def sync(self) -> None:
        """Round the float32 copies into the live half-precision buffers (in place)."""
        for name, m in self.master.items():
            self.live[name][...] = m.astype(self.live[name].dtype)

    def load(self, values: Mapping[str, np.ndarray]) -> None:
        """Set the float32 copies (and the live buffers) from ``values`` (any float dtype)."""
        for name, value in values.items():
            if name in self.master:
                np.copyto(self.master[name], np.asarray(value, dtype=np.float32))
        self.sync()


class MixedPrecision:
    """Master weights and loss scaling around an optimizer step; either may be absent.

    Use: build the optimizer over :attr:`params`; seed the backward with :meth:`seed`; pass each
    backward's gradients through :meth:`unscale`; update with :meth:`step` (it skips the step when
    some gradient since the last step held an inf or a NaN, then updates the scale).
    """

    def __init__(self, live: Mapping[str, np.ndarray], master: bool, scaler: LossScaler | None) -> None:
        self.weights = MasterWeights(live) if master else None
        self.scaler = scaler
        self.params: dict[str, np.ndarray] = self.weights.params if self.weights else dict(live)
        self.found_inf = False  # since the last step

    def seed(self, seed: np.ndarray) -> np.ndarray:
        """The gradient fed to the loss output: ``seed * scale``.

        A float16 loss cannot hold torch's first scale (2^16 > 65504): a seed that overflows its
        dtype would be an inf by construction, and the dynamic scale backs off first, without
        skipping a step (GradScaler would skip the first step to get there).
        """
        if self.scaler is None:
            return seed
        top = float(np.finfo(seed.dtype).max) if seed.dtype.kind == "f" else math.inf
        peak = float(np.abs(seed).max(initial=0.0))
        while self.scaler.dynamic and self.scaler.scale * peak > top:
            self.scaler.scale *= self.scaler.backoff_factor
        return seed * np.asarray(self.scaler.scale, dtype=seed.dtype)

    def unscale(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """float32 gradients of the unscaled loss (the inf / NaN found is kept for :meth:`step`)."""
        if self.scaler is None:
            if self.weights is None:
                return dict(grads)
            return {k: np.asarray(g, dtype=np.float32) for k, g in grads.items()}
        out, found = self.scaler.unscale(grads)
        self.found_inf = self.found_inf or found
        return out

    def step(self, optimizer: Any, grads: Mapping[str, np.ndarray]) -> bool:
        """``optimizer.step(grads)`` unless an inf / NaN gradient was seen; returns whether it ran."""
        found, self.found_inf = self.found_inf, False
        if not found:
            optimizer.step(grads)
            if self.weights is not None:
                self.weights.sync()
        if self.scaler is not None:
            self.scaler.update(found)
        return not found

    def state_dict(self) -> dict[str, Any]:
        return {
            "master": dict(self.weights.master) if self.weights else {},
            "scaler": self.scaler.state_dict() if self.scaler else {},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.weights is not None and state.get("master"):
            self.weights.load(state["master"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def mixed_precision(
    live: Mapping[str, np.ndarray],
    master_weights: MasterWeightsChoice = "auto",
    loss_scale: str | float | LossScaler | None = "auto",
) -> MixedPrecision | None:
    """The :class:`MixedPrecision` that ``Trainer(master_weights=..., loss_scale=...)`` asks for.

    ``master_weights``: ``True``, ``False``, or ``"auto"`` (see :func:`use_master_weights`).
    ``loss_scale``: ``"dynamic"`` (a :class:`LossScaler` with torch's defaults), a
    number (a static scale), a :class:`LossScaler`, ``None`` (none), or ``"auto"`` (dynamic when some
    parameter is float16, none otherwise). ``None`` when neither is wanted.
    """
    half = half_dtype(live)
    master = use_master_weights(master_weights, (np.asarray(p).dtype for p in live.values()))
    if isinstance(loss_scale, LossScaler):
        scaler: LossScaler | None = loss_scale
    elif loss_scale == "auto":
        scaler = LossScaler() if half == np.float16 else None
    elif loss_scale == "dynamic":
        scaler = LossScaler()
    elif loss_scale is None:
        scaler = None
    elif isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
        scaler = LossScaler(float(loss_scale), dynamic=False)
    else:
        raise InputError(
            f"loss_scale must be 'auto', 'dynamic', a number, a LossScaler or None, got {loss_scale!r}"
        )
    if not master and scaler is None:
        return None
    return MixedPrecision(live, master, scaler)
