"""The optimizer blocks of onnxruntime-training 1.19.2: ``AdamW`` (Hugging Face's variant, eps
1e-6), ``SGD`` and ``ClipGradNorm``, with its defaults.

Pass ``AdamW(...)`` or ``SGD()`` to ``generate_artifacts(optimizer=...)``, or call one on
``TrainingBlock.parameters()`` inside ``with onnxblock.empty_base() as accessor:``: as in 1.19.2,
the optimizer model is then written into ``accessor.model``, and the call returns the name of its
updated-flag output (``to_model_proto()`` returns the same update with one tensor per input, the
file ``generate_artifacts`` writes, which onnxruntime-web and -node run too). The model takes
``learning_rate`` (float32 [1]), for AdamW ``step`` (int64 [1], 1 for the first update), and the
sequences ``params``, ``gradients`` and for AdamW ``first_order_moments`` and
``second_order_moments``; onnxgrad's runs on stock onnxruntime (sequence ops, no training
kernels) and, where 1.19.2 updates its inputs in place, returns ``updated_params`` and
``updated_first_order_moments`` / ``updated_second_order_moments``
(:func:`onnxgrad.compat.training.graphs.optimizer_graph`). The formulas are the optimizer
registry's onnxruntime-training family (:mod:`onnxgrad.train.optimizers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto

from ....errors import InputError
from ....model.graph import ir_version_for
from ....train.losses import _Emitter
from ....train.optimizers import ORT, definition
from .. import graphs
from . import _accessor

__all__ = ["SGD", "AdamW", "ClipGradNorm"]


@dataclass
class ClipGradNorm:
    """Clip the gradients by their global L2 norm before the update: every gradient is scaled by
    ``min(1, max_norm / (‖g‖ + 1e-6))``, ``‖g‖`` the norm of all of them together (1.19.2's
    ``InplaceClipGradNorm``, the rule of ``torch.nn.utils.clip_grad_norm_``). Give it to an
    optimizer block, ``AdamW(clip_grad=ClipGradNorm(1.0))``, or call it on the name of a float32
    tensor sequence inside a base: it returns the name of the clipped sequence."""

    max_norm: float

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_norm, bool)
            or not isinstance(self.max_norm, int | float)
            or not self.max_norm > 0
        ):
            raise InputError(f"ClipGradNorm(max_norm) takes a number > 0, got {self.max_norm!r}")
        self.max_norm = float(self.max_norm)

    def __call__(self, gradients_name: str) -> str:
        """Append the clipping of the sequence ``gradients_name`` to the enclosing base's model."""
        model = _accessor.current().model
        _require_opset(model, 17)
        e = _Emitter(model.graph, 17, TensorProto.FLOAT, "clip_grad_norm")
        return graphs.clip_sequence(e, gradients_name, self.max_norm)


def _check_clip(clip_grad: object, owner: str) -> None:
    if clip_grad is not None and not isinstance(clip_grad, ClipGradNorm):
        raise InputError(
            f"{owner}(clip_grad=...) takes an onnxblock.optim.ClipGradNorm, got {type(clip_grad).__name__}"
        )


class _OptimizerBlock:
    kind = ""
    clip_grad: ClipGradNorm | None = None
    _model: onnx.ModelProto | None = None

    @property
    def attributes(self) -> dict:
        return {}

    def __call__(self, parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]]) -> str:
        """Write the optimizer model of the trainable parameters of ``parameters`` into the
        model of the enclosing ``with onnxblock.empty_base()``; returns its updated-flag output."""
        accessor = _accessor.current()  # inside a base, as onnxruntime-training requires
        trainable, _ = parameters
        specs = {t.name: (t.data_type, list(t.dims)) for t in trainable}
        max_norm = None if self.clip_grad is None else self.clip_grad.max_norm
        _write_into(
            accessor.model,
            graphs.optimizer_graph(self.kind, self.attributes, specs, max_norm, sequences=True),
        )
        self._model = graphs.optimizer_graph(self.kind, self.attributes, specs, max_norm)
        return graphs.FLAGS[self.kind]

    def to_model_proto(self) -> onnx.ModelProto:
        """The optimizer model built by the call, with one tensor per input (what
        ``generate_artifacts`` writes as ``optimizer_model.onnx``: onnxruntime-web and -node,
        which take no sequences, run it too). ``accessor.model`` holds the same update in
        1.19.2's layout, on sequences."""
        if self._model is None:
            raise InputError("Please build the optimizer model first before trying to retrieve it.")
        return self._model


