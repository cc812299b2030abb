"""Which Functions a PythonOp node may call, and the autograd ctx of each call still awaiting a backward.

Functions: a model file names a class (``func_name``); only classes registered with
:func:`register_function`, or given by the caller (``functions=``), run. Nothing is ever imported
because a model file said so, unless the caller explicitly lists the module prefixes it trusts
(``allow_import=``).

Contexts: each training call of a PythonOp keeps what its backward needs under a fresh int64 handle
(from ``0x1000000`` up, never a memory address). The handle is released right after the backward, or
when the value holding it is dropped without one (see ``ContextRegistry.handle_value``); inference
keeps nothing. This module does not import torch.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import PythonOpError

FIRST_HANDLE = 0x1000000

_FUNCTIONS: dict[str, type] = {}
_FUNCTIONS_LOCK = threading.Lock()

Functions = Mapping[str, type] | Iterable[type] | None


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: the name onnxgrad.export writes into ``func_name``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_function_class(cls: Any) -> None:
    if not isinstance(cls, type) or not all(hasattr(cls, a) for a in ("apply", "forward", "backward")):
        raise PythonOpError(
            f"{cls!r} is not a torch.autograd.Function subclass (it needs apply, forward and backward)"
        )


def register_function(cls: type, name: str | None = None) -> type:
    """Allow PythonOp nodes naming ``name`` (default ``module.QualName`` of ``cls``) to run ``cls``.

    Returns ``cls``, so it also works as a class decorator. Registering a name again replaces it.
    """
    _check_function_class(cls)
    with _FUNCTIONS_LOCK:
        _FUNCTIONS[name or qualified_name(cls)] = cls
    return cls


def unregister_function(name_or_cls: str | type) -> None:
    """Remove a registration (by name, or every name a class is registered under)."""
    with _FUNCTIONS_LOCK:
        for key in [k for k, v in _FUNCTIONS.items() if k == name_or_cls or v is name_or_cls]:
            del _FUNCTIONS[key]


def registered_functions() -> dict[str, type]:
    """A copy of the registry: name -> class."""
    with _FUNCTIONS_LOCK:
        return dict(_FUNCTIONS)


def _as_table(functions: Functions) -> dict[str, type]:
    if functions is None:
        return {}
    if isinstance(functions, Mapping):
        table = dict(functions)
    else:
        table = {qualified_name(c): c for c in functions}
    for cls in table.values():
        _check_function_class(cls)
    return table


def resolve_function(
    name: str,
    functions: Functions = None,
    allow_import: bool | Iterable[str] = False,
    where: str = "a PythonOp node",
) -> type:
    """The class ``name`` stands for: the caller's ``functions``, then the registry.

    Older files name a class by its bare name: it matches a registered class with that
    ``__qualname__`` when exactly one does. ``allow_import`` (``True`` or module prefixes) lets
    ``module.QualName`` be imported; otherwise an unknown name raises :class:`PythonOpError` naming
    it, and nothing is imported.
    """
    tables = [_as_table(functions), registered_functions()]
    for table in tables:
        if name in table:
            return table[name]
    if "." not in name:
        matches = {id(c): c for t in tables for c in t.values() if c.__qualname__ == name}
        if len(matches) == 1:
            return next(iter(matches.values()))
        if len(matches) > 1:
            found = sorted(qualified_name(c) for c in matches.values())
            raise PythonOpError(f"{where} names {name!r}, which matches several registered classes: {found}")
    if allow_import and _import_allowed(name, allow_import):
        return _import_function(name, where)
    raise PythonOpError(
        f"{where} calls {name!r}, which is not a registered Function: register the class with "
        f"onnxgrad.register_function(cls{'' if '.' in name else f', name={name!r}'}) or pass it in "
        "functions=; nothing was imported"
    )


def _import_allowed(name: str, allow: bool | Iterable[str]) -> bool:
    if allow is True:
        return True
    prefixes = [allow] if isinstance(allow, str) else list(allow)  # type: ignore[arg-type]
    return any(name == p or name.startswith(p.rstrip(".") + ".") for p in prefixes)


def _import_function(name: str, where: str) -> type:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        _check_function_class(obj)
        return obj
    raise PythonOpError(f"{where} calls {name!r}, which cannot be imported")


class ContextRegistry:
    """The autograd state of each PythonOp call awaiting its backward, by int64 handle."""

    def __init__(self) -> None:
        self._entries: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count(FIRST_HANDLE)

    def add(self, entry: Any) -> int:
        """Keep ``entry``; returns its new handle."""
        with self._lock:
            handle = next(self._counter)
            self._entries[handle] = entry
        return handle

    def get(self, handle: int, where: str = "PythonOpGrad") -> Any:
        """The entry of ``handle``, or :class:`PythonOpError` (released, or never created)."""
        with self._lock:
            entry = self._entries.get(handle)
        if entry is None:
            if handle < FIRST_HANDLE:
                raise PythonOpError(
                    f"{where}: ctx handle {handle} was not created by a training forward "
                    "(the forward ran with training=False, training_mode=0, or no input needed a gradient)"
                )
            raise PythonOpError(
                f"{where}: ctx handle {handle:#x} is unknown or already released: a backward runs once "
                "per forward"
            )
        return entry

    def release(self, handle: int) -> None:
        """Forget ``handle`` (no error when already released)."""
        with self._lock:
            self._entries.pop(handle, None)

    def handle_value(self, handle: int) -> np.ndarray:
        """A 0-d int64 array holding ``handle`` that releases it when garbage-collected.

        Runtimes hand it on through DLPack (which keeps the array alive), so the ctx lives exactly
        as long as some value holding the handle does.
        """
        holder = np.array(handle, dtype=np.int64)
        if handle >= FIRST_HANDLE:
            weakref.finalize(holder, self.release, handle)
        return holder

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def handles(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


contexts = ContextRegistry()
