"""Devices and execution providers: the one place where a device, as users name it, becomes the
onnxruntime providers of a session (every front end's ``providers=`` comes here: ForwardBackward,
OnnxModule, Trainer, the artifacts Runner, compat).

A device is ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"gpu"``, ``"gpu:N"`` (any case) or a
``torch.device`` (recognised by its attributes: torch is never imported here). Providers may also
be onnxruntime's own names (``"CUDAExecutionProvider"``, or ``(name, options)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnxruntime as ort

from ..errors import InputError

__all__ = ["DEVICES", "Device", "device_providers", "parse_device", "resolve_providers"]

Device = tuple[str, int]  # ("cpu" | "cuda", index)
DEVICES = "'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"  # what parse_device takes, for messages


def parse_device(device: Any, default_index: int = 0) -> Device:
    """``("cpu" | "cuda", index)`` for a device named as in the module's docstring (``None``: the
    CPU; ``"cuda"`` / ``"gpu"`` without an index: ``default_index``), else :class:`InputError`."""
    if device is None:
        return "cpu", 0
    if isinstance(device, str):
        low = device.strip().lower()
        if low == "cpu":
            return "cpu", 0
        if low in ("cuda", "gpu"):
            return "cuda", default_index
        head, _, index = low.partition(":")
        if head in ("cuda", "gpu") and index.isdigit():
            return "cuda", int(index)
        raise InputError(f"unknown device {device!r}: expected {DEVICES}")
    kind: Any = getattr(device, "type", None)
    number: Any = getattr(device, "index", -1)  # torch.device: an int, or None for "the current one"
    if isinstance(kind, str) and (number is None or isinstance(number, int)) and number != -1:
        if kind not in ("cpu", "cuda"):
            raise InputError(f"unsupported torch device {device!r}: only cpu and cuda work")
        return ("cpu", 0) if kind == "cpu" else ("cuda", default_index if number is None else number)
    raise InputError(f"unknown device {device!r}: expected {DEVICES}")


def device_providers(device: Device) -> list[Any]:
    """The onnxruntime providers of ``device`` (CUDA with the CPU as fallback), availability unchecked."""
    kind, index = device
    if kind == "cpu":
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]


def _provider_name(provider: Any) -> str | None:
    """The onnxruntime name of one entry (``"XExecutionProvider"`` or ``(name, options)``), None
    for a device."""
    name = provider[0] if isinstance(provider, tuple) and len(provider) == 2 else provider
    return name if isinstance(name, str) and name.endswith("ExecutionProvider") else None


def resolve_providers(providers: Any = None) -> list[Any]:
    """onnxruntime providers from a device (see the module's docstring), onnxruntime's own
    provider names, or a list of either; ``None`` is the CPU. Each must be available in this
    onnxruntime (:class:`InputError` otherwise, naming those that are); the CPU is appended as the
    fallback where missing."""
    if providers is None:
        return ["CPUExecutionProvider"]
    entries = (
        list(providers) if isinstance(providers, Sequence) and not isinstance(providers, str) else [providers]
    )
    out: list[Any] = []
    for p in entries:
        if _provider_name(p) is not None:
            found = [p]
        else:
            try:
                found = device_providers(parse_device(p))
            except InputError as exc:
                raise InputError(
                    f"{exc} (or one of onnxruntime's provider names, e.g. 'CUDAExecutionProvider')"
                ) from None
        for q in found:
            if q not in out:
                out.append(q)
    available = ort.get_available_providers()
    for p in out:
        name = _provider_name(p)
        if name not in available:
            raise InputError(f"execution provider {name!r} is not available (available: {available})")
    if "CPUExecutionProvider" not in [_provider_name(p) for p in out]:
        out.append("CPUExecutionProvider")
    return out
