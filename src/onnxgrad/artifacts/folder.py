"""Reading an artifacts folder as untrusted input: the rules :class:`onnxgrad.artifacts.Runner`
holds every file of a folder to (the JavaScript loader of ``js/`` follows the same rules).

* ``manifest.json``: JSON of the shape :func:`onnxgrad.artifacts.generate` writes; the entries the
  runner reads are checked (types, names, tensor specs) before anything else is opened, and its
  default learning rate passes :func:`~onnxgrad.train.optimizers.check_lr`.
* ``manifest["files"]``: each a relative path to a regular file inside the folder, no symbolic link
  (:func:`onnxgrad.model.validate.file_inside`, the rule of a model's external data).
* the three models: loaded as untrusted models (:func:`onnxgrad.model.validate.load_untrusted`: size
  limits, computed allocations, external data inside the folder); the step graph's inputs and
  outputs must be those the manifest describes.
* the state (``state.safetensors``, or the file given as ``state=``): a regular file no larger than
  the tensors the manifest declares (plus a header), holding exactly those tensors with the
  manifest's dtypes and shapes, every value finite, and an update count ``step`` in its metadata:
  decimal digits, from 0 to 2**63 - 1.

Every bad file is one typed error naming the file (and the tensor): :class:`~onnxgrad.errors.
InputError` for the manifest and the state, :class:`~onnxgrad.errors.ModelError` for a path that
leaves the folder and for a model that is not safe to run.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx

from ..errors import InputError, ModelError, PathNotFoundError
from ..model.graph import np_dtype
from ..model.validate import file_inside, load_untrusted
from ..train.optimizers import check_lr, definition
from . import tensors

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_STEP",
    "OPTIMIZER_METADATA",
    "TensorSpec",
    "check_step_model",
    "load_model",
    "nonnegative_state",
    "optimizer_of",
    "path_of",
    "read_manifest",
    "read_state",
]

FORMAT = "onnxgrad.artifacts"
FORMAT_VERSION = 1  # the manifest's "version"
OPTIMIZER_METADATA = "onnxgrad.optimizer"  # the step graph's optimizer: {"optimizer", "nonnegative"}
MANIFEST = "manifest.json"
MAX_STEP = 2**63 - 1  # the step is fed as an int64
STEP_PATTERN = r"0|[1-9][0-9]{0,18}"  # a state's step as written: decimal digits, no leading zero
_HEADER_BYTES = 1 << 24  # room for a safetensors header beyond the tensors' bytes
_KEYS = ("train_step", "eval_step", "inference", "state")
_DTYPES = {d.name: d for d in tensors.DTYPES.values()}  # what a state file can hold

TensorSpec = dict[str, Any]  # {"name": str, "dtype": str, "shape": list[int]}


def read_manifest(folder: str) -> dict[str, Any]:
    """The manifest of ``folder``, checked: :class:`InputError` naming what is wrong."""
    if not os.path.isdir(folder):
        raise PathNotFoundError(f"the artifacts folder {folder!r} does not exist")
    if not os.path.lexists(os.path.join(folder, MANIFEST)):
        raise InputError(f"{folder!r} is not an onnxgrad artifacts folder (no {MANIFEST})")
    path = file_inside(folder, MANIFEST, "the folder's manifest is")
    where = f"the manifest {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:
        raise InputError(f"cannot read {where}: {exc}") from exc
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InputError(f"{folder!r} is not an onnxgrad artifacts folder (no {FORMAT} manifest)")

    def entry(key: str, kind: type = dict) -> Any:
        value = m.get(key)
        if not isinstance(value, kind):
            raise InputError(f"{where} is corrupt: {key!r} is not a {kind.__name__}")
        return value

    if m.get("version") != FORMAT_VERSION:
        raise InputError(
            f"{where} is corrupt: its version is {m.get('version')!r}; this onnxgrad reads version "
            f"{FORMAT_VERSION}"
        )
    files = entry("files")
    for key in _KEYS:
        if not isinstance(files.get(key), str):
            raise InputError(f"{where} is corrupt: files.{key} is not a file name")
    for key, name in files.items():  # every file the folder lists lies inside it (the state: when read)
        if key != "state":
            file_inside(folder, name, f"the manifest's files.{key} is")
    for key in ("lr", "step", "loss"):
        if not isinstance(entry(key).get("name"), str):
            raise InputError(f"{where} is corrupt: {key}.name is not a string")
    default = entry("lr").get("default")
    if isinstance(default, bool) or not isinstance(default, int | float):
        raise InputError(f"{where} is corrupt: lr.default is not a number")
    check_lr(default)
    for key in ("parameters", "optimizer_state", "buffers"):
        for spec in entry(key, list):
            _spec(spec, f"{where}: {key}", concrete=True)
    for spec in entry("batch", list):
        _spec(spec, f"{where}: batch")
    for key in ("train_step", "eval_step"):
        for io in ("inputs", "outputs"):
            value = entry(key).get(io)
            if not isinstance(value, list) or (io == "outputs" and not value):
                raise InputError(f"{where} is corrupt: {key}.{io} is not a list of tensors")
            for spec in value:
                _spec(spec, f"{where}: {key}.{io}")
    feedback = entry("train_step").get("feedback")
    if not isinstance(feedback, dict) or not all(isinstance(v, str) for v in feedback.values()):
        raise InputError(f"{where} is corrupt: train_step.feedback is not a mapping of names")
    names = entry("inference").get("parameters")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InputError(f"{where} is corrupt: inference.parameters is not a list of names")
    optimizer = entry("optimizer")
    if not isinstance(optimizer.get("name"), str):
        raise InputError(f"{where} is corrupt: optimizer.name is not a string")
    try:  # the registry's validation: a known optimizer, its hyperparameters in range
        definition(optimizer["name"]).resolve({k: v for k, v in optimizer.items() if k != "name"})
    except InputError as exc:
        raise InputError(f"{where} is corrupt: optimizer: {exc}") from None
    carried = {s["name"] for k in ("parameters", "optimizer_state", "buffers") for s in m[k]}
    if set(feedback.values()) != carried:
        raise InputError(
            f"{where} is corrupt: train_step.feedback feeds {sorted(feedback.values())}, the folder "
            f"carries {sorted(carried)}"
        )
    return m


def _spec(spec: Any, where: str, *, concrete: bool = False) -> None:
    """A manifest tensor entry: a name, a dtype (one a state file holds when ``concrete``), a
    shape (of whole numbers >= 0 when ``concrete``; else dimensions may be names or null, or the
    shape unknown)."""
    ok = (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and _known_dtype(spec.get("dtype"), concrete)
    )
    shape = spec.get("shape") if ok else None
    if ok and (shape is not None or concrete):
        ok = isinstance(shape, list) and all(
            (isinstance(d, int) and not isinstance(d, bool) and d >= 0)
            or (not concrete and (d is None or isinstance(d, str)))
            for d in shape
        )
    if not ok:
        raise InputError(f"{where} is corrupt: {spec!r} is not a tensor entry (name, dtype, shape)")


def _known_dtype(name: Any, state: bool) -> bool:
    if state or not isinstance(name, str):
        return name in _DTYPES
    try:
        np.dtype(name)
    except TypeError:
        return False
    return True


def path_of(folder: str, manifest: Mapping[str, Any], key: str) -> str:
    """The path of the folder's file ``key`` (``"train_step"``, ``"state"``...), held to the rules
    of a model's external data (:class:`ModelError` otherwise)."""
    return file_inside(folder, manifest["files"][key], f"the manifest's files.{key} is")


