"""Session options: the one policy for the ``onnxruntime.SessionOptions`` of every session onnxgrad
makes (:func:`onnxgrad.runtime.runner.make_session` applies :func:`session_options_for`), and the
means to copy and carry them.

* Without options given, idle pool threads do not spin (:func:`default_options`).
* A model onnxruntime would run with its activations quantized, a blocked (4-bit)
  ``DequantizeLinear -> MatMul`` that it fuses into a ``MatMulNBits`` at accuracy level 4 (the
  QLoRA form of :mod:`onnxgrad.lora`), gets options under which the fused product computes in
  float, the graph onnxgrad differentiates (:func:`exact_nbits_options`). Options given without
  that setting are used as they are, with a warning. This holds for every front end
  (``ForwardBackward``, ``OnnxModule``, ``Trainer``, ``artifacts.Runner``, ``compat``...).
* Sessions over a large training state (:data:`NO_ARENA_BYTES` and more of parameters) run without
  onnxruntime's CPU memory arena (:func:`options_for_state`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import onnx
import onnxruntime as ort

__all__ = [
    "NBITS_ACCURACY_KEY",
    "NO_ARENA_BYTES",
    "SESSION_FIELDS",
    "copy_options",
    "default_options",
    "exact_nbits_options",
    "fuses_blocked_dequantize",
    "nbits_accuracy_set",
    "options_for_state",
    "options_from_state",
    "options_state",
    "session_options_for",
]


def default_options() -> ort.SessionOptions:
    """Session options onnxgrad uses unless given others: no spinning of idle pool threads."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


# onnxruntime fuses DequantizeLinear(blocked int4/int8) -> MatMul into MatMulNBits and, by default,
# runs it at accuracy level 4 (x quantized to int8 per block): not the float graph differentiated.
NBITS_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"


def fuses_blocked_dequantize(model: onnx.ModelProto) -> bool:
    """Whether onnxruntime fuses a ``DequantizeLinear -> MatMul`` of ``model`` into ``MatMulNBits``
    (and then, by default, quantizes the activations): a blocked DequantizeLinear (``block_size``
    set) of an initializer, read by a MatMul or Gemm (the main graph; what
    ``MatMulNBitsQuantizer(quant_format=QDQ)`` writes)."""
    inits = {t.name for t in model.graph.initializer}
    blocked = {
        node.output[0]
        for node in model.graph.node
        if node.op_type == "DequantizeLinear"
        and node.input[0] in inits
        and any(a.name == "block_size" and a.i > 0 for a in node.attribute)
    }
    return any(
        node.op_type in ("MatMul", "Gemm") and blocked.intersection(node.input) for node in model.graph.node
    )


def nbits_accuracy_set(options: ort.SessionOptions) -> bool:
    """Whether ``options`` set the accuracy level of the fused MatMulNBits (to any level)."""
    try:
        return bool(options.get_session_config_entry(NBITS_ACCURACY_KEY))
    except RuntimeError:  # not set
        return False


def exact_nbits_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """``options`` (or :func:`default_options`), changed in place so that the fused
    ``DequantizeLinear -> MatMul`` computes in float (accuracy level 1): the graph onnxgrad
    differentiates, instead of activations quantized to int8 per block."""
    options = default_options() if options is None else options
    options.add_session_config_entry(NBITS_ACCURACY_KEY, "1")
    return options


# SessionOptions can be neither copied nor pickled: these settings are carried field by field.
SESSION_FIELDS = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "execution_order",
    "graph_optimization_level",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "optimized_model_filepath",
    "profile_file_prefix",
    "use_deterministic_compute",
    "use_per_session_threads",
)
# the config entries a copy carries (onnxruntime cannot list those set)
_CONFIG_KEYS = (
    "session.intra_op.allow_spinning",
    "session.inter_op.allow_spinning",
    "session.set_denormal_as_zero",
    "session.use_env_allocators",
    "session.disable_prepacking",
    "session.use_device_allocator_for_initializers",
    NBITS_ACCURACY_KEY,
)


