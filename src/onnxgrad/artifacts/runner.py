"""Training from an artifacts folder with onnxruntime alone: one session run per step.

Parameters, optimizer state and running statistics live in two sets of buffers owned by the
runner; a step reads one set and onnxruntime writes the updates straight into the other (IO
binding on both sides), then the sets swap roles. Nothing is copied to or from numpy per step but
the batch and the scalar loss.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..errors import InputError
from ..model.graph import ValueInfo, onnx_dtype
from ..runtime.runner import make_session, session_options_for
from ..runtime.session import resolve_providers
from ..runtime.values import check_dims_agree, check_input
from ..train.schedules import LearningRate, as_schedule
from . import tensors
from .generate import FILES, FORMAT

__all__ = ["Runner"]


class Runner:
    """Train the model of an artifacts folder (written by :func:`onnxgrad.artifacts.generate`).

    ``lr``: a number or a schedule ``step -> lr`` (default: the manifest's). ``state``: a
    ``.safetensors`` file to start from instead of the folder's (e.g. written by
    :meth:`save_state`). ``threads``: onnxruntime's intra-op threads.
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
    ) -> None:
        self.folder = os.fspath(folder)
        with open(os.path.join(self.folder, FILES["manifest"])) as f:
            self.manifest: dict[str, Any] = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise InputError(f"{self.folder!r} is not an onnxgrad artifacts folder (no {FORMAT} manifest)")
        m = self.manifest
        values, meta = tensors.load(state or os.path.join(self.folder, m["files"]["state"]))
        self.iterations = int(meta.get("step", 0))  # updates made so far
        self.schedule = as_schedule(m["lr"]["default"] if lr is None else lr)
        self.lr = float(self.schedule(self.iterations))
        if threads is not None and session_options is not None:
            session_options.intra_op_num_threads = threads
        self._threads, self._options = threads, session_options  # None: onnxgrad's, per model
        self._providers = resolve_providers(providers)
        self._train = self._session("train_step")
        self._eval: ort.InferenceSession | None = None
        train = m["train_step"]
        self.feedback: dict[str, str] = dict(train["feedback"])  # output -> input
        self.carried = list(self.feedback.values())
        missing = [n for n in self.carried if n not in values]
        if missing:
            raise InputError(f"the state file lacks {missing}")
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

    def _session(self, key: str) -> ort.InferenceSession:
        path = os.path.join(self.folder, self.manifest["files"][key])
        options = self._options
        if options is None and self._threads is not None:
            options = session_options_for(path)  # the policy's options for this graph, then threads
            options.intra_op_num_threads = self._threads
        return make_session(path, self._providers, options)

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
            given = np.asarray(batch[name])
            if not np.can_cast(given.dtype, expected, "same_kind"):
                raise InputError(
                    f"batch input {name!r} has dtype {given.dtype}, the step expects {expected} "
                    f"(shape {_fmt_spec(info)})"
                )
            check_input(name, expected.name, given.shape, info)
            out[name] = np.ascontiguousarray(given, dtype=expected)
        check_dims_agree({k: a.shape for k, a in out.items()}, self._infos)
        return out

    # ---- training ------------------------------------------------------------------------------
    def step(self, batch: Mapping[str, Any]) -> float:
        """One update on ``batch`` (input name -> array, the target included); returns the loss
        computed before the update."""
        arrays = self._batch(batch, list(self.batch_specs))
        self.lr = float(self.schedule(self.iterations))
        if not self.lr >= 0:
            raise InputError(f"lr must be >= 0, got {self.lr}")
        self._lr[...] = self.lr
        self._step[...] = self.iterations
        binding = self._bindings[self._current]
        for name, arr in arrays.items():
            binding.bind_cpu_input(name, arr)
        self._train.run_with_iobinding(binding)
        self._current = 1 - self._current
        self.iterations += 1
        return float(self._loss)

    def evaluate(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """``{"loss": float, <model output>: array, ...}`` on ``batch``, without updating."""
        if self._eval is None:
            self._eval = self._session("eval_step")
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
        model = onnx.load(os.path.join(self.folder, self.manifest["files"]["inference"]))
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