def load_model(folder: str, manifest: Mapping[str, Any], key: str) -> onnx.ModelProto:
    """The folder's model ``key`` read as an untrusted model (:func:`load_untrusted`)."""
    return load_untrusted(path_of(folder, manifest, key))


def check_step_model(model: onnx.ModelProto, manifest: Mapping[str, Any], where: str) -> None:
    """The step graph takes and returns what the manifest says: :class:`ModelError` naming the
    first difference (a manifest copied from another folder, a step graph replaced)."""
    g = model.graph
    inputs = {i.name: i for i in g.input}
    specs = [s for k in ("parameters", "optimizer_state", "buffers") for s in manifest[k]]
    scalars = [manifest["lr"]["name"], manifest["step"]["name"]]
    expected = [*(s["name"] for s in manifest["batch"]), *scalars, *(s["name"] for s in specs)]
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in set(expected)]
    if missing or extra:
        raise ModelError(
            f"{where} does not match the manifest: inputs {missing} missing, {extra} not described (was the "
            "manifest copied from another folder?)"
        )
    for s in specs:
        t = inputs[s["name"]].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if np_dtype(t.elem_type).name != s["dtype"] or dims != list(s["shape"]):
            raise ModelError(
                f"{where} does not match the manifest: input {s['name']!r} is "
                f"{np_dtype(t.elem_type).name} {dims}, the manifest says {s['dtype']} {s['shape']}"
            )
    for s in manifest["batch"]:  # a dtype edited in the manifest: refused here, not at the first step
        dtype = np_dtype(inputs[s["name"]].type.tensor_type.elem_type).name
        if dtype != np.dtype(s["dtype"]).name:
            raise ModelError(
                f"{where} does not match the manifest: batch input {s['name']!r} is {dtype}, the manifest "
                f"says {s['dtype']}"
            )
    recorded = optimizer_of(model)
    if recorded is not None and recorded["optimizer"] != manifest["optimizer"]:
        raise ModelError(
            f"{where} does not match the manifest: the step updates with {recorded['optimizer']}, the "
            "manifest "
            f"says {manifest['optimizer']} (was the manifest copied from another folder?)"
        )
    outputs = [o.name for o in g.output]
    want = [manifest["loss"]["name"], *manifest["train_step"]["feedback"]]
    if sorted(outputs) != sorted(want) or outputs[0] != want[0]:
        raise ModelError(f"{where} does not match the manifest: outputs {outputs}, the manifest says {want}")


