"""Devices as the compat interface names them: strings, ``OrtDevice``, ``OrtValue``, ``torch.device``,
and the onnxruntime providers of one."""

from __future__ import annotations

from typing import Any

from ..deps import C
from ..errors import InputError
from ..runtime.providers import Device, device_providers, resolve_providers
from ..runtime.providers import parse_device as parse_named_device

__all__ = ["Device", "parse_device", "provider_device", "resolve_device"]


def parse_device(device: Any, default_index: int = 0) -> Device:
    """``("cpu" | "cuda", index)`` for any way users name a device: what
    :func:`onnxgrad.runtime.providers.parse_device` takes (``None``, ``'cpu'``, ``'cuda'``,
    ``'cuda:1'``, ``'gpu'``, a ``torch.device``...), an ``OrtDevice`` (public or
    ``_pybind_state``) and an ``OrtValue`` (its device)."""
    if callable(getattr(device, "device_type", None)):  # OrtDevice
        kind = device.device_type()
        if kind == C.OrtDevice.cpu():
            return "cpu", 0
        if kind == C.OrtDevice.cuda():
            return "cuda", int(device.device_id())
        raise InputError(f"unsupported OrtDevice type {kind!r}: only CPU and CUDA are supported")
    if callable(getattr(device, "device_name", None)):  # OrtValue
        return parse_named_device(device.device_name(), default_index)
    return parse_named_device(device, default_index)


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
    # resolve_providers checks that the provider is available (InputError, a ValueError, otherwise)
    ort_providers = resolve_providers(device_providers(device))
    if provider_options:
        first = ort_providers[0]
        name, base = first if isinstance(first, tuple) else (first, {})
        ort_providers[0] = (name, {**base, **dict(provider_options)})
    return ort_providers, device
