"""Adapter files: the adapters saved apart from the base (the safetensors layout of
:mod:`onnxgrad.model.safetensors`, or ``.npz``) and put back on it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from ..errors import InputError
from ..model import safetensors
from .adapters import LORA_KEY, _adapter_arrays, _adapters, add_adapters, with_values


def save_adapters(
    model: onnx.ModelProto, path: str | os.PathLike, values: Mapping[str, Any] | None = None
) -> None:
    """Write the adapters of ``model`` (or ``values``, e.g. ``ForwardBackward.parameters``, for the
    same names) to ``path``: a ``.npz`` archive, else the safetensors layout (the adapters' settings
    in its ``__metadata__``)."""
    arrays = _adapter_arrays(model, values)
    meta = json.dumps(_adapters(model)[0])
    path = os.fspath(path)
    if path.endswith(".npz"):
        np.savez(path, __lora__=np.array(meta), **arrays)
        return
    safetensors.save(path, arrays, {LORA_KEY: meta})


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
    adapted model that :func:`save_adapters` saw, its adapters holding the saved values."""
    meta, arrays = read_adapters(path)
    if not meta.get("adapters"):
        raise InputError(f"{os.fspath(path)!r} holds no LoRA settings")
    weights = [a["weight"] for a in meta["adapters"]]
    adapted = add_adapters(
        base, weights, rank=int(meta["rank"]), alpha=meta["alpha"], dropout=meta["dropout"]
    )
    _, adapters = _adapters(adapted)
    saved = {a["weight"]: a for a in meta["adapters"]}
    values = {}
    for ad in adapters:
        s = saved[ad.weight]
        missing = [n for n in (s["a"], s["b"]) if n not in arrays]
        if missing:
            raise InputError(f"{os.fspath(path)!r} lacks the adapter arrays {missing}")
        values[ad.a], values[ad.b] = arrays[s["a"]], arrays[s["b"]]
    return with_values(adapted, values)
