"""``Module``: the training and eval steps of an artifacts folder, on stock onnxruntime."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import _get_all_tensors, load_external_data_for_model

from ....errors import InputError, OnnxGradRuntimeError
from ....model.graph import check_model, np_dtype, value_info_from_proto
from ....runtime.options import options_for_state
from ....runtime.runner import make_session
from ....runtime.session import resolve_providers
from ....runtime.values import check_dims_agree, check_input, coerce
from ....train.losses import check_labels
from ...values import owned_ortvalue
from .. import checkpoint_file, graphs
from .checkpoint_state import CheckpointState

__all__ = ["Module"]

_ACCUMULATED = "_grad.accumulation.out"  # onnxruntime-training's gradient outputs


def _load(path: str | os.PathLike, what: str) -> tuple[onnx.ModelProto, str | None]:
    """The model at ``path``, with its external data; and ``path`` when it has external data
    (its session is then made from the file: the model may not fit in one protobuf)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"no {what} at {path!r}")
    if path.endswith(".ort"):
        raise InputError(
            f"{path!r} is in the ORT format, which onnxgrad cannot read back: pass the .onnx file "
            "that generate_artifacts wrote beside it"
        )
    model = onnx.load(path, load_external_data=False)
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in _get_all_tensors(model)):
        return model, None
    try:
        load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
    except Exception as exc:  # a missing or short data file, a location outside the folder
        raise InputError(f"cannot read the external data of the {what} {path!r}: {exc}") from exc
    return model, path


def _array(value: Any) -> np.ndarray:
    if isinstance(value, ort.OrtValue):
        return value.numpy()
    return np.asarray(value)


def _check_user_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """The input contract every door checks, ``feeds`` cast in place
    (:func:`onnxgrad.runtime.values.coerce`: dtype; :func:`~onnxgrad.runtime.values.check_input`:
    rank, fixed dimensions; :func:`~onnxgrad.runtime.values.check_dims_agree`: inputs declared with
    the same symbolic dimension, the batch of the features and of the labels, agree):
    :class:`InputError` before onnxruntime runs. Without it, labels of shape (1,) for a batch of 4
    were broadcast by ``SoftmaxCrossEntropyLoss`` (the loss of row 0 only, its gradient 4 times)."""
    infos = {}
    for vi in model.graph.input:
        info = value_info_from_proto(vi)
        if vi.name in feeds and info is not None and not info.sequence and info.dtype:
            infos[vi.name] = info
            feeds[vi.name] = coerce(f"input {vi.name!r}", feeds[vi.name], np_dtype(info.dtype))
            check_input(vi.name, feeds[vi.name].dtype.name, feeds[vi.name].shape, info)
    check_dims_agree({n: feeds[n].shape for n in infos}, infos)


def _nominal_message(what: str) -> str:
    """onnxruntime-training's error for ``what`` on a nominal checkpoint state."""
    return f"{what}. Please load the model parameters first."


