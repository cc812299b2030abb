"""The checkpoint file of :class:`onnxgrad.train.Trainer`: nested state (numbers, strings, lists,
dicts, numpy arrays) in one ``.npz`` file, with no pickled objects.

The state is written as JSON (the ``__meta__`` entry) in which each array is replaced by a reference
to an entry of its own; :func:`read_checkpoint` gives back the same nested state. What the state
holds (parameters, optimizer, shuffling generator, history, callbacks) is the trainer's business.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["CHECKPOINT_FORMAT", "pack", "read_checkpoint", "unpack", "write_checkpoint"]

CHECKPOINT_FORMAT = 1


def write_checkpoint(path: str | os.PathLike, state: Mapping[str, Any]) -> str:
    """Write ``state`` (with ``"format": CHECKPOINT_FORMAT`` added) to ``path``: to a temporary
    file first, then moved, so that a run killed while writing leaves the previous checkpoint."""
    arrays: dict[str, np.ndarray] = {}
    meta = json.dumps(pack({"format": CHECKPOINT_FORMAT, **state}, arrays))
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.savez(f, __meta__=np.array(meta), **arrays)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state :func:`write_checkpoint` wrote to ``path``; an :class:`InputError` when the file is
    missing, not a checkpoint, or of another format."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InputError(f"checkpoint {path!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(npz["__meta__"].item())
            arrays = {k: npz[k] for k in npz.files if k != "__meta__"}
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{path!r} is not an onnxgrad checkpoint: {exc}") from exc
    state = unpack(meta, arrays)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise InputError(f"{path!r}: unsupported checkpoint format {found!r}")
    return state


def pack(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    """``obj`` as JSON data, numpy arrays moved to ``arrays`` and replaced by references."""
    if isinstance(obj, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = obj
        return {"__array__": key}
    if isinstance(obj, Mapping):
        return {"__dict__": [[str(k), pack(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [pack(v, arrays) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def unpack(obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """The inverse of :func:`pack`."""
    if isinstance(obj, dict):
        if "__array__" in obj:
            return arrays[obj["__array__"]]
        return {k: unpack(v, arrays) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [unpack(v, arrays) for v in obj]
    return obj
