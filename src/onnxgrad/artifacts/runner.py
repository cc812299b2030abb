"""Training from an artifacts folder with onnxruntime alone: one session run per step.

Parameters, optimizer state and running statistics live in two sets of buffers owned by the
runner; a step reads one set and onnxruntime writes the updates straight into the other (IO
binding on both sides), then the sets swap roles. Nothing is copied to or from numpy per step but
the batch and the scalar loss.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..errors import InputError, OnnxGradRuntimeError
from ..model.graph import ValueInfo, onnx_dtype
from ..runtime.runner import make_session, session_options_for
from ..runtime.session import resolve_providers
from ..runtime.values import check_dims_agree, check_input, coerce
from ..train.data import check_indices, index_bounds, with_trailing_axis
from ..train.losses import loss_spec
from ..train.optimizers import check_lr
from ..train.schedules import LearningRate, as_schedule
from . import tensors
from .folder import (
    FORMAT,
    MAX_STEP,
    check_step_model,
    load_model,
    nonnegative_state,
    path_of,
    read_manifest,
    read_state,
)

__all__ = ["MAX_CONSECUTIVE_SKIPS", "Runner"]

MAX_CONSECUTIVE_SKIPS = 5  # non-finite losses in a row at which Runner.step raises


class Runner:
    """Train the model of an artifacts folder (written by :func:`onnxgrad.artifacts.generate`).

    ``lr``: a number or a schedule ``step -> lr`` (default: the manifest's); each value is checked
    (:func:`~onnxgrad.train.optimizers.check_lr`: finite, >= 0). ``state``: a ``.safetensors``
    file to start from instead of the folder's (e.g. written by :meth:`save_state`).
    ``threads``: onnxruntime's intra-op threads.

    The folder is read as untrusted input (:mod:`onnxgrad.artifacts.folder`): its files inside it
    and no symbolic links, its models through the checks of any model file, its state checked
    against the manifest (dtypes, shapes, finite values, ``step``).

    A step whose loss is not finite (NaN or infinite: a NaN in the batch, a divergence) is skipped:
    the parameters, optimizer state and :attr:`iterations` stay as they were, :attr:`skipped_steps`
    counts it and a :class:`UserWarning` says so. ``max_consecutive_skips`` (default
    :data:`MAX_CONSECUTIVE_SKIPS`, 5) skipped steps in a row raise
    :class:`~onnxgrad.errors.OnnxGradRuntimeError` (the state is still the last good one).

    A batch the loss counts no row of (empty, or every class label the loss's ``ignore_index``) is
    skipped too, before anything runs: :meth:`step` returns NaN (torch's loss of it), warns, and
    counts it in :attr:`skipped_steps` but not as a divergence (``consecutive_skips`` stays): an
    update on it would move the parameters by weight decay and the optimizer's moments alone.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        *,
        lr: LearningRate | None = None,
        state: str | os.PathLike | None = None,
        threads: int | None = None,
        providers: str | list | None = None,
        session_options: ort.SessionOptions | None = None,
        max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
    ) -> None:
        self.folder = os.fspath(folder)
        if isinstance(max_consecutive_skips, bool) or not (
            isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1
        ):
            raise InputError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0  # steps skipped for a non-finite loss, in all
        self.consecutive_skips = 0  # ... since the last applied update
        self.manifest: dict[str, Any] = read_manifest(self.folder)
        m = self.manifest
        train_model = load_model(self.folder, m, "train_step")
        check_step_model(train_model, m, f"the step graph {m['files']['train_step']!r}")
        carried_specs = [*m["parameters"], *m["optimizer_state"], *m["buffers"]]
        state_path = os.fspath(state) if state is not None else path_of(self.folder, m, "state")
        values, self.iterations = read_state(
            state_path, carried_specs, nonnegative_state(m)
        )  # updates made so far
        self.schedule = as_schedule(m["lr"]["default"] if lr is None else lr)
        self.lr = check_lr(self.schedule(self.iterations))
        if threads is not None and session_options is not None:
            session_options.intra_op_num_threads = threads
        self._threads, self._options = threads, session_options  # None: onnxgrad's, per model
        self._providers = resolve_providers(providers)
        self._train = self._session(train_model)
        # the loss add_loss wrote into the step (class labels to check before a step), or None
        self.loss_spec = loss_spec(self._train.get_modelmeta().custom_metadata_map)
        self._index_bounds = index_bounds(train_model)  # token ids in [0, rows), as the Trainer checks
        self._eval: ort.InferenceSession | None = None
        train = m["train_step"]
        self.feedback: dict[str, str] = dict(train["feedback"])  # output -> input
        self.carried = list(self.feedback.values())
        self.batch_specs = {s["name"]: s for s in m["batch"]}
        # every input the steps take from the caller, as declared (the batch, and what eval adds)
        specs = {s["name"]: s for s in (*m["eval_step"]["inputs"], *m["batch"])}
        self._infos = {n: _value_info(s) for n, s in specs.items()}
        self.loss_name = m["loss"]["name"]
        # two buffer sets: a step reads set k and writes set 1 - k
        self._arrays = [
            {n: np.ascontiguousarray(values[n]).copy() for n in self.carried},
            {n: np.empty_like(values[n]) for n in self.carried},
        ]
        self._values = [{n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in s.items()} for s in self._arrays]
        self._loss = np.zeros((), dtype=np.dtype(train["outputs"][0]["dtype"]))
        self._lr = np.zeros((), np.float64)
        self._step = np.zeros((), np.int64)
        self._scalars = {
            m["lr"]["name"]: ort.OrtValue.ortvalue_from_numpy(self._lr),
            m["step"]["name"]: ort.OrtValue.ortvalue_from_numpy(self._step),
        }
        loss_value = ort.OrtValue.ortvalue_from_numpy(self._loss)
        self._bindings = []
        for k in (0, 1):
            b = self._train.io_binding()
            for name, value in {**self._scalars, **self._values[k]}.items():
                b.bind_ortvalue_input(name, value)
            b.bind_ortvalue_output(self.loss_name, loss_value)
            for out, name in self.feedback.items():
                b.bind_ortvalue_output(out, self._values[1 - k][name])
            self._bindings.append(b)
        self._current = 0

    def __repr__(self) -> str:
        params = self.manifest["parameters"]
        n_values = sum(int(np.prod(p["shape"])) for p in params)
        batch = ", ".join(f"{n}: {_fmt_spec(i)}" for n, i in self._infos.items() if n in self.batch_specs)
        outputs = [s["name"] for s in self.manifest["eval_step"]["outputs"]]
        optimizer = self.manifest["optimizer"]["name"]
        return (
            f"Runner({self.folder!r}, batch=({batch}), parameters={len(params)} tensors "
            f"({n_values:,} values), optimizer={optimizer}, lr={self.lr:g}, step={self.iterations}, "
            f"outputs={outputs})"
        )

    def _session(self, model: onnx.ModelProto) -> ort.InferenceSession:
        options = self._options
        if options is None and self._threads is not None:
            options = session_options_for(model)  # the policy's options for this graph, then threads
            options.intra_op_num_threads = self._threads
        return make_session(model, self._providers, options)

    # ---- batches -------------------------------------------------------------------------------
    def _batch(self, batch: Mapping[str, Any], names: list[str]) -> dict[str, np.ndarray]:
        unknown = [k for k in batch if k not in self.batch_specs]
        if unknown:
            raise InputError(f"unknown batch input(s) {unknown}; the step takes {list(self.batch_specs)}")
        missing = [n for n in names if n not in batch]
        if missing:
            raise InputError(f"missing batch input(s) {missing}; the step takes {list(self.batch_specs)}")
        out = {}
        for name in names:
            info = self._infos[name]
            expected = np.dtype(self.batch_specs[name]["dtype"])
            given = coerce(f"batch input {name!r}", batch[name], expected)  # the one input contract
            given = with_trailing_axis(given, info)  # targets (N,) for an output (N, 1), as the Trainer
            check_input(name, expected.name, given.shape, info)
            out[name] = np.ascontiguousarray(given)
        check_dims_agree({k: a.shape for k, a in out.items()}, self._infos)
        if self.loss_spec is not None:
            self.loss_spec.check(out, "the batch")
        check_indices(out, self._index_bounds, "the batch")
        return out

    # ---- training ------------------------------------------------------------------------------
    def step(self, batch: Mapping[str, Any]) -> float:
        """One update on ``batch`` (input name -> array, the target included); returns the loss
        computed before the update."""
        arrays = self._batch(batch, list(self.batch_specs))
        if self.iterations >= MAX_STEP:  # the step is fed as an int64, and a state records it
            raise OnnxGradRuntimeError(
                f"the step count is {self.iterations}, the largest an int64 holds: no further update can be "
                "counted (save_state writes it; start a new count from a state with a smaller step)"
            )
        self.lr = check_lr(self.schedule(self.iterations))
        if self._counts_nothing(arrays):
            self.skipped_steps += 1  # not a divergence: consecutive_skips stays
            warnings.warn(
                f"the batch has no row the loss counts (empty, or every label the ignore_index) at update "
                f"{self.iterations}: the update was skipped, the parameters and optimizer state are "
                "unchanged",
                UserWarning,
                stacklevel=2,
            )
            return math.nan
        self._lr[...] = self.lr
        self._step[...] = self.iterations
        binding = self._bindings[self._current]
        for name, arr in arrays.items():
            binding.bind_cpu_input(name, arr)
        self._train.run_with_iobinding(binding)  # reads buffer set k, writes set 1 - k
        loss = float(self._loss)
        if not math.isfinite(loss):
            self._skip(loss)  # set k, the current state, stays
            return loss
        self.consecutive_skips = 0
        self._current = 1 - self._current
        self.iterations += 1
        return loss

    def _counts_nothing(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Whether the batch gives the loss no row: an input with no values (an empty batch), or
        every class label ignored (:meth:`~onnxgrad.train.losses.LossSpec.counts_nothing`); the
        JavaScript runner's rule too."""
        if any(a.size == 0 for a in arrays.values()):
            return True
        return self.loss_spec is not None and self.loss_spec.counts_nothing(arrays)

    def _skip(self, loss: float) -> None:
        """Count a step skipped for its non-finite ``loss``; raise at the limit, else warn."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        n, limit = self.consecutive_skips, self.max_consecutive_skips
        what = (
            f"the loss is {loss} at update {self.iterations}: the update was skipped, the parameters and "
            f"optimizer state are unchanged ({n} skipped in a row"
        )
        if n >= limit:
            raise OnnxGradRuntimeError(
                f"{what}, the limit max_consecutive_skips={limit}). Check the batches for NaN and "
                "infinite values, or lower the learning rate"
            )
        warnings.warn(f"{what}; {limit} in a row raise)", UserWarning, stacklevel=3)

    def evaluate(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``{"loss": float, <model output>: array, ...}`` on ``batch``, without updating."""
        if self._eval is None:
            self._eval = self._session(load_model(self.folder, self.manifest, "eval_step"))
        spec = self.manifest["eval_step"]
        carried = self._values[self._current]
        names = [s["name"] for s in spec["inputs"] if s["name"] not in carried]
        feeds = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self._batch(batch, names).items()}
        feeds.update({s["name"]: carried[s["name"]] for s in spec["inputs"] if s["name"] in carried})
        outputs = [s["name"] for s in spec["outputs"]]
        results = self._eval.run_with_ort_values(outputs, feeds)
        by_name: dict[str, Any] = {n: v.numpy() for n, v in zip(outputs, results)}
        by_name[self.loss_name] = float(by_name[self.loss_name])
        return by_name

    # ---- values --------------------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the current trainable parameters."""
        current = self._arrays[self._current]
        return {p["name"]: current[p["name"]].copy() for p in self.manifest["parameters"]}

    def set_parameters(self, values: Mapping[str, Any]) -> None:
        """Copy ``values`` (parameter name -> array) into the current trainable parameters; the
        optimizer state is kept. :class:`InputError` for a name that is not a trainable parameter or
        an array of another shape or dtype."""
        current = self._arrays[self._current]
        names = [p["name"] for p in self.manifest["parameters"]]
        for name, value in values.items():
            if name not in names:
                raise InputError(f"{name!r} is not a trainable parameter of {self.folder!r} (have {names})")
            value = np.asarray(value)
            if value.shape != current[name].shape or value.dtype != current[name].dtype:
                raise InputError(
                    f"parameter {name!r} is {current[name].dtype}{list(current[name].shape)}, "
                    f"got {value.dtype}{list(value.shape)}"
                )
            np.copyto(current[name], value)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of everything carried between steps: parameters, optimizer state, statistics."""
        return {n: a.copy() for n, a in self._arrays[self._current].items()}

    def save_state(self, path: str | os.PathLike) -> str:
        """Write the current parameters and state as a ``.safetensors`` file (the format of the
        folder's ``state.safetensors``, which the JavaScript runner also reads)."""
        meta = {"format": FORMAT, "step": str(self.iterations)}
        return tensors.save(path, self._arrays[self._current], meta)

    def to_onnx(self) -> onnx.ModelProto:
        """The inference model carrying the trained parameters and running statistics."""
        model = load_model(self.folder, self.manifest, "inference")
        current = self._arrays[self._current]
        names = list(self.manifest["inference"]["parameters"])
        g = model.graph
        g.initializer.extend(numpy_helper.from_array(current[n], n) for n in names)
        inputs = [i for i in g.input if i.name not in names]  # back to the model's own inputs
        del g.input[:]
        g.input.extend(inputs)
        return model

    def save(self, path: str | os.PathLike) -> str:
        """Write the trained inference model (``.onnx``); returns the path."""
        path = os.fspath(path)
        onnx.save(self.to_onnx(), path)
        return path


def _value_info(spec: Mapping[str, Any]) -> ValueInfo:
    """A manifest's ``{"name", "dtype", "shape"}`` entry as a :class:`ValueInfo`."""
    shape = spec["shape"]
    dims = None if shape is None else tuple(d if isinstance(d, int) and d > 0 else (d or None) for d in shape)
    return ValueInfo(spec["name"], onnx_dtype(np.dtype(spec["dtype"])), dims)


def _fmt_spec(info: ValueInfo) -> str:
    if info.shape is None:
        return "?"
    dims = ["?" if d is None else str(d) for d in info.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
