"""How large a model may say its tensors are: :class:`Limits` and the defaults the machine sets.

Size limits default to 16 GiB per tensor (at most the machine's memory) and the machine's memory
for all stored tensors together; the environment variables ``ONNXGRAD_MAX_TENSOR_BYTES`` and
``ONNXGRAD_MAX_TOTAL_BYTES`` override them (see ``SECURITY.md``). :mod:`.validate` applies them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InputError

__all__ = ["DEFAULT_MAX_TENSOR_BYTES", "Limits", "default_limits", "physical_memory"]

GiB = 1 << 30
DEFAULT_MAX_TENSOR_BYTES = 16 * GiB


@dataclass(frozen=True)
class Limits:
    """The largest sizes a model may declare.

    ``max_tensor_bytes``: any one tensor, stored (initializer, constant) or not (a declared or
    inferred value, the output of ``ConstantOfShape``, ``Expand``, ``Tile``, ``Range``...).
    ``max_total_bytes``: all the tensors the file stores, together (external data included).
    """

    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES
    max_total_bytes: int = DEFAULT_MAX_TENSOR_BYTES


def physical_memory() -> int | None:
    """The machine's memory in bytes, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def default_limits() -> Limits:
    """16 GiB per tensor and the machine's memory in all (each at most the machine's memory),
    unless ``ONNXGRAD_MAX_TENSOR_BYTES`` / ``ONNXGRAD_MAX_TOTAL_BYTES`` say otherwise."""
    memory = physical_memory()
    tensor = min(DEFAULT_MAX_TENSOR_BYTES, memory) if memory else DEFAULT_MAX_TENSOR_BYTES
    total = memory or DEFAULT_MAX_TENSOR_BYTES
    return Limits(
        max_tensor_bytes=_env_bytes("ONNXGRAD_MAX_TENSOR_BYTES", tensor),
        max_total_bytes=_env_bytes("ONNXGRAD_MAX_TOTAL_BYTES", total),
    )


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise InputError(f"environment variable {name}={text!r} is not a number of bytes") from None
    if value <= 0:
        raise InputError(f"environment variable {name}={text!r} must be a positive number of bytes")
    return value
