"""Devices as the compat interface names them: strings, ``OrtDevice``, ``OrtValue``, ``torch.device``,
and the onnxruntime providers of one."""

from __future__ import annotations

from typing import Any

from ..deps import C
from ..errors import InputError
from ..runtime.session import resolve_providers

Device = tuple[str, int]  # ("cpu" | "cuda", index)


def parse_device(device: Any, default_index: int = 0) -> Device:
    """``("cpu" | "cuda", index)`` for any way users name a device.

    Accepted: ``None``, strings (``'cpu'``, ``'Cpu'``, ``'cuda'``, ``'cuda:1'``, ``'gpu'``,
    ``'Gpu'``), an ``OrtDevice`` (public or ``_pybind_state``), an ``OrtValue`` (its device) and a
    ``torch.device`` (recognised by its attributes, so torch is never imported).
    """
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
        raise InputError(
            f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device"
        )
    if callable(getattr(device, "device_type", None)):  # OrtDevice
        kind = device.device_type()
        if kind == C.OrtDevice.cpu():
            return "cpu", 0
        if kind == C.OrtDevice.cuda():
            return "cuda", int(device.device_id())
        raise InputError(f"unsupported OrtDevice type {kind!r}: only CPU and CUDA are supported")
    if callable(getattr(device, "device_name", None)):  # OrtValue
        return parse_device(device.device_name(), default_index)
    kind, index = getattr(device, "type", None), getattr(device, "index", -1)
    if isinstance(kind, str) and index != -1:  # torch.device
        if kind not in ("cpu", "cuda"):
            raise InputError(f"unsupported torch device {device!r}: only cpu and cuda work")
        return parse_device(kind if index is None else f"{kind}:{index}", default_index)
    raise InputError(f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N', 'gpu' or a torch.device")


def provider_device(provider: Any, device_index: int) -> Device:
    """The device one entry of ``providers`` designates (execution provider names included)."""
    if provider == "CPUExecutionProvider":
        return "cpu", 0
    if provider == "CUDAExecutionProvider":
        return "cuda", device_index
    try:
        return parse_device(provider, device_index)
    except InputError:
        raise InputError(
            f"unexpected providers {provider!r}: expected None, 'cpu', 'cuda', 'cuda:N', 'gpu', "
            "a torch.device, or a list of 'CPUExecutionProvider' / 'CUDAExecutionProvider'"
        ) from None


def resolve_device(providers: Any, provider_options: Any, device_index: int) -> tuple[list[Any], Device]:
    """onnxruntime providers and the device for the ``providers`` argument of the original."""
    if isinstance(providers, list | tuple):
        # the original took one provider per input: they must all designate the same device
        devices = {provider_device(p, device_index) for p in providers}
        if len(devices) != 1:
            raise InputError(f"providers {providers!r} must all designate one device")
        device = devices.pop()
    else:
        device = provider_device(providers, device_index)
    if isinstance(provider_options, list | tuple):  # one dict per input in the original
        provider_options = next((o for o in provider_options if o), None)
    if provider_options and "device_id" in provider_options and device[0] == "cuda":
        device = ("cuda", int(provider_options["device_id"]))
    # resolve_providers checks that the provider is available (ValueError otherwise)
    ort_providers = resolve_providers("cpu" if device[0] == "cpu" else f"cuda:{device[1]}")
    if provider_options:
        first = ort_providers[0]
        name, base = first if isinstance(first, tuple) else (first, {})
        ort_providers[0] = (name, {**base, **dict(provider_options)})
    return ort_providers, device
