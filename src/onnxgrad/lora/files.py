"""Adapter files: the adapters saved apart from the base (the safetensors layout of
:mod:`onnxgrad.model.safetensors`, or ``.npz``) and put back on it."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from ..autodiff.params import declared_trainable
from ..errors import InputError
from ..model import safetensors
from ..model.graph import np_dtype, to_array
from ..model.load import load_model
from .adapters import (
    LORA_KEY,
    _adapter_arrays,
    _adapters,
    _as_arrays,
    _check_settings,
    adapter_names,
    add_adapters,
    with_values,
)


def save_adapters(
    model: onnx.ModelProto, path: str | os.PathLike, values: Mapping[str, Any] | None = None
) -> None:
    """Write the adapters of ``model`` (or ``values``, e.g. ``ForwardBackward.parameters``, or an
    ``OnnxModule``'s tensors, detached, for the same names) to ``path``: a ``.npz`` archive, else
    the safetensors layout (the adapters' settings in its ``__metadata__``).

    The other weights of ``model`` that trained beside the adapters (a classifier head given to
    ``trainable=``) are saved too, under their names, and listed in the settings (``"trained"``),
    and :func:`load_adapters` puts them back: those named in ``values``, and those the model's
    ``onnxgrad.trainable`` metadata names (``ForwardBackward.to_onnx``, ``Trainer.to_onnx`` and
    ``OnnxModule.to_onnx`` write there what trained). A name in ``values`` that is no initializer
    of ``model`` raises :class:`InputError`. A model made otherwise (``artifacts.Runner``) cannot
    say which of its weights trained: pass ``values`` then.
    """
    values = _as_arrays(values)  # torch tensors too (detached)
    adapters = set(adapter_names(model))
    inits = {t.name: t for t in model.graph.initializer}
    unknown = sorted(n for n in values if n not in inits)
    if unknown:
        raise InputError(f"values names {unknown[:10]}, which are not initializers of the model")
    for n in declared_trainable(model) or []:  # what the model says trained (ForwardBackward.to_onnx)
        if n not in adapters and n not in values and n in inits:
            values[n] = to_array(inits[n])
    trained = sorted(n for n in values if n not in adapters)
    arrays = _adapter_arrays(model, values)
    for n in trained:
        want = np_dtype(inits[n].data_type)
        arr = np.ascontiguousarray(values[n], dtype=want)
        if arr.shape != tuple(inits[n].dims):
            raise InputError(f"{n!r} has shape {list(inits[n].dims)}, got {list(arr.shape)}")
        arrays[n] = arr
    settings = dict(_adapters(model)[0])
    if trained:
        settings[_TRAINED] = trained
    meta = json.dumps(settings)
    path = os.fspath(path)
    if path.endswith(".npz"):
        np.savez(path, __lora__=np.array(meta), **arrays)
        return
    safetensors.save(path, arrays, {LORA_KEY: meta})


_TRAINED = "trained"  # the settings' list of the other weights saved beside the adapters
_LAYOUTS = ("left", "right", "right_t")  # how A and B make the update (see lora.adapters._Adapter)


def read_adapters(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The settings and the arrays of an adapter file written by :func:`save_adapters`."""
    path = os.fspath(path)
    if path.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["__lora__"]))
            return meta, {k: z[k] for k in z.files if k != "__lora__"}
    arrays, metadata = safetensors.load(path)
    try:
        meta = json.loads(metadata.get(LORA_KEY, "{}"))
    except ValueError as exc:
        raise InputError(f"{path!r} is not a safetensors file of adapters: {exc}") from exc
    return meta, arrays