def optimizer_of(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The step graph's ``onnxgrad.optimizer`` metadata (``{"optimizer": the manifest's entry,
    "nonnegative": [state slots >= 0]}``), ``None`` for a graph written before it was recorded."""
    text = next((p.value for p in model.metadata_props if p.key == OPTIMIZER_METADATA), None)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, dict) and isinstance(value.get("optimizer"), dict)):
        raise ModelError(f"the step graph's {OPTIMIZER_METADATA!r} metadata is not an optimizer description")
    return value


def nonnegative_state(manifest: Mapping[str, Any]) -> list[str]:
    """The optimizer state tensors of ``manifest`` that never hold a negative value (the second
    moments of Adam and AdamW: a negative one makes its parameter NaN), from the registry."""
    slots = definition(manifest["optimizer"]["name"]).nonnegative
    return [s["name"] for s in manifest["optimizer_state"] if s.get("key") in slots]


def read_state(
    path: str, specs: list[TensorSpec], nonnegative: Iterable[str] = ()
) -> tuple[dict[str, np.ndarray], int]:
    """(tensors, step) of the state file ``path``, checked against the tensors ``specs`` the
    manifest declares (the tensors ``nonnegative`` without a negative value):
    :class:`InputError` naming the file and the tensor otherwise."""
    where = f"the state file {path!r}"
    need = sum(math.prod(s["shape"]) * _DTYPES[s["dtype"]].itemsize for s in specs)
    try:
        size = os.path.getsize(path) if os.path.isfile(path) else None
    except OSError:
        size = None
    if size is not None and size > need + _HEADER_BYTES:
        raise InputError(
            f"{where} has {size} bytes, more than the {need} bytes of the tensors the folder carries"
        )
    values, meta = tensors.load(path)
    step = meta.get("step")
    if step is None:
        raise InputError(
            f"{where} does not record its step (the updates already made: 'step' in its __metadata__), "
            "which every state onnxgrad writes holds: a state written elsewhere? Add it"
        )
    if not (isinstance(step, str) and re.fullmatch(STEP_PATTERN, step) and int(step) <= MAX_STEP):
        raise InputError(
            f"{where}: its step (the updates already made) is {step!r}, not a whole number from 0 to "
            f"2**63 - 1 in decimal digits without leading zeros"
        )
    by_name = {s["name"]: s for s in specs}
    missing = [n for n in by_name if n not in values]
    if missing:
        raise InputError(f"{where} lacks {missing}, which the folder carries")
    extra = [n for n in values if n not in by_name]
    if extra:
        raise InputError(
            f"{where} holds {extra}, which the folder does not carry (the state of another folder?)"
        )
    for name, spec in by_name.items():
        arr = values[name]
        if arr.dtype.name != spec["dtype"] or list(arr.shape) != list(spec["shape"]):
            raise InputError(
                f"{where}: tensor {name!r} is {arr.dtype.name} {list(arr.shape)}, the folder carries "
                f"{spec['dtype']} {spec['shape']}"
            )
        if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
            bad = ~np.isfinite(arr.astype(np.float32, copy=False))
            if bad.any():
                raise InputError(
                    f"{where}: tensor {name!r} holds {int(bad.sum())} non-finite values (first at index "
                    f"{np.unravel_index(int(np.argmax(bad)), arr.shape)}): a state that would poison training"
                )
        if name in set(nonnegative) and (arr < 0).any():
            raise InputError(
                f"{where}: tensor {name!r} holds {int((arr < 0).sum())} negative values, which a second "
                "moment (a mean of squares) never holds: a state that would make its parameter NaN"
            )
    return values, int(step)
