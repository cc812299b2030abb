"""``CheckpointState``: parameters, their gradients, the optimizer state and user properties."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import numpy as np

from ....errors import InputError, InputTypeError, NotFoundError, OnnxGradRuntimeError
from .. import checkpoint_file
from ..checkpoint_file import CheckpointData, OptimizerGroup

__all__ = ["CheckpointState", "Parameter", "Parameters", "Properties"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # float properties are stored as float32


class Parameter:
    """One parameter of a :class:`CheckpointState`: ``data`` (read and write), ``grad`` (the
    accumulated gradient, ``None`` before the first training call), ``requires_grad``."""

    def __init__(self, name: str, state: CheckpointState) -> None:
        self._name, self._state = name, state

    @property
    def name(self) -> str:
        return self._name

    @property
    def data(self) -> np.ndarray:
        return self._state._values()[self._name].copy()

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._state._set(self._name, value)

    @property
    def grad(self) -> np.ndarray | None:
        grad = self._state._grads.get(self._name)
        return None if grad is None else grad.copy()

    @property
    def requires_grad(self) -> bool:
        return self._name in self._state._data.trainable

    def __repr__(self) -> str:
        return f"Parameter(name={self.name}, requires_grad={self.requires_grad})"


class Parameters:
    """The parameters by name; iterating gives ``(name, Parameter)`` in alphabetical order (as
    onnxruntime-training's). A nominal checkpoint (names and shapes, no values) answers ``in`` and
    ``len`` but raises :class:`~onnxgrad.errors.OnnxGradRuntimeError` (a ``RuntimeError``, as
    1.19.2) on reading or writing a parameter until ``Module.copy_buffer_to_parameters`` fills it."""

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        self._state._check_loaded(
            "Cannot get parameter from a nominal state. Please load the parameter states first"
        )
        if name not in self:
            raise NotFoundError(f"Parameter {name} not found.")
        return Parameter(name, self._state)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self._state._check_loaded(
            "Cannot copy parameter to a nominal state. Please load all the parameter states first"
        )
        if name not in self:
            raise NotFoundError(f"Parameter {name} not found.")
        self._state._set(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._state._values()

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        for name in sorted(self._state._values()):
            yield name, self[name]

    def __len__(self) -> int:
        return len(self._state._values())

    def __repr__(self) -> str:
        return repr(sorted(self._state._values()))


class Properties:
    """User properties (int, float or str values) saved with the checkpoint."""

    def __init__(self, state: CheckpointState) -> None:
        self._props = state._data.properties

    def __getitem__(self, name: str) -> int | float | str:
        if name not in self._props:
            raise NotFoundError(f"Property {name} not found.")
        return self._props[name]

    def __setitem__(self, name: str, value: int | float | str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str, np.integer, np.floating)):
            raise InputError(f"property {name!r}: values are int, float or str, got {type(value).__name__}")
        if isinstance(value, (int, np.integer)):
            value = int(value)
            if not -(2**63) <= value < 2**63:
                raise InputError(
                    f"property {name!r}: {value} does not fit the checkpoint's int64 properties "
                    "(from -2**63 to 2**63 - 1); store it as a str"
                )
        elif isinstance(value, (float, np.floating)):
            value = float(value)
            if math.isfinite(value) and abs(value) > _FLOAT32_MAX:
                raise InputError(
                    f"property {name!r}: {value} does not fit the checkpoint's float32 properties "
                    f"(at most {_FLOAT32_MAX:.7g} in magnitude); store it as a str"
                )
        self._props[name] = value

    def __contains__(self, name: object) -> bool:
        return name in self._props

    def __iter__(self) -> Iterator[tuple[str, int | float | str]]:
        for name in sorted(self._props):
            yield name, self._props[name]

    def __len__(self) -> int:
        return len(self._props)

    def __repr__(self) -> str:
        return repr(sorted(self._props))


class CheckpointState:
    """Everything a training session carries: load one with :meth:`load_checkpoint`."""

    def __init__(self, data: CheckpointData) -> None:
        if not isinstance(data, CheckpointData):
            raise InputTypeError(f"Invalid argument for CheckpointState received {type(data)}")
        self._data = data
        self._grads: dict[str, np.ndarray] = {}
        self._parameters = Parameters(self)
        self._properties = Properties(self)

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Read a checkpoint file (complete or nominal) written by onnxgrad or onnxruntime-training."""
        return cls(checkpoint_file.load(checkpoint_uri))

    @classmethod
    def save_checkpoint(
        cls, state: CheckpointState, checkpoint_uri: str | os.PathLike, include_optimizer_state: bool = False
    ) -> None:
        """Write ``state`` (parameters, properties and, when asked, the optimizer state) in
        onnxruntime-training's format."""
        if not isinstance(state, CheckpointState):
            raise InputError(f"save_checkpoint takes a CheckpointState, got {type(state).__name__}")
        d = state._data
        data = CheckpointData(
            trainable=dict(d.trainable),
            frozen=dict(d.frozen),
            nominal=d.nominal,
            groups=list(d.groups) if include_optimizer_state else [],
            properties=dict(d.properties),
        )
        checkpoint_file.save(checkpoint_uri, data)

    @property
    def parameters(self) -> Parameters:
        return self._parameters

    @property
    def properties(self) -> Properties:
        return self._properties

    # ---- for Module and Optimizer ---------------------------------------------------------------
    def _check_loaded(self, message: str) -> None:
        """Raise ``message`` while the state is nominal: its parameters have no values yet."""
        if self._data.nominal:
            raise OnnxGradRuntimeError(message)

    def _values(self) -> dict[str, np.ndarray]:
        return {**self._data.trainable, **self._data.frozen}

    def _set(self, name: str, value: np.ndarray) -> None:
        d = self._data
        where = d.trainable if name in d.trainable else d.frozen
        old = where[name]
        arr = np.asarray(value)
        if arr.shape != old.shape:
            raise InputError(f"parameter {name!r} has shape {old.shape}, got {arr.shape}")
        where[name] = np.array(arr, dtype=old.dtype, copy=True)

    def _group(self) -> OptimizerGroup:
        """The optimizer group (made at the first Optimizer: step 0, learning rate 1e-3)."""
        if not self._data.groups:
            self._data.groups.append(OptimizerGroup())
        return self._data.groups[0]
