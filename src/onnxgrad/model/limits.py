"""How large a model may say its tensors are: :class:`Limits` and the defaults the machine sets.

Size limits default to 16 GiB per tensor (at most the machine's memory) and the machine's memory
for all stored tensors together; the environment variables ``ONNXGRAD_MAX_TENSOR_BYTES`` and
``ONNXGRAD_MAX_TOTAL_BYTES`` override them (see ``SECURITY.md``). A model holds at most
:data:`DEFAULT_MAX_SUBGRAPHS` subgraphs (If branches, Loop and Scan bodies, at any depth), or
``ONNXGRAD_MAX_SUBGRAPHS``. :mod:`.validate` applies them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import InputError

__all__ = ["DEFAULT_MAX_SUBGRAPHS", "DEFAULT_MAX_TENSOR_BYTES", "Limits", "default_limits", "physical_memory"]

GiB = 1 << 30
DEFAULT_MAX_TENSOR_BYTES = 16 * GiB
# Each subgraph costs onnx, onnxruntime and the gradient builder a copy and a session of its own:
# 2**14 of them in a 2 MB file took 116 s and 2.8 GB to load; ordinary models hold a few dozen.
DEFAULT_MAX_SUBGRAPHS = 1024


@dataclass(frozen=True)
class Limits:
    """The largest sizes a model may declare.

    ``max_tensor_bytes``: any one tensor, stored (initializer, constant) or not (a declared or
    inferred value, the output of ``ConstantOfShape``, ``Expand``, ``Tile``, ``Range``...).
    ``max_total_bytes``: all the tensors the file stores, together (external data included).
    ``max_subgraphs``: the graphs nested in the model (If branches, Loop and Scan bodies, at any
    depth, in functions and training information too).
    """

    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES
    max_total_bytes: int = DEFAULT_MAX_TENSOR_BYTES
    max_subgraphs: int = DEFAULT_MAX_SUBGRAPHS


def physical_memory() -> int | None:
    """The machine's memory in bytes, or ``None`` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def default_limits() -> Limits:
    """16 GiB per tensor and the machine's memory in all (each at most the machine's memory), and
    :data:`DEFAULT_MAX_SUBGRAPHS` subgraphs, unless ``ONNXGRAD_MAX_TENSOR_BYTES`` /
    ``ONNXGRAD_MAX_TOTAL_BYTES`` / ``ONNXGRAD_MAX_SUBGRAPHS`` say otherwise."""
    memory = physical_memory()
    tensor = min(DEFAULT_MAX_TENSOR_BYTES, memory) if memory else DEFAULT_MAX_TENSOR_BYTES
    total = memory or DEFAULT_MAX_TENSOR_BYTES
    return Limits(
        max_tensor_bytes=_env_bytes("ONNXGRAD_MAX_TENSOR_BYTES", tensor),
        max_total_bytes=_env_bytes("ONNXGRAD_MAX_TOTAL_BYTES", total),
        max_subgraphs=_env_bytes("ONNXGRAD_MAX_SUBGRAPHS", DEFAULT_MAX_SUBGRAPHS, "subgraphs"),
    )


def _env_bytes(name: str, default: int, unit: str = "bytes") -> int:
    """The positive whole number environment variable ``name`` holds, ``default`` when unset;
    :class:`InputError` when it is not one (``unit`` names what it counts, for the message)."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise InputError(f"environment variable {name}={text!r} is not a number of {unit}") from None
    if value <= 0:
        raise InputError(f"environment variable {name}={text!r} must be a positive number of {unit}")
    return value