def options_state(options: ort.SessionOptions) -> dict[str, Any]:
    """The settings of ``options`` named in :data:`SESSION_FIELDS`, as a plain (picklable) dict."""
    return {f: getattr(options, f) for f in SESSION_FIELDS if hasattr(options, f)}


def options_from_state(state: Mapping[str, Any]) -> ort.SessionOptions:
    """New ``SessionOptions`` with the settings of :func:`options_state`."""
    options = ort.SessionOptions()
    for name, value in state.items():
        setattr(options, name, value)
    return options


def copy_options(options: ort.SessionOptions) -> ort.SessionOptions:
    """A copy of ``options``: its :data:`SESSION_FIELDS` and the usual config entries (custom op
    libraries, initializers and free dimension overrides added to ``options`` are not carried)."""
    copy = options_from_state(options_state(options))
    for key in _CONFIG_KEYS:
        try:
            value = options.get_session_config_entry(key)
        except RuntimeError:  # not set
            continue
        copy.add_session_config_entry(key, value)
    return copy


def session_options_for(
    model: onnx.ModelProto | str | os.PathLike, options: ort.SessionOptions | None = None
) -> ort.SessionOptions:
    """The options a session of ``model`` (a proto, or the path of a file) runs under: ``options``
    when given, else :func:`default_options`; a model onnxruntime would run with activations
    quantized (:func:`fuses_blocked_dequantize`) gets, without options, options computing the
    fused product in float (:func:`exact_nbits_options`), and with options that leave the level
    unset at an optimization level that fuses (extended or all), a :class:`UserWarning` (they are
    used as they are), once for those options and that model's weights (not per session)."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model), load_external_data=False)
    if not fuses_blocked_dequantize(model):
        return default_options() if options is None else options
    if options is None:
        return exact_nbits_options()
    fusing = int(options.graph_optimization_level) >= int(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED)
    if fusing and not nbits_accuracy_set(options) and _first_warning(options, model):
        warnings.warn(
            "the model's blocked DequantizeLinear -> MatMul is fused by onnxruntime into a MatMulNBits "
            "that quantizes the activations to int8 (accuracy level 4): the outputs and losses are not "
            "those of the float product onnxgrad differentiates (about 5e-3 relative). Pass "
            "session_options=onnxgrad.lora.session_options(your_options) to compute it in float",
            UserWarning,
            stacklevel=3,
        )
    return options


# (options, the fused weights) already warned about: a model's sessions (training, inference, a
# Trainer's evaluation) share the caller's options, and the warning says the same for each. The
# options are held so that their id stays theirs; the oldest are forgotten past 64.
_WARNED: dict[tuple[int, frozenset[str]], ort.SessionOptions] = {}


def _first_warning(options: ort.SessionOptions, model: onnx.ModelProto) -> bool:
    """Whether the accuracy-level warning is the first for ``options`` and ``model``'s blocked
    weights (the same in every variant of one model), remembering it."""
    weights = frozenset(n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input)
    key = (id(options), weights)
    if key in _WARNED:
        return False
    if len(_WARNED) >= 64:
        del _WARNED[next(iter(_WARNED))]
    _WARNED[key] = options
    return True


# onnxruntime's CPU arena keeps the largest buffers it ever gave (every gradient and update) for
# the session's life: over this much training state that doubles the memory of a step
NO_ARENA_BYTES = 1800 * 2**20


def options_for_state(options: ort.SessionOptions | None, state_bytes: int) -> ort.SessionOptions | None:
    """The options for the sessions of a training state of ``state_bytes`` bytes: from
    :data:`NO_ARENA_BYTES` on, a copy of ``options`` (or of :func:`default_options`) with the CPU
    memory arena off; below it, ``options`` as given (``None`` stays ``None``, for
    :func:`session_options_for` to decide)."""
    if state_bytes < NO_ARENA_BYTES:
        return options
    options = copy_options(options if options is not None else default_options())
    options.enable_cpu_mem_arena = False
    return options
