"""The model every front end trains: checked once, its training and inference variants, its graphs.

Each front end (``ForwardBackward``, ``gradients``, ``OnnxModule``, the compat classes, the
trainer, the artifacts) starts the same way: load and check the model once, switch Dropout and
BatchNormalization to training mode (running statistics fed and returned), keep the inference
twin for ``training=False``, choose the parameters and build the gradient graphs. :func:`prepare`
does it once, in :class:`PreparedModel`; the variants are made on first use::

    prepared = prepare(model)
    graphs = prepared.gradient_graphs(trainable=None)  # training mode
    inference = prepared.eval_graphs(graphs)  # the same parameters, inference mode
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any

import onnx

from ..model.graph import FLOAT_TYPES
from ..model.load import CheckedModel, load_checked
from .engine import GradientGraphs, build_gradient
from .modes import ModeSwitch, follows_training_flag, set_training_mode
from .params import Selection, select_parameters

ModelLike = CheckedModel | onnx.ModelProto | str | os.PathLike | bytes


def float_outputs(model: onnx.ModelProto) -> set[str]:
    """The outputs of ``model`` declared with a floating-point type: those that take a gradient."""
    return {o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES}


class PreparedModel:
    """A checked model with its training-mode and inference-mode variants (see the module docstring).

    ``checked``: the model as given (validated once). ``modes``: whether Dropout and
    BatchNormalization follow the training flag (:attr:`follows_training`), or run as the file
    says. ``selection``: the parameters chosen (and tied) before the modes were switched, when
    :meth:`select` made this model; ``None`` when :meth:`gradient_graphs` chooses them.
    """

    def __init__(
        self, checked: CheckedModel, *, modes: bool = True, selection: Selection | None = None
    ) -> None:
        self.checked = checked
        self.selection = selection
        self.follows_training = modes and follows_training_flag(checked.proto)
        self._switched: dict[str, ModeSwitch] = {}
        self._lock = threading.RLock()  # the variants are made once, by whichever thread asks first

    def _switch(self, key: str) -> ModeSwitch:
        """The switched copy ``key`` (``"train"``, ``"eval"``: the inference twin of the training
        copy, ``"given"``: the model as given in inference mode), made on first use."""
        with self._lock:
            if key not in self._switched:
                if key == "eval":
                    source = CheckedModel(self._switch("train").model)  # onnxgrad's own rewrite
                else:
                    source = self.checked
                self._switched[key] = set_training_mode(source, key == "train")
            return self._switched[key]

    # ---- the variants ---------------------------------------------------------------------------
    @property
    def training(self) -> CheckedModel:
        """The model in training mode: running statistics are graph inputs (fed the current values)
        and extra outputs (their updated values, :attr:`running_stats`)."""
        if not self.follows_training:
            return self.checked
        return CheckedModel(self._switch("train").model)  # onnxgrad's own rewrite of a checked model

    @property
    def inference(self) -> CheckedModel:
        """The inference twin of :attr:`training`: the same initializers and graph inputs (running
        statistics still fed), Dropout the identity, BatchNormalization on the running statistics."""
        if not self.follows_training:
            return self.checked
        return CheckedModel(self._switch("eval").model)

    @property
    def given_inference(self) -> CheckedModel:
        """The model as given switched to inference mode (no running statistic made an input)."""
        if not self.follows_training:
            return self.checked
        return CheckedModel(self._switch("given").model)

    @property
    def running_stats(self) -> dict[str, str]:
        """Running statistic -> the training output carrying its updated value (empty without modes)."""
        return dict(self._switch("train").running_stats) if self.follows_training else {}

    @property
    def buffers(self) -> list[str]:
        """Names of the running statistics: fed at each call, never trained."""
        return list(self.running_stats)

    @property
    def output_names(self) -> list[str]:
        """The outputs of the model as given (training mode adds the updated running statistics)."""
        return [o.name for o in self.checked.proto.graph.output]

    # ---- parameters and graphs ------------------------------------------------------------------
    def select(
        self,
        trainable: Iterable[str] | None = None,
        *,
        frozen: Iterable[str] = (),
        tie_weights: bool = True,
        outputs: Iterable[str] | None = None,
    ) -> PreparedModel:
        """The prepared model of the parameters chosen now, before the modes are switched: tied
        initializers are computed from their parameter in both variants (:attr:`selection`).

        ``trainable`` / ``frozen`` / ``tie_weights``: the choice every front end makes
        (:func:`~onnxgrad.autodiff.params.select_parameters`): ``trainable=None`` the default set,
        less the ``frozen`` names (freezing any copy of a tied parameter freezes the parameter);
        running statistics are never trained; with ``outputs`` (those the loss uses), parameters
        none of them depends on are left out, with a warning. :class:`InputError` for a bad name, or
        when ``frozen`` leaves nothing to train."""
        buffers = self.buffers if trainable is not None else ()  # checked against named ones only
        selection = select_parameters(
            self.checked.proto,
            trainable,
            frozen=frozen,
            tie_weights=tie_weights,
            buffers=buffers,
            outputs=outputs,
        )
        tied = CheckedModel(selection.model)  # onnxgrad's own rewrite of a checked model
        return PreparedModel(tied, modes=self.follows_training, selection=selection)

    def gradient_graphs(self, *, outputs: Iterable[str] | None = None, **options: Any) -> GradientGraphs:
        """The gradient graphs of the training variant: ``options`` are the keywords of
        ``build_gradient`` (``trainable``, ``frozen``, ``inputs_requiring_grad``, ``tie_weights``,
        ``recompute``, ``quantized``). ``outputs=None``: the floating-point outputs of the model as given (not
        the running statistics)."""
        if outputs is None and self.follows_training:
            given = float_outputs(self.checked.proto)
            outputs = [o for o in self.output_names if o in given]
        return build_gradient(self.training, outputs=outputs, **options)

    def eval_graphs(self, graphs: GradientGraphs) -> GradientGraphs:
        """The graphs of the inference variant with the parameters of ``graphs`` (training graphs
        from :meth:`gradient_graphs`); ``graphs`` itself when the model has no modes."""
        if not self.follows_training:
            return graphs
        # a core that tying made is no initializer of this model: name the copy, tied again
        made = {t.source: t.name for t in graphs.ties if t.made}
        trainable = [made.get(n, n) for n in graphs.trainable]
        return build_gradient(
            self.inference,
            trainable=trainable,
            outputs=list(graphs.grad_inputs),
            tie_weights=bool(graphs.ties),
            quantized=graphs.quantized,
        )


def prepare(model: ModelLike | PreparedModel, *, modes: bool = True) -> PreparedModel:
    """``model`` loaded and checked once (:func:`~onnxgrad.model.load.load_checked`), ready for
    every front end. ``modes``: Dropout and BatchNormalization follow the training flag (a
    training and an inference variant), or run as the file says (``False``). A
    :class:`PreparedModel` is returned as it is."""
    if isinstance(model, PreparedModel):
        return model
    return PreparedModel(load_checked(model), modes=modes)
