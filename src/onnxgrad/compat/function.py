"""What :meth:`OrtGradientForwardBackward.new_instance` returns: forward and backward calls on the
sessions its class holds."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime as ort

from ..autodiff.engine import GradientGraphs
from ..deps import C
from ..errors import InputError, InputTypeError, OnnxGradRuntimeError, PathNotFoundError
from ..model.graph import ValueInfo, np_dtype
from ..runtime.runner import Runner
from ..runtime.values import contiguous
from .devices import parse_device
from .values import OrtValueVector, c_value, check_value, fill


@dataclass
class _Pending:
    """What one training forward keeps for its backward."""

    saved: dict[str, ort.OrtValue]  # values of the forward graph the gradient graph reads
    inputs: list[Any]  # the caller's inputs (saved_tensors); keeps their buffers alive too
    shapes: list[tuple[int, ...]]  # shape of each output, to check the output gradients


class OrtGradientForwardBackwardFunction:
    """Ancestor of the classes :class:`OrtGradientForwardBackward` creates (``cls_type_``).

    The graphs and sessions are class attributes, shared by every instance; an instance keeps a
    LIFO stack of pending training forwards (``states_``), so several forwards may run before their
    backwards, which then run in reverse order.
    """

    _runner: ClassVar[Runner]
    _graphs: ClassVar[GradientGraphs]
    _optimized_pre_grad_model: ClassVar[onnx.ModelProto]
    _trained_onnx: ClassVar[onnx.ModelProto]
    _grad_input_names: ClassVar[list[str]]
    _output_names: ClassVar[list[str]]
    _input_specs: ClassVar[list[ValueInfo | None]]
    _output_specs: ClassVar[list[ValueInfo]]
    _devices: ClassVar[list[Any]]
    _bw_outputs_device_info: ClassVar[list[Any]]
    _logger: ClassVar[logging.Logger | None]
    _debug: ClassVar[bool]

    def __init__(self) -> None:
        if not hasattr(type(self), "_runner"):
            raise OnnxGradRuntimeError(
                "OrtGradientForwardBackwardFunction is abstract: create instances with "
                "OrtGradientForwardBackward(model).new_instance()"
            )
        self.states_: list[_Pending] = []
        self.saved_tensors_: list[Any] | None = None

    @staticmethod
    def device_name(device: Any) -> str:
        """``'Cpu'`` or ``'Gpu'`` for a device (OrtDevice, OrtValue, string, torch.device)."""
        return "Cpu" if parse_device(device)[0] == "cpu" else "Gpu"

    @staticmethod
    def input_to_ort(tensors: Iterable[Any], devices: Sequence[Any] | None, debug: bool) -> OrtValueVector:
        """Convert numpy arrays / OrtValues (or an ``OrtValueVector``) into an
        :class:`OrtValueVector`, as the original did (it also behaves as a list).

        Arrays are placed on ``devices[i]`` (the last device repeats, ``None`` means CPU); CPU
        arrays are wrapped without a copy when contiguous. With ``debug``, every value must
        already be on its device.
        """
        if isinstance(tensors, OrtValueVector) and not debug:
            return tensors  # as the original: a vector is already converted
        values: list[Any] = []
        keep: list[Any] = []  # the arrays the values borrow: the vector keeps them alive
        devices = list(devices or [None])
        for i, t in enumerate(tensors):
            device = devices[min(i, len(devices) - 1)]
            if t is None:
                raise InputError(f"value {i} is None: every input and gradient must be given")
            if isinstance(t, ort.OrtValue | C.OrtValue):
                keep.append(t)
                values.append(c_value(t))
            else:
                kind, index = parse_device(device)
                arr = contiguous(t)
                if arr.dtype.kind in "OUSV":  # onnxruntime would raise its own RuntimeError
                    raise InputTypeError(
                        f"value {i} is a {type(t).__name__} (numpy dtype {arr.dtype}): inputs and "
                        "gradients are numeric arrays or OrtValues"
                    )
                wrapper = ort.OrtValue.ortvalue_from_numpy(arr, kind, index)
                keep.append(wrapper)  # it holds ``arr`` when the value borrows its buffer
                values.append(wrapper._ortvalue)
            if debug and parse_device(values[-1])[0] != parse_device(device)[0]:
                raise InputError(
                    f"value {i} is on {values[-1].device_name()!r}, expected "
                    f"{OrtGradientForwardBackwardFunction.device_name(device)!r}"
                )
        return OrtValueVector(values, keep=keep)

    def save_for_backward(self, inputs: Iterable[Any]) -> None:
        """Keep ``inputs`` (a shallow copy of the list) for :attr:`saved_tensors`."""
        self.saved_tensors_ = list(inputs)

    @property
    def saved_tensors(self) -> list[Any]:
        """The inputs of the latest training forward whose backward has not run yet."""
        if self.saved_tensors_ is None:
            raise OnnxGradRuntimeError(
                "no tensor was saved: run forward(..., training=True) or save_for_backward first"
            )
        return self.saved_tensors_

    def forward(
        self, inputs: Sequence[Any], training: bool = False, forward_outputs_cache: Any = None
    ) -> OrtValueVector | list[ort.OrtValue]:
        """Run the model on ``inputs``: the features (``_input_names``) then the weights
        (``_weights_to_train``), as numpy arrays or OrtValues. Returns one OrtValue per output
        (``C.OrtValue``; ``.numpy()`` gives the array) in an :class:`OrtValueVector`, as the
        original did, or in ``forward_outputs_cache`` when one is given (a list or an
        ``OrtValueVector``), which is overwritten as the original overwrote it (see
        :func:`~onnxgrad.compat.values.fill`).

        With ``training``, what the backward needs is pushed on this instance's stack.
        """
        cls = type(self)
        items = list(inputs)
        if len(items) != len(cls._grad_input_names):
            raise InputError(
                f"forward expects {len(cls._grad_input_names)} values (inputs then weights: "
                f"{cls._grad_input_names}), got {len(items)}"
            )
        values = cls.input_to_ort(items, cls._devices, cls._debug)
        for i, (info, value) in enumerate(zip(cls._input_specs, values)):
            check_value("input", i, info, value)
        if cls._logger is not None:
            cls._logger.debug("[%s.forward] training=%r", cls.__name__, training)
        outputs, saved = cls._runner.forward(dict(zip(cls._grad_input_names, values)), training)
        by_name = dict(zip(cls._graphs.outputs, outputs))
        result = [by_name[o] for o in cls._output_names]
        if training:
            assert saved is not None
            self.states_.append(_Pending(saved, items, [tuple(v.shape()) for v in result]))
            self.save_for_backward(items)
        return fill(forward_outputs_cache, result)

    def backward(
        self, grad_outputs: Sequence[Any], backward_outputs_cache: Any = None
    ) -> OrtValueVector | list[ort.OrtValue | None]:
        """Gradients for the latest pending training forward (LIFO), given one gradient per
        output (``None`` counts as zeros; a gradient with the output's number of values in another
        shape is reshaped, as the original did). Returns an :class:`OrtValueVector` (as the
        original did; or ``backward_outputs_cache`` overwritten) with one OrtValue per forward input: the
        features first, then the weights (``None`` for a non-float feature).
        """
        cls = type(self)
        if not self.states_:
            raise OnnxGradRuntimeError(
                "backward needs a pending forward(..., training=True); none is left on this "
                "instance (a forward with training=False keeps nothing)"
            )
        pending = self.states_[-1]
        grads = list(grad_outputs)
        if len(grads) != len(cls._output_names):
            raise InputError(
                f"backward expects {len(cls._output_names)} gradients (one per output "
                f"{cls._output_names}), got {len(grads)}"
            )
        for i, (g, info, shape) in enumerate(zip(grads, cls._output_specs, pending.shapes)):
            if g is None:
                grads[i] = np.zeros(shape, dtype=np_dtype(info.dtype))
            else:
                grads[i] = _as_output_shape(g, shape)
        values = cls.input_to_ort(grads, cls._bw_outputs_device_info, cls._debug)
        for i, (info, shape, value) in enumerate(zip(cls._output_specs, pending.shapes, values)):
            check_value("gradient", i, ValueInfo(info.name, info.dtype, shape), value)
        self.states_.pop()  # consumed only once the gradients are known to be valid
        if cls._logger is not None:
            cls._logger.debug("[%s.backward] %d pending left", cls.__name__, len(self.states_))
        feeds = {o: v for o, v in zip(cls._output_names, values) if o in cls._graphs.grad_inputs}
        by_name = dict(zip(cls._runner.wrt, cls._runner.backward(pending.saved, feeds)))
        self.saved_tensors_ = self.states_[-1].inputs if self.states_ else None
        return fill(backward_outputs_cache, [by_name.get(n) for n in cls._grad_input_names])

    @classmethod
    def save_onnx_graph(
        cls, folder: Any, prefix: str | None = None, suffix: str | None = None
    ) -> dict[str, str | bytes]:
        """Save the forward graph (``_optimized_pre_grad_model``) and the gradient graph
        (``_trained_onnx``) in ``folder`` (which must exist) as
        ``{prefix}{class name}{suffix}.{attribute}.onnx``, as the original named them; returns
        ``{attribute: path}``.

        When ``folder`` is not a path (the original passed ``bytes``), nothing is written and the
        result maps each attribute to the serialized model.
        """
        if not hasattr(cls, "_trained_onnx"):
            raise OnnxGradRuntimeError("save_onnx_graph needs a class made by new_instance()")
        models = {
            "_optimized_pre_grad_model": cls._optimized_pre_grad_model,
            "_trained_onnx": cls._trained_onnx,
        }
        if not isinstance(folder, str | os.PathLike):
            return {k: m.SerializeToString() for k, m in models.items()}
        if not os.path.isdir(folder):
            raise PathNotFoundError(f"folder {os.fspath(folder)!r} does not exist")
        base = f"{prefix or ''}{cls.__name__}{suffix or ''}"
        saved: dict[str, str | bytes] = {}
        for attr, model in models.items():
            path = os.path.join(os.fspath(folder), f"{base}.{attr}.onnx")
            if os.path.exists(path):
                warnings.warn(f"{path!r} already exists: overwritten", UserWarning, stacklevel=2)
            onnx.save(model, path)
            saved[attr] = path
        return saved


def _as_output_shape(grad: Any, shape: tuple[int, ...]) -> Any:
    """``grad`` with the shape of its output when it has the same number of elements in another
    shape, as the original accepted ((1, N) for an (N, 1) output: its agent reshaped the gradient);
    anything else is returned as given, for :func:`check_value` to judge. A CPU OrtValue is read
    back into numpy (a copy) to be reshaped."""
    if isinstance(grad, ort.OrtValue | C.OrtValue):
        got = tuple(grad.shape())
        if got == shape or int(np.prod(got)) != int(np.prod(shape)) or parse_device(grad)[0] != "cpu":
            return grad
        return np.ascontiguousarray(grad.numpy()).reshape(shape)
    if isinstance(grad, np.ndarray) and grad.shape != shape and grad.size == int(np.prod(shape)):
        return grad.reshape(shape)
    return grad