def load_adapters(
    base: onnx.ModelProto | str | os.PathLike | bytes, path: str | os.PathLike
) -> onnx.ModelProto:
    """``base`` (the model without adapters) with the adapters saved in ``path`` put back: the same
    adapted model that :func:`save_adapters` saw, its adapters holding the saved values, and the
    other weights saved beside them (``"trained"``) holding theirs.

    The settings are checked against the saved arrays before anything is made (rank, ``alpha``,
    ``dropout``, the shapes of A and B), and every weight the file adapts or holds must be an
    initializer of ``base`` of the saved shape: anything else raises :class:`InputError`
    naming what is missing, never a model with some adapters left out."""
    where = repr(os.fspath(path))
    meta, arrays = read_adapters(path)
    if not isinstance(meta, dict) or not meta.get("adapters"):
        raise InputError(f"{where} holds no LoRA settings")
    saved, trained = _checked_settings(meta, arrays, where)
    src = load_model(base)
    inits = {t.name: t for t in src.graph.initializer}
    missing = [w for w in [*saved, *trained] if w not in inits]
    if missing:
        raise InputError(
            f"the base model has no weight {missing[:10]} that {where} holds adapters or values for: "
            "load the adapters on the model they were trained on"
        )
    for n in trained:
        if tuple(arrays[n].shape) != tuple(inits[n].dims):
            raise InputError(
                f"{where}: {n!r} is {list(arrays[n].shape)}, the base's is {list(inits[n].dims)}"
            )
    adapted = add_adapters(
        src, list(saved), rank=int(meta["rank"]), alpha=meta["alpha"], dropout=meta["dropout"]
    )
    _, adapters = _adapters(adapted)
    if sorted(ad.weight for ad in adapters) != sorted(saved):
        lost = sorted(set(saved) - {ad.weight for ad in adapters})
        raise InputError(f"{where}: the base model takes no adapter beside {lost}")
    values = {n: arrays[n] for n in trained}
    for ad in adapters:
        s = saved[ad.weight]
        if s["layout"] != ad.layout:
            raise InputError(
                f"{where}: the adapters of {ad.weight!r} have layout {s['layout']!r}, the base reads that "
                f"weight in layout {ad.layout!r}: load the adapters on the model they were trained on"
            )
        values[ad.a], values[ad.b] = arrays[s["a"]], arrays[s["b"]]
    return with_values(adapted, values)


def _checked_settings(
    meta: dict[str, Any], arrays: Mapping[str, np.ndarray], where: str
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The saved adapters by weight and the other trained weights of an adapter file's settings,
    checked against its arrays (so that nothing is allocated from the settings alone)."""
    lacking_keys = [k for k in ("rank", "alpha", "dropout") if k not in meta]
    if lacking_keys:
        raise InputError(f"{where} has bad LoRA settings: no {lacking_keys} key")
    try:
        _check_settings(meta["rank"], meta["alpha"], meta["dropout"])
    except InputError as exc:
        raise InputError(f"{where} has bad LoRA settings: {exc}") from exc
    if meta["alpha"] is None:
        raise InputError(f"{where} has bad LoRA settings: alpha is missing")
    rank = int(meta["rank"])
    scale = float(meta["alpha"]) / rank
    entries = meta["adapters"]
    if not isinstance(entries, list) or not all(
        isinstance(a, dict) and all(isinstance(a.get(k), str) for k in ("weight", "a", "b", "layout"))
        for a in entries
    ):
        raise InputError(f"{where}: its adapters are not a list of weight, a, b and layout entries")
    saved: dict[str, dict[str, Any]] = {}
    served: dict[str, str] = {}  # array name -> the weight whose adapter reads it
    for a in entries:
        lacking = [n for n in (a["a"], a["b"]) if n not in arrays]
        if lacking:
            raise InputError(f"{where} lacks the adapter arrays {lacking}")
        for n in (a["a"], a["b"]):
            if n in served:
                raise InputError(
                    f"{where}: the adapters of {served[n]!r} and {a['weight']!r} read the same array "
                    f"{n!r}; an array serves one adapter"
                )
            served[n] = a["weight"]
        if a["layout"] not in _LAYOUTS:
            raise InputError(
                f"{where}: the adapters of {a['weight']!r} have layout {a['layout']!r}, not one of {_LAYOUTS}"
            )
        left = a["layout"] == "left"  # A [r, in], B [out, r]; else A [in, r], B [r, out]
        shapes = (arrays[a["a"]].shape, arrays[a["b"]].shape)
        if any(len(sh) != 2 for sh in shapes) or (
            (shapes[0][0], shapes[1][1]) if left else (shapes[0][1], shapes[1][0])
        ) != (rank, rank):
            raise InputError(
                f"{where}: the adapters of {a['weight']!r} are {[list(sh) for sh in shapes]}, "
                f"not of the rank {rank} its settings say"
            )
        got = a.get("scale", scale)  # what load_adapters computes: alpha / rank
        if (
            isinstance(got, bool)
            or not isinstance(got, (int, float))
            or not math.isclose(got, scale, rel_tol=1e-6)
        ):
            raise InputError(
                f"{where}: the adapters of {a['weight']!r} have scale {got!r}, not alpha / rank = {scale!r} "
                "as its settings say"
            )
        if a["weight"] in saved:
            raise InputError(f"{where} adapts {a['weight']!r} twice")
        saved[a["weight"]] = a
    trained = meta.get(_TRAINED, [])
    if not isinstance(trained, list) or not all(isinstance(n, str) for n in trained):
        raise InputError(f"{where}: its {_TRAINED!r} is not a list of names")
    lacking = [n for n in trained if n not in arrays]
    if lacking:
        raise InputError(f"{where} lacks the arrays of the trained weights {lacking}")
    shared = sorted(set(trained) & set(served))
    if shared:
        raise InputError(f"{where}: {shared} are adapter arrays and trained weights; an array serves one")
    return saved, trained
