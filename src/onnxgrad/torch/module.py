"""An ONNX graph as a ``torch.nn.Module``: forward and backward run on onnxruntime.

Trainable initializers are ``nn.Parameter``s, other floating-point initializers are buffers, and
the module joins PyTorch autograd through one ``torch.autograd.Function`` per call. Tensors cross
between torch and onnxruntime through DLPack, without copies; what the forward hands to the
backward stays inside onnxruntime as ``OrtValue``s.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn

from ..autodiff.engine import build_gradient
from ..autodiff.graph import FLOAT_TYPES, load_model, to_array, value_info_from_proto
from ..autodiff.modes import follows_training_flag, set_training_mode
from ..errors import InputError
from ..pythonop import make_runner
from ..runtime.session import resolve_providers
from ..runtime.values import from_torch, to_torch
from ..validate import check_input


def _to_ort(t: torch.Tensor, keep: list[torch.Tensor]) -> Any:
    """An OrtValue sharing ``t``'s buffer. The OrtValue does not own it: the (possibly new,
    when ``t`` is a strided view) contiguous tensor is appended to ``keep``, which the caller
    holds until onnxruntime is done with the value."""
    contiguous = t.detach().contiguous()
    keep.append(contiguous)
    return from_torch(contiguous)


def torch_name(onnx_name: str, taken: set[str]) -> str:
    """A valid, unique PyTorch attribute name for an ONNX initializer name."""
    name = re.sub(r"\W", "_", onnx_name)
    if not name or name[0].isdigit():
        name = f"p_{name}"
    base, k = name, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


class _Variant:
    """The graphs and sessions for one choice of what requires grad."""

    def __init__(
        self,
        model: onnx.ModelProto,
        trainable: list[str],
        inputs: list[str],
        as_inputs: list[str],
        outputs: list[str],
        providers: list[Any],
        options: ort.SessionOptions | None,
    ) -> None:
        # Floating-point initializers that are not differentiated here are fed at each call (their
        # live values are buffers, or parameters with requires_grad=False): make them inputs.
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
        moved = set(as_inputs)
        kept = [i for i in proto.graph.initializer if i.name not in moved]
        added = [
            onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
            for i in proto.graph.initializer
            if i.name in moved
        ]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(kept)
        declared = {i.name for i in proto.graph.input}
        proto.graph.input.extend([a for a in added if a.name not in declared])
        self.graphs = build_gradient(
            proto, trainable=trainable, inputs_requiring_grad=inputs, outputs=outputs
        )
        self.runner = make_runner(self.graphs, providers, options)


class _OnnxFunction(torch.autograd.Function):
    """One call of an :class:`OnnxModule`: the forward graph now, the backward graph on demand.

    The values the backward needs are handed to ``ctx.save_for_backward`` as tensors that share
    onnxruntime's buffers (DLPack): PyTorch then owns their lifetime, frees them after a backward
    without ``retain_graph``, reports a second backward with its usual error, and detects in-place
    changes of saved inputs and parameters.
    """

    @staticmethod
    def forward(
        ctx: Any, variant: _Variant, names: Sequence[str], *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        keep: list[torch.Tensor] = []
        values = {n: _to_ort(t, keep) for n, t in zip(names, tensors)}
        outs, saved = variant.runner.forward(values, training=True)
        position = {n: i for i, n in enumerate(names)}
        saved_names = list(saved or {})
        ctx.save_for_backward(
            *[
                tensors[position[n]] if n in position else to_torch(saved[n])  # type: ignore[index]
                for n in saved_names
            ]
        )
        ctx.variant, ctx.names, ctx.saved_names = variant, names, saved_names
        results = tuple(to_torch(o) for o in outs)
        ctx.out_meta = [(r.shape, r.dtype) for r in results]
        ctx.mark_non_differentiable(*[r for r in results if not r.is_floating_point()])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True) asks for a differentiable backward
            raise RuntimeError(
                "OnnxModule does not support create_graph=True: its backward runs on onnxruntime "
                "and is not itself differentiable by torch (second-order gradients)"
            )
        keep: list[torch.Tensor] = []
        saved = {n: _to_ort(t, keep) for n, t in zip(ctx.saved_names, ctx.saved_tensors)}
        variant: _Variant = ctx.variant
        graphs = variant.graphs
        gvals = {}
        for i, out in enumerate(graphs.outputs):
            if out in graphs.grad_inputs:
                g = grads[i]
                if g is None:
                    g = torch.zeros(*ctx.out_meta[i])
                gvals[out] = _to_ort(g, keep)
        res = dict(zip(variant.runner.wrt, variant.runner.backward(saved, gvals)))
        return (None, None, *[to_torch(res[n]) if n in res else None for n in ctx.names])


class OnnxModule(nn.Module):
    """An ONNX model as a PyTorch layer.

    ``trainable``: initializer names that become ``nn.Parameter``s (``None``: every floating-point
    initializer); other floating-point initializers become buffers. ``forward(*tensors)`` takes the
    model inputs in order and returns a tensor (one output) or a tuple.
    """

    def __init__(
        self,
        model: onnx.ModelProto | str | os.PathLike | bytes,
        *,
        trainable: Iterable[str] | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
    ) -> None:
        super().__init__()
        proto = load_model(model)
        self.output_names = [o.name for o in proto.graph.output]
        # Dropout and BatchNormalization follow .train() / .eval(): one model per mode, sharing
        # initializer names; in training mode BatchNormalization's running statistics come out as
        # extra outputs, written back into their buffers after each forward.
        self._running_stats: dict[str, str] = {}
        if follows_training_flag(proto):
            train = set_training_mode(proto, True)
            proto = train.model
            self._running_stats = train.running_stats
            self._mode_bytes = {
                True: proto.SerializeToString(),
                False: set_training_mode(proto, False).model.SerializeToString(),
            }
        else:
            self._mode_bytes = {True: proto.SerializeToString()}
            self._mode_bytes[False] = self._mode_bytes[True]
        self._providers = providers
        self._session_options = session_options
        inits = {i.name: i for i in proto.graph.initializer}
        floats = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES]
        if trainable is None:  # every float initializer but the running statistics
            params = [n for n in floats if n not in self._running_stats]
        else:
            params = [trainable] if isinstance(trainable, str) else list(dict.fromkeys(trainable))
            for n in params:
                if n not in inits:
                    raise InputError(f"trainable name {n!r} is not an initializer of the model")
                if n not in floats:
                    raise InputError(f"initializer {n!r} is not floating-point: it cannot be trained")
        taken: set[str] = set()
        self.onnx_names: dict[str, str] = {}  # torch attribute name -> ONNX initializer name
        for n in floats:
            tname = torch_name(n, taken)
            self.onnx_names[tname] = n
            value = torch.from_numpy(np.array(to_array(inits[n]), copy=True))
            if n in params:
                self.register_parameter(tname, nn.Parameter(value))
            else:
                self.register_buffer(tname, value)
        init_names = set(inits)
        self.input_names = [i.name for i in proto.graph.input if i.name not in init_names]
        self._input_infos = {
            vi.name: value_info_from_proto(vi) for vi in proto.graph.input if vi.name not in init_names
        }
        self._variants: dict[tuple, _Variant] = {}
        self._lock = threading.Lock()

    # ---- running ------------------------------------------------------------------------------
    def _variant(self, wrt_params: tuple[str, ...], wrt_inputs: tuple[str, ...]) -> _Variant:
        mode = bool(self.training)
        key = (mode, wrt_params, wrt_inputs)
        with self._lock:
            variant = self._variants.get(key)
            if variant is None:
                others = [n for n in self.onnx_names.values() if n not in wrt_params]
                variant = _Variant(
                    onnx.load_from_string(self._mode_bytes[mode]),
                    list(wrt_params),
                    list(wrt_inputs),
                    others,
                    self.output_names,
                    resolve_providers(self._providers),
                    self._session_options,
                )
                self._variants[key] = variant
        return variant

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(tensors) != len(self.input_names):
            raise InputError(
                f"expected {len(self.input_names)} input tensor(s) {self.input_names}, got {len(tensors)}"
            )
        for name, t in zip(self.input_names, tensors):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise InputError(f"input {name!r} is on {t.device}; OnnxModule runs on the CPU")
            info = self._input_infos.get(name)
            if info is not None:
                check_input(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), info)
        values = [(n, getattr(self, t)) for t, n in self.onnx_names.items()]
        grad = torch.is_grad_enabled()
        wrt_params = tuple(n for n, v in values if grad and v.requires_grad)
        wrt_inputs = tuple(
            n for n, t in zip(self.input_names, tensors) if grad and t.requires_grad and t.is_floating_point()
        )
        variant = self._variant(wrt_params, wrt_inputs)
        names = list(self.input_names) + [n for n, _ in values]
        all_tensors = list(tensors) + [v for _, v in values]
        if wrt_params or wrt_inputs:
            outs = _OnnxFunction.apply(variant, names, *all_tensors)
        else:  # nothing requires grad: inference, nothing is kept for a backward
            keep: list[torch.Tensor] = []
            feeds = {n: _to_ort(t, keep) for n, t in zip(names, all_tensors)}
            outs = tuple(to_torch(o) for o in variant.runner.forward(feeds, training=False)[0])
        if self.training and self._running_stats:
            self._update_running_stats(variant, outs)
        outs = outs[: len(self.output_names)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _update_running_stats(self, variant: _Variant, outs: Sequence[torch.Tensor]) -> None:
        position = {name: i for i, name in enumerate(variant.graphs.outputs)}
        by_onnx = {n: t for t, n in self.onnx_names.items()}
        with torch.no_grad():
            for stat, out in self._running_stats.items():
                getattr(self, by_onnx[stat]).copy_(outs[position[out]])

    # ---- export, copies, pickling ----------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The inference model (Dropout and BatchNormalization in inference mode) carrying the
        module's current parameter and buffer values."""
        proto = onnx.load_from_string(self._mode_bytes[False])
        values = {n: getattr(self, t).detach().cpu().numpy() for t, n in self.onnx_names.items()}
        inits = [
            numpy_helper.from_array(values[i.name], i.name) if i.name in values else i
            for i in proto.graph.initializer
        ]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(inits)
        return proto

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_variants"] = {}  # onnxruntime sessions are rebuilt on first use
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def extra_repr(self) -> str:
        lines = [f"inputs={self.input_names}, outputs={self.output_names}"]
        for tname, oname in self.onnx_names.items():
            kind = "parameter" if tname in self._parameters else "buffer"
            shape = tuple(getattr(self, tname).shape)
            lines.append(f"({tname}): {kind} {shape} <- ONNX {oname!r}")
        return "\n".join(lines)