class Module:
    """Runs the training model (forward, loss, backward) and the eval model of a folder.

    Calling the module in training mode returns the loss output(s) and adds the gradients to
    ``state.parameters[name].grad``: they accumulate over calls until :meth:`lazy_reset_grad`,
    after which the next call overwrites them (the optimizer's step does not reset them). In eval
    mode the call runs the eval model. Folders of onnxruntime-training 1.19.2 work too: their
    training model holds ``com.microsoft`` training kernels that stock onnxruntime lacks, so the
    steps are rebuilt from ``eval_model.onnx`` and the checkpoint (``eval_model_uri`` is then
    needed).
    """

    training: bool

    def __init__(
        self,
        train_model_uri: str | os.PathLike,
        state: CheckpointState,
        eval_model_uri: str | os.PathLike | None = None,
        device: str = "cpu",
        session_options: ort.SessionOptions | None = None,
    ) -> None:
        if not isinstance(state, CheckpointState):
            raise InputError(f"Module takes a CheckpointState, got {type(state).__name__}")
        self.training = True
        self._state = state
        self._providers = resolve_providers("cpu" if device.startswith("cpu") else device)
        values = state._values()
        nbytes = sum(v.nbytes for v in values.values())
        self._big = nbytes >= checkpoint_file.EXTERNAL_DATA_THRESHOLD
        self._options = options_for_state(session_options, nbytes)  # the policy: no arena when large
        train, train_path = _load(train_model_uri, "training model")
        self._eval_file, self._eval_path = (
            (None, None) if eval_model_uri is None else _load(eval_model_uri, "eval model")
        )
        meta = graphs.read_meta(train)
        if meta is not None:  # written by onnxgrad: plain ONNX, run as it is
            self._graph = graphs.TrainingGraph(train, **meta)
            self._check_state()
        else:
            self._graph = self._rebuild(train)
            train_path = None
        source = train_path if train_path is not None else self._graph.model  # big: from its file
        self._session = make_session(source, self._providers, self._options, label="training model")
        self._eval_session: ort.InferenceSession | None = None
        self._eval_graph: onnx.ModelProto | None = None
        self._reset = True
        # gradients exist from the start, as zeros, like onnxruntime-training's buffers
        values = state._values()
        for name in self._graph.grads:
            state._grads.setdefault(name, np.zeros_like(values[name]))

    # ---- building ------------------------------------------------------------------------------
    def _check_state(self) -> None:
        values = self._state._values()
        missing = [p for p in self._graph.parameters if p not in values]
        if missing:
            raise InputError(f"the checkpoint lacks the parameters {missing} of the training model")
        untrained = [p for p in self._graph.grads if p not in self._state._data.trainable]
        if untrained:
            raise InputError(f"the training model trains {untrained}, which the checkpoint holds as frozen")

    def _loss_model(self) -> onnx.ModelProto:
        if self._eval_file is None:
            raise InputError(
                "this training model comes from onnxruntime-training and holds com.microsoft training "
                "kernels that stock onnxruntime lacks; pass eval_model_uri so that onnxgrad rebuilds the "
                "steps from it"
            )
        return graphs.loss_model_from_eval(self._eval_file, self._state._values())

    def _rebuild(self, train: onnx.ModelProto) -> graphs.TrainingGraph:
        """The steps of an onnxruntime-training folder, from its eval model and checkpoint."""
        d = self._state._data
        inputs = [i.name for i in train.graph.input]
        outputs = [o.name for o in train.graph.output if not o.name.endswith(_ACCUMULATED)]
        loss_model = self._loss_model()
        by_name = {i.name: i for i in loss_model.graph.initializer}
        # the parameters in the training model's input order, then any other the eval model reads
        order = [n for n in inputs if n in by_name and (n in d.trainable or n in d.frozen)]
        order += [n for n in (*d.trainable, *d.frozen) if n in by_name and n not in order]
        trainable = [n for n in order if n in d.trainable]
        frozen = [n for n in order if n in d.frozen]
        rest = [i for i in loss_model.graph.initializer if i.name not in set(order)]
        del loss_model.graph.initializer[:]
        loss_model.graph.initializer.extend([*(by_name[n] for n in order), *rest])
        known = {o.name for o in loss_model.graph.output}
        missing = [o for o in outputs if o not in known]
        if missing:
            raise InputError(f"the eval model lacks the outputs {missing} of the training model")
        return graphs.training_graph(loss_model, trainable, frozen, outputs)

    def _eval_model(self) -> onnx.ModelProto:
        if self._eval_graph is None:
            if self._eval_file is None:
                raise InputError("this Module has no eval model: pass eval_model_uri to run in eval mode")
            if graphs.read_meta(self._eval_file) is not None:
                self._eval_graph = self._eval_file
            else:
                self._eval_graph = graphs.eval_graph(
                    self._loss_model(), list(self._state._values()), self._graph.loss_outputs
                )
        return self._eval_graph

    # ---- steps ---------------------------------------------------------------------------------
    def _feeds(self, model: onnx.ModelProto, user_inputs: tuple) -> dict[str, np.ndarray]:
        """The parameters and ``user_inputs`` by input name of ``model``; an input with an
        initializer keeps that value (it is no user input)."""
        params = self._state._values()
        defaults = {i.name for i in model.graph.initializer}
        model_inputs = [i.name for i in model.graph.input]
        users = [n for n in model_inputs if n not in params and n not in defaults]
        if len(user_inputs) != len(users):
            raise InputError(f"the model takes {len(users)} input(s) {users}, got {len(user_inputs)}")
        feeds = {n: _array(v) for n, v in zip(users, user_inputs)}
        _check_user_inputs(model, feeds)
        for name, spec in self._graph.labels.items():  # onnxruntime: -1 is class C - 1, C a raw error
            if name in feeds:
                check_labels(feeds[name], spec["classes"], spec["ignore_index"], name=f"input {name!r}")
        feeds.update({n: params[n] for n in model_inputs if n in params})
        return feeds

    def __call__(self, *user_inputs: Any) -> Any:
        """Training mode: forward, loss and backward, the gradients accumulated; eval mode: the
        eval model. Returns the loss output(s): one value, or a tuple of them; numpy arrays when
        any input is one, ``OrtValue`` s when every input is an ``OrtValue`` (1.19.2's rule).
        Raises :class:`~onnxgrad.errors.OnnxGradRuntimeError` on a nominal checkpoint state until
        :meth:`copy_buffer_to_parameters` fills it."""
        step = "TrainStep" if self.training else "EvalStep"
        self._state._check_loaded(_nominal_message(f"Cannot perform {step} with a nominal state"))
        outputs = self._step(user_inputs)
        if not any(isinstance(v, np.ndarray) for v in user_inputs) and all(
            isinstance(v, ort.OrtValue) for v in user_inputs
        ):
            outputs = [owned_ortvalue(np.asarray(o)) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _step(self, user_inputs: tuple) -> list[np.ndarray]:
        if self.training:
            g = self._graph
            wanted = [*g.loss_outputs, *g.grads.values(), *g.stats.values()]
            results = self._session.run(wanted, self._feeds(g.model, user_inputs))
            n_loss, n_grads = len(g.loss_outputs), len(g.grads)
            grads = self._state._grads
            for name, value in zip(g.grads, results[n_loss : n_loss + n_grads]):
                if self._reset or name not in grads:
                    grads[name] = np.array(value, copy=True)
                else:
                    grads[name] += value
            self._reset = False
            for stat, value in zip(g.stats, results[n_loss + n_grads :]):
                self._state._set(stat, value)
            outputs = results[:n_loss]
        else:
            model = self._eval_model()
            if self._eval_session is None:
                source = self._eval_path if model is self._eval_file and self._eval_path else model
                self._eval_session = make_session(source, self._providers, self._options, label="eval model")
            outputs = self._eval_session.run(None, self._feeds(model, user_inputs))
        return list(outputs)

    def train(self, mode: bool = True) -> Module:
        """Training mode (``mode=True``) or eval mode; returns ``self``."""
        self.training = bool(mode)
        return self

    def eval(self) -> Module:
        """Eval mode; returns ``self``."""
        return self.train(False)

    def lazy_reset_grad(self) -> None:
        """The next training call overwrites the gradients instead of adding to them."""
        self._reset = True

    # ---- parameters as one buffer ----------------------------------------------------------------
    def _buffer_names(self, trainable_only: bool) -> list[str]:
        trainable = self._state._data.trainable
        return [p for p in self._graph.parameters if not trainable_only or p in trainable]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        """The number of elements of the (trainable) parameters."""
        values = self._state._values()
        return int(sum(values[n].size for n in self._buffer_names(trainable_only)))

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ort.OrtValue:
        """The (trainable) parameters flattened into one float32 buffer, in the training model's
        input order."""
        self._state._check_loaded(_nominal_message("Cannot copy parameters from a nominal checkpoint state"))
        values = self._state._values()
        names = self._buffer_names(trainable_only)
        flat = [values[n].astype(np.float32).ravel() for n in names]
        buffer = np.concatenate(flat) if flat else np.zeros(0, np.float32)
        return owned_ortvalue(buffer)  # a view of a temporary would read freed memory

    def copy_buffer_to_parameters(self, buffer: Any, trainable_only: bool = True) -> None:
        """Write a buffer laid out as :meth:`get_contiguous_parameters` back into the parameters
        (this completes a nominal checkpoint: every parameter, ``trainable_only=False``)."""
        d = self._state._data
        if d.nominal and trainable_only:
            raise OnnxGradRuntimeError(
                "For nominal checkpoint state, all parameters need to be loaded into the model "
                "(trainable_only = false)."
            )
        flat = _array(buffer).ravel()
        names = self._buffer_names(trainable_only)
        size = self.get_parameters_size(trainable_only)
        if flat.size != size:
            raise InputError(f"the buffer has {flat.size} elements, the parameters {size}")
        values, offset = self._state._values(), 0
        for name in names:
            n = values[name].size
            self._state._set(name, flat[offset : offset + n].reshape(values[name].shape))
            offset += n
        d.nominal = False

    # ---- names and export ----------------------------------------------------------------------
    def input_names(self) -> list[str]:
        """The user inputs of the current mode's model (parameters excluded)."""
        if self.training:
            return list(self._graph.user_inputs)
        params, model = self._state._values(), self._eval_model()
        defaults = {i.name for i in model.graph.initializer}
        return [i.name for i in model.graph.input if i.name not in params and i.name not in defaults]

    def output_names(self) -> list[str]:
        """The outputs the current mode's call returns."""
        if self.training:
            return list(self._graph.loss_outputs)
        return [o.name for o in self._eval_model().graph.output]

    def export_model_for_inferencing(
        self, inference_model_uri: str | os.PathLike, graph_output_names: list[str]
    ) -> None:
        """Write the model computing ``graph_output_names`` (any values of the model) in inference
        mode, with the current parameters as initializers."""
        if not graph_output_names or isinstance(graph_output_names, str):
            raise InputError("graph_output_names must be a non-empty list of value names")
        twice = sorted({n for n in graph_output_names if list(graph_output_names).count(n) > 1})
        if twice:
            raise InputError(
                f"graph_output_names lists {twice} more than once: a model's outputs have distinct names"
            )
        self._state._check_loaded(_nominal_message("Cannot export the model with a nominal state"))
        loss_model = self._loss_model_for_export()
        model = graphs.inference_graph(loss_model, self._state._values(), list(graph_output_names))
        check_model(model)
        checkpoint_file.save_onnx(model, inference_model_uri)  # big weights: external data beside it

    def _loss_model_for_export(self) -> onnx.ModelProto:
        if self._big:  # the training model as it is: its parameters are inputs, fed by inference_graph
            return self._graph.model
        if self._eval_file is not None:
            return self._loss_model()
        # onnxgrad's own training model: its forward half, parameters fed back as initializers
        return graphs.loss_model_from_eval(self._graph.model, self._state._values())
