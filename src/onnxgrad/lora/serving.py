"""Serving adapters through onnxruntime: the model whose adapters are overridable inputs, and
onnxruntime's own adapter file (``.onnx_adapter``, ``onnxruntime.AdapterFormat``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..autodiff.trainable import TRAINABLE_KEY, declared_trainable
from ..deps import require_onnxruntime
from ..errors import InputError
from ..model.graph import np_dtype, to_array
from ..model.load import load_model
from .adapters import _adapter_arrays, _adapters, _as_arrays, adapter_names


# ---- onnxruntime's own adapter format --------------------------------------------------------
def serving_model(model: onnx.ModelProto | str | os.PathLike | bytes) -> onnx.ModelProto:
    """The adapted ``model`` (from :func:`add_adapters`) made to serve adapters through
    onnxruntime: every adapter (A and B) is a graph input whose default (an initializer of the same
    name) is zeros, so with no adapter active it computes the base model, and an
    ``onnxruntime.LoraAdapter`` written by :func:`save_ort_adapter` for any fine-tune of the same
    :func:`add_adapters` call (same targets, rank and alpha) overrides them per request::

        session = onnxruntime.InferenceSession(serving_model(adapted).SerializeToString())
        adapter = onnxruntime.LoraAdapter()
        adapter.Load("task1.onnx_adapter")
        options = onnxruntime.RunOptions()
        options.add_active_adapter(adapter)
        session.run(None, feeds, options)
    """
    src = load_model(model)
    _, adapters = _adapters(src)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    names = {n for ad in adapters for n in (ad.a, ad.b)}
    present = {i.name for i in out.graph.input}
    for t in out.graph.initializer:
        if t.name in names:
            zeros = np.zeros(tuple(t.dims), dtype=np_dtype(t.data_type))
            t.CopyFrom(numpy_helper.from_array(zeros, t.name))
            if t.name not in present:
                out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    out.ir_version = max(out.ir_version, 4)  # initializers as overridable inputs: IR 4 on
    return out


def save_ort_adapter(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    values: Mapping[str, Any] | None = None,
    *,
    adapter_version: int = 1,
    model_version: int = 1,
) -> None:
    """Write the adapters of ``model`` (or ``values`` for the same names, e.g.
    ``ForwardBackward.parameters``) as an onnxruntime adapter file (``.onnx_adapter``, through
    ``onnxruntime.AdapterFormat``), for the model of :func:`serving_model`.

    Such a file overrides the adapters only: other weights in ``values`` that differ from the
    model's (a classifier head trained beside the adapters), and a model whose
    ``onnxgrad.trainable`` metadata names such weights (what ``to_onnx`` writes after training a
    head beside the adapters), would be lost, and raise :class:`InputError`; serve the model
    holding them (``serving_model(with_values(model, values))``), or keep them with
    :func:`save_adapters`."""
    require_onnxruntime()
    import onnxruntime as ort

    values = _as_arrays(values)  # torch tensors too (detached)
    inits = {t.name: t for t in model.graph.initializer}
    adapters = set(adapter_names(model))
    changed = sorted(
        n
        for n, v in (values or {}).items()
        if n not in adapters and (n not in inits or not np.array_equal(np.asarray(v), to_array(inits[n])))
    )
    if changed:
        raise InputError(
            f"values hold weights that are not adapters and differ from the model's: {changed[:10]}; "
            + _ADAPTERS_ONLY
        )
    # a model from ForwardBackward/Trainer/OnnxModule.to_onnx names what trained beside the adapters
    declared = sorted(n for n in declared_trainable(model) or [] if n not in adapters and n in inits)
    if declared:
        raise InputError(
            f"the model's {TRAINABLE_KEY!r} metadata says weights that are not adapters trained: "
            f"{declared[:10]}; " + _ADAPTERS_ONLY
        )
    params = {}
    for n, arr in _adapter_arrays(model, values).items():
        want = (tuple(inits[n].dims), np_dtype(inits[n].data_type))
        if (arr.shape, arr.dtype) != want:
            raise InputError(
                f"adapter {n!r} must be {want[1]} of shape {list(want[0])}, got {arr.dtype} {list(arr.shape)}"
            )
        params[n] = ort.OrtValue.ortvalue_from_numpy(arr)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(adapter_version)
    fmt.set_model_version(model_version)
    fmt.set_parameters(params)
    fmt.export_adapter(os.path.abspath(os.fspath(path)))


_ADAPTERS_ONLY = (
    "an onnxruntime adapter file overrides only the adapters, so they would be lost: serve "
    "serving_model(lora.with_values(model, values)), or save them with lora.save_adapters"
)


def read_ort_adapter(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The parameters (name -> array) of an onnxruntime adapter file."""
    require_onnxruntime()
    import onnxruntime as ort

    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise InputError(f"no adapter file {path!r}")
    try:
        fmt = ort.AdapterFormat.read_adapter(path)
    except Exception as exc:  # onnxruntime raises RuntimeError / its own Fail
        raise InputError(f"{path!r} is not an onnxruntime adapter file: {exc}") from exc
    return {n: np.array(v.numpy()) for n, v in fmt.get_parameters().items()}
