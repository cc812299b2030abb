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
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper
from torch import nn

from ..autodiff.backward import QUANTIZED_MODES
from ..autodiff.engine import build_gradient
from ..autodiff.params import untie
from ..autodiff.prepare import float_outputs, prepare
from ..autodiff.trainable import record_trainable
from ..deps import function_apply_direct, session_run, torch_interop
from ..errors import InputError, InputTypeError, OnnxGradRuntimeError
from ..model.graph import FLOAT_TYPES, dtype_name, np_dtype, to_array, unique_name, value_info_from_proto
from ..model.load import CheckedModel
from ..pythonop import make_runner
from ..runtime.runner import BACKWARD_FAILED, FORWARD_FAILED, Runner
from ..runtime.session import resolve_providers
from ..runtime.values import check_input, coerce, from_torch, to_torch
from ..train.amp import MasterWeightsChoice, is_half, use_master_weights

# call signatures (input shapes, dtypes, requires-grad flags) remembered per module; beyond, the
# memory starts over
_MAX_PLANS = 256
# the attributes OnnxModule._prepare derives from the others (not pickled)
_DERIVED = ("_attr_names", "_feed_names", "_stat_attrs", "_plans", "_casts", "_sources", "_value_dtypes")


def torch_name(onnx_name: str, taken: set[str]) -> str:
    """A valid, unique PyTorch attribute name for an ONNX initializer name."""
    name = re.sub(r"\W", "_", onnx_name)
    if not name or name[0].isdigit():
        name = f"p_{name}"
    return unique_name(name, taken)


# one part of a module path: an identifier, or an index as nn.Sequential and nn.ModuleList name theirs
_PART = re.compile(r"[A-Za-z_]\w*|\d+")
# names a submodule's parameter cannot take (nn.Module's own attributes)
_MODULE_ATTRS = frozenset(dir(nn.Module()))
# the attributes OnnxModule sets itself, which no top-level parameter or submodule may shadow
_OWN_ATTRS = frozenset({"tied", "output_names", "onnx_names", "input_names"})


def torch_paths(onnx_names: Sequence[str], reserved: Iterable[str] = ()) -> dict[str, str]:
    """The PyTorch name of each ONNX initializer: the ONNX name itself where it is a module path
    that torch can hold (``"fc1.weight"``, ``"encoder.layers.0.bias"``: a parameter ``weight`` of a
    submodule ``fc1``), so that ``state_dict()`` keys are those of the exported torch model;
    otherwise :func:`torch_name`'s attribute name (``"onnx::MatMul_12"`` -> ``"onnx__MatMul_12"``).

    ``reserved``: attribute names of the module itself, which no path may start with.
    """
    reserved = set(reserved) | _OWN_ATTRS
    paths = {}
    for n in onnx_names:
        parts = n.split(".")
        if (
            all(_PART.fullmatch(p) for p in parts)
            and parts[0] not in reserved
            and not parts[0].startswith("_")
            and not any(p in _MODULE_ATTRS for p in parts[1:])
        ):
            paths[n] = n
    # a name that is also another one's submodule ("fc" beside "fc.weight") stays an attribute
    prefixes = {p[:i] for p in paths for i in range(len(p)) if p[i] == "."}
    paths = {n: p for n, p in paths.items() if p not in prefixes}
    taken = {p.split(".")[0] for p in paths.values()} | reserved
    return {n: paths.get(n) or torch_name(n, taken) for n in onnx_names}


def legacy_names(onnx_names: Sequence[str]) -> dict[str, str]:
    """ONNX name -> the attribute name an OnnxModule gave it before parameters took their module
    paths (``"fc1_weight"``), for the state dicts and attribute reads of code written then."""
    taken: set[str] = set()
    return {n: torch_name(n, taken) for n in onnx_names}