def _write_into(model: onnx.ModelProto, built: onnx.ModelProto) -> None:
    """Append the graph of ``built`` to ``model`` (an empty base gets exactly ``built``)."""
    g = model.graph
    names = {o.name for o in built.graph.output}
    taken = {v.name for v in (*g.input, *g.output, *g.initializer)} | {o for n in g.node for o in n.output}
    clash = sorted(
        taken & ({v.name for v in built.graph.input} | {o for n in built.graph.node for o in n.output})
    )
    if clash:
        raise InputError(
            f"the base model already has values named {clash[:5]}: build the optimizer on empty_base()"
        )
    if not len(g.node):  # an empty base: named as 1.19.2 names it
        g.name = "AdamW Optimizer Model" if graphs.FLAGS[graphs.ADAMW] in names else "SGD Optimizer Model"
    g.input.extend(built.graph.input)
    g.node.extend(built.graph.node)
    g.output.extend(built.graph.output)
    g.initializer.extend(built.graph.initializer)
    _require_opset(model, 17)
    model.ir_version = max(model.ir_version, built.ir_version)
    del model.metadata_props[:]
    model.metadata_props.extend(built.metadata_props)


def _require_opset(model: onnx.ModelProto, version: int) -> None:
    """Raise the default-domain opset of ``model`` to ``version`` at least (what the update and
    clipping ops need; an empty base has onnx's current opset already)."""
    if {o.domain: o.version for o in model.opset_import}.get("", 0) < version:
        kept = [o for o in model.opset_import if o.domain not in ("", "ai.onnx")]
        del model.opset_import[:]
        model.opset_import.extend([onnx.helper.make_opsetid("", version), *kept])
        model.ir_version = max(model.ir_version, ir_version_for(model.opset_import))


_KERNEL = definition(graphs.ADAMW, ORT).defaults  # the registry's AdamWOptimizer: its defaults
ONNXBLOCK_EPS = 1e-6
"""onnxblock's ``AdamW(eps=)`` default (Hugging Face's), where the ``AdamWOptimizer`` kernel's
attribute defaults to the registry's 1e-8: the one default of this API that the registry does not hold."""


@dataclass
class AdamW(_OptimizerBlock):
    """AdamW as onnxruntime-training runs it (``adam_mode=1``): the bias corrections folded into
    the step size, ``eps`` added outside the square root, weight decay applied after the step.
    ``clip_grad``: a :class:`ClipGradNorm`, applied to the gradients first."""

    bias_correction: bool = True
    betas: tuple[float, float] = (_KERNEL["alpha"], _KERNEL["beta"])
    eps: float = ONNXBLOCK_EPS
    weight_decay: float = _KERNEL["weight_decay"]
    clip_grad: ClipGradNorm | None = None
    kind = graphs.ADAMW

    def __post_init__(self) -> None:
        _check_clip(self.clip_grad, "AdamW")
        definition(self.kind, ORT).resolve(self.attributes)  # the registry validates them

    @property
    def attributes(self) -> dict:
        """The attributes of onnxruntime-training's ``AdamWOptimizer`` node."""
        return {
            "alpha": float(self.betas[0]),
            "beta": float(self.betas[1]),
            "epsilon": float(self.eps),
            "weight_decay": float(self.weight_decay),
            "correct_bias": int(bool(self.bias_correction)),
            "adam_mode": 1,
        }


@dataclass
class SGD(_OptimizerBlock):
    """Plain SGD: ``p -= lr * grad``. ``clip_grad``: a :class:`ClipGradNorm`, applied first."""

    clip_grad: ClipGradNorm | None = None
    kind = graphs.SGD

    def __post_init__(self) -> None:
        _check_clip(self.clip_grad, "SGD")