def _tensor_from_numpy(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor holding a copy of ``arr``. bfloat16 (``ml_dtypes.bfloat16``, onnx's type for
    it, which ``torch.from_numpy`` does not know) crosses as its bits, a uint16 view."""
    arr = np.array(arr, copy=True)
    if arr.dtype.type is ml_dtypes.bfloat16:
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _numpy_from_tensor(tensor: torch.Tensor) -> np.ndarray:
    """The array of a CPU tensor; a bfloat16 tensor (no numpy type in torch) as ``ml_dtypes.bfloat16``."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


class _Variant:
    """The graphs and sessions for one choice of what requires grad, the bookkeeping of a call
    worked out once (which feeds are saved for the backward, which outputs take a gradient, which
    gradient goes back to which feed), and the runs of a call (:meth:`forward`, :meth:`infer`,
    :meth:`backward`, torch tensors in and out).

    A plain :class:`Runner`'s sessions are called on their C-level run with the names and result
    indices worked out here, the tensors of a run crossing in one call each way (a step of a
    Linear(16, 16), batch 4, fastest of 300: 101-105 -> 87-90 µs, torch 53-55); other runners
    (the PythonOp one) go through ``BaseRunner.forward`` and ``backward``."""

    def __init__(
        self,
        model: onnx.ModelProto,
        trainable: list[str],
        inputs: list[str],
        as_inputs: list[str],
        outputs: list[str],
        feed_names: Sequence[str],
        providers: list[Any],
        options: ort.SessionOptions | None,
        recompute: Any = None,
        quantized: str = "ste",
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
        # the module chose and tied its parameters already; proto rewrites the model it checked
        self.graphs = graphs = build_gradient(
            CheckedModel(proto),
            trainable=trainable,
            inputs_requiring_grad=inputs,
            outputs=outputs,
            tie_weights=False,
            recompute=recompute,
            quantized=quantized,
        )
        self.runner = make_runner(self.graphs, providers, options)
        # model inputs then initializers, the order of the tensors a call hands to _OnnxFunction
        self.feed_names = tuple(feed_names)
        position = {n: i for i, n in enumerate(self.feed_names)}
        self.saved_names = list(graphs.saved)
        # where each saved value comes from: the position of a feed (saved as the caller's tensor,
        # so that torch sees in-place changes of it), or None for an intermediate of the forward
        self.saved_feeds = [position.get(n) for n in self.saved_names]
        # (index in graphs.outputs, name) of the outputs whose gradient the backward takes
        self.grad_outputs = [(i, o) for i, o in enumerate(graphs.outputs) if o in graphs.grad_inputs]
        wrt = {n: j for j, n in enumerate(self.runner.wrt)}
        # for each feed: the index of its gradient among the backward's results, or None
        self.grad_slots = [wrt.get(n) for n in self.feed_names]
        self.output_index = {o: i for i, o in enumerate(graphs.outputs)}
        self.integral_outputs: list[int] | None = None  # outputs without a gradient (ints, bools)
        # A plain Runner is called positionally on its sessions' C-level run (the other runners,
        # e.g. the PythonOp one, go through BaseRunner.forward/backward): the names each run
        # takes and gives, and which of its results a call reads, worked out here once.
        self.direct = type(self.runner) is Runner
        if self.direct:
            runner = self.runner
            interop = torch_interop()  # its conversions, bound: one call per run each way
            self._to_ortvalues, self._tensors_at = interop.to_ortvalues, interop.tensors_at
            # and their common case, written inline in _run
            self._to_capsule, self._to_value, self._to_tensor = interop.fast_forms()
            self._fwd_run = session_run(runner.fwd)
            self._fwd_wanted = list(runner.fwd_outputs)  # the training forward's results
            where = {n: i for i, n in enumerate(self._fwd_wanted)}
            out_at = self.output_index
            intermediates = [
                n for n, i in zip(self.saved_names, self.saved_feeds) if i is None and n not in out_at
            ]
            # the user outputs then the saved intermediates, as indices into the results
            self._fwd_take = [where[o] for o in graphs.outputs] + [where[n] for n in intermediates]
            # each saved value: (True, feed position) or (False, index into the taken results); a
            # saved value that is also an output is saved as the output's own tensor (see _OnnxFunction)
            n_out, k = len(graphs.outputs), 0
            self._saved_from: list[tuple[bool, int]] = []
            for n, i in zip(self.saved_names, self.saved_feeds):
                if i is not None:
                    self._saved_from.append((True, i))
                elif n in out_at:
                    self._saved_from.append((False, out_at[n]))
                else:
                    self._saved_from.append((False, n_out + k))
                    k += 1
            self._infer_wanted = list(graphs.outputs)
            self._infer_take = list(range(n_out))
            # the backward's feeds: the saved values, then the gradients of the outputs
            self._bwd_feeds = [*self.saved_names, *[graphs.grad_inputs[o] for _, o in self.grad_outputs]]
            self._grad_positions = [i for i, _ in self.grad_outputs]
            # the gradients of all outputs are fed (no integer output): handed on as they come
            self._all_grads = self._grad_positions == list(range(n_out))
            self._bwd_wanted = [graphs.grad_outputs[w] for w in runner.wrt]
            self._bwd_take = list(range(len(self._bwd_wanted)))
            self._bwd_run: Any = None  # bound on the first backward (its session is made then)

    def forward(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the training forward on the feeds ``tensors``: (the outputs, the values to save for
        the backward: the feeds' own tensors, and tensors sharing onnxruntime's buffers)."""
        if not self.direct:
            feeds = dict(zip(self.feed_names, map(from_torch, tensors)))
            outs, saved = self.runner.forward(feeds, True)
            results = list(map(to_torch, outs))
            kept = [
                tensors[i]
                if i is not None
                else results[self.output_index[n]]
                if n in self.output_index
                else to_torch(saved[n])  # type: ignore[index]
                for n, i in zip(self.saved_names, self.saved_feeds)
            ]
            return results, kept
        got = self._run(self._fwd_run, self.feed_names, tensors, self._fwd_wanted, self._fwd_take)
        kept = [tensors[i] if feed else got[i] for feed, i in self._saved_from]
        return got[: len(self.output_index)], kept

    def infer(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the forward on the feeds ``tensors``, keeping nothing for a backward: the outputs."""
        if not self.direct:
            feeds = dict(zip(self.feed_names, map(from_torch, tensors)))
            return list(map(to_torch, self.runner.forward(feeds, training=False)[0]))
        return self._run(self._fwd_run, self.feed_names, tensors, self._infer_wanted, self._infer_take)

    def backward(self, saved: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run the backward on the saved values (in :attr:`saved_names` order) and the gradients
        of all outputs: one gradient per name of ``runner.wrt``."""
        if not self.direct:
            sv = dict(zip(self.saved_names, map(from_torch, saved)))
            gv = {out: from_torch(grads[i]) for i, out in self.grad_outputs}
            return list(map(to_torch, self.runner.backward(sv, gv)))
        run = self._bwd_run
        if run is None:  # the runner makes the session once, under its lock
            run = self._bwd_run = session_run(self.runner.backward_session())  # type: ignore[attr-defined]
        if not self._all_grads:
            grads = [grads[i] for i in self._grad_positions]
        return self._run(run, self._bwd_feeds, (*saved, *grads), self._bwd_wanted, self._bwd_take, True)

    def _run(
        self,
        run: Any,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        wanted: list[str],
        take: list[int],
        backward: bool = False,
    ) -> list[torch.Tensor]:
        """One C-level run of a plain Runner's session: ``tensors`` fed as ``names``, the results
        ``wanted`` computed and those at ``take`` returned as tensors, each crossing without a copy
        and written inline (one Python call per run: a step of a Linear(16, 16), batch 4, spends
        its fixed cost in calls like these, not in onnxruntime's kernels)."""
        to_value = self._to_value
        values = None
        if to_value is not None:
            to_capsule = self._to_capsule
            try:
                values = [to_value(to_capsule(t)) for t in tensors]
            except Exception:  # a strided view...: to_ortvalues copies it, or raises what it cannot take
                values = None
        if values is None:
            values = self._to_ortvalues(tensors)
        try:
            res = run(dict(zip(names, values)), wanted, None)
        except Exception as exc:
            raise OnnxGradRuntimeError(f"{BACKWARD_FAILED if backward else FORWARD_FAILED}: {exc}") from exc
        to_tensor = self._to_tensor
        if to_tensor is None:
            return self._tensors_at(res, take)
        at = res.dlpack_at
        return [to_tensor(at(i)) for i in take]


class _OnnxFunction(torch.autograd.Function):
    """One call of an :class:`OnnxModule`: the forward graph now, the backward graph on demand.

    The values the backward needs are handed to ``ctx.save_for_backward`` as tensors that share
    onnxruntime's buffers (DLPack): PyTorch then owns their lifetime, frees them after a backward
    without ``retain_graph``, reports a second backward with its usual error, and detects in-place
    changes of saved inputs and parameters. A saved value that is also an output is saved as the
    returned output tensor itself, not as a second tensor on the same buffer: an in-place change of
    the output (``out.add_(1)``) then bumps the version PyTorch checks, and the backward raises
    PyTorch's own error ("... modified by an inplace operation") instead of using the changed value.
    """

    @staticmethod
    def forward(ctx: Any, variant: _Variant, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # each OrtValue holds its tensor through DLPack: nothing else to keep alive
        outs, kept = variant.forward(tensors)
        ctx.save_for_backward(*kept)
        ctx.variant = variant
        results = tuple(outs)
        integral = variant.integral_outputs
        if integral is None:  # output types are fixed by the graph: learnt on the first call
            integral = variant.integral_outputs = [
                i for i, r in enumerate(results) if not r.is_floating_point()
            ]
        if integral:
            ctx.mark_non_differentiable(*[results[i] for i in integral])
        return results

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # backward(create_graph=True) asks for a differentiable backward
            raise OnnxGradRuntimeError(
                "OnnxModule does not support create_graph=True: its backward runs on onnxruntime "
                "and is not itself differentiable by torch (second-order gradients)"
            )
        variant: _Variant = ctx.variant
        # the gradients of outputs that did not reach the loss come as zeros, not None: the
        # Function materializes them (ctx.set_materialize_grads is left at its default, True)
        res = variant.backward(ctx.saved_tensors, grads)
        # None for the variant argument, then each feed's gradient (None: not differentiated)
        return (None, *[None if j is None else res[j] for j in variant.grad_slots])


# _OnnxFunction.apply without torch's Python layer in front of it, outside functorch transforms
_apply, _transforms_active = function_apply_direct(_OnnxFunction)


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, integral: bool) -> torch.Tensor:
    """``t`` as ``dtype`` under the input contract: a float type by a (differentiable) torch cast;
    an integer type (``integral``) by :func:`onnxgrad.runtime.values.coerce`, which refuses values
    that are not whole or do not fit, as every door does."""
    if not integral:
        return t.to(dtype)
    arr = t.detach().numpy() if t.dtype != torch.bfloat16 else t.detach().float().numpy()
    return torch.from_numpy(coerce(f"input {name!r}", arr, np.dtype(str(dtype).removeprefix("torch."))))


class OnnxModule(nn.Module):
    """An ONNX model as a PyTorch layer.

    ``trainable``: initializer names that become ``nn.Parameter``s (``None``: the model's
    parameters, leaving out exponents, epsilons, shapes, masks, running statistics and other
    constants; see :mod:`onnxgrad.autodiff.params`); other floating-point initializers become
    buffers. ``frozen``: names left out of those, buffers too (freezing any copy of a tied
    parameter freezes the parameter; the choice of every front end,
    :func:`onnxgrad.autodiff.params.select_parameters`). ``tie_weights``: initializers holding
    one parameter (equal, or equal up to a transpose or a cast, such as GPT-2's embedding and its
    folded transposed copy) become one ``nn.Parameter``, the others computed from it in the graph
    (``tied``); ``False`` keeps them apart.
    ``recompute``: activations rebuilt in the backward instead of kept (see ``build_gradient``).
    ``quantized``: the gradient through quantization ops, ``"ste"``, ``"zero"`` or ``"refuse"`` (see
    ``build_gradient``).
    ``master_weights``: ``True``, ``False`` or ``"auto"``, the values and the rule of
    ``Trainer(master_weights=)`` (:func:`onnxgrad.train.amp.use_master_weights`; ``"auto"``: when some
    parameter is half precision). With master weights, the parameters of the model's float16 initializers
    are float32 ``nn.Parameter``s, cast to the model's type at each forward (a torch cast, so their
    gradients arrive in float32): ``torch.amp.GradScaler`` (which refuses float16 gradients) and any
    torch optimizer then work as with a torch half model's float32 parameters under autocast.
    Buffers stay in the model's type; :meth:`to_onnx` writes the parameters back in it (rounded).
    No effect on float32 and float64 parameters. The default is ``False``, unlike the
    ``Trainer``'s ``"auto"``: here the user's torch optimizer holds the parameters, and a half
    module's parameters are half in torch too (as after ``module.half()``); the ``Trainer`` runs
    the optimizer itself, and its float16 updates would be lost below half an ulp.
    ``forward(*tensors)`` takes the model inputs in order and returns a tensor (one output) or a
    tuple.
    """

    def __init__(
        self,
        model: CheckedModel | onnx.ModelProto | str | os.PathLike | bytes,
        *,
        trainable: Iterable[str] | None = None,
        providers: str | Sequence[Any] | None = None,
        session_options: ort.SessionOptions | None = None,
        tie_weights: bool = True,
        recompute: Any = None,
        quantized: str = "ste",
        master_weights: MasterWeightsChoice = False,
        frozen: Iterable[str] = (),
    ) -> None:
        super().__init__()
        self._recompute = recompute  # build_gradient(recompute=): activations rebuilt in the backward
        if quantized not in QUANTIZED_MODES:
            raise InputError(f"quantized must be one of {list(QUANTIZED_MODES)}, got {quantized!r}")
        self._quantized = quantized  # build_gradient(quantized=): the gradient through quantization
        # the one validation; the parameters are chosen (and tied) before the modes are switched
        prepared = prepare(model).select(trainable, frozen=frozen, tie_weights=tie_weights)
        selection = prepared.selection
        assert selection is not None
        self.tied = selection.ties  # initializers computed from a parameter
        self.output_names = prepared.output_names
        # the outputs that take a gradient (integer and bool outputs come back non-differentiable)
        floats = float_outputs(prepared.checked.proto)
        self._grad_outputs = [o for o in self.output_names if o in floats]
        # Dropout and BatchNormalization follow .train() / .eval(): one model per mode, sharing
        # initializer names; in training mode BatchNormalization's running statistics come out as
        # extra outputs, written back into their buffers after each forward.
        self._running_stats: dict[str, str] = prepared.running_stats
        proto = prepared.training.proto
        self._mode_bytes = {True: proto.SerializeToString()}
        self._mode_bytes[False] = (
            prepared.inference.proto.SerializeToString()
            if prepared.follows_training
            else self._mode_bytes[True]
        )
        self._providers = providers
        self._session_options = session_options
        inits = {i.name: i for i in proto.graph.initializer}
        floats = [n for n, t in inits.items() if t.data_type in FLOAT_TYPES]
        params = set(selection.trainable)
        masters = use_master_weights(
            master_weights, (np_dtype(inits[n].data_type) for n in params if n in inits)
        )
        paths = torch_paths(floats, reserved=dir(self))
        # torch name (a module path: "fc1.weight") -> ONNX initializer name
        self.onnx_names: dict[str, str] = {}
        # attribute names of modules written before parameters took module paths -> torch name
        # (never a name the new paths use: "w1" is the submodule of "w1.lora_A" now)
        used = {p.split(".")[0] for p in paths.values()}
        self._legacy = {
            old: paths[n] for n, old in legacy_names(floats).items() if old != paths[n] and old not in used
        }
        # torch name -> the model's half type, for the float32 master parameters
        self._master_dtypes: dict[str, torch.dtype] = {}
        for n in floats:
            tname = paths[n]
            self.onnx_names[tname] = n
            owner, leaf = self._owner(tname, create=True)
            value = _tensor_from_numpy(to_array(inits[n]))
            if n in params:
                if masters and is_half(value.dtype):
                    self._master_dtypes[tname] = value.dtype
                    value = value.float()
                owner.register_parameter(leaf, nn.Parameter(value))
            else:
                owner.register_buffer(leaf, value)
        self._register_load_state_dict_pre_hook(self._legacy_keys)
        init_names = set(inits)
        self.input_names = [i.name for i in proto.graph.input if i.name not in init_names]
        self._input_infos = {
            vi.name: value_info_from_proto(vi) for vi in proto.graph.input if vi.name not in init_names
        }
        # keyed by (training, requires-grad flag of each initializer, then of each input)
        self._variants: dict[tuple[bool, ...], _Variant] = {}
        self._lock = threading.Lock()  # taken only to build a variant, never on a cache hit
        self._prepare()

    def _owner(self, tname: str, create: bool = False) -> tuple[nn.Module, str]:
        """The module holding the parameter or buffer ``tname`` (a module path), and its name
        there; ``create``: make the missing submodules on the way."""
        *parts, leaf = tname.split(".")
        owner: nn.Module = self
        for part in parts:
            sub = owner._modules.get(part)
            if sub is None:
                if not create:
                    raise AttributeError(tname)
                sub = nn.Module()
                owner.add_module(part, sub)
            owner = sub
        return owner, leaf

    def _value(self, tname: str) -> torch.Tensor:
        """The live parameter or buffer ``tname``."""
        owner, leaf = self._owner(tname)
        return getattr(owner, leaf)

    def _legacy_keys(self, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """A state dict written before parameters took module paths loads: its keys renamed."""
        for old, new in getattr(self, "_legacy", {}).items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        # torch's BatchNorm counts its batches; the ONNX model has no such value (its momentum is fixed)
        for key in [k for k in state_dict if k.startswith(prefix) and k.endswith(".num_batches_tracked")]:
            stats = key[len(prefix) : -len("num_batches_tracked")] + "running_mean"
            if stats in self.onnx_names:
                del state_dict[key]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            legacy = self.__dict__.get("_legacy") or {}
            if name not in legacy:
                raise
        self._warn_legacy(name)
        return self._value(legacy[name])

    def __setattr__(self, name: str, value: Any) -> None:
        legacy = self.__dict__.get("_legacy") or {}
        if name in legacy:  # an old name: the value goes where forward reads it, never beside it
            self._warn_legacy(name)
            owner, leaf = self._owner(legacy[name])
            setattr(owner, leaf, value)
            return
        super().__setattr__(name, value)

    def _warn_legacy(self, name: str) -> None:
        warnings.warn(
            f"OnnxModule.{name} is now {self._legacy[name]!r} (parameters take their module paths, as "
            f"in state_dict()); the old name will go",
            DeprecationWarning,
            stacklevel=3,
        )

    def _apply(self, fn: Any, recurse: bool = True) -> OnnxModule:
        # .to(dtype), .double(), .half(), .cuda()...: onnxruntime runs the model's own types on the
        # CPU, so a conversion is refused here rather than at the next forward
        held = {t.dtype for t in (*self.parameters(), *self.buffers()) if t.is_floating_point()}
        for dtype in held:
            try:
                probe = fn(torch.empty(0, dtype=dtype))
            except Exception:  # torch's own error, raised by the conversion itself
                break
            if isinstance(probe, torch.Tensor) and (probe.dtype != dtype or probe.device.type != "cpu"):
                raise InputTypeError(
                    f"OnnxModule runs the ONNX model in its own types on the CPU: converting its "
                    f"{str(dtype).removeprefix('torch.')} parameters to "
                    f"{str(probe.dtype).removeprefix('torch.')} on {probe.device} is refused. Inputs of "
                    f"another float type are cast to the model's at each call (torch.autocast "
                    f"included); for float64 training, export the model in float64"
                )
        return super()._apply(fn, recurse)

    def _prepare(self) -> None:
        """Work out once what each call needs (also after unpickling, which drops it)."""
        self._attr_names = list(self.onnx_names)
        masters = getattr(self, "_master_dtypes", {})  # absent from modules pickled before it
        # the model's type of each value, where the module holds it in float32 (None elsewhere)
        self._casts = [masters.get(t) for t in self._attr_names]
        # what forward reads, in order: the dicts holding each value, its name there, its cast
        self._sources = []
        # the type the model computes each value in (what forward feeds, after a master's cast)
        self._value_dtypes = []
        for tname, cast in zip(self._attr_names, self._casts):
            owner, leaf = self._owner(tname)
            self._sources.append((owner._parameters, owner._buffers, owner, leaf, cast))
            self._value_dtypes.append((tname, cast or getattr(owner, leaf).dtype))
        self._feed_names = (*self.input_names, *self.onnx_names.values())
        by_onnx = {n: t for t, n in self.onnx_names.items()}
        self._stat_attrs = [(by_onnx[stat], out) for stat, out in self._running_stats.items()]
        # call signature (see forward) -> (variant, whether autograd records the call), for the
        # signatures whose inputs passed validation: a hit skips both validation and variant choice
        self._plans: dict[tuple, tuple[_Variant, bool]] = {}

    # ---- running ------------------------------------------------------------------------------
    def _variant(self, wrt_params: tuple[str, ...], wrt_inputs: tuple[str, ...]) -> _Variant:
        """The variant, in the current mode, differentiating the initializers ``wrt_params`` and the
        inputs ``wrt_inputs``, built on first use."""
        key = (
            bool(self.training),
            *[n in wrt_params for n in self.onnx_names.values()],
            *[n in wrt_inputs for n in self.input_names],
        )
        return self._variants.get(key) or self._build_variant(key)

    def _build_variant(self, key: tuple[bool, ...]) -> _Variant:
        # under the lock, so that threads missing the same key at once build it once
        with self._lock:
            variant = self._variants.get(key)
            if variant is None:
                mode, flags = key[0], key[1:]
                onnx_names = list(self.onnx_names.values())
                k = len(onnx_names)
                wrt_params = [n for n, f in zip(onnx_names, flags[:k]) if f]
                wrt_inputs = [n for n, f in zip(self.input_names, flags[k:]) if f]
                variant = _Variant(
                    onnx.load_from_string(self._mode_bytes[mode]),
                    wrt_params,
                    wrt_inputs,
                    [n for n in onnx_names if n not in wrt_params],
                    self._grad_outputs,
                    self._feed_names,
                    resolve_providers(self._providers),
                    self._session_options,
                    getattr(self, "_recompute", None),
                    getattr(self, "_quantized", "ste"),
                )
                self._variants[key] = variant
        return variant

    def _check_inputs(self, tensors: tuple[Any, ...]) -> tuple[tuple[torch.dtype, bool] | None, ...] | None:
        """:class:`InputError` unless ``tensors`` are CPU tensors the model accepts; the cast of each
        under the input contract (:func:`onnxgrad.runtime.values.feed_dtype`): ``None`` where the
        dtype is the model's, else (the model's dtype, whether the values must be whole numbers);
        ``None`` for all when no input is cast."""
        if len(tensors) != len(self.input_names):
            raise InputError(
                f"expected {len(self.input_names)} input tensor(s) {self.input_names}, got {len(tensors)}"
            )
        casts: list[tuple[torch.dtype, bool] | None] = []
        for name, t in zip(self.input_names, tensors):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise InputError(f"input {name!r} is on {t.device}; OnnxModule runs on the CPU")
            info = self._input_infos.get(name)
            given = str(t.dtype).removeprefix("torch.")
            if info is None:
                casts.append(None)
                continue
            check_input(name, given, tuple(t.shape), info)
            expected = dtype_name(info.dtype)
            to = getattr(torch, expected)
            casts.append(None if to == t.dtype else (to, not to.is_floating_point))
        return tuple(casts) if any(casts) else None

    def _by_name(self, tensors: tuple[Any, ...], named: dict[str, Any]) -> tuple[Any, ...]:
        """The inputs in the model's order, from ``tensors`` (the first ones) and ``named``."""
        rest = self.input_names[len(tensors) :]
        unknown = [k for k in named if k not in self.input_names]
        twice = [k for k in named if k in self.input_names[: len(tensors)]]
        missing = [k for k in rest if k not in named]
        if unknown or twice or missing:
            what = (
                f"unknown input name(s) {unknown}"
                if unknown
                else f"input(s) {twice} given both by position and by name"
                if twice
                else f"missing input(s) {missing}"
            )
            raise InputError(f"{what}; the model's inputs are {self.input_names}")
        return (*tensors, *(named[k] for k in rest))

    def _plan(self, signature: tuple | None, tensors: tuple[Any, ...], values: list[Any]) -> tuple:
        """Validate the inputs of a call whose signature is not known yet, and choose its variant:
        (the variant, whether autograd records the call, the casts of the inputs or None)."""
        casts = self._check_inputs(tensors)
        for (tname, want), v in zip(self._value_dtypes, values):
            if isinstance(v, torch.Tensor) and v.dtype != want:
                raise InputTypeError(
                    f"{tname!r} holds {str(v.dtype).removeprefix('torch.')} values, the model computes "
                    f"in {str(want).removeprefix('torch.')}: assign values of its type (a load_state_dict "
                    f"with assign=True or a .data replaced keeps the type given)"
                )
        mask = [False] * (len(values) + len(tensors))
        if torch.is_grad_enabled():
            mask = [v.requires_grad for v in values]
            mask += [t.requires_grad and t.is_floating_point() for t in tensors]
        key = (bool(self.training), *mask)
        plan = (self._variants.get(key) or self._build_variant(key), True in mask, casts)
        if signature is not None:
            if len(self._plans) >= _MAX_PLANS:  # many input shapes: start over
                self._plans.clear()
            self._plans[signature] = plan
        return plan

    def forward(
        self, *tensors: torch.Tensor, **named: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model's outputs for its inputs, given in order (``input_names``) or by name.

        An input of another dtype than the model declares is cast under the input contract of
        every door (:func:`onnxgrad.runtime.values.feed_dtype`): floats to the model's float type
        (``torch.autocast``'s bfloat16 and float16 activations included; the gradient comes back in
        the caller's type), integers and whole-number floats to its integer type.
        """
        # The live parameters and buffers, read from the module's dicts, where getattr finds them
        # (at a 20th of getattr's cost): one replaced between calls (assignment, functional_call)
        # is the one fed.
        if named:
            tensors = self._by_name(tensors, named)
        values = []
        for params, buffers, owner, leaf, cast in self._sources:
            v = params.get(leaf)
            if v is None:
                v = buffers.get(leaf)
                if v is None:  # in neither dict: a parametrization, an attribute set by a hook
                    v = getattr(owner, leaf)
            if cast is not None:  # a float32 master weight: the model computes in its half type
                v = v.to(cast)
            values.append(v)
        # All that validation and the choice of variant depend on: a call with the signature of an
        # earlier one needs neither again (1 µs, against 4 µs for checking each time).
        sig: list[Any] = [self.training, torch.is_grad_enabled()]
        try:
            for v in values:
                sig.append((v.requires_grad, v.dtype))
            for t in tensors:
                sig.append((type(t), t.dtype, t.shape, t.requires_grad, t.is_cpu))
        except AttributeError:  # not a tensor: _plan says what is wrong
            signature, plan = None, None
        else:
            signature = tuple(sig)
            plan = self._plans.get(signature)
        variant, recorded, casts = plan or self._plan(signature, tensors, values)
        if casts is not None:
            tensors = tuple(
                t if c is None else _cast(name, t, *c) for name, t, c in zip(self.input_names, tensors, casts)
            )
        if recorded:
            apply = _OnnxFunction.apply if _transforms_active() else _apply
            outs = apply(variant, *tensors, *values)
        else:  # nothing requires grad: inference, nothing is kept for a backward
            outs = variant.infer((*tensors, *values))
        if self._stat_attrs and self.training:
            self._update_running_stats(variant, outs)
        n = len(self.output_names)
        return outs[0] if n == 1 else tuple(outs[:n])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``: the gradients of the parameters reset (``None``, or zeros with
        ``set_to_none=False``).

        A module with no submodules drops its own parameters' gradients directly: the same
        result as ``nn.Module.zero_grad`` without its walk over the module tree (a few µs a step
        on a small model, 4 µs alone and 15 µs inside a training step on a Linear(16, 16)).
        """
        if (
            not set_to_none
            or self.__dict__.get("_is_replica")
            or any(type(m) is not nn.Module for m in self._modules.values())
        ):
            super().zero_grad(set_to_none)  # other submodules, zeros, DataParallel's warning: torch's
            return
        for params, _, _, leaf, _ in self._sources:  # the module paths' parameters
            p = params.get(leaf)
            if p is not None and p.grad is not None:
                p.grad = None
        for p in self._parameters.values():  # and any the caller registered
            if p is not None and p.grad is not None:
                p.grad = None

    def _update_running_stats(self, variant: _Variant, outs: Sequence[torch.Tensor]) -> None:
        index = variant.output_index
        with torch.no_grad():
            for tname, out in self._stat_attrs:
                self._value(tname).copy_(outs[index[out]])

    # ---- export, copies, pickling ----------------------------------------------------------------
    def to_onnx(self) -> onnx.ModelProto:
        """The inference model (Dropout and BatchNormalization in inference mode) carrying the
        module's current parameter and buffer values."""
        proto = onnx.load_from_string(self._mode_bytes[False])
        masters = getattr(self, "_master_dtypes", {})
        values = {}
        for t, n in self.onnx_names.items():
            value = self._value(t).detach().cpu()
            values[n] = value.to(masters[t]) if t in masters else value  # the model's type again
        inits = [
            numpy_helper.from_array(_numpy_from_tensor(values[i.name]), i.name) if i.name in values else i
            for i in proto.graph.initializer
        ]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(inits)
        proto = untie(proto, getattr(self, "tied", []))  # tied copies back to initializers
        # an adapted model's trainable list names what trained here (the adapters and a head)
        trained = [n for t, n in self.onnx_names.items() if self._value(t).requires_grad]
        return record_trainable(proto, trained)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_variants"] = {}  # onnxruntime sessions are rebuilt on first use
        del state["_lock"]
        for name in _DERIVED:  # worked out again by _prepare
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._variants = {}  # keyed differently by older versions of this class
        self._lock = threading.Lock()
        self._prepare()

    def extra_repr(self) -> str:
        lines = [f"inputs={self.input_names}, outputs={self.output_names}"]
        for tname, oname in self.onnx_names.items():
            owner, leaf = self._owner(tname)
            kind = "parameter" if leaf in owner._parameters else "buffer"
            shape = tuple(self._value(tname).shape)
            lines.append(f"({tname}): {kind} {shape} <- ONNX {oname!r}")
        for tie in getattr(self, "tied", []):
            lines.append(f"ONNX {tie.name!r} <- {tie.how} of {tie.source!r} (tied)")
        return "\n".join(lines)
